"""Held-out items never reach anything the model learns from or is prompted with.

The predicate alone (normalisation, near-duplicates, the task source's canonical form of a problem, reference
answers, client tool schemas), then end to end: held-out items planted in the registry as ingested, served
and corrected traces, in every disguise, go through the real score, curate, DPO-pair, co-design and router
steps; no saved dataset row, preference pair, exemplar of any proposed harness and no router training row
may contain one. A control run with the predicate bypassed must find them.
"""

from __future__ import annotations

import json
import re
import time
import unicodedata
import uuid
from pathlib import Path

import pytest
import yaml

from pipeline.specs.heldout import HeldoutIndex, words

ROOT = Path(__file__).resolve().parent.parent
# The demo's first held-out chat item with the suites at 20 items (the tests' contract, ``conftest.write_specs``)
# is 15+42=?; the disguises of issue 21 are written out literally below.
DISGUISES = ["15+42", "42+15=?", "15 + 42 =", "what is 15 plus 42?", "fifteen plus forty-two =?"]


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


# --------------------------------------------------------------------- the demo contract's predicate
@pytest.fixture(scope="module")
def demo_contract(tmp_path_factory):
    """The demo contract with 20-item held-out suites, fixed rather than fresh."""
    from pipeline.specs.contract import load_contract

    contract = yaml.safe_load((ROOT / "contracts" / "demo.yaml").read_text())
    contract["version"] = "test-heldout"
    for suite in contract["heldout"]:
        # fixed samples: what each disguise is traced back to (a fresh suite holds out its whole split, and
        # names the first item of it that matches; tests/test_ledger.py checks that)
        suite["size"], suite["fresh"] = 20, False
    path = tmp_path_factory.mktemp("contract") / "contract.yaml"
    path.write_text(yaml.safe_dump(contract))
    return load_contract(path)


@pytest.fixture(scope="module")
def demo_index(demo_contract):
    from pipeline.specs.heldout import heldout_index, resolve_suites

    assert resolve_suites(demo_contract)["chat"][0]["messages"][0]["content"] == "15+42=?"
    return heldout_index(demo_contract)


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("disguise", DISGUISES)
def test_trivial_disguises_of_the_demo_item_are_excluded(demo_index, disguise):
    """Each disguise of ``15+42=?`` from issue 21, as a prompt, inside a request, in another family's format
    and as an assistant's or a tool's text."""
    reason = demo_index.exclusion(messages=_user(disguise))
    assert reason is not None and reason.endswith("chat #0"), reason
    for messages in (
        _user(f"quick one: {disguise} thanks"),
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": f"you asked {disguise}"}],
        [{"role": "user", "content": "hi"}, {"role": "tool", "content": disguise, "tool_call_id": "c"}],
    ):
        assert demo_index.exclusion(messages=messages) is not None, messages


@pytest.mark.parametrize(
    "text",
    ["timer 42+15", "add 15+42 egg", "counter 42+15", "progress 15+42", "f adds 15 42",
     "the sum of fifteen and forty two", "add 42 to 15", "1 5 + 4 2 = ?", "15\u200b+42=?", "１５＋４２"],
)  # fmt: skip
def test_the_same_problem_in_every_family_and_spelling_is_the_held_out_problem(demo_index, text):
    reason = demo_index.exclusion(messages=_user(text))
    assert (
        reason is not None
        and reason.endswith("held-out prompt chat #0")
        or reason == ("poses the problem of held-out item chat #0")
    ), reason


def test_other_problems_and_the_demo_training_items_are_not_excluded(demo_index):
    from pipeline.environment import make_item, split_of

    assert split_of(20, 37) == "train"
    for text in ["20+37=?", "what is 20 plus 37?", "115+42=?", "15+421", "15-42", "fifteen, then forty-two"]:
        assert demo_index.exclusion(messages=_user(text)) is None, text
    for family in ("chat", "agent", "coding", "genui"):
        for variant in range(4):
            item = make_item(family, 37, 20, variant)
            assert demo_index.exclusion(messages=item["messages"], metadata=item["metadata"]) is None


