"""`ratchet up` as a user runs it: a subprocess on free loopback ports; every part answers, SIGTERM stops
all of it (exit 0, no process left behind); a part that cannot start stops the rest with one line."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

RATCHET = str(Path(sys.executable).with_name("ratchet"))
STARTUP_S = 240  # five Python servers starting at once on a loaded 2-core machine


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Up:
    """`ratchet up` in a subprocess: its output line by line, and every process it ever had below it."""

    def __init__(self, ports: dict[str, int]):
        args = [f"--{name}-port={port}" for name, port in ports.items()]
        self.proc = subprocess.Popen(
            [RATCHET, "up", *args, "--startup-timeout", str(STARTUP_S)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PREFECT_WORKER_QUERY_SECONDS": "2"},
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        self.seen: dict[int, psutil.Process] = {}
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._watch, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line.rstrip())
            self.lines.put(line.rstrip())

    def _watch(self) -> None:
        """Record every descendant while `ratchet up` runs (orphans re-parented to it included)."""
        try:
            me = psutil.Process(self.proc.pid)
            while self.proc.poll() is None:
                for child in me.children(recursive=True):
                    self.seen.setdefault(child.pid, child)
                time.sleep(0.1)
        except psutil.NoSuchProcess:
            pass

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if text in self.lines.get(timeout=1):
                    return
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
        self.proc.kill()
        pytest.fail(f"`ratchet up` did not print {text!r}:\n" + "\n".join(self.output) + self.logs())

    def logs(self) -> str:
        home = Path(os.environ["RATCHET_HOME"]) / "logs"
        out = []
        for log in sorted(home.glob("*.log")):
            out.append(f"\n--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
        return "".join(out)

    def left_behind(self) -> list[str]:
        """Descendants that still run (a zombie is dead: only its exit status is left)."""
        alive = []
        for pid, proc in self.seen.items():
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{pid} {' '.join(proc.cmdline())[:120]}")
            except psutil.NoSuchProcess:
                pass
        return alive


def test_up_starts_every_part_and_sigterm_stops_them_all(lineage):
    ports = {name: free_port() for name in ("prefect", "mlflow", "dashboard", "serve")}
    up = Up(ports)
    up.wait_for("ready: Ctrl-C stops everything", STARTUP_S + 60)
    urls = {line.split()[-1] for line in up.output if line.split() and line.split()[-1].startswith("http://")}
    prefect, mlflow = f"http://127.0.0.1:{ports['prefect']}", f"http://127.0.0.1:{ports['mlflow']}"
    dashboard, serve = f"http://127.0.0.1:{ports['dashboard']}", f"http://127.0.0.1:{ports['serve']}"
    assert {prefect, mlflow, f"{dashboard}/", f"{serve}/v1"} <= urls, up.output
    with httpx.Client(trust_env=False, timeout=30) as client:
        assert client.get(f"{prefect}/api/health").json() is True
        for pool in ("ratchet-cpu", "ratchet-gpu"):  # a process worker polls each pool
            assert client.get(f"{prefect}/api/work_pools/{pool}").json()["status"] == "READY"
        limit = client.get(f"{prefect}/api/v2/concurrency_limits/ratchet-gpu").json()
        assert limit["limit"] == 1, limit
        assert client.get(f"{mlflow}/health").text.strip() == "OK"
        assert client.get(f"{mlflow}/api/2.0/mlflow/experiments/search?max_results=5").status_code == 200
        assert client.get(f"{dashboard}/").status_code == 200
        assert client.get(f"{serve}/health").json()["generation"] == 0  # the lineage's champion
        assert client.get(f"{serve}/v1/models").json()["data"][0]["id"] == "ratchet"
    assert len(up.seen) >= 6, up.seen  # server, two workers, MLflow, dashboard, server (and their children)

    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(timeout=90) == 0, "\n".join(up.output)
    assert up.output[-1] == "stopped"
    assert up.left_behind() == []
    for port in ports.values():  # nothing listens any more
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0


def test_a_part_that_cannot_start_stops_the_rest_with_one_line(lineage):
    ports = {name: free_port() for name in ("prefect", "mlflow", "dashboard", "serve")}
    with socket.socket() as taken:  # the dashboard's port is in use
        taken.bind(("127.0.0.1", ports["dashboard"]))
        taken.listen()
        up = Up(ports)
        rc = up.proc.wait(timeout=STARTUP_S)
        time.sleep(0.3)  # the reader thread drains the last line
    assert rc == 1, "\n".join(up.output)
    errors = [line for line in up.output if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(up.output), up.output
    assert re.match(r"error: ratchet dashboard exited with code \d+ before it answered http://", errors[0]), (
        errors
    )
    assert "address already in use" in errors[0] and "dashboard.log" in errors[0]
    assert up.left_behind() == []
