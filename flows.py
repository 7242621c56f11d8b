"""Prefect flows: the only module that imports Prefect.

Each pipeline step is a plain function in ``pipeline/``; here they are wrapped as tasks (with retries
where a step may fail transiently, e.g. a locked database) and composed into named flows.

    python -c "from flows import ingest_experience; ingest_experience(['traces.jsonl'])"
    ratchet advance            # runs the advance_generation flow
"""

from __future__ import annotations

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
# The ephemeral API server's first start creates and migrates its database; on a loaded 2-core machine that
# took longer than Prefect's default 20 s and `make demo` died before its first step.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

from prefect import flow, task  # noqa: E402

from pipeline.experience import IngestResult  # noqa: E402

TRANSIENT_RETRIES = 3
RETRY_DELAY_S = 2


@task(name="ingest-file", retries=TRANSIENT_RETRIES, retry_delay_seconds=RETRY_DELAY_S)
def ingest_file_task(
    path: str, source: str, generation_id: int | None, harness_version_id: int | None
) -> IngestResult:
    """Stream one JSONL file into the registry (idempotent, so a retry never duplicates)."""
    from pipeline.experience import ingest_file
    from pipeline.registry import get_engine, session_scope

    engine = get_engine()
    return ingest_file(
        path,
        session_factory=lambda: session_scope(engine),
        source=source,
        generation_id=generation_id,
        harness_version_id=harness_version_id,
    )


@task(name="resolve-generation", retries=TRANSIENT_RETRIES, retry_delay_seconds=RETRY_DELAY_S)
def resolve_generation_task(lineage: str, generation: int | None) -> tuple[int | None, int | None]:
    """The (generation id, harness version id) that served the traces: the given one or the champion."""
    from pipeline.registry import get_champion, get_engine, get_generation, session_scope

    with session_scope(get_engine()) as session:
        gen = (
            get_generation(session=session, number=generation, lineage=lineage)
            if generation is not None
            else get_champion(session=session, lineage=lineage)
        )
        return (gen.id, gen.harness_version_id) if gen is not None else (None, None)


@flow(name="ingest_experience")
def ingest_experience(
    paths: list[str], source: str = "import", lineage: str = "main", generation: int | None = None
) -> list[IngestResult]:
    """Ingest JSONL files of traces into the registry."""
    generation_id, harness_version_id = resolve_generation_task(lineage, generation)
    return [ingest_file_task(p, source, generation_id, harness_version_id) for p in paths]


@task(name="score-experience", retries=TRANSIENT_RETRIES, retry_delay_seconds=RETRY_DELAY_S)
def score_experience_task(contract_version_id: int, rescore: bool = False):
    """Score every unscored trace under one contract version (resumable: commits per batch)."""
    from pipeline.registry import get_engine, session_scope
    from pipeline.scoring import score_experience

    with session_scope(get_engine()) as session:
        return score_experience(session=session, contract_version_id=contract_version_id, rescore=rescore)


@task(name="resolve-contract", retries=TRANSIENT_RETRIES, retry_delay_seconds=RETRY_DELAY_S)
def resolve_contract_task(lineage: str, name: str | None, version: str | None) -> int:
    from pipeline.errors import RatchetError
    from pipeline.registry import get_champion, get_contract_version, get_engine, session_scope

    with session_scope(get_engine()) as session:
        if name is None:
            champion = get_champion(session=session, lineage=lineage)
            if champion is None:
                raise RatchetError(f"lineage {lineage!r} has no champion: run `ratchet init` first")
            return champion.contract_version_id
        return get_contract_version(session=session, name=name, version=version).id


@flow(name="score_experience")
def score_experience(
    lineage: str = "main", contract: str | None = None, version: str | None = None, rescore: bool = False
):
    """Score all unscored experience under a contract version (default: the champion's contract)."""
    contract_version_id = resolve_contract_task(lineage, contract, version)
    return score_experience_task(contract_version_id, rescore)


def _not_a_user_error(task, task_run, state) -> bool:
    """Retry transient failures (a locked database, a dropped connection), never a user's mistake."""
    from pipeline.errors import RatchetError

    try:
        state.result()
    except RatchetError:
        return False
    except Exception:
        return True
    return False


def _step_task():
    from prefect.cache_policies import NO_CACHE

    @task(
        retries=TRANSIENT_RETRIES,
        retry_delay_seconds=RETRY_DELAY_S,
        retry_condition_fn=_not_a_user_error,
        cache_policy=NO_CACHE,
    )
    def advance_step(fn, kwargs):
        return fn(**kwargs)

    return advance_step


@flow(name="advance_generation")
def advance_generation(generations: int = 1, config=None, tracker=None, progress=None) -> list[dict]:
    """Advance the lineage by ``generations`` cycles: collect, score, curate, train, co-design, evaluate, decide.

    Each step runs as a Prefect task; a crashed run continues the same candidate when started again.
    """
    from pipeline.advance import advance_once
    from pipeline.candidate import AdvanceConfig

    config = config or AdvanceConfig()
    step = _step_task()

    def run_step(name, fn, **kwargs):
        return step.with_options(name=name)(fn, kwargs)

    return [
        advance_once(config=config, tracker=tracker, progress=progress, run_step=run_step)
        for _ in range(generations)
    ]
