"""An adapter's weights file checked from its safetensors header alone, before any tensor is read or
allocated: a truncated or corrupt file, sizes beyond the file, non-float weights, or LoRA shapes of another
rank than the peft config's are a ``RatchetError`` of one line (a 400 at ``/v1/load_lora_adapter``), never
an error deep inside safetensors or peft."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from pipeline.errors import RatchetError

__all__ = ["FLOAT_DTYPES", "check_weights_header"]

# dtypes a LoRA's weights may have (safetensors' names); integers, booleans and 8-bit floats are refused
FLOAT_DTYPES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


def check_weights_header(weights: Path, ranks: Sequence[int], at: str) -> None:
    """Refuse a weights file whose safetensors header is not what a LoRA of ``ranks`` holds (truncated,
    unparsable, offsets or sizes beyond the file, non-float dtypes, lora_A/lora_B shapes of another rank),
    read from the header alone, before any tensor is allocated."""
    size = weights.stat().st_size
    bad = f"{at}: {weights.name} is not a valid safetensors file"
    with weights.open("rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= min(size - 8, MAX_HEADER_BYTES):
            raise RatchetError(f"{bad} (header of {length} bytes in a file of {size})")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise RatchetError(f"{bad} (unreadable header)") from None
    if not isinstance(header, dict):
        raise RatchetError(f"{bad} (unreadable header)")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    data = size - 8 - length
    if not tensors:
        raise RatchetError(f"{at}: {weights.name} holds no tensors")
    for name, info in tensors.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], list(info["shape"]), info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise RatchetError(f"{bad} (tensor {name[:80]!r}: malformed entry)") from None
        if dtype not in FLOAT_DTYPES:
            raise RatchetError(
                f"{at}: weight {name[:80]!r} has dtype {str(dtype)[:20]!r}, expected a float type (F16, BF16, F32)"
            )
        ints = all(type(n) is int and n >= 0 for n in (*shape, begin, end))
        if not ints or not begin <= end <= data or end - begin != math.prod(shape) * FLOAT_DTYPES[dtype]:
            raise RatchetError(f"{bad} (tensor {name[:80]!r}: its size does not match the file)")
        rank_dim = 0 if ".lora_A" in name or "lora_embedding_A" in name else 1
        if ("lora_A" in name or "lora_B" in name) and (len(shape) < 2 or shape[rank_dim] not in ranks):
            raise RatchetError(
                f"{at}: weight {name[:80]!r} has shape {shape}, which is not a LoRA of rank "
                f"{' or '.join(map(str, sorted(set(ranks))))} (adapter_config.json)"
            )
