"""Serving fixtures: tiny model + adapters built once per session, and a registry with a champion."""

from __future__ import annotations

import pytest

from serving.support import build_artifacts, champion_registry


@pytest.fixture(scope="session")
def tiny_artifacts(tmp_path_factory) -> dict:
    """Base model dir and one adapter dir per specialist (built once per session)."""
    return build_artifacts(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def registry(tmp_path, tiny_artifacts) -> str:
    return champion_registry(tmp_path, tiny_artifacts)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The tiny model decodes fastest on one thread (intra-op threads only add overhead, and contend with
    the uvicorn / writer threads); restored after each module."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
