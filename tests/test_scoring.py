"""Trace scoring and aggregation (pure), and the registry step ``score_experience``."""

from __future__ import annotations

import hashlib
import json
import textwrap
from pathlib import Path

import pytest
from sqlalchemy import create_engine, func, select
from sqlalchemy.orm import Session

from pipeline.errors import NotFoundError
from pipeline.registry.models import Base, ContractVersion, Experience, HarnessVersion, Score
from pipeline.scoring import (
    aggregate_turn,
    score_experience,
    score_trace,
    summarise_results,
    turn_specialists,
)
from pipeline.specs.contract import ContractSpec, contract_hash, load_contract
from pipeline.specs.harness import load_harness
from pipeline.specs.loading import validate_spec_text

ROOT = Path(__file__).resolve().parents[1]
DEMO = load_contract(ROOT / "contracts" / "demo.yaml")
HARNESS = load_harness(ROOT / "harnesses" / "demo.yaml")


def contract(text: str) -> ContractSpec:
    return validate_spec_text(textwrap.dedent(text), ContractSpec, file="<test>")


SMALL = contract(
    """\
    name: t
    version: "1"
    protocol: {context_budget: {max_tokens: 100}}
    default_specialist: chat
    specialists:
      chat:
        scorers:
          - {kind: exact_match, weight: 3}
          - {kind: length, max_chars: 10, weight: 1}
      strict:
        aggregate: min
        scorers:
          - {kind: exact_match}
          - {kind: length, max_chars: 10}
      gated:
        scorers:
          - {kind: regex, pattern: ok, required: true, weight: 0}
          - {kind: length, max_chars: 10}
    """
)


def chat(answer: str, expected: str | None = None, **extra) -> dict:
    meta = {"expected": expected} if expected is not None else {}
    meta.update(extra.pop("metadata", {}))
    return {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer}],
        "metadata": meta,
        **extra,
    }


def test_weighted_mean():
    res = score_trace(SMALL, chat("4", "4"))
    assert res.specialist == "chat" and res.total == 1.0
    assert res.values == {"exact_match": 1.0, "length": 1.0}
    res = score_trace(SMALL, chat("x" * 15, "4"))  # exact 0 (w3), length 0 (w1: 50% over with softness .5)
    assert res.values["length"] == 0.0 and res.total == 0.0
    res = score_trace(SMALL, chat("5", "4"))
    assert res.total == pytest.approx(0.25)
    assert res.details["exact_match"]["errors"] == ["turn 1: expected '4', got '5'"]
    # a scorer that does not apply is left out of the mean
    res = score_trace(SMALL, chat("5"))
    assert res.values["exact_match"] is None and res.total == 1.0


def test_min_aggregation_and_required_gate():
    res = score_trace(SMALL, chat("x" * 13, "x" * 13), specialist="strict")
    assert res.values["length"] == pytest.approx(0.4) and res.total == pytest.approx(0.4)
    res = score_trace(SMALL, chat("not fine"), specialist="gated")
    assert res.total == 0.0 and res.turns[0].gated_by == "regex"
    res = score_trace(SMALL, chat("ok" + "x" * 11), specialist="gated")
    assert res.total == pytest.approx(0.4)
    # only a zero-weight gate applies: its value is the score
    scorers = SMALL.specialists["gated"].scorers
    assert aggregate_turn(list(scorers), {"regex": 1.0, "length": None}, "weighted_mean") == (1.0, None)


