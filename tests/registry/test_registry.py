"""Registry data functions on SQLite and PostgreSQL."""

from __future__ import annotations

import threading

import pytest
from registry.adapter_files import stored_adapter
from sqlalchemy import func, select

from pipeline.errors import ConflictError, NotFoundError, RatchetError
from pipeline.registry import (
    AuditLog,
    Generation,
    GenerationStatus,
    create_adapter,
    create_generation,
    get_champion,
    get_generation,
    get_in_flight,
    list_generations,
    promote_generation,
    register_base_model,
    register_contract,
    register_harness,
    rollback_champion,
    session_scope,
    set_generation_adapter,
    set_generation_status,
)
from pipeline.settings import get_settings

SPECIALISTS = ["chat", "agent"]


def _seed(session):
    base = register_base_model(
        session=session, name="tiny", path="/models/tiny", spec={"tiny": {"hidden": 8}}
    )
    harness = register_harness(session=session, name="demo", version="v1", spec={"prompt": "hi"})
    contract = register_contract(session=session, name="demo", version="1", spec={"scorers": []})
    return base, harness, contract


def _gen(session, base, harness, contract, **kw):
    return create_generation(
        session=session,
        base_model_id=base.id,
        harness_version_id=harness.id,
        contract_version_id=contract.id,
        specialists=SPECIALISTS,
        **kw,
    )


def test_versions_are_content_addressed(engine):
    with session_scope(engine) as s:
        base, harness, contract = _seed(s)
        again = register_harness(session=s, name="demo", version="v1", spec={"prompt": "hi"})
        assert again.id == harness.id  # same content twice: a no-op
        with pytest.raises(ConflictError, match="already registered with different content"):
            register_harness(session=s, name="demo", version="v1", spec={"prompt": "changed"})
        with pytest.raises(ConflictError, match="contract 'demo' version '1'"):
            register_contract(session=s, name="demo", version="1", spec={"scorers": ["x"]})
        with pytest.raises(ConflictError):
            register_base_model(session=s, name="tiny", path="/elsewhere", spec={})
        assert (
            register_contract(session=s, name="demo", version="2", spec={"scorers": ["x"]}).id != contract.id
        )
    with session_scope(engine) as s:
        n = s.scalar(select(func.count()).select_from(AuditLog).where(AuditLog.action == "register"))
        assert n == 4  # base, harness, contract v1, contract v2 — no-ops are not audited


def test_generation_lifecycle_and_champion(engine):
    with session_scope(engine) as s:
        base, harness, contract = _seed(s)
        g0 = _gen(s, base, harness, contract)
        assert g0.number == 0 and {a.specialist: a.adapter_id for a in g0.adapters} == {
            "chat": None,
            "agent": None,
        }
        promote_generation(session=s, generation=g0, reason="initial")
        g1 = _gen(s, base, harness, contract, parent_id=g0.id)
        assert g1.number == 1
        adapter = create_adapter(
            session=s,
            specialist="chat",
            base_model_id=base.id,
            rank=8,
            alpha=16,
            target_modules=["q_proj"],
            **stored_adapter(get_settings().artifacts_dir / "chat"),
        )
        assert adapter.version == 1
        set_generation_adapter(session=s, generation=g1, specialist="chat", adapter_id=adapter.id)
        with pytest.raises(RatchetError, match="no specialist 'coding'"):
            set_generation_adapter(session=s, generation=g1, specialist="coding", adapter_id=adapter.id)
        set_generation_status(session=s, generation=g1, status="training")
        set_generation_status(session=s, generation=g1, status="evaluating")
        set_generation_status(session=s, generation=g1, status="promoted", reason="+0.1")
    with session_scope(engine) as s:
        champ = get_champion(session=s)
        assert champ.number == 1 and champ.decision == "+0.1"
        assert get_generation(session=s, number=0).status == GenerationStatus.retired
        assert [g.number for g in list_generations(session=s)] == [0, 1]
        assert {a.specialist: a.adapter_id for a in champ.adapters}["chat"] is not None
        restored = rollback_champion(session=s)
        assert restored.number == 0
    with session_scope(engine) as s:
        assert get_champion(session=s).number == 0
        assert get_generation(session=s, number=1).status == "retired"
        with pytest.raises(ConflictError, match="nothing to roll back to"):
            rollback_champion(session=s)
        actions = s.scalars(select(AuditLog.action).order_by(AuditLog.id)).all()
        assert actions.count("promote") == 2 and "rollback" in actions and "set_adapter" in actions


def test_invalid_transitions_are_refused(engine):
    with session_scope(engine) as s:
        base, harness, contract = _seed(s)
        g0 = _gen(s, base, harness, contract)
        set_generation_status(session=s, generation=g0, status="failed", reason="boom")
        with pytest.raises(ConflictError, match="cannot go from failed to training"):
            set_generation_status(session=s, generation=g0, status="training")
        with pytest.raises(ConflictError, match="only a built generation"):
            promote_generation(session=s, generation=g0)
        with pytest.raises(NotFoundError, match="no generation 7"):
            get_generation(session=s, number=7)


def test_one_candidate_in_flight_per_lineage(engine):
    with session_scope(engine) as s:
        base, harness, contract = _seed(s)
        _gen(s, base, harness, contract)
    with session_scope(engine) as s, pytest.raises(ConflictError, match="already candidate"):
        _gen(s, base, harness, contract)
    with session_scope(engine) as s:
        assert get_in_flight(session=s).number == 0
        # another lineage is independent
        assert _gen(s, base, harness, contract, lineage="other").number == 0


