"""Discovery: variants of training prompts with verifiable answers, never held out, kept when the champion
solves them sometimes but not reliably; collection practises on them; evaluation reports them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.environment import perturbed_items, sample_prompts, split_of, verify
from pipeline.errors import RatchetError
from pipeline.loop.advance import run_steps
from pipeline.loop.candidate import AdvanceConfig, done_steps
from pipeline.loop.discovery import composed_variants, discovered_items, keep_allowed
from pipeline.specs.contract import load_contract
from pipeline.specs.heldout import HeldoutIndex, heldout_index

ROOT = Path(__file__).resolve().parent.parent
CONTRACT = load_contract(ROOT / "contracts" / "demo.yaml")


@pytest.mark.parametrize("family", ["chat", "agent", "coding", "genui"])
def test_demo_variants_are_training_problems_with_their_answers(family):
    items = sample_prompts(family, 50, seed=3)
    variants = perturbed_items(family, items, 200, seed=1)
    assert len(variants) == 200
    given = {it["metadata"]["task_id"] for it in items}
    for v in variants:
        a, b = (int(x) for x in v["metadata"]["task_id"].rsplit(":", 1)[1].split("+"))
        assert split_of(a, b) == "train" and v["metadata"]["split"] == "train"  # never a held-out pair
        assert v["metadata"]["task_id"] not in given
        assert verify(v, v["metadata"]["expected"])[0]  # the answer it carries is the right one
    assert len({v["metadata"]["task_id"] for v in variants}) == len(variants)


def test_composed_variants_keep_the_items_checks():
    items = sample_prompts("chat", 10, seed=2)
    variants = composed_variants(items, 8, seed=0)
    assert len(variants) == 8
    for v in variants:
        (question,) = v["messages"]  # one user turn: the prefix is never an assistant turn to be scored
        prior_q, prior_a, _, own = question["content"].split("\n")
        target = next(it for it in items if it["messages"][0]["content"] == own)
        assert v["metadata"] == target["metadata"]  # the reply is checked against its own item
        prior = next(it for it in items if it["messages"][0]["content"] == prior_q)
        assert prior_a == prior["metadata"]["expected"]


def test_the_held_out_predicate_stops_a_variant_that_poses_a_held_out_prompt():
    """Attack: a task source whose variants pose held-out prompts (in any case or spacing) gets none through."""
    secret = "41+42=?"
    index = HeldoutIndex.build([("chat #0", secret)], ngram=8, threshold=0.5)
    variants = [
        {"messages": [{"role": "user", "content": " 41+42=? "}], "metadata": {"expected": "83"}},
        {
            "messages": [
                {"role": "user", "content": "1+2=?"},
                {"role": "assistant", "content": "3"},
                {"role": "user", "content": secret},
            ],
            "metadata": {"expected": "83"},
        },  # fmt: skip
        {
            "messages": [{"role": "user", "content": "5+6=?"}],
            "metadata": {"split": "heldout", "expected": "11"},
        },
        {
            "messages": [{"role": "user", "content": "6+7=?"}],
            "metadata": {"split": "validation", "expected": "13"},
        },
        {"messages": [{"role": "user", "content": "10+11=?"}], "metadata": {"expected": "21"}},
    ]
    kept, stopped = keep_allowed(variants, index)
    assert stopped == 4 and [v["messages"][0]["content"] for v in kept] == ["10+11=?"]
    assert kept[0]["metadata"]["split"] == "train" and kept[0]["metadata"]["discovered"] is True


def test_discovered_variants_are_checked_against_their_sha256(tmp_path):
    from pipeline.loop.discovery import write_variants

    entry = write_variants(
        [{"messages": [{"role": "user", "content": "1+2=?"}], "metadata": {}}], tmp_path / "v"
    )
    state = {"steps": {"discover": {"specialists": {"chat": {"tried": 1, "found": 1, **entry}}}}}
    assert len(discovered_items(state, "chat")) == 1 and discovered_items(state, "agent") == []
    Path(entry["path"]).write_text(json.dumps({"messages": [{"role": "user", "content": "7+8=?"}]}) + "\n")
    with pytest.raises(RatchetError, match="sha256"):
        discovered_items(state, "chat")


def test_discovery_finds_the_champions_frontier_and_collection_practises_it(lineage):
    from pipeline.registry import Generation, get_engine, session_scope
    from pipeline.scoring import score_trace

    config = AdvanceConfig(prompts_per_specialist=40, samples_per_prompt=2, discovery_candidates=48,
                           discovery_samples=4, min_examples=2, validation_items=6, seed=1)  # fmt: skip
    from pipeline.loop.advance import begin_candidate, owner_id

    generation_id = begin_candidate(config=config, owner=owner_id())
    run_steps(("discover", "collect"), generation_id=generation_id, config=config)
    steps = done_steps(generation_id)
    found = steps["discover"]["specialists"]
    assert set(found) == {"chat", "agent", "coding", "genui"}
    assert all(f["tried"] > 0 for f in found.values())
    with session_scope(get_engine()) as s:
        state = s.get(Generation, generation_id).state
    index = heldout_index(load_contract(lineage["contract"]))
    total = 0
    for specialist, f in found.items():
        items = discovered_items(state, specialist)
        assert len(items) == f["found"]
        total += len(items)
        for item in items:  # within reach, not yet learned: 1..3 of 4 samples solved
            assert 0 < item["metadata"]["discovered_pass_rate"] < 0.5
            assert index.exclusion(messages=item["messages"], metadata=item["metadata"]) is None
            answer = item["metadata"].get("expected")
            if isinstance(answer, str) and specialist == "chat":  # the variant's answer verifies
                trace = {**item, "messages": [*item["messages"], {"role": "assistant", "content": answer}]}
                assert score_trace(load_contract(lineage["contract"]), trace, specialist="chat").verified
        assert steps["collect"]["discovered_variants"][specialist] == len(items)
    assert total > 0, found  # the small base solves some sums sometimes


def test_discovery_scoring_counts_as_contract_scoring_and_matches_scoring_one_by_one():
    """Discovery's scoring is contract scoring (``bench/overhead.py`` counted its sandboxed test runs as
    overhead), with the same count per item as scoring one trace after another."""
    from pipeline.environment import sample_prompts
    from pipeline.loop.clock import CLOCK
    from pipeline.loop.discovery import solved, solved_counts
    from pipeline.specs.harness import load_harness

    harness = load_harness(ROOT / "harnesses" / "demo.yaml")
    attempts = []
    for specialist in ("chat", "coding"):
        for n, item in enumerate(sample_prompts(specialist, 6, seed=5)):
            right = (item.get("metadata") or {}).get("expected")
            replies = [right if isinstance(right, str) and k < n % 3 else f"no idea {k}" for k in range(3)]
            attempts.append(
                (specialist, [{**item, "messages": [*item["messages"], {"role": "assistant", "content": r}]}
                              for r in replies])
            )  # fmt: skip
    solved_any = []
    for specialist in ("chat", "coding"):
        mine = [traces for s, traces in attempts if s == specialist]
        one_by_one = [
            sum(solved(CONTRACT, t, harness=harness, specialist=specialist) for t in ts) for ts in mine
        ]
        CLOCK.reset()
        assert solved_counts(CONTRACT, mine, harness=harness, specialist=specialist) == one_by_one
        assert CLOCK.total("score") > 0
        solved_any.append(any(one_by_one))
    assert all(solved_any), "some replies solve their item"
