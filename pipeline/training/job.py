"""The LoRA job: setup, train, save, clean up -- in that order, in this one file.

``train_lora`` fine-tunes one LoRA adapter on a frozen base model from a ``datasets`` dataset saved with
``save_to_disk`` (rows with OpenAI-style ``messages``; loss on assistant tokens only). A successor
continues its parent's adapter weights. Rows become examples as ``examples`` says: a row the chat template
refuses, or that does not fit ``max_seq_len`` even with its oldest turns cut, is left out and counted by
reason (``TrainResult.dropped``, the run's ``rows_dropped_*`` metrics): a job never stops on one row; a row
whose reply the server decoded with this tokenizer trains on exactly the ids served (``TrainResult.token_ids``,
the run's ``token_ids_*`` metrics, ``lineage.json`` and the model card). Batches are packed
(``pipeline.modeling.packing``): several examples share a row, positions restart per example and the
block-diagonal mask keeps them from attending to each other, so no compute goes to padding. A step's batch
(``batch_size``, the optimizer's) runs as micro-batches within a token budget (``memory.token_budget``: the
spec's ``micro_batch_tokens``, or from the free GPU memory; no split on the CPU), each one's loss scaled by
its share of the batch's labelled tokens and its gradients accumulated, so the update is the whole batch's;
under ``torchrun`` (``training.processes``) each process runs its share of them (``distributed``), the
gradients are summed before the update, and only the main process writes checkpoints, the adapter and
metrics. Activation checkpointing as ``memory.checkpointing_wanted`` says. Each LoRA linear runs as one autograd function (``kernels.merged_lora``: peft's
``W x + scale * B (A x)`` with the same gradients, in fewer and larger matmuls),
and logits and loss are computed only where a label is (``kernels.assistant_loss``). Every
``checkpoint_every`` steps the adapter, optimizer, scheduler, RNG states and step are written under
``output_dir/checkpoint/`` (``checkpoint``: safetensors and JSON, never a pickle; the newest two are kept);
calling ``train_lora`` again with the same ``output_dir`` resumes from the newest intact one. On success
the adapter is saved with peft's ``save_pretrained`` (``adapter_config.json`` +
``adapter_model.safetensors``) beside a ``lineage.json``, all written under a temporary name and renamed
into place only when complete (``artifacts.atomic_directory``), so a full or read-only store fails the job
with an ``ArtifactStoreError`` and never leaves half an adapter; then the checkpoints are deleted -- or, for
the training step's jobs (``keep_checkpoints``), kept with the finished result beside them until the registry
has the adapter, so that a step failing in between reuses the job (``finished_before``) and its MLflow run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.errors import RatchetError
from pipeline.experience.toolcalls import normalize_tool_calls
from pipeline.modeling.packing import IGNORE, SERVED, packed_tensors
from pipeline.modeling.placement import placement
from pipeline.shipped import DISTRIBUTION
from pipeline.specs.loading import content_hash, weights_sha256
from pipeline.specs.modelspec import ALL_LINEAR as ALL_LINEAR  # re-exported: pipeline.training.ALL_LINEAR
from pipeline.specs.modelspec import LoraConfig, TrainDefaults
from pipeline.training.artifacts import conversations_sha256, hashed_row, save_adapter, stored_dataset_sha256
from pipeline.training.attention import padding_free
from pipeline.training.checkpoint import discard, finished_result, record_finished, resume, save_checkpoint
from pipeline.training.distributed import (
    broadcast_parameters,
    is_main,
    least,
    reduce_gradients,
    share,
    split,
    sum_over,
    world,
)
from pipeline.training.examples import NO_TARGET as NO_TARGET  # re-exported (dpo, grpo, tests): as below
from pipeline.training.examples import ROW_ERRORS as ROW_ERRORS
from pipeline.training.examples import EncodedRows as EncodedRows
from pipeline.training.examples import count as count
from pipeline.training.examples import dropped_text, encode_dataset, log_dropped, log_token_ids
from pipeline.training.examples import encode_row as encode_row
from pipeline.training.examples import encode_rows as encode_rows
from pipeline.training.examples import skip_reason as skip_reason
from pipeline.training.kernels import assistant_loss, merged_lora
from pipeline.training.likelihood import optimizer, policy_model
from pipeline.training.memory import token_budget

if TYPE_CHECKING:
    from pipeline.modeling.placement import Placement
    from pipeline.specs.modelspec import SpecialistModel

log = logging.getLogger(__name__)

_LORA, _TRAINING = LoraConfig(), TrainDefaults()  # the model spec's defaults: the one place they are written


HOW = ("micro_batch_tokens", "activation_checkpointing", "processes")  # how a step runs, not what it computes


@dataclass(frozen=True)
class TrainConfig:
    """LoRA hyperparameters and the schedule of one training job: a specialist's ``lora`` and ``training``
    sections of the model spec (``LoraConfig``, ``TrainDefaults``: their descriptions, and the defaults
    these are), plus the run's seed and the harness's tool-call format. ``from_spec`` builds it from a
    specialist's spec."""

    rank: int = _LORA.rank
    alpha: float = _LORA.alpha
    dropout: float = _LORA.dropout
    target_modules: tuple[str, ...] = tuple(_LORA.target_modules)
    lr: float = _TRAINING.lr
    epochs: float = _TRAINING.epochs
    max_steps: int | None = _TRAINING.max_steps  # when set, overrides epochs
    batch_size: int = _TRAINING.batch_size  # examples per optimizer step
    seed: int = 0  # the advance's ``step_seed`` of this specialist and generation
    checkpoint_every: int = _TRAINING.checkpoint_every
    # examples are truncated to this; also the packed row length. None: the model's own context length,
    # at most MAX_SEQ_LEN_DEFAULT (memory grows with it)
    max_seq_len: int | None = _TRAINING.max_seq_len
    warmup_steps: int = _TRAINING.warmup_steps
    weight_decay: float = _TRAINING.weight_decay
    # how a step runs, not what it computes (left out of the job's key: a job resumes under other values)
    micro_batch_tokens: int | None = _TRAINING.micro_batch_tokens  # None: memory.token_budget's
    activation_checkpointing: str = _TRAINING.activation_checkpointing  # auto | on | off
    processes: int = _TRAINING.processes  # the train step launches them (torchrun); this job is one of them
    # how tool calls appear in the rendered conversation (the harness's ``tool_call_format``)
    tool_call_format: str = "compact"

    def key(self) -> dict[str, Any]:
        """The settings that decide what the job computes (its checkpoints' key): all but ``HOW``."""
        return {k: v for k, v in asdict(self).items() if k not in HOW}

    @classmethod
    def from_spec(cls, specialist: SpecialistModel, *, seed: int, tool_call_format: str) -> TrainConfig:
        """The job a specialist's model spec describes: every field of its ``lora`` and ``training``
        sections, by name (a field of either that this class lacks is a ``TypeError`` here, never a knob
        silently dropped)."""
        lora = specialist.lora.model_dump()
        return cls(
            **{**lora, "target_modules": tuple(lora["target_modules"])},
            **specialist.training.model_dump(),
            seed=seed,
            tool_call_format=tool_call_format,
        )