def test_the_coding_item_with_swapped_operands_and_its_reference_answer_is_excluded(
    demo_index, demo_contract
):
    from pipeline.environment import completion_trace, reference_answer
    from pipeline.specs.heldout import resolve_suites

    item = resolve_suites(demo_contract)["coding"][0]
    a, b = item["messages"][0]["content"].split()[-2:]
    meta = {k: v for k, v in item["metadata"].items() if k != "split"}  # the mark is gone
    swapped = {"messages": _user(f"f adds {b} {a}"), "metadata": meta}
    trace = completion_trace(swapped, reference_answer(item))  # the same reference answer
    assert demo_index.exclusion(messages=trace["messages"], metadata=trace["metadata"]) == (
        "poses the problem of held-out item coding #0"
    )


def test_a_routing_prompt_without_its_question_mark_is_excluded(demo_index, demo_contract):
    asked = [p for prompts in demo_contract.routing.prompts.values() for p in prompts if p.endswith("?")]
    assert len(asked) >= 4
    for prompt in asked:
        for bare in (prompt.rstrip("?"), prompt.rstrip("?").rstrip() + "."):
            reason = demo_index.exclusion(messages=_user(bare))
            assert reason is not None and "routing" in reason, (bare, reason)


def test_trimming_keeps_short_prompts_whole_only():
    index = HeldoutIndex.build([("a", "ok?"), ("b", "is it ok?"), ("c", "12+35=?")], ngram=8, threshold=0.5)
    assert index.find(["ok"]) == "a" and index.find(["¿ok!!"]) == "a"  # trimmed, the prompt is "ok"
    assert index.find(["that is ok with me"]) is None  # one token: only a text that is exactly it
    assert index.find(["well, is it ok with you"]) == "b"  # three tokens or more: contained
    assert index.find(["12+35"]) == "c" and index.find(["timer 12+35"]) == "c"
    assert index.find(["112+35"]) is None and index.find(["?"]) is None and index.find(["it ok"]) is None


def test_a_correction_that_gives_only_the_answer_is_not_learned(demo_index, demo_contract):
    """ "15+42 is 57" as the correction of a reply to "give me a number": the problem is in the correction."""
    from pipeline.experience.eligibility import Candidate, accepted_correction

    def corrected(text: str) -> list[dict] | None:
        candidate = Candidate(
            experience_id=1, specialist="chat", score=0.0, source="deployment", verified=True,
            messages=[*_user("give me a number"), {"role": "assistant", "content": "?"}],
            metadata={"expected": text}, feedback={"rating": 1, "correction": text}, principal="crm",
            correction={"total": 1.0, "verified_by": ["exact_match"], "failed": []},
        )  # fmt: skip
        return accepted_correction(candidate, demo_contract)

    assert corrected("15+42 is 57") is None
    assert demo_index.exclusion(messages=[{"role": "assistant", "content": "15+42 is 57"}]) is not None
    assert corrected("20+37 is 57") is not None  # the control: a training problem's correction is learned


def test_a_reply_that_is_a_held_out_reference_answer_is_excluded_unless_it_is_its_own(
    demo_index, demo_contract
):
    from pipeline.environment import completion_trace, make_item, reference_answer, split_of
    from pipeline.specs.heldout import resolve_suites

    for family in ("coding", "genui"):
        item = resolve_suites(demo_contract)[family][0]
        answer = reference_answer(item)
        total = int(re.findall(r"\d+", answer)[-1])
        pitch = [*_user("write the function for me"), {"role": "assistant", "content": answer}]
        tests = {"tests": item["metadata"].get("tests"), "schema": item["metadata"].get("schema")}
        assert demo_index.exclusion(messages=pitch, metadata=tests) == (
            f"replies with the reference answer of held-out item {family} #0"
        )
        assert demo_index.exclusion(messages=[*pitch[:1], {"role": "assistant", "content": f" {answer}\n"}])
        # a training item of the same sum, verified against its own reference answer: it is learned
        a = next(a for a in range(10, 100) if 10 <= total - a <= 99 and split_of(a, total - a) == "train")
        own = next(o for v in range(2) if reference_answer(o := make_item(family, a, total - a, v)) == answer)
        trace = completion_trace(own, reference_answer(own))
        assert demo_index.exclusion(messages=trace["messages"], metadata=trace["metadata"]) is None
        # ... but not as an exemplar, a preference pair or any trace without its own reference answer
        assert demo_index.exclusion(messages=trace["messages"]) is not None


