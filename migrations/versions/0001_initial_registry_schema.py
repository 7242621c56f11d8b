"""initial registry schema

Revision ID: 0001
Revises:
Create Date: 2026-11-30 10:47:11.947067
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "audit_log",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor", sa.String(length=100), nullable=False),
        sa.Column("entity", sa.String(length=50), nullable=False),
        sa.Column("entity_id", sa.Integer(), nullable=True),
        sa.Column("action", sa.String(length=50), nullable=False),
        sa.Column("details", sa.Text(), nullable=False),
        sa.Column("message", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_log")),
    )
    with op.batch_alter_table("audit_log", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_audit_log_at"), ["at"], unique=False)

    op.create_table(
        "base_models",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("content_hash", sa.String(length=64), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("spec", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_base_models")),
        sa.UniqueConstraint("name", name=op.f("uq_base_models_name")),
    )
    op.create_table(
        "contract_versions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("version", sa.String(length=100), nullable=False),
        sa.Column("content_hash", sa.String(length=64), nullable=False),
        sa.Column("spec", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_contract_versions")),
        sa.UniqueConstraint("name", "version", name=op.f("uq_contract_versions_name_version")),
    )
    with op.batch_alter_table("contract_versions", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_contract_versions_content_hash"), ["content_hash"], unique=False)

    op.create_table(
        "harness_versions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("version", sa.String(length=100), nullable=False),
        sa.Column("content_hash", sa.String(length=64), nullable=False),
        sa.Column("spec", sa.Text(), nullable=False),
        sa.Column("parent_id", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["parent_id"],
            ["harness_versions.id"],
            name=op.f("fk_harness_versions_parent_id_harness_versions"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_harness_versions")),
        sa.UniqueConstraint("name", "version", name=op.f("uq_harness_versions_name_version")),
    )
    with op.batch_alter_table("harness_versions", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_harness_versions_content_hash"), ["content_hash"], unique=False)

    op.create_table(
        "quarantine",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("source_file", sa.Text(), nullable=False),
        sa.Column("line_number", sa.Integer(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("raw", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_quarantine")),
    )
    op.create_table(
        "adapters",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("specialist", sa.String(length=100), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("base_model_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("alpha", sa.Float(), nullable=False),
        sa.Column("target_modules", sa.Text(), nullable=False),
        sa.Column("artifact_uri", sa.Text(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("mlflow_run_id", sa.String(length=64), nullable=True),
        sa.Column("mlflow_model_version", sa.String(length=32), nullable=True),
        sa.Column("dataset_sha256", sa.String(length=64), nullable=True),
        sa.Column("parent_adapter_id", sa.Integer(), nullable=True),
        sa.Column("metrics", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["base_model_id"], ["base_models.id"], name=op.f("fk_adapters_base_model_id_base_models")
        ),
        sa.ForeignKeyConstraint(
            ["parent_adapter_id"], ["adapters.id"], name=op.f("fk_adapters_parent_adapter_id_adapters")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapters")),
        sa.UniqueConstraint(
            "base_model_id",
            "specialist",
            "version",
            name=op.f("uq_adapters_base_model_id_specialist_version"),
        ),
    )
    op.create_table(
        "generations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("lineage", sa.String(length=100), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("parent_id", sa.Integer(), nullable=True),
        sa.Column("base_model_id", sa.Integer(), nullable=False),
        sa.Column("harness_version_id", sa.Integer(), nullable=False),
        sa.Column("contract_version_id", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("step", sa.String(length=32), nullable=True),
        sa.Column("decision", sa.Text(), nullable=True),
        sa.Column("evaluation", sa.Text(), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["base_model_id"], ["base_models.id"], name=op.f("fk_generations_base_model_id_base_models")
        ),
        sa.ForeignKeyConstraint(
            ["contract_version_id"],
            ["contract_versions.id"],
            name=op.f("fk_generations_contract_version_id_contract_versions"),
        ),
        sa.ForeignKeyConstraint(
            ["harness_version_id"],
            ["harness_versions.id"],
            name=op.f("fk_generations_harness_version_id_harness_versions"),
        ),
        sa.ForeignKeyConstraint(
            ["parent_id"], ["generations.id"], name=op.f("fk_generations_parent_id_generations")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_generations")),
        sa.UniqueConstraint("lineage", "number", name=op.f("uq_generations_lineage_number")),
    )
    with op.batch_alter_table("generations", schema=None) as batch_op:
        batch_op.create_index(
            "uq_generations_one_champion",
            ["lineage"],
            unique=True,
            sqlite_where=sa.text("status = 'promoted'"),
            postgresql_where=sa.text("status = 'promoted'"),
        )
        batch_op.create_index(
            "uq_generations_one_in_flight",
            ["lineage"],
            unique=True,
            sqlite_where=sa.text("status IN ('candidate', 'training', 'evaluating')"),
            postgresql_where=sa.text("status IN ('candidate', 'training', 'evaluating')"),
        )

    op.create_table(
        "datasets",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("generation_id", sa.Integer(), nullable=False),
        sa.Column("specialist", sa.String(length=100), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("num_rows", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["generation_id"],
            ["generations.id"],
            name=op.f("fk_datasets_generation_id_generations"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_datasets")),
        sa.UniqueConstraint("generation_id", "specialist", name=op.f("uq_datasets_generation_id_specialist")),
    )
    op.create_table(
        "experience",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("content_hash", sa.String(length=64), nullable=False),
        sa.Column("completion_id", sa.String(length=100), nullable=True),
        sa.Column("messages", sa.Text(), nullable=False),
        sa.Column("metadata", sa.Text(), nullable=False),
        sa.Column("feedback", sa.Text(), nullable=True),
        sa.Column("routes", sa.Text(), nullable=False),
        sa.Column("specialist", sa.String(length=100), nullable=True),
        sa.Column("source", sa.String(length=32), nullable=False),
        sa.Column("generation_id", sa.Integer(), nullable=True),
        sa.Column("harness_version_id", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["generation_id"], ["generations.id"], name=op.f("fk_experience_generation_id_generations")
        ),
        sa.ForeignKeyConstraint(
            ["harness_version_id"],
            ["harness_versions.id"],
            name=op.f("fk_experience_harness_version_id_harness_versions"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_experience")),
        sa.UniqueConstraint("completion_id", name=op.f("uq_experience_completion_id")),
        sa.UniqueConstraint("content_hash", name=op.f("uq_experience_content_hash")),
    )
    with op.batch_alter_table("experience", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_experience_created_at"), ["created_at"], unique=False)
        batch_op.create_index(batch_op.f("ix_experience_generation_id"), ["generation_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_experience_source"), ["source"], unique=False)
        batch_op.create_index(batch_op.f("ix_experience_specialist"), ["specialist"], unique=False)

    op.create_table(
        "generation_adapters",
        sa.Column("generation_id", sa.Integer(), nullable=False),
        sa.Column("specialist", sa.String(length=100), nullable=False),
        sa.Column("adapter_id", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(
            ["adapter_id"], ["adapters.id"], name=op.f("fk_generation_adapters_adapter_id_adapters")
        ),
        sa.ForeignKeyConstraint(
            ["generation_id"],
            ["generations.id"],
            name=op.f("fk_generation_adapters_generation_id_generations"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("generation_id", "specialist", name=op.f("pk_generation_adapters")),
    )
    op.create_table(
        "scores",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("experience_id", sa.Integer(), nullable=False),
        sa.Column("contract_version_id", sa.Integer(), nullable=False),
        sa.Column("scorer", sa.String(length=100), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("details", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["contract_version_id"],
            ["contract_versions.id"],
            name=op.f("fk_scores_contract_version_id_contract_versions"),
        ),
        sa.ForeignKeyConstraint(
            ["experience_id"],
            ["experience.id"],
            name=op.f("fk_scores_experience_id_experience"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_scores")),
        sa.UniqueConstraint(
            "experience_id",
            "contract_version_id",
            "scorer",
            name=op.f("uq_scores_experience_id_contract_version_id_scorer"),
        ),
    )
    with op.batch_alter_table("scores", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_scores_contract_version_id"), ["contract_version_id"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("scores", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_scores_contract_version_id"))

    op.drop_table("scores")
    op.drop_table("generation_adapters")
    with op.batch_alter_table("experience", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_experience_specialist"))
        batch_op.drop_index(batch_op.f("ix_experience_source"))
        batch_op.drop_index(batch_op.f("ix_experience_generation_id"))
        batch_op.drop_index(batch_op.f("ix_experience_created_at"))

    op.drop_table("experience")
    op.drop_table("datasets")
    with op.batch_alter_table("generations", schema=None) as batch_op:
        batch_op.drop_index(
            "uq_generations_one_in_flight",
            sqlite_where=sa.text("status IN ('candidate', 'training', 'evaluating')"),
            postgresql_where=sa.text("status IN ('candidate', 'training', 'evaluating')"),
        )
        batch_op.drop_index(
            "uq_generations_one_champion",
            sqlite_where=sa.text("status = 'promoted'"),
            postgresql_where=sa.text("status = 'promoted'"),
        )

    op.drop_table("generations")
    op.drop_table("adapters")
    op.drop_table("quarantine")
    with op.batch_alter_table("harness_versions", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_harness_versions_content_hash"))

    op.drop_table("harness_versions")
    with op.batch_alter_table("contract_versions", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_contract_versions_content_hash"))

    op.drop_table("contract_versions")
    op.drop_table("base_models")
    with op.batch_alter_table("audit_log", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_audit_log_at"))

    op.drop_table("audit_log")
