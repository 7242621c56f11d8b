"""Where and in what precision a base model runs: device from the settings, dtype from the model spec.

``placement(dtype=..., device=...)`` resolves both once for collection, training, evaluation and serving:

- device ``auto`` is CUDA when torch sees a GPU, else the CPU; ``cpu``, ``cuda`` and ``cuda:N`` as given
  (``RATCHET_DEVICE``);
- dtype ``auto`` is bfloat16 on a GPU that supports it (float16 on one that does not), float32 on the CPU;
  ``float32``, ``bfloat16`` and ``float16`` as given (the model spec's ``dtype``). A half-precision dtype on a
  CPU without native support for it (bfloat16 needs AVX512-BF16 or AMX) is slow for matmuls there: one
  warning says so, and it is still honoured.

``tokenizer_dir(spec.tokenizer, base_dir)`` is the model spec's ``tokenizer`` (a directory) or the base's own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.errors import RatchetError
from pipeline.settings import get_settings

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
DTYPES = ("auto", "float32", "bfloat16", "float16")
_WARNED: set[str] = set()


@dataclass(frozen=True)
class Placement:
    """A resolved device (``cpu``, ``cuda``, ``cuda:1``) and torch dtype name."""

    device: str
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)


def placement(*, dtype: str = "auto", device: str = "auto") -> Placement:
    """Resolve the device and dtype (see the module docstring)."""
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    on_gpu = device.startswith("cuda")
    if on_gpu and not torch.cuda.is_available():
        raise RatchetError(f"device {device!r} was asked for (RATCHET_DEVICE) but torch sees no CUDA GPU")
    if dtype == "auto":
        dtype = ("bfloat16" if torch.cuda.is_bf16_supported() else "float16") if on_gpu else "float32"
    elif not on_gpu and dtype != "float32" and dtype not in _WARNED and not _native_cpu(dtype):
        _WARNED.add(dtype)
        log.warning(
            "dtype %s on the CPU is honoured but slow (this CPU has no native matmuls for it: float32 is "
            "faster); set the model spec's dtype to auto or float32 for CPU runs",
            dtype,
        )
    return Placement(device=device, dtype=dtype)


def _native_cpu(dtype: str) -> bool:
    """Whether this CPU multiplies ``dtype`` natively (bfloat16 with AVX512-BF16 or AMX: measured 2.5-3.4x
    faster than float32 matmuls on such a CPU); float16 on a CPU is always the slow path."""
    import torch

    if dtype != "bfloat16":
        return False
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    return bool(torch.cpu._is_avx512_bf16_supported() or amx())


def spec_placement(dtype: str = "auto") -> Placement:
    """The placement of a model spec's ``dtype`` under the current settings (device from ``Settings``)."""

    return placement(dtype=dtype, device=get_settings().device)


def tokenizer_dir(tokenizer: str, base_dir: str | Path) -> Path:
    """The tokenizer directory a model spec's ``tokenizer`` names (``same_as_base``: the base directory)."""
    return Path(base_dir) if tokenizer == "same_as_base" else Path(tokenizer)
