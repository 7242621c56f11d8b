"""Per-specialist views (own turns verbatim, others as summaries), turn memory and tool-call formats."""

from __future__ import annotations

import json

import pytest

from pipeline.experience.toolcalls import from_openai, parse_tool_calls, render_tool_calls, to_openai
from pipeline.serving.views import (
    ContextOverflowError,
    TurnMemory,
    TurnRecord,
    build_view,
    extract_summary,
    summary_messages,
)
from pipeline.specs.harness import HarnessSpec
from serving.support import HARNESS


def harness(**context):
    return HarnessSpec.model_validate({**HARNESS, "context": {**HARNESS["context"], **context}})


def chars(messages):
    return sum(len(m.get("content") or "") for m in messages)


CONVO = [
    {"role": "user", "content": "f adds 1 2"},
    {"role": "assistant", "content": "def f(x):return x+3"},
    {"role": "user", "content": "counter 1+2"},
    {"role": "assistant", "content": '{"type":"counter","value":3}'},
    {"role": "user", "content": "and now?"},
]


@pytest.fixture
def memory():
    mem = TurnMemory()
    mem.remember(CONVO[1], TurnRecord("coding", "wrote f adding 3"))
    mem.remember(CONVO[3], TurnRecord("genui", "showed a counter at 3"))
    return mem


def test_own_turns_verbatim_others_as_summaries(memory):
    view = build_view(CONVO, "coding", harness=harness(), memory=memory, count_tokens=chars, max_new_tokens=8)
    assert view[0] == {"role": "system", "content": "code"}
    assert view[2] == {"role": "assistant", "content": "def f(x):return x+3"}
    assert view[4] == {"role": "assistant", "content": "[genui] showed a counter at 3"}
    assert view[-1]["content"] == "and now?"


def test_full_and_hide_policies(memory):
    full = build_view(
        CONVO,
        "chat",
        harness=harness(other_specialists="full"),
        memory=memory,
        count_tokens=chars,
        max_new_tokens=8,
    )
    assert [m["content"] for m in full[1:]] == [m["content"] for m in CONVO]
    hidden = build_view(
        CONVO,
        "chat",
        harness=harness(other_specialists="hide"),
        memory=memory,
        count_tokens=chars,
        max_new_tokens=8,
    )
    assert [m["role"] for m in hidden] == ["system", "user", "user", "user"]


def test_client_system_prompt_is_appended_and_unknown_turns_are_verbatim():
    convo = [{"role": "system", "content": "be brief"}, *CONVO]
    view = build_view(
        convo, "chat", harness=harness(), memory=TurnMemory(), count_tokens=chars, max_new_tokens=8
    )
    assert view[0]["content"] == "chat\n\nbe brief"
    assert view[2]["content"] == "def f(x):return x+3"


def test_keep_turns_and_budget_trim_oldest_first(memory):
    view = build_view(
        CONVO, "coding", harness=harness(keep_turns=1), memory=memory, count_tokens=chars, max_new_tokens=8
    )
    assert [m["content"] for m in view[1:]] == ["counter 1+2", "[genui] showed a counter at 3", "and now?"]
    small = build_view(
        CONVO,
        "coding",
        harness=harness(),
        memory=memory,
        count_tokens=chars,
        max_new_tokens=8,
        context_limit=30,
    )
    assert [m["content"] for m in small] == ["code", "and now?"]
    with pytest.raises(ContextOverflowError, match="context window of 12"):
        build_view(
            CONVO,
            "coding",
            harness=harness(),
            memory=memory,
            count_tokens=chars,
            max_new_tokens=8,
            context_limit=12,
        )


