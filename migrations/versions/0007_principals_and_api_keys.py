"""principals and API keys: who sent each trace, and the keys ``ratchet serve`` grants scopes to

``api_keys`` holds each key's name, scopes and sha256 (never the key). ``experience.principal`` names who sent
a trace: the loop's own practice (``ratchet``: simulation and evaluation traces), the operator's ingest
(``operator``), or, for served turns, the key's name or ``anonymous``. Served turns stored before this
revision came from clients nobody vouched for: their principal stays NULL, and what the client sent beside
the conversation -- metadata the server did not write, ratings, corrections -- moves under ``claimed``, where
no scorer reads it (the score step scores every trace again under the final-turn rules anyway).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04 12:00:00
"""

import json
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# the metadata ``ratchet serve`` itself wrote on a served turn before this revision
SERVER_FIELDS = {
    "specialist", "generation", "latency_ms", "prompt_tokens", "completion_tokens", "route_reason",
    "route_method", "route_scores", "finish_reason", "model", "engine", "engine_model", "summaries", "stopped",
}  # fmt: skip


def _dump(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("key_sha256", sa.String(length=64), nullable=False),
        sa.Column("scopes", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("name", name=op.f("uq_api_keys_name")),
        sa.UniqueConstraint("key_sha256", name=op.f("uq_api_keys_key_sha256")),
    )
    op.add_column("experience", sa.Column("principal", sa.String(length=100), nullable=True))
    bind = op.get_bind()
    bind.execute(
        sa.text("UPDATE experience SET principal = 'ratchet' WHERE source IN ('simulation', 'evaluation')")
    )
    bind.execute(
        sa.text(
            "UPDATE experience SET principal = 'operator' WHERE principal IS NULL AND completion_id IS NULL"
        )
    )
    last = 0
    while True:  # served turns, in batches: the client's own fields move under `claimed`
        rows = bind.execute(
            sa.text(
                "SELECT id, metadata, feedback FROM experience WHERE completion_id IS NOT NULL AND id > :last "
                "ORDER BY id LIMIT 1000"
            ),
            {"last": last},
        ).all()
        if not rows:
            break
        last = rows[-1].id
        for row in rows:
            meta = json.loads(row.metadata) if row.metadata else {}
            feedback = json.loads(row.feedback) if row.feedback else None
            meta = meta if isinstance(meta, dict) else {}
            before = (meta, feedback)
            # what is under `claimed` already (a registry downgraded past this revision and upgraded again)
            # stays there once: upgrading twice must not nest it twice
            earlier = meta.get("claimed") if isinstance(meta.get("claimed"), dict) else {}
            claimed = {k: v for k, v in meta.items() if k not in SERVER_FIELDS and not (k == "claimed" and earlier)}
            if claimed:
                meta = {
                    **{k: v for k, v in meta.items() if k in SERVER_FIELDS},
                    "claimed": {**earlier, **claimed},
                }
            if isinstance(feedback, dict) and ("rating" in feedback or "correction" in feedback):
                feedback = {"claimed": {k: feedback[k] for k in ("rating", "correction") if k in feedback}}
            if (meta, feedback) != before:
                bind.execute(
                    sa.text("UPDATE experience SET metadata = :meta, feedback = :feedback WHERE id = :id"),
                    {
                        "meta": _dump(meta),
                        "feedback": None if feedback is None else _dump(feedback),
                        "id": row.id,
                    },
                )


def downgrade() -> None:
    with op.batch_alter_table("experience") as batch:
        batch.drop_column("principal")
    op.drop_table("api_keys")
