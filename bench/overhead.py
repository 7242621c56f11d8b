"""Share of one demo generation's wall time spent outside model compute.

Usage: python bench/overhead.py [--prompts 750] [--samples 4] [--home DIR]

Registers the demo lineage (building the tiny base if needed, not timed), starts the Prefect flow
machinery with a warm-up flow (the one-time temporary-server start is printed separately), then runs
one `advance_generation` flow exactly as `ratchet advance` does (Prefect tasks, SQLite registry,
MLflow tracking). Model compute is the time spent inside generation (collection, co-design,
held-out evaluation) and LoRA training, measured around those calls; everything else (Prefect,
registry, MLflow, scoring, I/O, model loading) is overhead. Target: overhead under 10%.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=750)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--home", default=None, help="RATCHET_HOME (default: a temporary directory)")
    args = parser.parse_args()
    home = args.home or tempfile.mkdtemp(prefix="ratchet-overhead-")
    os.environ["RATCHET_HOME"] = home
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

    from pipeline.advance import AdvanceConfig
    from pipeline.cli.advance import ensure_base_model, make_tracker
    from pipeline.lineage import init_lineage
    from pipeline.pair import CLOCK

    init_lineage(
        contract_path=ROOT / "contracts" / "demo.yaml",
        harness_path=ROOT / "harnesses" / "demo.yaml",
        model_path=ROOT / "models" / "tiny.yaml",
    )
    ensure_base_model("main")

    from prefect import flow

    from flows import advance_generation

    @flow(name="warm-up")
    def warm_up() -> int:
        return 1

    started = time.perf_counter()
    warm_up()
    prefect_start = time.perf_counter() - started

    config = AdvanceConfig(prompts_per_specialist=args.prompts, samples_per_prompt=args.samples)
    tracker = make_tracker()
    CLOCK.seconds, CLOCK.by_kind = 0.0, {}
    started = time.perf_counter()
    outcome = advance_generation(generations=1, config=config, tracker=tracker)[0]
    wall = time.perf_counter() - started
    compute = CLOCK.seconds
    print(
        f"one demo generation ({args.prompts} prompts x {args.samples} samples x 4 specialists): "
        f"{outcome['status']}"
    )
    print(f"  wall time            {wall:8.1f} s")
    for kind, seconds in sorted(CLOCK.by_kind.items()):
        print(f"  model compute: {kind:<8} {seconds:6.1f} s")
    print(
        f"  outside model compute {wall - compute:7.1f} s  -> share {(wall - compute) / wall:.1%}  (target < 10%)"
    )
    print(f"  one-time Prefect temporary server start: {prefect_start:.1f} s (not part of a generation)")


if __name__ == "__main__":
    main()
