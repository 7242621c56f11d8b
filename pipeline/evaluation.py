"""Comparing a candidate with its champion on the held-out suites, and the contract's promotion gates.

Both pairs are evaluated in the same run on the same items, so the comparison is paired: the
confidence interval of each delta comes from a paired bootstrap (items resampled jointly), and the
overall score is the mean of the per-specialist means (each specialist counts the same).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from statistics import fmean
from typing import TYPE_CHECKING, Any

from pipeline.candidate import AdvanceConfig, Progress, contract_of, load_generation, mark_step
from pipeline.contract import PromotionGates
from pipeline.errors import RatchetError

if TYPE_CHECKING:
    from pipeline.contract import ContractSpec
    from pipeline.harness import HarnessSpec
    from pipeline.pair import PairSpec


@dataclass
class SpecialistComparison:
    """One specialist's held-out result for both pairs."""

    specialist: str
    n: int
    champion: float
    candidate: float
    delta: float
    ci_low: float
    ci_high: float


@dataclass
class ComparisonResult:
    """The paired comparison and the gate decision, in words and numbers."""

    specialists: dict[str, SpecialistComparison]
    champion_overall: float
    candidate_overall: float
    delta: float
    ci_low: float
    ci_high: float
    confidence: float
    promote: bool
    reasons: list[str] = field(default_factory=list)

    @property
    def decision(self) -> str:
        verdict = "promote" if self.promote else "reject"
        return f"{verdict}: " + "; ".join(self.reasons)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["decision"] = self.decision
        return out


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def paired_bootstrap(
    pairs: dict[str, list[tuple[float, float]]], *, samples: int, confidence: float, seed: int
) -> tuple[dict[str, tuple[float, float]], tuple[float, float]]:
    """Percentile intervals of (candidate - champion) per specialist and for the macro-averaged overall.

    ``pairs[specialist]`` holds (champion, candidate) scores of the same items. Items are resampled
    within each specialist (stratified), jointly for both pairs.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    per = {}
    for s, items in pairs.items():
        deltas = np.array([c - p for p, c in items], dtype=np.float64)
        picks = rng.integers(0, len(deltas), size=(samples, len(deltas)))  # one resample per row
        per[s] = deltas[picks].mean(axis=1)
    overall = np.mean(np.stack(list(per.values())), axis=0)
    alpha = (1 - confidence) / 2
    bounds = {}
    for s, values in per.items():
        ordered = sorted(values.tolist())
        bounds[s] = (_quantile(ordered, alpha), _quantile(ordered, 1 - alpha))
    ordered = sorted(overall.tolist())
    return bounds, (_quantile(ordered, alpha), _quantile(ordered, 1 - alpha))


def compare_pairs(
    champion: dict[str, list[float]], candidate: dict[str, list[float]], *, gates: PromotionGates
) -> ComparisonResult:
    """Compare per-item held-out scores (same items, same order) and apply the promotion gates."""
    if set(champion) != set(candidate):
        raise ValueError(f"specialists differ: {sorted(champion)} vs {sorted(candidate)}")
    pairs = {}
    for s in sorted(champion):
        if len(champion[s]) != len(candidate[s]):
            raise ValueError(f"{s}: {len(champion[s])} champion items vs {len(candidate[s])} candidate items")
        if champion[s]:
            pairs[s] = list(zip(champion[s], candidate[s], strict=True))
    reasons: list[str] = []
    promote = True
    if not pairs:
        return ComparisonResult({}, 0.0, 0.0, 0.0, 0.0, 0.0, gates.confidence, False, ["no held-out items"])
    bounds, (lo, hi) = paired_bootstrap(
        pairs, samples=gates.bootstrap_samples, confidence=gates.confidence, seed=gates.seed
    )
    specialists = {}
    for s, items in pairs.items():
        champ = fmean(p for p, _ in items)
        cand = fmean(c for _, c in items)
        specialists[s] = SpecialistComparison(s, len(items), champ, cand, cand - champ, *bounds[s])
    champ_overall = fmean(c.champion for c in specialists.values())
    cand_overall = fmean(c.candidate for c in specialists.values())
    delta = cand_overall - champ_overall
    pct = round(gates.confidence * 100)
    small = [
        f"{s} has {c.n} items < {gates.min_heldout_samples}"
        for s, c in specialists.items()
        if c.n < gates.min_heldout_samples
    ]
    if small:
        promote = False
        reasons.append("too few held-out samples (" + ", ".join(small) + ")")
    if delta < gates.min_improvement or delta <= 0:
        promote = False
        reasons.append(
            f"overall {cand_overall:.3f} vs champion {champ_overall:.3f}: delta {delta:+.3f} is below "
            f"the minimum improvement {max(gates.min_improvement, 0):+.3f}"
        )
    else:
        reasons.append(
            f"overall {cand_overall:.3f} vs champion {champ_overall:.3f}: delta {delta:+.3f} "
            f"({pct}% CI {lo:+.3f}..{hi:+.3f})"
        )
    if gates.require_significant and delta > 0 and lo <= 0:
        promote = False
        reasons.append(f"the improvement is not significant: {pct}% CI {lo:+.3f}..{hi:+.3f} includes 0")
    for s, c in specialists.items():
        tol = gates.tolerance(s)
        if c.delta < -tol:
            promote = False
            reasons.append(
                f"{s} regressed {c.champion:.3f} -> {c.candidate:.3f} ({c.delta:+.3f}, tolerance {tol:.3f})"
            )
    return ComparisonResult(
        specialists, champ_overall, cand_overall, delta, lo, hi, gates.confidence, promote, reasons
    )


def score_pair(
    pair: PairSpec,
    items: dict[str, list[dict[str, Any]]],
    contract: ContractSpec,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, list[float]]:
    """Greedy answers of the pair on the items, each trace's total under the contract (unscorable = 0)."""
    from pipeline.clock import CLOCK
    from pipeline.pair import answer_items
    from pipeline.scoring import score_trace

    answered = answer_items(pair, items, num_samples=1, temperature=0.0, progress=progress)
    out: dict[str, list[float]] = {}
    with CLOCK.measure("score"):
        for specialist, traces in answered.items():
            values = []
            for (trace,) in traces:
                result = score_trace(contract, trace, harness=pair.harness, specialist=specialist)
                values.append(float(result.total or 0.0))
            out[specialist] = values
    return out