def test_short_reference_answers_are_not_indexed(demo_index, demo_contract):
    from pipeline.environment import reference_answer
    from pipeline.specs.heldout import MIN_ANSWER_TOKENS, resolve_suites

    chat = resolve_suites(demo_contract)["chat"][0]
    assert len(words(reference_answer(chat))) < MIN_ANSWER_TOKENS  # "57" says nothing about 15+42
    assert (
        demo_index.exclusion(messages=[*_user("give me a number"), {"role": "assistant", "content": "57"}])
        is None
    )


@pytest.mark.parametrize("where", ["description", "parameter", "enum", "key", "claimed"])
def test_a_held_out_prompt_in_the_client_tool_schemas_is_excluded(demo_index, where):
    from pipeline.environment import TOOLS

    secret = "what is 15 plus 42?"
    tool = {"type": "function", "function": {
        "name": "calc", "description": "adds",
        "parameters": {"type": "object", "properties": {"q": {"type": "string", "description": "a sum"}}},
    }}  # fmt: skip
    fn = tool["function"]
    if where in ("description", "claimed"):  # claimed: sent without the scope to certify, still shown
        fn["description"] = f"Use it for questions like {secret}"
    elif where == "parameter":
        fn["parameters"]["properties"]["q"]["description"] = secret
    elif where == "enum":
        fn["parameters"]["properties"]["q"]["enum"] = ["1+1", secret]
    elif where == "key":
        fn["parameters"]["properties"]["fifteen plus forty-two"] = {"type": "string"}  # the problem, reworded
    meta = {"claimed": {"tools": [tool]}} if where == "claimed" else {"tools": [tool]}
    trace = [*_user("20+37=?"), {"role": "assistant", "content": "57"}]
    assert demo_index.exclusion(messages=trace, metadata=meta) is not None, where
    assert demo_index.exclusion(messages=trace, metadata={"tools": TOOLS}) is None  # the demo's own tools


def test_the_predicate_excludes_no_demo_training_traffic_and_is_fast(demo_index, demo_contract):
    """20,000 training traces of the four families: only the routing suite's own ``56 + 33 = ?`` (a
    training-split sum the contract lists among its routing prompts) is excluded."""
    from pipeline.environment import FAMILIES, completion_trace, reference_answer, sample_prompts

    traces = [
        completion_trace(item, reference_answer(item))
        for family in FAMILIES
        for item in sample_prompts(family, 5000, seed=7)
    ]
    start = time.perf_counter()
    excluded = {
        t["messages"][0]["content"]
        for t in traces
        if demo_index.exclusion(messages=t["messages"], metadata=t["metadata"], source="simulation")
    }
    elapsed = time.perf_counter() - start
    assert excluded <= {"56+33=?", "timer 56+33", "counter 56+33", "progress 56+33", "add 56+33 egg"}
    assert "56 + 33 = ?" in demo_contract.routing.prompts["chat"]
    assert elapsed < 5.0, elapsed  # ~0.5 s measured (25 µs a trace, cold); generous for a loaded machine


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


SERVED = "crm"  # a client key the operator granted `certify` (and `correct`): its metadata verifies


def _canonical_disguises(contract) -> list[tuple[list[dict], dict, str, str]]:
    """Issue 21's disguises as verified experience: ``(context, metadata, right reply, wrong reply)``. Each
    context is asked twice, answered right and wrong, so the DPO step has a pair to make of it."""
    from pipeline.environment import reference_answer
    from pipeline.specs.heldout import resolve_suites

    suites = resolve_suites(contract)
    chat = {"specialist": "chat", "task": "chat", "expected": "57"}
    out = [(_user(text), chat, "57", "58") for text in DISGUISES]
    coding = suites["coding"][0]
    a, b = coding["messages"][0]["content"].split()[-2:]
    meta = {k: v for k, v in coding["metadata"].items() if k != "split"}
    answer = reference_answer(coding)
    out.append((_user(f"f adds {b} {a}"), meta, answer, answer.replace("return x+", "return x-")))
    # the reference answer without its problem, verified by the held-out item's own tests
    tests = {k: v for k, v in meta.items() if k != "expected"}
    out.append((_user("write the function for me"), tests, answer, answer.replace("return x+", "return x-")))
    for specialist, prompts in contract.routing.prompts.items():  # routing prompts without their "?"
        for text in prompts:
            if text.endswith("?"):
                meta = {"specialist": specialist, "expected": "ok"}
                out.append((_user(text.rstrip("?")), meta, "ok", "no"))
    return out