def test_other_specialists_tool_calls_and_results_are_replaced_by_the_summary():
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "set_timer", "arguments": '{"minutes":7}'},
    }
    convo = [
        {"role": "user", "content": "timer 3+4"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "started"},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "f adds 1 1"},
    ]
    mem = TurnMemory()
    mem.remember(convo[1], TurnRecord("agent", extract_summary(convo[1])))
    mem.remember(convo[3], TurnRecord("agent", "timer set"))
    assert mem.issuers(convo) == {"call_1": "agent"}
    view = build_view(convo, "coding", harness=harness(), memory=mem, count_tokens=chars, max_new_tokens=8)
    assert [m["content"] for m in view[1:]] == [
        "timer 3+4",
        "[agent] called set_timer(minutes=7)",
        "[agent] timer set",
        "f adds 1 1",
    ]
    own = build_view(convo, "agent", harness=harness(), memory=mem, count_tokens=chars, max_new_tokens=8)
    assert own[2]["tool_calls"] == [call] and own[3]["role"] == "tool"


def test_summary_prompt_and_extractive_summary():
    msgs = summary_messages([{"role": "user", "content": "hi"}], {"role": "assistant", "content": "hello"})
    assert msgs[-1]["role"] == "user" and msgs[-2]["content"] == "hello"
    assert len(extract_summary({"role": "assistant", "content": "x " * 500})) <= 160


def test_tool_call_formats_parse_and_render():
    assert parse_tool_calls("set_timer(minutes=7)", ["set_timer"], "openai") == [
        {"name": "set_timer", "arguments": {"minutes": 7}}
    ]
    assert parse_tool_calls('{"name":"set_timer","arguments":{"minutes":7}}', ["set_timer"]) == [
        {"name": "set_timer", "arguments": {"minutes": 7}}
    ]
    assert parse_tool_calls('<tool_call>[{"name":"a","arguments":"{}"}]</tool_call>', ["a"]) == [
        {"name": "a", "arguments": {}}
    ]
    assert parse_tool_calls("set_timer(minutes=7)", ["add_item"]) is None  # not an offered tool
    assert parse_tool_calls("hello world", ["set_timer"]) is None
    assert parse_tool_calls("set_timer(minutes=7)", []) is None
    calls = [{"name": "set_timer", "arguments": {"minutes": 7}}]
    assert render_tool_calls(calls, "compact") == "set_timer(minutes=7)"
    assert json.loads(render_tool_calls(calls)) == calls[0]
    oa = to_openai(calls, seed_text="x")
    assert oa[0]["function"]["name"] == "set_timer" and from_openai(oa) == calls
    assert to_openai(calls, seed_text="x") == oa and to_openai(calls, seed_text="y") != oa
    with pytest.raises(ValueError, match="unknown tool_call_format"):
        render_tool_calls(calls, "xml")


def test_no_system_prompt_exemplars_and_character_budget(memory):
    exemplar = {"messages": [{"role": "user", "content": "1+1=?"}, {"role": "assistant", "content": "2"}]}
    spec = {
        **HARNESS,
        "specialists": {
            **HARNESS["specialists"],
            "coding": {"system_prompt": "code", "exemplars": [exemplar, exemplar]},
        },
    }
    spec["context"] = {**HARNESS["context"], "include_system_prompt": False, "max_context_chars": 60}
    h = HarnessSpec.model_validate(spec)
    view = build_view(
        [{"role": "system", "content": "x"}, *CONVO],
        "coding",
        harness=h,
        memory=memory,
        count_tokens=chars,
        max_new_tokens=8,
    )
    assert view[0]["role"] != "system"  # neither the harness's nor the client's system prompt
    assert view[:2] == exemplar["messages"] and len(view) < 2 * 2 + len(CONVO)  # budget trimmed something
    with pytest.raises(ContextOverflowError):
        build_view(
            [{"role": "user", "content": "y" * 60}],
            "coding",
            harness=h,
            memory=memory,
            count_tokens=chars,
            max_new_tokens=8,
        )


