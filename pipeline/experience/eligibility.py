"""Eligibility: which scored experience may be learned from -- the one gate every consumer passes through.

A trace may be learned from only when its *final* assistant turn (the only one it can teach) passed the
contract: a verifying scorer (a reference answer, tests that ran, a schema, an expected call, a judge's
verdict, a counted rating) checked it and none of the verifying checks on it failed (the ``final`` score row;
the trace's mean over all turns is shown beside it, never selected on) -- or when a trusted user's
correction, itself scored under the contract, passed the same way (``accepted_correction``); it must never be
held out. What a client sent without the scope to certify it is kept under ``metadata.claimed`` /
``feedback.claimed`` and no scorer reads it (``pipeline.experience.principals``), so it can verify nothing.
``load_candidates`` is where every consumer of experience (curation's SFT examples and preference pairs,
co-design exemplars, router training data) gets its traces: it applies the held-out predicate
(``pipeline.specs.heldout``) and counts, per specialist, every turn it leaves out and why (``Drops``).
``eligible_examples`` is what co-design and the router learn from as it is. ``cap_principal_share`` keeps any
single outside principal to the contract's share of a dataset.

A specialist whose contract entry names no task source has no validation split of its own: a fixed slice of
its experience (``selection.validation_share`` of the prompts, by a hash of each prompt, so the same slice
every generation) is what co-design validates harness variants on (``validation_items``), and it is never
trained on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from pipeline.experience.principals import INSIDE
from pipeline.registry.models import Experience, Generation, Score
from pipeline.scoring import corrected_trace
from pipeline.scoring.trace import FINAL
from pipeline.specs.heldout import heldout_index

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from pipeline.specs.contract import ContractSpec
    from pipeline.specs.heldout import HeldoutIndex


UNKNOWN_PRINCIPAL = "(unknown)"  # a served trace stored before principals were recorded


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
    verified: bool = False  # a verifying scorer checked the final turn
    correction: dict[str, Any] | None = None  # the correction's score (``scoring.corrected_trace``)
    content_hash: str = ""  # the stored trace's content address (what the held-out answer is kept under)
    failed: list[str] = field(default_factory=list)  # verifying checks that failed on the final turn
    principal: str | None = None  # who sent the trace (``pipeline.experience.principals``); None: unknown
    routes: list[Any] = field(default_factory=list)  # per assistant turn, the specialist that served it

    @property
    def passed(self) -> bool:
        """Checked by a verifying scorer, and no verifying check on the final turn failed."""
        return self.verified and not self.failed

    def corrector(self) -> str | None:
        """Who gave the trace's counted correction (``feedback.correction_by``, else the trace's principal)."""
        by = self.feedback.get("correction_by") if isinstance(self.feedback, dict) else None
        return by if isinstance(by, str) else self.principal


@dataclass
class Drops:
    """How many turns were left out, per specialist and reason, and per principal (whose turn it was) and
    reason."""

    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    principals: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, specialist: str, reason: str, n: int = 1, *, principal: str | None = None) -> None:
        for table, key in ((self.counts, specialist), (self.principals, principal or UNKNOWN_PRINCIPAL)):
            per = table.setdefault(key, {})
            per[reason] = per.get(reason, 0) + n

    def merge(self, other: Drops) -> None:
        for mine, theirs in ((self.counts, other.counts), (self.principals, other.principals)):
            for key, reasons in theirs.items():
                per = mine.setdefault(key, {})
                for reason, n in reasons.items():
                    per[reason] = per.get(reason, 0) + n

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
    """The corrected conversation when a trusted user's correction passed the contract: a verifying scorer
    applied to the corrected final turn, none of the verifying checks on it failed, and its score reaches the
    selection threshold (text that merely passes form checks is never learned). Only corrections from
    principals granted the ``correct`` scope are stored where this reads them (others are kept under
    ``feedback.claimed``), and ``selection.trusted_corrections`` may narrow that further. The correction's own
    text goes through the held-out predicate too (the stored trace already did): a user could paste a
    held-out prompt or answer into it."""
    check = candidate.correction
    rules = contract.selection
    if not rules.use_corrections or not check:
        return None
    total = check.get("total")
    if total is None or total < rules.min_score or not check.get("verified_by") or check.get("failed"):
        return None
    if rules.trusted_corrections is not None and candidate.corrector() not in rules.trusted_corrections:
        return None

    corrected = corrected_trace({"messages": candidate.messages, "feedback": candidate.feedback})
    if corrected is None:
        return None
    index = heldout_index(contract)
    meta, messages = candidate.metadata, corrected["messages"]
    if index.exclusion(messages=messages, metadata=meta, source=candidate.source) or index.teaches(
        messages, meta
    ):
        return None
    return messages


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

    Only traces whose final turn the contract checked at or above ``min_score`` (default: its selection
    threshold; preference pairs read every checked trace), or with feedback (a correction may make them
    eligible), are read in full; none of them held out (the held-out predicate is applied here, for every
    consumer); none from an evaluation run. Whether a check failed on the final turn is each consumer's
    decision (``Candidate.passed``): a preference pair's other side may have failed one."""
    from sqlalchemy import case, func, or_, select

    threshold = contract.selection.min_score if min_score is None else min_score
    join = (
        (Score.experience_id == Experience.id)
        & (Score.contract_version_id == contract_version_id)
        & (Score.scorer == FINAL)
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
    counted = (
        select(specialist, reason, Experience.principal, func.count())
        .select_from(Experience)
        .join(Score, join)
    )
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
            Experience.principal,
            Experience.routes,
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
    for name, why, who, n in session.execute(
        counted.where(~eligible).group_by(specialist, reason, Experience.principal)
    ):
        drops.add(name, why, n, principal=who)
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
            failed=list((row.details or {}).get("failed") or []),
            principal=row.principal,
            routes=row.routes if isinstance(row.routes, list) else [],
        )
        if excluded(cand, heldout):
            drops.add(cand.specialist, "held-out", principal=cand.principal)
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
    index = heldout_index(contract)
    out = []
    for cand in candidates:
        corrected = accepted_correction(cand, contract)
        if corrected is not None and cand.correction:
            found = (cand, corrected, float(cand.correction["total"]))
        elif cand.passed and cand.score is not None and cand.score >= contract.selection.min_score:
            if index.teaches(cand.messages, cand.metadata):  # a held-out answer that is not its own
                continue
            found = (cand, cand.messages, float(cand.score))
        else:
            continue
        if (cand.specialist in sliced and in_validation_slice(found[1], share)) == validation:
            out.append(found)
    return out