def _plant(contract, tmp_path: Path) -> tuple[list[str], list[str]]:
    """Held-out items as verified, correct, high-scoring experience: ingested by the operator (``ratchet
    ingest``'s ``ingest_file``: trusted, so every such trace is verifiable whatever served traffic may count
    for), served (a certifying client's) and corrected, in every disguise; returns the texts no output may
    contain, and the prompts of training items that share a held-out item's reference answer (which must be
    learned)."""
    from pipeline.environment import completion_trace, make_item, reference_answer, split_of
    from pipeline.experience.ingest import ingest_file, trace_row, validate_trace
    from pipeline.registry import get_engine, insert_traces, session_scope
    from pipeline.specs.heldout import resolve_suites

    rows, ingested, prompts = [], [], []

    def served(trace: dict, **kw) -> None:
        rows.append(trace_row(trace, source="deployment", principal=SERVED, **kw))

    for items in resolve_suites(contract).values():
        for item in items[:3]:
            prompt = item["messages"][0]["content"]
            prompts.append(prompt)
            answer = completion_trace(item, reference_answer(item))["messages"][-1]
            meta = {k: v for k, v in item["metadata"].items() if k != "split"}  # the mark is gone
            for i, context in enumerate(_disguises(prompt)):
                trace = validate_trace({"messages": [*context, answer], "metadata": meta})
                ingested.append(trace)
                routed = {**trace, "metadata": {**meta, "route_reason": "strong signal"}}
                served(routed, completion_id=f"chatcmpl-{uuid.uuid4().hex}")
                if i == 0:
                    wrong = {"role": "assistant", "content": "?"}
                    fixed = validate_trace({"messages": [*context, wrong], "metadata": meta,
                                            "feedback": {"rating": 1, "correction": reference_answer(item)}})  # fmt: skip
                    served(fixed)
    for specialist, texts in contract.routing.prompts.items():  # routing-suite prompts, served
        for text in texts:
            trace = {"messages": [*_user(text), {"role": "assistant", "content": "ok"}],
                     "metadata": {"specialist": specialist, "expected": "ok"}}  # fmt: skip
            served(validate_trace(trace))
            prompts.append(text)
    for context, meta, right, wrong in _canonical_disguises(contract):
        for reply in (right, wrong):
            trace = validate_trace({"messages": [*context, {"role": "assistant", "content": reply}],
                                    "metadata": meta})  # fmt: skip
            ingested.append(trace)
            served(trace, completion_id=f"chatcmpl-{uuid.uuid4().hex}")
        prompts.append(context[0]["content"])
    # a correction that gives only the problem and its answer, to a prompt that has neither
    fixed = {"messages": [*_user("give me a number"), {"role": "assistant", "content": "?"}],
             "metadata": {"specialist": "chat", "expected": "15+42 is 57"},
             "feedback": {"rating": 1, "correction": "15+42 is 57"}}  # fmt: skip
    ingested.append(validate_trace(fixed))
    served(validate_trace(fixed), completion_id=f"chatcmpl-{uuid.uuid4().hex}")
    prompts.append("15+42 is 57")
    # a held-out prompt in the client's tool schemas, beside a training problem (20+37: train split)
    assert split_of(20, 37) == "train"
    tool = {"type": "function", "function": {"name": "calc", "description": "for questions like 15+42=?",
                                              "parameters": {"type": "object", "properties": {}}}}  # fmt: skip
    trace = {"messages": [*_user("20+37=? (tools offered)"), {"role": "assistant", "content": "57"}],
             "metadata": {"specialist": "chat", "expected": "57", "tools": [tool]}}  # fmt: skip
    ingested.append(validate_trace(trace))
    served(validate_trace(trace), completion_id=f"chatcmpl-{uuid.uuid4().hex}")
    prompts += ["20+37=? (tools offered)", "for questions like 15+42=?"]
    # training items whose reference answer is also a held-out item's (the demo's answers are sums)
    kept = []
    for family in ("coding", "genui"):
        answer = reference_answer(resolve_suites(contract)[family][0])
        total = int(re.findall(r"\d+", answer)[-1])
        a = next(a for a in range(10, 100) if 10 <= total - a <= 99 and split_of(a, total - a) == "train")
        item = next(
            o for v in range(2) if reference_answer(o := make_item(family, a, total - a, v)) == answer
        )
        ingested.append(completion_trace(item, answer))
        kept.append(item["messages"][0]["content"])
    path = tmp_path / "planted.jsonl"
    path.write_text("".join(json.dumps(trace) + "\n" for trace in ingested))
    result = ingest_file(path, session_factory=lambda: session_scope(get_engine()))
    assert (result.stored, result.quarantined) == (len(ingested), 0), result
    with session_scope(get_engine()) as session:
        assert insert_traces(session=session, rows=rows) == len(rows)
    return prompts, kept


