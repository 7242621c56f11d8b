"""adapters.method: how each adapter was trained (sft, dpo or grpo)

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 19:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("adapters") as batch:
        batch.add_column(sa.Column("method", sa.String(length=16), nullable=False, server_default="sft"))


def downgrade() -> None:
    with op.batch_alter_table("adapters") as batch:
        batch.drop_column("method")
