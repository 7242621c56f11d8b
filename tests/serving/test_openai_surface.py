"""The OpenAI chat-completions surface agent frameworks use, against a real app on the tiny model:
structured outputs (``response_format``) and ``tool_choice`` enforced by constrained decoding,
``parallel_tool_calls``, ``n`` > 1, ``logprobs`` / ``top_logprobs``, vLLM's ``return_token_ids`` (equal to
the token ids stored with the turn), string-valued response ``metadata``, the client's ``tools`` and
conversation id stored with the trace, streamed tool calls in OpenAI's delta shape, and every parameter
either honoured, harmlessly accepted or refused with a 400 naming it."""

from __future__ import annotations

import json
import time
from typing import Literal

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel

from pipeline.serving.served import ServeConfig
from pipeline.serving.server import create_app
from serving.support import ANSWER_SCHEMA, ASK, CLIENT_TOOLS, LAMP, champion_registry, experience_rows

TIMER = [{"role": "user", "content": "timer 3+4"}]


class Answer(BaseModel):  # bounded: a random model's free string would never end
    ok: bool
    size: Literal["s", "m", "l"]


@pytest.fixture(scope="module")
def app_url(tmp_path_factory, tiny_artifacts):
    return champion_registry(tmp_path_factory.mktemp("surface"), tiny_artifacts)


@pytest.fixture(scope="module")
def client(app_url):
    app = create_app(ServeConfig(registry_url=app_url, poll_seconds=0, device="cpu", flush_seconds=0.05))
    with TestClient(app) as c:
        yield c


@pytest.fixture(scope="module")
def sdk(client):
    """The official openai client, talking to the app in-process (TestClient is an httpx.Client)."""
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)


def post(client, **body):
    r = client.post("/v1/chat/completions", json={"model": "ratchet", "messages": ASK, **body})
    assert r.status_code == 200, r.text
    return r.json()


def refused(client, param, **body):
    r = client.post("/v1/chat/completions", json={"model": "ratchet", "messages": ASK, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err
    return err


def stored(client, url, cid):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        client.app.state.ratchet.recorder.flush()
        rows = {e.completion_id: e for e in experience_rows(url)}
        if cid in rows:
            return rows[cid]
    raise AssertionError(f"{cid} was not stored")


def sse_chunks(client, **body) -> list[dict]:
    with client.stream(
        "POST", "/v1/chat/completions", json={"model": "ratchet", "messages": ASK, "stream": True, **body}
    ) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# ------------------------------------------------------------------------------------- structured output
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_response_format_gives_schema_valid_json(client, seed):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
    body = post(client, response_format=fmt, max_tokens=60, temperature=1.0, seed=seed)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), ANSWER_SCHEMA)


def test_json_object_response_format_gives_a_json_object(client):
    body = post(client, response_format={"type": "json_object"}, max_tokens=60, temperature=1.0, seed=4)
    assert isinstance(json.loads(body["choices"][0]["message"]["content"]), dict)


def test_openai_parse_with_a_pydantic_model(sdk):
    done = sdk.chat.completions.parse(
        model="ratchet", messages=ASK, response_format=Answer, max_tokens=60, temperature=1.0, seed=7
    )
    assert isinstance(done.choices[0].message.parsed, Answer)


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "json_schema"},  # no json_schema
        {"type": "json_schema", "json_schema": {"name": "x"}},  # no schema
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "$ref": "#/nope"}}},
        {"type": "xml"},
    ],
)
def test_an_invalid_response_format_is_a_400_naming_it(client, fmt):
    refused(client, "response_format", response_format=fmt)


# ----------------------------------------------------------------------------------------------- tools
@pytest.mark.parametrize("seed", [1, 2])
def test_tool_choice_required_gives_a_call_of_an_offered_tool(client, seed):
    body = post(client, tools=CLIENT_TOOLS, tool_choice="required", max_tokens=80, temperature=1.0, seed=seed)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    for call in choice["message"]["tool_calls"]:
        assert call["function"]["name"] in {"set_timer", "lamp"}
        jsonschema.validate(json.loads(call["function"]["arguments"]), LAMP)


def test_named_tool_choice_calls_that_tool_once_without_parallel_calls(client):
    named = {"type": "function", "function": {"name": "lamp"}}
    for seed in (1, 2, 3):
        body = post(
            client, tools=CLIENT_TOOLS, tool_choice=named, parallel_tool_calls=False, max_tokens=80,
            temperature=1.0, seed=seed,
        )  # fmt: skip
        calls = body["choices"][0]["message"]["tool_calls"]
        assert [c["function"]["name"] for c in calls] == ["lamp"]
        assert json.loads(calls[0]["function"]["arguments"])["on"] in (True, False)


def test_a_named_tool_not_offered_is_a_400(client):
    refused(
        client, "tool_choice", tools=CLIENT_TOOLS, tool_choice={"type": "function", "function": {"name": "x"}}
    )
    refused(client, "tool_choice", tool_choice="required")  # nothing to call


