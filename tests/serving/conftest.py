"""Serving fixtures: tiny model + adapters built once per session, and a registry with a champion."""

from __future__ import annotations

import pytest

from serving.support import (
    SPECIALISTS,
    TOOL_ANSWER,
    TOOL_VIEW,
    build_adapter,
    build_base,
    register_generation,
)


@pytest.fixture(scope="session")
def tiny_artifacts(tmp_path_factory) -> dict:
    """Base model dir and one adapter dir per specialist (built once per session)."""
    root = tmp_path_factory.mktemp("tiny")
    base = build_base(root / "base")
    adapters = {}
    for i, s in enumerate(SPECIALISTS):
        train = [*TOOL_VIEW, {"role": "assistant", "content": TOOL_ANSWER}] if s == "agent" else None
        adapters[s] = build_adapter(base, root / f"adapter-{s}", seed=10 + i, train=train)
    return {"base": base, "adapters": adapters, "root": root}


@pytest.fixture
def registry(tmp_path, tiny_artifacts) -> str:
    from pipeline.registry import upgrade_db

    url = f"sqlite:///{tmp_path / 'serve.db'}"
    upgrade_db(url)
    register_generation(url, tiny_artifacts)
    return url


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The tiny model decodes fastest on one thread (intra-op threads only add overhead, and contend with
    the uvicorn / writer threads); restored after each module."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
