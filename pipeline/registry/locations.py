"""Paths in the registry are stored relative to the home (``RATCHET_HOME``) when they lie inside it, so a home
moved whole to another directory (or machine) keeps working: a stored relative path is read against the
current home. A path outside the home (a user's own base model directory) is stored as it is, and so is any
absolute path an older registry wrote: absolute stays absolute.

In Python, every path is the usable one (absolute); only the stored form is relative. ``HomePath`` is the
column type that converts on the way in and out; ``stored_path``/``home_path`` do the same for paths kept in
JSON documents (a generation's state)."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

from sqlalchemy import Text
from sqlalchemy.types import TypeDecorator

from pipeline.settings import get_settings

__all__ = ["HomePath", "home_path", "stored_path"]


def _home(home: Path | None) -> Path:
    return Path(os.path.abspath(home if home is not None else get_settings().home))


def stored_path(path: str | Path, *, home: Path | None = None) -> str:
    """How ``path`` (absolute, or relative to the working directory) is stored: relative to the home when it
    lies inside it, else absolute. ``home`` defaults to the settings' home."""
    absolute = Path(os.path.abspath(path))  # normalised: no `..` may climb out of the home
    base = _home(home)
    for root in (base, base.resolve()):  # the home as named, and with its links followed
        if absolute.is_relative_to(root):
            return absolute.relative_to(root).as_posix()
    return str(absolute)


def home_path(stored: str, *, home: Path | None = None) -> str:
    """A stored path as a usable absolute path: a relative one is inside the (current) home; an absolute one
    (outside the home, or written by an older registry) is returned unchanged."""
    path = Path(stored)
    return stored if path.is_absolute() else str(_home(home) / path)


class HomePath(TypeDecorator):
    """A filesystem path column (TEXT), stored relative to the home when inside it (see the module)."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value, dialect):
        return None if value is None else stored_path(value)

    def process_result_value(self, value, dialect):
        return None if value is None else home_path(value)


# MLflow's tables that hold artifact locations (MLflow 3: experiments, runs, model versions, logged models)
MLFLOW_LOCATION_COLUMNS = (
    ("experiments", "artifact_location"),
    ("runs", "artifact_uri"),
    ("model_versions", "source"),
    ("model_versions", "storage_location"),
    ("logged_models", "artifact_location"),
)


def follow_moved_store(*, tracking_uri: str, artifact_location: str) -> int:
    """Point a local MLflow store that moved with its home at the artifacts beside it. MLflow stores artifact
    locations absolute (``file:///old/home/mlartifacts/...``; a relative one is resolved when stored) and has
    no command to move them, so a moved home would log new runs' artifacts to the old place. When the SQLite
    store lies in the same directory as ``artifact_location`` (the home's ``mlflow.db`` and ``mlartifacts``)
    and an experiment's location is another directory named like it, that prefix is rewritten to
    ``artifact_location`` in MLflow's location columns (plain SQL on MLflow's documented schema). Returns the
    number of rows rewritten (0: nothing had moved, or the store is not such a file)."""
    from sqlalchemy import create_engine, inspect, text
    from sqlalchemy.engine import make_url

    url = make_url(tracking_uri)
    new = artifact_location.rstrip("/")
    if not url.drivername.startswith("sqlite") or not url.database or not new.startswith("file://"):
        return 0
    new_dir = Path(url2pathname(urlparse(new).path))
    if Path(url.database).absolute().parent != new_dir.parent:
        return 0
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            tables = set(inspect(conn).get_table_names())
            old = [
                row[0].rstrip("/")
                for row in conn.execute(text("SELECT DISTINCT artifact_location FROM experiments"))
                if row[0]
                and row[0].startswith("file://")
                and row[0].rstrip("/") != new
                and Path(row[0].rstrip("/")).name == new_dir.name
            ]
            changed = 0
            for prefix in old:
                for table, column in (c for c in MLFLOW_LOCATION_COLUMNS if c[0] in tables):
                    changed += conn.execute(
                        text(
                            f"UPDATE {table} SET {column} = :new || substr({column}, :cut) "
                            f"WHERE {column} = :old OR substr({column}, 1, :cut) = :prefix"
                        ),
                        {"new": new, "cut": len(prefix) + 1, "old": prefix, "prefix": prefix + "/"},
                    ).rowcount
            return changed
    finally:
        engine.dispose()
