"""Padding-free attention for packed training rows: each packed example attends causally to itself only,
with no ``[rows, L, L]`` mask built or read.

A packed batch (``packing.packed_tensors``) holds several examples per row, positions restarting at 0 for
each, and ``cu_seq_lens``: the cumulative lengths of its segments over the flattened ``rows * L`` tokens
(int32, flash-attention's varlen convention; a row's trailing padding is a segment of its own). Without
this module transformers derives a block-diagonal 4D mask from the position ids, and a masked
``scaled_dot_product_attention`` leaves its flash and memory-efficient kernels on a GPU (they take no
arbitrary mask) for the math kernel, which reads and writes the whole ``L x L`` score matrix.

``padding_free(model)`` (a context manager the training jobs enter for the whole job, backward included:
activation checkpointing recomputes the forward during backward) switches the model's attention to

- ``flash_attention_2`` (transformers' own varlen integration) when the ``flash_attn`` package is
  installed and the model is on a CUDA device in half precision, else
- ``PACKED`` (registered here with transformers' ``AttentionInterface``): ``scaled_dot_product_attention``
  run once per segment with ``is_causal=True`` and no mask (on a GPU: the flash or memory-efficient
  kernel), attention cost ``sum(n_i^2)`` instead of ``rows * L^2``.

It is a no-op (yields None) for models it cannot serve exactly: sliding-window or other non-full
attention layers, models whose attention does not dispatch through ``AttentionInterface``; and on a CPU
unless asked (``cpu=True``): there the masked SDPA has a fused kernel too, and on the real-proportion model
(Qwen3-0.6B layers, 4 steps of 8 packed traces, one thread) the per-segment path took 3% more process CPU
time (8.32 s vs 8.06 s, mean of 4 runs, same losses), so the job keeps the masked path there. ``attention_kwargs`` gives the keyword arguments the decoder's forward takes for a packed batch
(``kernels`` passes them). Anything else run inside the switch stays exact: a padding mask, a KV cache or
unpacked rows take transformers' SDPA path.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

__all__ = ["PACKED", "attention_kwargs", "padding_free", "padding_free_implementation"]

PACKED = "ratchet_packed_sdpa"
"""The name of the per-segment SDPA attention in transformers' ``AttentionInterface``."""

FLASH = "flash_attention_2"
PADDING_FREE = (PACKED, FLASH, "flash_attention_3", "flash_attention_4")
"""Implementations that take a packed batch's segments from ``cu_seq_lens_q/k`` (no 4D mask)."""


