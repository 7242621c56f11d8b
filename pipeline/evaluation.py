"""Comparing a candidate with its champion on the held-out suites, and the contract's promotion gates.

Both pairs are evaluated in the same run on the same items, so the comparison is paired: the
confidence interval of each delta comes from a paired bootstrap (items resampled jointly), and the
overall score is the mean of the per-specialist means (each specialist counts the same).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from statistics import fmean
from typing import Any

from pipeline.contract import PromotionGates


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
