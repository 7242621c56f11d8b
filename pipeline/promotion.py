"""Promotion: the contract's gates turn the candidate's evaluation into a verdict; promote or reject.

``judge(comparison, gates, attempt=k, router=..., parent_router=...)`` promotes only when all hold:

- **improvement**: the overall delta beats ``min_improvement`` in a one-sided paired t test at the rate
  attempt ``k`` may spend (``PromotionGates.attempt_rate``: ``false_promotion_rate * 6 / (pi**2 k**2)``,
  which sums to ``false_promotion_rate`` over every attempt against the same champion);
- **no regression**: for every specialist, the lower ``1 - regression_error_rate`` confidence bound of its
  delta is above minus its tolerance (a non-inferiority test per specialist and attempt);
- **enough items**: every specialist has ``min_heldout_samples`` held-out items scored on both pairs;
- **routing**: the router's accuracy on the contract's routing suite has not dropped below the parent's
  by more than ``routing.max_accuracy_drop``.

The comparison is made of the items scored on both pairs: the evaluation left out those a scorer could not
score on either side (``evaluation["unscored"]``, at most ``promotion.max_unscored_share`` of them, or the
evaluation step failed), and the verdict says how many. Its reasons say all of it in words and numbers.
``decide_step`` applies it. The registry is the truth about the champion: MLflow's ``champion`` alias of
each specialist's adapter moves only after the registry's commit (``sync_champion_aliases``), and where
that fails (MLflow unreachable between the two) the next sync (``ratchet advance``, ``ratchet
promote``/``rollback``, ``ratchet sync-aliases``) repairs it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipeline.candidate import AdvanceConfig, Progress, load_generation, mark_step
from pipeline.errors import RatchetError

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from pipeline.contract import PromotionGates, RoutingSuite
    from pipeline.evaluation import Comparison
    from pipeline.tracking import Tracker


@dataclass
class Verdict:
    """The gates' decision, in words and numbers."""

    promote: bool
    attempt: int
    rate: float  # the error rate this attempt's improvement test used
    lower: float  # the overall delta's one-sided lower confidence bound at that rate
    reasons: list[str] = field(default_factory=list)

    @property
    def decision(self) -> str:
        return ("promote: " if self.promote else "reject: ") + "; ".join(self.reasons)


def t_quantile(q: float, df: float) -> float:
    """The ``q`` quantile of Student's t with ``df`` degrees of freedom (normal for infinite ``df``)."""
    from scipy.stats import norm, t

    return float(norm.ppf(q) if math.isinf(df) else t.ppf(q, df))


def judge(
    comparison: Comparison,
    gates: PromotionGates,
    *,
    attempt: int,
    routing: RoutingSuite | None = None,
    router: dict[str, Any] | None = None,
    parent_router: dict[str, Any] | None = None,
    unscored: dict[str, int] | None = None,
) -> Verdict:
    """Apply the promotion gates to a paired comparison (see the module doc). ``unscored``: per specialist,
    the held-out items the evaluation left out of the comparison (named in the reasons; not a gate here)."""
    rate = gates.attempt_rate(attempt)
    lower = comparison.delta - t_quantile(1 - rate, comparison.df) * comparison.se
    verdict = Verdict(promote=True, attempt=attempt, rate=rate, lower=lower)
    reasons = verdict.reasons
    if not comparison.specialists:
        verdict.promote = False
        reasons.append("no held-out items")
        return verdict
    small = [
        f"{s} has {c.n} items < {gates.min_heldout_samples}"
        for s, c in comparison.specialists.items()
        if c.n < gates.min_heldout_samples
    ]
    if small:
        verdict.promote = False
        reasons.append("too few held-out items (" + ", ".join(small) + ")")
    bound = f"{100 * (1 - rate):.2f}% lower bound {lower:+.3f}"
    head = (
        f"overall {comparison.candidate_overall:.3f} vs champion {comparison.champion_overall:.3f}: "
        f"delta {comparison.delta:+.3f} ({bound}; attempt {attempt} since the last promotion, test at "
        f"{rate:.4f} of the lineage's {gates.false_promotion_rate:g})"
    )
    reasons.append(head)
    if unscored and (left_out := sum(unscored.values())):
        where = ", ".join(f"{s} {n}" for s, n in sorted(unscored.items()) if n)
        reasons.append(f"{left_out} held-out items left out, unscored on a pair ({where})")
    if lower <= gates.min_improvement:
        verdict.promote = False
        need = (
            "above 0"
            if gates.min_improvement == 0
            else f"above the minimum improvement {gates.min_improvement:+.3f}"
        )
        reasons.append(f"the improvement is not significant: the lower bound must be {need}")
    z = 1 - gates.regression_error_rate
    for s, c in comparison.specialists.items():
        tol = gates.tolerance(s)
        floor = c.delta - t_quantile(z, max(1, c.n - 1)) * c.se
        if floor <= -tol:
            verdict.promote = False
            reasons.append(
                f"{s} may have regressed beyond its tolerance: {c.champion:.3f} -> {c.candidate:.3f} "
                f"({c.delta:+.3f}; {100 * z:g}% lower bound {floor:+.3f} is not above -{tol:.3f})"
            )
    if routing is not None and router is not None and parent_router is not None:
        drop = parent_router["accuracy"] - router["accuracy"]
        if drop > routing.max_accuracy_drop:
            verdict.promote = False
            reasons.append(
                f"router accuracy fell {parent_router['accuracy']:.3f} -> {router['accuracy']:.3f} on the "
                f"routing suite (tolerance {routing.max_accuracy_drop:.3f})"
            )
    return verdict