def test_routes_decide_the_specialist_per_turn():
    trace = {
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "b"},
            {"role": "assistant", "content": "x" * 13},
        ],
        "metadata": {"specialist": "chat", "expected": "4"},
        "routes": [{"turn": 3, "specialist": "strict"}],
    }
    assert turn_specialists(SMALL, trace) == {1: "chat", 3: "strict"}
    res = score_trace(SMALL, trace)
    assert res.specialist == "strict"
    # exact_match is final-only: it applies to turn 3 (0.0); length applies to both turns
    assert [t.values for t in res.turns] == [
        {"exact_match": None, "length": 1.0},
        {"exact_match": 0.0, "length": pytest.approx(0.4)},
    ]
    assert res.by_specialist == {"chat": 1.0, "strict": 0.0}
    assert res.total == 0.5 and res.values["length"] == pytest.approx(0.7)
    assert turn_specialists(SMALL, trace, specialist="gated") == {1: "gated", 3: "gated"}


def test_default_and_unknown_specialists():
    assert score_trace(SMALL, chat("4", "4")).specialist == "chat"
    res = score_trace(SMALL, chat("4", "4", metadata={"specialist": "poet"}))
    assert res.specialist == "poet" and res.total == 1.0
    assert "scored as 'chat'" in res.turns[0].errors["specialist"]
    empty = score_trace(SMALL, {"messages": [{"role": "user", "content": "hi"}]})
    assert empty.total is None and empty.values == {} and empty.specialist == "chat"


def demo_traces() -> list[dict]:
    timer = {"name": "set_timer", "arguments": {"minutes": 5}}
    tool_call = {
        "id": "c",
        "type": "function",
        "function": {"name": "set_timer", "arguments": '{"minutes": 5}'},
    }
    return [
        chat("4", "4", metadata={"specialist": "chat"}, feedback=5),
        chat("7", "4", metadata={"specialist": "chat"}),
        {
            "messages": [
                {"role": "user", "content": "timer 5"},
                {"role": "assistant", "content": None, "tool_calls": [tool_call]},
                {"role": "tool", "tool_call_id": "c", "content": "ok"},
                {"role": "assistant", "content": "Timer set."},
            ],
            "metadata": {"specialist": "agent", "expected_call": timer},
        },
        chat("Sure!", metadata={"specialist": "agent", "expected_call": timer}),
        chat(
            "```python\ndef sq(x):\n    return x * x\n```",
            metadata={"specialist": "coding", "tests": "def test_sq():\n    assert sq(3) == 9\n"},
        ),
        chat('{"component": "button"}', metadata={"specialist": "genui", "schema": {"type": "object"}}),
    ]


def test_demo_contract_end_to_end():
    results = [score_trace(DEMO, t, harness=HARNESS) for t in demo_traces()]
    totals = [r.total for r in results]
    assert totals[0] == 1.0 and totals[1] < 0.8
    assert results[2].values["tool_call"] == 1.0 and totals[2] == 1.0
    assert results[3].values["tool_call"] == 0.0 and totals[3] == 0.0  # required gate: no call at all
    assert results[4].values["python_tests"] == 1.0 and results[4].values["has_def"] == 1.0
    assert results[5].values["json_schema"] == 1.0
    stats = {(s.scorer, s.specialist): s for s in summarise_results(DEMO, results)}
    assert stats[("exact_match", "chat")].n == 2 and stats[("exact_match", "chat")].failures == 1
    assert stats[("total", "chat")].mean == pytest.approx((1.0 + totals[1]) / 2)
    assert stats[("feedback", "chat")].n == 1


# --------------------------------------------------------------------------------------------- registry
@pytest.fixture
def session(tmp_path):
    engine = create_engine(f"sqlite:///{tmp_path / 'registry.db'}")
    Base.metadata.create_all(engine)  # tests only; product code uses the migrations
    with Session(engine) as s:
        yield s
    engine.dispose()


def add_contract(session, spec: ContractSpec, version: str) -> int:
    row = ContractVersion(
        name=spec.name, version=version, content_hash=contract_hash(spec), spec=spec.model_dump(mode="json")
    )
    session.add(row)
    session.commit()
    return row.id


