"""Fixtures of the training tests: the small tiny model (``support.SMALL``) and an SFT parent adapter on it,
built once per session (a module defining its own ``base_dir`` or ``parent`` uses its own)."""

from __future__ import annotations

import pytest

from pipeline.environment import training_corpus
from pipeline.environment.tinymodel import ensure_tiny_model
from pipeline.training import TrainConfig, train_lora, write_dataset
from training.support import SMALL


@pytest.fixture(scope="session")
def base_dir(tmp_path_factory):
    return ensure_tiny_model(config=SMALL, cache_dir=tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def parent(base_dir, tmp_path_factory):
    """An SFT adapter that moved the base: a reference that is not the bare base."""
    work = tmp_path_factory.mktemp("parent")
    write_dataset(training_corpus(120, seed=4), work / "sft")
    return train_lora(base_model_dir=base_dir, dataset_dir=work / "sft", output_dir=work / "job",
                      config=TrainConfig(rank=4, alpha=8, max_steps=10, batch_size=16, lr=5e-3)).adapter_dir  # fmt: skip