@dataclass(frozen=True)
class TrainResult:
    """What a finished (or interrupted) job produced."""

    adapter_dir: Path
    adapter_sha256: str
    steps: int
    final_loss: float
    tokens_per_second: float
    resumed_from_step: int
    examples: int
    seconds: float
    run_id: str | None = None
    completed: bool = True
    # (step, loss) at most ``LOSS_POINTS`` times over the run (the registry keeps it for the dashboard;
    # MLflow has every step); a resumed job's curve starts where it resumed
    loss_curve: tuple[tuple[int, float], ...] = ()
    # rows (SFT examples, DPO pairs, GRPO episodes) left out, by reason (``templating``: the chat template
    # refuses the row, it does not fit max_seq_len even cut, the template rewrites the trained turn, ...)
    dropped: dict[str, int] = field(default_factory=dict)
    # examples (DPO: each side, ``chosen ...`` / ``rejected ...``) by where their ids came from: ``served``
    # (the ids the server decoded), ``re-rendered`` (no served ids), ``re-rendered: <why>`` (served ids
    # another tokenizer wrote, too long, unreadable)
    token_ids: dict[str, int] = field(default_factory=dict)


LOSS_POINTS = 200


def git_describe(cwd: Path | None = None) -> str:
    """``git describe --always --dirty`` of the code, or the package version outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=cwd or Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"ratchet {version(DISTRIBUTION)}"
    except PackageNotFoundError:
        return "unknown"


def dataset_sha256(rows: list[dict[str, Any]]) -> str:
    """Content hash of rows' conversations and served ids (independent of arrow file layout). A stored
    training set's hash is ``artifacts.stored_dataset_sha256``: of its rows as loaded back, which Arrow may
    have filled in."""
    return conversations_sha256(hashed_row(row) for row in rows)


def write_dataset(traces: list[dict[str, Any]], dataset_dir: Path) -> str:
    """Save the ``messages`` of ``traces`` as a ``datasets`` dataset (``save_to_disk``); return its hash.
    Tool-call arguments are written as JSON text (``toolcalls.normalize_tool_calls``): an object beside text
    would give the column no type."""
    from datasets import Dataset

    rows = [{"messages": normalize_tool_calls(t["messages"])} for t in traces]
    if not rows:
        raise RatchetError(f"{dataset_dir}: no traces to write (a training set needs at least one)")
    Dataset.from_list(rows).save_to_disk(str(dataset_dir))
    return stored_dataset_sha256(dataset_dir)


def batch_indices(n: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Example indices of optimizer step ``step``: epochs are seeded permutations cut into batches
    (the last batch of an epoch may be short), so any step's batch is known without replaying."""
    import torch

    per_epoch = math.ceil(n / batch_size)
    epoch, k = divmod(step, per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
    return perm[k * batch_size : (k + 1) * batch_size]


MAX_SEQ_LEN_DEFAULT = 2048


def finished_before(ckpt_root: Path, *, job_key: str) -> TrainResult | None:
    """The result of this job when it finished before and the training step has not committed it yet
    (``checkpoint.finished_result``): nothing is trained again and no second MLflow run is opened."""

    done = finished_result(ckpt_root, job_key=job_key)
    if done is None:
        return None
    return TrainResult(**{**done, "adapter_dir": Path(done["adapter_dir"]),
                          "loss_curve": tuple(tuple(p) for p in done["loss_curve"])})  # fmt: skip


def finish(ckpt_root: Path, *, job_key: str, result: TrainResult, keep: bool) -> TrainResult:
    """A job's end: its checkpoints are deleted, or, with ``keep`` (the training step's jobs, until the
    registry has the adapter), kept with the result recorded beside them (``checkpoint.record_finished``)."""

    if keep:
        record_finished(
            ckpt_root, job_key=job_key, result={**asdict(result), "adapter_dir": str(result.adapter_dir)}
        )
    else:
        discard(ckpt_root)
    return result


def sequence_limit(base_model_dir: Path) -> int:
    """The default training sequence length: the model's ``max_position_embeddings``, capped at 2048."""
    config = json.loads((Path(base_model_dir) / "config.json").read_text())
    text = config.get("text_config", config)  # multimodal configs nest the language model's
    return min(int(text.get("max_position_embeddings") or MAX_SEQ_LEN_DEFAULT), MAX_SEQ_LEN_DEFAULT)


def train_lora(
    *,
    base_model_dir: Path,
    dataset_dir: Path,
    output_dir: Path,
    config: TrainConfig,
    parent_adapter_dir: Path | None = None,
    lineage: dict[str, Any] | None = None,
    tracker: Any = None,
    progress: Callable[[int, int, float], None] | None = None,
    stop_after_steps: int | None = None,
    where: Placement | None = None,
    tokenizer_dir: Path | None = None,
    keep_checkpoints: bool = False,
    quantization: str = "none",
) -> TrainResult:
    """Train (or resume) a LoRA adapter; return where it was saved and how training went.

    ``where``: device and dtype (``pipeline.modeling.placement``; default ``auto``); ``tokenizer_dir``: default the base's.

    ``stop_after_steps`` interrupts the job after that many steps *in this call* (after checkpointing),
    returning ``completed=False``: the hook tests and schedulers use to simulate a killed job.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from datasets import load_from_disk
    from peft import get_peft_model_state_dict
    from transformers import AutoTokenizer

    # ---- setup -------------------------------------------------------------------------------------
    base_model_dir, dataset_dir, output_dir = Path(base_model_dir), Path(dataset_dir), Path(output_dir)
    if not (dataset_dir / "dataset_info.json").is_file() and not (dataset_dir / "state.json").is_file():
        raise RatchetError(f"{dataset_dir}: not a dataset saved with save_to_disk (no state.json)")
    rows = load_from_disk(str(dataset_dir))
    if "messages" not in rows.column_names:
        raise RatchetError(f"{dataset_dir}: dataset has no 'messages' column (columns: {rows.column_names})")
    data_hash = stored_dataset_sha256(rows)  # the hash curation recorded for it in the registry
    rows = rows.to_list()
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    where = where or placement()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or base_model_dir)
    # Llama-3-style tokenizers have no pad token: pad with EOS (padding is masked out of attention and loss).
    pad_id = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)
    max_len = config.max_seq_len or sequence_limit(base_model_dir)
    encoded = encode_dataset(tokenizer, rows, max_len, fmt=config.tool_call_format, where=str(dataset_dir))
    examples, dropped, token_ids = encoded.examples, encoded.dropped, encoded.token_ids
    if not examples:
        raise RatchetError(
            f"{dataset_dir}: no row has an assistant turn to train on ({dropped_text(dropped)})"
        )
    model = policy_model(  # the parent's adapter, continued, or a fresh LoRA; safetensors only
        base_model_dir,
        rank=config.rank,
        alpha=config.alpha,
        dropout=config.dropout,
        target_modules=config.target_modules,
        parent_adapter_dir=parent_adapter_dir,
        where=where,
        quantization=quantization,
        activation_checkpointing=config.activation_checkpointing,
        max_seq_len=max_len,
    )
    model.train()
    params, optim, sched = optimizer(
        model, lr=config.lr, warmup_steps=config.warmup_steps, weight_decay=config.weight_decay
    )
    processes = world()  # this job's processes (torchrun): each runs its share of a step's micro-batches
    budget = least(token_budget(config.micro_batch_tokens, where=where, model=model, max_seq_len=max_len),
                   processes)  # fmt: skip
    main = is_main(processes)  # only the main one writes checkpoints, the adapter and metrics
    tracker = tracker if main else None
    per_epoch = math.ceil(len(examples) / config.batch_size)
    total = config.max_steps or max(1, math.ceil(config.epochs * per_epoch))
    key = {"config": config.key(), "data": data_hash, "parent": str(parent_adapter_dir)}
    job_key = content_hash(key if quantization == "none" else {**key, "quantization": quantization})

    ckpt_root = output_dir / "checkpoint"
    if (done := finished_before(ckpt_root, job_key=job_key)) is not None:
        return done  # it finished, then its registry commit failed: no step is trained again, no second run
    start = resume(ckpt_root, job_key=job_key, model=model, optim=optim, sched=sched, total=total)
    broadcast_parameters(params, processes)  # every process resumed the same files; this makes it certain

    # ---- train -------------------------------------------------------------------------------------
    with contextlib.ExitStack() as stack:
        stack.enter_context(merged_lora(model))
        stack.enter_context(padding_free(model))  # GPU: packed rows without a 4D mask; no-op on the CPU
        run_id = None
        if tracker:
            tags = {"kind": "lora", "resumed_from_step": str(start)}
            run_id = stack.enter_context(tracker.start_run(output_dir.name, tags))
            tracker.log_params(
                {
                    **asdict(config),
                    "dataset_sha256": data_hash,
                    "examples": len(examples),
                    "examples_served_ids": token_ids.get(SERVED, 0),
                    "rows_left_out": sum(dropped.values()),
                    "total_steps": total,
                }
            )
            log_dropped(tracker, dropped)
        log_token_ids(tracker, token_ids, str(dataset_dir))
        tokens, loss_value, started, step = 0, float("nan"), time.perf_counter(), start
        curve: list[tuple[int, float]] = []
        every = max(1, -(-total // LOSS_POINTS))
        while step < total:
            batch = [examples[i] for i in batch_indices(len(examples), config.batch_size, step, config.seed)]
            # micro-batches within the token budget, each loss scaled by its share of the batch's labelled
            # tokens: the gradients summed over them (and processes) are the whole batch's mean loss's
            packs = [packed_tensors([batch[i] for i in group], max_len, pad_id)
                     for group in split([min(len(ids), max_len) for ids, _ in batch], budget, processes)]  # fmt: skip
            labelled = [int((p["labels"][:, 1:] != IGNORE).sum()) for p in packs]
            loss_sum = torch.zeros((), device=where.device)
            for [k] in share([[k] for k in range(len(packs))], processes):
                if not labelled[k]:
                    continue  # nothing to learn from (its loss would be 0/0)
                tensors = {name: v.to(where.device) for name, v in packs[k].items()}
                loss = assistant_loss(model, tensors) * (labelled[k] / sum(labelled))
                loss.backward()
                loss_sum += loss.detach()
            reduce_gradients(params, processes)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            step += 1
            tokens += sum(len(e[0]) for e in batch)
            loss_value = sum_over(float(loss_sum), processes)  # each process holds its micro-batches' part
            if step % every == 0 or step == total:
                curve.append((step, round(loss_value, 5)))
            if tracker:
                tracker.log_metric("train_loss", loss_value, step=step)
            if progress is not None:
                progress(step, total, loss_value)
            interrupted = stop_after_steps is not None and step - start >= stop_after_steps and step < total
            if main and (step % config.checkpoint_every == 0 or interrupted):
                save_checkpoint(ckpt_root, job_key=job_key, step=step, model=model, optim=optim, sched=sched,
                                get_state=get_peft_model_state_dict)  # fmt: skip
            if interrupted:
                seconds = time.perf_counter() - started
                return TrainResult(output_dir / "adapter", "", step, loss_value, tokens / seconds, start,
                                   len(examples), seconds, run_id, completed=False, loss_curve=tuple(curve),
                                   dropped=dropped, token_ids=token_ids)  # fmt: skip
        seconds = time.perf_counter() - started

        # ---- save (the main process) ---------------------------------------------------------------
        adapter_dir, adapter_sha = output_dir / "adapter", ""
        if main:
            adapter_dir, adapter_sha = save_adapter(
                model,
                output_dir,
                record={
                    **(lineage or {}),
                    "method": "sft",
                    "dataset_sha256": data_hash,
                    "base_model_sha256": weights_sha256(base_model_dir),
                    "code_version": (lineage or {}).get("code_version") or git_describe(),
                    "parent_adapter": str(parent_adapter_dir) if parent_adapter_dir else None,
                    "train_config": asdict(config),
                    "steps": total,
                    "final_loss": loss_value,
                    "examples": len(examples),
                    "token_ids": token_ids,
                },
                tracker=tracker,
            )
        if tracker:
            tracker.log_metric("tokens_per_second", tokens / max(seconds, 1e-9), step=total)

    # ---- clean up ----------------------------------------------------------------------------------
    del model, optim
    result = TrainResult(
        adapter_dir,
        adapter_sha,
        total,
        loss_value,
        tokens / max(seconds, 1e-9),
        start,
        len(examples),
        seconds,
        run_id,
        loss_curve=tuple(curve),
        dropped=dropped,
        token_ids=token_ids,
    )
    return finish(ckpt_root, job_key=job_key, result=result, keep=keep_checkpoints) if main else result
