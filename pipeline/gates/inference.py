"""Inference for the promotion gate: the paired comparison of two pairs on the same items, and the two
one-sided tests the gate makes on it.

``compare_scores`` keeps, per specialist, the means, the mean paired difference and its standard error (a
description: what the pages show) and the item-level differences with their optional groups (what the
tests use). The overall delta is the mean of the specialists' mean differences, each specialist counting
the same. A unit is an item, or a group of items (``groups``: turns of one dialogue, copies of one item;
cluster-level).

**Improvement** (``improvement_test``): an exact one-sided sign-flip permutation test of the overall delta's
contributions (each specialist's items weighted ``1 / (k n_s)``, shifted by ``-min_improvement``). Its null
is *exchangeability of the two pairs' scores on each item*: every unit's (shifted) difference was as likely
to have had the other sign, so the p-value is the share of the ``2**units`` sign assignments whose sum
reaches the observed one (ties count against the candidate; a unit whose difference is zero drops out).
That null is what "the candidate is no better than its parent" means when the two pairs are
interchangeable on every item, and the test's size is then at most its rate for any bounded, tied scores
(where the t test over-rejects). It is *not* the wider null "the mean difference is at most 0": equal means
with skewed differences (a small gain on many items, a large loss on a few) are not covered -- +0.2 on 8%
of 300 items and -0.8 on 2% pass it 0.058 of the time at rate 0.0304, +0.2 on 4% and -0.8 on 1% 0.083
(exact, ``docs/gates.md``). With a margin the null is symmetry of ``d - min_improvement``, approximate on
bounded scores in the same way.

**Non-inferiority and retention** (``noninferiority_test``): a betting test of the mean of bounded variables
(Waudby-Smith & Ramdas, "Estimating means of bounded random variables by betting", JRSS-B 2023), valid for
ANY distribution of the differences in [-1, 1] (scores in [0, 1]) whose mean is at or below ``-tolerance``
(the candidate lost at least the tolerance): the units' mean differences, in a seeded random order that does
not depend on their values, map to ``x = (d + 1) / 2`` in [0, 1] and the null to ``E x <= m = (1 - tol) /
2``; the capital ``K_t = prod (1 + lambda_i (x_i - m))`` with a predictable bet ``lambda_i >= 0`` (the
predictable plug-in tuned for the fixed number of units n: ``sqrt(2 log(1/alpha) / (n var_{i-1}))``,
``var`` the running variance with a prior of 1/4, capped at ``BET_CAP / m`` so a bet never risks more than
that share of the capital) is a nonnegative supermartingale under the null, so by Ville's inequality
``P(max_t K_t >= 1/alpha) <= alpha``: ``p = min(1, 1 / max_t K_t)``. It assumes independent units (items,
or groups: then the null is about the mean over groups of each group's mean difference). Ties (d = 0) are
evidence here: they are above the margin. It gives up some power for that validity (``docs/gates.md``: the shifted sign-flip
test it replaced exceeded its rate when the candidate only lost items).

How the sign-flip p-value is computed, cheapest valid way first: bounded scores take few distinct values, so
the units fall into classes of equal magnitude and the sum is a weighted sum of binomials, enumerated exactly
when the classes but the largest have at most ``EXACT_COMBINATIONS`` joint outcomes (always for up to 20
units); otherwise a statistic at or below 0 has p >= 1/2 (symmetry), a Hoeffding bound at or below the
test's rate rejects exactly as the exact test would, and the rest is Monte Carlo with Besag-Clifford
sequential stopping (stop at the ``BC_HITS``-th draw reaching the statistic, p = hits/draws; or after ``n -
1`` draws, p = (hits + 1) / n), a valid p-value whose Monte Carlo standard error the result states. Its draws
are seeded from the data: the same inputs give the same p-value.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import asdict, dataclass
from statistics import fmean
from typing import Any

import numpy as np

EXACT_COMBINATIONS = 1 << 20  # joint outcomes of the enumerated classes (2**20: any 20 units)
BC_HITS = 20  # Besag-Clifford: stop at this many draws at or beyond the statistic
MC_MIN_DRAWS = 10_000
MC_MAX_DRAWS = 1 << 22
_CHUNK_CELLS = 1 << 22  # draws x units per Monte Carlo batch (32 MiB of float64)
BET_CAP = 0.75  # a bet risks at most 3/4 of the capital (Waudby-Smith & Ramdas truncate at 1/2 or 3/4)
BET_ORDER_SEED = 20231  # the units' order: random, but fixed before the data (Ville needs a predictable bet)


@dataclass(frozen=True)
class SpecialistComparison:
    """One specialist's held-out result for both pairs: means, the mean paired difference and its SE, and
    the item-level differences (candidate - champion) with each item's group (None: its own unit)."""

    specialist: str
    n: int
    champion: float
    candidate: float
    delta: float
    se: float
    diffs: tuple[float, ...] = ()
    groups: tuple[str | None, ...] | None = None


