"""A 4-bit base for training (QLoRA): the ``from_pretrained`` arguments of the model spec's ``quantization``.

``quantized_load_kwargs("nf4", where)`` loads the base's linear weights as 4-bit NormalFloat with double
quantization (Dettmers et al., 2023) through ``bitsandbytes``, computed in ``where``'s dtype, placed on
``where``'s device as they load (``device_map``: an 8B base never sits whole in float on the host). The
LoRA weights peft adds are ordinary float32 parameters beside the 4-bit ones, so the adapter a job saves is
unquantized and loads onto the float base (collection, evaluation and serving run the base in ``dtype``).
The output layer stays unquantized (transformers keeps it so).

``bitsandbytes`` is optional (``pip install 'ratchet-lineage[qlora]'``): without it, or where it cannot run
on the device, ``nf4`` is refused with one line before any weight is read. Measured on the CPU with
bitsandbytes 0.50.2 and torch 2.13: nf4 loads, trains a LoRA and saves it (``tests/training/test_quantization.py``);
on a CUDA GPU it is bitsandbytes' main path, not measured here.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from pipeline.errors import RatchetError

if TYPE_CHECKING:
    from pipeline.modeling.placement import Placement

__all__ = ["KINDS", "prepare_quantized", "quantized_load_kwargs"]

KINDS = ("none", "nf4")
INSTALL = "pip install 'ratchet-lineage[qlora]'"


def quantized_load_kwargs(kind: str, where: Placement) -> dict[str, Any]:
    """Extra ``from_pretrained`` arguments for a base quantized as ``kind``: ``none`` nothing; ``nf4`` a
    ``BitsAndBytesConfig`` (4-bit NormalFloat, double quantization, compute in ``where.torch_dtype``) and
    ``device_map`` onto ``where.device`` (the model is then not moved). Raises ``RatchetError`` when
    ``bitsandbytes`` is not installed or cannot quantize on ``where.device``."""
    if kind not in KINDS:
        raise RatchetError(f"quantization is one of {', '.join(KINDS)}, not {kind!r}")
    if kind == "none":
        return {}
    usable(where)
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=where.torch_dtype,
        bnb_4bit_use_double_quant=True,
    )
    return {"quantization_config": config, "device_map": {"": where.device}}


def usable(where: Placement) -> None:
    """Refuse, in one line, a 4-bit base ``bitsandbytes`` cannot give on ``where.device``: not installed, or
    its 4-bit quantization and matmul fail there (a probe of a 64 x 64 weight)."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise RatchetError(
            f"quantization nf4 needs bitsandbytes, which is not installed ({INSTALL}); or set the model "
            "spec's quantization to none"
        )
    import torch

    try:
        functional = importlib.import_module("bitsandbytes.functional")
        weight = torch.linspace(-1, 1, 64 * 64, device=where.device, dtype=where.torch_dtype).reshape(64, 64)
        packed, state = functional.quantize_4bit(weight, quant_type="nf4", compress_statistics=True)
        x = weight[:2]  # no random draw: the job's seeded stream stays as it was
        torch.nn.functional.linear(x, functional.dequantize_4bit(packed, state))
    except Exception as exc:  # bitsandbytes says why in its own words (no kernel for this device, ...)
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise RatchetError(
            f"quantization nf4: bitsandbytes cannot quantize on {where.device} ({reason}); set the model "
            "spec's quantization to none"
        ) from exc


def prepare_quantized(model: Any) -> Any:
    """A 4-bit base made ready for LoRA training, in place: every base weight frozen, and checked to be
    4-bit (a quantization that did not take would train a float base silently). peft's
    ``prepare_model_for_kbit_training`` is not used: it casts every unquantized weight (embeddings, output
    layer, norms) to float32, for 8B with a large vocabulary gigabytes more, which bfloat16 training does not
    need (the LoRA weights are float32 already)."""
    quantized = 0
    for _name, p in model.named_parameters():
        p.requires_grad_(False)
        quantized += type(p).__name__ == "Params4bit"
    if not quantized:
        raise RatchetError(
            "quantization nf4: the base loaded without a 4-bit weight (bitsandbytes did not apply)"
        )
    return model
