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

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from pipeline.registry import Generation
    from pipeline.specs.contract import ContractSpec

STEPS = ("discover", "collect", "score", "curate", "train", "codesign", "evaluate", "decide")
Progress = Callable[[str, int, int], None]
"""``progress(phase, done, total)``: what a step reports while it works (``total`` 0 when unknown)."""


@dataclass(frozen=True)
class AdvanceConfig:
    """Knobs of one advancement cycle (the signature is the config; the CLI exposes the main ones)."""

    lineage: str = "main"
    # Prompts sampled from the environment's training stream. Measured on the demo (honest split, 300
    # held-out items): 1,500 gave +0.01..+0.03 per generation, inside the gate's noise; 3,000 gave
    # +0.037, +0.039, +0.054, each significant (as in the notes: more verified attempts per generation).
    # With discovery (2026-12-03, five generations, seed 0): 2,000 x 4 stalled after two promotions at
    # 0.505; 3,000 x 4 and 3,000 x 3 both compounded over four promotions (0.604 and 0.598).
    prompts_per_specialist: int = 3000
    # False: no practice at all; the generation learns only from what was served and ingested.
    collect: bool = True
    # k attempts per prompt, all recorded as experience: 3 instead of 4 cost 0.006 held-out after four
    # generations and saves a quarter of collection (the demo's five generations fit in ten minutes)
    samples_per_prompt: int = 3
    # Discovery (``pipeline.loop.discovery``): variants of training prompts tried per specialist before collecting,
    # each sampled this many times; those the champion solves in more than none and fewer than half of the
    # samples are practised in place of as many regular prompts.
    discover: bool = True
    discovery_candidates: int = 128
    discovery_samples: int = 8
    temperature: float = 0.7  # sampling temperature of collection (evaluation is greedy)
    min_examples: int = 16  # a specialist with fewer curated examples keeps its parent's adapter
    validation_items: int = 48  # per specialist, for choosing among harness variants
    codesign: bool = True
    seed: int = 0
    # Renewed every quarter of it while a step runs: a run that stopped (elsewhere than on this host, where
    # a dead process is seen at once) is taken over this long after its last renewal.
    lease_seconds: int = 60


def step_seed(config: AdvanceConfig, number: int, salt: str) -> int:
    """A seed for one use (``salt``) in one generation of one lineage: reproducible, and independent of
    every other use."""
    return zlib.crc32(f"{config.lineage}:{number}:{config.seed}:{salt}".encode())


def load_generation(session: Session, generation_id: int) -> Generation:
    """The generation with its adapters loaded."""
    from sqlalchemy import select
    from sqlalchemy.orm import selectinload

    from pipeline.errors import NotFoundError
    from pipeline.registry import Generation, GenerationAdapter

    gen = session.scalar(
        select(Generation)
        .where(Generation.id == generation_id)
        .options(selectinload(Generation.adapters).selectinload(GenerationAdapter.adapter))
    )
    if gen is None:
        raise NotFoundError(f"generation id {generation_id} does not exist in the registry")
    return gen


def mark_step(session: Session, gen: Generation, step: str, outcome: dict[str, Any]) -> None:
    """Record that ``step`` is done for ``gen``, with what it did."""
    state = dict(gen.state or {})
    steps = dict(state.get("steps", {}))
    steps[step] = outcome
    state["steps"] = steps
    gen.state = state
    gen.step = step
    session.flush()


def record_seconds(generation_id: int, step: int | str, seconds: float) -> None:
    """Keep how long a step took in the candidate's ``state["seconds"]`` (what ``ratchet lineage --json``
    shows: where a generation's time went)."""
    from pipeline.registry import get_engine, session_scope

    with session_scope(get_engine()) as session:
        gen = load_generation(session, generation_id)
        state = dict(gen.state or {})
        state["seconds"] = {**state.get("seconds", {}), str(step): round(seconds, 1)}
        gen.state = state


def done_steps(generation_id: int) -> dict[str, Any]:
    """The outcomes of the steps already done for the candidate."""
    from pipeline.registry import get_engine, session_scope

    with session_scope(get_engine()) as session:
        return dict((load_generation(session, generation_id).state or {}).get("steps", {}))


def contract_of(gen: Generation) -> ContractSpec:
    """The contract version the generation is judged under."""
    from pipeline.specs.contract import stored_contract

    return stored_contract(gen.contract_version.spec)


def artifacts_for(lineage: str, number: int) -> Path:
    """Where a generation's datasets and adapters are written."""
    from pipeline.settings import get_settings

    return (get_settings().artifacts_dir / lineage / f"gen-{number:04d}").resolve()
