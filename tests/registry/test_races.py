"""Races on SQLite and PostgreSQL: version numbering, fresh-registry migration, champion moves, MLflow aliases."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from registry.adapter_files import stored_adapter
from sqlalchemy import func, select

from pipeline.errors import ConflictError
from pipeline.registry import (
    Adapter,
    AuditLog,
    Generation,
    GenerationStatus,
    HarnessVersion,
    create_adapter,
    create_generation,
    get_champion,
    make_engine,
    promote_generation,
    register_base_model,
    register_contract,
    register_harness,
    rollback_champion,
    session_scope,
)
from pipeline.settings import get_settings
from pipeline.specs.contract import load_contract

RATCHET = str(Path(sys.executable).parent / "ratchet")


def _seed(engine, generations: int = 3) -> int:
    """Generations 0..n-1 of lineage main: 0 retired, 1 champion, the rest rejected (built, not promoted)."""
    with session_scope(engine) as s:
        base = register_base_model(session=s, name="tiny", path="/models/tiny", spec={})
        harness = register_harness(session=s, name="demo", version="v1", spec={"p": 1})
        # the shipped contract's JSON: `ratchet advance` reads it back (it refuses a stored contract that leaves a
        # specialist ungated without saying so, as one that does not validate)
        spec = load_contract(Path(__file__).resolve().parents[2] / "contracts" / "demo.yaml").model_dump(
            mode="json"
        )
        contract = register_contract(session=s, name="demo", version="1", spec=spec)
        parent = None
        for n in range(generations):
            gen = create_generation(
                session=s,
                base_model_id=base.id,
                harness_version_id=harness.id,
                contract_version_id=contract.id,
                specialists=["chat"],
                parent_id=parent,
            )
            if n <= 1:
                promote_generation(session=s, generation=gen)
            else:
                gen.status = GenerationStatus.rejected
            parent = gen.id
        return base.id


def _run_together(targets) -> list[BaseException | None]:
    """Start every target at the same moment in its own thread; what each raised (None: it succeeded)."""
    barrier = threading.Barrier(len(targets))
    errors: list[BaseException | None] = [None] * len(targets)

    def run(i, fn):
        barrier.wait()
        try:
            fn()
        except BaseException as exc:  # recorded and asserted on by the caller
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return errors


def test_sixteen_concurrent_adapter_versions_are_unique_and_gap_free(engine):
    base_id = _seed(engine, generations=1)
    source = stored_adapter(get_settings().artifacts_dir / "chat")

    def bump():
        with session_scope(engine) as s:
            create_adapter(
                session=s,
                specialist="chat",
                base_model_id=base_id,
                rank=4,
                alpha=8,
                target_modules=["q_proj"],
                **source,
            )
            time.sleep(0.01)  # hold the transaction open a moment, as a real save does

    errors = _run_together([bump] * 16)
    assert errors == [None] * 16, [repr(e) for e in errors if e]
    with session_scope(engine) as s:
        versions = sorted(s.scalars(select(Adapter.version)))
    assert versions == list(range(1, 17))


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def fresh_url(request, tmp_path):
    """A registry URL whose database exists but has no schema yet."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'fresh.db'}"
    return request.getfixturevalue("postgres_url")


OPEN_AND_REGISTER = """
import os, sys, time
while not os.path.exists(sys.argv[2]):  # every process starts its first statement at the same moment
    time.sleep(0.005)
from pipeline.registry import get_engine, register_harness, session_scope
with session_scope(get_engine(sys.argv[1])) as s:
    register_harness(session=s, name="shared", version="1", spec={"same": True})
print("ok")
"""


def test_eight_processes_open_a_fresh_registry_at_once(fresh_url, tmp_path):
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", OPEN_AND_REGISTER, fresh_url, str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    time.sleep(3)  # imports done in every process
    go.touch()
    results = [p.communicate(timeout=180) for p in procs]
    failed = [
        err.strip().splitlines()[-1] for (out, err), p in zip(results, procs, strict=True) if p.returncode
    ]
    assert not failed, f"{len(failed)} of 8 failed: {failed[:3]}"
    engine = make_engine(fresh_url)
    try:
        with session_scope(engine) as s:
            assert s.scalar(select(func.count()).select_from(HarnessVersion)) == 1
            audits = s.scalar(select(func.count()).select_from(AuditLog).where(AuditLog.action == "register"))
            assert audits == 1  # registered once; seven saw it there
    finally:
        engine.dispose()


def _reset(engine) -> None:
    with session_scope(engine) as s:
        gens = list(s.scalars(select(Generation)))
        for gen in gens:
            gen.status = "retired"
        s.flush()  # no moment with two champions: the unique index is checked row by row
        for gen in gens:
            gen.status = {0: "retired", 1: "promoted"}.get(gen.number, "rejected")