@dataclass(frozen=True)
class Comparison:
    """The paired comparison of two pairs on the same items."""

    specialists: dict[str, SpecialistComparison]
    champion_overall: float
    candidate_overall: float
    delta: float
    se: float
    df: float  # Welch-Satterthwaite degrees of freedom of the overall delta's t statistic (descriptive)

    def to_dict(self) -> dict[str, Any]:
        """As stored (JSON has no infinity: an infinite ``df`` -- no variance at all -- is null)."""
        return {**asdict(self), "df": None if math.isinf(self.df) else self.df}

    @classmethod
    def from_dict(cls, data: dict[str, Any], items: dict[str, Any] | None = None) -> Comparison:
        """From ``to_dict``'s form. A comparison stored before it kept the item-level differences takes
        them from ``items`` (``evaluation["items"]``: per specialist ``parent``, ``candidate`` and optional
        ``groups``); so do groups it does not hold itself."""
        specialists = {}
        for s, v in data["specialists"].items():
            v = dict(v)
            stored = (items or {}).get(s) or {}
            if not v.get("diffs") and stored.get("candidate") is not None:
                v["diffs"] = [b - a for a, b in zip(stored["parent"], stored["candidate"], strict=True)]
            if v.get("groups") is None and stored.get("groups") is not None:
                v["groups"] = stored["groups"]
            v["diffs"] = tuple(v.get("diffs") or ())
            v["groups"] = _groups(v.get("groups"), len(v["diffs"]))
            specialists[s] = SpecialistComparison(**v)
        return cls(
            **{**data, "specialists": specialists, "df": math.inf if data["df"] is None else data["df"]}
        )


def _groups(groups: Any, n: int) -> tuple[str | None, ...] | None:
    """Groups aligned with ``n`` items, or None when there are none (absent, or every item its own)."""
    if groups is None or all(g is None for g in groups):
        return None
    if len(groups) != n:
        raise ValueError(f"{len(groups)} groups for {n} items")
    return tuple(None if g is None else str(g) for g in groups)


def compare_scores(
    champion: dict[str, list[float]],
    candidate: dict[str, list[float]],
    groups: dict[str, list[str | None]] | None = None,
) -> Comparison:
    """Paired statistics of per-item scores (same items, same order, per specialist); ``groups``: per
    specialist, each item's group (items of one group are one unit of the test)."""
    if set(champion) != set(candidate):
        raise ValueError(f"specialists differ: {sorted(champion)} vs {sorted(candidate)}")
    per: dict[str, SpecialistComparison] = {}
    parts = []  # (variance of the specialist's mean, n)
    for s in sorted(champion):
        if len(champion[s]) != len(candidate[s]):
            raise ValueError(f"{s}: {len(champion[s])} champion items vs {len(candidate[s])} candidate items")
        if not champion[s]:
            continue
        a, b = np.asarray(champion[s], dtype=np.float64), np.asarray(candidate[s], dtype=np.float64)
        d = b - a
        var = float(d.var(ddof=1)) / len(d) if len(d) > 1 else 0.0
        parts.append((var, len(d)))
        per[s] = SpecialistComparison(
            s,
            len(d),
            float(a.mean()),
            float(b.mean()),
            float(d.mean()),
            math.sqrt(var),
            tuple(d.tolist()),
            _groups((groups or {}).get(s), len(d)),
        )
    if not per:
        return Comparison({}, 0.0, 0.0, 0.0, 0.0, 0.0)
    k = len(per)
    var = sum(v for v, _ in parts) / k**2
    df = sum(v for v, _ in parts) ** 2 / sum(v**2 / max(1, n - 1) for v, n in parts) if var > 0 else math.inf
    champ = fmean(c.champion for c in per.values())
    cand = fmean(c.candidate for c in per.values())
    return Comparison(per, champ, cand, cand - champ, math.sqrt(var), df)


