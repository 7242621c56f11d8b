"""Request limits of ``ratchet serve`` on a real uvicorn server: a body refused while it is read (even an
endless chunked one), a bounded number of turns in flight (429 with Retry-After, at once), the request
timeout (504 / an error event, recorded as such), and clients that leave (their rows never decoded)."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from pipeline.serving.served import ServeConfig
from pipeline.serving.server import create_app
from serving.support import ServerThread, experience_rows

BODY = {"model": "ratchet", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def config(url, **over):
    return ServeConfig(
        **{"registry_url": url, "device": "cpu", "poll_seconds": 0, "flush_seconds": 0.05, **over}
    )


def wait_for(predicate, seconds=10.0, what="condition"):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached"
        time.sleep(0.02)


def recorded(url, app, cid):
    app.state.ratchet.recorder.flush()
    wait_for(lambda: cid in {e.completion_id for e in experience_rows(url)}, what=f"{cid} recorded")
    return next(e for e in experience_rows(url) if e.completion_id == cid)


def test_a_body_over_the_limit_is_refused_while_it_is_read(registry):
    with ServerThread(create_app(config(registry, max_body_bytes=4096))) as srv:
        big = {**BODY, "messages": [{"role": "user", "content": "x" * 5000}]}
        r = httpx.post(srv.url + "/v1/chat/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert "4096 bytes" in r.json()["error"]["message"]
        # an endless chunked body (no Content-Length): answered while the client is still sending
        sock = socket.create_connection(("127.0.0.1", srv.port))
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        stop, sent = threading.Event(), [0]

        def send_forever():
            piece = b"1000\r\n" + b"x" * 4096 + b"\r\n"
            try:
                while not stop.is_set():
                    sock.sendall(piece)
                    sent[0] += len(piece)
            except OSError:  # the server closed the connection after its answer
                pass

        sender = threading.Thread(target=send_forever, daemon=True)
        sender.start()
        sock.settimeout(20)
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            reply += data
        stop.set()
        sender.join(10)
        sock.close()
        head, _, payload = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 413") and b"connection: close" in head.lower()
        assert json.loads(payload)["error"]["code"] == "request_too_large"
        assert httpx.post(srv.url + "/v1/chat/completions", json=BODY).status_code == 200  # still serving


def test_a_full_queue_is_refused_at_once_with_retry_after(registry):
    app = create_app(config(registry, max_queue=2))
    with ServerThread(app) as srv:
        state = app.state.ratchet
        runtime = state.current.engine.runtime
        results = []
        with runtime.lock:  # the engine is busy: admitted turns stay in flight
            workers = [
                threading.Thread(
                    target=lambda: results.append(
                        httpx.post(srv.url + "/v1/chat/completions", json=BODY, timeout=60)
                    )
                )
                for _ in range(2)
            ]
            for w in workers:
                w.start()
            wait_for(lambda: state.admission.inflight == 2, what="two turns in flight")
            t0 = time.perf_counter()
            refused = httpx.post(srv.url + "/v1/chat/completions", json=BODY)
            waited = time.perf_counter() - t0
        for w in workers:
            w.join(60)
        assert refused.status_code == 429 and waited < 2.0, (refused.status_code, waited)
        assert int(refused.headers["retry-after"]) >= 1
        err = refused.json()["error"]
        assert err["code"] == "queue_full" and err["type"] == "rate_limit_error"
        assert [r.status_code for r in results] == [200, 200]
        assert httpx.post(srv.url + "/v1/chat/completions", json=BODY).status_code == 200  # slots released
        assert state.admission.inflight == 0


def test_admission_says_503_while_the_server_cannot_take_more():
    from pipeline.serving.limits import Admission
    from pipeline.serving.protocol import ApiError

    admission = Admission(1)
    slot = admission.admit(busy="loading a new generation")  # below the limit: admitted
    with pytest.raises(ApiError) as loading:
        admission.admit(busy="loading a new generation", seconds_per_turn=2.5)
    assert loading.value.status == 503 and loading.value.headers["Retry-After"] == "3"
    slot.release()
    slot.release()  # idempotent
    with pytest.raises(ApiError) as stopping:
        admission.admit(busy="stopping")
    assert stopping.value.status == 503 and admission.inflight == 0


def test_a_turn_past_the_timeout_gets_504_and_is_recorded_as_stopped(registry):
    app = create_app(config(registry, request_timeout_s=0.3))
    with ServerThread(app) as srv:
        runtime = app.state.ratchet.current.engine.runtime
        with runtime.lock:  # still waiting for the engine when the timeout strikes
            t0 = time.perf_counter()
            r = httpx.post(srv.url + "/v1/chat/completions", json=BODY, timeout=30)
            waited = time.perf_counter() - t0
            with httpx.stream(
                "POST", srv.url + "/v1/chat/completions", json={**BODY, "stream": True}, timeout=30
            ) as s:
                events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout" and waited < 5
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert events[-1]["error"]["code"] == "timeout"
        row = recorded(registry, app, events[0]["id"])
        assert row.meta["finish_reason"] == "timeout" and "request timeout" in row.meta["stopped"]
        state = app.state.ratchet
        wait_for(lambda: not state.pending, what="both stopped turns recorded")
        state.recorder.flush()
        rows = experience_rows(registry)
        assert len(rows) == 2 and all(e.meta["finish_reason"] == "timeout" for e in rows)
        assert httpx.post(srv.url + "/v1/chat/completions", json=BODY).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_is_never_decoded_but_recorded(registry, stream):
    app = create_app(config(registry))
    with ServerThread(app) as srv:
        state = app.state.ratchet
        runtime = state.current.engine.runtime
        with runtime.lock:  # the engine is busy with a first batch; the next request waits in the queue
            blocker = threading.Thread(
                target=lambda: httpx.post(srv.url + "/v1/chat/completions", json=BODY, timeout=60)
            )
            blocker.start()
            wait_for(lambda: state.admission.inflight == 1, what="the first batch")
            if stream:
                with httpx.stream(
                    "POST", srv.url + "/v1/chat/completions", json={**BODY, "stream": True, "max_tokens": 60}
                ) as s:
                    next(s.iter_lines())  # the first chunk, then the client goes
            else:
                with pytest.raises(httpx.ReadTimeout):
                    httpx.post(srv.url + "/v1/chat/completions", json={**BODY, "max_tokens": 60}, timeout=0.5)
            wait_for(lambda: state.admission.inflight == 1, what="the leaving turn stopped")

            def left():
                state.recorder.flush()
                return [e for e in experience_rows(registry) if e.meta["finish_reason"] == "disconnected"]

            wait_for(left, what="the leaving turn recorded")  # while the engine is still busy: never decoded
        blocker.join(60)
        [row] = left()
        assert row.meta["completion_tokens"] == 0 and "disconnected" in row.meta["stopped"]
        assert row.messages[-1] == {"role": "assistant", "content": ""}


def test_an_aborted_row_leaves_the_batch_and_the_others_are_unchanged(tiny_artifacts):
    from pipeline.serving.runtime import Abort, AdapterSource, GenerationRequest, load_runtime
    from pipeline.specs.loading import file_sha256
    from serving.support import RANK, SPECIALISTS, TARGETS

    srcs = [
        AdapterSource(s, p, file_sha256(p / "adapter_model.safetensors"), RANK, TARGETS)
        for s, p in tiny_artifacts["adapters"].items()
    ]
    rt = load_runtime(tiny_artifacts["base"], srcs, device="cpu")
    rt.end_ids = set()  # every row runs to its length unless stopped
    ids = tuple(rt.encode([{"role": "user", "content": "hello"}]))
    abort = Abort()
    reqs = [GenerationRequest(s, ids, 40) for s in SPECIALISTS]
    reqs[1] = GenerationRequest("agent", ids, 40, abort=abort)
    alone = [rt.generate([r])[0] for r in reqs]
    steps = []

    def on_text(row, _delta):
        steps.append(row)
        if row == 1 and steps.count(1) == 3:  # three tokens in: stop it
            abort.set("disconnected")

    mixed = rt.generate(reqs, on_text=on_text)
    assert mixed[1].finish_reason == "disconnected" and 3 <= mixed[1].completion_tokens < 40
    assert alone[1].text.startswith(mixed[1].text) and len(alone[1].text) > len(mixed[1].text)
    for i in (0, 2, 3):
        assert mixed[i].text == alone[i].text and mixed[i].completion_tokens == 40
    assert rt.generate([GenerationRequest("chat", ids, 40, abort=abort)])[0].completion_tokens == 0
