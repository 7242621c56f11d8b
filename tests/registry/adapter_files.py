"""A small but real adapter directory (safetensors weights and a LoRA peft config), for registry tests."""

from __future__ import annotations

import json
from pathlib import Path


def stored_adapter(path: Path, *, rank: int = 4) -> dict[str, str]:
    """Write an adapter at ``path``; returns ``create_adapter``'s ``artifact_uri`` and ``sha256`` for it."""
    import torch
    from safetensors.torch import save_file

    from pipeline.specs.loading import file_sha256

    path.mkdir(parents=True, exist_ok=True)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    save_file(
        {key.format("A"): torch.zeros(rank, 8), key.format("B"): torch.zeros(8, rank)},
        str(path / "adapter_model.safetensors"),
    )
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj"]}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return {"artifact_uri": str(path), "sha256": file_sha256(path / "adapter_model.safetensors")}
