"""The LoRA job's fast path: one autograd function per LoRA linear, and a loss computed only where labels are.

``merged_lora(model)`` (a context manager) makes each plain LoRA linear compute peft's ``W x + scale * B (A x)``
as one autograd function with the same gradients: in fewer and larger matmuls over a float32 base, in the
base's precision with the update kept apart over a bf16/fp16 one (float32 master weights); it steps aside,
call by call, when the model runs another adapter or none. ``assistant_loss`` computes logits only at
labelled positions, and ``label_logprobs`` the log-probability of each labelled token there (what
preference and RL training sum per example), the head and the float32 log-softmax a chunk of positions at
a time. Both are exact where they apply (tests compare them with peft's forward and transformers' loss)
and step aside where they would not be.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from pipeline.modeling.packing import IGNORE
from pipeline.training.attention import attention_kwargs

__all__ = [
    "LOGITS_BUDGET",
    "LOGIT_PROCESSING",
    "assistant_loss",
    "label_logprobs",
    "loss_chunk",
    "merged_lora",
]

LOGITS_BUDGET = 2**28
"""Bytes of float32 full-vocabulary logits that exist at once in ``assistant_loss``/``label_logprobs``
(256 MiB: 441 positions of a 152k vocabulary, 2,048 of a 32k one, every position of a small one)."""


@contextlib.contextmanager
def merged_lora(model: Any) -> Iterator[int]:
    """While training, compute each plain LoRA linear (one adapter, no dropout, no DoRA, no LoRA bias,
    frozen base) as one autograd function with peft's function and gradients: ``_lora_linear`` (one matmul
    with the merged weight ``W + scale * B A``: fewer and larger matmuls, what dominates a small model's
    step on CPU) over a float32 base, ``_lora_delta`` (``x W^T + scale * (x A^T) B^T``, the LoRA factors
    cast to the base's dtype) over a half-precision one. Yields how many modules take that path; restores
    peft's own forward on exit.

    Over bf16/fp16 the merged weight would be rounded to the base's precision, where a small update (B A a
    1e-4 fraction of W: a LoRA's early steps) is mostly rounding noise: measured on a 512x512 bf16 layer,
    the merged weight (formed in bf16, or in float32 then cast) carries the update with 3.2x its own size
    in error, the thin path as peft does (0.98x: the output's own bf16 rounding, bitwise equal to peft's
    output there). The factors stay the float32 master weights (peft's ``autocast_adapter_dtype``): the
    forward casts them, their gradients come back in float32, and no float32 copy of the input is saved
    (peft casts ``x`` to float32 for its LoRA path and keeps it for backward).

    Each patched forward checks, per call, that adapters are enabled and the patched adapter is the active
    one, and runs peft's own forward otherwise: a job that switches the same model to a frozen second
    adapter (a reference) or disables adapters (the bare base) gets exactly peft's result."""
    import torch
    from peft.tuners.lora import Linear as LoraLinear

    half = (torch.float16, torch.bfloat16)

    def merged(module: Any, name: str) -> Callable[..., Any]:
        base, lora_a, lora_b = module.base_layer, module.lora_A[name], module.lora_B[name]
        scale = float(module.scaling[name])
        function = _lora_delta() if base.weight.dtype in half else _lora_linear()
        peft_forward = type(module).forward

        def forward(x: Any, *args: Any, **kwargs: Any) -> Any:
            if (
                module.disable_adapters
                or module.merged
                or module.active_adapters != [name]
                or kwargs.get("adapter_names") is not None
                or x.dtype != base.weight.dtype
            ):
                return peft_forward(module, x, *args, **kwargs)
            return function.apply(x, base.weight, base.bias, lora_a.weight, lora_b.weight, scale)

        return forward

    patched = []
    for module in model.modules():
        if not isinstance(module, LoraLinear) or module.merged or len(module.active_adapters) != 1:
            continue
        name = module.active_adapters[0]
        base = module.base_layer
        a_dtype, b_dtype = module.lora_A[name].weight.dtype, module.lora_B[name].weight.dtype
        plain = (
            isinstance(module.lora_dropout[name], torch.nn.Identity)
            and name not in module.lora_variant  # DoRA, aLoRA, ... keep peft's forward
            and not module.disable_adapters
            and module.lora_B[name].bias is None
            and not getattr(module, "fan_in_fan_out", False)
            and isinstance(base, torch.nn.Linear)
            and not base.weight.requires_grad
            and (base.bias is None or not base.bias.requires_grad)
            # a full-precision base: the merged weight, in the adapter's own dtype; a half-precision one:
            # the thin path, whatever the factors' dtype (float32 master weights, or cast to the base's)
            and (base.weight.dtype in half or base.weight.dtype == a_dtype == b_dtype)
            and a_dtype.is_floating_point
            and b_dtype.is_floating_point
        )
        if plain:
            module.forward = merged(module, name)
            patched.append(module)
    try:
        yield len(patched)
    finally:
        for module in patched:
            del module.forward


@functools.cache  # one class per process, not one per job
def _lora_delta() -> Any:
    """``y = x W^T + bias + scale * (x A^T) B^T`` as one autograd function over a half-precision base (W,
    bias frozen; A, B in any floating dtype, cast to x's in the forward, their gradients returned in their
    own dtype).

    The update stays a separate rank-thin product added by one ``addmm`` (one rounding of the sum, as
    peft's float32 add then cast), so small updates are not rounded into the weight. Saved for backward:
    ``x`` in the base's dtype and ``x A^T`` (rank-thin), not a float32 copy of ``x``."""
    import torch
    import torch.nn.functional as F

    class LoraDeltaFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, weight: Any, bias: Any, lora_a: Any, lora_b: Any, scale: float) -> Any:
            a, b = lora_a.to(x.dtype), lora_b.to(x.dtype)
            flat = x.reshape(-1, x.shape[-1])
            thin = flat @ a.t()
            y = torch.addmm(F.linear(flat, weight, bias), thin, b.t(), alpha=scale)
            ctx.save_for_backward(x, weight, lora_a, lora_b, thin)
            ctx.scale = scale
            return y.view(*x.shape[:-1], y.shape[-1])

        @staticmethod
        def backward(ctx: Any, grad_out: Any) -> Any:
            x, weight, lora_a, lora_b, thin = ctx.saved_tensors
            a, b = lora_a.to(x.dtype), lora_b.to(x.dtype)
            flat_x, flat_g = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
            g_b = flat_g @ b  # [tokens, r]
            grad_x = grad_a = grad_b = None
            if ctx.needs_input_grad[0]:
                grad_x = torch.addmm(flat_g @ weight, g_b, a, alpha=ctx.scale).view(x.shape)
            if ctx.needs_input_grad[3]:
                grad_a = (g_b.t() @ flat_x).to(lora_a.dtype) * ctx.scale
            if ctx.needs_input_grad[4]:
                grad_b = (flat_g.t() @ thin).to(lora_b.dtype) * ctx.scale
            return grad_x, None, None, grad_a, grad_b, None

    return LoraDeltaFunction


@functools.cache  # one class per process, not one per job
def _lora_linear() -> Any:
    """``y = x (W + scale * B A)^T + bias`` as one autograd function (W, bias frozen).

    Forward: one matmul with the merged weight instead of peft's three (the base and two rank-thin
    ones) plus a scale and an add. Backward: ``dx`` through the merged weight (formed again, not kept:
    no extra copy of the weights lives between forward and backward), and the gradients of A and B
    through rank-thin products (``scale * dy^T (x A^T)`` and ``scale * (dy B)^T x``), which cost less
    than forming the full ``dy^T x``."""
    import torch
    import torch.nn.functional as F

    class LoraLinearFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, weight: Any, bias: Any, lora_a: Any, lora_b: Any, scale: float) -> Any:
            ctx.save_for_backward(x, weight, lora_a, lora_b)
            ctx.scale = scale
            return F.linear(x, torch.addmm(weight, lora_b, lora_a, alpha=scale), bias)

        @staticmethod
        def backward(ctx: Any, grad_out: Any) -> Any:
            x, weight, lora_a, lora_b = ctx.saved_tensors
            grad_x = None
            if ctx.needs_input_grad[0]:
                grad_x = grad_out @ torch.addmm(weight, lora_b, lora_a, alpha=ctx.scale)
            flat_x, flat_g = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
            grad_a = grad_b = None
            if ctx.needs_input_grad[3]:
                grad_a = (flat_g @ lora_b).t() @ flat_x * ctx.scale
            if ctx.needs_input_grad[4]:
                grad_b = flat_g.t() @ (flat_x @ lora_a.t()) * ctx.scale
            return grad_x, None, None, grad_a, grad_b, None

    return LoraLinearFunction