def decide_step(
    *,
    generation_id: int,
    config: AdvanceConfig,
    tracker: Tracker | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Apply the gates' verdict: promote or reject in the registry; then MLflow's champion aliases follow."""
    from pipeline.candidate import contract_of
    from pipeline.evaluation import Comparison
    from pipeline.registry import (
        Generation,
        get_champion,
        get_engine,
        promote_generation,
        session_scope,
        set_generation_status,
    )
    from pipeline.registry.db import hold_lock

    with session_scope(get_engine()) as session:
        gen = load_generation(session, generation_id)
        # Champion moves of the lineage wait until this decision commits (a rollback cannot slip in between
        # the check below and the promotion), and the champion is read after taking the lock.
        hold_lock(session=session, key=f"lineage:{gen.lineage}")
        evaluation = gen.evaluation or {}
        contract = contract_of(gen)
        champion = get_champion(session=session, lineage=gen.lineage)
        if champion is None or champion.id != gen.parent_id:
            # An operator moved the champion (a rollback, a manual promotion) while this candidate was being
            # built: it was compared with its parent only, never with the champion it would replace.
            parent = session.get(Generation, gen.parent_id) if gen.parent_id is not None else None
            now = f"generation {champion.number}" if champion else "none"
            promote = False
            decision = (
                f"reject: its parent is no longer the champion (built from generation "
                f"{parent.number if parent else '-'}; the champion is now {now}): it was never compared "
                "with the champion it would replace"
            )
        elif "comparison" in evaluation:
            verdict = judge(
                Comparison.from_dict(evaluation["comparison"]),
                contract.promotion,
                attempt=int(evaluation.get("attempt", 1)),
                routing=contract.routing,
                router=evaluation.get("router"),
                parent_router=evaluation.get("parent_router"),
                unscored=evaluation.get("unscored"),
            )
            promote, decision = verdict.promote, verdict.decision
            gen.evaluation = {
                **evaluation,
                "verdict": {
                    "promote": promote,
                    "rate": verdict.rate,
                    "lower": verdict.lower,
                    "reasons": verdict.reasons,
                },
            }
        else:
            promote, decision = False, "reject: not evaluated"
        if promote:
            promote_generation(session=session, generation=gen, reason=decision, actor="advance")
            status = "promoted"
        else:
            set_generation_status(
                session=session, generation=gen, status="rejected", reason=decision, actor="advance"
            )
            status = "rejected"
        mark_step(session, gen, "decide", {"status": status})
        outcome = {
            "generation": gen.number,
            "status": status,
            "decision": decision,
            "overall": evaluation.get("overall"),
            "parent_overall": evaluation.get("parent_overall"),
        }
    if promote:  # after the commit: the registry decided, the aliases follow (or the next sync repairs them)
        try:
            sync_champion_aliases(lineage=config.lineage, tracker=tracker)
        except RatchetError as exc:
            log.warning("%s", exc)
            outcome["aliases"] = str(exc)
    return outcome


def sync_champion_aliases(
    *, lineage: str, tracker: Tracker | Callable[[], Tracker] | None, engine: Engine | None = None
) -> int:
    """Point each specialist's MLflow ``champion`` alias at the registry champion's adapter (or remove it
    where the champion has none registered); returns how many aliases were set. Idempotent: run after every
    champion move's commit, and again at the next advance in case MLflow was unreachable the first time.

    ``tracker`` may be a function that makes it (opening MLflow can fail too, and is reported the same way).
    An MLflow failure is one ``RatchetError`` saying that the registry has moved and how to repair."""
    from pipeline.registry import get_champion, get_engine, session_scope
    from pipeline.tracking import TrackingUnavailable, registered_model_name

    if tracker is None:
        return 0
    with session_scope(engine or get_engine()) as session:
        champion = get_champion(session=session, lineage=lineage)
        if champion is None:
            return 0
        number = champion.number
        wanted = {
            slot.specialist: slot.adapter.mlflow_model_version if slot.adapter is not None else None
            for slot in champion.adapters
        }
    done = 0
    try:
        if callable(tracker):
            tracker = tracker()
        for specialist, version in sorted(wanted.items()):
            name = registered_model_name(lineage, specialist)
            if version:
                tracker.set_alias(name, "champion", version)
                done += 1
            else:
                tracker.delete_alias(name, "champion")
    except Exception as exc:  # MLflow's errors (HTTP, store) are many types; none may pass as a traceback
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        reason = reason.removeprefix("error: ")
        raise RatchetError(
            f"generation {number} is the champion of {lineage!r} in the registry, but MLflow's champion "
            f"aliases could not be moved ({reason[:200]}): `ratchet sync-aliases --lineage {lineage}` (or the "
            "next `ratchet advance`) moves them once MLflow is reachable"
        ) from (exc if isinstance(exc, TrackingUnavailable) else None)
    return done