def add_traces(session, traces: list[dict], *, harness_version_id: int | None = None) -> None:
    for t in traces:
        session.add(
            Experience(
                content_hash=hashlib.sha256(json.dumps(t, sort_keys=True).encode()).hexdigest(),
                messages=t["messages"],
                meta={k: v for k, v in t["metadata"].items() if k != "specialist"},
                specialist=t["metadata"].get("specialist"),
                feedback=t.get("feedback"),
                routes=t.get("routes", []),
                source="test",
                principal="operator",  # the operator's own traces: their metadata counts
                harness_version_id=harness_version_id,
            )
        )
    session.commit()


def scores(session, cv: int) -> dict[tuple[int, str], float | None]:
    rows = session.scalars(select(Score).where(Score.contract_version_id == cv)).all()
    return {(r.experience_id, r.scorer): r.value for r in rows}


def test_score_experience_and_rescore_under_a_new_contract_version(session):
    hv = HarnessVersion(name="demo", version="v1", content_hash="h", spec=HARNESS.model_dump(mode="json"))
    session.add(hv)
    session.commit()
    add_traces(session, demo_traces(), harness_version_id=hv.id)
    cv1 = add_contract(session, DEMO, "1")
    seen = []
    res = score_experience(session=session, contract_version_id=cv1, batch_size=4, progress=seen.append)
    assert res.scored == 6 and seen == [4, 2] and res.already_scored == 0
    assert res.by_specialist == {"chat": 2, "agent": 2, "coding": 1, "genui": 1}
    first = scores(session, cv1)
    assert len(first) == res.rows
    assert first[(1, "total")] == 1.0 and first[(3, "tool_call")] == 1.0 and first[(5, "python_tests")] == 1.0
    total_row = session.scalar(select(Score).where(Score.experience_id == 3, Score.scorer == "total"))
    assert total_row.details["specialist"] == "agent"

    # nothing left to do under the same version
    again = score_experience(session=session, contract_version_id=cv1)
    assert again.scored == 0 and again.already_scored == 6
    # a new trace is picked up alone
    add_traces(session, [chat("3", "3", metadata={"specialist": "chat"})])
    assert score_experience(session=session, contract_version_id=cv1).scored == 1
    first = scores(session, cv1)

    # a second contract version (chat's exact_match weighted 0) scores everything again
    spec2 = DEMO.model_copy(deep=True)
    spec2.version = "2"
    spec2.specialists["chat"].scorers[0].weight = 0.0
    cv2 = add_contract(session, spec2, "2")
    res2 = score_experience(session=session, contract_version_id=cv2, batch_size=3)
    assert res2.scored == 7
    assert scores(session, cv1) == first  # the old version's scores stay
    assert scores(session, cv2)[(2, "total")] != first[(2, "total")]

    # rescore replaces this version's rows only
    before_v1 = session.scalar(
        select(func.count()).select_from(Score).where(Score.contract_version_id == cv1)
    )
    res3 = score_experience(session=session, contract_version_id=cv2, rescore=True)
    assert res3.scored == 7
    assert (
        session.scalar(select(func.count()).select_from(Score).where(Score.contract_version_id == cv1))
        == before_v1
    )
    assert len(scores(session, cv2)) == res3.rows


def test_score_experience_unknown_contract_version(session):
    with pytest.raises(NotFoundError, match="contract version id 42"):
        score_experience(session=session, contract_version_id=42)


def test_cli_score_dry_run(tmp_path, capsys):
    from pipeline.cli import main

    path = tmp_path / "traces.jsonl"
    path.write_text("\n".join(json.dumps(t) for t in demo_traces()) + "\n\n", encoding="utf-8")
    main(
        [
            "contract",
            "score",
            str(ROOT / "contracts" / "demo.yaml"),
            str(path),
            "--harness",
            str(ROOT / "harnesses" / "demo.yaml"),
        ]
    )
    out = capsys.readouterr().out
    assert "python_tests" in out and "coding" in out and "per specialist" in out
    line = next(ln for ln in out.splitlines() if "exact_match" in ln)
    assert [cell for cell in line.split() if cell not in "│┃"][-5:] == ["2", "0.500", "0.000", "1.000", "1"]


