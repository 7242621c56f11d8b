"""stored files

Held-out suites (and later task files) that a contract names by sha256 are kept whole in the registry at
registration, content-addressed, so advance, evaluation and serving never need the original file.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02 01:50:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "stored_files",
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("sha256", name=op.f("pk_stored_files")),
    )


def downgrade() -> None:
    op.drop_table("stored_files")
