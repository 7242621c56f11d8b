"""Paired bootstrap comparison and the contract's promotion gates."""

from __future__ import annotations

import random

from pipeline.contract import PromotionGates
from pipeline.evaluation import compare_pairs

GATES = PromotionGates(
    min_improvement=0.01,
    require_significant=True,
    max_regression=0.02,
    min_heldout_samples=20,
    bootstrap_samples=300,
)


def _scores(p, n, seed):
    rng = random.Random(seed)
    return [1.0 if rng.random() < p else 0.0 for _ in range(n)]


def test_clear_improvement_is_promoted():
    champ = {"chat": _scores(0.2, 200, 1), "agent": _scores(0.3, 200, 2)}
    cand = {
        "chat": [max(v, w) for v, w in zip(champ["chat"], _scores(0.3, 200, 3), strict=True)],
        "agent": [max(v, w) for v, w in zip(champ["agent"], _scores(0.3, 200, 4), strict=True)],
    }
    result = compare_pairs(champ, cand, gates=GATES)
    assert result.promote, result.decision
    assert result.ci_low > 0 and result.delta > 0.1
    assert result.decision.startswith("promote: overall")


def test_degraded_candidate_is_rejected_with_reasons():
    champ = {"chat": _scores(0.5, 100, 1), "agent": _scores(0.5, 100, 2)}
    worse = {"chat": [0.0] * 100, "agent": champ["agent"]}
    result = compare_pairs(champ, worse, gates=GATES)
    assert not result.promote
    assert "chat regressed" in result.decision and "below the minimum improvement" in result.decision


def test_noise_is_not_significant_and_small_suites_are_refused():
    champ = {"chat": _scores(0.5, 30, 1)}
    cand = {"chat": list(champ["chat"])}
    cand["chat"][0], cand["chat"][1] = 1.0, 1.0  # a tiny, noisy gain
    result = compare_pairs(champ, cand, gates=GATES.model_copy(update={"min_improvement": 0.0}))
    assert not result.promote and "not significant" in result.decision
    small = compare_pairs({"chat": [0.0] * 5}, {"chat": [1.0] * 5}, gates=GATES)
    assert not small.promote and "too few held-out samples" in small.decision


def test_specialist_tolerance_override():
    champ = {"chat": [1.0] * 50 + [0.0] * 50, "coding": [1.0] * 50 + [0.0] * 50}
    cand = {"chat": [1.0] * 100, "coding": [1.0] * 49 + [0.0] * 51}
    gates = GATES.model_copy(update={"max_regression_per_specialist": {"coding": 0.0}})
    result = compare_pairs(champ, cand, gates=gates)
    assert not result.promote and "coding regressed" in result.decision
    loose = gates.model_copy(update={"max_regression_per_specialist": {"coding": 0.05}})
    assert compare_pairs(champ, cand, gates=loose).promote
