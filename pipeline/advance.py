"""Advancing a lineage by one generation: collect, score, curate, train, co-design, evaluate, decide.

Each step is a plain function of the candidate's id; it records what it did in the candidate's
``state`` so that ``advance`` run again after a crash continues the same candidate from the first
step not yet done. A lease on the candidate keeps a second ``advance`` from building it at the same
time: that run exits with a clear message instead.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from pipeline.errors import ConflictError, RatchetError

log = logging.getLogger(__name__)

STEPS = ("collect", "score", "curate", "train", "codesign", "evaluate", "decide")
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class AdvanceConfig:
    """Knobs of one advancement cycle (the signature is the config; the CLI exposes the main ones)."""

    lineage: str = "main"
    prompts_per_specialist: int = 1500  # prompts sampled from the environment's training stream
    samples_per_prompt: int = 4  # k attempts per prompt, all recorded as experience
    temperature: float = 0.7  # sampling temperature of collection (evaluation is greedy)
    min_examples: int = 16  # a specialist with fewer curated examples keeps its parent's adapter
    validation_items: int = 48  # per specialist, for choosing among harness variants
    codesign: bool = True
    seed: int = 0
    lease_seconds: int = 1800


def owner_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def step_seed(config: AdvanceConfig, number: int, salt: str) -> int:
    return zlib.crc32(f"{config.lineage}:{number}:{config.seed}:{salt}".encode())


def begin_candidate(*, config: AdvanceConfig, owner: str) -> int:
    """Resume the lineage's in-flight candidate or create the next one from the champion; take its lease."""
    from sqlalchemy import or_, update

    from pipeline.registry import (
        Generation,
        create_generation,
        get_champion,
        get_engine,
        get_in_flight,
        session_scope,
    )
    from pipeline.registry.models import utcnow

    with session_scope(get_engine()) as session:
        gen = get_in_flight(session=session, lineage=config.lineage)
        if gen is None:
            champion = get_champion(session=session, lineage=config.lineage)
            if champion is None:
                raise RatchetError(f"lineage {config.lineage!r} has no champion: run `ratchet init` first")
            gen = create_generation(
                session=session,
                lineage=config.lineage,
                base_model_id=champion.base_model_id,
                harness_version_id=champion.harness_version_id,
                contract_version_id=champion.contract_version_id,
                specialists=[a.specialist for a in champion.adapters],
                adapters={a.specialist: a.adapter_id for a in champion.adapters},
                parent_id=champion.id,
                state={"steps": {}, "config": config.__dict__},
            )
        now = utcnow()
        taken = session.execute(
            update(Generation)
            .where(Generation.id == gen.id)
            .where(
                or_(
                    Generation.lease_owner.is_(None),
                    Generation.lease_owner == owner,
                    Generation.lease_expires_at < now,
                )
            )
            .values(lease_owner=owner, lease_expires_at=now + timedelta(seconds=config.lease_seconds))
            .execution_options(synchronize_session=False)
        ).rowcount
        if not taken:
            session.refresh(gen)
            raise ConflictError(
                f"generation {gen.number} of lineage {config.lineage!r} is being advanced by {gen.lease_owner} "
                f"(lease until {gen.lease_expires_at:%H:%M:%S} UTC): wait for it, or retry after the lease expires"
            )
        return gen.id


def release_candidate(*, generation_id: int, owner: str) -> None:
    from sqlalchemy import update

    from pipeline.registry import Generation, get_engine, session_scope

    with session_scope(get_engine()) as session:
        session.execute(
            update(Generation)
            .where(Generation.id == generation_id, Generation.lease_owner == owner)
            .values(lease_owner=None, lease_expires_at=None)
            .execution_options(synchronize_session=False)
        )


def load_generation(session: Any, generation_id: int) -> Any:
    from sqlalchemy import select
    from sqlalchemy.orm import selectinload

    from pipeline.registry import Generation, GenerationAdapter

    return session.scalar(
        select(Generation)
        .where(Generation.id == generation_id)
        .options(selectinload(Generation.adapters).selectinload(GenerationAdapter.adapter))
    )


