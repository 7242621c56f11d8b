"""How often the promotion gate is fooled over a lineage's life, and how fast it promotes a real gain,
simulated at the demo's suite sizes with the real gate (``pipeline.loop.promotion.judge``: sign-flip
improvement test, betting non-inferiority tests).

    python bench/gates.py [--lineages 1000] [--jobs 2]      # --lineages 200: a quick run

Item model: per specialist the demo contract's held-out suite (its size: 1,000 since the demo draws fresh
samples; 300 before) of items right or wrong; a champion's results are drawn at the demo champion's
accuracy, a candidate's agree with the champion's except on a share of items that flip (measured on the
demo: FLIPS), with a true gain added per specialist.
Rows (every figure a share of simulated lineages, +- its binomial standard error):

1. **False promotions over a lineage's life**: 6 champion epochs x 10 equal-quality attempts each (the
   champion changes every epoch: as if real promotions happened between). *Ledger*: the attempt number
   keeps counting across epochs (the suite is the same: the registry's spending ledger); *reset*: it
   restarts every epoch (the per-champion counter before issue 23; with the t test the issue measured
   0.253 +- 0.049 for that scheme). Target: the ledger's figure <= the contract's false_promotion_rate.
   *Fresh*: a new sample per epoch (``fresh: true``): attempts restart on each sample, and the improvement
   test on the e-th sample spends 6/(pi^2 e^2) of the rate besides (``PromotionGates.attempt_rate``).
2. **Power**: a real +0.03 (every specialist) promoted within 3 attempts at epoch 1, after 50 attempts
   spent on the suite (no fresh draws: attempts 51-53), and with fresh draws on the first sample and on the
   6th (attempts 1-3 on it, the improvement test at 6/(pi^2 36) of its first-sample rate).
3. **Non-inferiority spent**: a candidate that truly lost exactly its tolerance on one specialist and gained
   elsewhere (+0.08 on the others: the improvement test passes), promoted within 20 attempts, with the
   non-inferiority rate spent over attempts vs tested at its full rate each time (before: 39%).
   *One-directional*: chat loses exactly its tolerance and gains no item (its differences are 0 or a loss:
   the shifted sign-flip test's worst case), others +0.08, promoted within 20 spent attempts: the betting
   test (target <= regression_error_rate) beside the old shifted sign-flip test in its place.
4. **Duplicated items**: three copies of each of 100 items per specialist, attempt 1, equal quality:
   false promotions with the copies as independent items vs marked as a group (one unit), beside 100
   distinct items (before, with the t test: 0.014 -> 0.091).
5. **Non-inferiority's size at its margin**: one test on a suite's size of i.i.d. paired 0/1 differences
   whose mean is exactly minus the tolerance, at the rates of attempts 1 and 2, with no item won (losses only: 5% of the
   items), 10% and 18% of the items discordant; the betting test beside the old shifted sign-flip test (whose
   null, symmetry of ``d + tolerance``, bounded scores at the margin do not meet).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.gates.inference import (  # noqa: E402
    compare_scores,
    noninferiority_test,
    signflip_test,
    unit_contributions,
)
from pipeline.loop.promotion import judge, spent_rate  # noqa: E402
from pipeline.specs.contract import PromotionGates, load_contract  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ITEMS = min(s.size or 0 for s in load_contract(ROOT / "contracts" / "demo.yaml").heldout)  # per specialist
# Per specialist: the contract score of a wrong and of a right answer under contracts/demo.yaml; the demo
# champion's share of right answers; the share of held-out items whose result differs between it and its
# candidate. Measured with `make demo` (seed 0, 2026-12-01): generation 0 and generation 1 on 300 items.
SCALE = {"chat": (1 / 6, 1.0), "agent": (0.0, 1.0), "coding": (1 / 11, 1.0), "genui": (0.0, 1.0)}
ACCURACY = {"chat": 0.143, "agent": 0.143, "coding": 0.117, "genui": 0.100}
FLIPS = {"chat": 0.177, "agent": 0.107, "coding": 0.123, "genui": 0.130}
EPOCHS, PER_EPOCH = 6, 10


def draw_champion(rng: np.random.Generator, items: int = ITEMS) -> dict[str, np.ndarray]:
    return {s: rng.random(items) < ACCURACY[s] for s in SCALE}


def draw_candidate(
    rng: np.random.Generator, champion: dict[str, np.ndarray], gain: float | dict[str, float]
) -> dict[str, np.ndarray]:
    """Flip items of the champion: right->wrong at rate FLIPS/(2p), wrong->right at FLIPS/(2(1-p)), plus
    what makes each specialist's expected score ``gain`` higher (a negative gain: more right->wrong)."""
    out = {}
    for s, right in champion.items():
        g = gain[s] if isinstance(gain, dict) else gain
        p, (low, high) = ACCURACY[s], SCALE[s]
        lose = FLIPS[s] / (2 * p) + max(0.0, -g) / (high - low) / p
        win = FLIPS[s] / (2 * (1 - p)) + max(0.0, g) / (high - low) / (1 - p)
        u = rng.random(right.size)
        out[s] = np.where(right, u >= lose, u < win)
    return out