def evaluate_step(
    *, generation_id: int, config: AdvanceConfig, progress: Progress | None = None
) -> dict[str, Any]:
    """Score the champion and the candidate on the contract's held-out suites in the same run; compare."""
    from pipeline.heldout import resolve_suites
    from pipeline.pair import pair_for_generation
    from pipeline.registry import get_engine, session_scope, set_generation_status

    engine = get_engine()
    with session_scope(engine) as session:
        gen = load_generation(session, generation_id)
        if gen.status in ("candidate", "training"):
            set_generation_status(session=session, generation=gen, status="evaluating")
        contract = contract_of(gen)
        candidate, champion = (
            pair_for_generation(gen),
            pair_for_generation(load_generation(session, gen.parent_id)),
        )
    # the generation's specialists only (a lineage may serve a subset of the contract's specialists)
    suites = {s: items for s, items in resolve_suites(contract).items() if s in candidate.adapters}
    if not suites:
        raise RatchetError("the contract declares no held-out suites: nothing to evaluate a candidate on")
    report = (lambda who: lambda d, t: progress(f"evaluate {who}", d, t)) if progress else (lambda who: None)
    champ_scores = score_pair(champion, suites, contract, progress=report("champion"))
    cand_scores = score_pair(candidate, suites, contract, progress=report("candidate"))
    comparison = compare_pairs(champ_scores, cand_scores, gates=contract.promotion)
    evaluation = {
        "scores": {s: round(c.candidate, 4) for s, c in comparison.specialists.items()},
        "overall": round(comparison.candidate_overall, 4),
        "parent_scores": {s: round(c.champion, 4) for s, c in comparison.specialists.items()},
        "parent_overall": round(comparison.champion_overall, 4),
        "comparison": comparison.to_dict(),
    }
    evaluation["router"], classifier = measure_routing(candidate.harness, generation_id=generation_id)
    with session_scope(engine) as session:
        gen = load_generation(session, generation_id)
        gen.evaluation = evaluation
        if classifier is not None:
            gen.state = {**(gen.state or {}), "router_classifier": classifier}
        parent = load_generation(session, gen.parent_id)
        if not (parent.evaluation or {}).get("scores"):  # generation 0 gets its held-out scores too
            parent.evaluation = {
                **(parent.evaluation or {}),
                "scores": evaluation["parent_scores"],
                "overall": evaluation["parent_overall"],
            }
        mark_step(session, gen, "evaluate", {"promote": comparison.promote, "decision": comparison.decision})
    return evaluation


def measure_routing(
    harness: HarnessSpec, *, generation_id: int, items_per_family: int = 50
) -> tuple[dict[str, Any], Any]:
    """Router accuracy on the labelled held-out turns, recorded per generation.

    In ``learned``/``hybrid`` mode a small classifier is first fitted on the lineage's experience that
    scored at least the selection threshold, labelled with the specialist that served it (held-out
    items never among them); it is returned (as a dict) to be stored with the generation for serving.
    """
    from pipeline.curation import load_candidates
    from pipeline.registry import get_engine, session_scope
    from pipeline.serving.routereval import (
        fit_router_classifier,
        heldout_routing_items,
        measure_router,
        routing_items,
    )

    items = heldout_routing_items(items_per_family)
    if harness.routing.mode == "signals":
        return measure_router(harness, items), None
    with session_scope(get_engine()) as session:
        gen = load_generation(session, generation_id)
        threshold = contract_of(gen).selection.min_score
        candidates = load_candidates(session=session, contract_version_id=gen.contract_version_id)
    traces = [
        {"messages": c.messages, "metadata": {"specialist": c.specialist}}
        for c in candidates
        if (c.score or 0) >= threshold and c.metadata.get("split") != "heldout" and c.source != "evaluation"
    ]
    if not traces:
        return measure_router(harness, items), None
    classifier = fit_router_classifier(routing_items(traces), labels=sorted(harness.specialists))
    return measure_router(harness, items, classifier=classifier), classifier.to_dict()
