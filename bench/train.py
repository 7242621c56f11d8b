"""LoRA SFT throughput: our packed training step vs the strongest Hugging Face ``Trainer`` set-ups, one run.

    .venv/bin/python bench/train.py [--model tiny|real|all] [--steps N] [--batch-size N] [--threads 1]

On each model (``--model all``, the default, runs both and prints both):

- ``tiny``: the demo's tiny char-level Llama (``ensure_tiny_model``), 2,000 curated environment traces
  of all four families (a few dozen tokens each), 60 steps x 64 examples, 10-step linear warm-up;
- ``real``: real proportions (``bench/realproportions.py``: Qwen3-0.6B-shaped layers, fewer of them, a
  32,768-token byte-level BPE vocabulary, ChatML), traces of 30-400 tokens (log-uniform) cut from local
  text, 10 steps x 8 examples: one epoch, so every run trains on exactly the same 80 examples; constant
  learning rate.

Four trainings of the same LoRA (r=16, alpha 32, all linear layers) on the same base weights and data,
with the same batch size, learning rate and schedule, gradient clipping (1.0) and number of optimizer steps:

1. ours: ``pipeline.training.train_lora`` (packed rows, one autograd function per LoRA linear, logits
   only at labelled positions, fused AdamW);
2. HF ``Trainer`` + ``DataCollatorForSeq2Seq`` (pad to the longest of each batch): the default;
3. HF ``Trainer`` with ``train_sampling_strategy="group_by_length"`` (batches of similar lengths, less
   padding);
4. HF ``Trainer`` + ``DataCollatorWithFlattening`` (padding-free: a batch is one row, positions restart
   per example, no attention across examples).

The HF runs use peft's LoRA, sdpa attention (``--hf-attn``; on CPU it is as fast as eager or faster for
every baseline, and far faster for the flattened rows), fused AdamW (transformers' default) and
``use_cache=False``; ours uses the model's own attention (eager for the tiny model). The first
``--untimed`` optimizer steps of every run are a warm-up outside the clock; the rest is timed step by step
(wall and process CPU time). Prints non-padding tokens/s of each, the ratio of ours to each and to the
fastest baseline (target >= 1.5x), the loss of each trained adapter on the same held-out examples (ours
within 2% of each baseline's) beside the untrained base's, and the load average as each run ended.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BASELINES = {
    "padded": "HF Trainer, padded",
    "grouped": "HF Trainer, group_by_length",
    "flattened": "HF Trainer, flattening",
}


@dataclass
class Setup:
    name: str
    base_dir: Path
    traces: list[dict[str, Any]]
    held: list[dict[str, Any]]
    steps: int
    batch_size: int
    untimed: int
    warmup_steps: int
    eval_batch: int


@dataclass
class Timed:
    """Timed steps of one training run: non-padding tokens, wall and CPU seconds."""

    tokens: int
    wall: float
    cpu: float
    adapter: Path
    load: float = 0.0  # 1-minute load average when the run ended (the machine is shared)

    def __post_init__(self) -> None:
        self.load = os.getloadavg()[0]

    @property
    def tps(self) -> float:
        return self.tokens / self.wall

    @property
    def tps_cpu(self) -> float:
        return self.tokens / self.cpu


def setups(args: argparse.Namespace) -> list[Setup]:
    from transformers import AutoTokenizer

    out = []
    if args.model in ("tiny", "all"):
        from pipeline.environment import training_corpus
        from pipeline.environment.tinymodel import TinyModelConfig, ensure_tiny_model

        base = ensure_tiny_model(config=TinyModelConfig(), cache_dir=args.cache)
        out.append(Setup("tiny", base, training_corpus(2000, seed=7), training_corpus(256, seed=8),
                         args.steps or 60, args.batch_size or 64, args.untimed, 10, 256))  # fmt: skip
    if args.model in ("real", "all"):
        from bench.realproportions import ensure_real_model, traces

        base = ensure_real_model(args.cache)
        tok = AutoTokenizer.from_pretrained(base)
        steps, batch = args.steps or 10, args.batch_size or 8
        # one epoch: every run trains on exactly the same examples, once each (in its own order)
        out.append(Setup("real", base, traces(tok, steps * batch, seed=7), traces(tok, 32, seed=8, held_out=True),
                         steps, batch, args.untimed, 0, 8))  # fmt: skip
    return out


def run_ours(setup: Setup, examples: list, args, out: Path) -> Timed:
    """``train_lora`` on the traces; the clock reads at each step's end (``progress``)."""
    from pipeline.training import TrainConfig, batch_indices, train_lora, write_dataset

    write_dataset(setup.traces, out / "data")
    marks: list[tuple[float, float]] = []
    config = TrainConfig(lr=args.lr, max_steps=setup.steps, batch_size=setup.batch_size,
                         warmup_steps=max(1, setup.warmup_steps), checkpoint_every=10**9)  # fmt: skip
    result = train_lora(
        base_model_dir=setup.base_dir,
        dataset_dir=out / "data",
        output_dir=out / "ours",
        config=config,
        progress=lambda *_: marks.append((time.perf_counter(), time.process_time())),
    )
    tokens = sum(
        len(examples[i][0])
        for step in range(setup.untimed, setup.steps)
        for i in batch_indices(len(examples), setup.batch_size, step, config.seed)
    )
    (w0, c0), (w1, c1) = marks[setup.untimed - 1], marks[-1]
    return Timed(tokens, w1 - w0, c1 - c0, result.adapter_dir)