def test_cli_score_bad_line(tmp_path, capsys):
    from pipeline.cli import main

    path = tmp_path / "traces.jsonl"
    path.write_text(json.dumps(demo_traces()[0]) + "\n{broken\n", encoding="utf-8")
    with pytest.raises(SystemExit) as exit_info:
        main(["contract", "score", str(ROOT / "contracts" / "demo.yaml"), str(path)])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert f"{path}:2: not valid JSON" in err and err.count("\n") == 1


# ----------------------------------------------------------------------------------------- verification
def test_only_outcome_checks_verify_a_turn():
    """Form alone (a length, JSON that parses, a call that fits some tool) scores ~1.0 but verifies nothing."""
    free = score_trace(DEMO, chat("a fluent answer", metadata={"specialist": "chat"}))
    assert free.total == 1.0 and not free.verified and free.turns[-1].verified_by == []
    checked = score_trace(DEMO, chat("4", "4", metadata={"specialist": "chat"}))
    assert checked.verified and checked.turns[-1].verified_by == ["exact_match"]
    wrong = score_trace(DEMO, chat("5", "4", metadata={"specialist": "chat"}))
    assert wrong.verified and wrong.turns[-1].failed_checks == ["exact_match"]
    rated = score_trace(DEMO, chat("a fluent answer", metadata={"specialist": "chat"}, feedback=5))
    assert rated.verified and rated.turns[-1].verified_by == ["feedback"]
    parse_only = score_trace(DEMO, chat('{"type": "counter"}', metadata={"specialist": "genui"}))
    assert parse_only.total == 1.0 and not parse_only.verified
    with_schema = score_trace(
        DEMO, chat('{"type": "counter"}', metadata={"specialist": "genui", "schema": {"type": "object"}})
    )
    assert with_schema.verified
    call = {"role": "assistant", "content": "set_timer(minutes=5)"}
    any_call = {"messages": [{"role": "user", "content": "x"}, call], "metadata": {"specialist": "agent"}}
    assert score_trace(DEMO, any_call, harness=HARNESS).total == 1.0
    assert not score_trace(DEMO, any_call, harness=HARNESS).verified
    expected = {
        **any_call,
        "metadata": {
            "specialist": "agent",
            "expected_call": {"name": "set_timer", "arguments": {"minutes": 5}},
        },
    }
    assert score_trace(DEMO, expected, harness=HARNESS).verified


def test_a_contract_can_declare_which_scorers_verify():
    spec = DEMO.model_copy(deep=True)
    spec.specialists["chat"].scorers[1].verifies = True  # the length check, declared an outcome check
    spec.specialists["chat"].scorers[0].verifies = False  # exact_match, declared not to count
    assert score_trace(spec, chat("fine", metadata={"specialist": "chat"})).turns[-1].verified_by == [
        "length"
    ]
    assert "exact_match" not in score_trace(spec, chat("4", "4")).turns[-1].verified_by


def test_a_correction_is_scored_without_the_rating_it_came_with():
    right = score_trace(DEMO, chat("5", "4", feedback={"rating": 1, "correction": "4"}))
    assert right.correction == {"total": 1.0, "verified_by": ["exact_match"], "failed": [], "errors": {}}
    wrong = score_trace(DEMO, chat("5", "4", feedback={"rating": 1, "correction": "6"}))
    assert wrong.correction["failed"] == ["exact_match"] and wrong.correction["total"] < 0.8
    assert score_trace(DEMO, chat("5", "4", feedback=1)).correction is None


