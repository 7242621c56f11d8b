"""Tools offered under ``tool_choice`` auto together with a response format (what openai-agents sends on every
turn of an Agent with an ``output_type``): the reply is calls of the offered tools OR JSON in the format, one
xgrammar grammar (``tool_call_grammar(..., or_schema=/or_object=)``). On the tiny random model every output is
one or the other, over many seeds, in each harness format, and both occur; through a real server the chat
route and ``/v1/responses`` give a tool call or schema-valid text."""

from __future__ import annotations

import json

import jsonschema
import pytest
from fastapi.testclient import TestClient

from pipeline.experience.toolcalls import assistant_message
from pipeline.modeling import grammar as G
from pipeline.modeling.grammar import GrammarError, tool_call_grammar
from pipeline.serving.runtime import load_runtime
from pipeline.serving.served import ServeConfig
from pipeline.serving.server import create_app
from serving.support import ANSWER_SCHEMA, TIMER_TOOL, build_base, champion_registry, grammar_rows

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Oslo", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
TOOLS = [WEATHER, TIMER_TOOL]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    base = build_base(tmp_path_factory.mktemp("union") / "base")
    return load_runtime(base, [], specialists=["chat"], device="cpu")


def _generate(rt, spec, n):
    return rt.generate(grammar_rows(rt, n, spec, new_tokens=100))


def _branch(text: str, fmt: str, schema: dict | None) -> str:
    """``call`` when ``text`` parses back as calls of the offered tools with valid arguments, ``json`` when
    it is one JSON value valid under ``schema`` (any object when None); anything else fails the test."""
    message = assistant_message(text, list(PARAMS), fmt)
    if message.get("tool_calls"):
        for call in message["tool_calls"]:
            jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS[call["function"]["name"]])
        return "call"
    value = json.loads(text)
    if schema is None:
        assert isinstance(value, dict), text
    else:
        jsonschema.validate(value, schema)
    return "json"


@pytest.mark.parametrize("fmt", ["json", "openai", "compact"])
def test_union_output_is_a_call_or_schema_json_and_both_occur(runtime, fmt):
    spec = tool_call_grammar(TOOLS, fmt=fmt, parallel=False, or_schema=ANSWER_SCHEMA)
    results = _generate(runtime, spec, 32)
    branches = []
    for r in results:
        assert r.finish_reason == "stop", r
        branches.append(_branch(r.text, fmt, ANSWER_SCHEMA))
    assert set(branches) == {"call", "json"}, branches


def test_union_with_parallel_calls(runtime):
    spec = tool_call_grammar(TOOLS, fmt="compact", parallel=True, or_schema=ANSWER_SCHEMA)
    for r in _generate(runtime, spec, 12):
        if r.finish_reason == "stop":
            _branch(r.text, "compact", ANSWER_SCHEMA)


@pytest.mark.parametrize("fmt", ["openai", "compact"])
def test_union_with_any_json_object(runtime, fmt):
    spec = tool_call_grammar(TOOLS, fmt=fmt, parallel=False, or_object=True)
    for r in _generate(runtime, spec, 16):
        if r.finish_reason == "stop":
            _branch(r.text, fmt, None)
        else:  # a random model may write a long object: what it wrote starts one or a call
            assert r.text.startswith(("{", "<tool_call>", "get_weather(", "set_timer(")), r.text


def test_union_specs_are_distinct_hashable_and_cached(runtime):
    plain = tool_call_grammar(TOOLS, fmt="json", parallel=True)
    union = tool_call_grammar(TOOLS, fmt="json", parallel=True, or_schema=ANSWER_SCHEMA)
    anything = tool_call_grammar(TOOLS, fmt="json", parallel=True, or_object=True)
    assert len({plain, union, anything}) == 3
    assert union == tool_call_grammar(TOOLS, fmt="json", parallel=True, or_schema=dict(ANSWER_SCHEMA))
    first = G.compile_grammar(runtime.tokenizer, union, vocab_size=runtime.vocab_size)
    assert G.compile_grammar(runtime.tokenizer, union, vocab_size=runtime.vocab_size) is first