def mark_step(session: Any, gen: Any, step: str, outcome: dict[str, Any]) -> None:
    state = dict(gen.state or {})
    steps = dict(state.get("steps", {}))
    steps[step] = outcome
    state["steps"] = steps
    gen.state = state
    gen.step = step
    session.flush()


def done_steps(generation_id: int) -> dict[str, Any]:
    from pipeline.registry import get_engine, session_scope

    with session_scope(get_engine()) as session:
        return dict((load_generation(session, generation_id).state or {}).get("steps", {}))


def contract_of(gen: Any) -> Any:
    from pipeline.contract import ContractSpec

    return ContractSpec.model_validate(gen.contract_version.spec)


def collect_step(
    *, generation_id: int, config: AdvanceConfig, progress: Progress | None = None
) -> dict[str, Any]:
    """Run the champion (the parent pair) in the task environment; record every attempt as experience."""
    from pipeline.environment import sample_prompts
    from pipeline.experience import trace_row, validate_trace
    from pipeline.pair import answer_items, pair_for_generation
    from pipeline.registry import get_engine, insert_traces, session_scope

    engine = get_engine()
    with session_scope(engine) as session:
        gen = load_generation(session, generation_id)
        parent = load_generation(session, gen.parent_id)
        pair = pair_for_generation(parent)
        number, parent_id, harness_id = gen.number, parent.id, parent.harness_version_id
    items = {
        s: sample_prompts(s, config.prompts_per_specialist, step_seed(config, number, f"collect:{s}"))
        for s in pair.adapters
    }
    answered = answer_items(
        pair,
        items,
        num_samples=config.samples_per_prompt,
        temperature=config.temperature,
        seed=step_seed(config, number, "sample"),
        progress=(lambda d, t: progress("collect", d, t)) if progress else None,
    )
    rows = []
    for traces in answered.values():
        for attempts in traces:
            for trace in attempts:
                trace["metadata"]["collected_for"] = number
                rows.append(
                    trace_row(
                        validate_trace(trace),
                        source="simulation",
                        generation_id=parent_id,
                        harness_version_id=harness_id,
                    )
                )
    stored = 0
    with session_scope(engine) as session:
        for start in range(0, len(rows), 2000):
            stored += insert_traces(session=session, rows=rows[start : start + 2000])
        outcome = {"attempts": len(rows), "stored": stored, "prompts": sum(len(v) for v in items.values())}
        mark_step(session, load_generation(session, generation_id), "collect", outcome)
    return outcome


def score_step(
    *, generation_id: int, config: AdvanceConfig, progress: Progress | None = None
) -> dict[str, Any]:
    """Score all experience not yet scored under the candidate's contract version."""
    from pipeline.registry import get_engine, session_scope
    from pipeline.scoring import score_experience

    engine = get_engine()
    with session_scope(engine) as session:
        contract_version_id = load_generation(session, generation_id).contract_version_id
    done = 0

    def report(n: int) -> None:
        nonlocal done
        done += n
        if progress:
            progress("score", done, 0)

    with session_scope(engine) as session:
        result = score_experience(session=session, contract_version_id=contract_version_id, progress=report)
    outcome = {"scored": result.scored, "errors": result.errors, "by_specialist": result.by_specialist}
    with session_scope(engine) as session:
        mark_step(session, load_generation(session, generation_id), "score", outcome)
    return outcome


def lineage_candidates(session: Any, gen: Any, contract: Any) -> list[Any]:
    """The lineage's scored experience at or above the contract's selection threshold (or with feedback)."""
    from pipeline.curation import load_candidates

    return load_candidates(
        session=session,
        contract_version_id=gen.contract_version_id,
        lineage=gen.lineage,
        min_score=contract.selection.min_score,
    )


def artifacts_for(lineage: str, number: int) -> Path:
    from pipeline.settings import get_settings

    return (get_settings().artifacts_dir / lineage / f"gen-{number:04d}").resolve()