Row = TypeVar("Row")


def cap_principal_share(
    rows: list[Row], *, share: float, principal_of: Callable[[Row], str | None], cap: int | None = None
) -> tuple[list[Row], list[Row]]:
    """The best-first ``rows`` kept under the contract's caps: at most ``cap`` rows, and no outside
    principal (anyone but the loop's own practice and the operator's ingest) holding more than ``share`` of
    the rows kept. Returns the kept rows (in the given order) and the rows the share rule dropped (each
    principal's lowest-ranked ones); the rest were left out by ``cap``.

    Dropping rows shrinks the dataset and so every share's allowance: the rule is applied until it holds
    (each round drops at least one row, so it ends). A dataset whose rows all come from one outside
    principal ends empty unless ``share`` is 1.0 -- one party alone never decides what is learned."""
    pool = list(rows)
    dropped: list[Row] = []
    while True:
        kept = pool[:cap] if cap is not None else pool
        counts: dict[str, int] = {}
        for row in kept:
            who = principal_of(row) or UNKNOWN_PRINCIPAL
            if who not in INSIDE:
                counts[who] = counts.get(who, 0) + 1
        allowed = int(share * len(kept) + 1e-9)
        over = {who: n - allowed for who, n in counts.items() if n > allowed}
        if not over:
            return kept, dropped
        cut: set[int] = set()
        for i in range(len(kept) - 1, -1, -1):  # each one's lowest-ranked rows first
            who = principal_of(kept[i]) or UNKNOWN_PRINCIPAL
            if over.get(who, 0) > 0:
                over[who] -= 1
                cut.add(i)
                dropped.append(kept[i])
        pool = [row for i, row in enumerate(pool) if i not in cut]
