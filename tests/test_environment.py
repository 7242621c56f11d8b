"""The task environment: formats, verifiers, the held-out split and the tool-call substrate."""

from __future__ import annotations

import json

import pytest

from pipeline.environment import (
    FAMILIES,
    apply_call,
    completion_trace,
    format_compact_call,
    heldout_suite,
    initial_state,
    is_heldout,
    make_item,
    parse_compact_call,
    reference_answer,
    sample_prompts,
    split_of,
    training_corpus,
    verify,
)


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_answers_verify_and_wrong_sums_do_not(family):
    for item in sample_prompts(family, 40, seed=3):
        answer = reference_answer(item)
        assert verify(item, answer)[0], (item, answer)
        total = str(sum(int(x) for x in item["metadata"]["task_id"].rsplit(":", 1)[1].split("+")))
        wrong = answer.replace(total, str(int(total) + 1))
        assert not verify(item, wrong)[0]
        assert not verify(item, "")[0]


def test_generators_are_deterministic_by_seed():
    assert sample_prompts("chat", 20, 1) == sample_prompts("chat", 20, 1)
    assert sample_prompts("chat", 20, 1) != sample_prompts("chat", 20, 2)
    assert heldout_suite("genui", 30, 0) == heldout_suite("genui", 30, 0)
    assert training_corpus(16, 5) == training_corpus(16, 5)


def test_heldout_split_is_disjoint_from_training_streams():
    heldout_pairs = {(a, b) for a in range(10, 100) for b in range(10, 100) if split_of(a, b) == "heldout"}
    assert 0.15 < len(heldout_pairs) / 8100 < 0.25
    for family in FAMILIES:
        for item in sample_prompts(family, 300, seed=0):
            assert item["metadata"]["split"] == "train" and not is_heldout(item["metadata"]["task_id"])
        suite = heldout_suite(family, 100, seed=0)
        assert len({i["metadata"]["task_id"] for i in suite}) == 100
        assert all(
            i["metadata"]["split"] == "heldout" and is_heldout(i["metadata"]["task_id"]) for i in suite
        )
    corpus = training_corpus(400, seed=0)
    assert {t["metadata"]["task"] for t in corpus} == set(FAMILIES)
    assert not any(is_heldout(t["metadata"]["task_id"]) for t in corpus)
    with pytest.raises(ValueError):
        is_heldout("nonsense")


def test_traces_follow_the_shared_conventions():
    item = make_item("agent", 12, 35, variant=1)
    meta = item["metadata"]
    assert meta["task"] == "agent" and meta["specialist"] == "agent" and meta["split"] in ("train", "heldout")
    assert meta["expected_call"] == {"name": "add_item", "arguments": {"name": "egg", "qty": 47}}
    trace = completion_trace(item, "add_item(name=egg,qty=47)")
    msg = trace["messages"][-1]
    assert msg["role"] == "assistant" and msg["content"] is None
    call = msg["tool_calls"][0]
    assert call["type"] == "function" and call["function"]["name"] == "add_item"
    assert json.loads(call["function"]["arguments"]) == {"name": "egg", "qty": 47}
    assert completion_trace(item, "garbage")["messages"][-1] == {"role": "assistant", "content": "garbage"}
    coding = make_item("coding", 12, 35)
    assert "assert f(0)==47" in coding["metadata"]["tests"]
    genui = make_item("genui", 12, 35)
    assert genui["metadata"]["schema"]["properties"]["value"]["const"] == 47


def test_compact_tool_calls_round_trip_and_reject_malformed_text():
    call = {"name": "add_item", "arguments": {"qty": 7, "name": "tea"}}
    text = format_compact_call(call["name"], call["arguments"])
    assert text == "add_item(name=tea,qty=7)"
    assert parse_compact_call(text) == {"name": "add_item", "arguments": {"name": "tea", "qty": 7}}
    assert parse_compact_call("set_timer()") == {"name": "set_timer", "arguments": {}}
    for bad in ("set_timer(minutes=4", "set_timer(minutes)", "x(a=1,a=2)", "1abc(a=1)", "set_timer(m=(1))"):
        assert parse_compact_call(bad) is None, bad


