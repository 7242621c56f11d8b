"""What the training jobs share: the models a job starts from and its optimizer, episodes as labelled token
ids, and the log-probability of each example's labelled tokens.

``policy_model`` is the trainable LoRA a job starts from: the parent's adapter (continued), or a fresh one
(B = 0: the bare base), on a base in the placement's dtype or 4-bit (``quantization: nf4``), with
activation checkpointing when wanted (``memory.checkpointing_wanted``). ``reference_of`` is the frozen model
the job is held to, without a second copy of the base: the parent's adapter loaded beside the policy's in
the same peft model (``REFERENCE``, frozen, never in the optimizer), or the bare base (adapters disabled)
when there is no parent; ``with reference(): ...`` runs the model as it. ``encode_episode`` labels every assistant
turn of a conversation (an RL episode may hold several: a tool call, the tool's result as context, the
answer). ``sequence_logprobs`` runs one packed forward (``packing.packed_tensors``, logits only at labelled
positions: ``kernels.label_logprobs``) and gives each labelled token's log-probability and its example.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.errors import RatchetError
from pipeline.modeling.decoding import attn_implementation_for
from pipeline.modeling.packing import packed_tensors
from pipeline.modeling.quantization import prepare_quantized, quantized_load_kwargs
from pipeline.modeling.templating import IGNORE, RowSkipped, encode_chat
from pipeline.training.kernels import label_logprobs
from pipeline.training.memory import checkpointing_wanted

if TYPE_CHECKING:
    import torch
    from peft import PeftModel

    from pipeline.modeling.placement import Placement

log = logging.getLogger(__name__)


def policy_model(
    base_model_dir: Path,
    *,
    rank: int,
    alpha: float,
    dropout: float,
    target_modules: Sequence[str],
    parent_adapter_dir: Path | None,
    where: Placement,
    quantization: str = "none",
    activation_checkpointing: str = "auto",
    max_seq_len: int | None = None,
) -> PeftModel:
    """The trainable peft model a job starts from: the parent's adapter, or a fresh LoRA of that shape.

    ``quantization`` (the model spec's): ``none`` loads the base in ``where``'s dtype; ``nf4`` with
    ``modeling.quantization``'s ``from_pretrained`` arguments (4-bit base placed as it loads, LoRA weights
    float32; refused in one line where bitsandbytes cannot run).
    ``activation_checkpointing`` (the spec's ``training`` setting, ``auto`` by ``memory.checkpointing_wanted``
    with ``max_seq_len``): each decoder block's activations recomputed in the backward pass (non-reentrant
    ``torch.utils.checkpoint``, which needs no input that requires grad; transformers also hooks the
    embeddings' output to require it). It acts in training mode only (``model.train()``)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    _check_safetensors(parent_adapter_dir)
    attn = attn_implementation_for(base_model_dir)
    load = ({"attn_implementation": attn} if attn else {}) | quantized_load_kwargs(quantization, where)
    base = AutoModelForCausalLM.from_pretrained(  # safetensors only: a pickled checkpoint is refused
        base_model_dir, dtype=where.torch_dtype, use_safetensors=True, **load
    )
    if quantization == "nf4":
        prepare_quantized(base)  # in place; placed by its load arguments: a 4-bit model is not moved
    else:
        base = base.to(where.device)
    if checkpointing_wanted(activation_checkpointing, base, where, max_seq_len=max_seq_len):
        enable = getattr(base, "activation_checkpointing_enable", None)  # transformers >= 5.2x's name
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if parent_adapter_dir is not None:
        return PeftModel.from_pretrained(base, parent_adapter_dir, is_trainable=True)
    lora = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(base, lora)


def _check_safetensors(adapter_dir: Path | None) -> None:
    if adapter_dir is not None and not (Path(adapter_dir) / "adapter_model.safetensors").is_file():
        raise RatchetError(  # peft would fall back to a pickled adapter_model.bin: never load one
            f"{adapter_dir}: parent adapter has no adapter_model.safetensors"
        )


REFERENCE = "reference"
"""The peft adapter name the parent's adapter is loaded under beside the policy's (``reference_of``)."""


@dataclass(frozen=True)
class Reference:
    """The frozen model a job is held to, as a mode of the policy's own peft model: calling it gives a
    context manager inside which ``model`` runs as the reference (``adapter`` active, or adapters disabled
    when it is None), in eval mode (no dropout) and under ``torch.no_grad``; on exit the policy's active
    adapter, every parameter's ``requires_grad`` and the training mode are as they were."""

    model: Any
    adapter: str | None

    @contextlib.contextmanager
    def __call__(self) -> Iterator[Any]:
        import torch

        model = self.model
        flags = [(p, p.requires_grad) for p in model.parameters()]
        active, training = model.active_adapter, model.training
        model.eval()
        try:
            with torch.no_grad():
                if self.adapter is None:
                    with model.disable_adapter():
                        yield model
                else:
                    model.set_adapter(self.adapter, inference_mode=True)
                    try:
                        yield model
                    finally:
                        model.set_adapter(active)
        finally:
            for (
                p,
                flag,
            ) in flags:  # peft's set_adapter / disable_adapter toggle requires_grad: put back exactly
                p.requires_grad_(flag)
            model.train(training)


