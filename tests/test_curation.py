"""Curation under the contract's selection rules: only verified experience, never a held-out item."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.experience.eligibility import Candidate
from pipeline.loop.curation import save_dataset, select_examples
from pipeline.specs.contract import load_contract
from pipeline.specs.heldout import HeldoutIndex
from pipeline.training import dataset_sha256

CONTRACT = load_contract(Path(__file__).resolve().parent.parent / "contracts" / "demo.yaml")
HELDOUT = HeldoutIndex.build(
    [("chat #0", "7+8=?"), ("chat #1", "what is the capital of france")], ngram=6, threshold=0.5
)


def _cand(i, q, a, score, specialist="chat", verified=True, **kw):
    msgs = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": q},
        {"role": "assistant", "content": a},
    ]
    return Candidate(
        experience_id=i,
        specialist=specialist,
        score=score,
        messages=kw.pop("messages", msgs),
        metadata=kw.pop("metadata", {}),
        feedback=kw.pop("feedback", None),
        source=kw.pop("source", "simulation"),
        verified=verified,
        correction=kw.pop("correction", None),
        failed=kw.pop("failed", []),
        principal=kw.pop("principal", "ratchet"),  # the loop's own practice unless a test says otherwise
    )


def _with_selection(**changes):
    return CONTRACT.model_copy(update={"selection": CONTRACT.selection.model_copy(update=changes)})


def _ids(result, specialist="chat"):
    return [e["experience_id"] for e in result.examples[specialist]]


def test_threshold_dedup_and_best_kept():
    cands = [
        _cand(1, "1+1", "2", 1.0),
        _cand(2, "1+1", "2", 0.9),
        _cand(3, "2+2", "5", 0.1),
        _cand(4, "3+3", "6", 0.85),
        _cand(5, "3+3", "6!", 0.95),
    ]
    result = select_examples(cands, contract=_with_selection(dedup="prompt"), heldout=HELDOUT)
    assert _ids(result) == [1, 5]
    assert result.dropped.counts["chat"] == {"below threshold": 1, "duplicate": 2}
    # `content` drops exact repeats only; `none` keeps every attempt above the threshold
    assert _ids(select_examples(cands, contract=_with_selection(dedup="content"), heldout=HELDOUT)) == [
        1,
        4,
        5,
    ]
    assert _ids(select_examples(cands, contract=_with_selection(dedup="none"), heldout=HELDOUT)) == [
        1,
        2,
        4,
        5,
    ]


def test_unverified_experience_is_never_learned_from():
    """A deployment turn nothing checked (no reference, tests, schema, expected call, verdict or rating)
    scores ~1.0 on form alone; it is still left out."""
    cands = [_cand(1, "hello", "a long fluent wrong answer", 1.0, verified=False), _cand(2, "2+2", "4", 1.0)]
    result = select_examples(cands, contract=CONTRACT, heldout=HELDOUT)
    assert _ids(result) == [2] and result.dropped.counts["chat"] == {"unverified": 1}


def test_heldout_items_in_every_disguise_never_reach_training():
    parts = [{"type": "text", "text": "7+8"}, {"type": "text", "text": "=?"}]
    disguises = [
        _cand(9, "7+8=?", "15", 1.0),  # verbatim
        _cand(10, "7+8=? ", "15", 1.0),  # trailing space
        _cand(11, "７+８=?", "15", 1.0),  # full-width digits (NFKC)
        _cand(12, "please: 7 + 8 = ?", "15", 1.0),  # embedded in a longer prompt
        _cand(
            13,
            "x",
            "15",
            1.0,
            messages=[{"role": "user", "content": parts}, {"role": "assistant", "content": "15"}],
        ),
        _cand(
            14,
            "x",
            "y",
            1.0,
            messages=[
                {"role": "user", "content": "What is the capital of France"},  # an earlier turn
                {"role": "assistant", "content": "Paris"},
                {"role": "user", "content": "thanks"},
                {"role": "assistant", "content": "you are welcome"},
            ],
        ),
        _cand(15, "9+9=?", "18", 1.0, metadata={"split": "heldout"}),
        _cand(16, "4+4=?", "8", 1.0, source="evaluation"),
        # a held-out prompt with a user correction still stays out
        _cand(
            17,
            "7+8=?",
            "14",
            0.0,
            verified=False,
            correction={"total": 1.0, "verified_by": ["exact_match"], "failed": []},
            feedback={"rating": 1, "correction": "15"},
        ),  # fmt: skip
    ]
    result = select_examples(
        [*disguises, _cand(18, "5+5=?", "10", 1.0), _cand(19, "17+8=?", "25", 1.0)],
        contract=CONTRACT,
        heldout=HELDOUT,
    )
    assert _ids(result) == [18, 19]  # 17+8 is a different problem: tokens, not characters, are compared
    assert result.dropped.counts["chat"] == {"held-out": 9}


def test_corrections_are_learned_only_when_they_pass_the_contract():
    good = {"total": 1.0, "verified_by": ["exact_match"], "failed": []}
    wrong = {"total": 0.17, "verified_by": ["exact_match"], "failed": ["exact_match"]}
    cands = [
        _cand(
            1, "6+6", "11", 0.17, verified=True, feedback={"rating": 1, "correction": "12"}, correction=good
        ),
        _cand(
            2, "6+7", "14", 0.17, verified=True, feedback={"rating": 1, "correction": "15"}, correction=wrong
        ),
        # attack: a correction no verifying scorer checked (no reference answer: only the length scorer
        # applied) passes the total but is text nobody verified -- never learned
        _cand(
            3,
            "hi",
            "?",
            0.5,
            verified=False,
            feedback={"correction": "EVIL 99"},
            correction={"total": 1.0, "verified_by": [], "failed": []},
        ),
    ]
    result = select_examples(cands, contract=CONTRACT, heldout=HELDOUT)
    assert _ids(result) == [1]
    assert result.examples["chat"][0]["messages"][-1] == {"role": "assistant", "content": "12"}
    assert result.dropped.counts["chat"] == {"correction failed the contract": 2}
    off = select_examples(cands, contract=_with_selection(use_corrections=False), heldout=HELDOUT)
    assert _ids(off) == [] and off.dropped.counts["chat"] == {"below threshold": 2, "unverified": 1}


def test_caps_and_per_specialist_counts():
    cands = [_cand(100 + i, f"{i}+0", str(i), 0.9 + i / 1000, specialist="agent") for i in range(5)]
    contract = _with_selection(max_examples={"agent": 2})
    result = select_examples(cands, contract=contract, heldout=HELDOUT)
    assert _ids(result, "agent") == [103, 104]  # the two best
    assert result.dropped.counts == {"agent": {"over cap": 3}}
    ties = [_cand(200 + i, f"{i}+1", str(i + 1), 1.0, specialist="agent") for i in range(5)]
    assert _ids(select_examples(ties, contract=contract, heldout=HELDOUT), "agent") == [203, 204]  # newest


def test_saved_dataset_is_hashed(tmp_path):
    examples = [
        {
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
            "score": 1.0,
            "experience_id": 1,
        }
    ]
    digest, n = save_dataset(examples, tmp_path / "ds")
    from datasets import load_from_disk

    saved = load_from_disk(str(tmp_path / "ds")).to_list()
    assert n == 1 and digest == dataset_sha256(saved) and len(digest) == 64
    assert saved[0]["experience_id"] == 1 and saved[0]["messages"][1]["content"] == "yo"


def test_validation_slice_of_a_specialist_without_tasks_is_never_learned_from():
    """Without a task source, a fixed slice of verified experience validates co-design: it is in no
    dataset, no exemplar pool and no router data, and it is the same slice whatever the order."""
    from pipeline.experience.eligibility import eligible_examples, in_validation_slice, validation_items

    chat = CONTRACT.specialists["chat"].model_copy(update={"tasks": None})
    contract = CONTRACT.model_copy(update={"specialists": {**CONTRACT.specialists, "chat": chat}})
    cands = [_cand(i, f"question number {i}", f"answer {i}", 1.0) for i in range(200)]
    sliced = {c.experience_id for c in cands if in_validation_slice(c.messages, 0.1)}
    assert 5 <= len(sliced) <= 40
    kept = set(_ids(select_examples(cands, contract=contract, heldout=HELDOUT, specialists=["chat"])))
    assert kept == {c.experience_id for c in cands} - sliced
    assert not {c.experience_id for c, _, _ in eligible_examples(cands, contract)} & sliced
    items = validation_items(list(reversed(cands)), contract, "chat", 1000)
    assert {it["messages"][-1]["content"] for it in items} == {f"question number {i}" for i in sliced}
    assert all(m["role"] != "assistant" for it in items for m in it["messages"])
    # with a task source the specialist has its own validation split: all its experience may be learned
    assert len(_ids(select_examples(cands, contract=CONTRACT, heldout=HELDOUT, specialists=["chat"]))) == 200


def test_a_reply_the_server_cut_off_is_never_learned_from_however_it_scores():
    """A turn stopped at the timeout or by a disconnect records a partial reply; even verified with a top
    score, it is not a whole answer to learn from (an accepted correction of it still is)."""
    cut = [
        _cand(i, f"question {i} about sorting", "def f(", 1.0, metadata={"finish_reason": reason})
        for i, reason in enumerate(["timeout", "disconnected"])
    ]
    whole = _cand(
        9, "question 9 about sorting", "def f(xs): return sorted(xs)", 1.0, metadata={"finish_reason": "stop"}
    )
    result = select_examples([*cut, whole], contract=CONTRACT, heldout=HELDOUT)
    assert _ids(result) == [9]
    assert result.dropped.counts["chat"] == {"reply stopped before its end": 2}


def test_a_correction_cannot_smuggle_a_held_out_prompt_into_training():
    """Attack: a user answers a harmless question wrong on purpose and 'corrects' it with a held-out prompt
    (and its answer). The correction would pass the contract; its own text goes through the predicate."""
    from pipeline.environment import heldout_suite

    item = heldout_suite("chat", 1, seed=1234)[0]  # in the demo contract's held-out suite
    secret = f"{item['messages'][0]['content']} {item['metadata']['expected']}"
    passed = {"total": 1.0, "verified_by": ["exact_match"], "failed": []}
    smuggler = _cand(30, "3+4=?", "8", 0.0, verified=False, correction=passed,
                     feedback={"rating": 1, "correction": f"7. Also: {secret}"})  # fmt: skip
    honest = _cand(
        31, "3+5=?", "9", 0.0, verified=False, correction=passed, feedback={"rating": 1, "correction": "8"}
    )
    result = select_examples([smuggler, honest], contract=CONTRACT, heldout=HELDOUT)
    assert _ids(result) == [31]
    assert all(secret not in json.dumps(e["messages"]) for e in result.examples.get("chat", []))


def test_no_single_outside_principal_fills_a_dataset():
    """Found on main: 2,000 self-certified served turns of one client made up a specialist's whole dataset.
    Each outside principal (a key, `anonymous`, an import's principal) may fill at most
    `selection.max_share_per_principal` of it; the loop's own practice and the operator's ingest are not
    outside. What the cap drops is counted, by principal too."""
    flood = [_cand(i, f"{i}+1", str(i + 1), 1.0, principal="crm", source="deployment") for i in range(2000)]
    alone = select_examples(flood, contract=CONTRACT, heldout=HELDOUT)
    assert _ids(alone) == []  # one party alone never decides what is learned
    assert alone.dropped.counts["chat"] == {"over principal share": 2000}
    assert alone.dropped.principals == {"crm": {"over principal share": 2000}}
    own = [_cand(10_000 + i, f"{i}+2", str(i + 2), 0.9) for i in range(300)]  # the loop's practice
    others = [_cand(20_000 + i, f"{i}+3", str(i + 3), 0.95, principal="raters", source="deployment")
              for i in range(50)]  # fmt: skip
    mixed = select_examples(flood + own + others, contract=CONTRACT, heldout=HELDOUT)
    kept = mixed.examples["chat"]
    n = len(kept)
    by = {
        p: sum(1 for e in kept if e["experience_id"] // 10_000 == k) for k, p in ((0, "crm"), (2, "raters"))
    }
    assert by["crm"] <= 0.25 * n and by["raters"] <= 0.25 * n and by["crm"] > 0
    assert sum(1 for e in kept if 10_000 <= e["experience_id"] < 20_000) == 300
    assert mixed.dropped.counts["chat"]["over principal share"] == 2050 - by["crm"] - by["raters"]
    everyone = select_examples(flood, contract=_with_selection(max_share_per_principal=1.0), heldout=HELDOUT)
    assert len(_ids(everyone)) == 2000


def test_a_verifying_check_that_failed_keeps_a_turn_out_whatever_its_total():
    """`verified` means a check applied and passed: a final turn with a failed verifying check is never
    learned, even when other scorers lift its total over the threshold."""
    cands = [_cand(1, "6+6", "13", 0.9, failed=["exact_match"]), _cand(2, "6+7", "13", 0.9)]
    result = select_examples(cands, contract=CONTRACT, heldout=HELDOUT)
    assert _ids(result) == [2] and result.dropped.counts["chat"] == {"failed check": 1}


def test_a_contract_may_name_whose_corrections_are_learned():
    good = {"total": 1.0, "verified_by": ["exact_match"], "failed": []}
    cands = [
        _cand(
            1,
            "6+6",
            "11",
            0.17,
            feedback={"correction": "12", "correction_by": "editors"},
            correction=good,
            failed=["exact_match"],
        ),  # fmt: skip
        _cand(
            2,
            "6+7",
            "11",
            0.17,
            feedback={"correction": "13", "correction_by": "interns"},
            correction=good,
            failed=["exact_match"],
        ),  # fmt: skip
    ]
    everyone = _with_selection(max_share_per_principal=1.0)  # (two correctors alone: no share cap here)
    assert _ids(select_examples(cands, contract=everyone, heldout=HELDOUT)) == [1, 2]
    narrowed = _with_selection(trusted_corrections=["editors"], max_share_per_principal=1.0)
    result = select_examples(cands, contract=narrowed, heldout=HELDOUT)
    assert _ids(result) == [1] and result.dropped.counts["chat"] == {"correction failed the contract": 1}


def test_a_learned_reply_must_be_its_own_answer_when_it_is_a_held_out_one():
    """A reply equal to a held-out item's reference answer (code, here) is learned only when it is the trace's
    own reference answer. A trace with some other reference of its own passes the predicate (its wrong reply
    may still be a preference pair's rejected side) but never becomes an SFT target."""
    from pipeline.environment import heldout_suite
    from pipeline.experience.preferences import preference_pairs
    from pipeline.specs.heldout import heldout_index

    index = heldout_index(CONTRACT)
    answer = heldout_suite("coding", 1, seed=1234)[0]["metadata"]["expected"]  # e.g. def f(x):return x+57
    tests = "assert True\n"
    own = _cand(1, "write the function for me", answer, 1.0, specialist="coding",
                metadata={"expected": answer, "tests": tests})  # fmt: skip
    other = _cand(2, "write another function for me", answer, 1.0, specialist="coding",
                  metadata={"expected": "zzz", "tests": tests})  # fmt: skip
    none = _cand(3, "and one more for me", answer, 1.0, specialist="coding", metadata={"tests": tests})
    result = select_examples([own, other, none], contract=CONTRACT, heldout=index)
    assert _ids(result, "coding") == [1] and result.dropped.counts["coding"] == {"held-out": 2}
    # as the rejected side of a pair, the same reply (wrong for its own reference) is kept
    right = _cand(4, "f adds 1 2", "def f(x):return x+3", 1.0, specialist="coding",
                  metadata={"expected": "def f(x):return x+3"})  # fmt: skip
    wrong = _cand(5, "f adds 1 2", answer, 0.0, specialist="coding", metadata={"expected": "def f(x):return x+3"},
                  failed=["python_tests"])  # fmt: skip
    pairs = preference_pairs([right, wrong], contract=CONTRACT, heldout=index, specialists=["coding"],
                             max_pairs={"coding": 10})  # fmt: skip
    assert [r["rejected"][-1]["content"] for r in pairs.pairs["coding"]] == [answer]