def test_stale_rows_are_scored_again_and_history_keeps_what_they_replaced(session):
    from pipeline.registry.models import ScoreHistory
    from pipeline.scoring import rescore_experience

    add_traces(
        session,
        [chat("4", "4", metadata={"specialist": "chat"}), chat("hi", metadata={"specialist": "chat"})],
    )
    cv = add_contract(session, DEMO, "1")
    first = score_experience(session=session, contract_version_id=cv)
    assert first.scored == 2 and first.unverified == 1
    total = {r.experience_id: r for r in session.scalars(select(Score).where(Score.scorer == "total"))}
    assert total[1].verified is True and total[2].verified is False and total[1].specialist == "chat"
    final = {r.experience_id: r for r in session.scalars(select(Score).where(Score.scorer == "final"))}
    assert final[1].verified is True and final[1].value == 1.0 and final[2].verified is False
    # a trace scored before its final turn's row was recorded counts as unscored
    session.delete(final[2])
    session.commit()
    again = score_experience(session=session, contract_version_id=cv)
    assert again.scored == 1 and again.already_scored == 1 and again.superseded > 0
    history = session.scalars(select(ScoreHistory)).all()
    assert {h.experience_id for h in history} == {2} and all(
        "before the final turn's row" in h.reason for h in history
    )
    # feedback that arrives later: the trace is scored again, the old rows kept beside the new ones
    session.get(Experience, 2).feedback = {"rating": 5}
    session.commit()
    (done,) = rescore_experience(session=session, experience_ids=[2], reason="feedback arrived after scoring")
    assert done.scored == 1 and done.unverified == 0
    new = session.scalar(select(Score).where(Score.experience_id == 2, Score.scorer == "total"))
    assert new.verified and new.details["verified_by"] == ["feedback"]
    reasons = {h.reason for h in session.scalars(select(ScoreHistory).where(ScoreHistory.experience_id == 2))}
    assert "feedback arrived after scoring" in reasons


def test_the_rl_reward_is_the_verified_final_turn_and_cannot_be_bought():
    """What GRPO maximises: the final turn's contract score when it was verified. Attacks kept: spraying calls
    over an episode's turns, a right call followed by a wrong one, and an unverifiable ending pay nothing."""
    from pipeline.environment import sample_prompts
    from pipeline.experience.toolcalls import to_openai
    from pipeline.scoring import EpisodeReward, episode_reward

    contract = load_contract(ROOT / "contracts" / "demo.yaml")
    item = next(
        it
        for it in sample_prompts("agent", 20, seed=3)
        if it["metadata"]["expected_call"]["name"] == "set_timer"
    )
    minutes = item["metadata"]["expected_call"]["arguments"]["minutes"]

    def calls(*values):
        return {"role": "assistant", "content": None,
                "tool_calls": to_openai([{"name": "set_timer", "arguments": {"minutes": v}} for v in values])}  # fmt: skip

    result = {"role": "tool", "tool_call_id": "x", "content": "{}"}

    def reward(*turns):
        trace = {"messages": [*item["messages"], *turns], "metadata": item["metadata"], "feedback": None}
        return episode_reward(contract, trace, harness=HARNESS, specialist="agent")

    call_turn = len(item["messages"])
    assert reward(calls(minutes)) == EpisodeReward(1.0, call_turn)
    # the verdict on the call pays for the call turn; the text after it is checked by nothing and never paid
    lie = {"role": "assistant", "content": "I could not set any timer, sorry. Also 2+2=5."}
    assert reward(calls(minutes), result, lie) == EpisodeReward(1.0, call_turn)
    assert reward(calls(minutes - 1, minutes, minutes + 1)).value == 0.0  # several at once
    assert reward(calls(minutes - 1), result, calls(minutes)).value == 0.0  # one per turn
    assert reward(calls(minutes), result, calls(minutes + 1)).value == 0.0  # right, then wrong
    assert reward(calls(minutes), result, calls(minutes)).value == 0.0  # right twice: the timer set twice
    chat = sample_prompts("chat", 1, seed=3)[0]
    unchecked = {"messages": [*chat["messages"], {"role": "assistant", "content": "47"}], "metadata": {}}
    assert episode_reward(contract, unchecked, harness=HARNESS, specialist="chat") == EpisodeReward(0.0, None)


