"""The candidate generation every advancement step works on: its config, its registry record, its artifacts.

Each step (``discovery``, ``collection``, ``scoring``, ``curation``, ``training``, ``codesign``,
``evaluation``, ``promotion``) is a plain function of the candidate's id and an ``AdvanceConfig``; it loads the candidate
with ``load_generation``, does its work and records its outcome with ``mark_step``, so that
``pipeline.loop.advance`` can resume a crashed candidate from the first step not yet done.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.errors import NotFoundError
from pipeline.knobs import described
from pipeline.registry import Generation, GenerationAdapter, get_engine, session_scope
from pipeline.registry.documents import Document, Steps, state_of
from pipeline.settings import get_settings
from pipeline.specs.contract import stored_contract

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from pipeline.specs.contract import ContractSpec

STEPS = ("discover", "collect", "score", "curate", "train", "codesign", "evaluate", "decide")
Progress = Callable[[str, int, int], None]
"""``progress(phase, done, total)``: what a step reports while it works (``total`` 0 when unknown)."""


@dataclass(frozen=True)
class AdvanceConfig:
    """Knobs of one advancement cycle. Each field's description and default are the help and default of
    its option of ``ratchet advance`` and ``ratchet demo`` (``pipeline.cli.options``)."""

    lineage: str = described("main", "Lineage name.")
    # Measured on the demo (honest split, 300 held-out items): 1,500 gave +0.01..+0.03 per generation,
    # inside the gate's noise; 3,000 gave +0.037, +0.039, +0.054, each significant (as in the notes: more
    # verified attempts per generation). With discovery (2026-12-03, five generations, seed 0): 2,000 x 4
    # stalled after two promotions at 0.505; 3,000 x 4 and 3,000 x 3 both compounded over four promotions
    # (0.604 and 0.598).
    prompts_per_specialist: int = described(
        3000, "Practice prompts per specialist per cycle, from its contract task source.", ge=1
    )
    collect: bool = described(
        True,
        "Practise on the task source; --no-collect learns from served and ingested experience only.",
    )
    # 3 instead of 4 cost 0.006 held-out after four generations and saves a quarter of collection (the
    # demo's five generations fit in ten minutes)
    samples_per_prompt: int = described(3, "Sampled attempts per prompt, all recorded as experience.", ge=1)
    discover: bool = described(
        True,
        "Before collecting, try variants of training prompts (pipeline.loop.discovery); those the champion "
        "solves in more than none and fewer than half of its samples are practised in place of as many "
        "regular prompts.",
    )
    discovery_candidates: int = described(
        128, "Variants of training prompts discovery tries per specialist.", ge=1
    )
    discovery_samples: int = described(8, "Samples of each variant discovery tries.", ge=1)
    temperature: float = described(0.7, "Sampling temperature of collection (evaluation is greedy).")
    min_examples: int = described(
        16, "A specialist with fewer curated examples keeps its parent's adapter.", ge=0
    )
    validation_items: int = described(
        48, "Items per specialist for choosing among harness variants (co-design).", ge=1
    )
    codesign: bool = described(True, "Try harness variants with the new adapters.")
    seed: int = described(0, "Seed of sampling, data order and initialisation.")
    lease_seconds: int = described(
        60,
        "The candidate's lease, renewed every quarter of it while a step runs: a run that stopped "
        "(elsewhere than on this host, where a dead process is seen at once) is taken over this long after "
        "its last renewal.",
        ge=1,
    )


def step_seed(config: AdvanceConfig, number: int, salt: str) -> int:
    """A seed for one use (``salt``) in one generation of one lineage: reproducible, and independent of
    every other use."""
    return zlib.crc32(f"{config.lineage}:{number}:{config.seed}:{salt}".encode())


def load_generation(session: Session, generation_id: int) -> Generation:
    """The generation with its adapters loaded."""
    from sqlalchemy import select
    from sqlalchemy.orm import selectinload

    gen = session.scalar(
        select(Generation)
        .where(Generation.id == generation_id)
        .options(selectinload(Generation.adapters).selectinload(GenerationAdapter.adapter))
    )
    if gen is None:
        raise NotFoundError(f"generation id {generation_id} does not exist in the registry")
    return gen


def mark_step(session: Session, gen: Generation, step: str, outcome: dict[str, Any] | Document) -> None:
    """Record that ``step`` is done for ``gen``, with what it did (validated as that step's outcome model,
    ``pipeline.registry.documents.Steps``: a key the model does not know is refused)."""
    state = state_of(gen)
    done = outcome.as_stored() if isinstance(outcome, Document) else outcome
    state.steps = Steps.read({**state.steps.as_stored(), step: done})
    gen.state = state.as_stored()
    gen.step = step
    session.flush()


def record_seconds(generation_id: int, step: int | str, seconds: float) -> None:
    """Keep how long a step took in the candidate's ``state.seconds`` (what ``ratchet lineage --json``
    shows: where a generation's time went)."""

    with session_scope(get_engine()) as session:
        gen = load_generation(session, generation_id)
        state = state_of(gen)
        state.seconds = {**state.seconds, str(step): round(seconds, 1)}
        gen.state = state.as_stored()


def done_steps(generation_id: int) -> dict[str, Any]:
    """The outcomes of the steps already done for the candidate, as stored (step -> outcome)."""

    with session_scope(get_engine()) as session:
        return state_of(load_generation(session, generation_id)).steps.as_stored()


def contract_of(gen: Generation) -> ContractSpec:
    """The contract version the generation is judged under."""

    return stored_contract(gen.contract_version.spec)


def artifacts_for(lineage: str, number: int) -> Path:
    """Where a generation's datasets and adapters are written."""

    return (get_settings().artifacts_dir / lineage / f"gen-{number:04d}").resolve()
