"""Preference pairs from contract-scored experience: verified replies only, the margin, corrections first,
held-out material never (attacks kept as tests)."""

from __future__ import annotations

from pathlib import Path

from pipeline.experience.eligibility import Candidate
from pipeline.experience.preferences import preference_pairs
from pipeline.specs.contract import load_contract
from pipeline.specs.heldout import HeldoutIndex, heldout_index

CONTRACT = load_contract(Path(__file__).resolve().parent.parent / "contracts" / "demo.yaml")
HELDOUT = HeldoutIndex.build([("chat #0", "7+8=?")], ngram=6, threshold=0.5)


def _cand(i, q, a, score, *, verified=True, specialist="chat", **kw):
    return Candidate(
        experience_id=i,
        specialist=specialist,
        score=score,
        messages=[{"role": "user", "content": q}, {"role": "assistant", "content": a}],
        metadata=kw.pop("metadata", {}),
        feedback=kw.pop("feedback", None),
        source=kw.pop("source", "simulation"),
        verified=verified,
        correction=kw.pop("correction", None),
        failed=kw.pop("failed", []),
        principal=kw.pop("principal", "ratchet"),  # the loop's own practice unless a test says otherwise
    )


def _pairs(cands, contract=CONTRACT, heldout=HELDOUT, max_pairs=100):
    result = preference_pairs(
        cands, contract=contract, heldout=heldout, specialists=["chat"], max_pairs={"chat": max_pairs}
    )
    return result.pairs["chat"], result.dropped.counts.get("chat", {})


def _replies(row):
    return row["messages"][-1]["content"], row["rejected"][-1]["content"]


def test_every_losing_reply_is_paired_with_the_best_reply_to_its_prompt():
    cands = [
        _cand(1, "12+35=?", "47", 1.0),
        _cand(2, "12+35=?", "46", 0.2),
        _cand(3, "12+35=?", "57", 0.2),
        _cand(4, "12+35=?", "46", 0.2),  # the same reply again: one pair, not two
        _cand(5, "12+35=?", "47.", 0.9),  # beats nobody by the margin, is not the best: unpaired
        _cand(6, "20+21=?", "41", 1.0),  # a prompt with one reply: nothing to compare
    ]
    rows, dropped = _pairs(cands)
    assert sorted(_replies(r) for r in rows) == [("47", "46"), ("47", "57")]
    for row in rows:  # the same context on both sides; the margin and both traces recorded
        assert row["messages"][:-1] == row["rejected"][:-1]
        assert row["margin"] >= CONTRACT.selection.min_preference_margin
        assert row["experience_id"] == 1 and row["rejected_experience_id"] in (3, 4)
    assert dropped == {"no pair within margin": 2}


def test_only_replies_the_contract_verified_are_ranked():
    """A form-only score (no verifying scorer applied) ranks nothing: not as preferred, not as the other."""
    cands = [
        _cand(1, "12+35=?", "47", 1.0, verified=False),
        _cand(2, "12+35=?", "46", 0.1),
        _cand(3, "20+21=?", "41", 1.0),
        _cand(4, "20+21=?", "14", 0.0, verified=False),
    ]
    rows, dropped = _pairs(cands)
    assert rows == [] and dropped["unverified"] == 2


def test_an_accepted_correction_beats_the_reply_it_corrects():
    correction = {"total": 1.0, "verified_by": ["exact_match"], "failed": []}
    cands = [
        _cand(
            1,
            "13+35=?",  # a training sum of the demo contract (12+35 is one of its held-out items)
            "49",
            0.17,
            feedback={"rating": 1, "correction": "48"},
            correction=correction,
            failed=["exact_match"],
        ),  # fmt: skip
        _cand(
            2,
            "30+31=?",
            "61",
            0.0,
            feedback={"rating": 1, "correction": "60"},  # failed the contract
            correction={"total": 0.0, "verified_by": ["exact_match"], "failed": ["exact_match"]},
        ),  # fmt: skip
    ]
    rows, _ = _pairs(cands)
    assert [_replies(r) for r in rows] == [("48", "49")]


