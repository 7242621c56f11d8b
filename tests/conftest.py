"""Shared fixtures: an isolated RATCHET_HOME per test, and registries on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
import yaml

from pipeline.environment.tinymodel import TinyModelConfig

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm would fetch its price list at import
os.environ.setdefault("MLFLOW_ENABLE_TELEMETRY", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One torch thread: the suite runs beside a PostgreSQL server, Prefect and subprocesses on 2 cores, where
# OpenMP threads waiting for each other made model tests several times slower (measured).
os.environ.setdefault("OMP_NUM_THREADS", "1")

PG_URL = os.environ.get("RATCHET_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def _sandbox_problem() -> str | None:
    from pipeline.sandbox import sandbox_problem

    return sandbox_problem("bubblewrap")


# Model-written code runs under bubblewrap where it works (CI installs it and sets RATCHET_REQUIRE_SANDBOX);
# elsewhere the suite runs it as plain processes, and the containment tests are skipped.
SANDBOX_PROBLEM = _sandbox_problem()
if SANDBOX_PROBLEM and os.environ.get("RATCHET_REQUIRE_SANDBOX"):
    raise RuntimeError(f"RATCHET_REQUIRE_SANDBOX is set but {SANDBOX_PROBLEM}")
if SANDBOX_PROBLEM:
    os.environ["RATCHET_SANDBOX"] = "process"


@pytest.fixture
def bubblewrap():
    """Skip a containment test where bubblewrap cannot run (it is required in CI)."""
    if SANDBOX_PROBLEM:
        pytest.skip(SANDBOX_PROBLEM)


@pytest.fixture(autouse=True)
def ratchet_home(tmp_path, monkeypatch):
    """Every test gets its own RATCHET_HOME (registry, MLflow store, artifacts) and fresh settings."""
    from pipeline.registry import dispose_engines
    from pipeline.settings import get_settings

    home = tmp_path / "home"
    home.mkdir()  # as `ratchet init` makes it: commands other than init refuse a missing home
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


# ---- a small tiny model and a lineage on it (advancement, flows) --------------------------------------------
ROOT = Path(__file__).resolve().parent.parent
SMALL = TinyModelConfig(hidden_size=48, num_layers=2, num_heads=2, intermediate_size=96, max_position_embeddings=64,
                        bootstrap_steps=120, bootstrap_batch_size=32, corpus_size=2000, seed=3)  # fmt: skip


@pytest.fixture(scope="session")
def small_base(tmp_path_factory):
    from pipeline.environment.tinymodel import ensure_tiny_model

    return ensure_tiny_model(config=SMALL, cache_dir=tmp_path_factory.mktemp("tiny"))


# One specialist per training method, each on a tiny configuration (tests of every method end to end).
METHODS = {
    "chat": {"method": "dpo", "dpo": {"batch_size": 8, "epochs": 1, "sft_weight": 1.0}},
    "agent": {"method": "grpo", "grpo": {"steps": 3, "prompts_per_step": 4, "group_size": 4, "max_turns": 2}},
    "genui": {"method": "grpo", "grpo": {"steps": 2, "prompts_per_step": 4, "group_size": 4}},
}


def write_specs(
    tmp: Path,
    base: Path,
    *,
    heldout_size: int = 20,
    methods: dict[str, dict] | None = None,
    fresh: bool | None = None,
) -> dict[str, Path]:
    """A model spec on the small base (``methods``: per specialist, its method and settings; default sft)
    and the demo contract with smaller held-out (and retention) suites."""
    model = {
        "name": "test-tiny",
        "base": {"path": str(base)},
        "specialists": {
            s: {
                "lora": {"rank": 4, "alpha": 8},
                "training": {"epochs": 1, "batch_size": 16},
                **(methods or {}).get(s, {}),
            }
            for s in ("chat", "agent", "coding", "genui")
        },
    }
    contract = yaml.safe_load((ROOT / "contracts" / "demo.yaml").read_text())
    contract["version"] = "test"
    for suite in contract["heldout"] + contract.get("retention", []):
        suite["size"] = heldout_size
    for suite in contract["heldout"] if fresh is not None else []:  # None: as shipped (fresh samples)
        suite["fresh"] = fresh
    paths = {"model": tmp / "model.yaml", "contract": tmp / "contract.yaml"}
    paths["model"].write_text(yaml.safe_dump(model))
    paths["contract"].write_text(yaml.safe_dump(contract))
    return paths


@pytest.fixture
def specs(small_base, tmp_path):
    """The small base's model spec and the demo contract with small held-out suites, as files."""
    return write_specs(tmp_path, small_base)


@pytest.fixture
def lineage(specs, tmp_path):
    return init_with_corrections(specs, tmp_path)


@pytest.fixture
def methods_lineage(small_base, tmp_path):
    """The lineage with chat on dpo, agent and genui on grpo (agent multi-turn), coding on sft."""
    return init_with_corrections(write_specs(tmp_path, small_base, methods=METHODS), tmp_path)


def init_with_corrections(specs: dict[str, Path], tmp: Path) -> dict[str, Path]:
    from pipeline.loop.founding import init_lineage

    init_lineage(
        contract_path=specs["contract"],
        harness_path=ROOT / "harnesses" / "demo.yaml",
        model_path=specs["model"],
    )
    ingest_corrections(tmp / "feedback.jsonl")
    return specs


def ingest_corrections(path: Path, per_specialist: int = 12) -> None:
    """Deployment traces the model got wrong, each with the user's corrected answer (a training source)."""
    from pipeline.environment import reference_answer, sample_prompts
    from pipeline.experience.ingest import ingest_file

    with open(path, "w") as fh:
        for specialist in ("chat", "agent", "coding", "genui"):
            for item in sample_prompts(specialist, per_specialist, seed=99):
                trace = {
                    "messages": [*item["messages"], {"role": "assistant", "content": "?"}],
                    "metadata": item["metadata"],
                    "feedback": {"rating": 1, "correction": reference_answer(item)},
                }
                fh.write(json.dumps(trace) + "\n")
    from pipeline.registry import get_engine, session_scope

    engine = get_engine()
    result = ingest_file(path, session_factory=lambda: session_scope(engine), source="deployment")
    assert result.stored > 40 and result.quarantined == 0, result


def run_cli(args: list[str]) -> int:
    """``ratchet ARGS`` in this process; its exit code (a user's mistake exits 1 with one line on stderr)."""
    from pipeline.cli import main

    try:
        main(args)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0