def _leaks(texts: list[str], prompts: list[str]) -> list[str]:
    blob = [_normalised(t) for t in texts]
    return [p for p in prompts if any(_normalised(p) in b for b in blob)]


def _texts(messages: list[dict]) -> list[str]:
    return [str(m.get("content") or "") + str(m.get("tool_calls") or "") for m in messages]


def _run_steps(generation_id: int, monkeypatch) -> dict[str, list[str]]:
    """score, curate, DPO pairs, co-design and router fitting as the loop runs them; every text they
    produced."""
    from datasets import load_from_disk

    import pipeline.codesign.operators as operators
    from pipeline.codesign import codesign_step
    from pipeline.experience.eligibility import lineage_candidates
    from pipeline.experience.preferences import preference_pairs
    from pipeline.loop.candidate import AdvanceConfig, contract_of, load_generation
    from pipeline.loop.curation import curate_step
    from pipeline.loop.evaluation import router_training_traces
    from pipeline.registry import TrainingDataset, get_engine, session_scope
    from pipeline.scoring import score_step
    from pipeline.specs.harness import HarnessSpec
    from pipeline.specs.heldout import heldout_index

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
        # what curation gives the DPO step (`method: dpo`): every checked reply, both sides of a pair
        pair_candidates, _ = lineage_candidates(session, gen, contract, min_score=0.0)
        paths = [d.path for d in session.query(TrainingDataset).filter_by(generation_id=generation_id)]
    specialists = sorted(contract.specialists)
    pairs = preference_pairs(
        pair_candidates, contract=contract, heldout=heldout_index(contract), specialists=specialists,
        max_pairs=dict.fromkeys(specialists, 10_000),
    ).pairs  # fmt: skip
    hybrid = harness.model_copy(update={"routing": harness.routing.model_copy(update={"mode": "hybrid"})})
    router_rows = router_training_traces(hybrid, contract, candidates)
    dataset_texts = [
        text
        for path in paths
        for row in load_from_disk(path).to_list()
        for text in [*_texts(row["messages"]), row["tools"]]  # the tool schemas reach the chat template
    ]
    pair_texts = [
        text
        for rows in pairs.values()
        for row in rows
        for text in [*_texts(row["messages"]), *_texts(row["rejected"]), json.dumps(row["tools"])]
    ]
    exemplar_texts = [
        m.content or ""
        for variant in proposed
        for sp in variant.spec.specialists.values()
        for ex in sp.exemplars
        for m in ex.messages
    ]
    router_texts = [str(m.get("content")) for t in router_rows for m in t["messages"]]
    assert paths and proposed and router_rows and any(pairs.values()), (paths, proposed, len(router_rows))
    return {
        "datasets": dataset_texts,
        "pairs": pair_texts,
        "exemplars": exemplar_texts,
        "router": router_texts,
    }


