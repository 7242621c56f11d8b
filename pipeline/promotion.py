"""Promotion: the contract's gates turn the candidate's evaluation into a verdict; promote or reject.

``judge(comparison, gates, attempt=k, router=..., parent_router=...)`` promotes only when all hold:

- **improvement**: the overall delta beats ``min_improvement`` in a one-sided paired t test at the rate
  attempt ``k`` may spend (``PromotionGates.attempt_rate``: ``false_promotion_rate * 6 / (pi**2 k**2)``,
  which sums to ``false_promotion_rate`` over every attempt against the same champion);
- **no regression**: for every specialist, the lower ``1 - regression_error_rate`` confidence bound of its
  delta is above minus its tolerance (a non-inferiority test per specialist and attempt);
- **enough items**: every specialist has ``min_heldout_samples`` held-out items;
- **routing**: the router's accuracy on the contract's routing suite has not dropped below the parent's
  by more than ``routing.max_accuracy_drop``.

The verdict's reasons say all of it in words and numbers. ``decide_step`` applies it: the registry's
champion and the MLflow alias ``champion`` of each adapter move together in one transaction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipeline.candidate import AdvanceConfig, Progress, load_generation, mark_step

if TYPE_CHECKING:
    from pipeline.contract import PromotionGates, RoutingSuite
    from pipeline.evaluation import Comparison
    from pipeline.registry import Generation
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
) -> Verdict:
    """Apply the promotion gates to a paired comparison (see the module doc)."""
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
    """Apply the gates' verdict: promote (registry champion and MLflow aliases in one step) or reject."""
    from pipeline.candidate import contract_of
    from pipeline.evaluation import Comparison
    from pipeline.registry import get_engine, promote_generation, session_scope, set_generation_status
    from pipeline.tracking import registered_model_name

    with session_scope(get_engine()) as session:
        gen = load_generation(session, generation_id)
        evaluation = gen.evaluation or {}
        contract = contract_of(gen)
        if "comparison" in evaluation:
            verdict = judge(
                Comparison.from_dict(evaluation["comparison"]),
                contract.promotion,
                attempt=int(evaluation.get("attempt", 1)),
                routing=contract.routing,
                router=evaluation.get("router"),
                parent_router=evaluation.get("parent_router"),
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
            if tracker is not None:  # inside the transaction: an alias failure rolls the promotion back
                for slot in gen.adapters:
                    if slot.adapter is not None and slot.adapter.mlflow_model_version:
                        tracker.set_alias(
                            registered_model_name(config.lineage, slot.specialist),
                            "champion",
                            slot.adapter.mlflow_model_version,
                        )
            status = "promoted"
        else:
            set_generation_status(
                session=session, generation=gen, status="rejected", reason=decision, actor="advance"
            )
            status = "rejected"
        mark_step(session, gen, "decide", {"status": status})
        gen.lease_owner, gen.lease_expires_at = None, None
        return {
            "generation": gen.number,
            "status": status,
            "decision": decision,
            "overall": evaluation.get("overall"),
            "parent_overall": evaluation.get("parent_overall"),
        }


def move_champion_aliases(gen: Generation, lineage: str, tracker: Tracker | None) -> None:
    """Point each specialist's MLflow ``champion`` alias at ``gen``'s adapter (or remove it): after a manual
    promotion or a rollback, inside the registry's transaction, so a failure here undoes both."""
    from pipeline.tracking import registered_model_name

    if tracker is None:
        return
    for slot in gen.adapters:
        name = registered_model_name(lineage, slot.specialist)
        if slot.adapter is not None and slot.adapter.mlflow_model_version:
            tracker.set_alias(name, "champion", slot.adapter.mlflow_model_version)
        else:
            tracker.delete_alias(name, "champion")
