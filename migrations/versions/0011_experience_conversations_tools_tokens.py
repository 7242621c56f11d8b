"""experience.conversation_id, tools, served_tokens: what a served turn was given and decoded

A client's conversation (a Responses ``previous_response_id`` chain, a conversation or session id it sent, or
one an imported trace store recorded) links its turns: ``conversation_id``, indexed with ``id`` for the
dashboard's pages of one conversation. ``tools``: the tools list the client offered on the turn (OpenAI chat
shape), which the model's prompt held. ``served_tokens``: by the index of each assistant message the server
decoded, the tokenizer's fingerprint and the exact prompt and completion token ids, so training learns the ids
the model really produced instead of a re-rendering of the message.

Rows from before this revision have none of them (NULL): nothing recorded what their client offered or which
ids were decoded, and their conversations were never linked.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05 01:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("experience", sa.Column("conversation_id", sa.String(length=100), nullable=True))
    op.add_column("experience", sa.Column("tools", sa.Text(), nullable=True))
    op.add_column("experience", sa.Column("served_tokens", sa.Text(), nullable=True))
    op.create_index("ix_experience_conversation_id_id", "experience", ["conversation_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_experience_conversation_id_id", table_name="experience")
    # Native DROP COLUMN (SQLite >= 3.35, PostgreSQL), as 0002 does.
    for column in ("served_tokens", "tools", "conversation_id"):
        op.execute(f"ALTER TABLE experience DROP COLUMN {column}")