# ---- what may be learned: the final turn, its own checks, trusted material only (issue 21) -----------------
def test_a_multi_turn_trace_is_selected_on_its_final_turn_not_its_mean():
    """Found on main: four earlier turns scored by `length` alone and a wrong final `99` (expected 84) made a
    trace total of 0.833, above the 0.8 threshold, and "verified" meant a check applied, not passed."""
    messages = []
    for i in range(4):
        messages += [{"role": "user", "content": f"say hi {i}"}, {"role": "assistant", "content": "hi"}]
    messages += [{"role": "user", "content": "40+44=?"}, {"role": "assistant", "content": "99"}]
    trace = {"messages": messages, "metadata": {"specialist": "chat", "expected": "84"}, "feedback": None}
    result = score_trace(DEMO, trace, harness=HARNESS)
    assert result.total > DEMO.selection.min_score  # the mean the old selection read
    assert result.final.total < DEMO.selection.min_score
    assert result.final.verified_by == ["exact_match"] and result.final.failed_checks == ["exact_match"]
    assert not result.final_passed


def test_a_text_turn_after_tool_calls_is_not_verified_by_them():
    """Found on main: "I could not set any timer, sorry. Also 2+2=5." after a right `set_timer(minutes=47)`
    scored 1.0 and was an SFT target: the call's verdict was lent to the text."""
    from pipeline.experience.toolcalls import to_openai

    call = {"role": "assistant", "content": None,
            "tool_calls": to_openai([{"name": "set_timer", "arguments": {"minutes": 47}}])}  # fmt: skip
    trace = {
        "messages": [
            {"role": "user", "content": "timer 20+27"},
            call,
            {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "content": "timer set"},
            {"role": "assistant", "content": "I could not set any timer, sorry. Also 2+2=5."},
        ],
        "metadata": {
            "specialist": "agent",
            "expected_call": {"name": "set_timer", "arguments": {"minutes": 47}},
        },
        "feedback": None,
    }
    result = score_trace(DEMO, trace, harness=HARNESS)
    assert result.turns[0].verified_by == ["tool_call"] and result.turns[0].total == 1.0
    assert result.final.verified_by == [] and not result.final_passed


def test_metadata_and_ratings_count_only_from_principals_the_contract_trusts():
    """The trace's principal certified its metadata; a rating counts for its rater. A contract may name whom
    each verifying scorer trusts; the loop's own practice is always trusted, an unknown principal never."""
    narrowed = DEMO.model_copy(deep=True)
    chat_scorers = narrowed.specialists["chat"].scorers
    chat_scorers[0].trusted = ["crm"]  # exact_match
    chat_scorers[2].trusted = ["raters"]  # feedback
    base = chat("84", "84", metadata={"specialist": "chat"})
    for principal, checked in (("crm", True), ("ratchet", True), ("other", False), (None, False)):
        result = score_trace(narrowed, {**base, "principal": principal}, harness=HARNESS)
        assert ("exact_match" in result.final.verified_by) is checked, principal
    rated = {**chat("hello"), "principal": "other", "feedback": {"rating": 5, "rating_by": "raters"}}
    assert score_trace(narrowed, rated, harness=HARNESS).final.verified_by == ["feedback"]
    rated["feedback"] = {"rating": 5, "rating_by": "anonymous"}
    assert score_trace(narrowed, rated, harness=HARNESS).final.verified_by == []
    # what a client sent without the scope sits under `claimed`: no scorer reads it
    claimed = {**chat("99"), "principal": "anonymous", "metadata": {"claimed": {"expected": "99"}},
               "feedback": {"claimed": {"rating": 5, "rating_by": "anonymous", "correction": "99"}}}  # fmt: skip
    result = score_trace(DEMO, claimed, harness=HARNESS)
    assert result.final.verified_by == [] and result.correction is None
