"""Expert iteration on the tiny model, measured: does self-training improve held-out accuracy?

For each specialist (task family): sample training-split prompts from the current champion
(base + adapter) at temperature 0.7, keep the verified completions, ACCUMULATE them across generations,
train ~2 epochs over the accumulated set continuing the same LoRA, evaluate greedily on the held-out
suite. Prints held-out accuracy per generation and the wall time (base build included unless cached).

    .venv/bin/python bench/self_improve.py --seeds 0 1 --generations 3

The base and the LoRA recipe are models/tiny.yaml's (``--lr``/``--epochs`` try others); ``--threads``
fixes torch's CPU threads, which changes the base's weights (float sums in another order): the
recipe's comment in models/tiny.yaml compares bases built on 1 and 2 threads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import tempfile
import time
from pathlib import Path

from pipeline.environment import FAMILIES, collect, evaluate, heldout_suite, sample_prompts
from pipeline.environment.tinymodel import ensure_tiny_model
from pipeline.loop.candidate import AdvanceConfig
from pipeline.modeling.decoding import load_model
from pipeline.specs.modelspec import load_model_spec
from pipeline.training import TrainConfig, train_lora, write_dataset


def run_specialist(
    *, base_dir: Path, family: str, work: Path, generations: int, prompts: int, samples: int,
    heldout: int, seed: int, train: TrainConfig,
) -> list[dict]:  # fmt: skip
    suite = heldout_suite(family, heldout, seed=0)
    model, tok = load_model(base_dir)
    rows = [{"generation": 0, "heldout": evaluate(model, tok, suite).accuracy}]
    adapter, kept = None, []
    for gen in range(1, generations + 1):
        t0 = time.perf_counter()
        items = sample_prompts(family, prompts, seed=seed * 1000 + gen)
        got = collect(model, tok, items, num_samples=samples, temperature=0.7, seed=seed * 1000 + gen)
        kept.extend(got.traces)
        data = work / family / f"data-{gen}"
        write_dataset(kept, data)
        result = train_lora(
            base_model_dir=base_dir,
            dataset_dir=data,
            output_dir=work / family / f"gen-{gen}",
            config=train,
            parent_adapter_dir=adapter,
            lineage={"parent_generation": gen - 1, "family": family},
        )
        adapter = result.adapter_dir
        model, tok = load_model(base_dir, adapter)
        acc = evaluate(model, tok, suite).accuracy
        rows.append({
            "generation": gen, "heldout": acc, "sample_success": round(got.success_rate, 3),
            "kept_total": len(kept), "steps": result.steps, "seconds": round(time.perf_counter() - t0, 1),
        })  # fmt: skip
        logging.info("%s gen %d: %s", family, gen, rows[-1])
    return rows


SPEC = Path(__file__).resolve().parent.parent / "models" / "tiny.yaml"


def main() -> None:
    spec = load_model_spec(SPEC)
    recipe = spec.specialists["chat"].training
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--generations", type=int, default=3)
    parser.add_argument(
        "--prompts",
        type=int,
        default=AdvanceConfig.prompts_per_specialist,
        help="training prompts per specialist per generation",
    )
    parser.add_argument("--lr", type=float, default=recipe.lr)
    parser.add_argument("--epochs", type=float, default=recipe.epochs)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--heldout", type=int, default=300)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--cache", type=Path, default=Path(".ratchet/cache"))
    parser.add_argument("--base-seed", type=int, default=None, help="base model seed (default: the spec's)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    report = {}
    for seed in args.seeds:
        started = time.perf_counter()
        config = spec.base.tiny.to_tiny_model_config()
        if args.base_seed is not None:
            config = dataclasses.replace(config, seed=args.base_seed)
        base = ensure_tiny_model(config=config, cache_dir=args.cache / f"threads-{args.threads}")
        built = time.perf_counter() - started
        train = TrainConfig(
            lr=args.lr, epochs=args.epochs, batch_size=recipe.batch_size, seed=seed, checkpoint_every=1000
        )
        with tempfile.TemporaryDirectory() as tmp:
            per_family = {
                f: run_specialist(
                    base_dir=base,
                    family=f,
                    work=Path(tmp),
                    generations=args.generations,
                    prompts=args.prompts,
                    samples=args.samples,
                    heldout=args.heldout,
                    seed=seed,
                    train=train,
                )  # fmt: skip
                for f in args.families
            }
        total = time.perf_counter() - started
        report[seed] = {"base_build_s": round(built, 1), "total_s": round(total, 1), "families": per_family}
        print(f"\nseed {seed}: base build {built:.0f}s, total {total:.0f}s")
        for f, rows in per_family.items():
            print(f"  {f:7s} held-out: " + " -> ".join(f"{r['heldout']:.3f}" for r in rows))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