@dataclass(frozen=True)
class SignFlip:
    """A one-sided sign-flip test's result. ``method``: ``exact`` (p is the exact permutation p-value),
    ``monte carlo`` (a valid p-value from ``draws`` random sign assignments, standard error ``error``),
    ``hoeffding`` (p is an upper bound of the exact p-value, at or below the test's rate: the exact test
    rejects too) or ``symmetry`` (the statistic is at most 0, so the exact p-value is at least p = 0.5)."""

    p: float
    method: str
    units: int  # units with a non-zero (shifted) difference
    draws: int = 0
    error: float = 0.0

    def describe(self) -> str:
        """The p-value and how it was computed, in words."""
        units = f"{self.units} non-zero unit{'s' if self.units != 1 else ''}"
        if self.method == "exact":
            return f"p = {self.p:.4g}, exact over {units}"
        if self.method == "monte carlo":
            return f"p = {self.p:.4g} +- {self.error:.2g}, Monte Carlo ({self.draws:,} draws) over {units}"
        if self.method == "hoeffding":
            return f"p <= {self.p:.3g}, Hoeffding bound over {units}"
        return f"p >= 0.5 (the statistic is not above 0) over {units}"

    def rejects(self, alpha: float) -> bool:
        """Whether the null hypothesis is rejected at ``alpha``."""
        return self.method != "symmetry" and self.p <= alpha


def unit_contributions(
    diffs: Any, groups: Any = None, *, shift: float = 0.0, weight: float = 1.0
) -> np.ndarray:
    """Each unit's contribution to the statistic: ``weight * sum over its items of (diff + shift)``; an item
    whose group is None is its own unit."""
    x = (np.asarray(diffs, dtype=np.float64) + shift) * weight
    if groups is None or all(g is None for g in groups):
        return x
    keys: dict[str, int] = {}
    index = np.empty(len(x), dtype=np.int64)
    for i, g in enumerate(groups):
        index[i] = keys.setdefault(f"i{i}" if g is None else f"g{g}", len(keys))
    return np.bincount(index, weights=x, minlength=len(keys))


def signflip_test(contributions: Any, *, alpha: float) -> SignFlip:
    """P(sum of randomly signed contributions >= their observed sum): see the module doc. ``alpha`` is the
    rate the test will be held to (it sets how many Monte Carlo draws a p-value near it needs)."""
    c = np.asarray(contributions, dtype=np.float64).ravel()
    scale = float(np.abs(c).max()) if c.size else 0.0
    c = c[np.abs(c) > 1e-9 * scale] if scale > 0 else c[:0]
    if c.size == 0:
        return SignFlip(1.0, "exact", 0)
    total = float(c.sum())
    tol = 1e-9 * float(np.abs(c).sum())  # float error of a sum: ties count as reaching the statistic
    exact = _exact(c, total)
    if exact is not None:
        return SignFlip(exact, "exact", c.size)
    if total <= tol:
        return SignFlip(0.5, "symmetry", c.size)
    bound = math.exp(-(total**2) / (2 * float((c**2).sum())))
    if bound <= alpha:
        return SignFlip(bound, "hoeffding", c.size)
    return _monte_carlo(c, total - tol, alpha)


