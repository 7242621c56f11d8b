"""Load: 500 concurrent clients on loopback against ``ratchet serve`` (a real uvicorn process, the tiny
model). Every request is answered or cleanly refused (429/503 with Retry-After, which the clients honour),
no connection error and no 5xx; the server's memory stays bounded (a second wave of 500 does not grow
it); and every answered turn is in the registry's experience after the graceful shutdown's flush."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import ssl
import subprocess
import sys
import threading
import time

import httpx

from serving.support import experience_rows

CLIENTS = 500
MAX_QUEUE = 128  # below CLIENTS, so a wave is partly refused and retried


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak) of ``pid`` in MiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) // 1024
    return out


async def _client(http: httpx.AsyncClient, k: int, outcome: dict) -> None:
    """One user: a request (every fifth streamed), retried after each 429/503's Retry-After."""
    rng = random.Random(k)
    stream = k % 5 == 0
    body = {
        "model": "ratchet",
        "messages": [
            {"role": "user", "content": rng.choice(["12+35=?", "hello", "counter 1+2", "f adds 1"])}
        ],
        "max_tokens": 4,
        "stream": stream,
    }
    deadline = time.monotonic() + 40
    while True:
        try:
            if stream:
                async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    status = r.status_code
                    if status == 200:
                        lines = [line async for line in r.aiter_lines() if line.startswith("data: {")]
                        cid = json.loads(lines[0][6:])["id"]
                        assert "error" not in lines[-1], lines[-1]
                    else:
                        await r.aread()
            else:
                r = await http.post("/v1/chat/completions", json=body)
                status = r.status_code
                cid = r.json()["id"] if status == 200 else None
        except httpx.HTTPError as exc:
            outcome["errors"].append(repr(exc))
            return
        outcome["statuses"][status] = outcome["statuses"].get(status, 0) + 1
        if status == 200:
            outcome["ids"].append(cid)
            return
        if status not in (429, 503) or "retry-after" not in r.headers or time.monotonic() > deadline:
            outcome["errors"].append(f"status {status}")
            return
        await asyncio.sleep(int(r.headers["retry-after"]) * rng.uniform(0.5, 1.0))  # jitter


async def _wave(url: str) -> dict:
    """``CLIENTS`` users at once, each with its own connection (one shared pool of 500 connections costs
    httpx time quadratic in their number: the clients, not the server, would be measured)."""
    outcome: dict = {"statuses": {}, "ids": [], "errors": []}
    tls = ssl.create_default_context()  # made once: unused on http://, but httpx builds one per client

    async def user(k: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60, verify=tls) as http:
            await _client(http, k, outcome)

    await asyncio.gather(*[user(k) for k in range(CLIENTS)])
    return outcome


def test_five_hundred_concurrent_clients(registry, tmp_path, capsys):
    port = _free_port()
    env = {
        **os.environ,
        "RATCHET_DATABASE_URL": registry,
        "RATCHET_HOME": str(tmp_path / "home"),
        "RATCHET_DEVICE": "cpu",
    }
    cmd = [sys.executable, "-c", "from pipeline.cli import main; main()", "serve", "--port", str(port)]
    cmd += ["--poll-seconds", "0", "--threads", "1", "--max-queue", str(MAX_QUEUE)]
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120  # a busy shared machine: torch's import alone can take long
        while True:
            assert proc.poll() is None, open(tmp_path / "serve.log").read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.1)
        asyncio.run(_wave_small(url))  # warm-up: every code path once
        baseline = _status(proc.pid)["VmRSS"]
        with open(f"/proc/{proc.pid}/clear_refs", "w") as f:
            f.write("5")  # the peak (VmHWM) from here on
        samples: list[int] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                samples.append(_status(proc.pid)["VmRSS"])
                time.sleep(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.perf_counter()
        first = asyncio.run(_wave(url))
        after_first, first_s = _status(proc.pid)["VmRSS"], time.perf_counter() - t0
        t0 = time.perf_counter()
        second = asyncio.run(_wave(url))
        after_second, second_s = _status(proc.pid)["VmRSS"], time.perf_counter() - t0
        stop.set()
        sampler.join()
        peak = _status(proc.pid)["VmHWM"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
    out = open(tmp_path / "serve.log").read()
    line = (
        f"load: {CLIENTS} clients x 2 waves, --max-queue {MAX_QUEUE}: waves {first_s:.1f} s / {second_s:.1f} s, "
        f"statuses {first['statuses']} / {second['statuses']}; RSS baseline {baseline} MiB, after waves "
        f"{after_first} / {after_second} MiB, peak {peak} MiB (sampled max {max(samples)} MiB)"
    )
    with capsys.disabled():
        print("\n" + line)
    for wave in (first, second):
        assert wave["errors"] == [], wave["errors"][:5]  # no connection error, no other status
        assert set(wave["statuses"]) <= {200, 429, 503} and len(wave["ids"]) == CLIENTS
    assert first["statuses"].get(429, 0) > 0, line  # the bound was reached and refused cleanly
    assert "Traceback" not in out and " 500 " not in out, out[-3000:]
    # Memory: what grows with load is bounded by --max-queue (turns in flight: their tensors, a batch's
    # KV cache of ~2 MiB), the 500 connections' buffers and the recorder's queue; measured about 10-30 MiB
    # here. 120 MiB leaves room for the allocator's arenas; a second wave must not add what the first did.
    assert peak - baseline < 120, line
    assert after_second - after_first < 30, line
    recorded = {e.completion_id for e in experience_rows(registry)}
    missing = set(first["ids"] + second["ids"]) - recorded
    assert not missing, f"{len(missing)} served turns not in the experience"


async def _wave_small(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        for k in range(10):
            await _client(http, k, {"statuses": {}, "ids": [], "errors": []})
