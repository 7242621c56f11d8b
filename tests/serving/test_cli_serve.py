"""``ratchet serve`` as a real process: answers an OpenAI client, and SIGTERM flushes the experience."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai

from serving.support import experience_rows


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_ratchet_serve_process(registry, tmp_path):
    port = _free_port()
    env = {
        **os.environ,
        "RATCHET_DATABASE_URL": registry,
        "RATCHET_HOME": str(tmp_path / "home"),
        "RATCHET_DEVICE": "cpu",
        "RATCHET_API_KEY": "k",
    }
    cmd = [
        sys.executable,
        "-c",
        "from pipeline.cli import main; main()",
        "serve",
        "--port",
        str(port),
        "--poll-seconds",
        "0",
        "--threads",
        "1",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k")
        ids = [
            client.chat.completions.create(
                model="ratchet", messages=[{"role": "user", "content": t}], max_tokens=4
            ).id
            for t in ("12+35=?", "f adds 1 2")
        ]
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0) as bad:
            try:
                bad.models.list()
                raise AssertionError("wrong key accepted")
            except openai.AuthenticationError:
                pass
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode in (0, -signal.SIGTERM), out  # uvicorn re-raises the signal once shut down
    assert "Application shutdown complete" in out
    assert {e.completion_id for e in experience_rows(registry)} == set(ids)
