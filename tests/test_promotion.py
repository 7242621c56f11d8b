"""The promotion gates: sign-flip tests of improvement and non-inferiority, each spent over its attempts on
its suite; retention suites; the KL budget; routing."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

from pipeline.gates.inference import compare_scores
from pipeline.loop.promotion import attempts_of, decide_step, judge, spent_rate
from pipeline.specs.contract import PromotionGates, RoutingSuite

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
    # fresh samples: attempt j on sample e spends 6/(pi^2 e^2) of that, so all samples together keep the rate
    both = sum(GATES.attempt_rate(j, e) for j in range(1, 2001) for e in range(1, 2001))
    assert 0.999 * GATES.false_promotion_rate < both < GATES.false_promotion_rate


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
    # one item of 300 lost: within a 0.05 tolerance (the betting test needs a few hundred items at 0.05: on
    # 100 with one item lost it cannot show non-inferiority at 0.0304; with none lost, p = 0.023)
    champ = {"chat": [1.0] * 150 + [0.0] * 150, "coding": [1.0] * 150 + [0.0] * 150}
    cand = {"chat": [1.0] * 300, "coding": [1.0] * 149 + [0.0] * 151}
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


def _lost(loss: int) -> tuple[dict, dict]:
    """agent clearly better (+0.2); chat lost ``loss`` of 200 items and gained none (p of non-inferiority
    at -0.05: 0.019 for 4)."""
    champ = {"chat": [1.0] * 60 + [0.0] * 140, "agent": [1.0] * 40 + [0.0] * 160}
    cand = {"chat": [1.0] * (60 - loss) + [0.0] * (140 + loss), "agent": [1.0] * 80 + [0.0] * 120}
    return champ, cand


def test_noninferiority_is_spent_over_its_own_attempts():
    """The same small drop passes non-inferiority on the specialist's first attempt on its suite and
    fails on its third, whatever the improvement test's attempt; the reason gives p, rate and attempt."""
    comparison = compare_scores(*_lost(4))
    first = judge(comparison, GATES, attempt=1, attempts={"noninferiority": {"chat": 1, "agent": 1}})
    assert first.promote, first.decision
    assert "no specialist regressed beyond its tolerance" in first.decision
    third = judge(comparison, GATES, attempt=1, attempts={"noninferiority": {"chat": 3, "agent": 1}})
    assert not third.promote
    assert "chat may have regressed beyond its tolerance: 0.300 -> 0.280 (-0.020" in third.decision
    assert "p = 0.017" in third.decision and "betting" in third.decision
    assert f"needs p <= {spent_rate(0.05, 3):.4g}: attempt 3 on its suite" in third.decision
    [row] = [t for t in third.tests if t["test"] == "noninferiority:chat"]
    assert (row["attempt"], row["passed"], row["margin"]) == (3, False, -0.05)
    # an evaluation written before the ledger has only `attempt`: every test uses it
    attempt, attempts = attempts_of({"attempt": 3})
    assert not judge(comparison, GATES, attempt=attempt, attempts=attempts).promote
    assert attempts_of({"attempt": 3, "attempts": {"improvement": 2}})[0] == 2


def test_a_forgotten_retention_suite_blocks_promotion_with_the_reason_in_words_and_numbers():
    champ = {"chat": _scores(0.2, 200, 1), "agent": _scores(0.3, 200, 2)}
    cand = {"chat": _improved(champ["chat"], 0.15, 3), "agent": _improved(champ["agent"], 0.15, 4)}
    comparison = compare_scores(champ, cand)
    kept = {"parent": [1.0] * 60 + [0.0] * 40, "candidate": [1.0] * 60 + [0.0] * 40}
    forgotten = {"parent": [1.0] * 60 + [0.0] * 40, "candidate": [1.0] * 45 + [0.0] * 55}
    suites = {
        "sums": {"specialist": "chat", "max_regression": 0.05, "error_rate": 0.05, **kept},
        "products": {"specialist": "agent", "max_regression": 0.05, "error_rate": 0.05, **forgotten},
    }
    verdict = judge(comparison, GATES, attempt=1, retention=suites, attempts={"retention": {"products": 4}})
    assert not verdict.promote
    assert (
        "retention suite products (agent) may have been forgotten beyond its tolerance: 0.600 -> 0.450 "
        "(-0.150 over 100 items; non-inferiority at -0.050: p = " in verdict.decision
    )
    assert f"needs p <= {spent_rate(0.05, 4):.4g}: attempt 4 on the suite" in verdict.decision
    assert "retention suites kept (sums: p = " in verdict.decision
    # a candidate that keeps both is promoted
    suites["products"].update(kept)
    assert judge(comparison, GATES, attempt=1, retention=suites).promote


def test_the_kl_budget_blocks_a_candidate_above_it_or_unmeasured():
    champ = {"chat": _scores(0.2, 200, 1), "agent": _scores(0.3, 200, 2)}
    cand = {"chat": _improved(champ["chat"], 0.15, 3), "agent": _improved(champ["agent"], 0.15, 4)}
    comparison = compare_scores(champ, cand)
    budget = GATES.model_copy(update={"max_kl_to_base": 0.2})
    near = {"chat": {"kl_to_base": 0.05}, "agent": {"kl_to_base": 0.19}}
    assert judge(comparison, budget, attempt=1, divergence=near).promote
    assert judge(comparison, GATES, attempt=1).promote  # no budget: measured and recorded only
    far = {"chat": {"kl_to_base": 0.05}, "agent": {"kl_to_base": 0.31}}
    verdict = judge(comparison, budget, attempt=1, divergence=far)
    assert not verdict.promote
    assert (
        "KL to the base model above promotion.max_kl_to_base 0.2 nats/token (agent 0.3100)"
        in verdict.decision
    )
    unmeasured = judge(comparison, budget, attempt=1, divergence={"chat": {"kl_to_base": 0.05}})
    assert not unmeasured.promote and "not measured for agent" in unmeasured.decision


