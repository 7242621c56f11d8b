"""Prefect flows: the only module that imports Prefect.

Each pipeline step is a plain function in ``pipeline/``; here they are wrapped as tasks (with retries
where a step may fail transiently, e.g. a locked database) and composed into named flows.

    python -c "from flows import ingest_experience; ingest_experience(['traces.jsonl'])"
    ratchet advance            # runs the advance_generation flow, every step in this process
    prefect deploy --all       # prefect.yaml: advance_cluster and train_candidate on two work pools

On one machine ``advance_generation`` runs every step in one flow. On a cluster ``advance_cluster`` (work
pool ``ratchet-cpu``) collects, scores and curates, hands training, co-design and evaluation to the
``train_candidate`` deployment (work pool ``ratchet-gpu``) with ``run_deployment``, waits for it and
decides. Both act on the candidate under one lease owner (the CPU flow run's), so no other run can take the
candidate in between; each step records its outcome in the registry, so a step already done is skipped
when a crashed run is started again. GPU steps hold a slot of the global concurrency limit ``ratchet-gpu``
(``prefect gcl create ratchet-gpu --limit N``) while they run. After each decision the flow publishes two
artifacts: the held-out comparison as a table and the decision with its gates as markdown.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

from pipeline.errors import ConflictError, RatchetError
from pipeline.experience.ingest import ingest_file
from pipeline.loop.advance import (
    TRACKED,
    advance_once,
    begin_candidate,
    owner_id,
    release_candidate,
    run_steps,
)
from pipeline.loop.candidate import STEPS, contract_of, done_steps
from pipeline.loop.lease import Lease
from pipeline.loop.promotion import t_quantile
from pipeline.registry import get_champion, get_contract_version, get_engine, get_generation, session_scope
from pipeline.registry.documents import evaluation_of
from pipeline.registry.tracking import MLflowTracker

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
# The ephemeral API server's first start creates and migrates its database; on a loaded 2-core machine that
# took longer than Prefect's default 20 s and `make demo` died before its first step.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
# A worker's flow runs log to its output: no per-file "Loading weights" bars (as `ratchet` itself sets).
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from prefect import flow, task  # noqa: E402

from pipeline.experience.ingest import IngestResult  # noqa: E402
from pipeline.loop.candidate import AdvanceConfig  # noqa: E402

log = logging.getLogger(__name__)

TRANSIENT_RETRIES = 3
RETRY_DELAY_S = 2


@task(name="ingest-file", retries=TRANSIENT_RETRIES, retry_delay_seconds=RETRY_DELAY_S)
def ingest_file_task(
    path: str, source: str, generation_id: int | None, harness_version_id: int | None
) -> IngestResult:
    """Stream one JSONL file into the registry (idempotent, so a retry never duplicates)."""

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
    from pipeline.scoring import score_experience

    with session_scope(get_engine()) as session:
        return score_experience(session=session, contract_version_id=contract_version_id, rescore=rescore)


@task(name="resolve-contract", retries=TRANSIENT_RETRIES, retry_delay_seconds=RETRY_DELAY_S)
def resolve_contract_task(lineage: str, name: str | None, version: str | None) -> int:

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

    try:
        state.result()
    except RatchetError:
        return False
    except Exception:
        return True
    return False


GPU_STEPS = ("train", "codesign", "evaluate")
GPU_LIMIT = "ratchet-gpu"
GPU_DEPLOYMENT = "train_candidate/train-candidate"
HANDOFF_POLL_S = 2  # how often the CPU flow asks whether the GPU flow run has finished


@contextmanager
def gpu_slot(limit: str | None) -> Iterator[None]:
    """Hold one slot of the global concurrency limit ``limit`` on the Prefect server (None: no limit).

    A missing limit is the operator's mistake, not "unlimited": one line says how to create it."""
    if limit is None:
        yield
        return
    from prefect.client.orchestration import get_client
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(limit)
        except ObjectNotFound:
            raise RatchetError(
                f"global concurrency limit {limit!r} does not exist on the Prefect server: create it with "
                f"`prefect gcl create {limit} --limit 1` (the number of GPU steps allowed at once)"
            ) from None
    # a lease renewal that fails once (a busy server) must not kill an hour of training
    with concurrency(limit, occupy=1, strict=True, raise_on_lease_renewal_failure=False):
        yield


