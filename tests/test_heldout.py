"""Held-out items never reach anything the model learns from or is prompted with.

The predicate alone (normalisation, near-duplicates), then end to end: held-out items planted in the
registry as ingested, served and corrected traces, in every disguise, go through the real score, curate,
co-design and router steps; no saved dataset row, no exemplar of any proposed harness and no router
training row may contain one. A control run with the predicate bypassed must find them.
"""

from __future__ import annotations

import re
import unicodedata
import uuid

import pytest

from pipeline.heldout import HeldoutIndex, words


def test_words_ignore_layout_case_and_unicode_forms():
    assert (
        words("  12 + 35 =?\n") == words("12+35=?") == words("１２＋３５＝？") == ("12", "+", "35", "=", "?")
    )
    assert words("Ünïcode") == words("ÜNÏCODE") == words("U\u0308nïcode")


def test_exact_contained_and_near_duplicate_prompts_are_found():
    long = "write a function that returns the sum of the squares of the numbers in a list"
    index = HeldoutIndex.build([("a", "12+35=?"), ("b", long), ("c", "ok")], ngram=8, threshold=0.5)
    assert index.find(["12+35=?"]) == "a"
    assert index.find(["please tell me: 12 + 35 = ? thanks"]) == "a"  # contained whole
    assert index.find(["112+35=?"]) is None and index.find(["12+36=?"]) is None  # other problems
    reworded = long.replace("write a function that", "Could you write code which") + ", please"
    assert index.find([reworded]) == "b"  # most of its 8-grams are there
    assert index.find(["the sum of the squares"]) is None  # a fragment is not a near-duplicate
    assert index.find(["ok"]) == "c" and index.find(["that is ok with me"]) is None  # short: whole only
    strict = HeldoutIndex.build([("b", long)], ngram=8, threshold=0.05)
    assert strict.find(["returns the sum of the squares of the numbers in it"]) == "b"


def test_the_predicate_reads_every_turn_and_every_part():
    index = HeldoutIndex.build([("a", "counter 12+35")], ngram=8, threshold=0.5)
    parts = {
        "role": "user",
        "content": [{"type": "text", "text": "counter"}, {"type": "text", "text": "12+35"}],
    }
    assert index.exclusion(messages=[parts]) == "contains held-out prompt a"
    earlier = [{"role": "user", "content": "counter 12+35"}, {"role": "assistant", "content": "x"},
               {"role": "user", "content": "and again"}]  # fmt: skip
    assert index.exclusion(messages=earlier) is not None
    call = {
        "role": "assistant",
        "tool_calls": [{"function": {"name": "ui", "arguments": '{"q": "counter 12+35"}'}}],
    }
    assert index.exclusion(messages=[call]) is not None
    assert index.exclusion(messages=[{"role": "user", "content": "x"}], metadata={"split": "heldout"})
    assert index.exclusion(messages=[{"role": "user", "content": "x"}], source="evaluation")
    assert index.exclusion(messages=[{"role": "user", "content": "counter 12+36"}]) is None


# ------------------------------------------------------------------------------------------- end to end
def _normalised(text: str) -> str:
    """An independent check (not the predicate's words()): NFKC, case folded, no whitespace at all."""
    return re.sub(r"\s+", "", unicodedata.normalize("NFKC", text)).casefold()


def _disguises(prompt: str) -> list[list[dict]]:
    """The same held-out prompt as a user would send it in ways an exact hash misses."""
    half = len(prompt) // 2
    return [
        [{"role": "user", "content": prompt + " "}],
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": prompt[:half]}, {"type": "text", "text": prompt[half:]}],
            }
        ],
        [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": "noted"},
            {"role": "user", "content": "go on"},
        ],
        [{"role": "user", "content": unicodedata.normalize("NFKC", prompt).upper()}],
        [{"role": "user", "content": f"quick one: {prompt} thanks"}],
    ]


def _plant(contract) -> list[str]:
    """Held-out items as verified, correct, high-scoring experience: ingested, served and corrected."""
    from pipeline.environment import completion_trace, reference_answer
    from pipeline.experience import trace_row, validate_trace
    from pipeline.heldout import resolve_suites
    from pipeline.registry import get_engine, insert_traces, session_scope

    rows, prompts = [], []
    for items in resolve_suites(contract).values():
        for item in items[:3]:
            prompt = item["messages"][0]["content"]
            prompts.append(prompt)
            answer = completion_trace(item, reference_answer(item))["messages"][-1]
            meta = {k: v for k, v in item["metadata"].items() if k != "split"}  # the mark is gone
            for i, context in enumerate(_disguises(prompt)):
                trace = validate_trace({"messages": [*context, answer], "metadata": meta})
                rows.append(trace_row(trace, source="import"))
                served = {**trace, "metadata": {**meta, "route_reason": "strong signal"}}
                rows.append(
                    trace_row(served, source="deployment", completion_id=f"chatcmpl-{uuid.uuid4().hex}")
                )
                if i == 0:
                    wrong = {"role": "assistant", "content": "?"}
                    fixed = validate_trace({"messages": [*context, wrong], "metadata": meta,
                                            "feedback": {"rating": 1, "correction": reference_answer(item)}})  # fmt: skip
                    rows.append(trace_row(fixed, source="deployment"))
    for specialist, texts in contract.routing.prompts.items():  # routing-suite prompts, served
        for text in texts:
            trace = {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}],
                     "metadata": {"specialist": specialist, "expected": "ok"}}  # fmt: skip
            rows.append(trace_row(validate_trace(trace), source="deployment"))
            prompts.append(text)
    with session_scope(get_engine()) as session:
        assert insert_traces(session=session, rows=rows) == len(rows)
    return prompts


