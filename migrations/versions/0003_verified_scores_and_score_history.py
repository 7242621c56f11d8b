"""verified scores and score history

Each score row says whether it verified the turn's outcome (``verified``; NULL for rows written before
this revision, which the score step re-scores) and names the trace's specialist. Scores replaced by a
re-score (feedback that arrived later, a stale row) move to ``score_history`` with the time and the reason,
so nothing scored is lost.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 20:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("scores", sa.Column("verified", sa.Boolean(), nullable=True))
    op.add_column("scores", sa.Column("specialist", sa.String(length=100), nullable=True))
    op.create_table(
        "score_history",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("experience_id", sa.Integer(), nullable=False),
        sa.Column("contract_version_id", sa.Integer(), nullable=False),
        sa.Column("scorer", sa.String(length=100), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("verified", sa.Boolean(), nullable=True),
        sa.Column("specialist", sa.String(length=100), nullable=True),
        sa.Column("details", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("superseded_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["contract_version_id"],
            ["contract_versions.id"],
            name=op.f("fk_score_history_contract_version_id_contract_versions"),
        ),
        sa.ForeignKeyConstraint(
            ["experience_id"],
            ["experience.id"],
            name=op.f("fk_score_history_experience_id_experience"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_score_history")),
    )
    with op.batch_alter_table("score_history", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_score_history_experience_id"), ["experience_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("score_history", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_score_history_experience_id"))
    op.drop_table("score_history")
    op.execute("ALTER TABLE scores DROP COLUMN specialist")
    op.execute("ALTER TABLE scores DROP COLUMN verified")