def server_gpu_limit(name: str = GPU_LIMIT) -> str | None:
    """``name`` when a Prefect API server is configured (``PREFECT_API_URL``: the server deployments run on,
    ``ratchet up``'s) and holds that global concurrency limit: ``ratchet advance`` then takes a slot of it for
    its GPU steps, as deployments do, so it never trains beside them past the limit. None without a server
    (the ephemeral one is this process's own: nothing to share) or, with a warning, without the limit."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        return None
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            log.warning(
                "the Prefect server at %s has no global concurrency limit %r: GPU steps run without a slot "
                "(create it with `prefect gcl create %s --limit 1`)",
                PREFECT_API_URL.value(),
                name,
                name,
            )
            return None
    return name


def ensure_gpu_limit(*, api_url: str, name: str = GPU_LIMIT, slots: int) -> None:
    """Create the global concurrency limit ``name`` with ``slots`` slots, or set its slots (``ratchet up``)."""
    from prefect.client.orchestration import SyncPrefectClient

    with SyncPrefectClient(api_url) as client:
        client.upsert_global_concurrency_limit_by_name(name, slots)


def _step_task():
    from prefect.cache_policies import NO_CACHE

    @task(
        retries=TRANSIENT_RETRIES,
        retry_delay_seconds=RETRY_DELAY_S,
        retry_condition_fn=_not_a_user_error,
        cache_policy=NO_CACHE,
    )
    def advance_step(fn, kwargs, gpu_limit: str | None = None):
        with gpu_slot(gpu_limit):
            return fn(**kwargs)

    return advance_step


def _job_runner():
    """``run_job(name, fn, **kwargs)``: each training job as its own task, named by method and specialist
    (``train-dpo-chat``), nested in the train step's task (whose retries resume the step, and with it an
    interrupted job from its checkpoint)."""
    from prefect.cache_policies import NO_CACHE

    @task(cache_policy=NO_CACHE)
    def train_job(fn, kwargs):
        return fn(**kwargs)

    def run_job(name, fn, **kwargs):
        return train_job.with_options(name=name)(fn, kwargs)

    return run_job


@flow(name="advance_generation")
def advance_generation(generations: int = 1, config=None, tracker=None, progress=None) -> list[dict]:
    """Advance the lineage by ``generations`` cycles: collect, score, curate, train, co-design, evaluate, decide.

    Each step runs as a Prefect task in this process (the GPU steps under a slot of the global concurrency
    limit ``ratchet-gpu`` where a Prefect server has it: ``server_gpu_limit``); a crashed run continues the
    same candidate when started again.
    """

    config = config or AdvanceConfig()
    step = _step_task()
    gpu_limit = server_gpu_limit()  # the slot deployments' GPU steps take, where there is a server

    def run_step(name, fn, **kwargs):
        return step.with_options(name=name)(fn, kwargs, gpu_limit if name in GPU_STEPS else None)

    outcomes = []
    for _ in range(generations):
        outcomes.append(
            advance_once(
                config=config, tracker=tracker, progress=progress, run_step=run_step, run_job=_job_runner()
            )
        )
        publish_decision(config.lineage, outcomes[-1]["generation"])
    return outcomes


@contextmanager
def _candidate(
    config: AdvanceConfig, owner: str, *, expect: int | None = None, release: bool
) -> Iterator[int]:
    """Hold the candidate's lease as ``owner`` (renewed in the background) while the block runs; the
    candidate must be generation id ``expect`` when given. ``release``: give the lease up afterwards."""

    generation_id = begin_candidate(config=config, owner=owner)
    if expect is not None and generation_id != expect:
        raise ConflictError(
            f"lineage {config.lineage!r}'s candidate is now generation id {generation_id}, not {expect}: the "
            "candidate this run was handed was finished or taken over by another run"
        )
    lease = Lease(generation_id, owner, config.lease_seconds, get_engine()).start()
    try:
        yield generation_id
    finally:
        lease.stop()
        if release:
            release_candidate(generation_id=generation_id, owner=owner)


def _run_steps(steps, *, generation_id: int, config: AdvanceConfig, gpu_limit: str | None = None) -> dict:
    """Run those of ``steps`` not yet done for the candidate, each as a task (GPU steps under a slot of
    ``gpu_limit``); the last step's outcome."""

    step = _step_task()
    todo = set(steps) - set(done_steps(generation_id))
    tracker = MLflowTracker.from_settings() if TRACKED & todo else None

    def as_task(name, fn, **kwargs):
        return step.with_options(name=name)(fn, kwargs, gpu_limit if name in GPU_STEPS else None)

    return run_steps(
        steps,
        generation_id=generation_id,
        config=config,
        tracker=tracker,
        run_step=as_task,
        run_job=_job_runner(),
    )


