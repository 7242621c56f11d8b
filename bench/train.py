"""LoRA SFT throughput: our packed training step vs a plain Hugging Face ``Trainer`` with padding.

After an untimed three-step warm-up, same tiny model, same LoRA (r=16, all linear layers), same curated data (environment traces of all four
families, 11-45 tokens, so padding to the longest in a batch wastes a lot), same batch size, learning
rate and number of optimizer steps, measured side by side in one run. Prints non-padding tokens/s for
both, the ratio (target >= 1.5x) and the loss of each trained adapter on the same evaluation batch
(ours should be within 5% of the baseline).

    .venv/bin/python bench/train.py [--steps 60]
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def eval_loss(base_dir: Path, adapter_dir: Path, examples: list, pad_id: int) -> float:
    """Mean assistant-token loss of base + adapter on ``examples`` (packed, no cross-attention)."""
    import torch

    from pipeline.decoding import load_model
    from pipeline.packing import packed_tensors

    model, _ = load_model(base_dir, adapter_dir)
    with torch.inference_mode():
        batch = packed_tensors(examples, 128, pad_id)
        return float(model(**batch, use_cache=False).loss)


def run_baseline(base_dir: Path, examples: list, tokenizer, args, out: Path) -> tuple[float, int, Path]:
    """HF Trainer + DataCollatorForSeq2Seq (pad to longest); returns (seconds, real tokens, adapter dir)."""
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, Trainer, TrainingArguments

    from pipeline.decoding import attn_implementation_for
    from pipeline.training import ALL_LINEAR

    tokenizer.padding_side = "right"
    base = AutoModelForCausalLM.from_pretrained(
        base_dir, attn_implementation=attn_implementation_for(base_dir)
    )
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(ALL_LINEAR),
                                            task_type="CAUSAL_LM"))  # fmt: skip
    data = Dataset.from_list([{"input_ids": ids, "labels": labels} for ids, labels in examples])
    pad = DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=-100)
    seen = [0]

    def collate(features):
        batch = pad(features)
        seen[0] += int(batch["attention_mask"].sum())
        return batch

    targs = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=args.batch_size, max_steps=args.steps,
        learning_rate=args.lr, lr_scheduler_type="constant_with_warmup", warmup_steps=10, weight_decay=0.0,
        max_grad_norm=1.0, logging_steps=10, save_strategy="no", report_to="none", use_cpu=True,
        dataloader_num_workers=0, seed=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(model=model, args=targs, train_dataset=data, data_collator=collate)
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    model.save_pretrained(out / "adapter")
    return seconds, seen[0], out / "adapter"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--cache", type=Path, default=Path(".ratchet/cache"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from transformers import AutoTokenizer

    from pipeline.environment import training_corpus
    from pipeline.packing import encode_chat
    from pipeline.tinymodel import TinyModelConfig, ensure_tiny_model
    from pipeline.training import TrainConfig, train_lora, write_dataset

    base_dir = ensure_tiny_model(config=TinyModelConfig(), cache_dir=args.cache)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    traces = training_corpus(2000, seed=7)
    examples = [encode_chat(tokenizer, t["messages"], 128) for t in traces]
    held = [encode_chat(tokenizer, t["messages"], 128) for t in training_corpus(256, seed=8)]
    lengths = sorted(len(ids) for ids, _ in examples)
    print(f"data: {len(examples)} examples, tokens per example min {lengths[0]} median "
          f"{lengths[len(lengths) // 2]} max {lengths[-1]}; {args.steps} steps x {args.batch_size}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_dataset(traces, tmp / "data")
        config = TrainConfig(lr=args.lr, max_steps=args.steps, batch_size=args.batch_size, warmup_steps=10,
                             checkpoint_every=10**9)  # fmt: skip
        # Warm the process up first (torch's first-call costs), so that neither side pays them for the other.
        train_lora(base_model_dir=base_dir, dataset_dir=tmp / "data", output_dir=tmp / "warm-up",
                   config=TrainConfig(max_steps=3, batch_size=args.batch_size, checkpoint_every=10**9))  # fmt: skip
        ours = train_lora(
            base_model_dir=base_dir, dataset_dir=tmp / "data", output_dir=tmp / "ours", config=config
        )
        base_s, base_tokens, base_adapter = run_baseline(base_dir, examples, tokenizer, args, tmp / "hf")
        ours_loss = eval_loss(base_dir, ours.adapter_dir, held, tokenizer.pad_token_id)
        base_loss = eval_loss(base_dir, base_adapter, held, tokenizer.pad_token_id)
    base_tps = base_tokens / base_s
    print(f"ours (packed):      {ours.tokens_per_second:9.0f} non-padding tokens/s  {ours.seconds:6.1f}s  "
          f"eval loss {ours_loss:.4f}")  # fmt: skip
    print(
        f"HF Trainer (padded): {base_tps:8.0f} non-padding tokens/s  {base_s:6.1f}s  eval loss {base_loss:.4f}"
    )
    print(f"throughput ratio: {ours.tokens_per_second / base_tps:.2f}x (target >= 1.5x); "
          f"loss ratio {ours_loss / base_loss:.3f} (target within 5%)")  # fmt: skip


if __name__ == "__main__":
    main()
