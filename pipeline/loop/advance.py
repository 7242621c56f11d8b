"""Advancing a lineage by one generation: discover, collect, score, curate, train, co-design, evaluate, decide.

This module only orchestrates. Each step is a plain function in the module named by its noun
(``discovery``, ``collection``, ``scoring``, ``curation``, ``training``, ``codesign``, ``evaluation``,
``promotion``)
that records what it did in the candidate's ``state`` (``pipeline.loop.candidate``), so that ``advance`` run
again after a crash continues the same candidate from the first step not yet done. A lease on the
candidate (``pipeline.loop.lease``: renewed while a step runs, proven on every write) keeps a second ``advance``
from building it at the same time: that run exits with a clear message instead, unless the lease's owner is
gone (its process dead on this host, or no renewal), in which case it is marked crashed and taken over.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from pipeline.errors import ConflictError, RatchetError
from pipeline.gates.suites import require_gated
from pipeline.loop.candidate import STEPS, AdvanceConfig, Progress, done_steps, record_seconds
from pipeline.loop.collection import collect_step
from pipeline.loop.curation import curate_step
from pipeline.loop.discovery import discover_step
from pipeline.loop.evaluation import evaluate_step
from pipeline.loop.lease import Lease, owner_gone, owner_id
from pipeline.loop.promotion import decide_step, sync_champion_aliases
from pipeline.registry import (
    Generation,
    audit,
    create_generation,
    get_champion,
    get_engine,
    get_in_flight,
    session_scope,
)
from pipeline.registry.documents import Crash, GenerationState, Steps, state_of
from pipeline.registry.models import utcnow
from pipeline.scoring import score_step
from pipeline.training import train_step

if TYPE_CHECKING:
    from pipeline.registry.tracking import Tracker

log = logging.getLogger(__name__)

__all__ = [
    "STEPS",
    "AdvanceConfig",
    "advance_once",
    "begin_candidate",
    "owner_id",
    "release_candidate",
    "run_steps",
    "step_functions",
]


def begin_candidate(*, config: AdvanceConfig, owner: str) -> int:
    """Resume the lineage's in-flight candidate or create the next one from the champion; take its lease.

    A lease whose owner is gone (``lease.owner_gone``) is taken over at once, and the crash is recorded."""
    from sqlalchemy import or_, update

    with session_scope(get_engine()) as session:
        gen = get_in_flight(session=session, lineage=config.lineage)
        if gen is None:
            champion = get_champion(session=session, lineage=config.lineage)
            if champion is None:
                raise RatchetError(f"lineage {config.lineage!r} has no champion: run `ratchet init` first")
            require_gated(champion, lineage=config.lineage)  # no specialist trained with no gate, unsaid
            gen = create_generation(
                session=session,
                lineage=config.lineage,
                base_model_id=champion.base_model_id,
                harness_version_id=champion.harness_version_id,
                contract_version_id=champion.contract_version_id,
                specialists=[a.specialist for a in champion.adapters],
                adapters={a.specialist: a.adapter_id for a in champion.adapters},
                parent_id=champion.id,
                state=GenerationState(steps=Steps(), config=config.__dict__),
            )
        now = utcnow()
        previous = gen.lease_owner
        gone = owner_gone(previous, gen.lease_expires_at, now) if previous and previous != owner else None
        allowed = [Generation.lease_owner.is_(None), Generation.lease_owner == owner]
        if gone:  # compare-and-swap on the dead owner's name: two runs taking over cannot both win
            allowed.append(Generation.lease_owner == previous)
        taken = session.execute(
            update(Generation)
            .where(Generation.id == gen.id)
            .where(or_(*allowed))
            .values(lease_owner=owner, lease_expires_at=now + timedelta(seconds=config.lease_seconds))
            .execution_options(synchronize_session=False)
        ).rowcount
        if taken and gone:
            session.refresh(gen)
            state = state_of(gen)
            state.crashes = [*state.crashes, Crash(owner=previous, step=gen.step, why=gone, at=str(now))]
            gen.state = state.as_stored()
            audit(
                session=session,
                actor=owner,
                entity="generations",
                entity_id=gen.id,
                action="crashed",
                details={"number": gen.number, "owner": previous, "after_step": gen.step},
                message=f"the run {previous} crashed ({gone}); taken over by {owner}",
            )
            log.warning("generation %d: the run %s crashed (%s); continuing it", gen.number, previous, gone)
        if not taken:
            session.refresh(gen)
            raise ConflictError(
                f"generation {gen.number} of lineage {config.lineage!r} is being advanced by {gen.lease_owner} "
                f"(lease until {gen.lease_expires_at:%H:%M:%S} UTC): wait for it, or retry after the lease expires"
            )
        return gen.id


def release_candidate(*, generation_id: int, owner: str) -> None:
    from sqlalchemy import update

    with session_scope(get_engine()) as session:
        session.execute(
            update(Generation)
            .where(Generation.id == generation_id, Generation.lease_owner == owner)
            .values(lease_owner=None, lease_expires_at=None)
            .execution_options(synchronize_session=False)
        )


def step_functions() -> dict[str, Callable[..., dict[str, Any]]]:
    """Each step's function, in order."""
    from pipeline.codesign import codesign_step  # lazy: looked up per call: tests replace codesign_step

    return {
        "discover": discover_step,
        "collect": collect_step,
        "score": score_step,
        "curate": curate_step,
        "train": train_step,
        "codesign": codesign_step,
        "evaluate": evaluate_step,
        "decide": decide_step,
    }


