"""What the model is given: system prompt, exemplars and the conversation trimmed to the context policy."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from pipeline.errors import RatchetError
from pipeline.experience.toolcalls import call_id
from pipeline.modeling.prompting import (
    MESSAGE_OVERHEAD_CHARS,
    PROMPT_OVERHEAD_CHARS,
    call_text,
    decoding_for,
    exemplar_messages,
    message_chars,
    prompt_budget_chars,
    prompt_chars,
    render_messages,
)
from pipeline.specs.harness import HarnessSpec, load_harness

ROOT = Path(__file__).resolve().parents[1]
DEMO = yaml.safe_load((ROOT / "harnesses" / "demo.yaml").read_text())

TIMER = {"role": "user", "content": "timer 5+7"}
TIMER_CALL = {
    "role": "assistant",
    "tool_calls": [{"name": "set_timer", "arguments": {"minutes": 12}}],
}


def harness(**context) -> HarnessSpec:
    data = copy.deepcopy(DEMO)
    data["context"].update(context)
    data["specialists"]["agent"]["exemplars"] = [{"messages": [TIMER, TIMER_CALL]}]
    data["specialists"]["chat"]["exemplars"] = [
        {"messages": [{"role": "user", "content": f"{i}+1=?"}, {"role": "assistant", "content": str(i + 1)}]}
        for i in range(10, 13)
    ]
    return HarnessSpec.model_validate(data)


def turn(text: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]


def test_demo_harness_gives_the_tiny_model_bare_turns():
    h = load_harness(ROOT / "harnesses" / "demo.yaml")
    convo = [{"role": "system", "content": "client rules"}, {"role": "user", "content": "12+35=?"}]
    assert render_messages(h, "chat", convo) == [{"role": "user", "content": "12+35=?"}]


def test_system_prompt_with_slots_and_client_system_messages():
    h = harness(include_system_prompt=True)
    convo = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "12+35=?"}]
    out = render_messages(h, "chat", convo)
    assert out[0] == {
        "role": "system",
        "content": "You add numbers. Answer with the number only.\n\nBe kind.",
    }
    assert out[-1] == {"role": "user", "content": "12+35=?"}
    assert [m["content"] for m in out[1:7:2]] == ["10+1=?", "11+1=?", "12+1=?"]  # exemplars, in order


def test_exemplar_tool_calls_are_openai_messages():
    h = harness()
    (ex,) = exemplar_messages(h, "agent")
    assert ex[0] == TIMER
    (tc,) = ex[1]["tool_calls"]
    assert ex[1]["content"] is None and tc["type"] == "function" and tc["id"] == call_id("exemplar:0:1:0")
    assert len(tc["id"]) == 9 and tc["id"].isalnum()  # the one id shape every chat template takes
    assert tc["function"] == {"name": "set_timer", "arguments": '{"minutes":12}'}
    # Counted as the model writes it: compact text here.
    assert message_chars(ex[1], "compact") == len("set_timer(minutes=12)") + MESSAGE_OVERHEAD_CHARS
    assert (
        call_text("set_timer", {"minutes": 12}, "json") == '{"name":"set_timer","arguments":{"minutes":12}}'
    )


def test_keep_turns_and_char_budget_drop_oldest_turns_then_exemplars():
    convo = (
        turn("10+10=?", "20")
        + turn("11+11=?", "22")
        + turn("12+12=?", "24")
        + [{"role": "user", "content": "9+9=?"}]
    )
    wide = render_messages(harness(keep_turns=2, max_context_chars=1000), "chat", convo)
    contents = [m["content"] for m in wide]
    assert contents[:6] == ["10+1=?", "11", "11+1=?", "12", "12+1=?", "13"]
    assert contents[6:] == ["11+11=?", "22", "12+12=?", "24", "9+9=?"]  # keep_turns=2: oldest turn gone
    assert render_messages(harness(keep_turns=0, max_context_chars=1000), "chat", convo)[6:] == convo[-1:]

    # An exemplar costs 12 chars, a past turn 13, the newest turn 7 + 2; the prompt budget is 64 - 8 = 56.
    tight = render_messages(harness(keep_turns=2, max_context_chars=64), "chat", convo)
    assert prompt_chars(tight) <= prompt_budget_chars(harness(max_context_chars=64), "chat") == 56
    assert [m["content"] for m in tight] == ["10+1=?", "11", "11+1=?", "12", "12+1=?", "13", "9+9=?"]
    tighter = render_messages(harness(keep_turns=2, max_context_chars=41), "chat", convo)
    assert [m["content"] for m in tighter] == ["10+1=?", "11", "11+1=?", "12", "9+9=?"]


def test_the_newest_user_turn_is_always_kept():
    long = {"role": "user", "content": "x" * 500}
    h = harness(max_context_chars=64)
    assert render_messages(h, "chat", [*turn("1+1=?", "2"), long]) == [long]
    # The current turn runs from the newest user message on (a tool round-trip stays whole).
    convo = [
        TIMER,
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "tool", "content": "ok"},
    ]
    # (each message as a chat template takes it: an empty tool-call list carries nothing)
    assert render_messages(h, "agent", convo)[-3:] == [
        TIMER,
        {"role": "assistant", "content": None},
        convo[2],
    ]


def test_budget_from_tokens_when_no_char_budget():
    h = harness(max_context_chars=None, max_context_tokens=20)
    assert prompt_budget_chars(h, "chat") == (20 - 8) * 4
    assert prompt_budget_chars(h, "chat", chars_per_token=1.0) == 12
    out = render_messages(h, "chat", [{"role": "user", "content": "1+1=?"}], chars_per_token=1.0)
    assert out == [{"role": "user", "content": "1+1=?"}]  # 12 chars: no exemplar fits


def test_decoding_for_and_unknown_specialists():
    h = harness()
    dec = decoding_for(h, "genui")
    assert (dec.temperature, dec.max_new_tokens, dec.stop) == (0.0, 40, ["\n"])
    dec.max_new_tokens = 1
    assert decoding_for(h, "genui").max_new_tokens == 40  # a copy
    with pytest.raises(RatchetError, match=r"no specialist 'poet' \(declared: chat, agent, coding, genui\)"):
        render_messages(h, "poet", [])


def test_prompt_chars_bound_the_tiny_models_tokens():
    """The character count is an upper bound of the tiny tokenizer's prompt length (role markers, bos)."""
    tinymodel = pytest.importorskip("pipeline.environment.tinymodel")
    from pipeline.modeling.packing import render_prompt

    tok = tinymodel.build_tokenizer()
    h = harness(include_system_prompt=True)
    for name, convo in [("chat", [{"role": "user", "content": "12+35=?"}]), ("agent", [TIMER])]:
        msgs = render_messages(h, name, convo)
        ids = tok(render_prompt(tok, msgs), add_special_tokens=False)["input_ids"]
        assert (
            len(ids)
            <= prompt_chars(msgs, h.tool_call_format)
            <= len(ids) + 2 * len(msgs) + PROMPT_OVERHEAD_CHARS
        )
    assert json.loads(exemplar_messages(h, "agent")[0][1]["tool_calls"][0]["function"]["arguments"]) == {
        "minutes": 12
    }
