"""Share of one demo generation's wall time spent outside model compute.

Usage: python bench/overhead.py [--prompts 3000] [--samples 4] [--home DIR]

Registers the demo lineage (building the tiny base if needed, not timed), warms the process up the
way any earlier generation in it would have (importing torch, transformers, peft, datasets and mlflow
and loading the base once; timed and printed separately, like the one-time start of Prefect's temporary
server by a warm-up flow), then runs one `advance_generation` flow exactly as `ratchet advance` does
(Prefect tasks, SQLite registry, MLflow tracking). Model compute is the time spent inside generation (collection, co-design,
held-out evaluation) and LoRA training; contract scoring (running the scorers, including sandboxed
test runs of model-written code) is reported on its own line; everything else (Prefect, registry,
MLflow, I/O, model loading) is the overhead. Target: overhead under 10%.
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

from pipeline.loop.candidate import AdvanceConfig  # noqa: E402 - light: dataclasses only


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=AdvanceConfig.prompts_per_specialist)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--home", default=None, help="RATCHET_HOME (default: a temporary directory)")
    args = parser.parse_args()
    home = args.home or tempfile.mkdtemp(prefix="ratchet-overhead-")
    os.environ["RATCHET_HOME"] = home
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

    from pipeline.cli.advance import ensure_base_model, make_tracker
    from pipeline.loop.clock import CLOCK
    from pipeline.loop.founding import init_lineage

    init_lineage(
        contract_path=ROOT / "contracts" / "demo.yaml",
        harness_path=ROOT / "harnesses" / "demo.yaml",
        model_path=ROOT / "models" / "tiny.yaml",
    )
    ensure_base_model("main")

    started = time.perf_counter()
    warm_up_libraries()
    imports = time.perf_counter() - started

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
    CLOCK.reset()
    started = time.perf_counter()
    outcome = advance_generation(generations=1, config=config, tracker=tracker)[0]
    wall = time.perf_counter() - started
    compute = CLOCK.total("generate", "train")
    scoring = CLOCK.total("score")
    print(
        f"one demo generation ({args.prompts} prompts x {args.samples} samples x 4 specialists): "
        f"{outcome['status']}"
    )
    rest = wall - compute - scoring
    print(f"  wall time                  {wall:8.1f} s")
    for kind in ("generate", "train"):
        print(f"  model compute: {kind:<10} {CLOCK.total(kind):8.1f} s")
    print(f"  contract scoring           {scoring:8.1f} s  (scorers, sandboxed runs of model-written code)")
    print(
        f"  everything else            {rest:8.1f} s  -> {rest / wall:.1%} of the generation (target < 10%)"
    )
    print(
        "    (Prefect tasks, registry reads and writes, MLflow tracking, datasets and adapters on disk, model loading)"
    )
    print(f"  one-time Prefect temporary server start: {prefect_start:.1f} s (not part of a generation)")
    print(
        f"  one-time library imports and first model load: {imports:.1f} s (not part of a generation; "
        "a cold process's first generation pays it)"
    )


def warm_up_libraries() -> None:
    """What the first generation of a process pays once: heavy imports and a first load of the base."""
    import datasets  # noqa: F401
    import mlflow  # noqa: F401
    import peft  # noqa: F401

    from pipeline.modeling.decoding import load_model
    from pipeline.registry import get_champion, get_engine, session_scope

    with session_scope(get_engine()) as session:
        base_dir = Path(get_champion(session=session, lineage="main").base_model.path)
    load_model(base_dir)  # imports the architecture's modules and the tokenizer's; not kept


if __name__ == "__main__":
    main()
