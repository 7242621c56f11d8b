"""`ratchet advance` takes the GPU slot deployments take (issue 22 §3): where a Prefect server is configured
and holds the global concurrency limit `ratchet-gpu`, its train, co-design and evaluate steps each hold a slot
of it while they run, so it never trains beside a deployment's GPU steps past the limit."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def test_advance_takes_the_gpu_slot(prefect_server, lineage):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    from flows import GPU_LIMIT, advance_generation, ensure_gpu_limit
    from pipeline.loop.candidate import AdvanceConfig

    ensure_gpu_limit(api_url=PREFECT_API_URL.value(), slots=1)
    seen: dict[str, int] = {}  # phase -> the limit's slots in use when it first reported

    def progress(phase: str, done: int, total: int) -> None:
        if phase.split()[0] not in seen:
            with get_client(sync_client=True) as client:
                seen[phase.split()[0]] = client.read_global_concurrency_limit_by_name(GPU_LIMIT).active_slots

    config = AdvanceConfig(prompts_per_specialist=4, samples_per_prompt=1, min_examples=2, validation_items=4,
                           seed=1)  # fmt: skip
    (outcome,) = advance_generation(generations=1, config=config, progress=progress)
    assert outcome["status"] in ("promoted", "rejected"), outcome
    assert seen["collect"] == 0, seen  # a CPU step holds no slot
    assert seen["train"] == 1 and seen["evaluate"] == 1, seen  # GPU steps hold one
    with get_client(sync_client=True) as client:
        assert client.read_global_concurrency_limit_by_name(GPU_LIMIT).active_slots == 0  # given back
