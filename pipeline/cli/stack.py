"""The single-machine stack ``ratchet up`` runs: a Prefect server, a process worker per work pool, the
MLflow UI, ``ratchet dashboard`` and ``ratchet serve``, each a child process in its own process group.

Each part is started, then polled at its health address until it answers; a part that exits (or never
answers) first stops every other part and is reported in one line with the end of its log. Once all answer,
their addresses are printed and the stack runs until SIGINT or SIGTERM, or until a part exits by itself.
Stopping sends SIGTERM to each part's process group (the last started first), SIGKILL after a grace period,
and then to anything the parts left behind: on Linux this process is a child subreaper, so descendants
whose parent died (a flow run a worker started in its own session) become its children and are found too.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.errors import RatchetError
from pipeline.knobs import described
from pipeline.registry.tracking import is_remote
from pipeline.settings import get_settings

log = logging.getLogger(__name__)

POOLS = ("ratchet-cpu", "ratchet-gpu")
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


@dataclass(frozen=True)
class StackConfig:
    """What ``ratchet up`` starts and where: each field is an option of the command (``pipeline.cli.options``),
    its description the help, its default the default."""

    host: str = described("127.0.0.1", "Interface every part listens on.")
    prefect_port: int = described(4200, "Prefect server (API and UI).", ge=1, le=65535)
    mlflow_port: int = described(5000, "MLflow UI.", ge=1, le=65535)
    dashboard_port: int = described(8100, "`ratchet dashboard`.", ge=1, le=65535)
    serve_port: int = described(8000, "`ratchet serve` (OpenAI-compatible API).", ge=1, le=65535)
    lineage: str = described("main", "Lineage the dashboard shows and the server serves.")
    gpu_slots: int = described(
        1, "Slots of the global concurrency limit `ratchet-gpu`: GPU steps at once.", ge=1
    )
    # a first Prefect start migrates its database (slow on 2 cores)
    startup_timeout_s: float = described(
        180.0, "Seconds each part may take to answer its health check.", ge=1
    )
    stop_timeout_s: float = described(20.0, "Seconds a part has to stop after SIGTERM before SIGKILL.", ge=0)


class StackError(RatchetError):
    """A part of the stack did not start."""


@dataclass
class Part:
    """One child process of the stack and how to tell that it is up."""

    name: str
    command: list[str]
    url: str  # what the user opens (printed)
    health: str  # polled until ``ready(response)``
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    ready: Callable[[Any], bool] = lambda response: response.status_code == 200
    proc: subprocess.Popen | None = None
    up: bool = False  # it has answered its health check

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,  # its own process group: stopped as one, deaf to our terminal's ^C
            )

    def last_line(self) -> str:
        try:
            lines = [
                line.strip() for line in self.log.read_text(errors="replace").splitlines() if line.strip()
            ]
        except OSError:
            return ""
        return lines[-1][:300] if lines else ""

    def failure(self, what: str) -> StackError:
        last = self.last_line()
        return StackError(f"{self.name} {what}{': ' + last if last else ''} (log: {self.log})")

    def is_ready(self, client: Any) -> bool:
        try:
            return bool(self.ready(client.get(self.health, timeout=5)))
        except Exception:  # refused, reset, timed out, not JSON yet: not up
            return False


def executable(name: str) -> str:
    """A console script of this environment (the venv's ``prefect``, ``mlflow``, ``ratchet``)."""
    beside = Path(sys.executable).with_name(name)
    if beside.is_file():
        return str(beside)
    import shutil

    found = shutil.which(name)
    if found is None:
        raise StackError(
            f"`{name}` is not installed in this environment ({sys.executable}): pip install -e ."
        )
    return found


def prefect_env(api_url: str) -> dict[str, str]:
    return {"PREFECT_API_URL": api_url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}


def prefect_server_part(*, host: str, port: int, log: Path) -> Part:
    api = f"http://{host}:{port}/api"
    return Part(
        "prefect server",
        [executable("prefect"), "server", "start", "--host", host, "--port", str(port)],
        url=f"http://{host}:{port}",
        health=f"{api}/health",
        log=log,
        env=prefect_env(api),
    )


def worker_part(*, pool: str, api_url: str, log: Path) -> Part:
    """A process worker of ``pool`` (created if missing); up once the server sees it (the pool is READY)."""
    return Part(
        f"prefect worker ({pool})",
        [
            executable("prefect"),
            "worker",
            "start",
            "--pool",
            pool,
            "--type",
            "process",
            "--name",
            f"{pool}-local",
        ],
        url=f"{api_url.removesuffix('/api')}/work-pools/work-pool/{pool}",
        health=f"{api_url}/work_pools/{pool}",
        log=log,
        env=prefect_env(api_url),
        ready=lambda response: response.status_code == 200 and response.json().get("status") == "READY",
    )


def stack_parts(config: StackConfig) -> tuple[Part, list[Part], list[Part]]:
    """The Prefect server, its workers (started once it answers), and the rest (started with it)."""

    settings = get_settings()
    home = settings.ensure_home().resolve()
    logs, host = home / "logs", config.host
    # the stack's Prefect database and profiles live with the rest of RATCHET_HOME unless PREFECT_HOME is set
    prefect_home = {} if "PREFECT_HOME" in os.environ else {"PREFECT_HOME": str(home / "prefect")}
    server = prefect_server_part(host=host, port=config.prefect_port, log=logs / "prefect-server.log")
    api = server.env["PREFECT_API_URL"]
    workers = [worker_part(pool=pool, api_url=api, log=logs / f"worker-{pool}.log") for pool in POOLS]
    for part in (server, *workers):
        part.env.update(prefect_home)
    rest: list[Part] = []
    if not is_remote(settings.tracking_uri):  # a tracking server elsewhere is already the UI
        mlflow = f"http://{host}:{config.mlflow_port}"
        command = [executable("mlflow"), "ui", "--backend-store-uri", settings.tracking_uri,
                   "--artifacts-destination", str(home / "mlartifacts"), "--host", host,
                   "--port", str(config.mlflow_port), "--workers", "1"]  # fmt: skip
        # MLflow's GenAI job runner (more Python processes) is nothing Ratchet uses
        env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_ENABLE_TELEMETRY": "false"}
        rest.append(Part("mlflow ui", command, mlflow, f"{mlflow}/health", logs / "mlflow.log", env))
    for command, port, page, health in (("dashboard", config.dashboard_port, "/", "/api/docs"),
                                         ("serve", config.serve_port, "/v1", "/health")):  # fmt: skip
        base = f"http://{host}:{port}"
        argv = [
            executable("ratchet"),
            command,
            "--host",
            host,
            "--port",
            str(port),
            "--lineage",
            config.lineage,
        ]
        rest.append(Part(f"ratchet {command}", argv, base + page, base + health, logs / f"{command}.log"))
    return server, workers, rest


def become_subreaper() -> bool:
    """Make orphaned descendants our children (Linux), so that stopping finds every one of them."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def stop_parts(parts: list[Part], timeout_s: float) -> None:
    """SIGTERM each part's process group (last started first), SIGKILL what is left after ``timeout_s``,
    and kill whatever the parts had started outside their groups."""
    import psutil

    below: dict[int, psutil.Process] = {}
    for part in parts:
        if part.proc is not None and part.proc.poll() is None:
            try:
                below.update({p.pid: p for p in psutil.Process(part.proc.pid).children(recursive=True)})
                os.killpg(part.proc.pid, signal.SIGTERM)
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass
    deadline = time.monotonic() + timeout_s
    for part in reversed(parts):
        if part.proc is None:
            continue
        try:
            part.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0fs of SIGTERM: killing it", part.name, timeout_s)
        try:
            os.killpg(part.proc.pid, signal.SIGKILL)  # its group's stragglers too
        except (ProcessLookupError, PermissionError):
            pass
        part.proc.wait()
    for proc in below.values():
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(list(below.values()), timeout=10)


def kill_orphans() -> None:
    """Kill and reap every process still below this one (as a subreaper: orphans of the stack's parts)."""
    import psutil

    left = psutil.Process().children(recursive=True)
    for proc in left:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(left, timeout=10)
    while True:  # reap the adopted ones psutil did not wait for
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break


def wait_until_ready(
    parts: list[Part], timeout_s: float, stopping: threading.Event, alive: list[Part]
) -> None:
    """Poll ``parts`` until each answers; one of ``alive`` (the started parts) that exits, or one of
    ``parts`` still silent after ``timeout_s``, is a ``StackError`` naming it."""
    import httpx

    deadline = time.monotonic() + timeout_s
    waiting = list(parts)
    with httpx.Client(trust_env=False) as client:  # loopback: no proxy from the environment
        while waiting and not stopping.is_set():
            for part in alive:
                assert part.proc is not None
                if part.proc.poll() is not None:
                    what = "" if part.up else f" before it answered {part.health}"
                    raise part.failure(f"exited with code {part.proc.returncode}{what}")
            for part in list(waiting):
                if part.is_ready(client):
                    part.up = True
                    log.info("%s is up", part.name)
                    waiting.remove(part)
            if waiting and time.monotonic() > deadline:
                raise waiting[0].failure(f"did not answer {waiting[0].health} within {timeout_s:.0f}s")
            stopping.wait(0.5)


def run_stack(config: StackConfig, echo: Callable[[str], None]) -> None:
    """Start the stack, print its addresses, run until SIGINT/SIGTERM, stop it all; ``StackError`` when a
    part fails (after the rest was stopped)."""
    from flows import GPU_LIMIT, ensure_gpu_limit  # lazy: imports prefect

    stopping = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stopping.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    become_subreaper()
    server, workers, rest = stack_parts(config)
    started: list[Part] = []
    try:
        for part in (server, *rest):  # all at once: on a small machine the starts overlap their imports
            part.start()
            started.append(part)
        wait_until_ready([server], config.startup_timeout_s, stopping, started)
        if not stopping.is_set():
            ensure_gpu_limit(api_url=server.env["PREFECT_API_URL"], name=GPU_LIMIT, slots=config.gpu_slots)
            for part in workers:
                part.start()
                started.append(part)
            wait_until_ready([*rest, *workers], config.startup_timeout_s, stopping, started)
        if not stopping.is_set():
            for part in started:
                echo(f"{part.name:<30} {part.url}")
            echo(
                f"global concurrency limit {GPU_LIMIT}: {config.gpu_slots} slot(s); logs in {server.log.parent}"
            )
            api = server.env["PREFECT_API_URL"]
            echo(f"deploy the scheduled flows: PREFECT_API_URL={api} prefect --no-prompt deploy --all")
            echo("ready: Ctrl-C stops everything")
        while not stopping.is_set():
            for part in started:
                assert part.proc is not None
                if part.proc.poll() is not None:
                    raise part.failure(f"exited with code {part.proc.returncode}")
            stopping.wait(1.0)
    finally:
        # the server last: workers that lose it retry for seconds before they exit (measured: 7.5 s vs 0.02 s)
        stop_parts([p for p in started if p is not server], config.stop_timeout_s)
        stop_parts([p for p in started if p is server], config.stop_timeout_s)
        kill_orphans()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    echo("stopped")
