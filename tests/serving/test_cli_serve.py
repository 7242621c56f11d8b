"""``ratchet serve`` as a real process: answers an OpenAI client, and SIGTERM flushes the experience."""

from __future__ import annotations

import signal

import openai

from serving.support import experience_rows, serve_process, wait_healthy


def test_ratchet_serve_process(registry, tmp_path):
    proc, port = serve_process(registry, tmp_path / "home", api_key="k")
    try:
        wait_healthy(proc, port)
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
