"""Paired comparison statistics of two pairs on the same held-out items."""

from __future__ import annotations

import math
import random

import pytest

from pipeline.evaluation import Comparison, compare_scores


def _scores(p, n, seed):
    rng = random.Random(seed)
    return [1.0 if rng.random() < p else 0.0 for _ in range(n)]


def test_paired_means_deltas_and_standard_errors():
    champ = {"chat": [1.0, 0.0, 0.0, 1.0], "agent": [0.0, 0.0, 1.0, 1.0]}
    cand = {"chat": [1.0, 1.0, 0.0, 1.0], "agent": [0.0, 1.0, 1.0, 0.0]}
    c = compare_scores(champ, cand)
    assert c.specialists["chat"].delta == pytest.approx(0.25) and c.specialists["agent"].delta == 0.0
    # chat differences [0, 1, 0, 0]: sample variance 0.25, SE sqrt(0.25 / 4)
    assert c.specialists["chat"].se == pytest.approx(0.25)
    assert c.delta == pytest.approx(0.125) and c.candidate_overall - c.champion_overall == pytest.approx(
        0.125
    )
    # overall SE: sqrt(se_chat^2 + se_agent^2) / 2 specialists
    agent_se = c.specialists["agent"].se
    assert c.se == pytest.approx(math.sqrt(0.25**2 + agent_se**2) / 2)
    assert Comparison.from_dict(c.to_dict()) == c


def test_identical_results_have_no_variance_and_mismatched_items_are_refused():
    same = {"chat": _scores(0.4, 50, 1)}
    c = compare_scores(same, same)
    assert c.delta == 0.0 and c.se == 0.0 and math.isinf(c.df)
    with pytest.raises(ValueError, match="specialists differ"):
        compare_scores({"chat": [1.0]}, {"agent": [1.0]})
    with pytest.raises(ValueError, match="3 champion items vs 2"):
        compare_scores({"chat": [1.0] * 3}, {"chat": [1.0] * 2})
