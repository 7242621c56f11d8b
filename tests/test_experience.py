"""Experience ingest: streaming, idempotent, every malformed line quarantined with its reason."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import func, select

from pipeline.errors import NotFoundError, RatchetError
from pipeline.experience.ingest import TraceError, ingest_file, trace_row, validate_trace
from pipeline.registry import Experience, Quarantine, session_scope
from pipeline.registry.models import utcnow


def _trace(i: int, **extra) -> dict:
    return {
        "messages": [
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": f"What is {i}+1?"},
            {"role": "assistant", "content": str(i + 1)},
        ],
        "metadata": {"specialist": "chat", "expected": str(i + 1)},
        **extra,
    }


def _write(path, lines):
    with open(path, "wb") as fh:
        for line in lines:
            fh.write((line if isinstance(line, bytes) else line.encode()) + b"\n")
    return path


def _count(engine, model):
    with session_scope(engine) as s:
        return s.scalar(select(func.count()).select_from(model))


def test_ingest_is_idempotent_and_counts_everything(engine, tmp_path):
    good = [json.dumps(_trace(i)) for i in range(50)]
    tool = {
        "messages": [
            {"role": "user", "content": "set a timer for 5 minutes"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "set_timer", "arguments": '{"minutes": 5}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            {"role": "assistant", "content": "Timer set."},
        ],
        "metadata": {"specialist": "agent"},
        "feedback": {"rating": 1, "correction": None},
        "routes": [{"turn": 1, "specialist": "agent", "reason": "signal: timer"}],
    }
    path = _write(tmp_path / "t.jsonl", [*good, good[3], json.dumps(tool)])
    factory = lambda: session_scope(engine)  # noqa: E731
    first = ingest_file(path, session_factory=factory, batch_size=16)
    assert (first.lines, first.stored, first.duplicate, first.quarantined) == (52, 51, 1, 0)
    again = ingest_file(path, session_factory=factory, batch_size=7)
    assert (again.stored, again.duplicate) == (0, 52)
    assert _count(engine, Experience) == 51
    with session_scope(engine) as s:
        row = s.scalar(select(Experience).where(Experience.specialist == "agent"))
        assert row.routes[0]["reason"] == "signal: timer" and row.feedback == {
            "rating": 1,
            "correction": None,
        }
        assert row.messages[1]["tool_calls"][0]["function"]["name"] == "set_timer"
        assert row.source == "import"
        age = (utcnow() - row.created_at).total_seconds()
        assert 0 <= age < 60, row.created_at


BAD_LINES = [
    (b"{not json", "bad JSON"),
    (b'\xff\xfe{"messages": []}', "invalid UTF-8"),
    (b"[1, 2]", "wrong shape"),
    (json.dumps({"messages": []}).encode(), "wrong shape: messages"),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(), "role"),
    (json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), "content"),
    (json.dumps({"messages": [{"role": "tool", "content": "x"}]}).encode(), "tool_call_id"),
    (json.dumps({**_trace(1), "feedback": "great"}).encode(), "feedback"),
    (json.dumps({**_trace(2), "extra": 1}).encode(), "unknown field"),
    (json.dumps({**_trace(3), "metadata": [1]}).encode(), "metadata"),
]


def test_every_malformed_line_is_quarantined(engine, tmp_path):
    big = json.dumps(_trace(99, metadata={"blob": "x" * 5000})).encode()
    lines = [json.dumps(_trace(0)).encode()] + [b for b, _ in BAD_LINES] + [big, b"", b"   "]
    path = _write(tmp_path / "bad.jsonl", lines)
    result = ingest_file(path, session_factory=lambda: session_scope(engine), max_line_bytes=4096)
    assert result.stored == 1
    assert result.quarantined == len(BAD_LINES) + 1
    assert result.lines == result.stored + result.duplicate + result.quarantined
    with session_scope(engine) as s:
        rows = s.scalars(select(Quarantine).order_by(Quarantine.line_number)).all()
    assert [r.line_number for r in rows] == list(range(2, 2 + len(BAD_LINES) + 1))
    for row, (_, expected) in zip(rows, BAD_LINES, strict=False):
        assert expected in row.reason, (row.reason, expected)
    assert "oversized line" in rows[-1].reason and len(rows[-1].raw) == 0


def test_a_rotated_log_gets_its_own_bad_lines_quarantined(engine, tmp_path):
    """A log rotated under the same name has new bad lines at the numbers the old one had: each is stored
    (quarantine knows a line by file, number and content), while a rerun of the same file adds no row twice.
    (A bad line at a number already quarantined under that name was counted and never stored.)"""
    path = tmp_path / "serve.jsonl"
    factory = lambda: session_scope(engine)  # noqa: E731
    big = json.dumps(_trace(7, metadata={"blob": "x" * 5000}))
    _write(path, [json.dumps(_trace(0)), "{not json", big])
    first = ingest_file(path, session_factory=factory, max_line_bytes=4096)
    _write(path, [json.dumps(_trace(1)), '{"messages": [1]', big.replace("x", "y")])  # rotated: same name
    rotated = ingest_file(path, session_factory=factory, max_line_bytes=4096)
    again = ingest_file(path, session_factory=factory, max_line_bytes=4096)  # a rerun of the rotated file
    assert (first.stored, first.quarantined) == (rotated.stored, rotated.quarantined) == (1, 2)
    assert (again.stored, again.duplicate, again.quarantined) == (0, 1, 2)
    with session_scope(engine) as s:
        rows = s.scalars(select(Quarantine).order_by(Quarantine.id)).all()
    assert [(r.line_number, r.raw.strip()) for r in rows] == [
        (2, "{not json"),
        (3, ""),
        (2, '{"messages": [1]'),
        (3, ""),
    ]
    assert len({r.line_sha256 for r in rows}) == 4 and all(len(r.line_sha256) == 64 for r in rows)


def test_missing_file_and_bad_source(engine, tmp_path):
    with pytest.raises(NotFoundError, match="no such file"):
        ingest_file(tmp_path / "nope.jsonl", session_factory=lambda: session_scope(engine))
    path = _write(tmp_path / "x.jsonl", [json.dumps(_trace(0))])
    with pytest.raises(RatchetError, match="unknown source 'web'"):
        ingest_file(path, session_factory=lambda: session_scope(engine), source="web")


def test_content_hash_is_canonical():
    a = trace_row(validate_trace(_trace(1)), source="import")
    reordered = json.loads(json.dumps(_trace(1), sort_keys=True))
    reordered["metadata"] = dict(reversed(list(reordered["metadata"].items())))
    assert trace_row(validate_trace(reordered), source="import").content_hash == a.content_hash
    assert trace_row(validate_trace(_trace(2)), source="import").content_hash != a.content_hash
    served_twice = {
        trace_row(validate_trace(_trace(1)), source="deployment", completion_id=c).content_hash
        for c in ("a", "b")
    }
    assert len(served_twice) == 2
    with pytest.raises(TraceError):
        validate_trace({"messages": [{"role": "user"}]})


def test_memory_stays_flat_on_a_large_file(tmp_path):
    """Streaming: peak Python allocations do not grow with the file (10k vs 1k lines)."""
    import tracemalloc

    from pipeline.registry import make_engine, upgrade_db

    url = f"sqlite:///{tmp_path / 'mem.db'}"
    upgrade_db(url)
    engine = make_engine(url)

    def peak(n):
        path = _write(tmp_path / f"{n}.jsonl", [json.dumps(_trace(i)) for i in range(n)])
        tracemalloc.start()
        ingest_file(path, session_factory=lambda: session_scope(engine), batch_size=500)
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top

    small, large = peak(1_000), peak(10_000)
    assert large < small * 2, (small, large)


def test_cli_ingest(tmp_path, capsys):
    from pipeline.cli import main

    path = _write(tmp_path / "t.jsonl", [json.dumps(_trace(i)) for i in range(3)] + [b"{oops"])
    main(["ingest", str(path)])
    out = capsys.readouterr().out
    assert "4 lines: 3 stored, 0 duplicate, 1 quarantined (bad JSON: 1)" in out
    with pytest.raises(SystemExit) as exc:
        main(["ingest", str(tmp_path / "missing.jsonl")])
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no such file" in err and "Traceback" not in err


def test_ingest_is_the_operators_path_and_names_its_principal(tmp_path, capsys):
    """`ratchet ingest` stays the operator's own trusted path: traces are stored under `operator`, or under the
    outside party named with `--principal` (whose share of a dataset the contract caps); the loop's own name
    is refused."""
    from pipeline.cli import main
    from pipeline.registry import get_engine

    mine = _write(tmp_path / "mine.jsonl", [json.dumps(_trace(i)) for i in range(2)])
    theirs = _write(tmp_path / "theirs.jsonl", [json.dumps(_trace(10 + i)) for i in range(3)])
    main(["ingest", str(mine)])
    main(["ingest", str(theirs), "--principal", "crm-export"])
    with session_scope(get_engine()) as s:
        counts = dict(
            s.execute(select(Experience.principal, func.count()).group_by(Experience.principal)).all()
        )
    assert counts == {"operator": 2, "crm-export": 3}
    capsys.readouterr()
    for name in ("ratchet", "has space", ""):
        with pytest.raises(SystemExit) as exc:
            main(["ingest", str(mine), "--principal", name])
        err = capsys.readouterr().err
        assert exc.value.code == 1 and "principal" in err and len(err.strip().splitlines()) == 1
