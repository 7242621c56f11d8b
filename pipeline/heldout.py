"""Held-out suites and validation sets: resolving them and scoring a model-harness pair on them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.errors import RatchetError

GENERATORS = ("demo",)


def resolve_suites(contract: Any, *, contract_path: Path | None = None) -> dict[str, list[dict[str, Any]]]:
    """Items of every held-out suite of the contract, per specialist (file suites are sha256-checked)."""
    from pipeline.contract import verify_suites

    suites: dict[str, list[dict[str, Any]]] = {}
    paths = iter(verify_suites(contract, contract_path) if contract_path else [])
    for suite in contract.heldout:
        if suite.generator is not None:
            if suite.generator not in GENERATORS:
                raise RatchetError(
                    f"held-out suite of {suite.specialist}: unknown generator {suite.generator!r}; "
                    f"expected one of {', '.join(GENERATORS)}"
                )
            from pipeline.environment import heldout_suite

            items = heldout_suite(suite.specialist, suite.size, suite.seed)
        else:
            if contract_path is None:
                raise RatchetError(f"held-out suite {suite.path} needs the contract's file location")
            path = next(paths)
            items = [
                json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()
            ]
        for item in items:  # whatever the source, these are held-out items
            item.setdefault("metadata", {})["split"] = "heldout"
        suites.setdefault(suite.specialist, []).extend(items)
    return suites


def validation_items(specialists: list[str], *, n: int, seed: int) -> dict[str, list[dict[str, Any]]]:
    """Training-split items for choosing among harness variants (never the held-out suites)."""
    from pipeline.environment import sample_prompts

    return {s: sample_prompts(s, n, seed) for s in specialists}


def score_pair(
    pair: Any,
    items: dict[str, list[dict[str, Any]]],
    contract: Any,
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
