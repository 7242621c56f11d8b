"""Adopting a new contract version: a lineage moves to it without starting over.

Why a lineage cannot simply pick up a changed contract: ``ratchet init`` refuses an existing lineage whose
first generation was registered under other specs (a second lineage would start with a fresh error budget on
the same held-out suites), the registry refuses a changed contract under an old version, and ``ratchet
advance`` builds every candidate under its champion's contract version, so nothing else ever moves a lineage.

``adopt_contract`` does, in this order (each step can be repeated: a failed adoption is run again as is):

1. checks the file as ``ratchet init`` would (files and their sha256, task sources, the champion's harness
   against the new protocol and exemplars, every specialist of the lineage declared, and every specialist
   judged by a held-out suite or ``ungated: true``, no suite empty); refuses another contract's name, the
   version the lineage is already on, a raised error rate (``raised_rates``: the ledger counts tests, not the
   rates they spent) and a lineage with a candidate in flight;
2. registers the new version with the suites it drops appended to its ``retention`` list (``carried_suites``:
   a dropped held-out suite becomes ``<specialist>-v<old version>`` with the old contract's tolerance and
   regression error rate; a retention suite of the old version is carried as it is): the held-out index and
   the evaluation read them from the stored spec with no other change. The stored spec then differs from the
   file; both content hashes are recorded;
3. scores every trace under the new version (``scoring.score_experience``: the old version's scores stay
   under the old version, where curation of other lineages still reads them; a row replaced under the new
   version goes to ``score_history``);
4. re-evaluates the champion on the new version's held-out suites (greedy answers scored under it) and moves
   it to the new version (``Generation.contract_version_id``; earlier generations keep theirs), with its new
   held-out scores where ``ratchet lineage`` and the dashboard read a generation's scores and the old ones
   kept under ``evaluation["adoptions"]``; the move is audited (action ``adopt``) with actor, reason and
   both hashes.

The spending ledger needs nothing: it is keyed by each suite's content hash, and a suite the new version keeps
resolves to the same items. Experience stays linked to the lineage's generations, whose ids do not change.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean
from typing import TYPE_CHECKING, Any

from pipeline.errors import ConflictError, NotFoundError, RatchetError
from pipeline.gates.answers import answer_suites, item_score
from pipeline.gates.suites import require_counted
from pipeline.loop.candidate import load_generation
from pipeline.loop.founding import require_clean_exemplars, require_clean_tasks
from pipeline.modeling.pair import pair_for_generation
from pipeline.registry import (
    ContractVersion,
    audit,
    get_champion,
    get_engine,
    get_in_flight,
    register_contract,
    session_scope,
    store_file,
)
from pipeline.registry.db import hold_lock
from pipeline.registry.documents import Adoption, evaluation_of
from pipeline.registry.models import utcnow
from pipeline.scoring import score_experience
from pipeline.specs.compatibility import require_compatible
from pipeline.specs.contract import ContractSpec, RetentionSuite, load_contract, stored_contract, verify_files
from pipeline.specs.harness import HarnessSpec
from pipeline.specs.heldout import resolve_retention, resolve_suites
from pipeline.specs.loading import content_hash

if TYPE_CHECKING:
    from pipeline.modeling.pair import PairSpec
    from pipeline.specs.contract import HeldoutSuite

__all__ = [
    "AdoptionResult",
    "adopt_contract",
    "adopted_spec",
    "carried_suites",
    "evaluate_champion",
    "raised_rates",
]


@dataclass(frozen=True)
class AdoptionResult:
    """What ``adopt_contract`` did."""

    lineage: str
    generation: int  # the champion that moved
    previous: str  # "name version" of the contract it left
    adopted: str  # "name version" it is on now
    contract_version_id: int
    file_sha256: str  # content hash of the file's contract (what `ratchet contract lint` prints)
    stored_sha256: str  # content hash of the stored spec (the file plus the carried retention suites)
    retained: list[str]  # retention suites added by this adoption
    released: list[str]  # retention suites the operator gave up (--release)
    kept: list[str]  # held-out suites of the old version the new one keeps (their ledger continues)
    scored: int  # traces scored under the new version
    scores: dict[str, float] = field(default_factory=dict)
    overall: float | None = None
    retention: dict[str, float] = field(default_factory=dict)  # the champion's mean per retention suite
    previous_overall: float | None = None

    def describe(self) -> list[str]:
        same = self.file_sha256 == self.stored_sha256
        lines = [
            f"lineage {self.lineage!r}: champion generation {self.generation} moved from contract {self.previous} "
            f"to {self.adopted}",
            f"contract sha256: file {self.file_sha256[:12]}, stored {self.stored_sha256[:12]}"
            + (" (the same)" if same else " (the file plus the retention suites below)"),
            "held-out suites kept (their spending continues): " + (", ".join(self.kept) or "none"),
            "became retention suites: " + (", ".join(self.retained) or "none"),
        ]
        if self.released:
            lines.append("retention suites released: " + ", ".join(self.released))

        def fmt(value: float | None) -> str:
            return "-" if value is None else f"{value:.3f}"

        per = "".join(f", {s} {v:.3f}" for s, v in sorted({**self.scores, **self.retention}.items()))
        lines.append(
            f"champion re-evaluated under {self.adopted}: overall {fmt(self.overall)} (under {self.previous}: "
            f"{fmt(self.previous_overall)}){per}"
        )
        lines.append(f"experience scored under {self.adopted}: {self.scored} traces")
        return lines


# ------------------------------------------------------------------------------------------------ suites
def _source(suite: HeldoutSuite | RetentionSuite) -> tuple[Any, ...]:
    """What a suite's items are made of: a file's sha256, or its generator, options, seed and size (a file's
    path is not part of it: the registry keeps the bytes under their sha256)."""

    if suite.sha256 is not None:
        return ("file", suite.specialist, suite.sha256)
    fresh = getattr(suite, "fresh", False)  # a fresh suite draws another sample per champion
    return ("generator", suite.specialist, suite.generator, content_hash(suite.options), suite.seed, suite.size,
            fresh)  # fmt: skip


def _retention_key(suite: HeldoutSuite | RetentionSuite) -> tuple[Any, ...]:
    scored_as = getattr(suite, "scored_as", None) or suite.specialist
    return (*_source(suite), scored_as)


def _label(version: str) -> str:
    """A version as it may appear in a suite name (``Name``: letters, digits, ``_ . -``)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", version).strip("-") or "old"


