"""Integration tests of the Prefect flows on a temporary Prefect server."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import func, select

from pipeline.registry import Experience, Score, get_engine, session_scope


@pytest.fixture(scope="module")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def _traces(path, n):
    with open(path, "w") as fh:
        for i in range(n):
            fh.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": f"What is {i}+2?"},
                            {"role": "assistant", "content": str(i + 2 if i % 2 else i)},
                        ],
                        "metadata": {"specialist": "chat", "expected": str(i + 2)},
                    }
                )
                + "\n"
            )
        fh.write("{broken\n")
    return path


def test_ingest_and_score_flows(prefect_server, tmp_path):
    from flows import ingest_experience, score_experience
    from pipeline.cli import main

    main(["init"])
    results = ingest_experience([str(_traces(tmp_path / "a.jsonl", 10))])
    assert (results[0].stored, results[0].quarantined) == (10, 1)
    again = ingest_experience([str(tmp_path / "a.jsonl")])
    assert (again[0].stored, again[0].duplicate) == (0, 10)
    run = score_experience()
    assert run.scored == 10
    with session_scope(get_engine()) as s:
        assert s.scalar(select(func.count()).select_from(Experience)) == 10
        totals = s.scalars(select(Score.value).where(Score.scorer == "total")).all()
    assert len(totals) == 10 and 0 < sum(totals) < 10  # half the answers are right
    assert score_experience().scored == 0  # nothing left unscored
