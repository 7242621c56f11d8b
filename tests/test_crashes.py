"""``kill -9`` of ``advance`` during training and during evaluation, on SQLite and PostgreSQL: the rerun
takes the dead run's candidate over at once and ends with the same generation number and the same counts
as a run that never crashed (no duplicate adapters, datasets, scores or held-out items)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import ROOT, ingest_corrections
from sqlalchemy import func, select

from pipeline.registry import (
    Adapter,
    DatasetExample,
    EvaluationItem,
    Experience,
    Generation,
    Quarantine,
    Score,
    TrainingDataset,
    dispose_engines,
    make_engine,
    session_scope,
)

ADVANCE = """
import os, sys, time
import pipeline.loop.evaluation as evaluation
from pipeline.loop.advance import advance_once
from pipeline.loop.candidate import AdvanceConfig
from pipeline.cli.advance import make_tracker
if os.environ.get("HOLD_EVALUATION"):  # evaluation on the tiny model can end between two polls: hold it open
    answer = evaluation.answer_suites
    def held(*args, **kwargs):
        result = answer(*args, **kwargs)
        if sys._getframe(1).f_code.co_name == "evaluate_step":  # not co-design's: the evaluation step's
            open(os.environ["HOLD_EVALUATION"], "w").close()  # the champion's answers are in: half done
            time.sleep(600)
        return result
    evaluation.answer_suites = held
print(advance_once(config=AdvanceConfig(prompts_per_specialist=24, samples_per_prompt=2, min_examples=2,
                                        validation_items=6, seed=1), tracker=make_tracker())["status"])
"""

_clean: dict[str, dict] = {}  # backend -> the counts of a run that never crashed (the same for every test)


def _counts(url: str) -> dict:
    engine = make_engine(url)
    try:
        with session_scope(engine) as s:
            gen = s.scalar(select(Generation).order_by(Generation.number.desc()))

            def count(model, *where):
                return s.scalar(select(func.count()).select_from(model).where(*where))

            return {
                "generations": s.scalars(select(Generation.number).order_by(Generation.number)).all(),
                "status": gen.status,
                "experience": count(Experience),
                "scores": count(Score),
                "quarantine": count(Quarantine),
                "datasets": sorted(
                    (d.specialist, d.num_rows, d.sha256)
                    for d in s.scalars(select(TrainingDataset).where(TrainingDataset.generation_id == gen.id))
                ),
                "dataset_examples": count(DatasetExample),
                "adapters": sorted((a.specialist, a.version) for a in s.scalars(select(Adapter))),
                "heldout_items": count(EvaluationItem, EvaluationItem.generation_id == gen.id),
                "overall": (gen.evaluation or {}).get("overall"),
            }
    finally:
        engine.dispose()


class World:
    """A lineage's home and registry that subprocesses run ``advance`` against, and copies of it."""

    def __init__(self, home: Path, url: str, backend: str, copies: list[str] | None = None):
        self.home, self.url, self.backend = home, url, backend
        self.copies = [] if copies is None else copies  # PostgreSQL databases made by ``copy``

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "RATCHET_HOME": str(self.home), "RATCHET_DATABASE_URL": self.url}

    def copy(self, home: Path) -> World:
        dispose_engines()
        shutil.copytree(self.home, home)
        if self.backend == "sqlite":
            url = f"sqlite:///{home / 'registry.db'}"
        else:
            import psycopg
            from sqlalchemy.engine import make_url

            name = f"ratchet_test_{uuid.uuid4().hex[:12]}"
            admin = make_url(self.url).set(database="test").render_as_string(hide_password=False)
            with psycopg.connect(admin.replace("postgresql+psycopg", "postgresql"), autocommit=True) as conn:
                conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{make_url(self.url).database}"')
            url = make_url(self.url).set(database=name).render_as_string(hide_password=False)
            self.copies.append(name)
        return World(home, url, self.backend, self.copies)

    def advance(self, **env: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-c", ADVANCE],
            env={**self.env, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def world(request, specs, tmp_path, monkeypatch):
    """A fresh lineage (generation 0 and ingested corrections) on each backend."""
    from pipeline.loop.founding import init_lineage
    from pipeline.settings import get_settings

    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'home' / 'registry.db'}"
    else:
        url = request.getfixturevalue("postgres_url")
    monkeypatch.setenv("RATCHET_DATABASE_URL", url)
    get_settings.cache_clear()
    init_lineage(
        contract_path=specs["contract"],
        harness_path=ROOT / "harnesses" / "demo.yaml",
        model_path=specs["model"],
    )
    ingest_corrections(tmp_path / "feedback.jsonl")
    made = World(tmp_path / "home", url, request.param)
    yield made
    if made.copies:
        import psycopg

        dispose_engines()
        admin = request.getfixturevalue("postgres_server").replace("postgresql+psycopg", "postgresql")
        with psycopg.connect(admin, autocommit=True) as conn:
            for name in made.copies:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _until(predicate, proc: subprocess.Popen, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"advance ended before {what}: {proc.communicate()[1][-2000:]}")
        if predicate():
            return
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"timed out waiting for {what}")


def _state(url: str) -> tuple[dict, int]:
    engine = make_engine(url)
    try:
        with session_scope(engine) as s:
            gen = s.scalar(select(Generation).where(Generation.number == 1))
            if gen is None:
                return {}, 0
            adapters = s.scalar(select(func.count()).select_from(Adapter))
            return {**(gen.state or {}).get("steps", {}), "_status": gen.status}, adapters
    finally:
        engine.dispose()


def _during_training(url: str) -> bool:
    steps, adapters = _state(url)
    return "curate" in steps and "train" not in steps and adapters >= 1  # one specialist saved, others to go


def _during_evaluation(url: str, held: Path) -> bool:
    steps, _ = _state(url)
    return held.exists() and steps.get("_status") == "evaluating" and "evaluate" not in steps


@pytest.mark.parametrize("moment", ["training", "evaluation"])
def test_kill_9_then_rerun_matches_a_clean_run(world, moment, tmp_path):
    clean = world.copy(tmp_path / "clean")
    crash = world.copy(tmp_path / "crash")
    if world.backend not in _clean:
        proc = clean.advance()
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        _clean[world.backend] = _counts(clean.url)
    expected = _clean[world.backend]

    held = tmp_path / "evaluation-held"
    proc = crash.advance(**({"HOLD_EVALUATION": str(held)} if moment == "evaluation" else {}))
    _until(
        lambda: _during_training(crash.url) if moment == "training" else _during_evaluation(crash.url, held),
        proc,
        moment,
    )
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    steps, _ = _state(crash.url)
    assert ("train" not in steps) if moment == "training" else ("evaluate" not in steps)  # killed mid-step

    started = time.monotonic()
    proc = crash.advance()  # no waiting for the dead run's lease: its process is gone
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "crashed" in err  # the takeover says what it found
    assert _counts(crash.url) == expected
    engine = make_engine(crash.url)
    with session_scope(engine) as s:
        gen = s.scalar(select(Generation).where(Generation.number == 1))
        assert len(gen.state["crashes"]) == 1 and gen.lease_owner is None
    engine.dispose()
    assert time.monotonic() - started < 600