def padding_free_implementation(model: Any, *, cpu: bool = False) -> str | None:
    """The padding-free implementation ``padding_free`` would switch ``model`` to, or None when it cannot
    serve the model exactly (non-full attention layers, no ``AttentionInterface`` dispatch) or the model is
    not on a GPU and ``cpu`` is False."""
    import torch

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(inner, "config", None)
    if config is None or not hasattr(inner, "set_attn_implementation"):
        return None
    can_set = getattr(inner, "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        return None
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return None
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return None
    if not getattr(config, "is_causal", True):
        return None
    weight = next(inner.parameters(), None)
    on_gpu = weight is not None and weight.device.type not in ("cpu", "meta")
    if not on_gpu and not cpu:
        return None
    if config._attn_implementation in PADDING_FREE:
        return config._attn_implementation
    if (
        weight.device.type == "cuda"
        and weight.dtype in (torch.float16, torch.bfloat16)
        and _flash_installed()
    ):
        return FLASH
    return PACKED


@contextlib.contextmanager
def padding_free(model: Any, *, cpu: bool = False) -> Iterator[str | None]:
    """Run ``model``'s attention padding-free (``padding_free_implementation``) inside the block; yields the
    implementation's name (None: unchanged) and restores the previous implementation on exit."""
    chosen = padding_free_implementation(model, cpu=cpu)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    previous = getattr(getattr(inner, "config", None), "_attn_implementation", None)
    if chosen is None or chosen == previous:
        yield chosen
        return
    _register()
    inner.set_attn_implementation(chosen)
    try:
        yield chosen
    finally:
        inner.set_attn_implementation(previous)


def attention_kwargs(model: Any, tensors: dict[str, Any]) -> dict[str, Any]:
    """The decoder's keyword arguments for a packed batch: ``cu_seq_lens_q/k`` and ``max_length_q/k`` when
    the model runs a padding-free implementation and the batch has ``cu_seq_lens``; else none (the
    position ids alone, as before). One host read of the lengths per forward, not one per layer: the
    per-segment SDPA gets them on the host, flash-attention on the device."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    implementation = getattr(getattr(inner, "config", None), "_attn_implementation", None)
    cu = tensors.get("cu_seq_lens")
    if cu is None or implementation not in PADDING_FREE:
        return {}
    import torch

    host = cu.cpu()
    longest = int((host[1:] - host[:-1]).max())
    lens = host if implementation == PACKED else cu.to(dtype=torch.int32)
    return {"cu_seq_lens_q": lens, "cu_seq_lens_k": lens, "max_length_q": longest, "max_length_k": longest}


def _flash_installed() -> bool:
    try:
        from transformers.utils import is_flash_attn_2_available
    except ImportError:  # pragma: no cover - every supported transformers has it
        return False
    return bool(is_flash_attn_2_available())


@functools.cache  # once per process: the interfaces are global registries
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(PACKED, _packed_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED, _packed_mask)


def _packed_mask(*args: Any, **kwargs: Any) -> Any:
    """No mask for a causal forward over whole rows without padding (the segments come from
    ``cu_seq_lens``/position ids); transformers' SDPA mask otherwise (a padding mask, a KV cache)."""
    from transformers.masking_utils import sdpa_mask

    mask, q_length, kv_offset = (
        kwargs.get("attention_mask"),
        kwargs.get("q_length"),
        kwargs.get("kv_offset", 0),
    )
    if q_length is None and kwargs.get("cache_position") is not None:  # transformers < 5.2x passes positions
        q_length = kwargs["cache_position"].shape[0]
    # as many keys as queries, none before them: no KV cache holds earlier tokens
    plain = q_length == kwargs.get("kv_length") and isinstance(kv_offset, int) and kv_offset == 0
    if plain and (mask is None or bool(mask.all())):
        return None
    return sdpa_mask(*args, **kwargs)


def _packed_attention(
    module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any
) -> tuple[Any, None]:
    """``scaled_dot_product_attention`` per packed segment, causal, no mask; transformers' SDPA forward
    (the same function per segment) for everything else. ``query``: ``[rows, heads, L, dim]``; returns
    ``[rows, L, heads, dim]`` as every attention function of the interface."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows, _, length, _ = query.shape
    if attention_mask is not None or key.shape[2] != length or length == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    cu = kwargs.pop("cu_seq_lens_q", None)
    kwargs.pop("cu_seq_lens_k", None)
    position_ids = kwargs.get("position_ids")
    if cu is not None:
        bounds = cu.tolist()
    elif position_ids is not None:  # a segment starts at each position 0, and at each row
        starts = (position_ids.expand(rows, -1).reshape(-1) == 0).nonzero().squeeze(-1).tolist()
        bounds = sorted({*starts, *range(0, rows * length + 1, length)})
    else:
        bounds = [r * length for r in range(rows + 1)]
    if len(bounds) == rows + 1 and bounds == [r * length for r in range(rows + 1)]:
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)  # one example per row
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        row, col = divmod(start, length)
        span = slice(col, col + end - start)
        out, _ = sdpa_attention_forward(
            module, query[row : row + 1, :, span], key[row : row + 1, :, span], value[row : row + 1, :, span],
            None, **kwargs,
        )  # fmt: skip
        pieces.append(out)
    return torch.cat(pieces, dim=1).view(rows, length, *pieces[0].shape[2:]), None
