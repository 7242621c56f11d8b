"""Shared fixtures: an isolated RATCHET_HOME per test, and registries on SQLite and PostgreSQL."""

from __future__ import annotations

import os
import uuid

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("MLFLOW_ENABLE_TELEMETRY", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One torch thread: the suite runs beside a PostgreSQL server, Prefect and subprocesses on 2 cores, where
# OpenMP threads waiting for each other made model tests several times slower (measured).
os.environ.setdefault("OMP_NUM_THREADS", "1")

PG_URL = os.environ.get("RATCHET_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


@pytest.fixture(autouse=True)
def ratchet_home(tmp_path, monkeypatch):
    """Every test gets its own RATCHET_HOME (registry, MLflow store, artifacts) and fresh settings."""
    from pipeline.registry import dispose_engines
    from pipeline.settings import get_settings

    home = tmp_path / "home"
    monkeypatch.setenv("RATCHET_HOME", str(home))
    monkeypatch.delenv("RATCHET_DATABASE_URL", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RATCHET_API_KEY", raising=False)
    get_settings.cache_clear()
    yield home
    dispose_engines()
    get_settings.cache_clear()


def _postgres_available() -> bool:
    try:
        import psycopg

        with psycopg.connect(PG_URL.replace("postgresql+psycopg", "postgresql"), connect_timeout=3):
            return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def postgres_server() -> str:
    if not _postgres_available():
        if os.environ.get("RATCHET_REQUIRE_POSTGRES"):
            pytest.fail(f"PostgreSQL is required (RATCHET_REQUIRE_POSTGRES) but {PG_URL} is unreachable")
        pytest.skip(f"PostgreSQL not reachable at {PG_URL}")
    return PG_URL


@pytest.fixture
def postgres_url(postgres_server):
    """A fresh, empty PostgreSQL database for one test, dropped afterwards."""
    import psycopg
    from sqlalchemy.engine import make_url

    name = f"ratchet_test_{uuid.uuid4().hex[:12]}"
    admin = postgres_server.replace("postgresql+psycopg", "postgresql")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = make_url(postgres_server).set(database=name).render_as_string(hide_password=False)
    yield url
    from pipeline.registry import dispose_engines

    dispose_engines()
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def registry_url(request, tmp_path):
    """A migrated, empty registry on each backend."""
    from pipeline.registry import upgrade_db

    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'registry.db'}"
    else:
        url = request.getfixturevalue("postgres_url")
    upgrade_db(url)
    return url


@pytest.fixture
def engine(registry_url):
    from pipeline.registry import make_engine

    eng = make_engine(registry_url)
    yield eng
    eng.dispose()
