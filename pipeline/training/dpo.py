"""The DPO job: setup, train, save, clean up -- in that order, in this one file.

``train_dpo`` fine-tunes one LoRA adapter by direct preference optimisation (Rafailov et al., 2023) on
preference pairs curated from contract-scored experience (``pipeline.experience.preferences``): each row is two
conversations with the same context, the preferred reply (``messages``) and the other (``rejected``). The
policy starts from the parent's adapter and the reference is the parent pair itself (its adapter merged into
a frozen copy of the base; the bare base when there is no parent), so the implicit KL holds the successor to
its parent. The loss per pair is ``-log sigmoid(beta * ((log pi(y+) - log ref(y+)) - (log pi(y-) -
log ref(y-))))`` over the reply's tokens (only the final assistant turn is labelled, as in SFT), plus
``sft_weight`` times the preferred reply's mean negative log-likelihood (RPO), which keeps pure DPO from
lowering the preferred reply's probability along with the other's.

Why not TRL's ``DPOTrainer`` (``docs/methods.md``, *Training methods*): its checkpoints keep optimizer, scheduler
and RNG state as pickles, which no training artifact of Ratchet is ever read through (``checkpoint``); and a
pair must be rendered exactly as SFT and serving render it (``templating.encode_chat``: the harness's tool-call
format, tool schemas to the template, non-prefix-stable templates), which this job shares with SFT instead
of a second tokenisation path -- and a side whose reply the server decoded with this tokenizer is not
rendered at all: it is the ids served (``job.encode_row``, ``packing.encode_reply``), each side on its own. The loss is the paper's and is checked against a direct computation in
``tests/test_preference.py``.

Batches are packed (chosen and rejected of every pair of the batch in one forward, no padding compute), each
LoRA linear takes the fast path of ``kernels.merged_lora``, reference log-probabilities are computed once
before training, checkpoints are those of the SFT job (safetensors + JSON, resumed from the newest intact
one), and the adapter is saved atomically with ``lineage.json`` (``artifacts.save_adapter``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.errors import RatchetError
from pipeline.modeling.placement import placement
from pipeline.modeling.templating import IGNORE
from pipeline.specs.loading import content_hash, weights_sha256
from pipeline.training.artifacts import save_adapter, stored_dataset_sha256
from pipeline.training.checkpoint import resume, save_checkpoint
from pipeline.training.job import (
    LOSS_POINTS,
    NO_TARGET,
    ROW_ERRORS,
    TrainResult,
    batch_indices,
    count,
    encode_row,
    finish,
    finished_before,
    git_describe,
    log_dropped,
    log_token_ids,
    sequence_limit,
    skip_reason,
)
from pipeline.training.kernels import merged_lora
from pipeline.training.likelihood import optimizer, policy_model, reference_model, sequence_logprobs

if TYPE_CHECKING:
    from pipeline.modeling.placement import Placement
    from pipeline.registry.tracking import Tracker
    from pipeline.specs.modelspec import DpoSettings, LoraConfig

log = logging.getLogger(__name__)

REFERENCE_BATCH = 256  # pairs per reference forward (no gradients: memory is activations only)

Example = tuple[list[int], list[int]]


def encode_pairs(
    tokenizer: Any, rows: list[dict[str, Any]], max_len: int, *, fmt: str, where: str
) -> tuple[list[tuple[Example, Example]], dict[str, int], dict[str, int]]:
    """``(pairs, dropped, token_ids)``: each preference row's (chosen, rejected) ids and labels, each side
    on the ids its reply was served with when this tokenizer served them, else re-rendered and cut to fit
    on its own, never its reply (``job.encode_row``); the rows left out by reason (a side that cannot be
    encoded, or with nothing to compare, drops the pair); and each side by where its ids came from
    (``chosen served``, ``rejected re-rendered``, ...)."""
    pairs: list[tuple[Example, Example]] = []
    dropped: dict[str, int] = {}
    token_ids: dict[str, int] = {}
    for r in rows:
        try:
            *chosen, chosen_how = encode_row(tokenizer, r, max_len, fmt=fmt)
            *rejected, rejected_how = encode_row(tokenizer, r, max_len, fmt=fmt, side="rejected")
        except ROW_ERRORS as exc:  # the template refuses it, it does not fit, it rewrites the reply, ...
            log.warning("%s: a pair is left out: %s", where, exc)
            count(dropped, skip_reason(exc))
            continue
        if all(label == IGNORE for label in chosen[1]) or all(label == IGNORE for label in rejected[1]):
            count(dropped, NO_TARGET)  # nothing to compare
            continue
        pairs.append(((chosen[0], chosen[1]), (rejected[0], rejected[1])))
        count(token_ids, f"chosen {chosen_how}")
        count(token_ids, f"rejected {rejected_how}")
    return pairs, dropped, token_ids


def train_dpo(
    *,
    base_model_dir: Path,
    dataset_dir: Path,
    output_dir: Path,
    settings: DpoSettings,
    lora: LoraConfig,
    seed: int = 0,
    tool_call_format: str = "compact",
    max_seq_len: int | None = None,
    parent_adapter_dir: Path | None = None,
    lineage: dict[str, Any] | None = None,
    tracker: Tracker | None = None,
    progress: Callable[[int, int, float], None] | None = None,
    stop_after_steps: int | None = None,
    where: Placement | None = None,
    tokenizer_dir: Path | None = None,
    keep_checkpoints: bool = False,
) -> TrainResult:
    """Train (or resume) a LoRA adapter on preference pairs; return where it was saved and how it went.

    ``stop_after_steps`` interrupts the job after that many steps in this call (after checkpointing),
    returning ``completed=False``, as ``train_lora`` does."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import torch.nn.functional as F
    from datasets import load_from_disk
    from peft import get_peft_model_state_dict
    from transformers import AutoTokenizer

    # ---- setup -------------------------------------------------------------------------------------
    base_model_dir, dataset_dir, output_dir = Path(base_model_dir), Path(dataset_dir), Path(output_dir)
    if not (dataset_dir / "state.json").is_file():
        raise RatchetError(f"{dataset_dir}: not a dataset saved with save_to_disk (no state.json)")
    table = load_from_disk(str(dataset_dir))
    missing = {"messages", "rejected"} - set(table.column_names)
    if missing:
        raise RatchetError(f"{dataset_dir}: a preference dataset needs columns messages and rejected (missing "
                           f"{', '.join(sorted(missing))})")  # fmt: skip
    rows = table.to_list()
    data_hash = stored_dataset_sha256(table)  # the hash curation recorded for it in the registry
    torch.manual_seed(seed)
    random.seed(seed)
    where = where or placement()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or base_model_dir)
    pad_id = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)
    max_len = max_seq_len or sequence_limit(base_model_dir)
    pairs, dropped, token_ids = encode_pairs(tokenizer, rows, max_len, fmt=tool_call_format,
                                             where=str(dataset_dir))  # fmt: skip
    if not pairs:
        raise RatchetError(
            f"{dataset_dir}: no preference pair has both replies to train on (left out, by reason: {dropped})"
        )
    model = policy_model(
        base_model_dir,
        rank=lora.rank,
        alpha=lora.alpha,
        dropout=lora.dropout,
        target_modules=lora.target_modules,
        parent_adapter_dir=parent_adapter_dir,
        where=where,
    )
    reference = reference_model(
        base_model_dir, parent_adapter_dir=parent_adapter_dir, where=where, tokenizer_dir=tokenizer_dir
    )

    def logprobs(net: Any, batch: list[int]) -> tuple[Any, Any]:
        """Summed log-probabilities of the chosen and the rejected reply of each pair in ``batch``."""
        examples = [pairs[i][0] for i in batch] + [pairs[i][1] for i in batch]
        summed, _, _ = sequence_logprobs(net, examples, row_len=max_len, pad_id=pad_id, device=where.device)
        return summed[: len(batch)], summed[len(batch) :]

    with torch.no_grad():  # the reference never changes: once, before training
        ref_chosen, ref_rejected = [], []
        for start in range(0, len(pairs), REFERENCE_BATCH):
            c, r = logprobs(reference, list(range(start, min(start + REFERENCE_BATCH, len(pairs)))))
            ref_chosen.append(c)
            ref_rejected.append(r)
        ref_chosen_all, ref_rejected_all = torch.cat(ref_chosen), torch.cat(ref_rejected)
    del reference
    chosen_tokens = torch.tensor(
        [sum(label != IGNORE for label in c[1]) for c, _ in pairs], dtype=torch.float32, device=where.device
    )
    model.train()
    params, optim, sched = optimizer(model, lr=settings.lr, warmup_steps=settings.warmup_steps)
    per_epoch = math.ceil(len(pairs) / settings.batch_size)
    total = settings.max_steps or max(1, math.ceil(settings.epochs * per_epoch))
    job_key = content_hash(
        {
            "method": "dpo",
            "settings": settings.model_dump(mode="json"),
            "lora": lora.model_dump(mode="json"),
            "seed": seed,
            "fmt": tool_call_format,
            "data": data_hash,
            "tools": content_hash([r.get("tools") for r in rows]),
            "max_len": max_len,
            "parent": str(parent_adapter_dir),
        }  # fmt: skip
    )
    ckpt_root = output_dir / "checkpoint"
    if (done := finished_before(ckpt_root, job_key=job_key)) is not None:
        return done  # it finished, then its registry commit failed: no step is trained again, no second run
    start = resume(ckpt_root, job_key=job_key, model=model, optim=optim, sched=sched, total=total)

    # ---- train -------------------------------------------------------------------------------------
    with contextlib.ExitStack() as stack:
        stack.enter_context(merged_lora(model))
        run_id = None
        if tracker:
            run_id = stack.enter_context(
                tracker.start_run(output_dir.name, {"kind": "lora", "method": "dpo", "resumed_from_step": str(start)})
            )  # fmt: skip
            tracker.log_params(
                {**settings.model_dump(), "method": "dpo", "rank": lora.rank, "alpha": lora.alpha, "seed": seed,
                 "dataset_sha256": data_hash, "pairs": len(pairs), "pairs_left_out": sum(dropped.values()),
                 "total_steps": total}
            )  # fmt: skip
            log_dropped(tracker, dropped)
        log_token_ids(tracker, token_ids, str(dataset_dir))
        loss_value, started, step, tokens = float("nan"), time.perf_counter(), start, 0
        curve: list[tuple[int, float]] = []
        every = max(1, -(-total // LOSS_POINTS))
        while step < total:
            batch = batch_indices(len(pairs), settings.batch_size, step, seed)
            index = torch.tensor(batch, device=where.device)
            policy_chosen, policy_rejected = logprobs(model, batch)
            chosen_reward = settings.beta * (policy_chosen - ref_chosen_all[index])
            rejected_reward = settings.beta * (policy_rejected - ref_rejected_all[index])
            loss = -F.logsigmoid(chosen_reward - rejected_reward).mean()
            if settings.sft_weight > 0:
                loss = loss + settings.sft_weight * (-policy_chosen / chosen_tokens[index]).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            step += 1
            tokens += sum(len(pairs[i][0][0]) + len(pairs[i][1][0]) for i in batch)
            loss_value = float(loss.detach())
            margin = chosen_reward.detach() - rejected_reward.detach()
            if step % every == 0 or step == total:
                curve.append((step, round(loss_value, 5)))
            if tracker:
                for key, value in {
                    "train_loss": loss_value,
                    "reward_margin": float(margin.mean()),
                    "reward_accuracy": float((margin > 0).float().mean()),
                    "chosen_reward": float(chosen_reward.detach().mean()),
                    "rejected_reward": float(rejected_reward.detach().mean()),
                }.items():
                    tracker.log_metric(key, value, step=step)
            if progress is not None:
                progress(step, total, loss_value)
            interrupted = stop_after_steps is not None and step - start >= stop_after_steps and step < total
            if step % settings.checkpoint_every == 0 or interrupted:
                save_checkpoint(ckpt_root, job_key=job_key, step=step, model=model, optim=optim, sched=sched,
                                get_state=get_peft_model_state_dict)  # fmt: skip
            if interrupted:
                seconds = time.perf_counter() - started
                return TrainResult(output_dir / "adapter", "", step, loss_value, tokens / seconds, start,
                                   len(pairs), seconds, run_id, completed=False, loss_curve=tuple(curve),
                                   dropped=dropped, token_ids=token_ids)  # fmt: skip
        seconds = time.perf_counter() - started

        # ---- save ----------------------------------------------------------------------------------
        adapter_dir, adapter_sha = save_adapter(
            model,
            output_dir,
            record={
                **(lineage or {}),
                "method": "dpo",
                "dataset_sha256": data_hash,
                "base_model_sha256": weights_sha256(base_model_dir),
                "code_version": (lineage or {}).get("code_version") or git_describe(),
                "parent_adapter": str(parent_adapter_dir) if parent_adapter_dir else None,
                "reference": "parent adapter" if parent_adapter_dir else "base model",
                "train_config": {**settings.model_dump(), "lora": lora.model_dump(), "seed": seed},
                "steps": total,
                "final_loss": loss_value,
                "pairs": len(pairs),
                "token_ids": token_ids,
            },
            tracker=tracker,
        )

    # ---- clean up ----------------------------------------------------------------------------------
    del model, optim
    result = TrainResult(
        adapter_dir,
        adapter_sha,
        total,
        loss_value,
        tokens / max(seconds, 1e-9),
        start,
        len(pairs),
        seconds,
        run_id,
        loss_curve=tuple(curve),
        dropped=dropped,
        token_ids=token_ids,
    )
    return finish(ckpt_root, job_key=job_key, result=result, keep=keep_checkpoints)
