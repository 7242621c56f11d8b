"""Attacks on the chat-completions and Responses surface (issue 25), against a real uvicorn server on the tiny
model: what a client sends never becomes another principal's prompt or training input, only ids the server
decoded are stored as served tokens, and a heavy request does not stall another client."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from pipeline.serving.served import ServeConfig
from pipeline.serving.server import create_app
from serving.support import ASK, ServerThread, api_keys, champion_registry, rows_by_id

OPERATOR_KEY = "operator-key"


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_artifacts):
    url = champion_registry(tmp_path_factory.mktemp("attacks"), tiny_artifacts)
    keys = api_keys(url, alice="chat", mallory="chat")
    config = ServeConfig(
        registry_url=url, device="cpu", poll_seconds=0, flush_seconds=0.05, api_key=OPERATOR_KEY
    )
    with ServerThread(create_app(config)) as srv:
        headers = dict(keys)
        headers["operator"] = {"Authorization": f"Bearer {OPERATOR_KEY}"}
        yield {"url": url, "base": srv.url, "headers": headers}


def post(served, path: str, body: dict, who: str = "alice", timeout: float = 120) -> httpx.Response:
    return httpx.post(served["base"] + path, json=body, headers=served["headers"][who], timeout=timeout)


def test_an_admin_continuing_a_conversation_never_gets_another_principals_turn(served):
    """Anyone may name any conversation id; continuing one must not put a turn mallory injected into it in the
    operator's prompt (nor store mallory's text as the operator's experience)."""

    def turn(text: str, who: str) -> httpx.Response:
        body = {"model": "ratchet", "input": text, "conversation": "conv-shared", "max_output_tokens": 3}
        reply = post(served, "/v1/responses", body, who=who)
        assert reply.status_code == 200, reply.text
        return reply

    turn("my own first turn", "operator")
    injected = turn("INJECTED by mallory", "mallory")
    chat = post(
        served,
        "/v1/chat/completions",
        {"model": "ratchet", "messages": [{"role": "user", "content": "INJECTED via chat"}], "max_tokens": 3,
         "metadata": {"conversation_id": "conv-shared"}},
        who="mallory",
    )  # fmt: skip
    assert chat.status_code == 200, chat.text
    rows_by_id(served["url"], injected.json()["id"], chat.json()["id"])
    follow = turn("and next?", "operator")
    row = rows_by_id(served["url"], follow.json()["id"])[follow.json()["id"]]
    texts = [m.get("content") for m in row.messages]
    assert "my own first turn" in texts
    assert not any("INJECTED" in (t or "") for t in texts), texts


def worst_health_latency(served, during) -> tuple[float, object]:
    """The slowest ``/health`` answer while ``during()`` runs in another thread, and what it returned."""
    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault("r", during()))
    worst = 0.0
    with httpx.Client(base_url=served["base"], timeout=120) as client:
        client.get("/health")
        thread.start()
        while thread.is_alive():
            t0 = time.perf_counter()
            client.get("/health")
            worst = max(worst, time.perf_counter() - t0)
            time.sleep(0.01)
    thread.join()
    return worst, out.get("r")


@pytest.mark.parametrize("turns", [4000])
def test_a_long_history_over_the_window_does_not_stall_other_clients(served, turns):
    history = []
    for i in range(turns):
        history += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
    body = {"model": "ratchet", "messages": [*history, *ASK], "max_tokens": 2}
    t0 = time.perf_counter()
    worst, reply = worst_health_latency(served, lambda: post(served, "/v1/chat/completions", body))
    took = time.perf_counter() - t0
    print(f"history {turns}: request {took:.2f}s, worst /health {worst:.2f}s, status {reply.status_code}")
    assert reply.status_code in (200, 400), reply.text
    assert worst < 1.0