def carried_suites(
    old: ContractSpec, new: ContractSpec, *, release: tuple[str, ...] | list[str] = ()
) -> tuple[list[RetentionSuite], list[str], list[str]]:
    """The retention suites ``new`` must gain so that nothing ``old`` measured is forgotten, the names of the
    old held-out suites ``new`` keeps, and the names released.

    A held-out suite of ``old`` that ``new`` has neither as a held-out suite nor as a retention suite scored
    as its own specialist (same items: the same file, or the same generator, options, seed and size) becomes
    ``<specialist>-v<old version>``, tolerance and error rate those of ``old`` for that specialist. A changed
    suite counts as dropped: the old items are what the champion was judged on. A retention suite of ``old``
    that ``new`` lacks is carried as it is, unless its name is in ``release`` (the operator gives it up).
    A generated ``fresh`` suite is carried as the sample of its seed."""

    released = [n for n in release if n in {r.name for r in old.retention}]
    unknown = sorted(set(release) - set(released))
    if unknown:
        names = ", ".join(r.name for r in old.retention) or "none"
        raise RatchetError(
            f"--release {unknown[0]}: contract {old.name} {old.version} has no such retention suite ({names})"
        )
    in_new = {_source(h) for h in new.heldout}
    retained = {_retention_key(r) for r in new.retention} | {(*_source(h), h.specialist) for h in new.heldout}
    taken = {r.name for r in new.retention}
    out: list[RetentionSuite] = []
    kept: list[str] = []
    counts: dict[str, int] = {}

    def name_for(base: str) -> str:
        name, k = base, 1
        while name in taken:
            k += 1
            name = f"{base}-{k}"
        taken.add(name)
        return name

    for suite in old.heldout:
        counts[suite.specialist] = counts.get(suite.specialist, 0) + 1
        label = (
            suite.specialist
            if counts[suite.specialist] == 1
            else f"{suite.specialist}#{counts[suite.specialist]}"
        )
        if _source(suite) in in_new:
            kept.append(label)
            continue
        if _retention_key(suite) in retained:
            continue
        out.append(
            RetentionSuite(
                name=name_for(f"{suite.specialist}-v{_label(old.version)}"),
                specialist=suite.specialist,
                path=suite.path,
                sha256=suite.sha256,
                generator=suite.generator,
                options=dict(suite.options),
                seed=suite.seed,
                size=suite.size,
                max_regression=old.promotion.tolerance(suite.specialist),
                error_rate=old.promotion.regression_error_rate,
            )
        )
        retained.add(_retention_key(suite))
    for suite in old.retention:
        if suite.name in released or _retention_key(suite) in retained:
            continue
        out.append(suite.model_copy(update={"name": name_for(suite.name)}))
        retained.add(_retention_key(suite))
    return out, kept, released


