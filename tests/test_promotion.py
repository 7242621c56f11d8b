"""The promotion gates: an attempt-aware improvement test, non-inferiority per specialist, routing."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

from pipeline.contract import PromotionGates, RoutingSuite
from pipeline.evaluation import compare_scores
from pipeline.promotion import judge

ROOT = Path(__file__).resolve().parent.parent
GATES = PromotionGates(max_regression=0.05, min_heldout_samples=20)


def _scores(p, n, seed):
    rng = random.Random(seed)
    return [1.0 if rng.random() < p else 0.0 for _ in range(n)]


def _improved(champ, p, seed):
    return [max(v, w) for v, w in zip(champ, _scores(p, len(champ), seed), strict=True)]


def test_alpha_spending_sums_to_the_lineage_rate():
    rates = [GATES.attempt_rate(k) for k in range(1, 100_001)]
    assert rates[0] == pytest.approx(0.05 * 6 / 3.14159265**2, rel=1e-6)
    assert sum(rates) < GATES.false_promotion_rate and sum(rates) > 0.9999 * GATES.false_promotion_rate
    assert all(a > b for a, b in zip(rates, rates[1:], strict=False))


def test_clear_improvement_is_promoted_and_the_same_gain_needs_more_on_later_attempts():
    champ = {"chat": _scores(0.2, 200, 1), "agent": _scores(0.3, 200, 2)}
    cand = {"chat": _improved(champ["chat"], 0.15, 3), "agent": _improved(champ["agent"], 0.15, 4)}
    first = judge(compare_scores(champ, cand), GATES, attempt=1)
    assert first.promote, first.decision
    assert first.decision.startswith("promote: overall") and "attempt 1" in first.decision
    later = judge(compare_scores(champ, cand), GATES, attempt=40)
    assert later.rate < first.rate / 1000 and later.lower < first.lower


def test_degraded_candidate_is_rejected_with_reasons():
    champ = {"chat": _scores(0.5, 100, 1), "agent": _scores(0.5, 100, 2)}
    worse = {"chat": [0.0] * 100, "agent": champ["agent"]}
    verdict = judge(compare_scores(champ, worse), GATES, attempt=1)
    assert not verdict.promote
    assert "chat may have regressed" in verdict.decision and "not significant" in verdict.decision


def test_noise_is_not_significant_and_small_suites_are_refused():
    champ = {"chat": _scores(0.5, 30, 1)}
    cand = {"chat": list(champ["chat"])}
    cand["chat"][0], cand["chat"][1] = 1.0, 1.0  # a tiny, noisy gain
    assert not judge(compare_scores(champ, cand), GATES, attempt=1).promote
    small = judge(compare_scores({"chat": [0.0] * 5}, {"chat": [1.0] * 5}), GATES, attempt=1)
    assert not small.promote and "too few held-out items" in small.decision


def test_a_specialist_within_noise_of_its_tolerance_blocks_promotion():
    champ = {"chat": [1.0] * 50 + [0.0] * 50, "coding": [1.0] * 50 + [0.0] * 50}
    cand = {"chat": [1.0] * 100, "coding": [1.0] * 49 + [0.0] * 51}
    strict = GATES.model_copy(update={"max_regression_per_specialist": {"coding": 0.0}})
    verdict = judge(compare_scores(champ, cand), strict, attempt=1)
    assert not verdict.promote and "coding may have regressed" in verdict.decision
    loose = GATES.model_copy(update={"max_regression_per_specialist": {"coding": 0.05}})
    assert judge(compare_scores(champ, cand), loose, attempt=1).promote


def test_a_router_that_got_worse_blocks_promotion():
    champ = {"chat": _scores(0.2, 200, 1)}
    cand = {"chat": _improved(champ["chat"], 0.3, 3)}
    suite = RoutingSuite(prompts={"chat": ["what is 2 plus 2"]}, max_accuracy_drop=0.05)
    comparison = compare_scores(champ, cand)
    ok = judge(
        comparison,
        GATES,
        attempt=1,
        routing=suite,
        router={"accuracy": 0.9},
        parent_router={"accuracy": 0.92},
    )
    assert ok.promote
    worse = judge(
        comparison, GATES, attempt=1, routing=suite, router={"accuracy": 0.8}, parent_router={"accuracy": 0.9}
    )
    assert not worse.promote and "router accuracy fell 0.900 -> 0.800" in worse.decision


def test_the_verdict_says_how_many_items_were_left_out_unscored():
    """The comparison holds only the items scored on both pairs; the verdict names the ones left out."""
    champ = {"chat": _scores(0.2, 200, 1), "agent": _scores(0.3, 200, 2)}
    cand = {"chat": _improved(champ["chat"], 0.15, 3), "agent": _improved(champ["agent"], 0.15, 4)}
    verdict = judge(compare_scores(champ, cand), GATES, attempt=1, unscored={"chat": 3, "agent": 1})
    assert (
        verdict.promote
        and "4 held-out items left out, unscored on a pair (agent 1, chat 3)" in verdict.decision
    )
    assert "left out" not in judge(compare_scores(champ, cand), GATES, attempt=1, unscored={}).decision


def _bench():
    spec = importlib.util.spec_from_file_location("bench_gates", ROOT / "bench" / "gates.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_repeated_attempts_rarely_promote_noise_and_a_real_gain_gets_through():
    """bench/gates.py, smaller: equal-quality candidates against one champion over 20 attempts, and a real
    +0.03 gain within 3 attempts, at the demo's suite sizes; the fixed-rate gate is the control."""
    from pipeline.contract import load_contract

    bench = _bench()
    gates = load_contract(ROOT / "contracts" / "demo.yaml").promotion
    false = bench.simulate(gates, lineages=150, attempts=20, gain=0.0, seed=3)
    assert false <= gates.false_promotion_rate
    fixed = bench.simulate(gates, lineages=150, attempts=20, gain=0.0, seed=3, spend=False)
    assert fixed > 3 * gates.false_promotion_rate  # without spending, repeated testing promotes noise
    assert bench.simulate(gates, lineages=150, attempts=3, gain=0.03, seed=4) >= 0.8
