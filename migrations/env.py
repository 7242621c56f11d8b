"""Alembic environment: the registry's models are the target; the URL comes from the config or Settings."""

from __future__ import annotations

from alembic import context

from pipeline.registry.db import make_engine
from pipeline.registry.models import Base, JSONText, UTCDateTime

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if url:
        return url
    from pipeline.settings import get_settings

    return get_settings().registry_url


def render_item(type_, obj, autogen_context):
    """Render our TypeDecorators as the plain types they store, so migrations never import the models."""
    if type_ == "type" and isinstance(obj, JSONText):
        return "sa.Text()"
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def run_migrations_offline() -> None:
    context.configure(
        url=_url(),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
        render_item=render_item,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connectable = config.attributes.get("connection")
    if connectable is not None:
        _run(connectable)
        return
    engine = make_engine(_url())
    with engine.connect() as connection:
        _run(connection)
    engine.dispose()


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        render_item=render_item,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
