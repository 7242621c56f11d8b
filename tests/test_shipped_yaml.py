"""Every YAML file the repo ships validates, says which command uses it, and the shipped harnesses
satisfy the shipped contracts."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.cli.contract import lint_file
from pipeline.contract import load_contract
from pipeline.harness import check_harness, load_harness

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"contracts": "contract", "harnesses": "harness", "models": "model"}
SHIPPED = sorted(p for folder in FOLDERS for p in (ROOT / folder).glob("*.y*ml"))


def test_something_is_shipped():
    assert {p.parent.name for p in SHIPPED} == set(FOLDERS)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_yaml_lints(path):
    problems, spec, kind = lint_file(path)
    assert problems == []
    assert kind == FOLDERS[path.parent.name] and spec is not None


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_yaml_starts_with_its_command(path):
    first = path.read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith("# Used by: ratchet "), first


@pytest.mark.parametrize(
    "harness_path, contract_path",
    [
        (h, c)
        for h in sorted((ROOT / "harnesses").glob("*.y*ml"))
        for c in sorted((ROOT / "contracts").glob("*.y*ml"))
    ],
    ids=lambda p: p.name,
)
def test_shipped_harnesses_satisfy_shipped_contracts(harness_path, contract_path):
    assert check_harness(load_harness(harness_path), load_contract(contract_path)) == []