def run_hf(setup: Setup, kind: str, examples: list, tokenizer, args, out: Path) -> Timed:
    """HF Trainer + peft LoRA, with the collator and sampler of ``kind`` (see ``BASELINES``)."""
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import (
        AutoModelForCausalLM,
        DataCollatorForSeq2Seq,
        DataCollatorWithFlattening,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from pipeline.modeling.decoding import attn_implementation_for
    from pipeline.training import ALL_LINEAR

    tokenizer.padding_side = "right"
    attn = attn_implementation_for(setup.base_dir) if args.hf_attn == "model" else args.hf_attn
    base = AutoModelForCausalLM.from_pretrained(
        setup.base_dir, **({"attn_implementation": attn} if attn else {})
    )
    base.config.use_cache = False
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(ALL_LINEAR),
                                            task_type="CAUSAL_LM"))  # fmt: skip
    data = Dataset.from_list([{"input_ids": ids, "labels": labels} for ids, labels in examples])
    if kind == "flattened":
        inner = DataCollatorWithFlattening()
    else:
        inner = DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=-100)
    seen: list[int] = []  # non-padding tokens of each batch, in order (batch k is optimizer step k)

    def collate(features):
        seen.append(sum(len(f["input_ids"]) for f in features))
        return inner(features)

    marks: list[tuple[float, float]] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_a, **_k):
            marks.append((time.perf_counter(), time.process_time()))

    targs = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=setup.batch_size, max_steps=setup.steps,
        learning_rate=args.lr, warmup_steps=setup.warmup_steps,
        lr_scheduler_type="constant_with_warmup" if setup.warmup_steps else "constant",
        weight_decay=0.0, max_grad_norm=1.0, logging_strategy="no", save_strategy="no", report_to="none",
        use_cpu=True, dataloader_num_workers=0, seed=0, disable_tqdm=True,
        train_sampling_strategy="group_by_length" if kind == "grouped" else "random",
    )  # fmt: skip
    trainer = Trainer(model=model, args=targs, train_dataset=data, data_collator=collate, callbacks=[Clock()])
    trainer.train()
    model.save_pretrained(out / "adapter")
    (w0, c0), (w1, c1) = marks[setup.untimed - 1], marks[-1]
    return Timed(sum(seen[setup.untimed : setup.steps]), w1 - w0, c1 - c0, out / "adapter")


def eval_loss(base_dir: Path, adapter_dir: Path | None, examples: list, pad_id: int, chunk: int) -> float:
    """Mean assistant-token loss (transformers' own) of base (+ adapter) on ``examples``, packed in chunks."""
    import torch

    from pipeline.modeling.decoding import load_model
    from pipeline.modeling.packing import packed_tensors

    model, _ = load_model(base_dir, adapter_dir)
    total = count = 0.0
    with torch.inference_mode():
        for i in range(0, len(examples), chunk):
            batch = packed_tensors(examples[i : i + chunk], 4096, pad_id)
            n = int((batch["labels"][:, 1:] != -100).sum())
            total += float(model(**batch, use_cache=False).loss) * n
            count += n
    return total / count