@pytest.fixture
def planted(small_base, tmp_path):
    from conftest import init_with_corrections, write_specs
    from sqlalchemy import select

    from pipeline.loop.advance import begin_candidate
    from pipeline.loop.candidate import AdvanceConfig, contract_of, load_generation
    from pipeline.registry import Generation, get_engine, session_scope

    specs = write_specs(tmp_path, small_base)
    contract = yaml.safe_load(specs["contract"].read_text())
    # No outside principal may fill more than a quarter of a dataset by default: the served traces planted
    # here are one client's (`crm`), and the cap would drop most of them -- hiding what the predicate does.
    contract["selection"]["max_share_per_principal"] = 1.0
    specs["contract"].write_text(yaml.safe_dump(contract))
    init_with_corrections(specs, tmp_path)
    generation_id = begin_candidate(config=AdvanceConfig(), owner="test")
    with session_scope(get_engine()) as session:
        contract = contract_of(load_generation(session, generation_id))
        assert session.scalar(select(Generation.number).where(Generation.id == generation_id)) == 1
    return generation_id, *_plant(contract, tmp_path)


def test_planted_heldout_items_reach_no_dataset_pair_exemplar_or_router_row(planted, monkeypatch):
    generation_id, prompts, kept = planted
    produced = _run_steps(generation_id, monkeypatch)
    assert {where: _leaks(texts, prompts) for where, texts in produced.items()} == {
        "datasets": [],
        "pairs": [],
        "exemplars": [],
        "router": [],
    }
    # what the predicate must not refuse: training items whose answers held-out items share
    assert _leaks(produced["datasets"], kept) == kept


def test_control_without_the_predicate_the_same_check_finds_the_leak(planted, monkeypatch):
    import pipeline.experience.eligibility as eligibility
    from pipeline.specs.heldout import HeldoutIndex

    monkeypatch.setattr(HeldoutIndex, "exclusion", lambda self, **kwargs: None)
    monkeypatch.setattr(HeldoutIndex, "teaches", lambda self, *args: None)  # its learned-reply rule too
    monkeypatch.setattr(eligibility, "_EXCLUDED", {})
    generation_id, prompts, _ = planted
    produced = _run_steps(generation_id, monkeypatch)
    assert _leaks(produced["datasets"], prompts) and _leaks(produced["router"], prompts)
    assert _leaks(produced["pairs"], prompts)
    # each of issue 21's disguises is one the check finds when nothing stops it
    disguised = [context[0]["content"] for context, *_ in _canonical_disguises(_contract(generation_id))]
    found = set(_leaks(produced["datasets"] + produced["pairs"], prompts))
    assert not [d for d in [*disguised, "15+42 is 57", "for questions like 15+42=?"] if d not in found]


def _contract(generation_id: int):
    from pipeline.loop.candidate import contract_of, load_generation
    from pipeline.registry import get_engine, session_scope

    with session_scope(get_engine()) as session:
        return contract_of(load_generation(session, generation_id))


def _serve(contract) -> list[str]:
    """Issue 21's disguises sent through the real server by a client whose key may certify and correct: each
    disguise asked with its verification metadata, then corrected to its right answer (the tiny model's own
    reply is noise), the correction-only trace and the held-out prompt in the client's tool schemas. Returns
    the texts no output may contain."""
    from fastapi.testclient import TestClient

    from pipeline.experience.principals import OPERATOR, parse_scopes
    from pipeline.registry import create_api_key, get_engine, session_scope
    from pipeline.serving.served import ServeConfig
    from pipeline.serving.server import create_app

    with session_scope(get_engine()) as session:
        scopes = parse_scopes("chat,certify,correct")
        _, key = create_api_key(session=session, name=SERVED, scopes=scopes, actor=OPERATOR)
    auth = {"Authorization": f"Bearer {key}"}
    tool = {"type": "function", "function": {"name": "calc", "description": "for questions like 15+42=?"}}
    asked = [
        *((context, meta, right) for context, meta, right, _ in _canonical_disguises(contract)),
        (_user("give me a number"), {"expected": "15+42 is 57"}, "15+42 is 57"),
        (_user("20+37=? (tools offered)"), {"expected": "57", "tools": [tool]}, "57"),
    ]
    config = ServeConfig(poll_seconds=0, device="cpu", flush_seconds=0.05)
    with TestClient(create_app(config)) as client:
        for context, meta, right in asked:
            body = {"model": "ratchet", "messages": context, "metadata": meta}
            reply = client.post("/v1/chat/completions", json=body, headers=auth)
            assert reply.status_code == 200, reply.text
            fixed = {"completion_id": reply.json()["id"], "correction": right}
            assert client.post("/v1/feedback", json=fixed, headers=auth).json()["counted"] == {
                "correction": True
            }
    return [context[0]["content"] for context, _, _ in asked] + ["15+42 is 57", "for questions like 15+42=?"]