def curate_step(
    *, generation_id: int, config: AdvanceConfig, progress: Progress | None = None
) -> dict[str, Any]:
    """One SFT dataset per specialist from all scored experience of the lineage (accumulated), held-out excluded."""
    from sqlalchemy import delete

    from pipeline.curation import prompt_key, save_dataset, select_examples
    from pipeline.heldout import resolve_suites
    from pipeline.pair import render_conversation
    from pipeline.registry import TrainingDataset, get_engine, session_scope

    engine = get_engine()
    with session_scope(engine) as session:
        gen = load_generation(session, generation_id)
        contract = contract_of(gen)
        from pipeline.harness import HarnessSpec

        harness = HarnessSpec.model_validate(gen.harness_version.spec)
        heldout = {
            prompt_key(item["messages"]) for items in resolve_suites(contract).values() for item in items
        }
        candidates = lineage_candidates(session, gen, contract)
        specialists = [a.specialist for a in gen.adapters]
        number = gen.number
    selected = select_examples(
        candidates, contract=contract, heldout_prompts=heldout, specialists=specialists
    )
    out_dir = artifacts_for(config.lineage, number) / "datasets"
    datasets: dict[str, Any] = {}
    with session_scope(engine) as session:
        session.execute(delete(TrainingDataset).where(TrainingDataset.generation_id == generation_id))
        for specialist in specialists:
            examples = selected.examples.get(specialist, [])
            if len(examples) < config.min_examples:
                datasets[specialist] = {"rows": len(examples), "skipped": f"fewer than {config.min_examples}"}
                continue
            for ex in examples:  # train on what the model sees under the harness
                *context, answer = ex["messages"]
                ex["messages"] = [*render_conversation(harness, specialist, context), answer]
            digest, rows = save_dataset(examples, out_dir / specialist)
            session.add(
                TrainingDataset(
                    generation_id=generation_id,
                    specialist=specialist,
                    path=str(out_dir / specialist),
                    sha256=digest,
                    num_rows=rows,
                )
            )
            datasets[specialist] = {"rows": rows, "sha256": digest, "path": str(out_dir / specialist)}
        outcome = {"datasets": datasets, "dropped": selected.dropped}
        mark_step(session, load_generation(session, generation_id), "curate", outcome)
    return outcome


def step_functions() -> dict[str, Callable[..., dict[str, Any]]]:
    """Each step's function, in order."""
    from pipeline.promotion import decide_step, evaluate_step
    from pipeline.successor import codesign_step, train_step

    return {
        "collect": collect_step,
        "score": score_step,
        "curate": curate_step,
        "train": train_step,
        "codesign": codesign_step,
        "evaluate": evaluate_step,
        "decide": decide_step,
    }


TRACKED = {"train", "decide"}


def advance_once(
    *,
    config: AdvanceConfig,
    tracker: Any = None,
    progress: Progress | None = None,
    run_step: Callable[..., Any] | None = None,
) -> dict[str, Any]:
    """Build (or resume) one candidate and decide on it. ``run_step(name, fn, **kwargs)`` lets the Prefect
    flow run each step as a task; by default steps are called directly."""
    owner = owner_id()
    generation_id = begin_candidate(config=config, owner=owner)
    manage_gc = gc.get_freeze_count() == 0  # a caller that froze objects itself manages collection
    try:
        done = done_steps(generation_id)
        outcome: dict[str, Any] = {}
        for step in STEPS:
            if step in done:
                continue
            kwargs: dict[str, Any] = {"generation_id": generation_id, "config": config, "progress": progress}
            if step in TRACKED:
                kwargs["tracker"] = tracker
            fn = step_functions()[step]
            # What is alive between steps (imported libraries, loaded models: about a million objects) is
            # long-lived; frozen, the cyclic GC stops re-scanning it in every full collection, which cost
            # ~0.3 s each and ~4 s per demo generation. Reference counting still frees garbage at once;
            # only garbage in reference cycles waits for the unfreeze (measured: a training job leaves
            # none that holds tensors). Collecting before each freeze cost ~0.8 s per generation.
            if manage_gc:
                gc.freeze()
            outcome = run_step(step, fn, **kwargs) if run_step else fn(**kwargs)
        return outcome
    finally:
        if manage_gc:  # back to normal collection once the generation is over
            gc.unfreeze()
        release_candidate(generation_id=generation_id, owner=owner)
