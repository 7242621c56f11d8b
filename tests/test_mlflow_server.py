"""Ratchet against a real ``mlflow server`` process: a PostgreSQL backend store with proxied artifacts (the
cluster setup of docs/cluster.md), a server that is not there, and a server killed in the middle of a generation
and started again."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from sqlalchemy import func, select

from pipeline.loop.candidate import AdvanceConfig, done_steps
from pipeline.registry import Adapter, Generation, get_champion, get_engine, session_scope
from pipeline.registry.tracking import HTTP_CLIENT_DEFAULTS, TrackingUnavailable
from pipeline.specs.loading import file_sha256

# generation 1 of the lineage fixture, learning from its ingested corrections: the MLflow traffic of a whole
# generation (runs, per-step metrics, adapter uploads, model versions, aliases) without waiting for collection
CONFIG = AdvanceConfig(prompts_per_specialist=24, samples_per_prompt=2, min_examples=2, validation_items=6,
                       seed=1, collect=False)  # fmt: skip
MLFLOW = Path(sys.executable).with_name("mlflow")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MlflowServer:
    """``mlflow server`` as a child process in its own process group (it forks uvicorn workers)."""

    def __init__(self, *, backend: str, artifacts: Path, log: Path, port: int | None = None):
        self.backend, self.artifacts, self.log, self.port = backend, artifacts, log, port or free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> MlflowServer:
        command = [str(MLFLOW), "server", "--backend-store-uri", self.backend, "--serve-artifacts",
                   "--artifacts-destination", str(self.artifacts), "--host", "127.0.0.1",
                   "--port", str(self.port), "--workers", "1"]  # fmt: skip
        # the GenAI job runner (four more Python processes) is not what Ratchet uses
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + timeout
        probe = f"{self.uri}/api/2.0/mlflow/experiments/get-by-name?experiment_name=Default"
        while True:  # ready means the REST API answers from the store, not just that the port is open
            if self.proc.poll() is not None:
                pytest.fail(f"mlflow server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(probe, timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"mlflow server did not answer within {timeout:.0f}s:\n{self.tail()}")
            time.sleep(0.25)

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL the whole server at once: what a crash or an OOM kill does."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()


@pytest.fixture
def tracking_env(monkeypatch):
    """Point Ratchet at a server (``use(uri)``); the client settings Ratchet sets are undone afterwards."""
    from pipeline.settings import get_settings

    saved = {name: os.environ.get(name) for name in HTTP_CLIENT_DEFAULTS}
    for name in HTTP_CLIENT_DEFAULTS:
        os.environ.pop(name, None)

    def use(uri: str) -> None:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        get_settings.cache_clear()

    yield use
    for name, value in saved.items():
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value


@pytest.fixture
def mlflow_database(postgres_server):
    """A fresh PostgreSQL database for the MLflow server's backend store, dropped afterwards."""
    import psycopg
    from sqlalchemy.engine import make_url

    name = f"ratchet_mlflow_{uuid.uuid4().hex[:12]}"
    admin = postgres_server.replace("postgresql+psycopg", "postgresql")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield make_url(postgres_server).set(database=name).render_as_string(hide_password=False)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _adapters(generation: int = 1) -> list[Adapter]:
    with session_scope(get_engine()) as s:
        gen = s.scalar(select(Generation).where(Generation.number == generation))
        rows = [slot.adapter for slot in gen.adapters if slot.adapter is not None]
        s.expunge_all()
        return rows


@pytest.mark.postgres
def test_one_generation_against_an_mlflow_server_with_postgresql_and_proxied_artifacts(
    lineage, mlflow_database, tracking_env, tmp_path
):
    import psycopg
    from mlflow import MlflowClient

    from pipeline.cli import main
    from pipeline.cli.advance import make_tracker
    from pipeline.loop.advance import advance_once

    shared = tmp_path / "shared-artifacts"
    server = MlflowServer(backend=mlflow_database, artifacts=shared, log=tmp_path / "mlflow-server.log")
    try:
        server.start()
        tracking_env(server.uri)
        outcome = advance_once(config=CONFIG, tracker=make_tracker())
        if outcome["status"] != "promoted":  # the champion alias either way: promoted by hand, audited
            main(["promote", "1", "--reason", "test the alias on the server"])
        client = MlflowClient(tracking_uri=server.uri, registry_uri=server.uri)
        adapters = _adapters()
        assert adapters, outcome
        for adapter in adapters:
            run = client.get_run(adapter.mlflow_run_id)
            assert run.info.status == "FINISHED" and run.data.tags["kind"] == "lora"
            assert run.data.params["rank"] == "4" and run.data.params["adapter_sha256"] == adapter.sha256
            curve = client.get_metric_history(run.info.run_id, "train_loss")
            assert [m.step for m in curve] == list(range(1, adapter.metrics["steps"] + 1))
            assert [[m.step, round(m.value, 5)] for m in curve][-1] == adapter.metrics["loss_curve"][-1]
            # artifacts went through the server into its --artifacts-destination, not to this machine's home
            assert run.info.artifact_uri.startswith("mlflow-artifacts:/")
            names = {f.path for f in client.list_artifacts(run.info.run_id, "adapter")}
            assert {"adapter/adapter_model.safetensors", "adapter/lineage.json"} <= names
            experiment = run.info.experiment_id
            stored = (
                shared / experiment / run.info.run_id / "artifacts" / "adapter" / "adapter_model.safetensors"
            )
            assert file_sha256(stored) == adapter.sha256
            name = f"ratchet-main-{adapter.specialist}"
            version = client.get_model_version(name, adapter.mlflow_model_version)
            assert version.run_id == adapter.mlflow_run_id and version.source.endswith("/adapter")
            assert client.get_model_version_by_alias(name, "champion").version == adapter.mlflow_model_version
            # what it is and what the gates decided, on the run and on the version, through the server
            decided = {"lineage": "main", "generation": "1", "specialist": adapter.specialist,
                       "method": "sft", "decision": outcome["status"]}  # fmt: skip
            assert decided.items() <= run.data.tags.items() and decided.items() <= version.tags.items()
            assert f"heldout/candidate/{adapter.specialist}" in run.data.metrics
            assert version.description.startswith(f"main generation 1, {adapter.specialist}:")
            card = client.download_artifacts(run.info.run_id, "adapter/README.md", str(tmp_path / "cards"))
            assert f"**Decision: {outcome['status']}**" in Path(card).read_text()
        with psycopg.connect(
            mlflow_database.replace("postgresql+psycopg", "postgresql")
        ) as conn:  # really there
            training_runs = (  # each generation also has a run of its own (kind=generation: its metrics)
                "SELECT count(*) FROM runs r WHERE NOT EXISTS (SELECT 1 FROM tags t WHERE "
                "t.run_uuid = r.run_uuid AND t.key = 'kind' AND t.value = 'generation')"
            )
            assert conn.execute(training_runs).fetchone()[0] == len(adapters)
    finally:
        server.stop()


