"""Training methods compared: one generation from the same parent and the same experience with sft, dpo and grpo.

The demo's tiny base (models/tiny.yaml, cached), a fresh registry, and generation 0 (or the champion after
``--parent-after`` ordinary generations) as the parent. Discovery, collection and scoring run once; then, for
each method, a candidate with every specialist on that method (the model spec's settings for it) is curated,
trained and evaluated against the parent on the contract's held-out suites (co-design off, so the harness is
the same). Prints, per method, the held-out gain with its 95% interval, per specialist, and the wall time of
the method's own steps (curate + train + evaluate; grpo samples its own rollouts inside train).

    .venv/bin/python bench/methods.py                   # sft, dpo, grpo from generation 0, seed 0
    .venv/bin/python bench/methods.py --parent-after 1 --seed 1 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--methods", nargs="+", default=["sft", "dpo", "grpo"], choices=["sft", "dpo", "grpo"]
    )
    parser.add_argument(
        "--spec", type=Path, default=ROOT / "models" / "tiny.yaml", help="settings per method"
    )
    parser.add_argument("--prompts", type=int, default=None, help="collection prompts per specialist")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parent-after", type=int, default=0, help="ordinary (sft) generations before")
    parser.add_argument("--specialists", nargs="+", default=None, help="only these specialists (default all)")
    parser.add_argument("--cache", type=Path, default=ROOT / ".ratchet" / "cache")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    home = Path(tempfile.mkdtemp(prefix="ratchet-methods-"))
    os.environ["RATCHET_HOME"] = str(home)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

    from pipeline.environment.tinymodel import ensure_tiny_model
    from pipeline.loop.candidate import AdvanceConfig
    from pipeline.settings import apply_torch_threads
    from pipeline.specs.modelspec import load_model_spec

    apply_torch_threads()
    spec = load_model_spec(args.spec)
    started = time.perf_counter()
    base = ensure_tiny_model(config=spec.base.tiny.to_tiny_model_config(), cache_dir=args.cache)
    print(f"base {base} ready in {time.perf_counter() - started:.0f}s; registry under {home}")
    raw = yaml.safe_load(args.spec.read_text())
    raw["base"] = {"path": str(base)}
    if args.specialists:
        raw["specialists"] = {s: raw["specialists"][s] for s in args.specialists}
    config = AdvanceConfig(seed=args.seed, codesign=False)
    if args.prompts:
        config = dataclasses.replace(config, prompts_per_specialist=args.prompts)
    results = run(raw, config, home=home, methods=args.methods, parent_after=args.parent_after)
    print_results(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


def with_method(raw: dict, method: str) -> dict:
    spec = json.loads(json.dumps(raw))
    for entry in spec["specialists"].values():
        entry["method"] = method
    return spec


def run(raw: dict, config, *, home: Path, methods: list[str], parent_after: int) -> dict:
    from pipeline.cli.advance import make_tracker
    from pipeline.loop.advance import advance_once, run_steps
    from pipeline.loop.candidate import done_steps, mark_step
    from pipeline.loop.founding import init_lineage
    from pipeline.loop.promotion import t_quantile
    from pipeline.registry import (
        create_generation,
        get_champion,
        get_engine,
        register_base_model,
        session_scope,
        set_generation_status,
    )

    specs = home / "specs"
    specs.mkdir()
    model_path = specs / "model.yaml"
    model_path.write_text(yaml.safe_dump(with_method(raw, "sft")))
    init_lineage(
        contract_path=ROOT / "contracts" / "demo.yaml",
        harness_path=ROOT / "harnesses" / "demo.yaml",
        model_path=model_path,
    )
    tracker = make_tracker()
    for _ in range(parent_after):
        print(advance_once(config=config, tracker=tracker)["decision"])
    engine = get_engine()
    shared: dict = {}
    results: dict = {"parent_after": parent_after, "seed": config.seed, "methods": {}}
    for method in methods:
        with session_scope(engine) as session:
            champion = get_champion(session=session, lineage=config.lineage)
            variant = register_base_model(
                session=session,
                name=f"tiny-bench-{method}",
                path=champion.base_model.path,
                spec=with_method(raw, method),
            )
            gen = create_generation(
                session=session,
                lineage=config.lineage,
                base_model_id=variant.id,
                harness_version_id=champion.harness_version_id,
                contract_version_id=champion.contract_version_id,
                specialists=[a.specialist for a in champion.adapters],
                adapters={a.specialist: a.adapter_id for a in champion.adapters},
                parent_id=champion.id,
                state={"steps": {}, "config": config.__dict__},
            )
            generation_id = gen.id
            for step, outcome in shared.items():  # the same discovered variants and experience
                mark_step(session, gen, step, outcome)
        if not shared:
            began = time.perf_counter()
            run_steps(("discover", "collect", "score"), generation_id=generation_id, config=config)
            shared = {
                s: o for s, o in done_steps(generation_id).items() if s in ("discover", "collect", "score")
            }
            results["shared_s"] = round(time.perf_counter() - began, 1)
            results["shared"] = {"collect": shared["collect"], "discover": shared["discover"]}
        began = time.perf_counter()
        timings = {}
        for step in ("curate", "train", "codesign", "evaluate"):
            t0 = time.perf_counter()
            run_steps((step,), generation_id=generation_id, config=config, tracker=tracker)
            timings[step] = round(time.perf_counter() - t0, 1)
        wall = time.perf_counter() - began
        with session_scope(engine) as session:
            from pipeline.loop.candidate import load_generation

            gen = load_generation(session, generation_id)
            ev = gen.evaluation
            set_generation_status(
                session=session, generation=gen, status="rejected", reason=f"bench: {method}"
            )
        comparison = ev["comparison"]
        half = t_quantile(0.975, comparison["df"] or float("inf")) * comparison["se"]
        results["methods"][method] = {
            "delta": comparison["delta"],
            "interval": [comparison["delta"] - half, comparison["delta"] + half],
            "parent": comparison["champion_overall"],
            "candidate": comparison["candidate_overall"],
            "specialists": {
                s: {"parent": c["champion"], "candidate": c["candidate"], "delta": c["delta"]}
                for s, c in comparison["specialists"].items()
            },
            "discovery": ev.get("discovery"),
            "wall_s": round(wall, 1),
            "steps_s": timings,
        }
        print(f"{method}: {json.dumps(results['methods'][method])}")
    return results


def print_results(results: dict) -> None:
    print(
        f"\nparent: generation after {results['parent_after']} sft generation(s), seed {results['seed']}; "
        f"shared discovery + collection + scoring {results.get('shared_s')}s"
    )
    print(f"{'method':6s} {'held-out gain':>14s} {'95% interval':>20s} {'wall s':>7s}   per specialist")
    for method, r in results["methods"].items():
        lo, hi = r["interval"]
        per = "  ".join(f"{s} {v['delta']:+.3f}" for s, v in sorted(r["specialists"].items()))
        print(f"{method:6s} {r['delta']:+14.3f} {f'[{lo:+.3f}, {hi:+.3f}]':>20s} {r['wall_s']:7.0f}   {per}")


if __name__ == "__main__":
    main()