def scores(results: dict[str, np.ndarray]) -> dict[str, list[float]]:
    return {s: np.where(r, SCALE[s][1], SCALE[s][0]).tolist() for s, r in results.items()}


def promoted(
    gates: PromotionGates, champion: dict, candidate: dict, j: int, groups=None, sample: int | None = None
) -> bool:
    """The real gate's verdict at attempt ``j`` (improvement and every non-inferiority test), on the
    ``sample``-th fresh sample of the suites (None: a fixed suite)."""
    comparison = compare_scores(scores(champion), scores(candidate), groups)
    attempts = {"noninferiority": dict.fromkeys(SCALE, j), "improvement_sample": sample}
    return judge(comparison, gates, attempt=j, attempts=attempts).promote


def lineage_false(gates: PromotionGates, seed: int, index: int) -> tuple[bool, bool, bool]:
    """(ledger, reset, fresh): whether the lineage ever promoted an equal-quality candidate."""
    rng = np.random.default_rng([seed, index])
    ledger = reset = fresh = False
    for epoch in range(EPOCHS):
        champion = draw_champion(rng)
        for a in range(1, PER_EPOCH + 1):
            if ledger and reset and fresh:
                return True, True, True
            candidate = draw_candidate(rng, champion, 0.0)
            ledger = ledger or promoted(gates, champion, candidate, epoch * PER_EPOCH + a)
            reset = reset or promoted(gates, champion, candidate, a)
            fresh = fresh or promoted(gates, champion, candidate, a, sample=epoch + 1)
    return ledger, reset, fresh


def lineage_power(
    gates: PromotionGates, seed: int, index: int, spent: int, sample: int | None = None
) -> bool:
    """Whether a real +0.03 is promoted within 3 attempts after ``spent`` attempts on the suite (on the
    ``sample``-th fresh sample: attempts restart there)."""
    rng = np.random.default_rng([seed, index])
    champion = draw_champion(rng)
    return any(
        promoted(gates, champion, draw_candidate(rng, champion, 0.03), spent + a, sample=sample)
        for a in (1, 2, 3)
    )


def lineage_noninferiority(gates: PromotionGates, seed: int, index: int) -> tuple[bool, bool]:
    """(spent, unspent): promoted within 20 attempts, chat truly worse by exactly its tolerance."""
    rng = np.random.default_rng([seed, index])
    champion = draw_champion(rng)
    gain = {s: -gates.tolerance(s) if s == "chat" else 0.08 for s in SCALE}
    spent = unspent = False
    for j in range(1, 21):
        candidate = draw_candidate(rng, champion, gain)
        comparison = compare_scores(scores(champion), scores(candidate))
        spent = (
            spent
            or judge(
                comparison, gates, attempt=j, attempts={"noninferiority": dict.fromkeys(SCALE, j)}
            ).promote
        )
        unspent = unspent or judge(comparison, gates, attempt=j, attempts={"noninferiority": dict.fromkeys(SCALE, 1)}).promote  # fmt: skip
    return spent, unspent


def shifted_signflip(diffs, tolerance: float, alpha: float) -> bool:
    """The non-inferiority test before the betting test (for comparison only): a sign-flip test of
    ``d + tolerance``, valid only where that is symmetric; whether it rejects (a pass)."""
    n = len(diffs)
    return signflip_test(unit_contributions(diffs, shift=tolerance, weight=1 / n), alpha=alpha).rejects(alpha)