def adopted_spec(
    old: ContractSpec, new: ContractSpec, *, release: tuple[str, ...] | list[str] = ()
) -> tuple[ContractSpec, list[RetentionSuite], list[str], list[str]]:
    """``new`` with ``carried_suites(old, new)`` appended to its retention list (validated again), the suites
    added, the held-out suites kept and the retention suites released."""

    carried, kept, released = carried_suites(old, new, release=release)
    missing = sorted({n for r in carried for n in (r.specialist, r.scored_as) if n} - set(new.specialists))
    if missing:
        raise RatchetError(
            f"contract {new.name} {new.version} drops specialist {missing[0]!r}, whose suites the lineage must "
            "keep as retention suites: keep the specialist declared"
        )
    data = new.model_dump(mode="json")
    data["retention"] = [*data.get("retention", []), *(r.model_dump(mode="json") for r in carried)]
    try:
        return ContractSpec.model_validate(data), carried, kept, released
    except (
        ValueError
    ) as exc:  # a carried suite the new version cannot hold (a specialist it no longer scores)
        first = exc.errors()[0]["msg"] if hasattr(exc, "errors") else str(exc)
        raise RatchetError(
            f"contract {new.name} {new.version} cannot keep the suites of {old.name} {old.version} as retention "
            f"suites: {first}"
        ) from None


def raised_rates(old: ContractSpec, new: ContractSpec) -> list[str]:
    """One line per error rate ``new`` raises above ``old``'s: ``promotion.false_promotion_rate``,
    ``promotion.regression_error_rate``, and the rate of each suite ``new`` tests for non-inferiority on items
    (or, for a retention suite, under a name) ``old`` already tested -- held-out suites at
    ``regression_error_rate``, retention suites at their ``error_rate`` (the ledger counts both as one
    budget). Why refused: the ledger stores how many tests a suite has seen, not the rates they spent, so the
    j-th test at a higher rate spends more than the rate the earlier tests were promised under."""
    out = [
        f"promotion.{key} {after:g} is above {before:g}"
        for key in ("false_promotion_rate", "regression_error_rate")
        if (after := getattr(new.promotion, key)) > (before := getattr(old.promotion, key))
    ]

    def _items(suite: HeldoutSuite | RetentionSuite) -> tuple[Any, ...]:
        # a fresh suite's seed sample is the items a retention suite of that seed holds: one budget, strictly
        return _source(suite)[:6]

    by_items: dict[tuple[Any, ...], float] = {}
    for suite, rate in [(h, old.promotion.regression_error_rate) for h in old.heldout] + [
        (r, r.error_rate) for r in old.retention
    ]:
        by_items[_items(suite)] = min(rate, by_items.get(_items(suite), rate))
    by_name = {r.name: r.error_rate for r in old.retention}
    tested: list[tuple[str, float, list[float | None]]] = [
        (f"retention[{i}] ({r.name}): error_rate", r.error_rate, [by_items.get(_items(r)), by_name.get(r.name)])
        for i, r in enumerate(new.retention)
    ]  # fmt: skip
    if new.promotion.regression_error_rate <= old.promotion.regression_error_rate:  # else said above
        tested += [
            (f"heldout[{i}] ({h.specialist}): promotion.regression_error_rate",
             new.promotion.regression_error_rate, [by_items.get(_items(h))])
            for i, h in enumerate(new.heldout)
        ]  # fmt: skip
    for what, rate, befores in tested:
        known = [b for b in befores if b is not None]
        if known and rate > min(known):
            out.append(f"{what} {rate:g} is above the {min(known):g} its items were tested at")
    return out


