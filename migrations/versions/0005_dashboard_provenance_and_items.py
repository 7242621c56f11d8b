"""dashboard: dataset provenance, held-out items, keyset indexes

``dataset_examples`` records which trace went into which training dataset; ``evaluation_items`` keeps each
held-out item of a candidate's evaluation with both pairs' answers and scores; composite indexes let the
dashboard page through experience, quarantine and the audit log newest first within a filter.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02 07:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "dataset_examples",
        sa.Column("dataset_id", sa.Integer(), nullable=False),
        sa.Column("experience_id", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["dataset_id"], ["datasets.id"], name=op.f("fk_dataset_examples_dataset_id_datasets"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["experience_id"],
            ["experience.id"],
            name=op.f("fk_dataset_examples_experience_id_experience"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("dataset_id", "experience_id", name=op.f("pk_dataset_examples")),
    )
    op.create_index(op.f("ix_dataset_examples_experience_id"), "dataset_examples", ["experience_id"])
    op.create_table(
        "evaluation_items",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("generation_id", sa.Integer(), nullable=False),
        sa.Column("specialist", sa.String(length=100), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("messages", sa.Text(), nullable=False),
        sa.Column("parent_answer", sa.Text(), nullable=True),
        sa.Column("candidate_answer", sa.Text(), nullable=True),
        sa.Column("parent_value", sa.Float(), nullable=False),
        sa.Column("candidate_value", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["generation_id"],
            ["generations.id"],
            name=op.f("fk_evaluation_items_generation_id_generations"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_evaluation_items")),
        sa.UniqueConstraint(
            "generation_id", "specialist", "position", name=op.f("uq_evaluation_items_generation_id_specialist_position")
        ),
    )
    op.create_index("ix_experience_specialist_id", "experience", ["specialist", "id"])
    op.create_index("ix_experience_source_id", "experience", ["source", "id"])
    op.create_index("ix_experience_generation_id_id", "experience", ["generation_id", "id"])
    op.create_index(
        "ix_scores_contract_scorer_experience", "scores", ["contract_version_id", "scorer", "experience_id"]
    )
    op.create_index("ix_quarantine_by_source_file", "quarantine", ["source_file", "id"])
    op.create_index("ix_audit_log_by_entity", "audit_log", ["entity", "id"])
    op.create_index("ix_audit_log_by_action", "audit_log", ["action", "id"])
    op.create_index("ix_audit_log_by_actor", "audit_log", ["actor", "id"])


def downgrade() -> None:
    op.drop_index("ix_audit_log_by_actor", table_name="audit_log")
    op.drop_index("ix_audit_log_by_action", table_name="audit_log")
    op.drop_index("ix_audit_log_by_entity", table_name="audit_log")
    op.drop_index("ix_quarantine_by_source_file", table_name="quarantine")
    op.drop_index("ix_scores_contract_scorer_experience", table_name="scores")
    op.drop_index("ix_experience_generation_id_id", table_name="experience")
    op.drop_index("ix_experience_source_id", table_name="experience")
    op.drop_index("ix_experience_specialist_id", table_name="experience")
    op.drop_table("evaluation_items")
    op.drop_index(op.f("ix_dataset_examples_experience_id"), table_name="dataset_examples")
    op.drop_table("dataset_examples")