def reference_of(model: PeftModel, parent_adapter_dir: Path | None) -> Reference:
    """The reference a job's loss holds ``model`` (the policy) to, in the same weights: the parent's adapter
    loaded into ``model`` as a second, frozen adapter named ``REFERENCE`` (its LoRA weights only: no second
    copy of the base), or, without a parent, the bare base (adapters disabled).

    The reference's parameters never require grad outside its context and are never in the optimizer:
    build the optimizer (``optimizer``: the parameters that require grad) before calling this -- peft 0.21
    also leaves a loaded inactive adapter frozen, which this checks -- and save the policy with
    ``selected_adapters`` (peft's ``save_pretrained`` writes every adapter of the model otherwise). The
    merged-LoRA kernel (``kernels.merged_lora``) runs peft's own forward while the reference is active."""

    if parent_adapter_dir is None:
        return Reference(model, None)
    _check_safetensors(parent_adapter_dir)
    if REFERENCE in model.peft_config:
        raise RatchetError(f"the model already has an adapter named {REFERENCE!r}")
    training = model.training
    model.load_adapter(str(parent_adapter_dir), adapter_name=REFERENCE, is_trainable=False)
    model.train(training)  # peft puts the whole model in eval mode when it loads a frozen adapter
    trainable = [n for n, p in model.named_parameters() if f".{REFERENCE}." in n and p.requires_grad]
    if trainable:
        raise RatchetError(f"the reference adapter's weights require grad ({trainable[0]}, ...): not frozen")
    return Reference(model, REFERENCE)


def optimizer(
    model: Any, *, lr: float, warmup_steps: int, weight_decay: float = 0.0
) -> tuple[list, Any, Any]:
    """``(params, optim, sched)`` every job steps: fused AdamW over the trainable (LoRA) parameters and a
    linear warm-up over ``warmup_steps`` updates."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    warmup = max(1, warmup_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / warmup))
    return params, optim, sched


def encode_episode(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    max_len: int,
    *,
    fmt: str,
    tools: list[dict[str, Any]] | None = None,
    turns: int = 1,
) -> tuple[list[int], list[int]]:
    """``templating.encode_chat`` with the last ``turns`` assistant turns labelled, not only the last: the
    turns an RL episode's policy wrote (a tool call, then an answer after the tool's result), never an
    exemplar's or a task item's own. An earlier turn's labels come from encoding the conversation up to it,
    where that encoding is a prefix of the whole one (a prefix-stable template); a turn the template renders
    differently later (or that the template refuses alone, or that only fitted with less context cut) stays
    unlabelled. Tool results and user turns are never labelled; what the model wrote is inert text, so a
    label is never a role token it did not write. ``templating.RowSkipped`` as ``encode_chat`` (the template
    refuses the episode, it does not fit, it rewrites the final turn): the caller leaves it out, counted."""

    ids, labels = encode_chat(tokenizer, messages, max_len, fmt=fmt, tools=tools)
    labels = list(labels)
    assistant = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    for index in assistant[-turns:-1] if turns > 1 else []:
        try:
            head_ids, head_labels = encode_chat(
                tokenizer, messages[: index + 1], max_len, fmt=fmt, tools=tools
            )
        except RowSkipped as exc:
            log.debug("assistant turn %d cannot be encoded alone (%s): left unlabelled", index, exc)
            continue
        if ids[: len(head_ids)] != head_ids:
            log.debug("assistant turn %d is rendered differently later: left unlabelled", index)
            continue
        for pos, label in enumerate(head_labels):
            if label != IGNORE:
                labels[pos] = label
    return ids, labels


def sequence_logprobs(
    model: Any, examples: list[tuple[list[int], list[int]]], *, row_len: int, pad_id: int, device: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(per_example, logp, owner)``: the summed log-probability of each example's labelled tokens
    ``[N]``, every labelled token's log-probability ``[T]`` and the example it belongs to ``[T]``, from one
    packed forward of ``model`` (with gradients when they are enabled)."""
    import torch

    tensors = {k: v.to(device) for k, v in packed_tensors(examples, row_len, pad_id, owners=True).items()}
    logp, where = label_logprobs(model, tensors)
    owner = tensors["example_index"][:, 1:].flatten()[where]
    per_example = torch.zeros(len(examples), dtype=logp.dtype, device=logp.device).index_add(0, owner, logp)
    return per_example, logp, owner