def assistant_loss(model: Any, tensors: dict[str, Any], *, chunk: int | None = None) -> Any:
    """Mean next-token cross-entropy over labelled positions, computing logits only there (most tokens of
    a chat example are prompt), ``chunk`` positions at a time (``label_logprobs``). Equal to the causal-LM
    loss transformers computes from ``labels``."""
    found = _labelled_hidden(model, tensors)
    if found is None:
        return model(**_model_inputs(tensors), use_cache=False).loss
    hidden, targets, _, head = found
    logp = _chunked_logprobs(head, hidden, targets, chunk)
    return -logp.sum() / max(logp.numel(), 1)


def label_logprobs(model: Any, tensors: dict[str, Any], *, chunk: int | None = None) -> tuple[Any, Any]:
    """``(logp, where)``: the log-probability of each labelled next token, in row-major order, and the flat
    index of the position that predicts it (to look up ``example_index`` of a packed batch). Logits are
    computed only there, as in ``assistant_loss``; the sum of ``-logp`` over a batch divided by its count
    is that loss.

    The head and the float32 log-softmax run over ``chunk`` positions at a time (None: ``loss_chunk``),
    each under activation checkpointing when gradients are wanted: the ``[positions, vocab]`` float32
    logits (4 bytes x 152k vocabulary per position: 0.6 GB per 1,000 positions) are never whole, in the
    forward or the backward, which recomputes one chunk's logits at a time."""
    import torch

    found = _labelled_hidden(model, tensors)
    if found is None:  # a model that post-processes logits: its own full forward
        logits = model(**_model_inputs(tensors), use_cache=False).logits[:, :-1]
        targets = tensors["labels"][:, 1:]
        keep = targets != IGNORE
        logits, targets = logits[keep], targets[keep]
        where = keep.flatten().nonzero().squeeze(-1)
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return logp, where
    hidden, targets, where, head = found
    return _chunked_logprobs(head, hidden, targets, chunk), where


