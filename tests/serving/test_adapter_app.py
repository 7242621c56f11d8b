"""The ``--expose-adapters`` engine honours what vLLM honours on a chat request: ``response_format`` and a
forced ``tool_choice`` by constrained decoding (a forced call comes back as native ``tool_calls``),
``logprobs`` / ``top_logprobs`` (no entry for the end token); and it refuses with a 400 naming the parameter
what it does not do (``n`` > 1, penalties), never a silent 200. A server in front of it (``--engine
external``) passes the client's parameters through and gets them enforced."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from pipeline.serving.served import ServeConfig
from pipeline.serving.server import create_app
from serving.support import ANSWER_SCHEMA, ASK, CLIENT_TOOLS, LAMP, ServerThread, champion_registry

KEY = "engine-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "chat-g0"


@pytest.fixture(scope="module")
def registry_url(tmp_path_factory, tiny_artifacts):
    return champion_registry(tmp_path_factory.mktemp("adapter-app"), tiny_artifacts)


@pytest.fixture(scope="module")
def app(registry_url):
    from pipeline.registry import get_engine
    from pipeline.serving.adapter_app import create_adapter_app
    from pipeline.serving.scheduler import MicroBatchScheduler
    from pipeline.serving.served import load_served, plan_generation

    plan = plan_generation(get_engine(registry_url), "main", "champion")
    config = ServeConfig(registry_url=registry_url, device="cpu", poll_seconds=0, max_lora_rank=8)
    served = load_served(plan, config, MicroBatchScheduler())
    names = {f"{s}-g{plan.number}": s for s in served.specialists}
    return create_adapter_app(served.engine, api_key=KEY, model_names=names)


@pytest.fixture(scope="module")
def engine(app):
    """The engine as a server (one event loop for its scheduler: the front below talks to it too)."""
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(engine):
    with httpx.Client(base_url=engine.url, timeout=60) as c:
        yield c


def post(client, **body):
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, **body}, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def refused(client, param, **body):
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, **body}, headers=AUTH)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def streamed(client, **body) -> list[dict]:
    payload = {"model": MODEL, "messages": ASK, "stream": True, **body}
    with client.stream("POST", "/v1/chat/completions", json=payload, headers=AUTH) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_response_format_json_schema_is_enforced(client, seed):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}
    choice = post(client, response_format=fmt, max_tokens=60, temperature=1.0, seed=seed)["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), ANSWER_SCHEMA)


def test_response_format_json_object_is_enforced_streamed_too(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}
    chunks = streamed(client, response_format=fmt, max_tokens=60, temperature=1.0, seed=4)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    jsonschema.validate(json.loads(text), ANSWER_SCHEMA)
    body = post(client, response_format={"type": "json_object"}, max_tokens=60, temperature=1.0, seed=4)
    assert isinstance(json.loads(body["choices"][0]["message"]["content"]), dict)


@pytest.mark.parametrize("seed", [1, 2])
def test_tool_choice_required_gives_native_tool_calls(client, seed):
    choice = post(
        client, tools=CLIENT_TOOLS, tool_choice="required", max_tokens=100, temperature=1.0, seed=seed
    )["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    calls = choice["message"]["tool_calls"]
    assert calls and choice["message"]["content"] is None
    for call in calls:
        assert call["type"] == "function" and call["id"]
        assert call["function"]["name"] in {"set_timer", "lamp"}
        jsonschema.validate(json.loads(call["function"]["arguments"]), LAMP)


def test_named_tool_choice_streams_one_call_of_that_tool(client):
    named = {"type": "function", "function": {"name": "lamp"}}
    body = {"tools": CLIENT_TOOLS, "tool_choice": named, "parallel_tool_calls": False, "max_tokens": 100}
    chunks = streamed(client, **body, temperature=1.0, seed=5)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert not any(d.get("content") for d in deltas)
    assert [c["function"]["name"] for c in calls if c["function"].get("name")] == ["lamp"]
    arguments = "".join(c["function"].get("arguments") or "" for c in calls)
    jsonschema.validate(json.loads(arguments), LAMP)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_logprobs_have_no_end_token_entry(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}
    body = post(client, response_format=fmt, logprobs=True, top_logprobs=2, max_tokens=60, seed=1)
    choice = body["choices"][0]
    content = choice["logprobs"]["content"]
    assert choice["finish_reason"] == "stop"  # it ended on the end token
    assert len(content) == body["usage"]["completion_tokens"]
    assert "".join(i["token"] for i in content) == choice["message"]["content"]
    assert all(len(i["top_logprobs"]) == 2 and i["logprob"] <= 0 for i in content)
    chunks = streamed(client, logprobs=True, max_tokens=5, temperature=0)
    got = [i for c in chunks for ch in c["choices"] if ch.get("logprobs") for i in ch["logprobs"]["content"]]
    assert len(got) == 5 and all(i["top_logprobs"] == [] for i in got)
    assert post(client, max_tokens=3)["choices"][0].get("logprobs") is None


def test_what_it_does_not_do_is_a_400_naming_the_parameter(client):
    refused(client, "n", n=2)
    refused(client, "frequency_penalty", frequency_penalty=0.5)
    refused(client, "logit_bias", logit_bias={"5": 10})
    refused(client, "top_logprobs", top_logprobs=2)  # without logprobs
    refused(
        client, "tool_choice", tools=CLIENT_TOOLS, tool_choice={"type": "function", "function": {"name": "x"}}
    )
    refused(client, "tool_choice", tool_choice="required")  # nothing to call
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    refused(client, "response_format", response_format=bad)
    post(client, n=1, frequency_penalty=0, max_tokens=2, whatever_vllm_ignores=1)  # neutral / unknown: fine


def test_a_front_with_the_external_engine_gets_the_parameters_enforced(engine, registry_url):
    config = ServeConfig(
        registry_url=registry_url,
        device="cpu",
        poll_seconds=0,
        flush_seconds=0.05,
        engine="external",
        engine_url=engine.url,
        engine_api_key=KEY,
        engine_model_template="{specialist}-g{generation}",
    )
    with ServerThread(create_app(config)) as front:
        sdk = openai.OpenAI(base_url=front.url + "/v1", api_key="unused", max_retries=0)
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}
        done = sdk.chat.completions.create(
            model="ratchet", messages=ASK, response_format=fmt, max_tokens=60, temperature=1.0, seed=2
        )
        jsonschema.validate(json.loads(done.choices[0].message.content), ANSWER_SCHEMA)
        called = sdk.chat.completions.create(
            model="ratchet", messages=ASK, tools=CLIENT_TOOLS, tool_choice="required", max_tokens=100, seed=3
        )
        calls = called.choices[0].message.tool_calls
        assert calls and called.choices[0].finish_reason == "tool_calls"
        for call in calls:
            assert call.function.name in {"set_timer", "lamp"}
            jsonschema.validate(json.loads(call.function.arguments), LAMP)