TRACKED = {"train", "decide"}


def run_steps(
    steps: tuple[str, ...] | list[str],
    *,
    generation_id: int,
    config: AdvanceConfig,
    tracker: Tracker | None = None,
    progress: Progress | None = None,
    run_step: Callable[..., Any] | None = None,
    run_job: Callable[..., Any] | None = None,
    freeze: bool = False,
) -> dict[str, Any]:
    """Run those of ``steps`` the candidate has not done yet, in order; the last step's outcome (a step done
    before reports the outcome it recorded). ``run_step(name, fn, **kwargs)`` runs a step another way (a
    Prefect task), ``run_job(name, fn, **kwargs)`` each training job (a Prefect task per method);
    ``freeze``: ``gc.freeze()`` before each step (the caller unfreezes)."""
    done = done_steps(generation_id)
    outcome: dict[str, Any] = {}
    for step in steps:
        if step in done:
            outcome = done[step]
            continue
        kwargs: dict[str, Any] = {"generation_id": generation_id, "config": config, "progress": progress}
        if step in TRACKED:
            kwargs["tracker"] = tracker
        if step == "train" and run_job is not None:
            kwargs["run_job"] = run_job
        fn = step_functions()[step]
        # What is alive between steps (imported libraries, loaded models: about a million objects) is
        # long-lived; frozen, the cyclic GC stops re-scanning it in every full collection, which cost
        # ~0.3 s each and ~4 s per demo generation. Reference counting still frees garbage at once;
        # only garbage in reference cycles waits for the unfreeze (measured: a training job leaves
        # none that holds tensors). Collecting before each freeze cost ~0.8 s per generation.
        if freeze:
            gc.freeze()
        started = time.perf_counter()
        outcome = run_step(step, fn, **kwargs) if run_step else fn(**kwargs)
        record_seconds(generation_id, step, time.perf_counter() - started)
    return outcome


def advance_once(
    *,
    config: AdvanceConfig,
    tracker: Tracker | None = None,
    progress: Progress | None = None,
    run_step: Callable[..., Any] | None = None,
    run_job: Callable[..., Any] | None = None,
) -> dict[str, Any]:
    """Build (or resume) one candidate and decide on it. ``run_step(name, fn, **kwargs)`` lets the Prefect
    flow run each step as a task (and ``run_job`` each training job); by default they are called directly."""

    owner = owner_id()
    generation_id = begin_candidate(config=config, owner=owner)
    lease = Lease(generation_id, owner, config.lease_seconds, get_engine()).start()
    manage_gc = gc.get_freeze_count() == 0  # a caller that froze objects itself manages collection
    try:
        if tracker is not None:  # a promotion whose aliases MLflow missed (it was down) is repaired first
            try:
                sync_champion_aliases(lineage=config.lineage, tracker=tracker)
            except RatchetError as exc:
                if exc.__cause__ is not None:  # MLflow unreachable: training could not be tracked either
                    raise exc.__cause__ from None
                log.warning("%s", exc)
        return run_steps(
            STEPS,
            generation_id=generation_id,
            config=config,
            tracker=tracker,
            progress=progress,
            run_step=run_step,
            run_job=run_job,
            freeze=manage_gc,
        )
    except Exception as exc:
        if not isinstance(exc, ConflictError):  # (another run has it: nothing for the operator to do)
            log.warning(
                "the candidate of lineage %r stopped: the next `ratchet advance` continues it from the step "
                "that failed; if that step cannot succeed, `ratchet abandon --lineage %s --reason TEXT` gives "
                "it up and the next advance starts a new candidate",
                config.lineage,
                config.lineage,
            )
        raise
    finally:
        lease.stop()
        if manage_gc:  # back to normal collection once the generation is over
            gc.unfreeze()
        release_candidate(generation_id=generation_id, owner=owner)
