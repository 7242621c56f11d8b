"""Constrained decoding (``pipeline.modeling.grammar`` in the batched decoder): a random-weight model whose
output is JSON valid against the schema on every seed, on the char model and the real-proportion BPE model;
constrained and free rows in one batch; tool calls in each harness format that parse back into calls of the
offered tools with schema-valid arguments; hostile schemas refused quickly."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest
from realmodel import build_real_model

from pipeline.experience.toolcalls import assistant_message
from pipeline.modeling import grammar as G
from pipeline.modeling.grammar import (
    GrammarError,
    check_grammar,
    json_object_grammar,
    json_schema_grammar,
    tool_call_grammar,
)
from pipeline.serving.runtime import load_runtime
from serving.support import TIMER_TOOL, build_base, grammar_rows

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["a", "b", "c"]},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
    },
    "required": ["city", "count", "ok", "kind", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
TOOLS = [WEATHER, TIMER_TOOL]


@pytest.fixture(scope="module", params=["tiny", "real"])
def runtime(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    base = build_base(root / "base") if request.param == "tiny" else build_real_model(root / "base")
    return load_runtime(base, [], specialists=["chat"], device="cpu")


def _rows(rt, n, grammar, **kw):
    return grammar_rows(rt, n, grammar, prompt="answer {k} in JSON", **kw)


def test_json_schema_output_is_always_valid(runtime):
    results = runtime.generate(_rows(runtime, 24, json_schema_grammar(SCHEMA)))
    for r in results:
        assert r.finish_reason == "stop", r
        jsonschema.validate(json.loads(r.text), SCHEMA)
        assert r.completion_ids[-1] in runtime.end_ids  # it ended on an end token, allowed once complete
    assert len({r.text for r in results}) > 3  # the seeds make different objects


def test_free_rows_are_not_json(runtime):
    """The control: the same rows without a grammar do not give schema-valid JSON."""
    results = runtime.generate(_rows(runtime, 8, None))
    for r in results:
        with pytest.raises((ValueError, jsonschema.ValidationError)):
            jsonschema.validate(json.loads(r.text), SCHEMA)


def test_json_object_output_is_an_object(runtime):
    results = runtime.generate(_rows(runtime, 8, json_object_grammar(), new_tokens=400))
    for r in results:
        if r.finish_reason == "stop":
            assert isinstance(json.loads(r.text), dict)
        else:  # a random model may write a long object: what it wrote is a prefix of one
            assert r.text.startswith("{")


def test_constrained_and_free_rows_share_a_batch(runtime):
    spec = json_schema_grammar(SCHEMA)
    constrained, free = _rows(runtime, 4, spec), _rows(runtime, 4, None)
    mixed = [row for pair in zip(constrained, free, strict=True) for row in pair]
    together = runtime.generate(mixed)
    for r in together[::2]:
        jsonschema.validate(json.loads(r.text), SCHEMA)
    assert together[0].text == runtime.generate([constrained[0]])[0].text  # greedy: the same as alone
    assert together[1].text == runtime.generate([free[0]])[0].text


@pytest.mark.parametrize("fmt", ["json", "openai", "compact"])
@pytest.mark.parametrize("parallel", [True, False])
def test_tool_calls_parse_back_into_offered_tools(runtime, fmt, parallel):
    spec = tool_call_grammar(TOOLS, fmt=fmt, parallel=parallel)
    new_tokens = 480 if parallel else 120  # up to MAX_PARALLEL_CALLS calls
    if runtime.context_limit <= 128 and parallel:  # the char model: a list of calls may outgrow 128 tokens
        pytest.skip("parallel calls do not fit the char model's context")
    results = runtime.generate(_rows(runtime, 12, spec, new_tokens=new_tokens))
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    counts = set()
    for r in results:
        assert r.finish_reason == "stop", r
        message = assistant_message(r.text, list(params), fmt)
        calls = message.get("tool_calls")
        assert calls, r.text
        counts.add(len(calls))
        for call in calls:
            name = call["function"]["name"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), params[name])
    if not parallel:
        assert counts == {1}


@pytest.mark.parametrize("fmt", ["json", "openai", "compact"])
def test_a_named_tool_is_the_one_called(runtime, fmt):
    spec = tool_call_grammar([TIMER_TOOL], fmt=fmt, parallel=False)
    for r in runtime.generate(_rows(runtime, 6, spec)):
        calls = assistant_message(r.text, ["get_weather", "set_timer"], fmt)["tool_calls"]
        assert [c["function"]["name"] for c in calls] == ["set_timer"]


def _nested(depth):
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


HOSTILE = {
    "deep": _nested(300),
    "many alternatives": {
        "anyOf": [
            {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": f"^x{{{i}}}$"}}}
            for i in range(3000)
        ]
    },
    "big repeats": {"type": "string", "pattern": "^(a{2000}){2000}$"},
    "huge": {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(6000)}},
    "invalid": {"type": "object", "properties": {"a": {"type": "no-such-type"}}},
    "not an object": ["type", "object"],
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_schemas_are_refused_quickly(runtime, name):
    started = time.perf_counter()
    with pytest.raises(GrammarError):
        runtime.check_grammar(json_schema_grammar(HOSTILE[name]))
    assert time.perf_counter() - started < 2.0


def test_a_slow_compile_is_cut_at_the_deadline_and_remembered(runtime, monkeypatch):
    monkeypatch.setattr(G, "COMPILE_SECONDS", 0.001)
    schema = {
        "type": "object",
        "properties": {f"q{i}": {"type": "integer"} for i in range(400)},
    }
    spec = json_schema_grammar(schema)
    with pytest.raises(GrammarError, match="did not compile"):
        check_grammar(runtime.tokenizer, spec, vocab_size=runtime.vocab_size)
    monkeypatch.setattr(G, "COMPILE_SECONDS", 60.0)
    started = time.perf_counter()
    with pytest.raises(GrammarError):  # refused from the cache, not compiled again
        check_grammar(runtime.tokenizer, spec, vocab_size=runtime.vocab_size)
    assert time.perf_counter() - started < 0.1


def test_bad_tool_specs_are_refused():
    with pytest.raises(GrammarError, match="tool_call_format"):
        tool_call_grammar(TOOLS, fmt="xml", parallel=True)
    with pytest.raises(GrammarError, match="at least one tool"):
        tool_call_grammar([], fmt="json", parallel=True)
    with pytest.raises(GrammarError, match="name"):
        tool_call_grammar([{"type": "function", "function": {}}], fmt="json", parallel=True)


def test_compiling_is_cached(runtime):
    spec = json_schema_grammar({"type": "object", "properties": {"z": {"type": "boolean"}}})
    first = G.compile_grammar(runtime.tokenizer, spec, vocab_size=runtime.vocab_size)
    again = G.compile_grammar(runtime.tokenizer, spec, vocab_size=runtime.vocab_size)
    assert first is again
