"""What a training step holds in memory at once: micro-batches cut by a token budget.

The spec's ``batch_size`` is the optimizer's batch; a step runs it as consecutive micro-batches whose
packed tokens fit ``micro_batch_tokens`` and accumulates their gradients, each micro-batch's loss scaled
so that the sum is the whole batch's loss (the same update as one forward over the batch, up to float
rounding). ``micro_batches`` cuts a batch in order (the batch's own order, so the cut is reproducible and a
resumed job cuts the same way); an example longer than the budget is a micro-batch of its own.

``token_budget`` resolves the spec's ``micro_batch_tokens`` (null: from the free device memory on a GPU, no
split on the CPU) and ``checkpointing_wanted`` its ``activation_checkpointing`` (``auto``: by the base's size).
Both estimate from the model's config; neither measures a forward.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.modeling.placement import Placement

__all__ = ["CHECKPOINTING_PARAMETERS", "checkpointing_wanted", "micro_batches", "token_budget", "token_bytes"]

log = logging.getLogger(__name__)

CHECKPOINTING_PARAMETERS = 1_000_000_000
"""``activation_checkpointing: auto`` turns it on for a base of at least this many parameters (1B)."""
USABLE = 0.8
"""The share of the device's free memory a derived budget plans to fill (the rest: the allocator's
fragmentation, the kernels' workspaces, what the estimate leaves out)."""


def micro_batches(lengths: Sequence[int], budget: int | None) -> list[list[int]]:
    """Positions ``0 .. len(lengths) - 1`` cut into consecutive groups whose summed lengths stay within
    ``budget`` tokens (a group holds at least one example); ``budget`` None: one group of all."""

    if budget is not None and budget < 1:
        raise ValueError(f"a micro-batch token budget must be positive, not {budget}")
    if not lengths:
        return []
    if budget is None:
        return [list(range(len(lengths)))]
    groups: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(lengths):
        if groups[-1] and used + n > budget:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return groups


def checkpointing_wanted(
    setting: str, model: Any, where: Placement, *, max_seq_len: int | None = None
) -> bool:
    """Whether a job recomputes activations in the backward pass (the spec's ``activation_checkpointing``).

    ``on`` / ``off`` as given. ``auto``: on for a base of at least ``CHECKPOINTING_PARAMETERS`` (1B)
    parameters on any device; on a GPU also when one ``max_seq_len`` sequence's activations without
    checkpointing (``token_bytes``) would not fit ``USABLE`` of the free memory; off otherwise (every CPU run
    of a smaller base, where the recompute costs time and memory is not short)."""

    if setting not in ("auto", "on", "off"):
        raise ValueError(f"activation_checkpointing is auto, on or off, not {setting!r}")
    if setting != "auto":
        return setting == "on"
    if base_parameters(model) >= CHECKPOINTING_PARAMETERS:
        return True
    if not where.device.startswith("cuda") or max_seq_len is None:
        return False
    free = _free_bytes(where.device)
    return (
        max_seq_len * token_bytes(model, where, max_seq_len=max_seq_len, checkpointing=False) > free * USABLE
    )


def token_budget(setting: int | None, *, where: Placement, model: Any, max_seq_len: int) -> int | None:
    """Tokens per micro-batch (the spec's ``micro_batch_tokens``): ``setting`` when given; None (one
    micro-batch per step, no split) on the CPU; on a GPU, derived when the model is loaded and before the
    first step:

        budget = (USABLE * free - 12 * trainable) / token_bytes(model)

    ``free``: ``torch.cuda.mem_get_info``'s free bytes of the job's device (the weights already there);
    ``12 * trainable``: the LoRA parameters' float32 gradients and AdamW's two moments (4 bytes each), not
    yet allocated; ``token_bytes``: what one token of a micro-batch holds between forward and backward (its
    formula is there), with activation checkpointing as the model has it. At least 1: a budget below
    ``max_seq_len`` still runs (each example alone), with a warning that it may not fit."""

    if setting is not None:
        if setting < 1:
            raise ValueError(f"a micro-batch token budget must be positive, not {setting}")
        return setting
    if not where.device.startswith("cuda"):
        return None
    checkpointing = checkpointing_on(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    usable = USABLE * _free_bytes(where.device) - 12 * trainable
    per_token = token_bytes(model, where, max_seq_len=max_seq_len, checkpointing=checkpointing)
    budget = max(1, int(usable // per_token))
    if budget < max_seq_len:
        log.warning(
            "%s: %d tokens per micro-batch fit the free memory (about %.0f KiB a token), fewer than one "
            "sequence of %d: a long example may not fit (set micro_batch_tokens, activation_checkpointing: "
            "on, or a shorter max_seq_len)", where.device, budget, per_token / 1024, max_seq_len,
        )  # fmt: skip
    log.info("%s: micro-batches of at most %d tokens (%.0f KiB a token, checkpointing %s)",
             where.device, budget, per_token / 1024, "on" if checkpointing else "off")  # fmt: skip
    return budget


def token_bytes(model: Any, where: Placement, *, max_seq_len: int, checkpointing: bool) -> float:
    """Bytes one trained token holds from its forward to its backward -- an estimate from the config, for
    a Llama-style decoder of ``L`` layers, width ``h``, MLP width ``i``, key/value width ``kv`` (KV heads x
    head size), ``n`` attention heads, vocabulary ``V``, ``b`` bytes per element of the compute dtype:

    - a block keeps ``block = b * (10 h + 4 i + 2 kv)``: its input and norms (2 h), q, k, v with and without
      rotary embedding (2 h + 2 kv), the attention output and o_proj's input (2 h), the second norm (2 h),
      the residual sums (2 h), and the MLP's gate, up, activation and product (4 i); ``eager`` attention
      (scores materialised) adds ``b * 2 n max_seq_len`` (scores and probabilities of the token's row);
    - without checkpointing all ``L`` blocks keep theirs: ``L * block``; with it each block keeps only its
      input (``L * b * h``) and one block is recomputed at a time (``+ block``);
    - the head: ``(b + 12) V`` -- logits in the compute dtype, their float32 copy, log-softmax and its
      gradient -- counted for every token, although only labelled positions have logits (an upper bound).
    """

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    b = _dtype_bytes(where.dtype)
    h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    inner = getattr(config, "intermediate_size", None) or 4 * h
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    block = b * (10 * h + 4 * inner + 2 * kv)
    if getattr(config, "_attn_implementation", None) == "eager":
        block += b * 2 * heads * max_seq_len
    kept = layers * b * h + block if checkpointing else layers * block
    return float(kept + (b + 12) * vocab)


def base_parameters(model: Any) -> int:
    """The frozen base's parameter count (LoRA weights left out; a 4-bit weight counted unpacked)."""
    total = 0
    for name, p in model.named_parameters():
        if "lora_" in name:
            continue
        state = getattr(p, "quant_state", None)  # bitsandbytes' Params4bit: two weights a byte
        total += state.shape.numel() if state is not None and hasattr(state, "shape") else p.numel()
    return total


def checkpointing_on(model: Any) -> bool:
    """Whether ``model`` (transformers', or peft's around it) recomputes activations in training."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # transformers >= 5.2x, older
        try:
            return bool(getattr(model, name))
        except AttributeError:
            continue
    return False


def _dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def _free_bytes(device: str) -> int:
    import torch

    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free)
