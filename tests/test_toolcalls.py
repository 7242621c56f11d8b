"""One reader of tool calls for the loop and the server: tagged JSON blocks, JSON content, compact text."""

from __future__ import annotations

import json

from pipeline.experience.toolcalls import answered_trace, assistant_message, split_tool_calls

NAMES = ["set_timer", "add_item"]


def test_tagged_blocks_after_prose():
    text = (
        'Sure.\n<tool_call>\n{"name": "set_timer", "arguments": {"minutes": 5}}\n</tool_call>\n'
        '<tool_call>{"name": "add_item", "arguments": "{\\"name\\": \\"egg\\", \\"qty\\": 2}"}</tool_call>'
    )
    content, calls = split_tool_calls(text, NAMES, "openai")
    assert content == "Sure."
    assert calls == [
        {"name": "set_timer", "arguments": {"minutes": 5}},
        {"name": "add_item", "arguments": {"name": "egg", "qty": 2}},
    ]


def test_what_is_not_a_call_stays_text():
    for text in (
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not an offered tool
        '<tool_call>{"name": "set_timer", "arguments": {}}</tool_call> and then some prose',
        "<tool_call>not json</tool_call>",
        "set a timer for 5 minutes",
    ):
        assert split_tool_calls(text, NAMES, "openai") == (text, None), text
    assert split_tool_calls("set_timer(minutes=5)", [], "compact") == ("set_timer(minutes=5)", None)


def test_assistant_message_and_answered_trace():
    msg = assistant_message("set_timer(minutes=5)", NAMES, "compact", seed_text="t")
    assert msg["content"] is None and json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {
        "minutes": 5
    }
    assert assistant_message("set_timer(minutes=5)", NAMES, "compact", seed_text="t") == msg  # stable ids
    assert assistant_message("hello", NAMES, "openai") == {"role": "assistant", "content": "hello"}
    item = {
        "messages": [{"role": "user", "content": "timer 5"}],
        "metadata": {"tools": [{"type": "function", "function": {"name": "set_timer"}}]},
    }
    trace = answered_trace(item, '{"name": "set_timer", "arguments": {"minutes": 5}}', fmt="json")
    assert trace["messages"][-1]["tool_calls"][0]["function"]["name"] == "set_timer"
    assert answered_trace({**item, "metadata": {}}, "set_timer(minutes=5)", fmt="compact")["messages"][
        -1
    ] == {
        "role": "assistant",
        "content": "set_timer(minutes=5)",
    }  # no tool offered: text


def test_a_number_longer_than_python_converts_is_not_a_call_and_never_a_crash():
    """Hostile model output: 5,000 digits in a call's argument (Python refuses more than 4,300)."""
    from pipeline.experience.toolcalls import assistant_message, from_openai

    huge = "9" * 5000
    for fmt, text in (("compact", f"set_timer(minutes={huge})"),
                      ("json", f'{{"name": "set_timer", "arguments": {{"minutes": {huge}}}}}'),
                      ("json", f'<tool_call>{{"name": "set_timer", "arguments": {{"minutes": {huge}}}}}</tool_call>')):  # fmt: skip
        assert assistant_message(text, ["set_timer"], fmt) == {"role": "assistant", "content": text}
    call = {"function": {"name": "set_timer", "arguments": f'{{"minutes": {huge}}}'}}
    assert from_openai([call])[0]["arguments"] == {"_raw": f'{{"minutes": {huge}}}'}


def test_tool_call_ids_are_nine_alphanumerics_every_template_accepts():
    """Mistral's templates refuse any id but 9 letters and digits; every family takes those. New ids have that
    shape; an ingested OpenAI id is mapped to it the same way each time (a call and its result still match)."""
    import re

    from pipeline.experience.toolcalls import call_id, openai_tool_call, template_call_id, to_openai

    ids = [
        tc["id"] for tc in to_openai([{"name": "set_timer", "arguments": {"minutes": m}} for m in range(50)])
    ]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids) and len(set(ids)) == 50
    assert openai_tool_call({"name": "a", "arguments": {}}, seed_text="s")["id"] == call_id(
        's{"arguments": {}, "name": "a"}'
    )
    assert (
        template_call_id("call_3f9a0c1b2d4e") == template_call_id("call_3f9a0c1b2d4e") != "call_3f9a0c1b2d4e"
    )
    assert re.fullmatch(r"[A-Za-z0-9]{9}", template_call_id("call_3f9a0c1b2d4e"))
    assert template_call_id("abcDEF123") == "abcDEF123"  # already fits: unchanged
    assert re.fullmatch(r"[A-Za-z0-9]{9}", template_call_id(None))
