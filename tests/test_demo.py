"""The demo's claim, checked on a second seed: the champion's held-out contract score rises because the
model learned from its own scored experience (no hard-coded results: the gates decide on fresh evaluations).

Runs the shipped tiny model spec (two of its specialists, to keep the suite's time in bounds) with the
shipped contract and harness, advancing with seed 1 (the demo uses seed 0).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from pipeline.advance import advance_once
from pipeline.candidate import AdvanceConfig
from pipeline.cli.advance import ensure_base_model, lineage_rows
from pipeline.lineage import init_lineage

ROOT = Path(__file__).resolve().parent.parent


def test_second_seed_also_improves(tmp_path):
    spec = yaml.safe_load((ROOT / "models" / "tiny.yaml").read_text())
    spec["specialists"] = {name: spec["specialists"][name] for name in ("chat", "agent")}
    model = tmp_path / "tiny-two.yaml"
    model.write_text(yaml.safe_dump(spec))
    init_lineage(
        contract_path=ROOT / "contracts" / "demo.yaml",
        harness_path=ROOT / "harnesses" / "demo.yaml",
        model_path=model,
    )
    ensure_base_model("main")
    config = AdvanceConfig(seed=1)
    outcomes = [advance_once(config=config) for _ in range(3)]
    rows = lineage_rows("main")
    base, champion = rows[0]["overall"], next(r for r in rows if r["status"] == "promoted")
    promoted = [o for o in outcomes if o["status"] == "promoted"]
    assert promoted, [o["decision"] for o in outcomes]
    assert champion["generation"] > 0 and champion["overall"] > base + 0.03, (base, champion)
    # every promotion was significant: the lower end of its interval is above zero
    for row in rows[1:]:
        if row["status"] in ("promoted", "retired"):
            assert "CI +" in row["decision"], row["decision"]
