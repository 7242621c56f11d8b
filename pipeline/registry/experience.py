"""Experience rows: bulk insert (idempotent by content hash), quarantine, feedback."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Column, Integer, MetaData, String, Table, Text, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from pipeline.errors import NotFoundError, RatchetError
from pipeline.experience.principals import OPERATOR
from pipeline.registry.models import Experience, Quarantine, UTCDateTime, sqlite_timestamp, utcnow
from pipeline.registry.versions import audit

# The experience table seen as plain text columns: bulk ingest passes JSON it has already serialised, and
# the dashboard's list pages filter and parse the JSON text themselves, so SQLAlchemy does no per-value work
# beyond what the driver does.
RAW_EXPERIENCE = _raw = Table(
    "experience",
    MetaData(),
    Column("id", Integer, primary_key=True),
    Column("content_hash", String(64)),
    Column("completion_id", String(100)),
    Column("messages", Text),
    Column("metadata", Text),
    Column("feedback", Text),
    Column("routes", Text),
    Column("specialist", String(100)),
    Column("source", String(32)),
    Column("principal", String(100)),
    Column("generation_id", Integer),
    Column("harness_version_id", Integer),
    Column("created_at", UTCDateTime),
    Column("conversation_id", String(100)),
    Column("tools", Text),
    Column("served_tokens", Text),
)

# The exact statement bulk ingest sends on SQLite (bench/ingest.py times the same one bare).
SQLITE_INSERT = (
    "INSERT INTO experience (content_hash, completion_id, messages, metadata, feedback, routes, specialist, "
    "source, principal, generation_id, harness_version_id, created_at, conversation_id, tools, served_tokens) "
    "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?) "
    "ON CONFLICT (content_hash) DO NOTHING"
)

SOURCES = ("deployment", "simulation", "import", "evaluation")


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One trace ready for insertion: JSON fields already serialised (canonical, sorted keys)."""

    content_hash: str
    messages: str
    metadata: str
    feedback: str | None
    routes: str
    specialist: str | None
    source: str
    generation_id: int | None = None
    harness_version_id: int | None = None
    completion_id: str | None = None
    principal: str | None = None  # who sent it (``pipeline.experience.principals``)
    conversation_id: str | None = None  # links the turns of one conversation (at most 100 characters)
    tools: str | None = None  # JSON: the client's ``tools`` list offered on the turn (OpenAI chat shape)
    served_tokens: str | None = None  # JSON: ``ServedTokens`` by the index of the assistant message served


def sqlite_params(rows: Sequence[TraceRow], created: datetime) -> list[tuple[Any, ...]]:
    """The parameter tuples ``SQLITE_INSERT`` takes for ``rows``."""
    stamp = sqlite_timestamp(created)
    return [
        (
            r.content_hash,
            r.completion_id,
            r.messages,
            r.metadata,
            r.feedback,
            r.routes,
            r.specialist,
            r.source,
            r.principal,
            r.generation_id,
            r.harness_version_id,
            stamp,
            r.conversation_id,
            r.tools,
            r.served_tokens,
        )
        for r in rows
    ]


def _insert_ignoring_duplicates(session: Session):
    dialect = session.get_bind().dialect.name
    if dialect == "sqlite":
        return sqlite.insert(_raw).on_conflict_do_nothing(index_elements=["content_hash"])
    if dialect == "postgresql":
        return postgresql.insert(_raw).on_conflict_do_nothing(index_elements=["content_hash"])
    raise RatchetError(f"unsupported database dialect {dialect!r}: use SQLite or PostgreSQL")


def insert_traces(*, session: Session, rows: Sequence[TraceRow], now: datetime | None = None) -> int:
    """Insert traces, skipping any whose content hash is already stored. Returns how many were new."""
    if not rows:
        return 0
    created = now or utcnow()
    if session.get_bind().dialect.name == "sqlite":
        # Through the driver directly, inside the session's transaction: no per-value work in Python.
        # sqlite3's executemany reports the rows really inserted (conflicts excluded).
        cursor = session.connection().exec_driver_sql(SQLITE_INSERT, sqlite_params(rows, created))
        return max(cursor.rowcount, 0)
    params = [
        {
            "content_hash": r.content_hash,
            "completion_id": r.completion_id,
            "messages": r.messages,
            "metadata": r.metadata,
            "feedback": r.feedback,
            "routes": r.routes,
            "specialist": r.specialist,
            "source": r.source,
            "principal": r.principal,
            "generation_id": r.generation_id,
            "harness_version_id": r.harness_version_id,
            "created_at": created,
            "conversation_id": r.conversation_id,
            "tools": r.tools,
            "served_tokens": r.served_tokens,
        }
        for r in rows
    ]
    # psycopg's batched executemany does not report inserted rows; RETURNING yields only those.
    stmt = _insert_ignoring_duplicates(session)
    return len(session.execute(stmt.returning(_raw.c.id), params).all())


