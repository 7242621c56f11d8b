"""The cluster setup end to end, as a user runs it: a real `prefect server start` (SQLite under its own
PREFECT_HOME) on a loopback port, a real process worker per pool (`prefect worker start --pool ratchet-cpu
--type process`, and ratchet-gpu), the GPU limit made with `prefect gcl create`, the deployments of
prefect.yaml made with `prefect deploy --all`, and `prefect deployment run advance_cluster/advance-generation
--watch`. The run collects, scores and curates on the CPU pool, hands train/codesign/evaluate to a run of
train-candidate on the GPU pool, decides, and publishes its artifacts; the registry, MLflow and Prefect
all show it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from pipeline.loop.candidate import STEPS, AdvanceConfig
from pipeline.registry import get_engine, list_generations, session_scope

ROOT = Path(__file__).resolve().parent.parent
PREFECT = str(Path(sys.executable).with_name("prefect"))
# the smallest generation the flow tests use (tests/test_flows.py)
FAST = AdvanceConfig(prompts_per_specialist=12, samples_per_prompt=2, min_examples=2, validation_items=4)
STARTUP_S = 240  # a first server start migrates its database: slow on a loaded 2-core machine
RUN_S = 300


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Cluster:
    """The Prefect server and its two workers, with their logs for failure messages."""

    def __init__(self, home: Path):
        from pipeline.cli.stack import POOLS, prefect_server_part, worker_part

        self.port = free_port()
        self.server = prefect_server_part(host="127.0.0.1", port=self.port, log=home / "server.log")
        self.api = self.server.env["PREFECT_API_URL"]
        self.workers = [worker_part(pool=p, api_url=self.api, log=home / f"worker-{p}.log") for p in POOLS]

    def logs(self) -> str:
        out = []
        for part in (self.server, *self.workers):
            text = part.log.read_text(errors="replace") if part.log.exists() else "(no log)"
            out.append(f"\n--- {part.name} ({part.log})\n" + "\n".join(text.splitlines()[-40:]))
        return "".join(out)

    def fail(self, message: str) -> None:
        pytest.fail(message + self.logs(), pytrace=False)

    def cli(self, *args: str, timeout: float = 120) -> str:
        """A `prefect` command against the server, as a user types it; its output (fails the test on error)."""
        try:
            done = subprocess.run(
                [PREFECT, "--no-prompt", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired as exc:
            self.fail(
                f"`prefect {' '.join(args)}` did not finish within {timeout:.0f}s:\n{exc.stdout}\n{exc.stderr}"
            )
        if done.returncode != 0:
            self.fail(f"`prefect {' '.join(args)}` exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
        return done.stdout


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    from pipeline.cli.stack import StackError, stop_parts, wait_until_ready

    prefect_home = tmp_path / "prefect"
    monkeypatch.setenv("PREFECT_HOME", str(prefect_home))
    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # prefect.yaml's schedules are created, but no scheduled run may start during the test: only ours runs
    monkeypatch.setenv("PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED", "false")
    monkeypatch.setenv("PREFECT_WORKER_QUERY_SECONDS", "1")  # workers see a new run within a second
    monkeypatch.setenv("PREFECT_LOGGING_LEVEL", "INFO")
    c = Cluster(tmp_path)
    monkeypatch.setenv("PREFECT_API_URL", c.api)
    started = []
    try:
        c.server.start()
        started.append(c.server)
        wait_until_ready([c.server], STARTUP_S, threading.Event(), started)
        c.cli("gcl", "create", "ratchet-gpu", "--limit", "1")
        for worker in c.workers:
            worker.start()
            started.append(worker)
        wait_until_ready(c.workers, STARTUP_S, threading.Event(), started)
    except StackError as exc:
        stop_parts(started, 20)
        c.fail(str(exc))
    yield c
    stop_parts(c.workers, 20)  # before the server: a worker that lost it retries for seconds
    stop_parts([c.server], 20)


def test_advance_generation_deployment_runs_on_both_pools(lineage, cluster):
    from mlflow import MlflowClient
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        FlowRunFilter,
        FlowRunFilterId,
    )
    from scipy.stats import t

    from pipeline.settings import get_settings

    cluster.cli("deploy", "--all", timeout=180)
    spec = {d["name"]: d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]}
    with SyncPrefectClient(cluster.api) as client:
        advance = client.read_deployment_by_name("advance_cluster/advance-generation")
        gpu = client.read_deployment_by_name("train_candidate/train-candidate")
        score = client.read_deployment_by_name("score_experience/score-experience")
    assert (advance.work_pool_name, gpu.work_pool_name, score.work_pool_name) == (
        "ratchet-cpu", "ratchet-gpu", "ratchet-cpu")  # fmt: skip
    assert advance.parameters == spec["advance-generation"]["parameters"]
    assert advance.schedules[0].schedule.cron == spec["advance-generation"]["schedules"][0]["cron"]
    interval = spec["score-experience"]["schedules"][0]["interval"]
    assert score.schedules[0].schedule.interval.total_seconds() == interval and not gpu.schedules

    params = json.dumps({"config": asdict(FAST)})
    out = cluster.cli("deployment", "run", "advance_cluster/advance-generation", "--params", params,
                      "--watch", "--watch-timeout", str(RUN_S), timeout=RUN_S + 60)  # fmt: skip
    assert "Completed" in out, out

    # the registry: generation 1 decided, every step recorded, the lease given back
    with session_scope(get_engine()) as s:
        gens = list_generations(session=s)
        assert [g.number for g in gens] == [0, 1]
        gen = gens[1]
        assert gen.status in ("promoted", "rejected") and set(gen.state["steps"]) == set(STEPS)
        assert gen.lease_owner is None
        run_ids = {s.adapter.mlflow_run_id for s in gen.adapters if s.adapter and s.adapter.mlflow_run_id}
        evaluation, status, decision = gen.evaluation, gen.status, gen.decision
    # MLflow: the GPU run's training runs are in the store every process shares
    mlflow = MlflowClient(tracking_uri=get_settings().tracking_uri)
    experiment = mlflow.get_experiment_by_name("ratchet")
    runs = {r.info.run_id: r for r in mlflow.search_runs([experiment.experiment_id])}
    assert run_ids and run_ids <= set(runs), (run_ids, set(runs))
    assert all(
        runs[r].info.status == "FINISHED" and runs[r].data.metrics.get("train_loss") is not None
        for r in run_ids
    )

    with SyncPrefectClient(cluster.api) as client:
        flow_runs = client.read_flow_runs()
        flows_by_id = {f.id: f.name for f in client.read_flows()}
        by_flow = {flows_by_id[r.flow_id]: r for r in flow_runs}
        cpu, gpu_run = by_flow["advance_cluster"], by_flow["train_candidate"]
        assert cpu.state.is_completed() and gpu_run.state.is_completed()
        assert gpu_run.parent_task_run_id is not None  # a subflow of the CPU run: linked in the UI

        def steps_of(run) -> set[str]:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
            return {r.name.rsplit("-", 1)[0] for r in runs}

        assert {"train", "codesign", "evaluate"} <= steps_of(gpu_run)  # the GPU steps ran on the GPU pool
        assert {"discover", "collect", "score", "curate", "decide"} <= steps_of(cpu)
        assert not {"train", "codesign", "evaluate"} & steps_of(cpu)
        keys = ["main-gen-1-heldout", "main-gen-1-decision"]
        artifacts = {
            a.key: a
            for a in client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=keys)))
        }
    assert set(artifacts) == set(keys) and all(a.flow_run_id == cpu.id for a in artifacts.values())

    # the table: one row per specialist and the overall row, with the registry's numbers; each interval's
    # lower end is the bound the gate tested
    table = artifacts["main-gen-1-heldout"].data
    rows = {r["specialist"]: r for r in (json.loads(table) if isinstance(table, str) else table)}
    comparison, verdict = evaluation["comparison"], evaluation["verdict"]
    assert set(rows) == {*comparison["specialists"], "overall"}
    alpha = yaml.safe_load(lineage["contract"].read_text())["promotion"]["regression_error_rate"]
    for name, c in comparison["specialists"].items():
        r = rows[name]
        assert (r["parent"], r["candidate"], r["delta"], r["n"]) == (
            round(c["champion"], 4), round(c["candidate"], 4), round(c["delta"], 4), c["n"])  # fmt: skip
        lower = c["delta"] - t.ppf(1 - alpha, max(1, c["n"] - 1)) * c["se"]
        assert r["interval"].startswith(f"{100 * (1 - 2 * alpha):.4g}% [{lower:+.4f},"), (r, lower)
    overall = rows["overall"]
    assert overall["delta"] == round(comparison["delta"], 4)
    assert overall["n"] == sum(c["n"] for c in comparison["specialists"].values())
    assert f"[{verdict['lower']:+.4f}," in overall["interval"], (overall, verdict)
    # the decision: status, the decision in words, every reason, the gates
    markdown = artifacts["main-gen-1-decision"].data
    assert markdown.startswith(f"# main generation 1: {status}") and decision in markdown
    assert all(reason in markdown for reason in verdict["reasons"])
    gates = [line for line in markdown.splitlines() if line.endswith(("| pass |", "| **fail** |"))]
    assert {g.split(" | ")[0] for g in gates} >= {"| improvement", "| noninferiority:chat", "| routing"}, (
        markdown
    )
    assert any("**fail**" in g for g in gates) == (status == "rejected")  # the gates agree with the decision