def _leaks(texts: list[str], prompts: list[str]) -> list[str]:
    blob = [_normalised(t) for t in texts]
    return [p for p in prompts if any(_normalised(p) in b for b in blob)]


def _run_steps(generation_id: int, monkeypatch) -> dict[str, list[str]]:
    """score, curate, co-design and router fitting as the loop runs them; every text they produced."""
    from datasets import load_from_disk

    import pipeline.codesign.operators as operators
    from pipeline.candidate import AdvanceConfig, contract_of, load_generation
    from pipeline.codesign import codesign_step
    from pipeline.curation import curate_step
    from pipeline.eligibility import lineage_candidates
    from pipeline.evaluation import router_training_traces
    from pipeline.harness import HarnessSpec
    from pipeline.registry import TrainingDataset, get_engine, session_scope
    from pipeline.scoring import score_step

    config = AdvanceConfig(validation_items=4, min_examples=1)
    proposed = []
    real = operators.propose_variants

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        proposed.extend(out)
        return out

    monkeypatch.setattr(operators, "propose_variants", spy)
    score_step(generation_id=generation_id, config=config)
    curate_step(generation_id=generation_id, config=config)
    codesign_step(generation_id=generation_id, config=config)
    with session_scope(get_engine()) as session:
        gen = load_generation(session, generation_id)
        contract = contract_of(gen)
        harness = HarnessSpec.model_validate(gen.harness_version.spec)
        candidates, _ = lineage_candidates(session, gen, contract)
        paths = [d.path for d in session.query(TrainingDataset).filter_by(generation_id=generation_id)]
    hybrid = harness.model_copy(update={"routing": harness.routing.model_copy(update={"mode": "hybrid"})})
    router_rows = router_training_traces(hybrid, contract, candidates)
    dataset_texts = [
        str(m.get("content") or "") + str(m.get("tool_calls") or "")
        for path in paths
        for row in load_from_disk(path).to_list()
        for m in row["messages"]
    ]
    exemplar_texts = [
        m.content or ""
        for variant in proposed
        for sp in variant.spec.specialists.values()
        for ex in sp.exemplars
        for m in ex.messages
    ]
    router_texts = [str(m.get("content")) for t in router_rows for m in t["messages"]]
    assert paths and proposed and router_rows, (paths, proposed, len(router_rows))
    return {"datasets": dataset_texts, "exemplars": exemplar_texts, "router": router_texts}


@pytest.fixture
def planted(lineage):
    from sqlalchemy import select

    from pipeline.advance import begin_candidate
    from pipeline.candidate import AdvanceConfig, contract_of, load_generation
    from pipeline.registry import Generation, get_engine, session_scope

    generation_id = begin_candidate(config=AdvanceConfig(), owner="test")
    with session_scope(get_engine()) as session:
        contract = contract_of(load_generation(session, generation_id))
        assert session.scalar(select(Generation.number).where(Generation.id == generation_id)) == 1
    return generation_id, _plant(contract)


def test_planted_heldout_items_reach_no_dataset_exemplar_or_router_row(planted, monkeypatch):
    generation_id, prompts = planted
    produced = _run_steps(generation_id, monkeypatch)
    assert {where: _leaks(texts, prompts) for where, texts in produced.items()} == {
        "datasets": [],
        "exemplars": [],
        "router": [],
    }


def test_control_without_the_predicate_the_same_check_finds_the_leak(planted, monkeypatch):
    import pipeline.eligibility as eligibility
    from pipeline.heldout import HeldoutIndex

    monkeypatch.setattr(HeldoutIndex, "exclusion", lambda self, **kwargs: None)
    monkeypatch.setattr(eligibility, "_EXCLUDED", {})
    generation_id, prompts = planted
    produced = _run_steps(generation_id, monkeypatch)
    assert _leaks(produced["datasets"], prompts) and _leaks(produced["router"], prompts)


def test_content_parts_split_inside_a_word_are_read_run_together():
    index = HeldoutIndex.build([("a", "counter 12+35")], ngram=8, threshold=0.5)
    split = {
        "role": "user",
        "content": [{"type": "text", "text": "coun"}, {"type": "text", "text": "ter 12+35"}],
    }
    assert index.exclusion(messages=[split]) == "contains held-out prompt a"


def test_a_harness_with_a_heldout_exemplar_is_refused_at_registration(tmp_path, specs):
    from pathlib import Path

    import yaml

    from pipeline.contract import load_contract
    from pipeline.errors import RatchetError
    from pipeline.heldout import resolve_suites
    from pipeline.lineage import init_lineage

    ROOT = Path(__file__).resolve().parent.parent
    item = resolve_suites(load_contract(specs["contract"]))["chat"][0]
    harness = yaml.safe_load((ROOT / "harnesses" / "demo.yaml").read_text())
    exemplar = [
        {"role": "user", "content": item["messages"][0]["content"]},
        {"role": "assistant", "content": "1"},
    ]
    harness["specialists"]["chat"]["exemplars"] = [{"messages": exemplar}]
    path = tmp_path / "harness.yaml"
    path.write_text(yaml.safe_dump(harness))
    with pytest.raises(
        RatchetError, match=r"specialists.chat.exemplars\[0\] contains held-out prompt chat #0"
    ):
        init_lineage(contract_path=specs["contract"], harness_path=path, model_path=specs["model"])