def _bench():
    spec = importlib.util.spec_from_file_location("bench_gates", ROOT / "bench" / "gates.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_lineage_rarely_promotes_noise_over_its_life_and_a_real_gain_gets_through():
    """bench/gates.py, smaller: 6 champion epochs x 10 equal-quality attempts at the demo's suite sizes,
    spending per suite (the ledger) vs restarting at every champion; a real +0.03 within 3 attempts."""
    from pipeline.specs.contract import load_contract

    bench = _bench()
    gates = load_contract(ROOT / "contracts" / "demo.yaml").promotion
    false = bench.run(bench.lineage_false, gates, 60, seed=3, jobs=1)
    ledger, reset = false[:, 0].mean(), false[:, 1].mean()
    rate = gates.false_promotion_rate
    # 60 lineages: within two standard errors of the rate (the full bench: 0.03 of 1,000), and several
    # times below the per-champion restart
    assert ledger <= rate + 2 * (rate * (1 - rate) / 60) ** 0.5 and reset > 3 * ledger, (ledger, reset)
    assert bench.run(bench.lineage_power, gates, 60, seed=4, jobs=1, extra=(0,)).mean() >= 0.7


def test_a_kl_that_is_not_a_number_is_not_measured():
    """NaN compares false with any budget: it must not pass ``max_kl_to_base`` (nor infinity)."""
    champ = {"chat": _scores(0.2, 200, 1), "agent": _scores(0.3, 200, 2)}
    cand = {"chat": _improved(champ["chat"], 0.15, 3), "agent": _improved(champ["agent"], 0.15, 4)}
    comparison = compare_scores(champ, cand)
    budget = GATES.model_copy(update={"max_kl_to_base": 0.2})
    for bad in (float("nan"), float("inf")):
        divergence = {"chat": {"kl_to_base": 0.05}, "agent": {"kl_to_base": bad, "tokens": 100}}
        verdict = judge(comparison, budget, attempt=1, divergence=divergence)
        assert not verdict.promote and "not measured for agent (KL" in verdict.decision, verdict.decision


def test_a_masked_vocabulary_entry_adds_nothing_to_the_kl():
    """A token both models give probability 0 (log-probability -inf): 0 log 0 = 0, not NaN."""
    import torch

    from pipeline.gates.divergence import kl_sum

    logits = torch.tensor([[2.0, 0.5, float("-inf")], [0.0, 1.0, float("-inf")]])
    p, q = torch.log_softmax(logits, -1), torch.log_softmax(logits * 0.5, -1)
    expected = float((p[:, :2].exp() * (p[:, :2] - q[:, :2])).sum())  # the two unmasked entries
    assert kl_sum(p, q) == pytest.approx(expected) and expected > 0
    assert kl_sum(p, p) == 0.0


def test_an_evaluated_specialist_with_no_compared_items_is_refused():
    """Every item of one specialist left out (unscored), or its suite empty: it would be missing from the
    comparison and escape every gate; it is refused as having too few held-out items."""
    n = 300
    champ = {s: [0.0] * n for s in ("a", "b", "c", "d")} | {"e": []}
    cand = {s: [1.0] * 60 + [0.0] * (n - 60) for s in ("a", "b", "c", "d")} | {"e": []}
    comparison = compare_scores(champ, cand)
    assert "e" not in comparison.specialists and judge(comparison, GATES, attempt=1).promote
    unscored = judge(comparison, GATES, attempt=1, unscored={"e": 20})
    assert not unscored.promote and "too few held-out items (e has 0 items)" in unscored.decision
    evaluated = judge(comparison, GATES, attempt=1, evaluated={"a", "b", "c", "d", "e"})
    assert not evaluated.promote and "too few held-out items (e has 0 items)" in evaluated.decision
    assert judge(comparison, GATES, attempt=1, evaluated={"a", "b", "c", "d"}).promote


def test_decide_step_refuses_an_evaluated_specialist_missing_from_the_comparison(lineage):
    """Through ``decide_step``: the evaluation held out agent's suite (``suites``) but compared no agent
    item; the candidate is rejected for it, not promoted on the other specialists' gain."""
    from pipeline.loop.advance import begin_candidate
    from pipeline.loop.candidate import AdvanceConfig, load_generation
    from pipeline.registry import get_engine, session_scope

    config = AdvanceConfig(prompts_per_specialist=24, samples_per_prompt=2, min_examples=2, seed=1)
    gen_id = begin_candidate(config=config, owner="test")
    champ = {"chat": [0.0] * 300, "coding": [0.0] * 300}
    cand = {"chat": [1.0] * 60 + [0.0] * 240, "coding": [1.0] * 60 + [0.0] * 240}
    items = {s: {"parent": champ[s], "candidate": cand[s]} for s in champ}
    evaluation = {
        "comparison": compare_scores(champ, cand).to_dict(),
        "items": items,
        "suites": {"chat": "a" * 64, "coding": "b" * 64, "agent": "c" * 64},
        "attempts": {"improvement": 1, "noninferiority": {"chat": 1, "coding": 1, "agent": 1}},
    }
    with session_scope(get_engine()) as s:
        load_generation(s, gen_id).evaluation = evaluation
    outcome = decide_step(generation_id=gen_id, config=config)
    assert outcome["status"] == "rejected", outcome
    assert "too few held-out items (agent has 0 items)" in outcome["decision"]
