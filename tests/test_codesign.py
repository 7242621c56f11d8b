"""Harness co-design: variants from top experience, content-addressed labels, always contract-compatible."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from pipeline.codesign import HarnessVariant, parent_variant, propose_variants, variant_label
from pipeline.environment.tasks import (
    FAMILIES,
    completion_trace,
    heldout_suite,
    reference_answer,
    sample_prompts,
)
from pipeline.errors import RatchetError
from pipeline.modeling.prompting import prompt_budget_chars, prompt_chars, render_messages
from pipeline.specs.compatibility import check_harness
from pipeline.specs.contract import load_contract
from pipeline.specs.harness import HarnessSpec, load_harness
from pipeline.specs.heldout import heldout_index, resolve_suites

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = load_contract(ROOT / "contracts" / "demo.yaml")
HELDOUT = heldout_index(CONTRACT)
DEMO = load_harness(ROOT / "harnesses" / "demo.yaml")


def scored(item: dict, answer: str | None = None, score: float = 1.0, verified: bool = True) -> dict:
    trace = completion_trace(item, reference_answer(item) if answer is None else answer)
    return {**trace, "score": score, "verified": verified, "specialist": item["metadata"]["specialist"]}


def top_traces(n: int = 12) -> dict[str, list[dict]]:
    return {f: [scored(it) for it in sample_prompts(f, n, seed=3)] for f in FAMILIES}


def with_system_prompts() -> HarnessSpec:
    data = DEMO.model_dump(mode="json")
    data["context"]["include_system_prompt"] = True
    return HarnessSpec.model_validate(data)


def by_op(variants: list[HarnessVariant]) -> dict[str, HarnessVariant]:
    return {v.operator: v for v in variants}


def test_parent_first_then_valid_content_addressed_variants():
    variants = propose_variants(
        DEMO, top_traces=top_traces(), contract=CONTRACT, heldout=HELDOUT, rng_seed=7, include_parent=True
    )
    assert variants[0] == parent_variant(DEMO) and variants[0].label == "v1"
    ops = by_op(variants[1:])
    assert set(ops) == {"fewshot", "decoding"}  # no prompt variant: the demo shows no system prompt
    for v in variants[1:]:
        assert v.label == v.spec.version == variant_label("v1", v.operator, v.spec)
        assert v.label.startswith(f"v1+{v.operator}.") and len(v.label) == len("v1+") + len(v.operator) + 7
        assert check_harness(v.spec, CONTRACT) == []
        assert v.spec.description.startswith("v1 + ") and v.description in v.spec.description
    # Deterministic for a seed; the label depends on content only.
    again = propose_variants(
        DEMO, top_traces=top_traces(), contract=CONTRACT, heldout=HELDOUT, rng_seed=7, include_parent=True
    )
    assert [v.label for v in again] == [v.label for v in variants]
    assert [v.spec for v in again] == [v.spec for v in variants]


def test_fewshot_exemplars_come_from_top_traces_and_fit_the_window():
    top = top_traces()
    spec = by_op(propose_variants(DEMO, top_traces=top, contract=CONTRACT, heldout=HELDOUT, rng_seed=1))[
        "fewshot"
    ].spec
    prompts = {f: {t["messages"][0]["content"] for t in top[f]} for f in FAMILIES}
    for f in FAMILIES:
        exemplars = spec.specialists[f].exemplars
        assert 1 <= len(exemplars) <= 3
        assert all(ex.messages[0].content in prompts[f] for ex in exemplars)
        # Every held-out prompt still gets every exemplar, within the tiny model's 128 positions.
        for item in heldout_suite(f, 20, seed=5):
            msgs = render_messages(spec, f, item["messages"])
            assert len(msgs) == 2 * len(exemplars) + 1
            assert prompt_chars(msgs, spec.tool_call_format) <= prompt_budget_chars(spec, f)
    agent_calls = [
        m.tool_calls for ex in spec.specialists["agent"].exemplars for m in ex.messages if m.tool_calls
    ]
    assert agent_calls and all(c[0].name in ("set_timer", "add_item") for c in agent_calls)


def test_fewshot_skips_held_out_unverified_low_scoring_and_misfit_traces():
    held = heldout_suite("chat", 5, seed=0)
    disguised = []  # the contract's own held-out items, unmarked and reworded in spacing and case
    for item in resolve_suites(CONTRACT)["chat"][:3]:
        trace = scored(item)
        trace["metadata"] = {"specialist": "chat"}
        trace["messages"][0]["content"] = " " + trace["messages"][0]["content"].upper() + "  "
        disguised.append(trace)
    train = sample_prompts("chat", 5, seed=0)
    top = {
        "chat": [scored(it) for it in held]  # marked held out: never an exemplar
        + disguised  # held out by the predicate
        + [scored(it, verified=False) for it in train]  # nothing verified these
        + [scored(it, answer="0", score=0.5) for it in train]  # below selection.min_score 0.8
        + [scored(it, answer="x" * 200) for it in train[:1]]  # too long for the window
    }
    assert propose_variants(DEMO, top_traces=top, contract=CONTRACT, heldout=HELDOUT, rng_seed=0) == []
    ok = {"chat": top["chat"] + [scored(train[1])]}
    (fewshot,) = propose_variants(DEMO, top_traces=ok, contract=CONTRACT, heldout=HELDOUT, rng_seed=0)
    (ex,) = fewshot.spec.specialists["chat"].exemplars
    assert ex.messages[0].content == train[1]["messages"][0]["content"]


def test_decoding_is_tightened_never_loosened():
    spec = by_op(
        propose_variants(DEMO, top_traces=top_traces(), contract=CONTRACT, heldout=HELDOUT, rng_seed=0)
    )["decoding"].spec
    longest = max(len(reference_answer(it)) for it in sample_prompts("coding", 12, seed=3))
    assert spec.specialists["coding"].decoding.max_new_tokens == longest + 6 + 1 < 32
    # genui answers (~30 chars) + margin exceed 40: unchanged, as is every other field.
    assert spec.specialists["genui"].decoding == DEMO.specialists["genui"].decoding
    assert spec.specialists["coding"].model_copy(update={"decoding": None}) == DEMO.specialists[
        "coding"
    ].model_copy(update={"decoding": None})
    data = DEMO.model_dump(mode="json")
    for sp in data["specialists"].values():
        sp["decoding"]["stop"] = []
    no_stop = HarnessSpec.model_validate(data)
    spec = by_op(
        propose_variants(no_stop, top_traces=top_traces(), contract=CONTRACT, heldout=HELDOUT, rng_seed=0)
    )["decoding"].spec
    assert all(sp.decoding.stop == ["\n"] for sp in spec.specialists.values())


def test_prompt_variants_when_system_prompts_are_shown():
    parent = with_system_prompts()
    seen = set()
    for seed in range(8):
        v = by_op(
            propose_variants(
                parent, top_traces=top_traces(), contract=CONTRACT, heldout=HELDOUT, rng_seed=seed
            )
        )["prompt"]
        chat = v.spec.specialists["chat"]
        if "answer-format" in v.description:
            assert chat.slots["answer_format"].startswith("Reply like: ")
            assert chat.render_system_prompt().endswith(chat.slots["answer_format"])
            # A longer prompt does not fit genui's 128-character window next to its answer: left as it was.
            assert v.spec.specialists["genui"] == parent.specialists["genui"]
            assert "genui" not in v.description
        else:
            assert chat.system_prompt == "{persona}" and chat.slots == {"persona": "You add numbers."}
            assert v.spec.specialists["agent"] == parent.specialists["agent"]  # already only required slots
        seen.add(v.description.split(" (")[0])
        assert check_harness(v.spec, CONTRACT) == []
    assert len(seen) == 2


def test_max_variants_and_no_evidence():
    assert propose_variants(DEMO, top_traces={}, contract=CONTRACT, heldout=HELDOUT, rng_seed=0) == []
    no_change = propose_variants(
        DEMO, top_traces={}, contract=CONTRACT, heldout=HELDOUT, rng_seed=0, include_parent=True
    )
    assert no_change == [parent_variant(DEMO)]
    one = propose_variants(
        DEMO, top_traces=top_traces(), contract=CONTRACT, heldout=HELDOUT, rng_seed=0, max_variants=1
    )
    assert len(one) == 1
    top = top_traces()
    firsts = {
        v.operator
        for s in range(8)
        for v in propose_variants(
            DEMO, top_traces=top, contract=CONTRACT, heldout=HELDOUT, rng_seed=s, max_variants=1
        )
    }
    assert firsts == {"fewshot", "decoding"}  # the seed decides which operator goes first


def test_labels_stay_short_and_the_parent_must_be_compatible():
    long_parent = DEMO.model_copy(update={"version": "v1" + "+fewshot.abcdef" * 5})
    (v, *_) = propose_variants(
        long_parent, top_traces=top_traces(), contract=CONTRACT, heldout=HELDOUT, rng_seed=0
    )
    assert v.label.startswith("v1+fewshot.abcdef+") and len(v.label) <= 100
    longer = DEMO.model_copy(update={"version": "v1" + "+fewshot.abcdef" * 6})
    (v, *_) = propose_variants(
        longer, top_traces=top_traces(), contract=CONTRACT, heldout=HELDOUT, rng_seed=0
    )
    assert v.label == f"v1+{v.operator}.{v.label.rsplit('.', 1)[1]}"
    data = copy.deepcopy(DEMO.model_dump(mode="json"))
    data["tool_call_format"] = "json"
    with pytest.raises(RatchetError, match="violates contract demo"):
        propose_variants(
            HarnessSpec.model_validate(data), top_traces={}, contract=CONTRACT, heldout=HELDOUT, rng_seed=0
        )


def test_compact_harness_rejects_what_compact_cannot_say():
    data = yaml.safe_load((ROOT / "harnesses" / "demo.yaml").read_text())
    data["tools"][0]["function"]["parameters"]["properties"]["loud"] = {"type": "boolean"}
    data["specialists"]["agent"]["exemplars"] = [
        {
            "messages": [
                {"role": "user", "content": "add 1+2 a,b"},
                {
                    "role": "assistant",
                    "tool_calls": [{"name": "add_item", "arguments": {"name": "a,b", "qty": 3}}],
                },
            ]
        }
    ]
    with pytest.raises(ValueError) as info:
        HarnessSpec.model_validate(data)
    text = str(info.value)
    assert "tools.set_timer.loud: type 'boolean' cannot be written in the compact tool-call format" in text
    assert "argument name='a,b' cannot be written in the compact tool-call format" in text
    # A top trace whose call cannot be written compactly is skipped rather than breaking the variant.
    item = sample_prompts("agent", 1, seed=0)[0]
    bad = scored(item)
    bad["messages"][-1]["tool_calls"][0]["function"]["arguments"] = '{"name":"a,b","qty":3}'
    variants = propose_variants(
        DEMO, top_traces={"agent": [bad]}, contract=CONTRACT, heldout=HELDOUT, rng_seed=0
    )
    assert "fewshot" not in by_op(variants)
