"""Engines, sessions and migrations for the registry (SQLite by default, PostgreSQL supported)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError
from sqlalchemy.orm import Session, sessionmaker

from pipeline.errors import RatchetError

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent.parent / "migrations"
_engines: dict[str, Engine] = {}
_lock = threading.Lock()


def _sqlite_pragmas(dbapi_conn, _record) -> None:  # pragma: no cover - exercised via every SQLite test
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def make_engine(url: str) -> Engine:
    """A new engine for ``url``; SQLite gets WAL, a busy timeout and foreign keys."""
    try:
        parsed = make_url(url)
        parsed.get_dialect()
    except (ArgumentError, NoSuchModuleError):
        raise RatchetError(
            f"invalid database URL {url!r}: expected e.g. sqlite:///path.db or "
            "postgresql+psycopg://user@host/db"
        ) from None
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.drivername.startswith("sqlite"):
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(parsed, connect_args={"timeout": 30, "check_same_thread": False})
        event.listen(engine, "connect", _sqlite_pragmas)
    else:
        engine = create_engine(parsed, pool_pre_ping=True)
    return engine


def _alembic_config(url: str):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade_db(url: str, revision: str = "head") -> None:
    """Apply migrations up to ``revision`` (Alembic is the only way the schema is made)."""
    from alembic import command

    command.upgrade(_alembic_config(url), revision)


def downgrade_db(url: str, revision: str) -> None:
    """Revert migrations down to ``revision`` (``base`` removes every table)."""
    from alembic import command
    from alembic.util.exc import CommandError

    try:
        command.downgrade(_alembic_config(url), revision)
    except CommandError as exc:
        raise RatchetError(f"cannot downgrade to {revision!r}: {exc}") from None


def current_revision(url: str) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with make_engine(url).connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def get_engine(url: str | None = None, *, upgrade: bool = True) -> Engine:
    """The process-wide engine for ``url`` (default: the settings' registry), migrated to head on first use."""
    if url is None:
        from pipeline.settings import get_settings

        settings = get_settings()
        settings.ensure_home()
        url = settings.registry_url
    with _lock:
        engine = _engines.get(url)
        if engine is None:
            engine = make_engine(url)
            if upgrade:
                try:
                    upgrade_db(url)
                except Exception as exc:
                    if "OperationalError" in type(exc).__name__ or "connect" in str(exc).lower():
                        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
                        where = engine.url.render_as_string(hide_password=True)
                        raise RatchetError(f"cannot open the registry at {where}: {reason}") from None
                    raise
            _engines[url] = engine
        return engine


def dispose_engines() -> None:
    """Close every cached engine (tests, and forked worker processes)."""
    with _lock:
        for engine in _engines.values():
            engine.dispose()
        _engines.clear()


@contextmanager
def session_scope(engine: Engine | None = None) -> Iterator[Session]:
    """A session that commits on success and rolls back on error."""
    factory = sessionmaker(bind=engine or get_engine(), expire_on_commit=False)
    session = factory()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()