def test_tool_choice_none_answers_in_text(client):
    body = post(client, messages=TIMER, tools=CLIENT_TOOLS, tool_choice="none", max_tokens=30)
    assert (
        "tool_calls" not in body["choices"][0]["message"]
        and body["choices"][0]["finish_reason"] != "tool_calls"
    )


def test_streamed_tool_calls_assemble_into_the_same_call(client, sdk):
    body = {"tools": CLIENT_TOOLS, "tool_choice": "required", "max_tokens": 80, "temperature": 0}
    plain = post(client, **body)["choices"][0]["message"]["tool_calls"]
    chunks = sse_chunks(client, **body)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    first = next(d["tool_calls"][0] for d in deltas if d.get("tool_calls"))
    assert first["index"] == 0 and first["type"] == "function" and first["id"] and first["function"]["name"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # the openai SDK's own stream accumulator reads the deltas back into the same calls
    with sdk.chat.completions.stream(model="ratchet", messages=ASK, **body) as stream:
        final = stream.get_final_completion()
    got = [(c.function.name, json.loads(c.function.arguments)) for c in final.choices[0].message.tool_calls]
    assert got == [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in plain]
    assert final.choices[0].finish_reason == "tool_calls"


# ---------------------------------------------------------------------------------------- n, logprobs
def test_n_choices_share_the_batch_and_are_each_recorded(client, app_url):
    body = post(client, n=2, temperature=1.0, seed=5, max_tokens=8)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    # choice i is sampled with seed + i
    second = post(client, temperature=1.0, seed=6, max_tokens=8)["choices"][0]["message"]["content"]
    assert body["choices"][1]["message"]["content"] == second
    assert body["usage"]["completion_tokens"] == sum(
        stored(client, app_url, cid).meta["completion_tokens"] for cid in (body["id"], body["id"] + "-1")
    )


def test_n_choices_stream(client):
    chunks = sse_chunks(client, n=2, temperature=1.0, seed=5, max_tokens=8)
    plain = post(client, n=2, temperature=1.0, seed=5, max_tokens=8)
    texts = ["", ""]
    finishes = [None, None]
    for c in chunks:
        for ch in c["choices"]:
            texts[ch["index"]] += ch["delta"].get("content") or ""
            finishes[ch["index"]] = ch["finish_reason"] or finishes[ch["index"]]
    assert texts == [c["message"]["content"] for c in plain["choices"]]
    assert finishes == [c["finish_reason"] for c in plain["choices"]]


def test_logprobs_shape(client):
    body = post(client, logprobs=True, top_logprobs=2, max_tokens=6)
    content = body["choices"][0]["logprobs"]["content"]
    assert 0 < len(content) <= body["usage"]["completion_tokens"]
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert item["logprob"] <= 0 and item["bytes"] == list(item["token"].encode())
        assert len(item["top_logprobs"]) == 2 and item["top_logprobs"][0]["logprob"] >= item["logprob"] - 1e-4
        assert set(item["top_logprobs"][0]) == {"token", "logprob", "bytes"}
    text = body["choices"][0]["message"]["content"]
    assert "".join(i["token"] for i in content).startswith(text)
    assert (
        post(client, logprobs=True, max_tokens=4)["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        == []
    )
    assert post(client, max_tokens=4)["choices"][0]["logprobs"] is None
    refused(client, "top_logprobs", top_logprobs=2)  # without logprobs: OpenAI's 400 too
    refused(client, "top_logprobs", logprobs=True, top_logprobs=21)


def test_streamed_logprobs_and_token_ids(client):
    chunks = sse_chunks(client, logprobs=True, return_token_ids=True, max_tokens=6)
    plain = post(client, logprobs=True, return_token_ids=True, max_tokens=6)
    got = [i for c in chunks for ch in c["choices"] if ch.get("logprobs") for i in ch["logprobs"]["content"]]
    want = plain["choices"][0]["logprobs"]["content"]
    assert [i["token"] for i in got] == [i["token"] for i in want] and len(got) > 0
    assert [i["logprob"] for i in got] == pytest.approx(
        [i["logprob"] for i in want], abs=1e-3
    )  # batch numerics
    ids = [i for c in chunks for ch in c["choices"] for i in ch.get("token_ids") or []]
    assert ids == plain["choices"][0]["token_ids"]
    assert (
        next(c["prompt_token_ids"] for c in chunks if c.get("prompt_token_ids")) == plain["prompt_token_ids"]
    )


def test_return_token_ids_equal_the_stored_served_tokens(client, app_url):
    body = post(client, return_token_ids=True, max_tokens=6)
    row = stored(client, app_url, body["id"])
    served = row.served_tokens[str(len(ASK))]
    assert (
        served["prompt_ids"] == body["prompt_token_ids"]
        and served["completion_ids"] == body["choices"][0]["token_ids"]
    )
    assert served["tokenizer"] and len(body["choices"][0]["token_ids"]) == body["usage"]["completion_tokens"]
    assert "prompt_token_ids" not in post(client, max_tokens=2)


# ------------------------------------------------------------------------------- metadata, storage
def test_response_metadata_values_are_strings(client):
    body = post(client, max_tokens=2)
    assert body["metadata"] and all(isinstance(v, str) for v in body["metadata"].values())
    first = sse_chunks(client, max_tokens=2)[0]
    assert all(isinstance(v, str) for v in first["metadata"].values())


def test_tools_and_conversation_id_are_stored_with_the_trace(client, app_url):
    body = post(client, messages=TIMER, tools=CLIENT_TOOLS, max_tokens=30, metadata={"session_id": "sess-42"})
    row = stored(client, app_url, body["id"])
    assert row.tools == CLIENT_TOOLS and row.conversation_id == "sess-42"
    other = post(client, metadata={"conversation_id": "c-1", "session_id": "ignored"}, max_tokens=2)
    assert stored(client, app_url, other["id"]).conversation_id == "c-1"
    long = post(client, metadata={"conversation_id": "x" * 101}, max_tokens=2)
    assert stored(client, app_url, long["id"]).conversation_id is None


# ------------------------------------------------------------------------------------------- parameters
@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("logit_bias", {"50": 10}),
        ("functions", [{"name": "f", "parameters": {}}]),
        ("function_call", "auto"),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("modalities", ["text", "audio"]),
        ("prediction", {"type": "content", "content": "x"}),
        ("web_search_options", {}),
        ("frequency_penalty", 0.5),
        ("presence_penalty", -1),
        ("top_k", 5),
        ("made_up", 1),
        ("n", 0),
        ("n", 100),
    ],
)
def test_unsupported_parameters_are_a_400_naming_them(client, param, value):
    refused(client, param, **{param: value})


