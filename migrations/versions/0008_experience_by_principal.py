"""experience by principal: an index for the dashboard's principal filter

The dashboard's experience page filters by principal (who sent a trace) and pages newest first within it,
like its generation, specialist and source filters: a composite index of the principal with the id serves
that as one query on SQLite and PostgreSQL (``principal IS NULL``, served before 0007, included).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04 18:00:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_experience_principal_id", "experience", ["principal", "id"])


def downgrade() -> None:
    op.drop_index("ix_experience_principal_id", table_name="experience")
