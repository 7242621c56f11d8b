"""Score rows: the bulk insert of one scoring batch, and superseding rows that a re-score replaces."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, insert, literal, select
from sqlalchemy.orm import Session

from pipeline.registry.models import Score, ScoreHistory, dump_json, sqlite_timestamp, utcnow

# What insert_scores sends on SQLite: the driver's own executemany, JSON serialised once per row here.
SQLITE_SCORE_INSERT = (
    "INSERT INTO scores (experience_id, contract_version_id, scorer, value, verified, specialist, details, "
    "created_at) VALUES (?,?,?,?,?,?,?,?)"
)


@dataclass(frozen=True, slots=True)
class ScoreRow:
    """One scorer's value (or the ``total``) for one trace under one contract version."""

    experience_id: int
    contract_version_id: int
    scorer: str
    value: float | None
    details: dict[str, Any]
    verified: bool = False
    specialist: str | None = None


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
                (
                    r.experience_id,
                    r.contract_version_id,
                    r.scorer,
                    r.value,
                    r.verified,
                    r.specialist,
                    dump_json(r.details),
                    stamp,
                )
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
                    "verified": r.verified,
                    "specialist": r.specialist,
                    "details": r.details,
                    "created_at": created,
                }
                for r in rows
            ],
        )
    return len(rows)


def supersede_scores(
    *, session: Session, experience_ids: Sequence[int], contract_version_id: int, reason: str
) -> int:
    """Move the traces' score rows under one contract version to ``score_history`` (with ``reason``) so a
    re-score can replace them; return how many rows moved."""
    if not experience_ids:
        return 0
    where = (Score.contract_version_id == contract_version_id) & Score.experience_id.in_(list(experience_ids))
    columns = ("experience_id", "contract_version_id", "scorer", "value", "verified", "specialist", "details")
    moved = session.execute(
        insert(ScoreHistory).from_select(
            [*columns, "created_at", "superseded_at", "reason"],
            select(
                *(getattr(Score, c) for c in columns),
                Score.created_at,
                literal(utcnow(), ScoreHistory.superseded_at.type),
                literal(reason, ScoreHistory.reason.type),
            ).where(where),
        )
    ).rowcount
    session.execute(delete(Score).where(where))
    return moved