def bench(setup: Setup, args) -> None:
    from transformers import AutoTokenizer

    from pipeline.modeling.packing import encode_chat
    from pipeline.training.job import sequence_limit

    tokenizer = AutoTokenizer.from_pretrained(setup.base_dir)
    max_len = sequence_limit(setup.base_dir)
    examples = [encode_chat(tokenizer, t["messages"], max_len) for t in setup.traces]
    held = [encode_chat(tokenizer, t["messages"], max_len) for t in setup.held]
    lengths = sorted(len(ids) for ids, _ in examples)
    labelled = sum(sum(x != -100 for x in labs) for _, labs in examples) / sum(lengths)
    print(f"\n== {setup.name}: {setup.base_dir.name}, {setup.steps} steps x {setup.batch_size} examples "
          f"({setup.untimed} untimed); {len(examples)} examples of {lengths[0]}-{lengths[-1]} tokens "
          f"(median {lengths[len(lengths) // 2]}, {labelled:.0%} labelled), {len(held)} held out")  # fmt: skip
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        runs = {"ours": run_ours(setup, examples, args, tmp)}
        for kind in BASELINES:
            runs[kind] = run_hf(setup, kind, examples, tokenizer, args, tmp / kind)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        base_loss = eval_loss(setup.base_dir, None, held, pad, setup.eval_batch)
        losses = {
            name: eval_loss(setup.base_dir, r.adapter, held, pad, setup.eval_batch)
            for name, r in runs.items()
        }
    ours = runs["ours"]
    print(
        f"{'':30s} {'tok/s wall':>10s} {'tok/s cpu':>10s} {'timed s':>8s} {'load':>5s} {'eval loss':>9s}   ours vs it"
    )
    for name, label in {"ours": "ours (packed)", **BASELINES}.items():
        r = runs[name]
        vs = (
            f"{ours.tps / r.tps:5.2f}x wall {ours.tps_cpu / r.tps_cpu:5.2f}x cpu, loss ratio "
            f"{losses['ours'] / losses[name]:.3f}"
            if name != "ours"
            else ""
        )
        print(
            f"{label:30s} {r.tps:10.0f} {r.tps_cpu:10.0f} {r.wall:8.1f} {r.load:5.1f} {losses[name]:9.4f}   {vs}"
        )
    fastest = max(BASELINES, key=lambda k: runs[k].tps)
    ratio = ours.tps / runs[fastest].tps
    worst = max(abs(losses["ours"] / losses[k] - 1) for k in BASELINES)
    above = max(losses["ours"] / losses[k] - 1 for k in BASELINES)  # > 0: ours trained worse than one
    cpu_ratio = ours.tps_cpu / runs[fastest].tps_cpu
    print(f"untrained base eval loss {base_loss:.4f}")
    print(f"{setup.name}: ours vs the fastest baseline ({BASELINES[fastest]}): {ratio:.2f}x wall, "
          f"{cpu_ratio:.2f}x cpu (target >= 1.5x: {'met' if ratio >= 1.5 else 'MISSED'}); eval loss within "
          f"{worst:.1%} of every baseline's (target 2%: {'met' if worst <= 0.02 else 'MISSED'}), at most "
          f"{max(above, 0):.1%} above any; {time.perf_counter() - started:.0f} s")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=("tiny", "real", "all"), default="all")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (tiny 60, real 10)")
    parser.add_argument("--batch-size", type=int, default=None, help="examples per step (tiny 64, real 8)")
    parser.add_argument("--untimed", type=int, default=2, help="warm-up steps of every run, not timed")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument(
        "--hf-attn",
        choices=("sdpa", "eager", "model"),
        default="sdpa",
        help="attention of the HF runs (model: what the model directory asks for, eager for the tiny model)",
    )
    parser.add_argument("--cache", type=Path, default=Path(".ratchet/cache"))
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (0: torch's own). 1 by default: on a shared machine more threads measure the "
        "neighbours (each op waits for a descheduled OpenMP thread), not the code",
    )
    args = parser.parse_args()
    if args.untimed < 1:
        parser.error("--untimed must be at least 1 (the clock starts at the end of the last untimed step)")
    logging.basicConfig(level=logging.WARNING)
    import torch

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for setup in setups(args):
        bench(setup, args)


if __name__ == "__main__":
    main()