def test_held_out_material_never_reaches_a_pair():
    from pipeline.environment import heldout_suite

    secret = heldout_suite("chat", 1, seed=1234)[0]["messages"][0]["content"]  # in the demo's held-out suite
    smuggled = {"total": 1.0, "verified_by": ["exact_match"], "failed": []}
    cands = [
        _cand(1, "7+8=?", "15", 1.0),  # a held-out prompt
        _cand(2, "7+8=?", "16", 0.0),
        _cand(3, "9+9=?", "18", 1.0, metadata={"split": "heldout"}),
        _cand(4, "9+9=?", "17", 0.0),
        _cand(5, "evaluation", "x", 1.0, source="evaluation"),
        _cand(6, "evaluation", "y", 0.0, source="evaluation"),
        # attack: a user's correction that carries a held-out prompt (and would pass the contract)
        _cand(
            7,
            "3+4=?",
            "8",
            0.0,
            feedback={"rating": 1, "correction": f"7. Also: {secret}"},
            correction=smuggled,
        ),
    ]
    rows, dropped = _pairs(cands, heldout=heldout_index(CONTRACT).__class__.build(
        [("chat #0", "7+8=?"), ("secret", secret)], ngram=6, threshold=0.5))  # fmt: skip
    assert rows == [], rows
    assert dropped["held-out"] == 5


def test_cut_off_replies_are_on_neither_side():
    stopped = {"finish_reason": "timeout"}
    cands = [
        _cand(1, "12+35=?", "47", 1.0, metadata=stopped),
        _cand(2, "12+35=?", "4", 0.0),
        _cand(3, "20+21=?", "41", 1.0),
        _cand(4, "20+21=?", "4", 0.0, metadata={"finish_reason": "disconnected"}),
    ]
    rows, dropped = _pairs(cands)
    assert rows == [] and dropped["reply stopped before its end"] == 2


def test_the_cap_keeps_the_largest_margins_newest_first():
    cands = []
    for i, (a, b) in enumerate([(10, 11), (12, 13), (14, 15)]):
        cands += [_cand(10 * i, f"{a}+{b}=?", str(a + b), 1.0), _cand(10 * i + 1, f"{a}+{b}=?", "x", 0.5)]
    cands += [_cand(100, "50+51=?", "101", 1.0), _cand(101, "50+51=?", "0", 0.0)]
    rows, dropped = _pairs(cands, max_pairs=2)
    assert [r["experience_id"] for r in rows] == [100, 20] and dropped["over cap"] == 2


def test_a_preferred_reply_must_pass_the_contract():
    """The preferred side is trained on too (RPO): one below selection.min_score is no one's preferred reply,
    however far it is above the other."""
    rows, dropped = _pairs([_cand(1, "12+35=?", "4", 0.6), _cand(2, "12+35=?", "x", 0.0)])
    assert rows == [] and dropped == {"no pair within margin": 2}


def test_what_follows_the_final_reply_is_no_part_of_a_pair():
    after = {"role": "tool", "tool_call_id": "c1", "content": "{}"}
    best = _cand(1, "12+35=?", "47", 1.0)
    other = _cand(2, "12+35=?", "46", 0.0)
    best.messages.append(after)
    other.messages.append(after)
    (row,), _ = _pairs([best, other])
    assert (
        [m["role"] for m in row["messages"]] == [m["role"] for m in row["rejected"]] == ["user", "assistant"]
    )
    assert _replies(row) == ("47", "46")


def test_a_correction_never_makes_a_right_or_unchecked_reply_the_rejected_side():
    """Found on main: an accepted correction became the chosen side and the model's original reply -- even a
    right one -- the rejected side. Now the replaced reply is rejected only when the contract itself checked it
    and scored it below the threshold; otherwise the correction only joins its prompt's group."""
    correction = {"total": 1.0, "verified_by": ["exact_match"], "failed": []}
    right = _cand(1, "12+35=?", "47", 1.0, feedback={"correction": "47.0"}, correction=correction)
    unchecked = _cand(2, "hello", "hi there", 0.9, verified=False, feedback={"correction": "47"},
                      correction=correction)  # fmt: skip
    rows, _ = _pairs([right, unchecked])
    assert rows == []


def test_an_outside_principal_fills_at_most_its_share_of_the_pairs():
    cands = []
    for i in range(40):  # one client's certified turns: a right and a wrong reply per prompt
        cands.append(_cand(2 * i, f"{i}+{i}=?", str(2 * i), 1.0, principal="crm", source="deployment"))
        cands.append(
            _cand(2 * i + 1, f"{i}+{i}=?", str(2 * i + 1), 0.0, principal="crm", source="deployment")
        )
    rows, dropped = _pairs(cands)
    assert rows == [] and dropped["over principal share"] == 40
