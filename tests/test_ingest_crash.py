"""A real `ratchet ingest` killed mid-file (SIGKILL) and rerun stores exactly what one clean run stores:
the same traces and the same quarantine rows, none twice, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from sqlalchemy import func, select

from pipeline.experience.ingest import ingest_file
from pipeline.registry import Experience, Quarantine, make_engine, session_scope, upgrade_db

LINES = 25_000
BATCH = 100
RATCHET = str(Path(sys.executable).parent / "ratchet")


def _write_traces(path: Path) -> Path:
    """A sizeable JSONL file: mostly good traces (some with 30-digit integers), a few repeats, and bad lines
    of several kinds (broken JSON, a raw NUL byte, a wrong-typed specialist)."""
    with open(path, "wb") as fh:
        for i in range(LINES):
            if i % 97 == 5:
                fh.write(b'{"messages": [{"role": "user", "content": "x\x00y"}]}\n')
            elif i % 97 == 50:
                fh.write(b"{broken\n")
            elif i % 97 == 70:
                fh.write(json.dumps({"messages": [{"role": "user", "content": "q"}], "metadata": {"specialist": [i]}}).encode() + b"\n")  # fmt: skip
            else:
                n = i - 1 if i % 101 == 3 else i  # a repeat of the line before: a duplicate
                trace = {
                    "messages": [{"role": "user", "content": f"question {n}"}, {"role": "assistant", "content": f"answer {n}"}],
                    "metadata": {"specialist": "chat", "score": 10**30 + n},
                }  # fmt: skip
                fh.write(json.dumps(trace).encode() + b"\n")
    return path


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def fresh_registry(request, tmp_path):
    """Makes migrated, empty registries on one backend (each PostgreSQL one its own database, dropped after)."""
    made: list[str] = []

    def make() -> str:
        if request.param == "sqlite":
            url = f"sqlite:///{tmp_path / f'registry-{len(made)}.db'}"
        else:
            import psycopg
            from sqlalchemy.engine import make_url

            server = request.getfixturevalue("postgres_server")
            name = f"ratchet_test_{uuid.uuid4().hex[:12]}"
            with psycopg.connect(server.replace("postgresql+psycopg", "postgresql"), autocommit=True) as conn:
                conn.execute(f'CREATE DATABASE "{name}"')
            url = make_url(server).set(database=name).render_as_string(hide_password=False)
        made.append(url)
        upgrade_db(url)
        return url

    yield make
    from pipeline.registry import dispose_engines

    dispose_engines()
    if request.param == "postgresql":
        import psycopg
        from sqlalchemy.engine import make_url

        admin = request.getfixturevalue("postgres_server").replace("postgresql+psycopg", "postgresql")
        with psycopg.connect(admin, autocommit=True) as conn:
            for url in made:
                conn.execute(f'DROP DATABASE IF EXISTS "{make_url(url).database}" WITH (FORCE)')


def _state(url: str) -> tuple[int, int, int, list[tuple[int, str]]]:
    """(traces, distinct content hashes, quarantine rows, each quarantined line and its reason)."""
    engine = make_engine(url)
    try:
        with session_scope(engine) as s:
            traces = s.scalar(select(func.count()).select_from(Experience))
            hashes = s.scalar(select(func.count(func.distinct(Experience.content_hash))))
            rows = s.execute(
                select(Quarantine.line_number, Quarantine.reason).order_by(Quarantine.line_number)
            ).all()
            return traces, hashes, len(rows), [tuple(r) for r in rows]
    finally:
        engine.dispose()


def _ingest_cli(url: str, path: Path, home: Path) -> subprocess.Popen:
    env = {**os.environ, "RATCHET_DATABASE_URL": url, "RATCHET_HOME": str(home)}
    return subprocess.Popen(
        [RATCHET, "ingest", str(path), "--batch-size", str(BATCH)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_killed_ingest_reruns_to_the_clean_result(fresh_registry, tmp_path):
    path = _write_traces(tmp_path / "traces.jsonl")
    clean_url, crashed_url = fresh_registry(), fresh_registry()

    clean = make_engine(clean_url)
    ingest_file(path, session_factory=lambda: session_scope(clean), batch_size=BATCH)
    clean.dispose()
    expected = _state(clean_url)
    assert expected[0] == expected[1] > 20_000 and expected[2] == len(
        {i for i in range(LINES) if i % 97 in (5, 50, 70)}
    )

    proc = _ingest_cli(crashed_url, path, tmp_path / "home")
    watch = make_engine(crashed_url)
    deadline = time.monotonic() + 120
    try:
        while True:  # kill it as soon as some batches are in: mid-file, maybe mid-transaction
            with session_scope(watch) as s:
                stored = s.scalar(select(func.count()).select_from(Experience))
            if stored >= 3 * BATCH or proc.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        assert proc.poll() is None, f"ingest ended before it could be killed: {proc.communicate()}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        watch.dispose()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    partial = _state(crashed_url)
    assert 0 < partial[0] < expected[0] and partial[2] < expected[2], (partial[:3], expected[:3])

    rerun = _ingest_cli(crashed_url, path, tmp_path / "home")
    out, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, err[-2000:]
    assert f"{LINES} lines: " in out and "quarantined" in out
    assert _state(crashed_url) == expected

    again = _ingest_cli(
        crashed_url, path, tmp_path / "home"
    )  # a third run of the finished file changes nothing
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0 and f"{LINES} lines: 0 stored" in out, (out, err[-2000:])
    assert _state(crashed_url) == expected
