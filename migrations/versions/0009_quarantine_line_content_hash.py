"""quarantine.line_sha256: a quarantined line is known by its content too

Ingest skips a bad line it has quarantined already (a rerun after a crash), and knew it by file name and line
number alone: a rotated log -- same name, new content -- had its bad lines counted and never stored. Each row
now keeps the sha256 of the whole line. Rows from before this revision get it where the kept text is the
whole line (shorter than the 4096 bytes kept, valid UTF-8, no NUL); the rest stay NULL and match any
content at their number, as before.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04 16:00:00
"""

import hashlib
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RAW_KEEP = 4096  # bytes of a bad line quarantine keeps (pipeline.experience.ingest.RAW_KEEP when this was written)


def _whole_line_sha256(raw: str) -> str | None:
    """The sha256 of the line ``raw`` was kept from, when ``raw`` is all of it, unchanged."""
    data = raw.encode("utf-8")
    if not data or len(data) >= RAW_KEEP or "\ufffd" in raw or "\\u0000" in raw:
        return None  # empty (an oversized line), maybe cut, or bytes replaced on the way in
    return hashlib.sha256(data).hexdigest()


def upgrade() -> None:
    op.add_column("quarantine", sa.Column("line_sha256", sa.String(length=64), nullable=True))
    bind = op.get_bind()
    last = 0
    while True:  # in batches: a registry may hold millions of quarantined lines
        rows = bind.execute(
            sa.text("SELECT id, raw FROM quarantine WHERE id > :last ORDER BY id LIMIT 1000"), {"last": last}
        ).all()
        if not rows:
            break
        last = rows[-1].id
        found = [{"id": r.id, "digest": d} for r in rows if (d := _whole_line_sha256(r.raw)) is not None]
        if found:
            bind.execute(sa.text("UPDATE quarantine SET line_sha256 = :digest WHERE id = :id"), found)


def downgrade() -> None:
    # Native DROP COLUMN (SQLite >= 3.35, PostgreSQL), as 0002 does.
    op.execute("ALTER TABLE quarantine DROP COLUMN line_sha256")
