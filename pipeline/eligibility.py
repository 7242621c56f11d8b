"""Eligibility: which scored experience may be learned from -- the one gate every consumer passes through.

A trace may be learned from only when the contract verified it -- a verifying scorer (a reference answer,
tests that ran, a schema, an expected call, a judge's verdict, a user's rating) checked its final turn --
or when a user's correction, itself scored under the contract, passed (``accepted_correction``); it must
never be held out. ``load_candidates`` is where every consumer of experience (curation's SFT examples and
preference pairs, co-design exemplars, router training data) gets its traces: it applies the held-out
predicate (``pipeline.heldout``) and counts, per specialist, every turn it leaves out and why (``Drops``).
``eligible_examples`` is what co-design and the router learn from as it is.

A specialist whose contract entry names no task source has no validation split of its own: a fixed slice of
its experience (``selection.validation_share`` of the prompts, by a hash of each prompt, so the same slice
every generation) is what co-design validates harness variants on (``validation_items``), and it is never
trained on.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from pipeline.contract import ContractSpec
    from pipeline.heldout import HeldoutIndex
    from pipeline.registry import Generation


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


def accepted_correction(candidate: Candidate, contract: ContractSpec) -> list[dict[str, Any]] | None:
    """The corrected conversation when the user's correction passed the contract: its total reaches the
    selection threshold and no verifying scorer that applied to it failed. A correction is a user's
    statement of the right answer, so one that passes counts as verified. The correction's own text goes
    through the held-out predicate too (the stored trace already did): a user could paste a held-out prompt
    into it."""
    check = candidate.correction
    if not contract.selection.use_corrections or not check:
        return None
    total = check.get("total")
    if total is None or total < contract.selection.min_score or check.get("failed"):
        return None
    from pipeline.heldout import heldout_index
    from pipeline.scoring import corrected_trace

    corrected = corrected_trace({"messages": candidate.messages, "feedback": candidate.feedback})
    if corrected is None or heldout_index(contract).exclusion(messages=corrected["messages"][-1:]):
        return None
    return corrected["messages"]


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


def load_candidates(
    *,
    session: Session,
    contract_version_id: int,
    contract: ContractSpec,
    heldout: HeldoutIndex,
    lineage: str | None = None,
    min_score: float | None = None,
    specialists: list[str] | None = None,
) -> tuple[list[Candidate], Drops]:
    """The scored traces that may be learned from (optionally of one lineage's generations, of some
    specialists), and the count of those left out per specialist and reason.

    Only traces the contract verified at or above ``min_score`` (default: its selection threshold;
    preference pairs read every verified trace), or with feedback (a correction may make them eligible), are
    read in full; none of them held out (the held-out predicate is applied here, for every consumer); none
    from an evaluation run."""
    from sqlalchemy import case, func, or_, select

    from pipeline.registry.models import Experience, Generation, Score

    threshold = contract.selection.min_score if min_score is None else min_score
    join = (
        (Score.experience_id == Experience.id)
        & (Score.contract_version_id == contract_version_id)
        & (Score.scorer == "total")
    )
    eligible = or_(
        (Score.value >= threshold) & Score.verified.is_(True), Experience.feedback.is_not(None)
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
    if specialists is not None:
        counted, loaded = (
            counted.where(specialist.in_(specialists)),
            loaded.where(specialist.in_(specialists)),
        )
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
    session: Session,
    gen: Generation,
    contract: ContractSpec,
    *,
    min_score: float | None = None,
    specialists: list[str] | None = None,
) -> tuple[list[Candidate], Drops]:
    """``load_candidates`` for a generation's lineage under its contract version."""
    from pipeline.heldout import heldout_index

    return load_candidates(
        session=session,
        contract_version_id=gen.contract_version_id,
        contract=contract,
        heldout=heldout_index(contract),
        lineage=gen.lineage,
        min_score=min_score,
        specialists=specialists,
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
