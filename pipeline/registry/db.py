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
from pipeline.registry.models import Generation, utcnow
from pipeline.settings import get_settings
from pipeline.shipped import shipped_dir

log = logging.getLogger(__name__)

_engines: dict[str, Engine] = {}
_lock = threading.Lock()


# How long a SQLite writer waits for another's write lock before "database is locked" (``registry_busy``).
BUSY_TIMEOUT_S = 30.0


def _sqlite_pragmas(dbapi_conn, _record) -> None:  # pragma: no cover - exercised via every SQLite test
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
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
        engine = create_engine(parsed, connect_args={"timeout": BUSY_TIMEOUT_S, "check_same_thread": False})
        event.listen(engine, "connect", _sqlite_pragmas)
    else:
        engine = create_engine(parsed, pool_pre_ping=True)
    return engine


def _alembic_config(url: str):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(shipped_dir("migrations")))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


@contextmanager
def _migration_lock(url: str) -> Iterator[object | None]:
    """One migrating process at a time: PostgreSQL's session-level advisory lock (the migration runs on the
    connection that holds it), or an exclusive ``flock`` on ``<registry>.lock`` beside a SQLite file.
    Without it, eight processes opening a fresh registry at once all ran the first migration and six
    failed with "table already exists"."""
    parsed = make_url(url)
    if parsed.drivername.startswith("postgresql"):
        from sqlalchemy import text

        engine = make_engine(url)
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT pg_advisory_lock(hashtextextended('ratchet:migrate', 0))"))
                conn.commit()
                try:
                    yield conn
                finally:
                    conn.rollback()
                    conn.execute(text("SELECT pg_advisory_unlock(hashtextextended('ratchet:migrate', 0))"))
                    conn.commit()
        finally:
            engine.dispose()
    elif parsed.drivername.startswith("sqlite") and parsed.database and parsed.database != ":memory:":
        import fcntl

        with open(f"{parsed.database}.lock", "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)  # released when the file is closed, also if the process dies
            try:
                yield None
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)
    else:
        yield None


def head_revision() -> str:
    """The newest migration this code knows."""
    from alembic.script import ScriptDirectory

    return str(ScriptDirectory.from_config(_alembic_config("sqlite://")).get_current_head())


def upgrade_db(url: str, revision: str = "head") -> None:
    """Apply migrations up to ``revision`` (Alembic is the only way the schema is made), one process at a
    time: a process that waited for another's migration finds the schema done and applies nothing."""
    from alembic import command

    with _migration_lock(url) as connection:
        cfg = _alembic_config(url)
        if connection is not None:
            cfg.attributes["connection"] = connection
        command.upgrade(cfg, revision)
        if connection is not None:
            connection.commit()  # type: ignore[attr-defined]


def downgrade_db(url: str, revision: str) -> None:
    """Revert migrations down to ``revision`` (``base`` removes every table)."""
    from alembic import command
    from alembic.util.exc import CommandError

    try:
        command.downgrade(_alembic_config(url), revision)
    except CommandError as exc:
        raise RatchetError(f"cannot downgrade to {revision!r}: {exc}") from None


def _revision_of(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def current_revision(url: str) -> str | None:
    engine = make_engine(url)
    try:
        return _revision_of(engine)
    finally:
        engine.dispose()


def get_engine(url: str | None = None, *, upgrade: bool = True) -> Engine:
    """The process-wide engine for ``url`` (default: the settings' registry), migrated to head on first use."""
    if url is None:
        settings = get_settings()
        settings.ensure_home()
        url = settings.registry_url
    with _lock:
        engine = _engines.get(url)
        if engine is None:
            engine = make_engine(url)
            if upgrade:
                try:
                    if _revision_of(engine) != head_revision():  # the usual case costs one SELECT
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


def hold_lock(*, session: Session, key: str) -> None:
    """Hold the lock named ``key`` until the session's transaction ends, so that a read-then-write (the
    next version number, the current champion, "is this name registered yet?") cannot interleave with
    another process doing the same. PostgreSQL: a transaction-level advisory lock on the key's hash.
    SQLite has one writer at a time: a write statement that changes nothing takes the database's write
    lock (pysqlite begins the transaction at the first write), as ``BEGIN IMMEDIATE`` would."""
    from sqlalchemy import text

    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(hashtextextended(:key, 0))"), {"key": key})
    else:
        session.execute(text("UPDATE alembic_version SET version_num = version_num WHERE 0"))


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


def registry_busy(exc: BaseException, *, ours: frozenset[str] = frozenset()) -> RatchetError | None:
    """The one line for SQLite's "database is locked" anywhere in ``exc``'s chain: another writer held the
    registry's write lock past the busy timeout. It names that writer's work where the registry knows it (a
    generation's advance lease: lineage, number, step, owner; leases of owners in ``ours``, this process's
    own, are not "another writer") and says to try again; None for any other error."""
    from sqlalchemy.exc import OperationalError

    seen, chain = exc, []
    while seen is not None and len(chain) < 20:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    locked = next(
        (
            e
            for e in chain
            if (isinstance(e, OperationalError) and "database is locked" in str(e.orig))
            or (type(e).__name__ == "OperationalError" and str(e) == "database is locked")  # sqlite3's own
        ),
        None,
    )
    if locked is None:
        return None
    with _lock:
        files = sorted({str(e.url.database) for e in _engines.values() if e.dialect.name == "sqlite"})
    where = f"the registry at {', '.join(files)}" if files else "the registry"
    work = _leased_work(ours)
    return RatchetError(
        f"{where} stayed locked by another writer for more than {BUSY_TIMEOUT_S:g} s"
        + (f" ({work})" if work else "")
        + "; run the command again when it is done (SQLite lets one process write at a time)"
    )


def _leased_work(ours: frozenset[str]) -> str:
    """What holds an advance lease now, in words ("" when nothing does or the registry cannot say)."""
    from sqlalchemy import select

    with _lock:
        engines = [e for e in _engines.values() if e.dialect.name == "sqlite"]
    parts = []
    for engine in engines:
        try:  # a read: WAL lets it through while the other writer holds the write lock
            with engine.connect() as conn:
                rows = conn.execute(
                    select(
                        Generation.lineage,
                        Generation.number,
                        Generation.status,
                        Generation.step,
                        Generation.lease_owner,
                    )
                    .where(Generation.lease_owner.is_not(None), Generation.lease_expires_at > utcnow())
                    .order_by(Generation.id)
                ).all()
        except Exception as exc:  # the message is about the lock; saying who holds it is a courtesy
            log.debug("could not read the advance leases: %s", exc)
            continue
        for lineage, number, status, step, owner in (r for r in rows if r.lease_owner not in ours):
            done = f"last step done: {step}" if step else "no step done yet"
            parts.append(
                f"`ratchet advance` run {owner} on generation {number} of lineage {lineage!r}: {status}, {done}"
            )
    return "; ".join(parts)
