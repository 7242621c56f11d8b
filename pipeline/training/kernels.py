"""The LoRA job's fast path: one autograd function per LoRA linear, and a loss computed only where labels are.

``merged_lora(model)`` (a context manager) makes each plain LoRA linear compute peft's ``W x + scale * B (A x)``
as one autograd function with the same gradients in fewer and larger matmuls; ``assistant_loss`` computes
logits only at labelled positions, and ``label_logprobs`` the log-probability of each labelled token there
(what preference and RL training sum per example). Both are exact where they apply (tests compare them with peft's forward
and transformers' loss) and step aside where they would not be.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from pipeline.modeling.packing import IGNORE

__all__ = ["LOGIT_PROCESSING", "assistant_loss", "label_logprobs", "merged_lora"]


@contextlib.contextmanager
def merged_lora(model: Any) -> Iterator[int]:
    """While training, compute each plain LoRA linear (one adapter, no dropout, no DoRA, no LoRA bias,
    frozen base) with ``_lora_linear``: the same function and gradients as peft's
    ``W x + scale * B (A x)``, with fewer and larger matmuls, which is what dominates a small model's
    step on CPU. Yields how many modules take that path; restores peft's own forward on exit."""
    import torch
    from peft.tuners.lora import Linear as LoraLinear

    function = _lora_linear()

    def merged(module: Any, name: str) -> Callable[..., Any]:
        base, lora_a, lora_b = module.base_layer, module.lora_A[name], module.lora_B[name]
        scale = float(module.scaling[name])

        def forward(x: Any, *args: Any, **kwargs: Any) -> Any:
            return function.apply(x, base.weight, base.bias, lora_a.weight, lora_b.weight, scale)

        return forward

    patched = []
    for module in model.modules():
        if not isinstance(module, LoraLinear) or module.merged or len(module.active_adapters) != 1:
            continue
        name = module.active_adapters[0]
        base = module.base_layer
        plain = (
            isinstance(module.lora_dropout[name], torch.nn.Identity)
            and name not in module.lora_variant  # DoRA, aLoRA, ... keep peft's forward
            and not module.disable_adapters
            and module.lora_B[name].bias is None
            and not getattr(module, "fan_in_fan_out", False)
            and isinstance(base, torch.nn.Linear)
            and not base.weight.requires_grad
            and (base.bias is None or not base.bias.requires_grad)
            # peft keeps adapters in float32 over a half-precision base and casts x; that path stays peft's
            and base.weight.dtype == module.lora_A[name].weight.dtype == module.lora_B[name].weight.dtype
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


def assistant_loss(model: Any, tensors: dict[str, Any]) -> Any:
    """Mean next-token cross-entropy over labelled positions, computing logits only there (most tokens of
    a chat example are prompt). Equal to the causal-LM loss transformers computes from ``labels``."""
    import torch.nn.functional as F

    found = _labelled_logits(model, tensors)
    if found is None:
        return model(**_model_inputs(tensors), use_cache=False).loss
    logits, targets, _ = found
    return F.cross_entropy(logits.float(), targets)


def label_logprobs(model: Any, tensors: dict[str, Any]) -> tuple[Any, Any]:
    """``(logp, where)``: the log-probability of each labelled next token, in row-major order, and the flat
    index of the position that predicts it (to look up ``example_index`` of a packed batch). Logits are
    computed only there, as in ``assistant_loss``; the sum of ``-logp`` over a batch divided by its count
    is that loss."""
    import torch

    found = _labelled_logits(model, tensors)
    if found is None:  # a model that post-processes logits: its own full forward
        logits = model(**_model_inputs(tensors), use_cache=False).logits[:, :-1]
        targets = tensors["labels"][:, 1:]
        keep = targets != IGNORE
        logits, targets = logits[keep], targets[keep]
        where = keep.flatten().nonzero().squeeze(-1)
    else:
        logits, targets, where = found
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logp, where


def _model_inputs(tensors: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v for k, v in tensors.items() if k in ("input_ids", "labels", "position_ids", "attention_mask")
    }


def _labelled_logits(model: Any, tensors: dict[str, Any]) -> tuple[Any, Any, Any] | None:
    """Logits at the positions before each label, the labels, and those positions' flat indices (in the
    ``[rows, L - 1]`` grid); None for a model whose logits need its own forward."""

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = inner.get_decoder() if hasattr(inner, "get_decoder") else None
    head = inner.get_output_embeddings()
    config = getattr(inner, "config", None)
    # Models that post-process logits (soft-capping, scaling) keep their own forward and loss.
    processed = any(getattr(config, k, None) not in (None, 1, 1.0) for k in LOGIT_PROCESSING)
    if decoder is None or decoder is inner or head is None or processed:
        return None
    hidden = decoder(
        input_ids=tensors["input_ids"], position_ids=tensors["position_ids"], use_cache=False
    ).last_hidden_state
    targets = tensors["labels"][:, 1:]
    keep = targets != IGNORE
    return head(hidden[:, :-1][keep]), targets[keep], keep.flatten().nonzero().squeeze(-1)


LOGIT_PROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