def test_racing_promotions_and_rollbacks_keep_exactly_one_champion(engine):
    _seed(engine)

    def promote_two():
        with session_scope(engine) as s:
            gen = s.scalar(select(Generation).where(Generation.number == 2))
            promote_generation(session=s, generation=gen, reason="race")

    def roll_back():
        with session_scope(engine) as s:
            rollback_champion(session=s)

    refused = 0
    for _ in range(12):
        _reset(engine)
        errors = _run_together([promote_two, promote_two, roll_back, roll_back])
        unexpected = [repr(e) for e in errors if e is not None and not isinstance(e, ConflictError)]
        assert not unexpected  # a loser is told why (ConflictError), never an integrity error
        refused += sum(e is not None for e in errors)
        with session_scope(engine) as s:
            champions = s.scalars(select(Generation.number).where(Generation.status == "promoted")).all()
            assert len(champions) == 1, champions
            assert get_champion(session=s).number == champions[0]
    assert refused  # two promotions of one generation: one of them is always refused


def _cli(*args: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [RATCHET, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_racing_cli_promotions_leave_one_champion_and_the_loser_one_line(registry_url, tmp_path):
    engine = make_engine(registry_url)
    _seed(engine)
    env = {**os.environ, "RATCHET_DATABASE_URL": registry_url, "RATCHET_HOME": str(tmp_path / "home")}
    from pipeline.registry.tracking import MLflowTracker

    MLflowTracker(tracking_uri=f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}")  # the store, made once
    procs = [_cli("promote", "2", env=env) for _ in range(3)]
    results = [(p.wait(timeout=180), *p.communicate()) for p in procs]
    winners = [r for r in results if r[0] == 0]
    losers = [r for r in results if r[0] != 0]
    assert len(winners) == 1, results
    for _rc, _out, err in losers:
        lines = [line for line in err.strip().splitlines() if line]
        assert lines == ["error: generation 2 is already the champion"], err
    with session_scope(engine) as s:
        assert get_champion(session=s).number == 2
    engine.dispose()


def test_mlflow_aliases_agree_with_the_registry_after_a_failure_between_the_two(tmp_path, monkeypatch):
    """The registry commits first; MLflow down at that moment leaves the aliases behind, said in one line,
    and the next sync (here `ratchet sync-aliases`) brings them level."""
    from pipeline.registry import get_engine, set_generation_adapter
    from pipeline.registry.tracking import MLflowTracker, registered_model_name

    home = tmp_path / "home"
    store = f"sqlite:///{home / 'mlflow.db'}"
    engine = get_engine()
    _seed(engine)
    tracker = MLflowTracker(tracking_uri=store, artifact_root=home / "mlartifacts")
    weights = get_settings().artifacts_dir / "adapter"
    source = stored_adapter(weights)
    name = registered_model_name("main", "chat")
    with session_scope(engine) as s:
        base_id = s.scalar(select(Generation.base_model_id))
        for number in (1, 2):
            with tracker.start_run(f"gen-{number}") as run_id:
                tracker.log_artifact(weights, "adapter")
                version = tracker.register_adapter(name, run_id, "adapter")
            adapter = create_adapter(
                session=s, specialist="chat", base_model_id=base_id, rank=4, alpha=8,
                target_modules=["q_proj"], **source,
            )  # fmt: skip
            adapter.mlflow_model_version = version
            gen = s.scalar(select(Generation).where(Generation.number == number))
            set_generation_adapter(session=s, generation=gen, specialist="chat", adapter_id=adapter.id)
    tracker.set_alias(name, "champion", "1")

    import socket

    with socket.socket() as sock:  # a port nothing listens on: MLflow "down"
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    env = {
        **os.environ,
        "RATCHET_HOME": str(home),
        "MLFLOW_TRACKING_URI": dead,
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
        "MLFLOW_HTTP_REQUEST_TIMEOUT": "3",
    }
    proc = _cli("promote", "2", env=env)
    rc, (_out, err) = proc.wait(timeout=120), proc.communicate()
    assert rc != 0
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1 and "generation 2 is the champion" in lines[0] and "sync-aliases" in lines[0], err
    with session_scope(engine) as s:
        assert get_champion(session=s).number == 2  # the registry moved, and stays moved
    assert tracker.alias_version(name, "champion") == "1"  # MLflow did not
    proc = _cli("sync-aliases", env={**env, "MLFLOW_TRACKING_URI": store})
    rc, (_out, err) = proc.wait(timeout=120), proc.communicate()
    assert rc == 0, err
    assert tracker.alias_version(name, "champion") == "2"  # level again