def _chunk_logprobs(head: Any, hidden: Any, targets: Any) -> Any:
    import torch.nn.functional as F

    return -F.cross_entropy(head(hidden).float(), targets, reduction="none")


def loss_chunk(vocab: int) -> int:
    """Labelled positions per chunk of the loss: as many as ``LOGITS_BUDGET`` holds of ``vocab``-wide
    float32 logits (at least one)."""
    return max(1, LOGITS_BUDGET // (4 * vocab))


def _chunked_logprobs(head: Any, hidden: Any, targets: Any, chunk: int | None) -> Any:
    """``log softmax(head(hidden))[targets]`` in float32, ``chunk`` rows at a time; each chunk checkpointed
    (its logits recomputed in backward) when a gradient can flow into it and there is more than one chunk
    (one chunk's saved logits are no more than the bound: no recomputation, what a small CPU batch pays)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    chunk = chunk or loss_chunk(head.weight.shape[0])
    if hidden.shape[0] <= chunk:
        return _chunk_logprobs(head, hidden, targets)
    grad = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in head.parameters())
    )
    parts = []
    for start in range(0, hidden.shape[0], chunk):
        h, t = hidden[start : start + chunk], targets[start : start + chunk]
        if grad:
            parts.append(checkpoint(_chunk_logprobs, head, h, t, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(head, h, t))
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


def _model_inputs(tensors: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v for k, v in tensors.items() if k in ("input_ids", "labels", "position_ids", "attention_mask")
    }


def _labelled_hidden(model: Any, tensors: dict[str, Any]) -> tuple[Any, Any, Any, Any] | None:
    """The last hidden states at the positions before each label, the labels, those positions' flat indices
    (in the ``[rows, L - 1]`` grid) and the output head; None for a model whose logits need its own
    forward. A padding-free attention (``attention.padding_free``) gets the batch's segments."""

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = inner.get_decoder() if hasattr(inner, "get_decoder") else None
    head = inner.get_output_embeddings()
    config = getattr(inner, "config", None)
    # Models that post-process logits (soft-capping, scaling) keep their own forward and loss.
    processed = any(getattr(config, k, None) not in (None, 1, 1.0) for k in LOGIT_PROCESSING)
    if decoder is None or decoder is inner or head is None or processed:
        return None
    hidden = decoder(
        input_ids=tensors["input_ids"],
        position_ids=tensors["position_ids"],
        use_cache=False,
        **attention_kwargs(model, tensors),
    ).last_hidden_state
    targets = tensors["labels"][:, 1:]
    keep = targets != IGNORE
    return hidden[:, :-1][keep], targets[keep], keep.flatten().nonzero().squeeze(-1), head


LOGIT_PROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
