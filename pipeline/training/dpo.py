"""The DPO job: setup, train, save, clean up -- in that order, in this one file.

``train_dpo`` fine-tunes one LoRA adapter by direct preference optimisation (Rafailov et al., 2023) on
preference pairs curated from contract-scored experience (``pipeline.experience.preferences``): each row is two
conversations with the same context, the preferred reply (``messages``) and the other (``rejected``). The
policy starts from the parent's adapter and the reference is the parent pair itself (``likelihood.reference_of``:
the parent's adapter loaded, frozen, into the same model beside the policy's, or the adapters switched off
when there is no parent -- never a second copy of the base), so the implicit KL holds the successor to its
parent. The loss per pair is ``-log sigmoid(beta * ((log pi(y+) - log ref(y+)) - (log pi(y-) -
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

Batches are packed (chosen and rejected of a pair in the same forward, no padding compute), each LoRA linear
takes the fast path of ``kernels.merged_lora``, reference log-probabilities are computed once before
training, checkpoints are those of the SFT job (safetensors + JSON, resumed from the newest intact one), and
the adapter is saved atomically with ``lineage.json`` (``artifacts.save_adapter``).

Memory: the spec's ``batch_size`` pairs are one optimizer step, run as micro-batches of at most
``micro_batch_tokens`` packed tokens (``memory.micro_batches`` over the pairs' summed lengths: a pair's two
sides never part), each micro-batch's loss its pairs' summed loss over the batch's pair count, so that the
accumulated gradients are those of the whole batch's mean; the reference pass is cut the same way. Under
``torchrun`` each process runs its share of the micro-batches (``distributed.share``), the gradients are
summed before clipping, and only the main process writes checkpoints, the adapter and the metrics.
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
from pipeline.specs.loading import content_hash, file_sha256, weights_sha256
from pipeline.training.artifacts import save_adapter, stored_dataset_sha256
from pipeline.training.attention import padding_free
from pipeline.training.checkpoint import resume, save_checkpoint
from pipeline.training.distributed import (
    broadcast_parameters,
    is_main,
    least,
    reduce_gradients,
    share,
    split,
    world,
)
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
from pipeline.training.likelihood import REFERENCE, optimizer, policy_model, reference_of, sequence_logprobs
from pipeline.training.memory import token_budget

if TYPE_CHECKING:
    import torch

    from pipeline.modeling.placement import Placement
    from pipeline.registry.tracking import Tracker
    from pipeline.specs.modelspec import DpoSettings, LoraConfig

log = logging.getLogger(__name__)

REFERENCE_BATCH = 256  # pairs per reference forward without a token budget (no gradients: activations only)

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


def pair_lengths(pairs: list[tuple[Example, Example]], batch: list[int]) -> list[int]:
    """Packed tokens of each pair of ``batch`` (both sides: they share a micro-batch)."""
    return [len(pairs[i][0][0]) + len(pairs[i][1][0]) for i in batch]


def pair_logprobs(
    model: Any,
    pairs: list[tuple[Example, Example]],
    batch: list[int],
    *,
    row_len: int,
    pad_id: int,
    device: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probabilities of the chosen and the rejected reply of each pair in ``batch``, from one
    packed forward of ``model`` (with gradients when they are enabled)."""
    examples = [pairs[i][0] for i in batch] + [pairs[i][1] for i in batch]
    summed, _, _ = sequence_logprobs(model, examples, row_len=row_len, pad_id=pad_id, device=device)
    return summed[: len(batch)], summed[len(batch) :]


