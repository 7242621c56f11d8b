"""A row that cannot be rendered, encoded or stored never stops the loop: it is dropped and counted, and the
generation finishes (issue 22 §3: three triggers, each of which halted every `ratchet advance` of a lineage
until someone edited the database).

(a) a served trace whose client-sent tool-call ``arguments`` is an object beside the server's strings (Arrow
    refused the whole dataset); (b) a client's ``metadata.tools: [1]`` (training's chat template call and
    co-design's validation items raised); (c) a chat template that refuses a row (co-design raised)."""

from __future__ import annotations

import json
import shutil
import uuid
from typing import Any

import pytest
from conftest import init_with_corrections, write_specs

from pipeline.environment import reference_answer, sample_prompts
from pipeline.experience.eligibility import in_validation_slice
from pipeline.loop.advance import advance_once
from pipeline.loop.candidate import AdvanceConfig
from pipeline.registry import get_champion, get_engine, insert_traces, list_generations, session_scope

CONFIG = AdvanceConfig(prompts_per_specialist=8, samples_per_prompt=2, min_examples=2, validation_items=4,
                       seed=1, codesign=True)  # fmt: skip
SHARE = 0.1  # the contract's selection.validation_share (its default)
# A chat template that refuses any message containing this word (as real ones refuse what they do not take).
REFUSE = "REFUSE"
REFUSING = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if 'REFUSE' in (m['content'] or '') %}{{ raise_exception('this template refuses it') }}{% endif %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>{{ m['content'] or '' }}{{ eos_token }}"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] or '' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def serve(messages: list[dict[str, Any]], metadata: dict[str, Any], specialist: str) -> None:
    """Store a turn as the server stores what it served (``recorder.served_trace_row``; the baseline server
    stored any ``metadata.tools`` a client sent, so such rows are in registries already)."""
    from pipeline.serving.recorder import served_trace_row

    with session_scope(get_engine()) as session:
        champion = get_champion(session=session)
        row = served_trace_row(
            messages=messages,
            metadata=metadata,
            routes=[{"turn": len(messages) - 1, "specialist": specialist, "reason": "test", "scores": {}}],
            specialist=specialist,
            completion_id=f"chatcmpl-{uuid.uuid4().hex}",
            generation_id=champion.id,
            harness_version_id=champion.harness_version_id,
            principal=f"client-{uuid.uuid4().hex[:8]}",  # many clients: no principal's share is capped
        )
        assert insert_traces(session=session, rows=[row]) == 1


def call(expected: dict[str, Any], *, as_object: bool, **extra: Any) -> dict[str, Any]:
    args = expected["arguments"] if as_object else json.dumps(expected["arguments"])
    function = {"name": expected["name"], "arguments": args, **extra}
    return {"id": uuid.uuid4().hex[:9], "type": "function", "function": function}


def agent_turns(n: int, *, seed: int, object_args: bool, **extra: Any) -> None:
    """Served agent conversations: the client sends the earlier call back (its arguments an object when
    ``object_args``, as some clients do; ``extra`` fields beside them) and the server's reply is a correct
    call (arguments as text)."""
    items = sample_prompts("agent", 2 * n, seed=seed)
    for first, second in zip(items[::2], items[1::2], strict=True):
        earlier = call(first["metadata"]["expected_call"], as_object=object_args, **extra)
        messages = [
            *first["messages"],
            {"role": "assistant", "content": None, "tool_calls": [earlier]},
            {"role": "tool", "tool_call_id": earlier["id"], "content": "ok"},
            *second["messages"],
            {"role": "assistant", "content": None,
             "tool_calls": [call(second["metadata"]["expected_call"], as_object=False)]},
        ]  # fmt: skip
        serve(messages, second["metadata"], "agent")


def chat_turns(n: int, *, seed: int, validation: bool, metadata: dict | None = None, text: str = "") -> None:
    """``n`` correct served chat turns whose prompt is in chat's validation slice (``validation``) or not."""
    stored = 0
    for item in sample_prompts("chat", 2000, seed=seed):
        messages = [{"role": "user", "content": item["messages"][-1]["content"] + text},
                    {"role": "assistant", "content": reference_answer(item)}]  # fmt: skip
        if in_validation_slice(messages, SHARE) != validation:
            continue
        serve(messages, {**item["metadata"], **(metadata or {})}, "chat")
        stored += 1
        if stored == n:
            return
    raise AssertionError("not enough prompts")


def lineage_for(triggers: tuple[str, ...], small_base, tmp_path) -> None:
    """The demo lineage on the small base, chat learning from experience only (co-design validates on its
    validation slice), its tokenizer's chat template refusing ``REFUSE`` for trigger (c)."""
    import yaml

    base = small_base
    if "c" in triggers:
        base = tmp_path / "refusing-base"
        shutil.copytree(small_base, base)
        (base / "chat_template.jinja").write_text(REFUSING)
    specs = write_specs(tmp_path, base)
    contract = yaml.safe_load(specs["contract"].read_text())
    del contract["specialists"]["chat"]["tasks"]
    specs["contract"].write_text(yaml.safe_dump(contract))
    init_with_corrections(specs, tmp_path)
    chat_turns(8, seed=11, validation=True)  # good validation items for co-design
    chat_turns(8, seed=12, validation=False)  # good training rows


TRIGGERS = {
    # served with object arguments (stored as JSON text: kept), and a client's extra field of two types
    # across rows (no single column type: one of them dropped, "cannot be stored")
    "a": lambda: (
        agent_turns(4, seed=7, object_args=False),
        agent_turns(4, seed=8, object_args=True),
        agent_turns(1, seed=9, object_args=False, strict={"mode": 1}),
        agent_turns(1, seed=10, object_args=False, strict="yes"),
    ),
    # malformed tools on rows co-design validates on and on rows curation would train on
    "b": lambda: (
        chat_turns(3, seed=21, validation=True, metadata={"tools": [1]}),
        chat_turns(3, seed=22, validation=False, metadata={"tools": [1]}),
    ),
    # rows the chat template refuses, on both sides as well
    "c": lambda: (
        chat_turns(3, seed=31, validation=True, text=f" {REFUSE}"),
        chat_turns(3, seed=32, validation=False, text=f" {REFUSE}"),
    ),
}


@pytest.mark.parametrize(
    "triggers",
    [
        ("a", "b", "c"),
        *(pytest.param((t,), marks=pytest.mark.slow, id=f"only-{t}") for t in "abc"),  # each alone
    ],
)
def test_rows_that_cannot_be_rendered_encoded_or_stored_are_dropped_and_counted(
    triggers, small_base, tmp_path
):
    lineage_for(triggers, small_base, tmp_path)
    for t in triggers:
        TRIGGERS[t]()
    outcome = advance_once(config=CONFIG)
    assert outcome["generation"] == 1 and outcome["status"] in ("promoted", "rejected"), outcome
    with session_scope(get_engine()) as s:
        steps = list_generations(session=s)[1].state["steps"]
    curate, train, codesign = steps["curate"], steps["train"], steps["codesign"]
    assert curate["datasets"]["chat"]["rows"] > 0 and codesign["variants"], (curate, codesign)
    if "a" in triggers:
        assert curate["dropped"]["agent"].get("cannot be stored") == 1, curate["dropped"]
        assert curate["datasets"]["agent"]["rows"] >= 8  # the object arguments were stored as text
    if "b" in triggers:
        assert curate["dropped"]["chat"].get("malformed metadata.tools") == 3, curate["dropped"]
        assert codesign["skipped"].get("malformed metadata.tools") == 6, codesign  # as material, items
    if "c" in triggers:
        assert train["adapters"]["chat"]["dropped"].get("template error") == 3, train["adapters"]["chat"]
        assert codesign["skipped"].get("the chat template refuses the prompt", 0) >= 1, codesign


def test_tool_call_arguments_are_stored_as_json_text():
    from pipeline.experience.ingest import validate_trace
    from pipeline.serving.recorder import served_trace_row

    messages = [
        {"role": "user", "content": "add 2 eggs"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "abcdefghi", "type": "function", "function": {"name": "add_item", "arguments": {"qty": 2}}}]},
        {"role": "tool", "tool_call_id": "abcdefghi", "content": "ok"},
    ]  # fmt: skip
    row = served_trace_row(messages=messages, metadata={}, routes=[], specialist="agent", completion_id="c",
                           generation_id=None, harness_version_id=None, principal="p")  # fmt: skip
    stored = json.loads(row.messages)[1]["tool_calls"][0]["function"]
    assert stored["arguments"] == '{"qty":2}'
    ingested = validate_trace({"messages": messages})["messages"][1]["tool_calls"][0]["function"]
    assert ingested["arguments"] == '{"qty":2}' and messages[1]["tool_calls"][0]["function"]["arguments"] == {
        "qty": 2
    }  # the caller's object is not changed


@pytest.mark.parametrize(
    "tools", [[1], "x", [{"type": "function", "function": {"name": ""}}], [{"function": 3}]]
)
def test_malformed_metadata_tools_are_refused_at_the_server_and_at_ingest(tools):
    from pipeline.experience.ingest import TraceError, validate_trace
    from pipeline.serving.protocol import ApiError, ChatRequest, parse_body

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "metadata": {"tools": tools}}
    with pytest.raises(ApiError) as exc:
        parse_body(json.dumps(body).encode(), ChatRequest)
    assert exc.value.status == 400 and exc.value.message.startswith("metadata: tools")
    assert "\n" not in exc.value.message
    with pytest.raises(TraceError, match="metadata.tools"):
        validate_trace({"messages": body["messages"], "metadata": {"tools": tools}})
    ok = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert parse_body(json.dumps({**body, "metadata": {"tools": [ok]}}).encode(), ChatRequest).metadata