def test_agent_verifier_checks_schema_and_resulting_state():
    item = make_item("agent", 20, 22, variant=0)
    assert verify(item, "set_timer(minutes=42)")[0]
    ok, details = verify(item, "set_timer(minutes=abc)")
    assert not ok and "arguments" in details["error"]
    ok, details = verify(item, "add_item(name=egg,qty=42)")
    assert not ok and details["state"]["cart"] == {"egg": 42}
    assert not verify(item, "launch(x=1)")[0]
    state = apply_call(apply_call(initial_state(), {"name": "add_item", "arguments": {"name": "jam", "qty": 2}}),
                       {"name": "add_item", "arguments": {"name": "jam", "qty": 3}})  # fmt: skip
    assert state["cart"] == {"jam": 5}


def test_coding_verifier_sandbox_rejects_anything_but_arithmetic():
    item = make_item("coding", 30, 12)
    assert verify(item, "def f(x):return x+42")[0]
    assert verify(item, "def f(x):return x+30+12")[0]  # any correct program passes
    for bad in ("def f(x):return x+41", "import os", "def f(x):\n while 1: pass", "def f(x):return open(x)",
                "def f(:", "def f(x):return x+10**9999"):  # fmt: skip
        ok, details = verify(item, bad)
        assert not ok and details.get("error"), bad


def test_genui_verifier_uses_the_item_schema():
    item = make_item("genui", 50, 50, variant=1)
    assert verify(item, '{"type":"progress","percent":100}')[0]
    assert not verify(item, '{"type":"progress","percent":101}')[0]
    assert not verify(item, '{"type":"counter","percent":100}')[0]
    assert not verify(item, '{"type":"progress","percent":100')[0]


# ---------------------------------------------------------------------------------- canonical problems
@pytest.mark.parametrize(
    "text",
    ["15+42=?", "15+42", "42+15=?", "15 + 42 =", "what is 15 plus 42?", "fifteen plus forty-two =?",
     "Fifteen plus FORTY TWO", "fortytwo and fifteen", "f adds 42 15", "timer 15+42", "add 15+42 egg",
     "counter 42+15", "progress 15+42", "the sum of 15 and 42", "add 42 to 15", "15 added to 42",
     "1 5 + 4 2", "１５＋４２", "15\u200b+42", "sum: 15, 42", "10+15+42"],
)  # fmt: skip
def test_the_problem_is_recognised_however_written(text):
    from pipeline.environment.problems import problem_keys

    assert ("add", 15, 42) in problem_keys([{"role": "user", "content": text}])


@pytest.mark.parametrize(
    "text",
    ["115+42", "15+421", "15-42", "15*42", "fifteen, then forty-two", "def f(x):return x+57",
     '{"type":"counter","value":57}', "add_item(name=egg,qty=57)", "fourteen someone often", "x+15 y+42"],
)  # fmt: skip
def test_other_texts_pose_other_problems_or_none(text):
    from pipeline.environment.problems import problem_keys

    assert ("add", 15, 42) not in problem_keys([{"role": "user", "content": text}])


def test_every_message_and_part_is_read():
    from pipeline.environment.problems import problem_keys

    messages = [
        {"role": "user", "content": [{"type": "text", "text": "15"}, {"type": "text", "text": "+42"}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"function": {"name": "calc", "arguments": '{"q": "20 plus 37"}'}}]},
        {"role": "tool", "content": "ten and eleven", "tool_call_id": "c"},
    ]  # fmt: skip
    assert problem_keys(messages) == {("add", 15, 42), ("add", 20, 37), ("add", 10, 11)}
    assert problem_keys([{"role": "user", "content": 7}, "junk", {"role": "user"}]) == frozenset()


def test_the_canonical_form_finds_every_held_out_pair_and_no_other_in_all_formats():
    """Every item of every pair, family and format: its canonical key is its own unordered pair, so the
    held-out predicate excludes no train or validation item (the split is by that pair)."""
    from pipeline.environment.problems import problem_keys

    for a in range(10, 100):
        for b in range(10, 100):
            for family in FAMILIES:
                for variant in range(12 if family == "agent" else 2 if family == "genui" else 1):
                    item = make_item(family, a, b, variant)
                    trace = completion_trace(item, reference_answer(item))
                    assert problem_keys(trace["messages"]) == {("add", min(a, b), max(a, b))}, trace
