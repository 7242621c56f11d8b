"""suite_attempts and suite_items: the spending ledger of held-out and retention suites

Every test an evaluation makes on a suite (by the content hash of the suite's resolved items) is a row of
``suite_attempts``: which test (``improvement``, ``noninferiority:<specialist>``, ``retention:<name>``), which
generation of which lineage under which contract version, and its attempt number ``j``. ``suite_items``
holds each suite's item keys (the hash of an item's prompts as the duplicate check compares them), written
once when the suite is first spent on: ``j`` is 1 + the largest number, over the suite's items, of other
generations whose tests of the same budget used a suite holding the item, so a near-duplicate suite (one
item more, a suite added beside it, a ``group`` added) continues the count of the items it shares. The
``j``-th test is made at its rate ``* 6 / (pi**2 * j**2)``; counting per item rather than per parent is what
keeps a promotion, a manual promote, a new lineage or a contract change from resetting the error rate. A
``fresh`` suite's samples share a ``family`` (the hash of its declaration); ``sample`` is the sample's
number in it, and the improvement test on the ``e``-th sample spends ``6 / (pi**2 * e**2)`` of the rate, so
fresh samples keep the lineage-wide bound too.

No rows are backfilled: generations evaluated before this revision never recorded their suites' hashes or
items, and recomputing them would need the task generators' code as it was then. Instead the ledger counts
them at run time, conservatively: each generation of a lineage whose evaluation has a ``comparison`` but no
``suites``/``attempts`` counts as one earlier test on every suite of every test a new evaluation of that
lineage makes (``pipeline.registry.ledger.legacy_tests``; over-counting only makes the gates stricter).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04 19:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "suite_attempts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("suite_sha256", sa.String(length=64), nullable=False),
        sa.Column("test", sa.String(length=150), nullable=False),
        sa.Column("generation_id", sa.Integer(), nullable=False),
        sa.Column("lineage", sa.String(length=100), nullable=False),
        sa.Column("generation_number", sa.Integer(), nullable=False),
        sa.Column("contract_version_id", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("family", sa.String(length=64), nullable=False),
        sa.Column("sample", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["generation_id"], ["generations.id"], name=op.f("fk_suite_attempts_generation_id_generations")
        ),
        sa.ForeignKeyConstraint(
            ["contract_version_id"],
            ["contract_versions.id"],
            name=op.f("fk_suite_attempts_contract_version_id_contract_versions"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_suite_attempts")),
        sa.UniqueConstraint(
            "suite_sha256",
            "test",
            "generation_id",
            name=op.f("uq_suite_attempts_suite_sha256_test_generation_id"),
        ),
    )
    op.create_index(
        op.f("ix_suite_attempts_generation_id"), "suite_attempts", ["generation_id"], unique=False
    )
    op.create_table(
        "suite_items",
        sa.Column("suite_sha256", sa.String(length=64), nullable=False),
        sa.Column("item_key", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("suite_sha256", "item_key", name=op.f("pk_suite_items")),
    )
    op.create_index(op.f("ix_suite_items_item_key"), "suite_items", ["item_key"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_suite_items_item_key"), table_name="suite_items")
    op.drop_table("suite_items")
    op.drop_index(op.f("ix_suite_attempts_generation_id"), table_name="suite_attempts")
    op.drop_table("suite_attempts")