# -------------------------------------------------------------------------------------------- evaluation
def evaluate_champion(
    pair: PairSpec,
    contract: ContractSpec,
    *,
    epoch: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """The pair's greedy answers on the contract's held-out suites (a ``fresh`` suite's sample of champion
    ``epoch``) and retention suites, each scored on its final turn as evaluation scores it
    (``evaluation.item_score``, under the suite's ``scored_as``): per specialist and per retention suite the
    mean over the items scored, overall the mean of the specialists' means (as the gate weighs them), the items
    left unscored. More than ``promotion.max_unscored_share`` unscored is refused, as evaluation refuses it."""

    suites = {s: items for s, items in resolve_suites(contract, epoch=epoch).items() if s in pair.adapters}
    if not suites:
        raise RatchetError(
            f"contract {contract.name} {contract.version} has no held-out suite for the lineage"
        )
    kept = [r for r in contract.retention if r.specialist in pair.adapters]
    resolved = resolve_retention(contract) if kept else {}
    jobs = [(s, s, s, items) for s, items in suites.items()]  # (key, specialist, scored as, items)
    jobs += [
        (f"retention {r.name}", r.specialist, r.scored_as or r.specialist, resolved[r.name]) for r in kept
    ]
    means: dict[str, float] = {}
    unscored: dict[str, int] = {}
    reasons: list[str] = []
    for key, specialist, scored_as, items in jobs:
        values = []
        for trace in answer_suites(pair, {specialist: items}, progress=progress)[specialist]:
            got = item_score(contract, trace, harness=pair.harness, specialist=scored_as)
            if got.value is None:
                unscored[key] = unscored.get(key, 0) + 1
                reasons.append(got.error or "")
            else:
                values.append(got.value)
        if values:
            means[key] = round(fmean(values), 4)
    total = sum(len(job[3]) for job in jobs)
    if total and sum(unscored.values()) / total > contract.promotion.max_unscored_share:
        raise RatchetError(
            f"re-evaluating the champion: {sum(unscored.values())} of {total} suite items could not be scored "
            f"(over promotion.max_unscored_share {contract.promotion.max_unscored_share:g}): "
            f"{' '.join(reasons[0].split())[:300]}"
        )
    scores = {s: means[s] for s in suites if s in means}
    return {
        "scores": scores,
        "overall": round(fmean(scores.values()), 4) if scores else None,
        "retention": {r.name: means[f"retention {r.name}"] for r in kept if f"retention {r.name}" in means},
        "unscored": unscored,
    }


# -------------------------------------------------------------------------------------------- adoption
def _require_idle(session: Any, lineage: str) -> None:
    """A candidate in flight was begun under the current contract: adopting under it is refused."""

    in_flight = get_in_flight(session=session, lineage=lineage)
    if in_flight is not None:
        raise ConflictError(
            f"generation {in_flight.number} of lineage {lineage!r} is {in_flight.status} under the current "
            "contract: let `ratchet advance` finish it, or `ratchet abandon` it, before adopting a new one"
        )


def _check_file(path: Path, lineage: str) -> tuple[ContractSpec, ContractSpec, dict[str, Path], int, int]:
    """Load and check the file against the lineage (step 1 of the module doc); return the file's contract,
    the lineage's contract, the files the new one names, the champion's id and its contract version's id."""

    new = load_contract(path)
    with session_scope(get_engine()) as session:
        champion = get_champion(session=session, lineage=lineage)
        if champion is None:
            raise NotFoundError(f"lineage {lineage!r} has no champion: run `ratchet init` first")
        _require_idle(session, lineage)
        old = stored_contract(champion.contract_version.spec)
        harness = HarnessSpec.model_validate(champion.harness_version.spec)
        specialists = sorted(a.specialist for a in champion.adapters)
        champion_id, old_id = champion.id, champion.contract_version_id
    if new.name != old.name:
        raise RatchetError(
            f"{path}: contract {new.name!r} is not lineage {lineage!r}'s contract {old.name!r}: a lineage adopts "
            "new versions of its own contract only (start another lineage with `ratchet init --lineage NAME`)"
        )
    if new.version == old.version:
        raise ConflictError(
            f"{path}: lineage {lineage!r} is already on {old.name} version {old.version!r}: a changed contract "
            "needs a new `version`"
        )
    raised = raised_rates(old, new)
    if raised:
        raise RatchetError(
            f"{path}: {'; '.join(raised)} (under {old.name} {old.version}): a lineage's error rates may be kept "
            "or lowered, not raised (the spending ledger counts the tests already made on each suite, not the "
            "rates they spent, so a higher rate would spend more than the budget stated)"
        )
    undeclared = [s for s in specialists if s not in new.specialists]
    if undeclared:
        raise RatchetError(
            f"{path}: specialists {undeclared} of lineage {lineage!r} have no entry in the contract (it declares "
            f"{', '.join(sorted(new.specialists))})"
        )
    files = verify_files(new, path)  # a missing or changed file stops here, named
    # as `ratchet init` checks a contract: each trained specialist judged by a suite or `ungated: true`, no
    # suite repeating an item
    require_counted(new, where=str(path), contract_path=path, specialists=specialists)
    require_compatible(harness, new)
    require_clean_exemplars(harness, new, where=f"the champion's harness {harness.name}", contract_path=path)
    require_clean_tasks(new, contract_path=path)
    return new, old, files, champion_id, old_id


def adopt_contract(
    *,
    contract_path: Path,
    lineage: str = "main",
    actor: str = "user",
    reason: str = "contract adopted",
    release: tuple[str, ...] | list[str] = (),
    progress: Callable[[str, int, int], None] | None = None,
) -> AdoptionResult:
    """Move ``lineage`` to the contract version in ``contract_path`` (see the module doc)."""
    from sqlalchemy import select

    contract_path = Path(contract_path)
    new, old, files, champion_id, old_id = _check_file(contract_path, lineage)
    stored, carried, kept, released = adopted_spec(old, new, release=release)
    spec = stored.model_dump(mode="json")
    file_sha256, stored_sha256 = content_hash(new), content_hash(spec)
    engine = get_engine()
    with session_scope(engine) as session:
        existing = session.scalar(
            select(ContractVersion).where(
                ContractVersion.name == new.name, ContractVersion.version == new.version
            )
        )
        if existing is not None and existing.content_hash != stored_sha256:
            raise ConflictError(
                f"{contract_path}: contract {new.name} version {new.version!r} is already registered with other "
                f"content (stored sha256 {existing.content_hash[:12]}; this lineage would store "
                f"{stored_sha256[:12]}: the file plus {len(carried)} retention suite(s)): give the file a "
                "new `version`"
            )
        cv = register_contract(session=session, name=new.name, version=new.version, spec=spec, actor=actor)
        for file in files.values():  # kept whole, as `ratchet init` keeps them
            store_file(session=session, content=file.read_bytes())
        new_id = cv.id
    done = [0]

    def scoring(n: int) -> None:  # score_experience reports each batch; the caller wants the running total
        done[0] += n
        if progress is not None:
            progress(f"score under {new.name} {new.version}", done[0], 0)

    with session_scope(engine) as session:
        scored = score_experience(session=session, contract_version_id=new_id, progress=scoring)
    with session_scope(engine) as session:
        champion = load_generation(session, champion_id)
        pair, epoch = pair_for_generation(champion), champion.number
    report = (lambda d, t: progress("re-evaluate the champion", d, t)) if progress else None
    evaluated = evaluate_champion(pair, stored, epoch=epoch, progress=report)
    with session_scope(engine) as session:
        hold_lock(session=session, key=f"lineage:{lineage}")
        champion = load_generation(session, champion_id)
        session.refresh(champion)
        if champion.status != "promoted" or champion.contract_version_id != old_id:
            raise ConflictError(
                f"lineage {lineage!r} changed while the champion was re-evaluated (generation {champion.number} "
                f"is {champion.status}, contract version id {champion.contract_version_id}): run the adoption again"
            )
        _require_idle(session, lineage)  # an advance may have begun a candidate meanwhile
        before = evaluation_of(champion)
        record = {
            "from": {"id": old_id, "name": old.name, "version": old.version},
            "to": {"id": new_id, "name": new.name, "version": new.version},
            "file_sha256": file_sha256,
            "stored_sha256": stored_sha256,
            "retention_added": [r.name for r in carried],
            "retention_released": released,
            "kept": kept,
            "previous_scores": before.scores,
            "previous_overall": before.overall,
            "at": utcnow().isoformat(),
            "actor": actor,
            "reason": reason,
        }
        adoption = Adoption.model_validate(
            {**record, "retention": evaluated["retention"], "unscored": evaluated["unscored"]}
        )
        after = before.model_copy(deep=True)
        after.scores, after.overall = evaluated["scores"], evaluated["overall"]
        after.adoptions = [*before.adoptions, adoption]
        champion.evaluation = after.as_stored()
        champion.contract_version_id = new_id
        session.flush()
        audit(
            session=session,
            actor=actor,
            entity="generations",
            entity_id=champion.id,
            action="adopt",
            details={"lineage": lineage, "number": champion.number, **record, "scores": evaluated["scores"],
                     "overall": evaluated["overall"], "scored": scored.scored},
            message=reason,
        )  # fmt: skip
        number = champion.number
    return AdoptionResult(
        lineage=lineage,
        generation=number,
        previous=f"{old.name} {old.version}",
        adopted=f"{new.name} {new.version}",
        contract_version_id=new_id,
        file_sha256=file_sha256,
        stored_sha256=stored_sha256,
        retained=record["retention_added"],
        released=released,
        kept=kept,
        scored=scored.scored,
        scores=evaluated["scores"],
        overall=evaluated["overall"],
        retention=evaluated["retention"],
        previous_overall=record["previous_overall"],
    )