def test_demo_harness_on_the_contracts_routing_suite():
    """The routing suite is written unlike the signal patterns: accuracy is measured, not true by design."""
    from pipeline.serving.routereval import measure_router, suite_items
    from pipeline.specs.contract import load_contract
    from pipeline.specs.harness import load_harness

    harness = load_harness("harnesses/demo.yaml")
    items = suite_items(load_contract("contracts/demo.yaml"))
    result = measure_router(harness, items)
    assert result["total"] == len(items) == 32 and result["harness_version"] == harness.version
    assert 0.75 <= result["accuracy"] < 1.0
    assert sum(sum(row.values()) for row in result["confusion"].values()) == 32


def test_learned_router_trained_from_traces_and_measured():
    from pipeline.environment import FAMILIES, sample_prompts
    from pipeline.serving.routereval import fit_router_classifier, measure_router, routing_items, suite_items
    from pipeline.specs.contract import load_contract
    from pipeline.specs.harness import load_harness

    traces = [
        {**item, "metadata": {"specialist": fam}}
        for fam in FAMILIES
        for item in sample_prompts(fam, 30, seed=3)
    ]
    clf = fit_router_classifier(routing_items(traces), list(FAMILIES))
    assert max(clf.scores("timer 12+30"), key=clf.scores("timer 12+30").get) == "agent"
    demo = load_harness("harnesses/demo.yaml")
    learned = demo.model_copy(update={"routing": demo.routing.model_copy(update={"mode": "learned"})})
    result = measure_router(learned, suite_items(load_contract("contracts/demo.yaml")), classifier=clf)
    assert result["mode"] == "learned" and result["total"] == 32 and result["by_method"] == {"learned": 32}


def test_training_rebuilds_the_view_the_server_showed_from_the_recorded_trace(memory):
    """Found on main: curation rendered what a specialist saw with other specialists' turns in full, where the
    server had shown it their summaries. Curation now rebuilds the view with the same function from the served
    trace's recorded routes and summaries (``recorded_writer``), and gets what the server built."""
    from pipeline.modeling.prompting import render_messages
    from pipeline.serving.views import recorded_writer

    served = build_view(
        CONVO, "coding", harness=harness(), memory=memory, count_tokens=chars, max_new_tokens=8
    )
    routes = [
        {"turn": 1, "specialist": "coding"},
        {"turn": 3, "specialist": "genui"},
        {"turn": 5, "specialist": "coding"},
    ]
    metadata = {"summaries": {"1": "wrote f adding 3", "3": "showed a counter at 3"}}
    rebuilt = render_messages(harness(), "coding", CONVO, writer=recorded_writer(routes, metadata))
    assert rebuilt == served
    assert '{"type":"counter","value":3}' not in json.dumps(rebuilt)  # the other specialist's reply itself
    # odd shapes in a stored trace are ignored, not trusted or crashed on
    odd = recorded_writer([{"turn": "1", "specialist": 5}, "x", None], {"summaries": ["no"]})
    assert (
        render_messages(harness(), "coding", CONVO, writer=odd)[4]["content"]
        == '{"type":"counter","value":3}'
    )


def test_a_client_system_message_in_content_parts_is_read_as_text():
    """Found on main: a client system message sent as content parts reached training as
    "[{'type': 'text', ...}]". Every view reads content parts with the one text reader."""
    from pipeline.modeling.prompting import render_messages

    convo = [
        {
            "role": "system",
            "content": [{"type": "text", "text": "Answer in "}, {"type": "text", "text": "French."}],
        },
        {"role": "user", "content": [{"type": "text", "text": "12+35=?"}]},
    ]
    trained = render_messages(harness(), "chat", convo)
    served = build_view(
        convo, "chat", harness=harness(), memory=TurnMemory(), count_tokens=chars, max_new_tokens=8
    )
    assert trained == served
    assert trained[0] == {"role": "system", "content": "chat\n\nAnswer in French."}
    assert trained[-1] == {"role": "user", "content": "12+35=?"}