@flow(name="train_candidate")
def train_candidate(config: AdvanceConfig, generation_id: int, owner: str, gpu_limit: str | None = GPU_LIMIT):
    """The GPU steps (train, co-design, evaluate) of the candidate ``advance_cluster`` handed over.

    It acts as that flow run's lease ``owner`` and leaves the lease to it, so no other run can take the
    candidate between the two."""
    with _candidate(config, owner, expect=generation_id, release=False):
        _run_steps(GPU_STEPS, generation_id=generation_id, config=config, gpu_limit=gpu_limit)


@flow(name="advance_cluster")
def advance_cluster(
    config: AdvanceConfig = AdvanceConfig(),
    generations: int = 1,
    gpu_deployment: str | None = GPU_DEPLOYMENT,
    gpu_limit: str | None = GPU_LIMIT,
) -> list[dict]:
    """Advance the lineage on work pools: collect, score and curate here; train, co-design and evaluate in
    a run of ``gpu_deployment`` (None: here, each under a slot of ``gpu_limit``); then decide here."""
    from dataclasses import asdict

    from prefect.deployments import run_deployment
    from prefect.runtime import flow_run

    # One lease owner for this flow run and the GPU run it starts. Its extra part (the flow run) makes
    # `lease.owner_gone` judge it by expiry only: this process ending early must not free the candidate
    # while the GPU run, renewing the same owner, still works on it.
    owner = f"{owner_id()}/flow-run:{flow_run.id}"
    outcomes = []
    for _ in range(generations):
        with _candidate(config, owner, release=True) as generation_id:
            _run_steps(STEPS[: STEPS.index(GPU_STEPS[0])], generation_id=generation_id, config=config)
            if gpu_deployment is None:
                _run_steps(GPU_STEPS, generation_id=generation_id, config=config, gpu_limit=gpu_limit)
            else:
                parameters = {"config": asdict(config), "generation_id": generation_id, "owner": owner}
                run = run_deployment(
                    gpu_deployment,
                    parameters={**parameters, "gpu_limit": gpu_limit},
                    poll_interval=HANDOFF_POLL_S,
                )
                if run.state is None or not run.state.is_completed():
                    raise RatchetError(
                        f"the GPU steps of lineage {config.lineage!r}'s candidate (flow run {run.name} of "
                        f"{gpu_deployment}) ended {run.state.name if run.state else 'without a state'}: see "
                        "its logs; the next run continues the candidate from its first step not done"
                    )
            outcomes.append(_run_steps(("decide",), generation_id=generation_id, config=config))
        publish_decision(config.lineage, outcomes[-1]["generation"])
    return outcomes