def test_union_limits_apply_to_the_schema():
    with pytest.raises(GrammarError, match="not both"):
        tool_call_grammar(TOOLS, fmt="json", parallel=True, or_schema=ANSWER_SCHEMA, or_object=True)
    deep: dict = {"type": "integer"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(GrammarError, match="deeper"):
        tool_call_grammar(TOOLS, fmt="json", parallel=True, or_schema=deep)
    with pytest.raises(GrammarError, match="valid JSON schema"):
        tool_call_grammar(TOOLS, fmt="json", parallel=True, or_schema={"type": "no-such-type"})


# --------------------------------------------------------------------------------------- through a server
SERVER_TOOLS = [
    {"type": "function", "function": {"name": n, "description": n, "parameters": p}}
    for n, p in PARAMS.items()
]


@pytest.fixture(scope="module")
def client(tmp_path_factory, tiny_artifacts):
    url = champion_registry(tmp_path_factory.mktemp("union-serve"), tiny_artifacts)
    app = create_app(ServeConfig(registry_url=url, poll_seconds=0, device="cpu", flush_seconds=0.05))
    with TestClient(app) as c:
        yield c


def _chat_branch(message: dict, finish: str) -> str:
    if message.get("tool_calls"):
        assert finish == "tool_calls"
        for call in message["tool_calls"]:
            jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS[call["function"]["name"]])
        return "call"
    assert finish == "stop", message
    jsonschema.validate(json.loads(message["content"]), ANSWER_SCHEMA)
    return "json"


def test_chat_tools_under_auto_with_a_json_schema_give_a_call_or_schema_json(client):
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "final_output", "schema": ANSWER_SCHEMA, "strict": True},
    }
    branches = []
    for seed in range(8):
        r = client.post(
            "/v1/chat/completions",
            json={
                "model": "ratchet",
                "messages": [{"role": "user", "content": "timer 3+4"}],  # the agent adapter
                "tools": SERVER_TOOLS,
                "response_format": fmt,
                "max_tokens": 100,
                "temperature": 1.0,
                "seed": seed,
            },
        )
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        branches.append(_chat_branch(choice["message"], choice["finish_reason"]))
    assert set(branches) == {"call", "json"}, branches  # before the union: the format won, no call ever


BAD_TOOL = {"type": "function", "function": {"name": "bad", "parameters": {"type": "no-such-type"}}}


@pytest.mark.parametrize(
    ("schema", "tools", "param"),
    [({"type": "no-such-type"}, SERVER_TOOLS, "response_format"), (ANSWER_SCHEMA, [BAD_TOOL], "tools")],
)
def test_a_union_the_library_refuses_is_a_400_naming_the_part_at_fault(client, schema, tools, param):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    r = client.post(
        "/v1/chat/completions",
        json={"model": "ratchet", "messages": [{"role": "user", "content": "hi"}], "tools": tools,
              "response_format": fmt},
    )  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize(
    ("schema", "tool", "param"),
    [({"type": "no-such-type"}, None, "text.format"), (ANSWER_SCHEMA, BAD_TOOL["function"], "tools")],
)
def test_a_refused_union_is_a_400_naming_the_responses_parameter(client, schema, tool, param):
    flat = [{"type": "function", **(tool or {"name": "set_timer", "parameters": PARAMS["set_timer"]})}]
    text = {"format": {"type": "json_schema", "name": "x", "schema": schema}}
    r = client.post("/v1/responses", json={"model": "ratchet", "input": "hi", "tools": flat, "text": text})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_responses_tools_under_auto_with_text_format_give_a_call_or_schema_json(client):
    flat = [{"type": "function", "name": n, "description": n, "parameters": p} for n, p in PARAMS.items()]
    text = {
        "format": {"type": "json_schema", "name": "final_output", "schema": ANSWER_SCHEMA, "strict": True}
    }
    branches = []
    for _ in range(12):
        r = client.post(
            "/v1/responses",
            json={
                "model": "ratchet",
                "input": "timer 3+4",
                "tools": flat,
                "text": text,
                "max_output_tokens": 100,
                "temperature": 1.0,  # the Responses API has no seed: each try samples anew
            },
        )
        assert r.status_code == 200, r.text
        body = r.json()
        calls = [o for o in body["output"] if o["type"] == "function_call"]
        if calls:
            for call in calls:
                jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]])
            branches.append("call")
        else:
            [message] = [o for o in body["output"] if o["type"] == "message"]
            jsonschema.validate(json.loads(message["content"][0]["text"]), ANSWER_SCHEMA)
            branches.append("json")
    assert "call" in branches, branches  # about half are calls on the agent adapter


def test_a_compile_refused_for_load_is_a_503_to_retry_not_a_400(client, monkeypatch):
    """All compile slots busy (``MAX_COMPILING``) is the server's state, not the client's mistake."""
    import threading

    full = threading.BoundedSemaphore(1)
    full.acquire()
    monkeypatch.setattr(G, "_running", full)
    fresh = {
        **ANSWER_SCHEMA,
        "properties": {**ANSWER_SCHEMA["properties"], "spare": {"type": "boolean"}},
    }  # not cached
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": fresh}}
    r = client.post(
        "/v1/chat/completions",
        json={"model": "ratchet", "messages": [{"role": "user", "content": "hi"}], "response_format": fmt},
    )
    assert r.status_code == 503 and r.headers["Retry-After"], r.text
    assert "compiling" in r.json()["error"]["message"]