def lineage_one_directional(gates: PromotionGates, seed: int, index: int) -> tuple[bool, bool]:
    """(betting, old shifted sign-flip): promoted within 20 spent attempts, chat losing exactly its
    tolerance (right -> wrong on some items, never wrong -> right), the others +0.08."""
    rng = np.random.default_rng([seed, index])
    champion = draw_champion(rng)
    tol = gates.tolerance("chat")
    (low, high), p = SCALE["chat"], ACCURACY["chat"]
    new = old = False
    for j in range(1, 21):
        if new and old:
            break
        candidate = draw_candidate(rng, champion, {s: 0.0 if s == "chat" else 0.08 for s in SCALE})
        candidate["chat"] = champion["chat"] & (rng.random(ITEMS) >= tol / ((high - low) * p))
        comparison = compare_scores(scores(champion), scores(candidate))
        verdict = judge(comparison, gates, attempt=j, attempts={"noninferiority": dict.fromkeys(SCALE, j)})
        new = new or verdict.promote
        others = all(t["passed"] for t in verdict.tests if t["test"] != "noninferiority:chat")
        rate = spent_rate(gates.regression_error_rate, j)
        old = old or (others and shifted_signflip(comparison.specialists["chat"].diffs, tol, rate))
    return new, old


def lineage_duplicates(gates: PromotionGates, seed: int, index: int) -> tuple[bool, bool, bool]:
    """(distinct, copies, grouped copies): attempt-1 false promotion on 100 items, tripled, grouped."""
    rng = np.random.default_rng([seed, index])
    champion = draw_champion(rng, 100)
    candidate = draw_candidate(rng, champion, 0.0)
    tripled = (
        {s: np.repeat(r, 3) for s, r in champion.items()},
        {s: np.repeat(r, 3) for s, r in candidate.items()},
    )
    groups = {s: [str(i) for i in np.repeat(np.arange(100), 3)] for s in SCALE}
    return (
        promoted(gates, champion, candidate, 1),
        promoted(gates, *tripled, 1),
        promoted(gates, *tripled, 1, groups),
    )


def lineage_margin(gates: PromotionGates, seed: int, index: int, discordant: float) -> tuple[bool, ...]:
    """(attempt 1, attempt 2, old at 1, old at 2): one non-inferiority test at its margin rejects (a false
    pass); ``discordant`` at the tolerance itself: losses only."""
    rng = np.random.default_rng([seed, index])
    tol = gates.max_regression
    lose, win = (discordant + tol) / 2, (discordant - tol) / 2
    u = rng.random(ITEMS)
    d = np.where(u < lose, -1.0, np.where(u < lose + win, 1.0, 0.0))
    rates = [spent_rate(gates.regression_error_rate, j) for j in (1, 2)]
    new = tuple(noninferiority_test(d, tolerance=tol, alpha=r).rejects(r) for r in rates)
    return new + tuple(shifted_signflip(d, tol, r) for r in rates)


def _chunk(args: tuple) -> list:
    fn, gates, seed, indices, extra = args
    return [fn(gates, seed, i, *extra) for i in indices]


def run(
    fn: Callable, gates: PromotionGates, n: int, *, seed: int, jobs: int, extra: tuple = ()
) -> np.ndarray:
    """``fn`` over lineages 0..n-1 (each seeded by (seed, index): the same figures whatever ``jobs``)."""
    chunks = [(fn, gates, seed, range(i, min(n, i + 25)), extra) for i in range(0, n, 25)]
    if jobs <= 1:
        out = [r for c in chunks for r in _chunk(c)]
    else:
        with ProcessPoolExecutor(jobs) as pool:
            out = [r for part in pool.map(_chunk, chunks) for r in part]
    return np.asarray(out, dtype=np.float64)


def share(x: np.ndarray) -> str:
    p = float(x.mean())
    return f"{p:.3f} +- {math.sqrt(p * (1 - p) / x.size):.3f}"


