"""What the DPO and GRPO memory tests share: their small tiny-model config and a probe counting base copies."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from pipeline.environment.tinymodel import TinyModelConfig

SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                        max_position_embeddings=96, bootstrap_steps=40, bootstrap_batch_size=32,
                        corpus_size=400, seed=2)  # fmt: skip


@contextlib.contextmanager
def base_weight_copies() -> Iterator[set[int]]:
    """The storage of every token-embedding weight a forward runs while the block runs (a second copy of
    the base, such as a merged reference model, is a second address)."""
    import torch

    seen: set[int] = set()

    def hook(module, args, output):
        if isinstance(module, torch.nn.Embedding):
            seen.add(module.weight.untyped_storage().data_ptr())

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()
