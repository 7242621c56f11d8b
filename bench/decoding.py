"""Sampling throughput: our batched decoding loop vs transformers' ``model.generate``, same prompts.

Tiny model, environment prompts of all four families, ``k`` samples per prompt at temperature 0.7,
the same batch size and ``max_new_tokens`` for both. Prints sequences/s for both and the ratio, and
the time ours needs for the demo's per-generation load (3,000 prompts x 4 samples).

    .venv/bin/python bench/decoding.py [--prompts 400]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=400)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--cache", type=Path, default=Path(".ratchet/cache"))
    args = parser.parse_args()
    import torch

    from pipeline.environment import FAMILIES, sample_prompts
    from pipeline.environment.tinymodel import TinyModelConfig, ensure_tiny_model
    from pipeline.modeling.decoding import SamplingConfig, generate, load_model
    from pipeline.modeling.templating import encode_prompt

    model, tok = load_model(ensure_tiny_model(config=TinyModelConfig(), cache_dir=args.cache))
    per = max(1, args.prompts // len(FAMILIES))
    prompts = [encode_prompt(tok, i["messages"]) for f in FAMILIES for i in sample_prompts(f, per, seed=0)]
    config = SamplingConfig(
        num_samples=args.samples, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size
    )
    n = len(prompts) * args.samples

    started = time.perf_counter()
    generate(model, tok, prompts, config)
    ours = time.perf_counter() - started

    started = time.perf_counter()
    per_batch = max(1, args.batch_size // args.samples)
    with torch.inference_mode():
        for at in range(0, len(prompts), per_batch):
            batch = tok.pad({"input_ids": prompts[at : at + per_batch]}, padding=True, return_tensors="pt")
            model.generate(**batch, do_sample=True, temperature=0.7, top_p=1.0, top_k=0,
                           num_return_sequences=args.samples, max_new_tokens=args.max_new_tokens,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    theirs = time.perf_counter() - started
    print(f"ours:             {n / ours:8.0f} sequences/s ({ours:.1f}s for {n})")
    print(f"model.generate:   {n / theirs:8.0f} sequences/s ({theirs:.1f}s)")
    print(f"ratio: {theirs / ours:.2f}x; demo load 3,000 x 4 at our rate: {12000 / (n / ours):.1f}s")


if __name__ == "__main__":
    main()