def test_racing_candidates_produce_one(engine):
    with session_scope(engine) as s:
        base, harness, contract = _seed(s)
    results: list[str] = []

    def worker():
        try:
            with session_scope(engine) as s:
                _gen(s, base, harness, contract)
            results.append("created")
        except ConflictError:
            results.append("conflict")

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count("created") == 1, results
    with session_scope(engine) as s:
        assert s.scalar(select(func.count()).select_from(Generation)) == 1


def test_one_champion_enforced_by_the_database(engine):
    from sqlalchemy.exc import IntegrityError

    with session_scope(engine) as s:
        base, harness, contract = _seed(s)
        g0 = _gen(s, base, harness, contract)
        promote_generation(session=s, generation=g0)
        g1 = _gen(s, base, harness, contract, parent_id=g0.id)
    with pytest.raises(IntegrityError), session_scope(engine) as s:
        row = s.get(Generation, g1.id)
        row.status = "promoted"  # bypassing promote_generation: the partial unique index refuses it
        s.flush()


def test_scores_bulk_insert_round_trips(engine):
    """insert_scores (the driver's executemany on SQLite, Core on PostgreSQL) stores what the ORM reads."""
    from datetime import UTC, datetime, timedelta, timezone

    from pipeline.experience.ingest import trace_row, validate_trace
    from pipeline.registry import Experience, Score, ScoreRow, insert_scores, insert_traces

    trace = {"messages": [{"role": "user", "content": "é 2+2"}, {"role": "assistant", "content": "4"}]}
    now = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    with session_scope(engine) as s:
        c = register_contract(session=s, name="c", version="1", spec={"x": 1})
        insert_traces(session=s, rows=[trace_row(validate_trace(trace), source="import")])
        exp_id = s.scalar(select(Experience.id))
        rows = [
            ScoreRow(exp_id, c.id, "exact", 1.0, {"expected": "4", "note": "é", "nested": {"b": [1, 2]}}),
            ScoreRow(exp_id, c.id, "total", None, {"specialist": "chat", "nan": float("nan")}),
        ]
        assert insert_scores(session=s, rows=rows, now=now) == 2
        assert insert_scores(session=s, rows=[]) == 0
    with session_scope(engine) as s:
        got = {r.scorer: r for r in s.scalars(select(Score))}
        assert got["exact"].value == 1.0 and got["total"].value is None
        assert got["exact"].details == {"expected": "4", "note": "é", "nested": {"b": [1, 2]}}
        assert (
            got["total"].details["specialist"] == "chat" and got["total"].details["nan"] is None
        )  # JSON has no NaN
        assert got["exact"].created_at == now and got["exact"].experience_id == exp_id
    paris = datetime(2026, 1, 2, 4, 4, 5, tzinfo=timezone(timedelta(hours=1)))
    with session_scope(engine) as s:  # the ORM path: any zone in, the same instant out, in UTC
        s.add(
            Score(experience_id=exp_id, contract_version_id=c.id, scorer="orm", value=0.5, created_at=paris)
        )
    with session_scope(engine) as s:
        stamp = s.scalar(select(Score.created_at).where(Score.scorer == "orm"))
        assert stamp == paris and stamp.utcoffset() == timedelta(0)
        assert s.scalar(select(Experience.messages).where(Experience.id == exp_id)) == trace["messages"]


def test_a_trace_keeps_its_conversation_tools_and_served_ids(engine):
    """The bulk insert (the driver's executemany on SQLite, Core on PostgreSQL) stores a turn's conversation,
    the tools its client offered and the ids the server decoded; the same messages in another conversation
    are another trace, and the served ids read back as ``ServedTokens``."""
    from pipeline.experience.ingest import trace_row, validate_trace
    from pipeline.registry import Experience, insert_traces
    from pipeline.registry.documents import served_tokens_of

    trace = {"messages": [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}]}
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    served = {"1": {"tokenizer": "f" * 64, "prompt_ids": [5, 6, 7], "completion_ids": [8, 2]}}
    first = trace_row(
        validate_trace(trace),
        source="deployment",
        conversation_id="conv-1",
        tools=tools,
        served_tokens=served,
    )
    other = trace_row(validate_trace(trace), source="deployment", conversation_id="conv-2", tools=tools)
    plain = trace_row(validate_trace(trace), source="deployment")
    assert len({first.content_hash, other.content_hash, plain.content_hash}) == 3
    with session_scope(engine) as s:
        assert insert_traces(session=s, rows=[first, other, plain, first]) == 3
    with session_scope(engine) as s:
        rows = {r.conversation_id: r for r in s.scalars(select(Experience))}
        assert set(rows) == {"conv-1", "conv-2", None}
        assert rows["conv-1"].tools == tools and rows[None].tools is None
        ids = served_tokens_of(rows["conv-1"].served_tokens)
        assert ids["1"].prompt_ids == [5, 6, 7] and ids["1"].completion_ids == [8, 2]
        assert rows["conv-2"].served_tokens is None


def test_json_documents_round_trip_beyond_what_orjson_handles():
    from pipeline.registry.models import dump_json, load_json

    doc = {"b": [1, 2**70 + 1], "é": "ü", "a": {"z": None, "y": 1.5}}  # beyond 64 bits: standard json
    text = dump_json(doc)
    assert text == '{"a":{"y":1.5,"z":null},"b":[1,1180591620717411303425],"é":"ü"}'  # sorted, compact
    assert load_json(text) == doc and load_json(text)["b"][1] == 2**70 + 1  # exact, not rounded
    assert dump_json({2: "turn two", 10: "turn ten"}) == '{"10":"turn ten","2":"turn two"}'  # int keys
    assert dump_json({"x": float("inf")}) == '{"x":null}'
    assert load_json('{"x":NaN}')["x"] != load_json('{"x":NaN}')["x"]  # rows written by json.dumps still load
