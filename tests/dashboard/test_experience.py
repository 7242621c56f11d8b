"""Experience pages on SQLite and PostgreSQL: every filter returns exactly the matching traces over its keyset
pages, and a scanned filter that runs out of time says how far it searched and continues from there."""

from __future__ import annotations

import hashlib
import json

import pytest
from sqlalchemy.orm import Session

from pipeline.dashboard import experience
from pipeline.dashboard.experience import ExperienceQuery, list_experience
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

N = 1500
SPECIALISTS = ("chat", "agent", "coding")


def _seed(engine) -> dict[int, dict]:
    from sqlalchemy import select

    from pipeline.registry import Experience

    with Session(engine) as s, s.begin():
        base = register_base_model(session=s, name="b", path="/nowhere", spec={})
        harness = register_harness(session=s, name="h", version="1", spec={})
        contract = register_contract(session=s, name="c", version="1", spec={})
        gen = create_generation(session=s, base_model_id=base.id, harness_version_id=harness.id,
                                contract_version_id=contract.id, specialists=list(SPECIALISTS), status="promoted")  # fmt: skip
        rows = []
        for i in range(N):
            text = f"question {i}" + (" needle" if i % 97 == 0 else "")
            messages = [{"role": "user", "content": text}, {"role": "assistant", "content": f"answer {i}"}]
            feedback = {"correction": "x"} if i % 7 == 0 else ({"rating": 1} if i % 11 == 0 else None)
            rows.append(TraceRow(content_hash=hashlib.sha256(str(i).encode()).hexdigest(), messages=json.dumps(messages),
                                 metadata="{}", feedback=None if feedback is None else json.dumps(feedback), routes="[]",
                                 specialist=SPECIALISTS[i % 3], source="import" if i % 2 else "simulation",
                                 generation_id=gen.id if i % 5 == 0 else None))  # fmt: skip
        assert insert_traces(session=s, rows=rows) == N
        ids = list(s.scalars(select(Experience.id).order_by(Experience.id)))
        truth = {}
        scores = []
        for i, eid in enumerate(ids):
            value = (i % 10) / 10 if i % 3 != 2 else None  # a third is not scored
            truth[eid] = {"i": i, "score": value, "verified": None if value is None else i % 2 == 0}
            if value is not None:
                scores.append(
                    ScoreRow(
                        eid,
                        contract.id,
                        "total",
                        value,
                        {},
                        verified=i % 2 == 0,
                        specialist=SPECIALISTS[i % 3],
                    )
                )
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


MATCH = {
    "none": ({}, lambda t: True),
    "specialist": ({"specialist": "agent"}, lambda t: SPECIALISTS[t["i"] % 3] == "agent"),
    "source+specialist": (
        {"source": "import", "specialist": "chat"},
        lambda t: t["i"] % 2 == 1 and t["i"] % 3 == 0,
    ),
    "generation": ({"generation": 0}, lambda t: t["i"] % 5 == 0),
    "verified": ({"verified": "yes"}, lambda t: t["verified"] is True),
    "unscored": ({"verified": "unscored"}, lambda t: t["score"] is None),
    "score range": (
        {"score_min": 0.3, "score_max": 0.5},
        lambda t: t["score"] is not None and 0.3 <= t["score"] <= 0.5,
    ),
    "correction": ({"feedback": "correction"}, lambda t: t["i"] % 7 == 0),
    "no feedback": ({"feedback": "none"}, lambda t: t["i"] % 7 != 0 and t["i"] % 11 != 0),
    "text": ({"q": "NEEDLE"}, lambda t: t["i"] % 97 == 0),
    "text none": ({"q": "no such words"}, lambda t: False),
}


@pytest.mark.parametrize("case", list(MATCH))
def test_filters_over_keyset_pages(engine, case):
    truth = _seed(engine)
    query, keep = MATCH[case]
    expected = sorted((eid for eid, t in truth.items() if keep(t)), reverse=True)
    with Session(engine) as s:
        seen, _ = _all(s, query)
    assert seen == expected


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