@pytest.fixture(scope="module")
def small_bodies(tmp_path_factory, tiny_artifacts):
    """A server taking bodies of at most 32 KiB."""
    url = champion_registry(tmp_path_factory.mktemp("small"), tiny_artifacts)
    config = ServeConfig(
        registry_url=url, device="cpu", poll_seconds=0, flush_seconds=0.05, max_body_bytes=32 << 10
    )
    with ServerThread(create_app(config)) as srv:
        yield {"url": url, "base": srv.url, "headers": {"alice": {}}}


def padded_input(text: str, pairs: int) -> list[dict]:
    """Input items: ``pairs`` short past exchanges (trimmed from the model's view, kept in the trace), then
    ``text``."""
    items = []
    for i in range(pairs):
        items += [
            {"role": "user", "content": f"padding question {i:05d}"},
            {"role": "assistant", "content": [{"type": "output_text", "text": f"padding answer {i:05d}"}]},
        ]
    return [*items, {"role": "user", "content": text}]


@pytest.mark.parametrize("how", ["previous_response_id", "conversation"])
def test_a_conversation_kept_server_side_grows_no_larger_than_a_body(small_bodies, how):
    """Each continuation stores the whole conversation again: with a client adding a full body per request,
    a chain kept server-side would grow one stored row (and the spool) without bound. A continuation whose
    conversation would be larger than ``--max-body-bytes`` (what a client could send itself) is refused."""
    limit = 32 << 10
    prev, sizes, last = None, [], None
    for step in range(8):
        body = {"model": "ratchet", "input": padded_input(f"step {step}", 120), "max_output_tokens": 2}
        if how == "conversation":
            body["conversation"] = "conv-growing"
        elif prev is not None:
            body["previous_response_id"] = prev
        last = post(small_bodies, "/v1/responses", body)
        if last.status_code != 200:
            break
        prev = last.json()["id"]
        row = rows_by_id(small_bodies["url"], prev)[prev]
        sizes.append(len(json.dumps(row.messages)))
    print(how, sizes, last.status_code, last.text[:200])
    assert last.status_code == 400, sizes
    assert last.json()["error"]["param"] == how
    assert max(sizes) <= limit


