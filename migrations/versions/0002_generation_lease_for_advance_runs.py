"""generation lease for advance runs

A running `ratchet advance` holds a lease on the candidate it builds, so a second run on the same
lineage waits or exits with a clear message instead of building the same candidate twice.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 10:55:27.609968
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ADD COLUMN on both backends (no SQLite table rebuild, so the partial indexes stay as they are).
    op.add_column("generations", sa.Column("lease_owner", sa.String(length=200), nullable=True))
    op.add_column("generations", sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    # Native DROP COLUMN (SQLite >= 3.35, PostgreSQL): a batch rebuild would lose the partial indexes' WHERE.
    op.execute("ALTER TABLE generations DROP COLUMN lease_expires_at")
    op.execute("ALTER TABLE generations DROP COLUMN lease_owner")
