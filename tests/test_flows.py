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


def test_advance_generation_flow(prefect_server, methods_lineage):
    """`ratchet advance`'s flow on a real temporary Prefect server: each step a task, each training job a task
    named by its method, a decision at the end."""
    from prefect.client.orchestration import get_client

    from flows import advance_generation
    from pipeline.loop.candidate import STEPS, AdvanceConfig
    from pipeline.registry import list_generations

    config = AdvanceConfig(
        prompts_per_specialist=12, samples_per_prompt=2, min_examples=2, validation_items=4
    )
    (outcome,) = advance_generation(generations=1, config=config)
    assert outcome["generation"] == 1 and outcome["status"] in ("promoted", "rejected")
    with session_scope(get_engine()) as s:
        gens = list_generations(session=s)
        assert [g.number for g in gens] == [0, 1] and set(gens[1].state["steps"]) == set(STEPS)
        jobs = gens[1].state["steps"]["train"]["adapters"]

    import asyncio

    async def task_names():
        async with get_client() as client:
            runs = await client.read_task_runs()
            return {r.name.rsplit("-", 1)[0] for r in runs}

    names = asyncio.run(task_names())
    assert set(STEPS) <= names, names  # every step ran as a Prefect task
    trained = {f"train-{a['method']}-{s}" for s, a in jobs.items()}
    assert {"train-dpo-chat", "train-grpo-agent", "train-grpo-genui"} <= trained <= names, (trained, names)
