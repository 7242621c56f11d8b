"""Curation: scored experience becomes one SFT dataset per specialist, under the contract's selection rules.

A trace may be learned from only when the contract verified it -- a verifying scorer (a reference answer,
tests that ran, a schema, an expected call, a judge's verdict, a user's rating) checked its final turn --
or when a user's correction, itself scored under the contract, passed; it must also reach the selection
threshold and must not be held out. ``load_candidates`` is where every consumer of experience (curation,
co-design exemplars, router training data) gets its traces: it applies the held-out predicate
(``pipeline.heldout``) and counts, per specialist, every turn it leaves out and why.

Reasons a turn is dropped, in the order they are decided: ``specialist not trained``, ``source not
selected``, ``unverified`` (no verifying scorer applied, no accepted correction), ``below threshold``,
``held-out``, ``correction failed the contract``, ``no assistant turn``, ``validation slice``,
``duplicate``, ``over cap``.

A specialist whose contract entry names no task source has no validation split of its own: a fixed slice of
its experience (``selection.validation_share`` of the prompts, by a hash of each prompt, so the same slice
every generation) is what co-design validates harness variants on (``validation_items``), and it is never
trained on.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.contract import ContractSpec

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from pipeline.candidate import AdvanceConfig, Progress
    from pipeline.heldout import HeldoutIndex
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
    verified: bool = False
    correction: dict[str, Any] | None = None  # the correction's score (``scoring.corrected_trace``)
    content_hash: str = ""  # the stored trace's content address (what the held-out answer is kept under)


@dataclass
class Drops:
    """How many turns were left out, per specialist and reason."""

    counts: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, specialist: str, reason: str, n: int = 1) -> None:
        per = self.counts.setdefault(specialist, {})
        per[reason] = per.get(reason, 0) + n

    def merge(self, other: Drops) -> None:
        for specialist, reasons in other.counts.items():
            for reason, n in reasons.items():
                self.add(specialist, reason, n)

    def total(self, reason: str) -> int:
        return sum(per.get(reason, 0) for per in self.counts.values())


@dataclass
class CurationResult:
    """What curation kept per specialist, and why the rest was left out."""

    examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    dropped: Drops = field(default_factory=Drops)


def prompt_key(messages: list[dict[str, Any]]) -> str:
    """Hash of the conversation before its last assistant turn (what the model was asked)."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=len(messages))
    context = [
        {"role": m.get("role"), "content": m.get("content")}
        for m in messages[:last]
        if m.get("role") != "system"
    ]
    return hashlib.sha256(json.dumps(context, sort_keys=True).encode()).hexdigest()


def in_validation_slice(messages: list[dict[str, Any]], share: float) -> bool:
    """Whether a conversation's prompt falls in the validation slice (a pure function of the prompt)."""
    return int(prompt_key(messages)[:16], 16) / 16**16 < share


def validation_items(
    candidates: list[Candidate], contract: ContractSpec, specialist: str, n: int
) -> list[dict[str, Any]]:
    """Up to ``n`` task items (the conversation before its answer, with the trace's metadata for the scorers)
    from ``specialist``'s verified experience in the validation slice, one per prompt, lowest prompt hash
    first (the same items every generation while the experience lasts)."""
    chosen: dict[str, dict[str, Any]] = {}
    for cand, messages, _score in eligible_examples(candidates, contract, validation=True):
        if cand.specialist != specialist:
            continue
        last = max(i for i, m in enumerate(messages) if m.get("role") == "assistant")
        key = prompt_key(messages)
        if key not in chosen:
            chosen[key] = {"messages": messages[:last], "metadata": dict(cand.metadata), "feedback": None}
    return [chosen[k] for k in sorted(chosen)[:n]]


