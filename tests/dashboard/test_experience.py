"""Experience pages on SQLite and PostgreSQL: every filter returns exactly the matching traces over its keyset
pages, and a scanned filter that runs out of time says how far it searched and continues from there."""

from __future__ import annotations

import hashlib
import json

import pytest
from sqlalchemy.orm import Session

from pipeline.dashboard import experience, trace
from pipeline.dashboard.experience import ExperienceQuery, failed_checks, final_status
from pipeline.registry import (
    ScoreRow,
    TraceRow,
    create_generation,
    insert_scores,
    insert_traces,
    register_base_model,
    register_contract,
    register_harness,
)


def list_experience(**kwargs) -> dict:
    """One page as the API returns it (its response model, dumped): the assertions read it by key."""
    return experience.list_experience(**kwargs).model_dump()


def split_feedback(raw) -> tuple[list[dict], list[dict]]:
    """The (counted, claimed) feedback entries, dumped."""
    counted, claimed = trace.split_feedback(raw)
    return [e.model_dump() for e in counted], [e.model_dump() for e in claimed]


N = 1500
SPECIALISTS = ("chat", "agent", "coding")
PRINCIPALS = ("crm", "anonymous", "operator", None)  # None: served before principals were recorded


def _truth(i: int) -> dict:
    """What trace ``i`` of the seed is: its final turn's score and verdict, its principal and feedback.

    A third is not scored, and some scored ones have only the ``total`` row of a contract scored before
    ``final`` rows existed (not scored under the final-turn rules). The rest: the final turn passed, a
    verifying check failed on it, or no verifying check applied (a form check may still give it 1.0). The
    ``total`` row (the mean over turns) is always "verified" and scores the opposite of the final turn: a page
    that read it would show every trace as checked and filter scores the wrong way round."""
    value = (i % 10) / 10 if i % 3 != 2 else None
    legacy = value is not None and i % 13 == 0
    kind = i % 4
    status = (
        "not scored"
        if value is None or legacy
        else ("passed", "not verified", "failed", "not verified")[kind]
    )
    feedback: dict = {}
    if i % 7 == 0:
        feedback |= {"correction": "x", "correction_by": "crm"}
    if i % 11 == 0:
        feedback |= {"rating": 1}
    if i % 17 == 0:  # a client without the scopes: kept apart, never counted
        feedback |= {"claimed": {"rating": 0, "rating_by": "anonymous", "correction": "y"}}
    return {
        "i": i,
        "score": None if status == "not scored" else value,
        "value": value,
        "total": None if value is None else 1 - value,
        "legacy": legacy,
        "status": status,
        "failed": ["exact_match"] if status == "failed" else [],
        "principal": PRINCIPALS[(i // 3) % 4],
        "feedback": feedback or None,
    }


def _seed(engine) -> dict[int, dict]:
    from sqlalchemy import select

    from pipeline.registry import Experience

    with Session(engine) as s, s.begin():
        base = register_base_model(session=s, name="b", path="/nowhere", spec={})
        harness = register_harness(session=s, name="h", version="1", spec={})
        contract = register_contract(session=s, name="c", version="1", spec={})
        gen = create_generation(session=s, base_model_id=base.id, harness_version_id=harness.id,
                                contract_version_id=contract.id, specialists=list(SPECIALISTS), status="promoted")  # fmt: skip
        rows, truths = [], []
        for i in range(N):
            t = _truth(i)
            truths.append(t)
            text = f"question {i}" + (" needle" if i % 97 == 0 else "")
            messages = [{"role": "user", "content": text}, {"role": "assistant", "content": f"answer {i}"}]
            feedback = t["feedback"]
            rows.append(TraceRow(content_hash=hashlib.sha256(str(i).encode()).hexdigest(), messages=json.dumps(messages),
                                 metadata="{}", feedback=None if feedback is None else json.dumps(feedback), routes="[]",
                                 specialist=SPECIALISTS[i % 3], source="import" if i % 2 else "simulation",
                                 generation_id=gen.id if i % 5 == 0 else None, principal=t["principal"]))  # fmt: skip
        assert insert_traces(session=s, rows=rows) == N
        ids = list(s.scalars(select(Experience.id).order_by(Experience.id)))
        truth = {}
        scores = []
        for t, eid in zip(truths, ids, strict=True):
            truth[eid] = t
            if t["total"] is None:
                continue
            sp = SPECIALISTS[t["i"] % 3]
            scores.append(ScoreRow(eid, contract.id, "total", t["total"], {}, verified=True, specialist=sp))
            if not t["legacy"]:
                details = {"turn": 1, "verified_by": [] if t["status"] == "not verified" else ["exact_match"],
                           "failed": t["failed"]}  # fmt: skip
                if t["i"] % 8 == 0:  # a passed correction's own checks sit beside the final turn's
                    details["correction"] = {"total": 1.0, "verified_by": ["exact_match"], "failed": []}
                scores.append(ScoreRow(eid, contract.id, "final", t["value"], details,
                                       verified=t["status"] != "not verified", specialist=sp))  # fmt: skip
        insert_scores(session=s, rows=scores)
    return truth


def _all(session: Session, query: dict, **kw) -> tuple[list[int], int]:
    """Follow the pages to the end; returns the ids seen and how many pages stopped early."""
    seen, before, early = [], None, 0
    for _ in range(10_000):
        page = list_experience(
            session=session, lineage="main", query=ExperienceQuery(**query, before=before, limit=40), **kw
        )
        seen += [t["id"] for t in page["traces"]]
        early += page["searched_to"] is not None
        before = page["older"]
        if before is None:
            return seen, early
    raise AssertionError("pages never ended")


def _counted(t: dict, field: str) -> bool:
    return field in (t["feedback"] or {})


MATCH = {
    "none": ({}, lambda t: True),
    "specialist": ({"specialist": "agent"}, lambda t: SPECIALISTS[t["i"] % 3] == "agent"),
    "source+specialist": (
        {"source": "import", "specialist": "chat"},
        lambda t: t["i"] % 2 == 1 and t["i"] % 3 == 0,
    ),
    "generation": ({"generation": 0}, lambda t: t["i"] % 5 == 0),
    "verified": ({"verified": "yes"}, lambda t: t["status"] == "passed"),
    "failed": ({"verified": "failed"}, lambda t: t["status"] == "failed"),
    "not verified": ({"verified": "no"}, lambda t: t["status"] == "not verified"),
    "unscored": ({"verified": "unscored"}, lambda t: t["status"] == "not scored"),
    "score range": (
        {"score_min": 0.3, "score_max": 0.5},
        lambda t: t["score"] is not None and 0.3 <= t["score"] <= 0.5,
    ),
    "correction": ({"feedback": "correction"}, lambda t: _counted(t, "correction")),
    "rating": ({"feedback": "rating"}, lambda t: _counted(t, "rating")),
    "claimed": ({"feedback": "claimed"}, lambda t: _counted(t, "claimed")),
    "no feedback": ({"feedback": "none"}, lambda t: t["feedback"] is None),
    "text": ({"q": "NEEDLE"}, lambda t: t["i"] % 97 == 0),
    "text none": ({"q": "no such words"}, lambda t: False),
    "principal": ({"principal": "crm"}, lambda t: t["principal"] == "crm"),
    "principal unknown": ({"principal": "(unknown)"}, lambda t: t["principal"] is None),
    "principal+verified": (
        {"principal": "anonymous", "verified": "no"},
        lambda t: t["principal"] == "anonymous" and t["status"] == "not verified",
    ),
}


@pytest.mark.parametrize("case", list(MATCH))
def test_filters_over_keyset_pages(engine, case):
    truth = _seed(engine)
    query, keep = MATCH[case]
    expected = sorted((eid for eid, t in truth.items() if keep(t)), reverse=True)
    with Session(engine) as s:
        seen, _ = _all(s, query)
    assert seen == expected


def test_each_row_says_whether_its_final_turn_passed(engine):
    """The list's verdict is the ``final`` row's: passed (a verifying check applied, none failed), failed (and
    which checks), not verified (no verifying check applied: its score is no pass), or not scored under the
    final-turn rules -- never the ``total`` row's, whatever it says. Each row names its principal."""
    truth = _seed(engine)
    with Session(engine) as s:
        rows = []
        before = None
        while True:
            page = list_experience(session=s, lineage="main", query=ExperienceQuery(before=before, limit=200))
            rows += page["traces"]
            if (before := page["older"]) is None:
                break
    assert len(rows) == N and {r["status"] for r in rows} == {
        "passed",
        "failed",
        "not verified",
        "not scored",
    }
    for r in rows:
        t = truth[r["id"]]
        assert (r["status"], r["failed"], r["principal"]) == (t["status"], t["failed"], t["principal"]), t
        assert r["verified"] is ({"passed": True, "not scored": None}.get(t["status"], False))
        assert r["score"] == (None if t["status"] == "not scored" else pytest.approx(t["score"]))
        fb = t["feedback"] or {}
        assert r["feedback"] == bool(fb)
        assert r["feedback_counted"] == ("rating" in fb or "correction" in fb)
        assert r["feedback_claimed"] == ("claimed" in fb)


def test_a_principal_filter_is_one_indexed_query(engine):
    _seed(engine)
    with Session(engine) as s:
        alone = list_experience(session=s, lineage="main", query=ExperienceQuery(principal="crm", limit=5))
        unknown = list_experience(session=s, lineage="main", query=ExperienceQuery(principal="(unknown)"))
        both = list_experience(
            session=s, lineage="main", query=ExperienceQuery(principal="crm", specialist="chat", limit=5)
        )
    assert not alone["scanned"] and not unknown["scanned"] and both["scanned"]
    assert [t["principal"] for t in alone["traces"]] == ["crm"] * 5
    assert unknown["traces"] and {t["principal"] for t in unknown["traces"]} == {None}


def test_a_scan_out_of_time_continues_where_it_stopped(engine, monkeypatch):
    truth = _seed(engine)
    monkeypatch.setattr(experience, "FIRST_WINDOW", 100)
    expected = sorted((eid for eid, t in truth.items() if t["i"] % 97 == 0), reverse=True)
    with Session(engine) as s:
        seen, early = _all(s, {"q": "needle"}, budget_s=0.0)  # every page stops after its first window
        page = list_experience(
            session=s, lineage="main", query=ExperienceQuery(q="needle", limit=40), budget_s=0.0
        )
    assert seen == expected and early > 5
    assert page["searched_to"] is not None and page["older"] == page["searched_to"]
    assert all(t["id"] >= page["searched_to"] for t in page["traces"])


def test_newer_pages_walk_back_up(engine):
    truth = _seed(engine)
    ids = sorted(truth, reverse=True)
    with Session(engine) as s:
        older = list_experience(session=s, lineage="main", query=ExperienceQuery(before=ids[100], limit=10))
        newer = list_experience(
            session=s, lineage="main", query=ExperienceQuery(after=older["newer"], limit=10)
        )
        text = list_experience(
            session=s, lineage="main", query=ExperienceQuery(after=ids[-1], q="answer", limit=5)
        )
    assert [t["id"] for t in older["traces"]] == ids[101:111]
    assert [t["id"] for t in newer["traces"]] == ids[91:101]
    assert [t["id"] for t in text["traces"]] == ids[-6:-1]


def test_cursors_beyond_the_table_are_clamped_and_newer_scans_continue_upwards(engine, monkeypatch):
    truth = _seed(engine)
    monkeypatch.setattr(experience, "FIRST_WINDOW", 100)
    expected = sorted(eid for eid, t in truth.items() if t["i"] % 97 == 0)
    with Session(engine) as s:
        far = list_experience(
            session=s, lineage="main", query=ExperienceQuery(q="needle", before=2**62), budget_s=0.0
        )
        assert (
            far["searched_to"] is not None and far["searched_to"] > max(truth) - 200
        )  # one window, not the table
        seen, after = [], 0
        for _ in range(1000):  # walking up from the oldest trace, a window at a time
            page = list_experience(session=s, lineage="main", query=ExperienceQuery(q="needle", after=after, limit=3), budget_s=0.0)  # fmt: skip
            seen += sorted(t["id"] for t in page["traces"])
            if page["newer"] is None:
                break
            after = page["newer"]
    assert seen == expected


def test_a_tool_call_answer_is_previewed_by_its_name(engine):
    with Session(engine) as s, s.begin():
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "set a timer"},
                    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "set_timer", "arguments": "{}"}}]}]  # fmt: skip
        insert_traces(session=s, rows=[TraceRow(content_hash="t" * 64, messages=json.dumps(messages), metadata="{}",
                                                feedback=None, routes="[]", specialist="agent", source="import")])  # fmt: skip
        page = list_experience(session=s, lineage="main", query=ExperienceQuery())
    (trace,) = page["traces"]
    assert trace["prompt"] == "set a timer" and trace["answer"] == "tool call set_timer"