def test_harmless_parameters_are_accepted(client):
    post(
        client, user="u-1", store=False, service_tier="auto", frequency_penalty=0, presence_penalty=0.0,
        logit_bias={}, modalities=["text"], n=1, parallel_tool_calls=True, safety_identifier="s",
        prompt_cache_key="k", stream_options=None, reasoning_effort="low", verbosity="low", logprobs=False, top_logprobs=None, functions=None,
        response_format={"type": "text"}, max_tokens=2,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------- external
class BodyLog:
    """ASGI middleware keeping the JSON body of every chat request the engine behind it receives."""

    def __init__(self, app):
        self.app, self.bodies = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].endswith("/chat/completions"):
            return await self.app(scope, receive, send)
        raw = b""

        async def logged():
            nonlocal raw
            message = await receive()
            raw += message.get("body", b"")
            if message["type"] == "http.request" and not message.get("more_body"):
                self.bodies.append(json.loads(raw))
            return message

        return await self.app(scope, logged, send)


def test_external_engine_gets_the_client_parameters_unchanged(app_url):
    from pipeline.registry import get_engine
    from pipeline.serving.adapter_app import create_adapter_app
    from pipeline.serving.scheduler import MicroBatchScheduler
    from pipeline.serving.served import load_served, plan_generation
    from serving.support import ServerThread

    cfg = {"registry_url": app_url, "device": "cpu", "poll_seconds": 0, "flush_seconds": 0.05}
    served = load_served(
        plan_generation(get_engine(app_url), "main", "champion"), ServeConfig(**cfg), MicroBatchScheduler()
    )
    engine = BodyLog(create_adapter_app(served.engine))
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
    named = {"type": "function", "function": {"name": "lamp"}}
    with (
        ServerThread(engine) as engine_srv,
        ServerThread(create_app(ServeConfig(**cfg, engine="external", engine_url=engine_srv.url))) as front,
    ):
        client = openai.OpenAI(base_url=front.url + "/v1", api_key="unused", max_retries=0)
        client.chat.completions.create(
            model="ratchet", messages=ASK, response_format=fmt, logprobs=True, top_logprobs=2, max_tokens=4
        )
        client.chat.completions.create(
            model="ratchet",
            messages=ASK,
            tools=CLIENT_TOOLS,
            tool_choice=named,
            parallel_tool_calls=False,
            max_tokens=4,
        )
        ids = {"return_token_ids": True}  # the engine's ids never come back: refused, not answered with nulls
        with pytest.raises(openai.BadRequestError, match="return_token_ids"):
            client.chat.completions.create(model="ratchet", messages=ASK, extra_body=ids)
    first, second = [b for b in engine.bodies if b["max_tokens"] == 4]  # not the summaries' requests
    assert first["response_format"] == fmt and first["logprobs"] is True and first["top_logprobs"] == 2
    assert (
        second["tool_choice"] == named
        and second["parallel_tool_calls"] is False
        and second["tools"] == CLIENT_TOOLS
    )


def test_more_choices_than_the_queue_holds_is_a_400_not_a_429_forever(app_url):
    cfg = ServeConfig(registry_url=app_url, poll_seconds=0, device="cpu", flush_seconds=0.05, max_queue=2)
    with TestClient(create_app(cfg)) as c:
        refused(c, "n", n=3)
        assert len(post(c, n=2, max_tokens=2)["choices"]) == 2
