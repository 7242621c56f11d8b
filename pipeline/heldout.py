"""Held-out suites and validation sets: resolving them and scoring a model-harness pair on them."""

from __future__ import annotations

import json
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