def test_feedback_splits_into_counted_and_claimed_with_who_gave_it():
    served = {"rating": 0.0, "rating_by": "crm", "claimed": {"correction": "x", "correction_by": "anonymous"}}
    assert split_feedback(served) == (
        [{"field": "rating", "value": 0.0, "by": "crm"}],
        [{"field": "correction", "value": "x", "by": "anonymous"}],
    )
    # moved under `claimed` by migration 0007 (served before principals): nobody recorded as its sender
    legacy = {"claimed": {"rating": 5, "correction": "y"}}
    assert split_feedback(legacy) == (
        [],
        [{"field": "rating", "value": 5, "by": None}, {"field": "correction", "value": "y", "by": None}],
    )
    ingested = {"rating": 1, "correction": "z"}  # came with the trace: the trace's principal gave it
    assert split_feedback(ingested)[0] == [
        {"field": "rating", "value": 1, "by": None},
        {"field": "correction", "value": "z", "by": None},
    ]
    assert split_feedback(4) == ([{"field": "rating", "value": 4, "by": None}], [])  # a bare rating counts
    assert split_feedback({"claimed": "<b>odd</b>"}) == (
        [],
        [{"field": "claimed", "value": "<b>odd</b>", "by": None}],
    )
    assert split_feedback("text") == ([], []) and split_feedback(None) == ([], [])


def test_a_failed_check_wins_over_what_the_row_says_beside_it():
    assert final_status(scored=False, verified=True, failed=[]) == "not scored"
    assert final_status(scored=True, verified=True, failed=[]) == "passed"
    assert final_status(scored=True, verified=True, failed=["exact_match"]) == "failed"
    assert final_status(scored=True, verified=False, failed=["odd"]) == "failed"
    assert final_status(scored=True, verified=None, failed=[]) == "not verified"
    assert failed_checks('["a", 2]') == ["a", "2"] and failed_checks(None) == [] and failed_checks("[]") == []
    assert failed_checks("tool_call") == ["tool_call"] and failed_checks({"x": 1}) == ["{'x': 1}"]