def test_an_unreachable_tracking_server_is_one_line_in_seconds_and_changes_nothing(
    lineage, tracking_env, capsys
):
    from pipeline.cli import main

    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    tracking_env(uri)
    started = time.monotonic()
    with pytest.raises(SystemExit) as exited:
        main(["advance", "--no-collect", "--prompts", "4"])
    seconds = time.monotonic() - started
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 1 and "\n" not in err, err
    assert err.startswith(
        f"error: MLflow tracking server {uri} is unreachable (opening experiment 'ratchet': "
    )
    assert "Connection refused" in err
    assert seconds < 30, seconds  # MLflow's own defaults retry for about four minutes (measured: 247 s)
    with session_scope(get_engine()) as s:
        assert s.scalar(select(func.count()).select_from(Generation)) == 1  # no candidate was started


def test_a_server_killed_mid_generation_fails_cleanly_and_the_rerun_completes_it(
    lineage, tracking_env, tmp_path
):
    """SIGKILL while the second specialist trains: the step stops with one line, the registry keeps the first
    specialist (its run exists) and nothing else; with the server back the same candidate completes."""
    from mlflow import MlflowClient

    from pipeline.cli.advance import make_tracker
    from pipeline.loop.advance import advance_once

    server = MlflowServer(backend=f"sqlite:///{tmp_path / 'mlflow.db'}", artifacts=tmp_path / "artifacts",
                          log=tmp_path / "mlflow-server.log")  # fmt: skip
    phases: list[str] = []

    def kill_during_the_second_job(phase: str, done: int, total: int) -> None:
        if phase.startswith("train ") and phase not in phases:
            phases.append(phase)
            if len(phases) == 2:
                server.kill()

    try:
        server.start()
        tracking_env(server.uri)
        started = time.monotonic()
        with pytest.raises(TrackingUnavailable) as failed:
            advance_once(config=CONFIG, tracker=make_tracker(), progress=kill_during_the_second_job)
        seconds = time.monotonic() - started
        message = str(failed.value)
        assert (
            message.startswith(f"MLflow tracking server {server.uri} is unreachable (")
            and "\n" not in message
        )
        first = phases[0].removeprefix("train ")
        with session_scope(get_engine()) as s:
            gen = s.scalar(select(Generation).where(Generation.number == 1))
            assert gen.status == "training" and gen.lease_owner is None  # still in flight, free to continue
            assert get_champion(session=s).number == 0
            assert set(gen.state["trained"]) == {first}
        assert "train" not in done_steps(gen.id)
        [kept] = _adapters()
        assert kept.specialist == first and kept.mlflow_run_id and kept.mlflow_model_version

        server.start()  # the same store and port
        outcome = advance_once(config=CONFIG, tracker=make_tracker())
        assert outcome["generation"] == 1 and outcome["status"] in ("promoted", "rejected")
        client = MlflowClient(tracking_uri=server.uri, registry_uri=server.uri)
        adapters = _adapters()
        assert {a.specialist for a in adapters} >= {first, phases[1].removeprefix("train ")}
        assert next(a for a in adapters if a.specialist == first).id == kept.id  # kept, not trained again
        for adapter in adapters:  # every row points at a run and a model version that exist
            run = client.get_run(adapter.mlflow_run_id)
            assert run.info.status == "FINISHED" and run.info.artifact_uri.startswith("mlflow-artifacts:/")
            version = client.get_model_version(
                f"ratchet-main-{adapter.specialist}", adapter.mlflow_model_version
            )
            assert version.run_id == adapter.mlflow_run_id
            if outcome["status"] == "promoted":
                alias = client.get_model_version_by_alias(f"ratchet-main-{adapter.specialist}", "champion")
                assert alias.version == adapter.mlflow_model_version
        runs = client.search_runs([client.get_experiment_by_name("ratchet").experiment_id])
        # the run the kill interrupted stays RUNNING on the server: nothing could end it; no row points at it
        orphans = [  # a generation's own run (kind=generation, its metrics) is no training run
            r
            for r in runs
            if r.info.run_id not in {a.mlflow_run_id for a in adapters}
            and r.data.tags.get("kind") != "generation"
        ]
        assert [r.info.status for r in orphans] == ["RUNNING"]
        assert seconds < 90, seconds
    except BaseException:
        print(server.tail())
        raise
    finally:
        server.stop()
