"""Share of one demo generation's wall time spent outside model compute.

Usage: python bench/overhead.py [--prompts 3000] [--samples 4] [--home DIR] [--profile FILE]

Registers the demo lineage (building the tiny base if needed, not timed), warms the process up the
way any earlier generation in it would have (importing torch, transformers, peft, datasets, mlflow and
scipy.stats, and loading the base once; timed and printed separately, like the one-time start of Prefect's temporary
server by a warm-up flow), then runs one `advance_generation` flow exactly as `ratchet advance` does
(Prefect tasks, SQLite registry, MLflow tracking). Model compute is the time spent inside generation
(discovery, collection, co-design, held-out and retention evaluation), LoRA training and the teacher-forced
forwards of the KL measurement; contract scoring (running the scorers, including sandboxed test runs of
model-written code, wherever a step scores) is reported on its own line; everything else (Prefect, registry,
MLflow, I/O, tokenization, model loading) is the overhead. Target: overhead under 5%.

Per step it prints the step's wall time (what ``advance`` records in the candidate's ``state["seconds"]``)
split the same way, and the time between steps (Prefect's task runs, the lease, the decision's artifacts).
``--profile FILE`` also runs the generation under cProfile (main thread; scorer threads are not in it),
writes its pstats to FILE and prints the project's functions by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
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
    parser.add_argument("--profile", default=None, help="write the generation's cProfile stats (pstats) here")
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
    steps = observe_steps()
    profile = cProfile.Profile() if args.profile else None
    CLOCK.reset()
    started = time.perf_counter()
    if profile is not None:
        profile.enable()
    outcome = advance_generation(generations=1, config=config, tracker=tracker)[0]
    if profile is not None:
        profile.disable()
    wall = time.perf_counter() - started
    compute = CLOCK.total(*COMPUTE)
    scoring = CLOCK.total("score")
    print(
        f"one demo generation ({args.prompts} prompts x {args.samples} samples x 4 specialists): "
        f"{outcome['status']}"
    )
    rest = wall - compute - scoring
    print(f"  wall time                  {wall:8.1f} s")
    for kind in COMPUTE:
        print(f"  model compute: {kind:<10} {CLOCK.total(kind):8.1f} s")
    print(f"  contract scoring           {scoring:8.1f} s  (scorers, sandboxed runs of model-written code)")
    print(f"  everything else            {rest:8.1f} s  -> {rest / wall:.1%} of the generation (target < 5%)")
    print(
        "    (Prefect tasks, registry reads and writes, MLflow tracking, datasets and adapters on disk, model loading)"
    )
    print_steps(steps, wall)
    print(f"  one-time Prefect temporary server start: {prefect_start:.1f} s (not part of a generation)")
    print(
        f"  one-time library imports and first model load: {imports:.1f} s (not part of a generation; "
        "a cold process's first generation pays it)"
    )
    if profile is not None:
        profile.dump_stats(args.profile)
        print(
            f"\ncProfile of the generation (main thread) written to {args.profile}; the project's functions:"
        )
        pstats.Stats(args.profile).sort_stats("cumulative").print_stats(r"(pipeline|flows\.py)", 40)


COMPUTE = ("generate", "train", "forward")  # forward: the teacher-forced passes of the KL measurement
KINDS = (*COMPUTE, "score")


def observe_steps() -> list[tuple[str, float, dict[str, float]]]:
    """``(step, wall seconds, CLOCK's totals when it ended)`` of each step, in order: what ``advance``
    records of a step's time (``record_seconds``) seen on its way to the registry."""
    from pipeline.loop import advance
    from pipeline.loop.clock import CLOCK

    seen: list[tuple[str, float, dict[str, float]]] = []
    record = advance.record_seconds

    def observed(generation_id: int, step: str, seconds: float) -> None:
        seen.append((str(step), seconds, dict(CLOCK.by_kind)))
        record(generation_id, step, seconds)

    advance.record_seconds = observed
    return seen


def print_steps(steps: list[tuple[str, float, dict[str, float]]], wall: float) -> None:
    """Each step's wall time split into model compute, contract scoring and the rest; then between steps."""
    print(
        f"  per step          {'wall':>8} {'generate':>9} {'train':>7} {'forward':>8} {'score':>7} {'rest':>7}"
    )
    before: dict[str, float] = {}
    for step, seconds, clock in steps:
        spent = {k: clock.get(k, 0.0) - before.get(k, 0.0) for k in KINDS}
        rest = seconds - sum(spent.values())
        print(
            f"    {step:<14} {seconds:8.1f} {spent['generate']:9.1f} {spent['train']:7.1f} "
            f"{spent['forward']:8.1f} {spent['score']:7.1f} {rest:7.1f}"
        )
        before = clock
    between = wall - sum(seconds for _, seconds, _ in steps)
    print(f"    {'between steps':<14} {between:8.1f} {'':>9} {'':>7} {'':>8} {'':>7} {between:7.1f}")


def warm_up_libraries() -> None:
    """What the first generation of a process pays once: heavy imports and a first load of the base."""
    import datasets  # noqa: F401
    import mlflow  # noqa: F401
    import peft  # noqa: F401
    import scipy.stats  # noqa: F401 - the promotion gate's t quantile (``promotion.t_quantile``): ~1.8 s once

    from pipeline.modeling.decoding import load_model
    from pipeline.registry import get_champion, get_engine, session_scope

    with session_scope(get_engine()) as session:
        base_dir = Path(get_champion(session=session, lineage="main").base_model.path)
    load_model(base_dir)  # imports the architecture's modules and the tokenizer's; not kept


if __name__ == "__main__":
    main()
