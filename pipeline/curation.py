"""Curation: turn scored experience into one SFT dataset per specialist under the contract's selection rules.

Held-out items never reach a training set: a trace is excluded when its metadata marks it held-out,
when it came from an evaluation run, or when its prompt is one of the held-out suites' prompts.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.contract import ContractSpec

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from pipeline.candidate import AdvanceConfig, Progress
    from pipeline.registry import Generation

log = logging.getLogger(__name__)


@dataclass
class Candidate:
    """One trace considered for training, with its total score under the contract."""

    experience_id: int
    specialist: str
    score: float | None
    messages: list[dict[str, Any]]
    metadata: dict[str, Any]
    feedback: Any
    source: str


@dataclass
class CurationResult:
    """What curation kept per specialist, and why the rest was left out."""

    examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


def prompt_key(messages: list[dict[str, Any]]) -> str:
    """Hash of the conversation before its last assistant turn (what the model was asked)."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=len(messages))
    context = [
        {"role": m.get("role"), "content": m.get("content")}
        for m in messages[:last]
        if m.get("role") != "system"
    ]
    return hashlib.sha256(json.dumps(context, sort_keys=True).encode()).hexdigest()


def _content_key(messages: list[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()


def is_heldout(candidate: Candidate, heldout_prompts: set[str]) -> bool:
    """Whether a trace belongs to evaluation and must never be trained on."""
    return (
        candidate.metadata.get("split") == "heldout"
        or candidate.source == "evaluation"
        or prompt_key(candidate.messages) in heldout_prompts
    )


def _corrected(candidate: Candidate) -> list[dict[str, Any]] | None:
    fb = candidate.feedback
    if not isinstance(fb, dict) or not isinstance(fb.get("correction"), str) or not fb["correction"].strip():
        return None
    messages = [dict(m) for m in candidate.messages]
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    if last is None:
        return None
    messages[last] = {"role": "assistant", "content": fb["correction"]}
    return messages[: last + 1]


def select_examples(
    candidates: Iterable[Candidate],
    *,
    contract: ContractSpec,
    heldout_prompts: set[str],
    specialists: Iterable[str] | None = None,
) -> CurationResult:
    """Apply the contract's selection rules: held-out exclusion, corrections, threshold, dedup, caps."""
    rules = contract.selection
    wanted = set(specialists) if specialists is not None else set(contract.specialists)
    best: dict[str, dict[str, tuple[float, int, list[dict[str, Any]], int]]] = {s: {} for s in wanted}
    result = CurationResult()
    for order, cand in enumerate(candidates):
        if cand.specialist not in wanted:
            result.drop("specialist not trained")
            continue
        if rules.sources is not None and cand.source not in rules.sources:
            result.drop("source not selected")
            continue
        if is_heldout(cand, heldout_prompts):
            result.drop("held-out")
            continue
        messages = _corrected(cand) if rules.use_corrections else None
        score = 1.0 if messages is not None else cand.score  # a user's correction is the answer
        if messages is None:
            messages = cand.messages
            if score is None or score < rules.min_score:
                result.drop("below threshold")
                continue
        if not any(m.get("role") == "assistant" for m in messages):
            result.drop("no assistant turn")
            continue
        key = (
            prompt_key(messages)
            if rules.dedup == "prompt"
            else _content_key(messages)
            if rules.dedup == "content"
            else str(order)
        )
        slot = best[cand.specialist]
        if key in slot:
            result.drop("duplicate")
            if slot[key][0] >= score:
                continue
        slot[key] = (score, order, messages, cand.experience_id)
    for specialist, slot in best.items():
        chosen = sorted(slot.values(), key=lambda item: (-item[0], item[1]))
        cap = rules.max_examples.get(specialist, rules.max_examples_per_specialist)
        if cap is not None and len(chosen) > cap:
            for _ in chosen[cap:]:
                result.drop("over cap")
            chosen = chosen[:cap]
        chosen.sort(key=lambda item: item[1])  # keep arrival order in the dataset
        result.examples[specialist] = [
            {"messages": msgs, "score": float(score), "experience_id": exp_id}
            for score, _, msgs, exp_id in chosen
        ]
    return result


def load_candidates(
    *, session: Session, contract_version_id: int, lineage: str | None = None, min_score: float | None = None
) -> list[Candidate]:
    """Scored traces (total under the contract version), optionally limited to one lineage's generations and
    to those at or above ``min_score`` (traces with feedback are always kept: they may carry a correction)."""
    from sqlalchemy import select

    from pipeline.registry.models import Experience, Generation, Score

    stmt = (
        select(
            Experience.id,
            Experience.specialist,
            Score.value,
            Score.details,
            Experience.messages,
            Experience.meta,
            Experience.feedback,
            Experience.source,
        )
        .join(
            Score,
            (Score.experience_id == Experience.id)
            & (Score.contract_version_id == contract_version_id)
            & (Score.scorer == "total"),
        )
        .order_by(Experience.id)
    )
    if min_score is not None:
        stmt = stmt.where((Score.value >= min_score) | Experience.feedback.is_not(None))
    if lineage is not None:
        stmt = stmt.outerjoin(Generation, Generation.id == Experience.generation_id).where(
            (Generation.lineage == lineage) | (Experience.generation_id.is_(None))
        )
    out = []
    for row in session.execute(stmt):
        specialist = (row.details or {}).get("specialist") or row.specialist
        out.append(
            Candidate(
                experience_id=row.id,
                specialist=specialist,
                score=row.value,
                messages=row.messages,
                metadata=row.meta or {},
                feedback=row.feedback,
                source=row.source,
            )
        )
    return out


def save_dataset(examples: list[dict[str, Any]], path: Path) -> tuple[str, int]:
    """Save with ``datasets.Dataset.save_to_disk``; return (sha256 of the conversations, rows)."""
    import datasets

    from pipeline.training import dataset_sha256

    datasets.disable_progress_bars()
    rows = [
        {"messages": e["messages"], "score": e["score"], "experience_id": e["experience_id"]}
        for e in examples
    ]
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return dataset_sha256(rows), len(rows)


def lineage_candidates(session: Session, gen: Generation, contract: ContractSpec) -> list[Candidate]:
    """The lineage's scored experience at or above the contract's selection threshold (or with feedback)."""
    return load_candidates(
        session=session,
        contract_version_id=gen.contract_version_id,
        lineage=gen.lineage,
        min_score=contract.selection.min_score,
    )


def curate_step(
    *, generation_id: int, config: AdvanceConfig, progress: Progress | None = None
) -> dict[str, Any]:
    """One SFT dataset per specialist from all scored experience of the lineage (accumulated), held-out excluded."""
    from sqlalchemy import delete

    from pipeline.candidate import artifacts_for, contract_of, load_generation, mark_step
    from pipeline.harness import HarnessSpec
    from pipeline.heldout import resolve_suites
    from pipeline.prompting import render_messages
    from pipeline.registry import TrainingDataset, get_engine, session_scope

    engine = get_engine()
    with session_scope(engine) as session:
        gen = load_generation(session, generation_id)
        contract = contract_of(gen)
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
                ex["messages"] = [*render_messages(harness, specialist, context), answer]
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
