"""Training: the LoRA job (``job``, top to bottom, with its fast path in ``kernels``) and the advancement
step that runs one job per specialist (``step``)."""

from pipeline.training.job import (
    ALL_LINEAR,
    TrainConfig,
    TrainResult,
    batch_indices,
    dataset_sha256,
    git_describe,
    train_lora,
    write_dataset,
)
from pipeline.training.step import train_step

__all__ = [
    "ALL_LINEAR",
    "TrainConfig",
    "TrainResult",
    "batch_indices",
    "dataset_sha256",
    "git_describe",
    "train_lora",
    "train_step",
    "write_dataset",
]
