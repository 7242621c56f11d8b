"""Score rows: the bulk insert of one scoring batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import insert
from sqlalchemy.orm import Session

from pipeline.registry.models import Score, dump_json, sqlite_timestamp, utcnow

# What insert_scores sends on SQLite: the driver's own executemany, JSON serialised once per row here.
SQLITE_SCORE_INSERT = (
    "INSERT INTO scores (experience_id, contract_version_id, scorer, value, details, created_at) "
    "VALUES (?,?,?,?,?,?)"
)


@dataclass(frozen=True, slots=True)
class ScoreRow:
    """One scorer's value (or the ``total``) for one trace under one contract version."""

    experience_id: int
    contract_version_id: int
    scorer: str
    value: float | None
    details: dict[str, Any]


def insert_scores(*, session: Session, rows: Sequence[ScoreRow], now: datetime | None = None) -> int:
    """Insert score rows in one executemany inside the session's transaction; return how many."""
    if not rows:
        return 0
    created = now or utcnow()
    if session.get_bind().dialect.name == "sqlite":
        stamp = sqlite_timestamp(created)
        session.connection().exec_driver_sql(
            SQLITE_SCORE_INSERT,
            [
                (r.experience_id, r.contract_version_id, r.scorer, r.value, dump_json(r.details), stamp)
                for r in rows
            ],
        )
    else:
        session.execute(
            insert(Score.__table__),
            [
                {
                    "experience_id": r.experience_id,
                    "contract_version_id": r.contract_version_id,
                    "scorer": r.scorer,
                    "value": r.value,
                    "details": r.details,
                    "created_at": created,
                }
                for r in rows
            ],
        )
    return len(rows)
