"""Chat rendering for a real tokenizer: tool calls per format, tool schemas to the template, labels only on
the model's own turn -- also under templates that are not prefix-stable."""

from __future__ import annotations

import json
import logging

import pytest
from realmodel import CHATML, train_tokenizer

from pipeline.modeling.packing import IGNORE, encode_chat, model_messages, render_prompt

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "set_timer",
            "description": "Start a timer.",
            "parameters": {"type": "object", "properties": {"minutes": {"type": "integer"}}},
        },
    }
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "set_timer", "arguments": '{"minutes": 47}'}}
CONVERSATION = [
    {"role": "system", "content": "Act through tools."},
    {"role": "user", "content": "timer 47"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "started"},
    {"role": "assistant", "content": "Done: 47 minutes."},
]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer("bytelevel")


def labelled_text(tok, ids, labels) -> str:
    return tok.decode([i for i, lab in zip(ids, labels, strict=True) if lab != IGNORE])


def test_openai_format_keeps_structured_calls_and_ids():
    msgs = model_messages(CONVERSATION, "openai")
    assert msgs[2]["tool_calls"][0]["function"] == {"name": "set_timer", "arguments": {"minutes": 47}}
    # an ingested OpenAI id is given to the template as 9 alphanumerics (what every family takes), the same
    # in the call and in its result
    called = msgs[2]["tool_calls"][0]["id"]
    assert msgs[3]["tool_call_id"] == called and len(called) == 9 and called.isalnum() and called != "call_1"
    compact = model_messages(CONVERSATION, "compact")
    assert compact[2] == {"role": "assistant", "content": "set_timer(minutes=47)"}
    assert json.loads(model_messages(CONVERSATION, "json")[2]["content"]) == {
        "name": "set_timer",
        "arguments": {"minutes": 47},
    }


def test_tool_schemas_and_calls_reach_the_template(tok):
    prompt = render_prompt(tok, CONVERSATION[:4], fmt="openai", tools=TOOLS)
    assert '"name": "set_timer"' in prompt and "<tools>" in prompt  # the schema, from tools=
    assert '<tool_call>\n{"name": "set_timer", "arguments": {"minutes": 47}}\n</tool_call>' in prompt
    assert "<tool_response>\nstarted\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_labels_cover_only_the_final_turn(tok):
    ids, labels = encode_chat(tok, CONVERSATION, 512, fmt="openai", tools=TOOLS)
    assert labelled_text(tok, ids, labels) == "Done: 47 minutes.<|im_end|>\n"
    ids, labels = encode_chat(tok, CONVERSATION[:3], 512, fmt="openai", tools=TOOLS)
    text = labelled_text(tok, ids, labels)
    assert text.startswith("<tool_call>") and '"minutes": 47' in text and "<tools>" not in text


FORCED_THINK = CHATML.replace(
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' -}}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' -}}",
)
DROPS_HISTORY = CHATML.replace(
    "{{- '<|im_start|>assistant\\n' + (m.content or '') -}}",
    "{{- '<|im_start|>assistant\\n' + ((m.content or '') if loop.last else (m.content or '').split('</think>')[-1]) -}}",
)


def test_a_template_that_forces_a_think_prefix_is_handled(tok, caplog):
    """DeepSeek-R1-style: the generation prompt opens ``<think>``, the stored turn has none. Not a crash:
    labels start where the two renders differ, on the model's own text."""
    tok = train_tokenizer("bytelevel")
    tok.chat_template = FORCED_THINK
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Résumé 😀"}]
    ids, labels = encode_chat(tok, msgs, 512)
    assert labelled_text(tok, ids, labels) == "Résumé 😀<|im_end|>\n"


def test_a_template_that_rewrites_history_labels_only_the_last_turn(tok):
    """Qwen3-style: earlier turns lose their reasoning; the trained turn is rendered whole."""
    tok = train_tokenizer("bytelevel")
    tok.chat_template = DROPS_HISTORY
    msgs = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>x</think>first"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "<think>y</think>second"},
    ]
    ids, labels = encode_chat(tok, msgs, 512)
    assert labelled_text(tok, ids, labels) == "<think>y</think>second<|im_end|>\n"
    assert "<think>x</think>" not in tok.decode(ids)


def test_a_template_that_rewrites_the_trained_turn_is_refused(tok):
    tok = train_tokenizer("bytelevel")
    tok.chat_template = FORCED_THINK.replace("(m.content or '')", "(m.content or '') | upper")
    with pytest.raises(ValueError, match="rewrites the final assistant turn"):
        encode_chat(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "quiet"}], 512)
    logging.getLogger(__name__).info("refused as expected")


def test_packed_tensors_give_each_segments_cumulative_lengths():
    """``cu_seq_lens`` marks where every example and every row's trailing padding starts, over the
    flattened rows (flash-attention's varlen convention): exactly the positions that restart at 0."""
    from pipeline.modeling.packing import packed_tensors

    examples = [([7] * n, [IGNORE] + [7] * (n - 1)) for n in (5, 9, 3, 12, 1, 4)]
    batch = packed_tensors(examples, 12, 0)
    cu = batch["cu_seq_lens"]
    flat = batch["position_ids"].flatten().tolist()
    assert str(cu.dtype) == "torch.int32"
    assert cu.tolist() == [i for i, p in enumerate(flat) if p == 0] + [len(flat)]
    lengths = sorted(b - a for a, b in zip(cu.tolist(), cu.tolist()[1:], strict=False))
    padding = batch["input_ids"].numel() - sum(len(ids) for ids, _ in examples)
    assert sum(lengths) == len(flat) and padding > 0
    rows, width = batch["input_ids"].shape
    assert all(r * width in cu.tolist() for r in range(rows))  # no segment crosses a row