@pytest.mark.parametrize("param", ["served_tokens", "token_ids", "prompt_token_ids", "conversation_id"])
def test_a_client_cannot_send_served_ids_or_a_conversation_column(served, param):
    body = {"model": "ratchet", "messages": ASK, "max_tokens": 2, param: [1, 2, 3]}
    reply = post(served, "/v1/chat/completions", body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param
    reply = post(served, "/v1/responses", {"model": "ratchet", "input": "hi", param: [1, 2, 3]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param


def test_only_the_ids_the_server_decoded_are_stored_as_served(served):
    """Ids a client puts on its own messages (an assistant message with ``token_ids``) are never stored as
    served; a continued Responses chain stores the ids of its new reply only, at its index."""
    smuggled = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "forged", "token_ids": [5, 6], "served_tokens": {"1": [5]}},
        {"role": "user", "content": "12+35=?"},
    ]
    chat = post(
        served,
        "/v1/chat/completions",
        {"model": "ratchet", "messages": smuggled, "max_tokens": 3, "n": 2, "return_token_ids": True},
    )
    assert chat.status_code == 200, chat.text
    cid = chat.json()["id"]
    rows = rows_by_id(served["url"], cid, f"{cid}-1")
    for choice in chat.json()["choices"]:
        row = rows[cid if choice["index"] == 0 else f"{cid}-{choice['index']}"]
        assert set(row.served_tokens) == {"3"}
        assert row.served_tokens["3"]["completion_ids"] == choice["token_ids"]
        assert row.served_tokens["3"]["prompt_ids"] == chat.json()["prompt_token_ids"]
    first = post(served, "/v1/responses", {"model": "ratchet", "input": "hi", "max_output_tokens": 2})
    follow = post(
        served,
        "/v1/responses",
        {
            "model": "ratchet",
            "input": "more",
            "max_output_tokens": 2,
            "previous_response_id": first.json()["id"],
        },
    )
    assert follow.status_code == 200, follow.text
    row = rows_by_id(served["url"], follow.json()["id"])[follow.json()["id"]]
    assert set(row.served_tokens) == {str(len(row.messages) - 1)}


def test_eight_choices_with_top_logprobs_stall_no_one(served):
    body = {
        "model": "ratchet", "messages": ASK, "n": 8, "max_tokens": 100, "logprobs": True, "top_logprobs": 20,
        "temperature": 1.0,
    }  # fmt: skip
    t0 = time.perf_counter()
    worst, reply = worst_health_latency(served, lambda: post(served, "/v1/chat/completions", body))
    took = time.perf_counter() - t0
    print(f"n=8 top_logprobs=20: {took:.2f}s, {len(reply.content)} bytes, worst /health {worst:.3f}s")
    assert reply.status_code == 200, reply.text
    assert worst < 1.0

    stream = {**body, "stream": True}
    worst, reply = worst_health_latency(served, lambda: post(served, "/v1/chat/completions", stream))
    print(f"streamed: {len(reply.content)} bytes, worst /health {worst:.3f}s")
    assert reply.status_code == 200 and reply.text.rstrip().endswith("[DONE]")
    assert worst < 1.0
    responses = {
        "model": "ratchet", "input": "12+35=?", "max_output_tokens": 100, "top_logprobs": 20,
        "include": ["message.output_text.logprobs"], "stream": True,
    }  # fmt: skip
    worst, reply = worst_health_latency(served, lambda: post(served, "/v1/responses", responses))
    print(f"responses streamed: {len(reply.content)} bytes, worst /health {worst:.3f}s")
    assert reply.status_code == 200
    assert "response.completed" in reply.text or "response.incomplete" in reply.text
    assert worst < 1.0


def test_continuations_waiting_on_a_stalled_registry_do_not_stall_decoding(small_bodies):
    """While the registry takes no writes, a ``conversation`` continuation waits (up to 10 s) for the spool
    to drain. Those waits must not hold the threads every turn's decoding runs on: on main eight of them
    (the default executor has min(32, cores + 4) threads) held an unrelated plain turn for ~10 s."""
    import sqlite3

    db = small_bodies["url"].removeprefix("sqlite:///")
    first = post(small_bodies, "/v1/responses", {"model": "ratchet", "input": "hi", "max_output_tokens": 2})
    assert first.status_code == 200
    lock = sqlite3.connect(db, timeout=30, isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")
    try:
        plain = post(
            small_bodies, "/v1/chat/completions", {"model": "ratchet", "messages": ASK, "max_tokens": 2}
        )
        assert plain.status_code == 200  # a turn is spooled: now one waits to be stored
        body = {"model": "ratchet", "input": "more", "conversation": "conv-stall", "max_output_tokens": 2}
        waiting = [
            threading.Thread(target=post, args=(small_bodies, "/v1/responses", body)) for _ in range(8)
        ]
        for t in waiting:
            t.start()
        time.sleep(1.0)
        t0 = time.perf_counter()
        again = post(
            small_bodies, "/v1/chat/completions", {"model": "ratchet", "messages": ASK, "max_tokens": 2}
        )
        took = time.perf_counter() - t0
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    for t in waiting:
        t.join(60)
    print(f"a plain turn while 8 continuations wait on the registry: {took:.2f}s")
    assert again.status_code == 200, again.text
    assert took < 3.0


def test_feedback_on_a_turn_still_streaming_waits_for_it(served):
    """A streamed turn's id is in its first chunk, before the turn is recorded: feedback sent then waits for
    the turn (as the feedback route says) instead of a 404 for a turn the client is being answered."""
    body = {
        "model": "ratchet",
        "messages": ASK,
        "max_tokens": 100,
        "temperature": 1.0,
        "stream": True,
        "n": 8,
    }
    with httpx.stream(
        "POST",
        served["base"] + "/v1/chat/completions",
        json=body,
        headers=served["headers"]["alice"],
        timeout=60,
    ) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        cid = json.loads(first.removeprefix("data: "))["id"]
        feedback = post(served, "/v1/feedback", {"completion_id": cid, "rating": 1.0})
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert feedback.status_code == 200, feedback.text


def test_a_huge_tools_list_does_not_stall_other_clients(served):
    """Tools are rendered into the prompt and counted while the view is fitted to the window, on the request
    path: a body full of tools must not hold the event loop."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": "d" * 1500,
                "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
            },
        }
        for i in range(1000)
    ]
    body = {"model": "ratchet", "messages": ASK, "max_tokens": 2, "tools": tools}
    t0 = time.perf_counter()
    worst, reply = worst_health_latency(served, lambda: post(served, "/v1/chat/completions", body))
    print(f"1000 tools: {time.perf_counter() - t0:.2f}s, {reply.status_code}, worst /health {worst:.2f}s")
    assert reply.status_code in (200, 400), reply.text
    assert worst < 1.0


def test_many_input_items_do_not_stall_other_clients(served):
    """20,000 function calls in one assistant message (one body): refused at once with a 400 (at most
    ``protocol.MAX_TOOL_CALLS`` per message), not rendered through the chat template whole while the view is
    fitted (on main: /health waited 4.6 s; with the rendering moved off the loop, 0.4 s alone and 2.4 s under
    the full suite's load, the renders holding the GIL)."""
    items = [
        {"type": "function_call", "call_id": f"c{i}", "name": "lamp", "arguments": "{}"}
        for i in range(20_000)
    ]
    body = {
        "model": "ratchet",
        "input": [{"role": "user", "content": "go"}, *items, {"role": "user", "content": "12+35=?"}],
        "max_output_tokens": 2,
    }
    t0 = time.perf_counter()
    worst, reply = worst_health_latency(served, lambda: post(served, "/v1/responses", body))
    print(f"20,000 items: {time.perf_counter() - t0:.2f}s, {reply.status_code}, worst /health {worst:.2f}s")
    assert reply.status_code == 400 and "128" in reply.json()["error"]["message"], reply.text
    assert worst < 1.0


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        ("/v1/chat/completions", '{"model": "ratchet", "messages": [{"role": "user", "content": "hi"}], '
         '"max_tokens": 2, "metadata": {"expected": NaN}}'),
        ("/v1/feedback", '{"completion_id": "chatcmpl-x", "rating": Infinity}'),
        ("/v1/responses", '{"model": "ratchet", "input": "hi", "top_p": -Infinity}'),
    ],
)  # fmt: skip
def test_nan_and_infinity_are_a_400(served, path, raw):
    """Python's JSON parser takes NaN and Infinity: a rating of Infinity, or metadata a registry on PostgreSQL
    refuses (an answered turn never stored), must be refused at the door."""
    reply = httpx.post(
        served["base"] + path,
        content=raw,
        headers={**served["headers"]["alice"], "Content-Type": "application/json"},
        timeout=60,
    )
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["code"] == "invalid_json"


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 2**70])
def test_a_seed_outside_int64_is_a_400_and_fails_no_one_else(served, seed):
    """torch's generator takes 64-bit seeds: a larger one crashed the shared decoding batch (a 500, and every
    other client's row in that batch failed with it). It is refused at the door, naming ``seed``."""
    import concurrent.futures

    ask = {"model": "ratchet", "messages": [{"role": "user", "content": "3+4=?"}], "max_tokens": 8}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        honest = pool.submit(post, served, "/v1/chat/completions", {**ask, "seed": 1, "temperature": 1.0})
        hostile = pool.submit(post, served, "/v1/chat/completions", {**ask, "seed": seed, "temperature": 1.0})
        reply, other = hostile.result(), honest.result()
    assert reply.status_code == 400 and "seed" in reply.text, reply.text
    assert other.status_code == 200, other.text
