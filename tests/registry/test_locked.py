"""SQLite's one write lock: a writer held up past the busy timeout gets one line naming the other writer's
work, and curation holds the lock only for its rows, not while it writes the dataset files."""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest
from sqlalchemy import select
from test_training_faults import ADVANCE  # noqa: E402  (tests/ is on the path: pythonpath in pyproject)

import pipeline.registry.db as registry_db


def _registry_file() -> Path:
    from pipeline.registry import get_engine

    return Path(get_engine().url.database)


@pytest.fixture
def short_busy_timeout(monkeypatch):
    """Half a second instead of 30 (raising=False: the baseline had no such setting and waits its 30 s)."""
    monkeypatch.setattr(registry_db, "BUSY_TIMEOUT_S", 0.5, raising=False)


def test_a_write_held_up_past_the_busy_timeout_is_one_line_naming_the_other_writer(
    short_busy_timeout, lineage, tmp_path, capsys
):
    """`ratchet ingest` while another process holds the write lock (here: a connection in BEGIN IMMEDIATE)
    and an advance run holds its lease: one line that names the run and its generation and says to try again,
    exit 1, no traceback (it was a 64-line "database is locked" traceback)."""
    from pipeline.cli import main
    from pipeline.loop.advance import begin_candidate

    gid = begin_candidate(config=ADVANCE, owner="buildhost:4242:0:cafe0001")
    traces = tmp_path / "more.jsonl"
    traces.write_text(
        json.dumps(
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
        )
        + "\n"
    )
    with closing(sqlite3.connect(_registry_file(), isolation_level=None)) as other:
        other.execute("BEGIN IMMEDIATE")  # the other writer, mid-transaction
        with pytest.raises(SystemExit) as exited:
            main(["ingest", str(traces)])
        other.execute("ROLLBACK")
    assert exited.value.code == 1
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    [line] = [x for x in err.splitlines() if x.startswith("error:")]
    assert "stayed locked by another writer" in line and "run the command again" in line
    assert "buildhost:4242:0:cafe0001" in line and "generation 1 of lineage 'main'" in line, line
    assert gid


def test_any_other_database_error_keeps_its_traceback():
    """Only the lock is the user's to wait out: another OperationalError is not turned into that line."""
    from sqlalchemy.exc import OperationalError

    other = OperationalError("INSERT ...", {}, sqlite3.OperationalError("disk I/O error"))
    assert registry_db.registry_busy(other) is None
    locked = OperationalError("INSERT ...", {}, sqlite3.OperationalError("database is locked"))
    assert registry_db.registry_busy(RuntimeError("database is locked")) is None  # not a database error
    try:
        raise RuntimeError("the step failed") from locked
    except RuntimeError as wrapped:
        assert "stayed locked" in str(registry_db.registry_busy(wrapped))


def test_curation_writes_its_dataset_files_without_holding_the_write_lock(lineage, monkeypatch):
    """While curation saves each dataset (``save_to_disk``), another writer can take SQLite's write lock at
    once; the datasets' rows and provenance are committed together afterwards. (Curation used to hold the
    lock across every dataset write: ingest and serving waited, past 30 s "database is locked".)"""
    import pipeline.loop.curation as curation
    from pipeline.loop.advance import begin_candidate, step_functions
    from pipeline.registry import DatasetExample, TrainingDataset, get_engine, session_scope

    gid = begin_candidate(config=ADVANCE, owner="test")
    for step in ("collect", "score"):
        step_functions()[step](generation_id=gid, config=ADVANCE, progress=None)
    db = _registry_file()
    probes: list[str] = []
    save = curation.save_dataset

    def save_and_probe(examples, path):  # the real save, and beside it: can another writer get in?
        out = save(examples, path)
        with closing(sqlite3.connect(db, timeout=0, isolation_level=None)) as other:
            try:
                other.execute("BEGIN IMMEDIATE")
                other.execute("ROLLBACK")
                probes.append("free")
            except sqlite3.OperationalError as exc:
                probes.append(str(exc))
        return out

    monkeypatch.setattr(curation, "save_dataset", save_and_probe)
    outcome = step_functions()["curate"](generation_id=gid, config=ADVANCE, progress=None)
    written = {s: d for s, d in outcome["datasets"].items() if "sha256" in d}
    assert written and probes == ["free"] * len(written), probes
    with session_scope(get_engine()) as s:
        rows = {
            d.specialist: d
            for d in s.scalars(select(TrainingDataset).where(TrainingDataset.generation_id == gid))
        }
        assert {sp: (r.sha256, r.path) for sp, r in rows.items()} == {
            sp: (d["sha256"], d["path"]) for sp, d in written.items()
        }
        linked = set(s.scalars(select(DatasetExample.dataset_id)))
        assert linked == {r.id for r in rows.values()}
    for d in written.values():
        assert (Path(d["path"]) / "dataset_info.json").is_file()
