"""What the training jobs share: the models a job starts from and its optimizer, episodes as labelled token
ids, and the log-probability of each example's labelled tokens.

``policy_model`` is the trainable LoRA a job starts from: the parent's adapter (continued), or a fresh one
(B = 0: the bare base). ``reference_model`` is the frozen model the job is held to: the parent pair (base +
parent adapter, merged), or the bare base when there is no parent. ``encode_episode`` labels every assistant
turn of a conversation (an RL episode may hold several: a tool call, the tool's result as context, the
answer). ``sequence_logprobs`` runs one packed forward (``packing.packed_tensors``, logits only at labelled
positions: ``kernels.label_logprobs``) and gives each labelled token's log-probability and its example.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.errors import RatchetError
from pipeline.modeling.decoding import attn_implementation_for, load_model
from pipeline.modeling.packing import packed_tensors
from pipeline.modeling.templating import IGNORE, RowSkipped, encode_chat
from pipeline.training.kernels import label_logprobs

if TYPE_CHECKING:
    import torch
    from peft import PeftModel
    from transformers import PreTrainedModel

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
) -> PeftModel:
    """The trainable peft model a job starts from: the parent's adapter, or a fresh LoRA of that shape."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    if (
        parent_adapter_dir is not None
        and not (Path(parent_adapter_dir) / "adapter_model.safetensors").is_file()
    ):
        raise RatchetError(  # peft would fall back to a pickled adapter_model.bin: never load one
            f"{parent_adapter_dir}: parent adapter has no adapter_model.safetensors"
        )
    attn = attn_implementation_for(base_model_dir)
    base = AutoModelForCausalLM.from_pretrained(  # safetensors only: a pickled checkpoint is refused
        base_model_dir, dtype=where.torch_dtype, use_safetensors=True,
        **({"attn_implementation": attn} if attn else {}),
    ).to(where.device)  # fmt: skip
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


def reference_model(
    base_model_dir: Path, *, parent_adapter_dir: Path | None, where: Placement, tokenizer_dir: Path | None
) -> PreTrainedModel:
    """The frozen model a job is held to (the parent pair: its adapter merged into a copy of the base; the
    bare base without a parent). Memory: one more copy of the base's weights."""

    model, _ = load_model(base_model_dir, parent_adapter_dir, where=where, tokenizer_dir=tokenizer_dir)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


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