ANY_CONTENT = -(1 << 63)  # the prefix of a line quarantined before 0009 whose content was not recoverable


def line_key(sha256_hex: str) -> int:
    """The first 64 bits of a line's sha256 as a signed integer (what ``quarantined_lines`` holds)."""
    return int(sha256_hex[:16], 16) - (1 << 63) + 1  # never ANY_CONTENT


def quarantined_lines(*, session: Session, source_file: str) -> tuple[array, array]:
    """(line numbers, content keys) of ``source_file``'s quarantined lines, ordered by line number; a key is
    ``line_key`` of the line's sha256, or ``ANY_CONTENT`` for a line quarantined before its hash was kept
    (migration 0009 recovers it where the kept text is the whole line). 16 bytes a line: a rerun of a file
    with a million bad lines holds 16 MB, not a million Python tuples."""
    stmt = (
        select(Quarantine.line_number, Quarantine.line_sha256)
        .where(Quarantine.source_file == source_file)
        .order_by(Quarantine.line_number)
    )
    numbers, keys = array("q"), array("q")
    for chunk in session.execute(stmt).partitions(10_000):
        for number, digest in chunk:
            numbers.append(number)
            keys.append(ANY_CONTENT if digest is None else line_key(digest))
    return numbers, keys


def quarantine_lines(
    *, session: Session, source_file: str, entries: Sequence[tuple[int, str, str, str | None]]
) -> None:
    """Keep malformed input: (line number, reason, raw text, sha256 of the whole line) per entry."""
    now = utcnow()
    session.add_all(
        Quarantine(
            source_file=source_file, line_number=n, reason=reason, raw=raw, line_sha256=digest, created_at=now
        )
        for n, reason, raw, digest in entries
    )
    session.flush()


def attach_feedback(
    *,
    session: Session,
    completion_id: str,
    rating: float | None = None,
    correction: str | None = None,
    principal: str = OPERATOR,
    may_rate: bool = True,
    may_correct: bool = True,
) -> tuple[Experience, dict[str, bool]]:
    """Attach a rating and/or a corrected answer from ``principal`` to the served turn with ``completion_id``.

    What the principal may make count (``may_rate``: the ``rate`` scope, ``may_correct``: ``correct``) is
    stored at the top of the trace's feedback with who gave it (``rating`` + ``rating_by``, ``correction`` +
    ``correction_by``), where the contract's scorers read it; the rest is kept under ``feedback.claimed``, shown
    and never scored. Returns the row and, per field sent, whether it counts."""
    if rating is None and correction is None:
        raise RatchetError("feedback needs a rating, a correction, or both")
    row = session.scalar(select(Experience).where(Experience.completion_id == completion_id))
    if row is None:
        raise NotFoundError(f"no served completion with id {completion_id!r}")
    feedback: dict[str, Any] = dict(row.feedback) if isinstance(row.feedback, dict) else {}
    claimed: dict[str, Any] = dict(feedback.get("claimed") or {})
    counted: dict[str, bool] = {}
    for field, value, allowed in (("rating", rating, may_rate), ("correction", correction, may_correct)):
        if value is None:
            continue
        target = feedback if allowed else claimed
        target[field], target[f"{field}_by"] = value, principal
        counted[field] = allowed
    if claimed:
        feedback["claimed"] = claimed
    row.feedback = feedback
    session.flush()
    audit(
        session=session,
        actor=principal,
        entity="experience",
        entity_id=row.id,
        action="feedback",
        details={"completion_id": completion_id, "rating": rating, "has_correction": correction is not None,
                 "counted": counted},
    )  # fmt: skip
    return row, counted


def set_served_summary(*, session: Session, completion_id: str, index: str, summary: str) -> bool:
    """Set ``metadata.summaries[index]`` of the served turn ``completion_id`` (a model-written summary that
    arrived after the turn was stored). Returns False when no such turn is stored."""
    row = session.scalar(select(Experience).where(Experience.completion_id == completion_id))
    if row is None:
        return False
    meta = dict(row.meta or {})
    meta["summaries"] = {**(meta.get("summaries") or {}), index: summary}
    row.meta = meta
    session.flush()
    return True
