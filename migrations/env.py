"""Alembic environment: the registry's models are the target; the URL comes from the config or Settings."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Engine

from pipeline.registry.db import make_engine
from pipeline.registry.locations import HomePath
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
    if type_ == "type" and isinstance(obj, JSONText | HomePath):
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
    if isinstance(connectable, Engine):  # pytest-alembic passes its engine
        with connectable.connect() as connection:
            _run(connection)
        return
    if connectable is not None:
        _run(connectable)
        return
    engine = make_engine(_url())
    with engine.connect() as connection:
        _run(connection)
    engine.dispose()


def _run(connection) -> None:
    if connection.dialect.name == "sqlite":
        _run_sqlite(connection)
        return
    _configure(connection)
    with context.begin_transaction():
        context.run_migrations()


def _configure(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        render_item=render_item,
    )


def _run_sqlite(connection) -> None:
    """SQLite rebuilds a table to alter it (batch mode: copy, DROP, rename). With foreign keys on, dropping a
    table that others reference fails ("FOREIGN KEY constraint failed") or, worse, cascades and deletes the
    referencing rows. So: foreign keys off around the migrations (the pragma is ignored inside a transaction,
    so it is set before one begins), every step in one real transaction (pysqlite begins none for DDL: BEGIN
    is sent here), and ``PRAGMA foreign_key_check`` before the commit: a migration that left a dangling
    reference rolls back whole."""
    if connection.in_transaction():
        connection.commit()
    connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
    connection.commit()
    try:
        with connection.begin():
            connection.exec_driver_sql("BEGIN IMMEDIATE")
            _configure(connection)
            with context.begin_transaction():
                context.run_migrations()
            broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
            if broken:
                table, rowid, parent, _ = broken[0]
                raise RuntimeError(
                    f"migration left {len(broken)} row(s) referencing missing rows (first: {table} row {rowid} "
                    f"-> {parent}); rolled back"
                )
    finally:
        connection.exec_driver_sql("PRAGMA foreign_keys=ON")
        connection.commit()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
