"""The reference a preference or RL job is held to, without a second copy of the base (``reference_of``).

With a parent, the parent's adapter is loaded into the policy's own peft model as a second, frozen adapter;
``with reference(): ...`` runs the model as the parent pair and must give the log-probabilities of the parent
merged into a copy of the base (how jobs loaded the reference before) -- also while the merged-LoRA kernel is on,
whose patched forward must then step aside for peft's (``kernels.merged_lora`` checks the active adapter).
Without a parent the reference is the bare base (adapters disabled). Afterwards the policy is exactly as
before: the same log-probabilities, active adapter, training mode and ``requires_grad`` flags; the
reference's weights are never in the optimizer, get no gradient and do not move with a step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from realmodel import build_real_model

from pipeline.errors import RatchetError
from pipeline.modeling.decoding import load_model
from pipeline.modeling.placement import Placement
from pipeline.training.kernels import merged_lora
from pipeline.training.likelihood import (
    REFERENCE,
    optimizer,
    policy_model,
    reference_of,
    sequence_logprobs,
)

CPU = Placement(device="cpu", dtype="float32")
LORA = {
    "rank": 4,
    "alpha": 8.0,
    "dropout": 0.0,
    "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"],
}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return build_real_model(tmp_path_factory.mktemp("qwen") / "model", sharpness=1.0)


def moved(model, scale: float, seed: int) -> None:
    """Give every LoRA weight of ``model``'s active adapter random values (a trained adapter's)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name and ".default." in name:
                p.copy_(torch.randn(p.shape, generator=generator) * scale)


@pytest.fixture(scope="module")
def parent(base, tmp_path_factory) -> Path:
    model = policy_model(base, **LORA, parent_adapter_dir=None, where=CPU)
    moved(model, 0.2, seed=1)
    out = tmp_path_factory.mktemp("parent") / "adapter"
    model.save_pretrained(out, safe_serialization=True)
    return out


def examples() -> list[tuple[list[int], list[int]]]:
    import torch

    generator = torch.Generator().manual_seed(3)
    out = []
    for n in (9, 14, 6, 11):
        ids = torch.randint(5, 300, (n,), generator=generator).tolist()
        out.append((ids, [-100] * 3 + ids[3:]))
    return out


def logps(model):
    per_example, _, _ = sequence_logprobs(model, examples(), row_len=64, pad_id=0, device="cpu")
    return per_example


def merged_reference(base: Path, parent_dir: Path | None):
    """The reference as jobs loaded it before: the parent merged into a second copy of the base (or the
    bare base)."""
    import torch

    model, _ = load_model(base, parent_dir, where=CPU)
    model.eval()

    with torch.no_grad():
        return logps(model)


@pytest.mark.parametrize("kernel", [False, True], ids=["peft forward", "merged-LoRA kernel"])
@pytest.mark.parametrize("with_parent", [True, False], ids=["parent adapter", "bare base"])
def test_the_reference_is_the_parent_pair_and_the_policy_is_restored(base, parent, kernel, with_parent):
    """Fails with the kernel on until ``merged_lora`` runs peft's forward for an adapter it did not patch
    (and for disabled adapters)."""
    import contextlib

    import torch

    parent_dir = parent if with_parent else None
    expected = merged_reference(base, parent_dir)
    policy = policy_model(base, **LORA, parent_adapter_dir=parent_dir, where=CPU)
    policy.train()
    moved(policy, 0.3, seed=2)  # the policy has trained away from its parent
    params, optim, _ = optimizer(policy, lr=1e-2, warmup_steps=1)
    reference = reference_of(policy, parent_dir)
    flags = {n: p.requires_grad for n, p in policy.named_parameters()}
    frozen = {n: p.detach().clone() for n, p in policy.named_parameters() if f".{REFERENCE}." in n}
    assert bool(frozen) == with_parent

    with merged_lora(policy) if kernel else contextlib.nullcontext():
        before = logps(policy)
        with reference() as model:
            assert model is policy and not torch.is_grad_enabled()
            got = logps(policy)
        after = logps(policy)
        loss = -after.sum()
    assert not got.requires_grad and after.requires_grad
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert (before - got).abs().max() > 0.1  # the policy is not the reference: the test can tell them apart
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert {n: p.requires_grad for n, p in policy.named_parameters()} == flags
    assert policy.active_adapter == "default" and policy.training

    in_optimizer = {id(p) for group in optim.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for p in params}
    assert in_optimizer == {id(p) for n, p in policy.named_parameters() if ".default." in n}
    loss.backward()
    optim.step()
    for name, p in policy.named_parameters():
        if name in frozen:
            assert p.grad is None and not p.requires_grad, name
            torch.testing.assert_close(p.detach(), frozen[name], rtol=0, atol=0)


def test_the_reference_runs_without_dropout_and_puts_the_mode_back(base, parent):
    """Inside the reference the model is in eval mode (a parent with dropout would be random otherwise);
    a model that was in eval mode stays so."""
    policy = policy_model(base, **{**LORA, "dropout": 0.5}, parent_adapter_dir=None, where=CPU)
    reference = reference_of(policy, parent)
    for mode in (True, False):
        policy.train(mode)
        with reference():
            assert not policy.training
        assert policy.training == mode


def test_a_second_reference_or_a_pickled_parent_is_refused(base, parent, tmp_path):
    policy = policy_model(base, **LORA, parent_adapter_dir=None, where=CPU)
    reference_of(policy, parent)
    with pytest.raises(RatchetError, match="already has an adapter"):
        reference_of(policy, parent)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((parent / "adapter_config.json").read_text())
    with pytest.raises(RatchetError, match="no adapter_model.safetensors"):
        reference_of(policy_model(base, **LORA, parent_adapter_dir=None, where=CPU), pickled)