@pytest.mark.parametrize("bypass", [False, True], ids=["predicate", "control"])
def test_disguises_sent_through_the_real_server_are_never_learned(small_base, tmp_path, monkeypatch, bypass):
    from conftest import init_with_corrections, write_specs

    import pipeline.experience.eligibility as eligibility
    from pipeline.loop.advance import begin_candidate
    from pipeline.loop.candidate import AdvanceConfig

    specs = write_specs(tmp_path, small_base)
    contract = yaml.safe_load(specs["contract"].read_text())
    contract["selection"]["max_share_per_principal"] = 1.0  # one client's traces: see `planted`
    specs["contract"].write_text(yaml.safe_dump(contract))
    init_with_corrections(specs, tmp_path)
    generation_id = begin_candidate(config=AdvanceConfig(), owner="test")
    texts = _serve(_contract(generation_id))
    if bypass:
        monkeypatch.setattr(HeldoutIndex, "exclusion", lambda self, **kwargs: None)
        monkeypatch.setattr(HeldoutIndex, "teaches", lambda self, *args: None)
        monkeypatch.setattr(eligibility, "_EXCLUDED", {})
    produced = _run_steps(generation_id, monkeypatch)
    leaks = set(_leaks(produced["datasets"] + produced["pairs"] + produced["router"], texts))
    if bypass:  # every disguise is learned when nothing stops it
        assert leaks == set(texts), set(texts) - leaks
    else:
        assert leaks == set() and _leaks(produced["exemplars"], texts) == []


def _exemplar_cases(contract) -> list[tuple[str, dict, str]]:
    """Issue 21's disguises as the co-design step sees them: ``(specialist, top trace, text to look for)``,
    each a verified trace scored 1.0 (what the ``fewshot`` operator picks exemplars from)."""
    cases = []
    for context, meta, right, _ in _canonical_disguises(contract):
        specialist = meta.get("specialist") or meta.get("task")
        trace = {"messages": [*context, {"role": "assistant", "content": right}], "metadata": meta}
        cases.append((specialist, trace, context[0]["content"]))
    # the correction that gives only the answer, as the final reply of a prompt that has neither
    fixed = {"messages": [*_user("give me a number"), {"role": "assistant", "content": "15+42 is 57"}],
             "metadata": {"specialist": "chat", "expected": "15+42 is 57"}}  # fmt: skip
    cases.append(("chat", fixed, "15+42 is 57"))
    return cases


@pytest.mark.parametrize("bypass", [False, True], ids=["predicate", "control"])
def test_the_codesign_operator_makes_no_disguise_an_exemplar(demo_index, demo_contract, bypass):
    """Co-design's ``fewshot`` operator, given each disguise alone as a specialist's top experience: with
    the predicate no proposed harness has it as an exemplar; with an index that holds nothing (the control)
    each one that fits the tiny model's window becomes an exemplar -- as co-design picked two of them in
    issue 21, putting the held-out answer into the candidate's prompt at evaluation."""
    from pipeline.codesign import propose_variants
    from pipeline.specs.harness import load_harness

    harness = load_harness(ROOT / "harnesses" / "demo.yaml")
    index = HeldoutIndex.build([], ngram=8, threshold=0.5) if bypass else demo_index
    cases = _exemplar_cases(demo_contract)
    found = []
    for specialist, trace, text in cases:
        top = {specialist: [{**trace, "score": 1.0, "verified": True, "specialist": specialist}]}
        variants = propose_variants(
            harness, top_traces=top, contract=demo_contract, heldout=index, rng_seed=0
        )
        exemplars = [
            m.content or ""
            for v in variants
            for sp in v.spec.specialists.values()
            for ex in sp.exemplars or []
            for m in ex.messages
        ]
        found += _leaks(exemplars, [text])
    if bypass:  # every case is one co-design would show the model, when nothing stops it
        assert found == [text for _, _, text in cases]
    else:
        assert found == []


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

    from pipeline.errors import RatchetError
    from pipeline.loop.founding import init_lineage
    from pipeline.specs.contract import load_contract
    from pipeline.specs.heldout import resolve_suites

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
