"""How often the promotion gate is fooled over a lineage's repeated attempts, and how fast it promotes a
real gain, simulated at the demo's suite sizes with the real gate (``pipeline.promotion.judge``).

    python bench/gates.py [--lineages 1000] [--attempts 50]

A lineage keeps one champion whose item-level results on the fixed held-out suite (the demo contract's:
4 specialists x its suite size) are drawn once; each attempt is a candidate whose results agree with the
champion's except on a share of items that flip (measured on the demo: see FLIPS). Equal quality: flips
either way balance in expectation. A real gain: +0.03 overall. Printed: the chance of any false promotion within 50
attempts (must be at most the contract's false_promotion_rate) and the chance a +0.03 gain is promoted
within 3 attempts (must be at least 0.8), each beside the same numbers for the strongest baseline a user
would pick -- the same test at a fixed per-attempt rate (the gate before alpha spending).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.contract import PromotionGates, load_contract  # noqa: E402
from pipeline.evaluation import compare_scores  # noqa: E402
from pipeline.promotion import judge  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ITEMS = min(s.size or 0 for s in load_contract(ROOT / "contracts" / "demo.yaml").heldout)  # per specialist
# Per specialist: the contract score of a wrong and of a right answer under contracts/demo.yaml; the demo
# champion's share of right answers; the share of held-out items whose result differs between it and its
# candidate. Measured with `make demo` (seed 0, 2026-12-01): generation 0 and generation 1 on 300 items.
SCALE = {"chat": (1 / 6, 1.0), "agent": (0.0, 1.0), "coding": (1 / 11, 1.0), "genui": (0.0, 1.0)}
ACCURACY = {"chat": 0.143, "agent": 0.143, "coding": 0.117, "genui": 0.100}
FLIPS = {"chat": 0.177, "agent": 0.107, "coding": 0.123, "genui": 0.130}


def draw_champion(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {s: rng.random(ITEMS) < ACCURACY[s] for s in SCALE}


def draw_candidate(
    rng: np.random.Generator, champion: dict[str, np.ndarray], gain: float
) -> dict[str, np.ndarray]:
    """Flip items of the champion: right->wrong at rate FLIPS/(2p), wrong->right at FLIPS/(2(1-p)) plus
    what makes the expected overall score ``gain`` higher (every specialist gains ``gain``)."""
    out = {}
    for s, right in champion.items():
        p = ACCURACY[s]
        low, high = SCALE[s]
        lose = FLIPS[s] / (2 * p)
        win = FLIPS[s] / (2 * (1 - p)) + gain / (high - low) / (1 - p)
        u = rng.random(ITEMS)
        out[s] = np.where(right, u >= lose, u < win)
    return out


def scores(results: dict[str, np.ndarray]) -> dict[str, list[float]]:
    return {s: np.where(r, SCALE[s][1], SCALE[s][0]).tolist() for s, r in results.items()}


def simulate(
    gates: PromotionGates, *, lineages: int, attempts: int, gain: float, spend: bool = True, seed: int = 0
) -> float:
    """Share of lineages that promote within ``attempts`` attempts (``spend=False``: every attempt tested
    as the first, i.e. at a fixed rate)."""
    rng = np.random.default_rng(seed)
    promoted = 0
    for _ in range(lineages):
        champion = draw_champion(rng)
        base = scores(champion)
        for k in range(1, attempts + 1):
            comparison = compare_scores(base, scores(draw_candidate(rng, champion, gain)))
            if judge(comparison, gates, attempt=k if spend else 1).promote:
                promoted += 1
                break
    return promoted / lineages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lineages", type=int, default=1000)
    parser.add_argument("--attempts", type=int, default=50)
    args = parser.parse_args()
    gates = load_contract(ROOT / "contracts" / "demo.yaml").promotion
    started = time.perf_counter()
    false = simulate(gates, lineages=args.lineages, attempts=args.attempts, gain=0.0)
    false_fixed = simulate(gates, lineages=args.lineages, attempts=args.attempts, gain=0.0, spend=False)
    power = simulate(gates, lineages=args.lineages, attempts=3, gain=0.03, seed=1)
    power_fixed = simulate(gates, lineages=args.lineages, attempts=3, gain=0.03, seed=1, spend=False)
    took = time.perf_counter() - started
    rate = gates.false_promotion_rate
    print(
        f"{args.lineages} simulated lineages per row, {ITEMS} items x {len(SCALE)} specialists, {took:.0f} s"
    )
    print(
        f"any false promotion within {args.attempts} attempts: {false:.3f} (alpha spending) vs "
        f"{false_fixed:.3f} (fixed per-attempt rate): {false / max(false_fixed, 1e-9):.2f}x; "
        f"target <= {rate:g}: {'met' if false <= rate else 'NOT met'}"
    )
    print(
        f"+0.03 overall promoted within 3 attempts: {power:.3f} (alpha spending) vs {power_fixed:.3f} (fixed): "
        f"{power / max(power_fixed, 1e-9):.2f}x; target >= 0.8: {'met' if power >= 0.8 else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