def ratio(a: np.ndarray, b: np.ndarray) -> str:
    """a's mean over b's, with a delta-method standard error (pairs of lineages; covariance included)."""
    ma, mb = float(a.mean()), float(b.mean())
    if mb == 0:
        return "n/a"
    r = ma / mb
    var = (a.var() / ma**2 if ma else 0) + b.var() / mb**2 - (2 * np.cov(a, b)[0, 1] / (ma * mb) if ma else 0)
    return f"{r:.2f}x +- {r * math.sqrt(max(var, 0) / a.size):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lineages", type=int, default=1000)
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    gates = load_contract(ROOT / "contracts" / "demo.yaml").promotion
    n, jobs, seed = args.lineages, args.jobs, args.seed
    rate = gates.false_promotion_rate
    started = time.perf_counter()
    print(f"{n} simulated lineages per row, {ITEMS} items x {len(SCALE)} specialists, {jobs} processes")

    false = run(lineage_false, gates, n, seed=seed, jobs=jobs)
    ledger, reset, fresh_false = false[:, 0], false[:, 1], false[:, 2]
    print(
        f"1. any false promotion over {EPOCHS} epochs x {PER_EPOCH} attempts: ledger {share(ledger)} "
        f"(target <= {rate:g}: {'met' if ledger.mean() <= rate else 'NOT met'}) vs per-champion reset "
        f"{share(reset)} (ledger/reset {ratio(ledger, reset)}; the t test with resets: 0.253 +- 0.049); "
        f"fresh samples (attempts restart per sample, sample e spends 6/(pi^2 e^2)) {share(fresh_false)} "
        f"(target <= {rate:g}: {'met' if fresh_false.mean() <= rate else 'NOT met'})"
    )
    first = run(lineage_power, gates, n, seed=seed + 1, jobs=jobs, extra=(0,))
    late = run(lineage_power, gates, n, seed=seed + 2, jobs=jobs, extra=(50,))
    fresh = run(lineage_power, gates, n, seed=seed + 3, jobs=jobs, extra=(0, 1))
    fresh6 = run(lineage_power, gates, n, seed=seed + 3, jobs=jobs, extra=(0, EPOCHS))
    print(
        f"2. +0.03 promoted within 3 attempts: epoch 1 {share(first)} (target >= 0.8: "
        f"{'met' if first.mean() >= 0.8 else 'NOT met'}); after 50 attempts on the same suite "
        f"{share(late)}; fresh samples: on the first {share(fresh)}, on the {EPOCHS}th (attempts 1-3 on "
        f"it, after {EPOCHS - 1} samples x {PER_EPOCH} attempts) {share(fresh6)}"
    )
    ni = run(lineage_noninferiority, gates, n, seed=seed + 4, jobs=jobs)
    print(
        f"3. chat truly -{gates.tolerance('chat'):g} (its tolerance), others +0.08, promoted within 20 "
        f"attempts: non-inferiority spent {share(ni[:, 0])} vs at its full rate every attempt "
        f"{share(ni[:, 1])} (target <= {gates.regression_error_rate:g}; before: 0.39)"
    )
    one = run(lineage_one_directional, gates, n, seed=seed + 7, jobs=jobs)
    target = gates.regression_error_rate
    print(
        f"3b. chat loses exactly -{gates.tolerance('chat'):g} and wins no item, others +0.08, promoted within "
        f"20 spent attempts: betting test {share(one[:, 0])} (target <= {target:g}: "
        f"{'met' if one[:, 0].mean() <= target else 'NOT met'}) vs the old shifted sign-flip {share(one[:, 1])}"
    )
    dup = run(lineage_duplicates, gates, 2 * n, seed=seed + 5, jobs=jobs)
    print(
        f"4. attempt-1 false promotion, 100 items x 3 copies: as independent items {share(dup[:, 1])}, as "
        f"groups {share(dup[:, 2])}; 100 distinct items {share(dup[:, 0])} (nominal "
        f"{gates.attempt_rate(1):.4f}; before, t test: 0.014 -> 0.091)"
    )
    rates = [spent_rate(gates.regression_error_rate, j) for j in (1, 2)]
    for share_discordant in (gates.max_regression, 0.10, 0.18):
        margin = run(lineage_margin, gates, 5 * n, seed=seed + 6, jobs=jobs, extra=(share_discordant,))
        what = "losses only" if share_discordant == gates.max_regression else "discordant"
        print(
            f"5. non-inferiority at its margin (-{gates.max_regression:g}), {share_discordant:.0%} {what}: "
            f"size {share(margin[:, 0])} at {rates[0]:.4f}, {share(margin[:, 1])} at {rates[1]:.4f} (old "
            f"shifted sign-flip: {share(margin[:, 2])}, {share(margin[:, 3])})"
        )
    print(f"took {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
