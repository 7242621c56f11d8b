"""The GPU concurrency limit: GPU steps hold a slot of Prefect's global concurrency limit while they run.

Five training tasks are submitted at once (Prefect's thread pool runs them concurrently) through the same
task wrapper the flows use for every step; each records when its work started and ended. With one slot no
two overlap; with five they do (the control: without the limit the check would fail).
"""

from __future__ import annotations

import time

import pytest


@pytest.fixture(scope="module")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


HOLD_S = 0.6  # long enough that five concurrent holds overlap even when threads start late on a busy machine


def train(*, index: int) -> dict:
    """Stands in for the training step's work (the limit under test is around it): when it ran."""
    started = time.monotonic()
    time.sleep(HOLD_S)
    return {"index": index, "start": started, "end": time.monotonic()}


def run_five(limit_name: str | None) -> list[dict]:
    from prefect import flow

    import flows

    @flow(name="five-trainings")
    def five_trainings() -> list[dict]:
        step = flows._step_task().with_options(name="train")
        futures = [step.submit(train, {"index": i}, limit_name) for i in range(5)]
        return [f.result() for f in futures]

    return five_trainings()


def most_at_once(spans: list[dict]) -> int:
    """The largest number of spans running at the same instant (a sweep over starts and ends)."""
    events = sorted(
        [(s["start"], 1) for s in spans] + [(s["end"], -1) for s in spans], key=lambda e: (e[0], e[1])
    )
    running = peak = 0
    for _, change in events:
        running += change
        peak = max(peak, running)
    return peak


def _limit(slots: int) -> str:
    """The test's limit with ``slots`` slots (created the first time, updated in place after)."""
    from prefect.settings import PREFECT_API_URL

    import flows

    flows.ensure_gpu_limit(api_url=PREFECT_API_URL.value(), name="ratchet-gpu-test", slots=slots)
    return "ratchet-gpu-test"


def test_one_slot_runs_training_one_at_a_time(prefect_server):
    spans = sorted(run_five(_limit(1)), key=lambda s: s["start"])
    assert len(spans) == 5
    for before, after in zip(spans, spans[1:], strict=False):
        assert after["start"] >= before["end"], f"tasks {before['index']} and {after['index']} overlapped"
    assert most_at_once(spans) == 1


def test_slots_are_configurable_and_the_control_overlaps(prefect_server):
    """Five slots: they do run together (so the check above can fail); two: never more than two at once."""
    assert most_at_once(run_five(_limit(5))) >= 3
    assert most_at_once(run_five(_limit(2))) == 2


def test_a_missing_limit_is_one_clear_error(prefect_server):
    from pipeline.errors import RatchetError

    with pytest.raises(
        RatchetError, match=r"global concurrency limit 'ratchet-gpu-missing' does not exist.*gcl create"
    ):
        run_five("ratchet-gpu-missing")


def test_a_generation_in_one_flow_takes_gpu_slots_resumes_and_publishes(prefect_server, lineage):
    """`advance_cluster` with no GPU deployment (everything in one flow): the GPU steps go through the limit
    (a missing one stops the run at `train`, after collect, score and curate); the next run continues the
    same candidate without collecting again, and both flows publish their artifacts."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from sqlalchemy import func, select

    from flows import advance_cluster, advance_generation
    from pipeline.errors import RatchetError
    from pipeline.loop.candidate import STEPS, AdvanceConfig, done_steps
    from pipeline.registry import Experience, Generation, get_engine, session_scope

    fast = AdvanceConfig(prompts_per_specialist=12, samples_per_prompt=2, min_examples=2, validation_items=4)

    def state() -> tuple[int, dict]:
        with session_scope(get_engine()) as s:
            collected = s.scalar(select(func.count()).where(Experience.source == "simulation"))
            gen_id = s.scalar(select(Generation.id).where(Generation.number == 1))
        return collected, done_steps(gen_id)

    with pytest.raises(RatchetError, match="'ratchet-gpu-absent' does not exist"):
        advance_cluster(config=fast, gpu_deployment=None, gpu_limit="ratchet-gpu-absent")
    collected, steps = state()
    assert set(steps) == {"discover", "collect", "score", "curate"} and collected > 0

    (outcome,) = advance_cluster(config=fast, gpu_deployment=None, gpu_limit=_limit(1))
    assert outcome["generation"] == 1 and outcome["status"] in ("promoted", "rejected")
    again, steps = state()
    assert again == collected and set(steps) == set(STEPS)  # continued, not collected again

    (second,) = advance_generation(generations=1, config=fast)  # the single-machine flow publishes too
    keys = [f"main-gen-{n}-{what}" for n in (1, 2) for what in ("heldout", "decision")]
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=keys)))
    by_key = {a.key: a for a in found}
    assert set(by_key) == set(keys)
    assert by_key["main-gen-2-decision"].data.startswith(f"# main generation 2: {second['status']}")
    assert second["decision"] in by_key["main-gen-2-decision"].data