def _classes(c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct magnitudes of ``c`` (equal within float error) and how many units have each."""
    a = np.sort(np.abs(c))
    cuts = np.flatnonzero(np.diff(a) > 1e-9 * a[-1]) + 1
    bounds = np.concatenate(([0], cuts, [a.size]))
    mags = np.array([a[i:j].mean() for i, j in zip(bounds[:-1], bounds[1:], strict=True)])
    return mags, np.diff(bounds)


@functools.lru_cache(maxsize=4096)
def _binomial_pmf(m: int) -> np.ndarray:
    """Binomial(m, 1/2) probabilities of 0..m (cached: read-only)."""
    k = np.arange(m + 1, dtype=np.float64)
    log = math.lgamma(m + 1) - _LGAMMA(k + 1) - _LGAMMA(m - k + 1) - m * math.log(2)
    pmf = np.exp(log)
    pmf.flags.writeable = False
    return pmf


_LGAMMA = np.vectorize(math.lgamma, otypes=[np.float64])


def _exact(c: np.ndarray, total: float) -> float | None:
    """The exact p-value, or None when the enumeration would be too large. The units of one magnitude
    ``a`` (``m`` of them) add ``a (2B - m)`` with ``B ~ Binomial(m, 1/2)`` plus signs: the joint outcomes
    of all classes but the largest are enumerated, the largest's tail is read off its binomial."""
    mags, counts = _classes(c)
    last = int(np.argmax(counts))
    others = [i for i in range(len(mags)) if i != last]
    if math.prod(int(counts[i]) + 1 for i in others) > EXACT_COMBINATIONS:
        return None
    values, probs = np.zeros(1), np.ones(1)
    for i in others:
        m = int(counts[i])
        values = (values[:, None] + mags[i] * (2 * np.arange(m + 1) - m)[None, :]).ravel()
        probs = (probs[:, None] * _binomial_pmf(m)[None, :]).ravel()
    a, m = float(mags[last]), int(counts[last])
    tail = np.concatenate((np.cumsum(_binomial_pmf(m)[::-1])[::-1], [0.0]))  # tail[k] = P(B >= k)
    need = (total - values + a * m) / (2 * a)  # the last class must reach B >= need
    k = np.clip(np.ceil(need - 1e-7), 0, m + 1).astype(np.int64)
    return float(min(1.0, (probs * tail[k]).sum()))


def _seed(c: np.ndarray) -> int:
    """A seed from the data: the same contributions draw the same signs."""
    return int.from_bytes(hashlib.blake2b(np.round(c, 12).tobytes(), digest_size=8).digest(), "little")


def _monte_carlo(c: np.ndarray, threshold: float, alpha: float) -> SignFlip:
    """Besag-Clifford sequential Monte Carlo p-value of ``P(sum >= threshold)``: draws up to ``n - 1``
    random sign assignments, ``n`` enough for a p-value of 1/20 of ``alpha`` (within the limits)."""
    rng = np.random.default_rng(_seed(c))
    n = int(min(MC_MAX_DRAWS, max(MC_MIN_DRAWS, math.ceil(20 / alpha))))
    drawn = hits = 0
    batch = 1024
    while drawn < n - 1:
        size = min(batch, n - 1 - drawn, max(1, _CHUNK_CELLS // c.size))
        signs = rng.integers(0, 2, size=(size, c.size), dtype=np.int8).astype(np.float64) * 2 - 1
        reached = hits + np.cumsum(signs @ c >= threshold)
        if reached[-1] >= BC_HITS:
            draws = drawn + int(np.argmax(reached >= BC_HITS)) + 1
            p = BC_HITS / draws
            return SignFlip(p, "monte carlo", c.size, draws, math.sqrt(p * (1 - p) / draws))
        hits, drawn, batch = int(reached[-1]), drawn + size, batch * 2
    p = (hits + 1) / n
    return SignFlip(p, "monte carlo", c.size, drawn, math.sqrt(p * (1 - p) / max(1, drawn)))


def improvement_test(comparison: Comparison, *, margin: float, alpha: float) -> SignFlip:
    """One-sided test that the overall delta (the mean of the specialists' mean differences) exceeds
    ``margin``: every item's difference shifted by ``-margin`` and weighted ``1 / (k n_s)``."""
    k = len(comparison.specialists)
    parts = [
        unit_contributions(c.diffs, c.groups, shift=-margin, weight=1 / (k * len(c.diffs)))
        for c in comparison.specialists.values()
        if c.diffs
    ]
    return signflip_test(np.concatenate(parts) if parts else np.zeros(0), alpha=alpha)


@dataclass(frozen=True)
class Betting:
    """A betting test's result: ``p = min(1, 1 / capital)``, ``capital`` the largest the bettor's wealth
    reached (an e-value's running maximum) over ``units`` units."""

    p: float
    units: int
    capital: float
    method: str = "betting"
    draws: int = 0  # the sign-flip result's fields, for the verdict's rows
    error: float = 0.0

    def describe(self) -> str:
        """The p-value and how it was computed, in words."""
        units = f"{self.units} unit{'s' if self.units != 1 else ''}"
        return f"p = {self.p:.4g}, betting (largest capital {self.capital:.3g}) over {units}"

    def rejects(self, alpha: float) -> bool:
        """Whether the null hypothesis is rejected at ``alpha``."""
        return self.units > 0 and self.p <= alpha


def unit_means(diffs: Any, groups: Any = None) -> np.ndarray:
    """Each unit's mean difference (an item whose group is None is its own unit), in first-seen order."""
    d = np.asarray(diffs, dtype=np.float64)
    if groups is None or all(g is None for g in groups):
        return d
    keys: dict[str, int] = {}
    index = np.empty(len(d), dtype=np.int64)
    for i, g in enumerate(groups):
        index[i] = keys.setdefault(f"i{i}" if g is None else f"g{g}", len(keys))
    return np.bincount(index, weights=d) / np.bincount(index)


def betting_test(x: Any, *, null_mean: float, alpha: float) -> Betting:
    """One-sided betting test of ``H0: E x <= null_mean`` for ``x`` in [0, 1] (see the module doc): valid for
    any distribution of independent ``x`` with mean at most ``null_mean``, at every ``alpha``; ``alpha`` tunes
    the bet (the rate the test will be held to)."""
    x = np.asarray(x, dtype=np.float64).ravel()
    n, m = x.size, float(null_mean)
    if n == 0:
        return Betting(1.0, 0, 1.0)
    if not np.all(np.isfinite(x)) or x.min() < -1e-9 or x.max() > 1 + 1e-9:
        raise ValueError("a betting test needs values in [0, 1] (paired differences of scores in [0, 1])")
    x = np.clip(x, 0.0, 1.0)[np.random.default_rng([BET_ORDER_SEED, n]).permutation(n)]
    t = np.arange(1, n + 1, dtype=np.float64)
    mean = (0.5 + np.cumsum(x)) / (t + 1)  # the running mean, with a prior of 1/2
    var = (0.25 + np.cumsum((x - mean) ** 2)) / (t + 1)  # the running variance, with a prior of 1/4
    before = np.concatenate(([0.25], var[:-1]))  # predictable: bet i uses units 1..i-1 only
    cap = BET_CAP / m if m > 0 else math.inf
    bet = np.minimum(np.sqrt(2 * math.log(1 / min(max(alpha, 1e-300), 1.0 - 1e-12)) / (n * before)), cap)
    log_capital = np.cumsum(np.log1p(bet * (x - m)))
    top = float(np.exp(min(max(0.0, float(log_capital.max())), 700.0)))
    return Betting(min(1.0, 1.0 / top), n, top)


def noninferiority_test(diffs: Any, groups: Any = None, *, tolerance: float, alpha: float) -> Betting:
    """One-sided test that the mean difference is above ``-tolerance`` (not worse by the tolerance): a
    betting test of the units' mean differences in [-1, 1] (a group is one unit: its mean difference)."""
    d = unit_means(diffs, groups)
    if d.size and (not np.all(np.isfinite(d)) or np.abs(d).max() > 1 + 1e-9):
        raise ValueError(
            f"paired differences outside [-1, 1] (largest {np.abs(d).max():.3g}): scores must lie in [0, 1]"
        )
    return betting_test((d + 1) / 2, null_mean=(1 - tolerance) / 2, alpha=alpha)