def reference_logprobs(
    model: Any,
    reference: Callable[[], contextlib.AbstractContextManager[Any]],
    pairs: list[tuple[Example, Example]],
    *,
    budget: int | None,
    row_len: int,
    pad_id: int,
    device: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every pair's summed reference log-probability of its chosen and of its rejected reply ``([P], [P])``:
    ``model`` run as the reference (``reference()``, from ``likelihood.reference_of``), in micro-batches of at
    most ``budget`` packed tokens (a pair's sides together), or ``REFERENCE_BATCH`` pairs at a time without a
    budget. Under ``torchrun`` each process computes its share and the shares are summed (every process
    ends with all of them)."""
    import torch
    import torch.distributed as dist

    team = world()
    everything = list(range(len(pairs)))
    if budget is None:
        groups = [everything[s : s + REFERENCE_BATCH] for s in range(0, len(pairs), REFERENCE_BATCH)]
    else:
        groups = split(pair_lengths(pairs, everything), budget, team)
    chosen = torch.zeros(len(pairs), dtype=torch.float32, device=device)
    rejected = torch.zeros(len(pairs), dtype=torch.float32, device=device)
    with reference(), torch.no_grad():
        for group in share(groups, team):
            c, r = pair_logprobs(model, pairs, group, row_len=row_len, pad_id=pad_id, device=device)
            index = torch.tensor(group, device=device)
            chosen[index], rejected[index] = c.float(), r.float()
    if team.size > 1:
        dist.all_reduce(chosen)
        dist.all_reduce(rejected)
    return chosen, rejected


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
    micro_batch_tokens: int | None = None,
    activation_checkpointing: str = "auto",
    quantization: str = "none",
) -> TrainResult:
    """Train (or resume) a LoRA adapter on preference pairs; return where it was saved and how it went.

    ``stop_after_steps`` interrupts the job after that many steps in this call (after checkpointing),
    returning ``completed=False``, as ``train_lora`` does. ``micro_batch_tokens`` (None: the whole batch
    at once), ``activation_checkpointing`` and ``quantization`` are the model spec's (``TrainDefaults``):
    the first cuts each step (see the module doc), the other two are ``likelihood.policy_model``'s."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import torch.distributed as dist
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
    team = world()
    tracker = tracker if is_main(team) else None  # one process writes the run's metrics and files
    model = policy_model(
        base_model_dir,
        rank=lora.rank,
        alpha=lora.alpha,
        dropout=lora.dropout,
        target_modules=lora.target_modules,
        parent_adapter_dir=parent_adapter_dir,
        where=where,
        quantization=quantization,
        activation_checkpointing=activation_checkpointing,
        max_seq_len=max_len,
    )
    shape = {"row_len": max_len, "pad_id": pad_id, "device": where.device}
    budget = least(token_budget(micro_batch_tokens, where=where, model=model, max_seq_len=max_len), world())
    # the reference never changes: once, before training, through the same model (no second base)
    ref_chosen_all, ref_rejected_all = reference_logprobs(
        model, reference_of(model, parent_adapter_dir), pairs, budget=budget, **shape
    )
    if REFERENCE in model.peft_config:  # its weights are not needed again, and never saved with the policy
        model.delete_adapter(REFERENCE)
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
            # a 4-bit base is another job (the key of a job on the unquantized base stays as it was)
            **({"quantization": quantization} if quantization != "none" else {}),
        }  # fmt: skip
    )
    ckpt_root = output_dir / "checkpoint"
    if (done := finished_before(ckpt_root, job_key=job_key)) is not None:
        return done  # it finished, then its registry commit failed: no step is trained again, no second run
    start = resume(ckpt_root, job_key=job_key, model=model, optim=optim, sched=sched, total=total)
    broadcast_parameters(params, team)  # every process resumed the same files; this makes it certain

    # ---- train -------------------------------------------------------------------------------------
    with contextlib.ExitStack() as stack:
        stack.enter_context(merged_lora(model))
        stack.enter_context(padding_free(model))  # GPU: packed rows without a 4D mask; no-op on the CPU
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
            # sums over this process's micro-batches: loss, margin, margin > 0, chosen and rejected reward
            sums = torch.zeros(5, dtype=torch.float64, device=where.device)
            for group in share(split(pair_lengths(pairs, batch), budget, team), team):
                part = [batch[j] for j in group]
                index = torch.tensor(part, device=where.device)
                policy_chosen, policy_rejected = pair_logprobs(model, pairs, part, **shape)
                chosen_reward = settings.beta * (policy_chosen - ref_chosen_all[index])
                rejected_reward = settings.beta * (policy_rejected - ref_rejected_all[index])
                per_pair = -F.logsigmoid(chosen_reward - rejected_reward)
                if settings.sft_weight > 0:
                    per_pair = per_pair + settings.sft_weight * (-policy_chosen / chosen_tokens[index])
                (per_pair.sum() / len(batch)).backward()  # summed over the micro-batches: the batch's mean
                margin = (chosen_reward - rejected_reward).detach()
                sums += torch.stack([per_pair.detach().sum(), margin.sum(), (margin > 0).sum(),
                                     chosen_reward.detach().sum(), rejected_reward.detach().sum()]).double()  # fmt: skip
            if team.size > 1:
                dist.all_reduce(sums)
            reduce_gradients(params, team)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            step += 1
            tokens += sum(pair_lengths(pairs, batch))
            means = (sums / len(batch)).tolist()
            loss_value = means[0]
            if step % every == 0 or step == total:
                curve.append((step, round(loss_value, 5)))
            if tracker:
                names = ("train_loss", "reward_margin", "reward_accuracy", "chosen_reward", "rejected_reward")
                for key, value in zip(names, means, strict=True):
                    tracker.log_metric(key, value, step=step)
            if progress is not None:
                progress(step, total, loss_value)
            interrupted = stop_after_steps is not None and step - start >= stop_after_steps and step < total
            if (step % settings.checkpoint_every == 0 or interrupted) and is_main(team):
                save_checkpoint(ckpt_root, job_key=job_key, step=step, model=model, optim=optim, sched=sched,
                                get_state=get_peft_model_state_dict)  # fmt: skip
            if interrupted:
                seconds = time.perf_counter() - started
                return TrainResult(output_dir / "adapter", "", step, loss_value, tokens / seconds, start,
                                   len(pairs), seconds, run_id, completed=False, loss_curve=tuple(curve),
                                   dropped=dropped, token_ids=token_ids)  # fmt: skip
        seconds = time.perf_counter() - started

        # ---- save ----------------------------------------------------------------------------------
        adapter_dir, adapter_sha = output_dir / "adapter", ""
        if is_main(team):
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
        if team.size > 1:  # the other processes return the adapter the main one saved
            dist.barrier()
            adapter_sha = adapter_sha or file_sha256(adapter_dir / "adapter_model.safetensors")

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
    if not is_main(team):
        return result
    return finish(ckpt_root, job_key=job_key, result=result, keep=keep_checkpoints)