def _content_key(messages: list[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()


def accepted_correction(candidate: Candidate, contract: ContractSpec) -> list[dict[str, Any]] | None:
    """The corrected conversation when the user's correction passed the contract: its total reaches the
    selection threshold and no verifying scorer that applied to it failed. A correction is a user's
    statement of the right answer, so one that passes counts as verified."""
    check = candidate.correction
    if not contract.selection.use_corrections or not check:
        return None
    total = check.get("total")
    if total is None or total < contract.selection.min_score or check.get("failed"):
        return None
    from pipeline.scoring import corrected_trace

    corrected = corrected_trace({"messages": candidate.messages, "feedback": candidate.feedback})
    return corrected["messages"] if corrected else None


_EXCLUDED: dict[tuple[str, str, str], str | None] = {}  # (index, trace content, source) -> reason


def excluded(candidate: Candidate, heldout: HeldoutIndex) -> str | None:
    """The held-out predicate for one candidate. Answers are kept per process under the trace's content
    address (the same content gets the same answer, whichever registry it is in): accumulated experience
    is checked once, not once per generation."""
    if not heldout.key or not candidate.content_hash:
        return heldout.exclusion(
            messages=candidate.messages, metadata=candidate.metadata, source=candidate.source
        )
    key = (heldout.key, candidate.content_hash, candidate.source)
    if key not in _EXCLUDED:
        if len(_EXCLUDED) >= 2_000_000:
            _EXCLUDED.clear()
        _EXCLUDED[key] = heldout.exclusion(
            messages=candidate.messages, metadata=candidate.metadata, source=candidate.source
        )
    return _EXCLUDED[key]


def select_examples(
    candidates: list[Candidate],
    *,
    contract: ContractSpec,
    heldout: HeldoutIndex,
    specialists: list[str] | None = None,
) -> CurationResult:
    """Apply the contract's selection rules: verification, corrections, threshold, held-out, dedup, caps.

    Only the final assistant turn of each selected conversation is a training target (``packing``);
    the turns before it are context."""
    from pipeline.serving.turns import STOPPED

    rules = contract.selection
    wanted = set(specialists) if specialists is not None else set(contract.specialists)
    sliced = {s for s, entry in contract.specialists.items() if entry.tasks is None}
    best: dict[str, dict[str, tuple[float, int, list[dict[str, Any]], int, Any]]] = {s: {} for s in wanted}
    result = CurationResult()
    drop = result.dropped.add
    for order, cand in enumerate(candidates):
        if cand.specialist not in wanted:
            drop(cand.specialist, "specialist not trained")
            continue
        if rules.sources is not None and cand.source not in rules.sources:
            drop(cand.specialist, "source not selected")
            continue
        messages = accepted_correction(cand, contract)
        score = cand.correction["total"] if messages is not None and cand.correction else cand.score
        if messages is None:
            usable = cand.verified and cand.score is not None and cand.score >= rules.min_score
            if not usable:
                why = "unverified" if not cand.verified else "below threshold"
                failed = cand.correction and rules.use_corrections
                drop(cand.specialist, "correction failed the contract" if failed else why)
                continue
            messages = cand.messages
            if cand.metadata.get("finish_reason") in STOPPED:  # cut off (timeout, disconnect): never whole
                drop(cand.specialist, "reply stopped before its end")
                continue
        if excluded(cand, heldout):
            drop(cand.specialist, "held-out")
            continue
        if not any(m.get("role") == "assistant" for m in messages):
            drop(cand.specialist, "no assistant turn")
            continue
        if cand.specialist in sliced and in_validation_slice(messages, rules.validation_share):
            drop(cand.specialist, "validation slice")
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
            drop(cand.specialist, "duplicate")
            if slot[key][0] >= score:
                continue
        slot[key] = (float(score), order, messages, cand.experience_id, cand.metadata.get("tools"))
    for specialist, slot in best.items():
        chosen = sorted(slot.values(), key=lambda item: (-item[0], item[1]))
        cap = rules.max_examples.get(specialist, rules.max_examples_per_specialist)
        if cap is not None and len(chosen) > cap:
            drop(specialist, "over cap", len(chosen) - cap)
            chosen = chosen[:cap]
        chosen.sort(key=lambda item: item[1])  # keep arrival order in the dataset
        result.examples[specialist] = [
            {"messages": msgs, "score": score, "experience_id": exp_id, "tools": tools}
            for score, _, msgs, exp_id, tools in chosen
        ]
    return result


def load_candidates(
    *,
    session: Session,
    contract_version_id: int,
    contract: ContractSpec,
    heldout: HeldoutIndex,
    lineage: str | None = None,
) -> tuple[list[Candidate], Drops]:
    """The scored traces that may be learned from (optionally of one lineage's generations), and the count
    of those left out per specialist and reason.

    Only traces the contract verified at or above its selection threshold, or with feedback (a correction
    may make them eligible), are read in full; none of them held out (the held-out predicate is applied
    here, for every consumer); none from an evaluation run."""
    from sqlalchemy import case, func, or_, select

    from pipeline.registry.models import Experience, Generation, Score

    rules = contract.selection
    join = (
        (Score.experience_id == Experience.id)
        & (Score.contract_version_id == contract_version_id)
        & (Score.scorer == "total")
    )
    eligible = or_(
        (Score.value >= rules.min_score) & Score.verified.is_(True), Experience.feedback.is_not(None)
    ) & (Experience.source != "evaluation")
    specialist = func.coalesce(Score.specialist, contract.default_specialist)
    reason = case(
        (Experience.source == "evaluation", "held-out"),
        (Score.verified.is_not(True), "unverified"),
        else_="below threshold",
    )
    counted = select(specialist, reason, func.count()).select_from(Experience).join(Score, join)
    loaded = (
        select(
            Experience.id,
            Experience.content_hash,
            specialist.label("specialist"),
            Score.value,
            Score.verified,
            Score.details,
            Experience.messages,
            Experience.meta,
            Experience.feedback,
            Experience.source,
        )
        .select_from(Experience)
        .join(Score, join)
        .where(eligible)
        .order_by(Experience.id)
    )
    if lineage is not None:
        in_lineage = (Generation.lineage == lineage) | Experience.generation_id.is_(None)
        counted = counted.outerjoin(Generation, Generation.id == Experience.generation_id).where(in_lineage)
        loaded = loaded.outerjoin(Generation, Generation.id == Experience.generation_id).where(in_lineage)
    drops = Drops()
    for name, why, n in session.execute(counted.where(~eligible).group_by(specialist, reason)):
        drops.add(name, why, n)
    out = []
    for row in session.execute(loaded):
        cand = Candidate(
            experience_id=row.id,
            specialist=row.specialist,
            score=row.value,
            messages=row.messages,
            metadata=row.meta or {},
            feedback=row.feedback,
            source=row.source,
            verified=bool(row.verified),
            correction=(row.details or {}).get("correction"),
            content_hash=row.content_hash,
        )
        if excluded(cand, heldout):
            drops.add(cand.specialist, "held-out")
            continue
        out.append(cand)
    return out, drops


def lineage_candidates(
    session: Session, gen: Generation, contract: ContractSpec
) -> tuple[list[Candidate], Drops]:
    """``load_candidates`` for a generation's lineage under its contract version."""
    from pipeline.heldout import heldout_index

    return load_candidates(
        session=session,
        contract_version_id=gen.contract_version_id,
        contract=contract,
        heldout=heldout_index(contract),
        lineage=gen.lineage,
    )


def eligible_examples(
    candidates: list[Candidate], contract: ContractSpec, *, validation: bool = False
) -> list[tuple[Candidate, list[dict[str, Any]], float]]:
    """(candidate, conversation, score) of every candidate that may be learned from as it is, or through an
    accepted correction: what co-design's exemplars and the router learn from (curation adds dedup and
    caps). The validation slice of specialists without a task source is left out (``validation=True``:
    only that slice, what co-design validates on)."""
    share = contract.selection.validation_share
    sliced = {s for s, entry in contract.specialists.items() if entry.tasks is None}
    out = []
    for cand in candidates:
        corrected = accepted_correction(cand, contract)
        if corrected is not None and cand.correction:
            found = (cand, corrected, float(cand.correction["total"]))
        elif cand.verified and cand.score is not None and cand.score >= contract.selection.min_score:
            found = (cand, cand.messages, float(cand.score))
        else:
            continue
        if (cand.specialist in sliced and in_validation_slice(found[1], share)) == validation:
            out.append(found)
    return out


def save_dataset(examples: list[dict[str, Any]], path: Path) -> tuple[str, int]:
    """Save with ``datasets.Dataset.save_to_disk``; return (sha256 of the conversations, rows)."""
    import datasets

    from pipeline.training import dataset_sha256

    datasets.disable_progress_bars()
    rows = [  # tools: the schemas the chat template was given (JSON text: one column type for every row)
        {
            "messages": e["messages"],
            "score": e["score"],
            "experience_id": e["experience_id"],
            "tools": json.dumps(e.get("tools") or [], separators=(",", ":")),
        }
        for e in examples
    ]
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return dataset_sha256(rows), len(rows)


def curate_step(
    *, generation_id: int, config: AdvanceConfig, progress: Progress | None = None
) -> dict[str, Any]:
    """One SFT dataset per specialist from all eligible experience of the lineage (accumulated)."""
    from sqlalchemy import delete, insert

    from pipeline.candidate import artifacts_for, contract_of, load_generation, mark_step
    from pipeline.harness import HarnessSpec
    from pipeline.heldout import heldout_index
    from pipeline.pair import offered_tools
    from pipeline.prompting import render_messages
    from pipeline.registry import DatasetExample, TrainingDataset, get_engine, session_scope

    engine = get_engine()
    with session_scope(engine) as session:
        gen = load_generation(session, generation_id)
        contract = contract_of(gen)
        harness = HarnessSpec.model_validate(gen.harness_version.spec)
        candidates, dropped = lineage_candidates(session, gen, contract)
        specialists = [a.specialist for a in gen.adapters]
        number = gen.number
    selected = select_examples(
        candidates, contract=contract, heldout=heldout_index(contract), specialists=specialists
    )
    dropped.merge(selected.dropped)
    out_dir = artifacts_for(config.lineage, number) / "datasets"
    datasets: dict[str, Any] = {}
    with session_scope(engine) as session:
        session.execute(delete(TrainingDataset).where(TrainingDataset.generation_id == generation_id))
        for specialist in specialists:
            examples = selected.examples.get(specialist, [])
            if len(examples) < config.min_examples:
                datasets[specialist] = {"rows": len(examples), "skipped": f"fewer than {config.min_examples}"}
                continue
            offered = offered_tools(harness, specialist)
            for ex in examples:  # train on what the model sees under the harness
                *context, answer = ex["messages"]
                ex["messages"] = [*render_messages(harness, specialist, context), answer]
                ex["tools"] = ex.get("tools") or offered
            digest, rows = save_dataset(examples, out_dir / specialist)
            dataset = TrainingDataset(
                generation_id=generation_id,
                specialist=specialist,
                path=str(out_dir / specialist),
                sha256=digest,
                num_rows=rows,
            )
            session.add(dataset)
            session.flush()
            traces = sorted(
                {int(ex["experience_id"]) for ex in examples if ex.get("experience_id") is not None}
            )
            if traces:  # provenance: which traces this dataset (and so its adapter) learned from
                session.execute(
                    insert(DatasetExample),
                    [{"dataset_id": dataset.id, "experience_id": e} for e in traces],
                )
            datasets[specialist] = {"rows": rows, "sha256": digest, "path": str(out_dir / specialist)}
        outcome = {"datasets": datasets, "dropped": dropped.counts}
        mark_step(session, load_generation(session, generation_id), "curate", outcome)
    return outcome