def decision_report(lineage: str, number: int) -> tuple[list[dict], str]:
    """A decided generation's held-out comparison as table rows, and its decision with the gates as markdown.

    Each row's interval is a two-sided t interval at ``1 - 2 alpha`` (per specialist alpha is the contract's
    ``regression_error_rate``, overall the rate the improvement test used), a description of the delta; the
    gates are the verdict's own tests (``evaluation.verdict.tests``: the sign-flip improvement test and
    the betting non-inferiority tests, each at the rate its attempt on its suite may spend), then the KL
    budget, the item count and routing."""

    with session_scope(get_engine()) as session:
        gen = get_generation(session=session, number=number, lineage=lineage)
        evaluation, status, decision = evaluation_of(gen), gen.status, gen.decision or ""
        contract = contract_of(gen)
    gates, comparison, verdict = contract.promotion, evaluation.comparison, evaluation.verdict

    def row(name, parent, candidate, delta, se, df, alpha, n) -> dict:
        half = t_quantile(1 - alpha, df) * se
        interval = f"{100 * (1 - 2 * alpha):.4g}% [{delta - half:+.4f}, {delta + half:+.4f}]"
        return {"specialist": name, "parent": round(parent, 4), "candidate": round(candidate, 4),
                "delta": round(delta, 4), "interval": interval, "n": n}  # fmt: skip

    def gate(name: str, setting: str, measured: str, passed: bool) -> str:
        return f"| {name} | {setting} | {measured} | {'pass' if passed else '**fail**'} |"

    alpha = gates.regression_error_rate
    specialists = sorted(comparison.specialists.items()) if comparison is not None else []
    rows = [row(s, c.champion, c.candidate, c.delta, c.se, max(1, c.n - 1), alpha, c.n)
            for s, c in specialists]  # fmt: skip
    lines = [f"# {lineage} generation {number}: {status}", "", f"**Decision:** {decision}", ""]
    lines += [f"- {reason}" for reason in (verdict.reasons if verdict else [])]
    lines += ["", "## Gates", "", "| gate | setting | measured | result |", "|---|---|---|---|"]
    if rows and verdict:
        df = float("inf") if comparison.df is None else comparison.df
        total = sum(c.n for _, c in specialists)
        rows.append(row("overall", comparison.champion_overall, comparison.candidate_overall,
                        comparison.delta, comparison.se, df, verdict.rate, total))  # fmt: skip
    # the gate's own tests (sign-flip permutation tests, each at the rate its attempt on the suite may spend);
    # the rows' t intervals above describe the deltas, they decide nothing
    for test in verdict.tests if verdict else []:
        how = f"Monte Carlo +-{test.mc_error:.2g}" if test.method == "monte carlo" else test.method
        margin = f", margin {test.margin:+g}" if test.margin else ""
        setting = f"p <= {test.rate:.4g} (attempt {test.attempt} on its suite{margin})"
        measured = f"p = {test.p:.4g} ({how}, {test.units} units)"
        lines.append(gate(test.test, setting, measured, bool(test.passed)))
    if gates.max_kl_to_base is not None:
        for s, _ in specialists:
            kl = evaluation.divergence[s].kl_to_base if s in evaluation.divergence else None
            measured = "not measured" if kl is None else f"{kl:.4f} nats/token"
            lines.append(gate(f"KL to base: {s}", f"<= {gates.max_kl_to_base:g}", measured,
                              kl is not None and kl <= gates.max_kl_to_base))  # fmt: skip
    fewest = min((c.n for _, c in specialists), default=0)
    lines.append(gate("held-out items", f">= {gates.min_heldout_samples} per specialist", f"fewest {fewest}",
                      fewest >= gates.min_heldout_samples))  # fmt: skip
    after = evaluation.router.accuracy if evaluation.router else None
    before = evaluation.parent_router.accuracy if evaluation.parent_router else None
    if contract.routing is not None and after is not None and before is not None:
        lines.append(gate("routing", f"accuracy drop <= {contract.routing.max_accuracy_drop:g}",
                          f"{before:.3f} -> {after:.3f}", before - after <= contract.routing.max_accuracy_drop))  # fmt: skip
    return rows, "\n".join(lines) + "\n"


def artifact_key(lineage: str, number: int, what: str) -> str:
    """An artifact key (lowercase letters, digits, dashes) naming the lineage, the generation and what."""
    import re

    return f"{re.sub(r'[^a-z0-9]+', '-', lineage.lower()).strip('-')}-gen-{number}-{what}"


def publish_decision(lineage: str, number: int) -> None:
    """The generation's held-out table and decision as artifacts of this flow run (Prefect UI: Artifacts)."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    rows, markdown = decision_report(lineage, number)
    if rows:
        create_table_artifact(
            rows,
            key=artifact_key(lineage, number, "heldout"),
            description=f"{lineage} generation {number}: held-out scores, parent vs candidate (paired)",
        )
    create_markdown_artifact(
        markdown,
        key=artifact_key(lineage, number, "decision"),
        description=f"{lineage} generation {number}: the decision and its gates",
    )
