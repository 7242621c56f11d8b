"""The fast LoRA kernel under mixed precision and adapter switching, and the chunked label-only loss.

- ``merged_lora`` patches the LoRA linears of a bf16 base with float32 (master) adapters, peft's default
  (``autocast_adapter_dtype``); its output carries a small update as exactly as peft's does (not rounded
  into a merged bf16 weight), its gradients land on the float32 weights, and a few AdamW steps follow the
  float32 reference as closely as peft's own bf16 forward does.
- A patched forward runs peft's own forward when the model is switched to another adapter or adapters are
  disabled (the reference of DPO/GRPO lives in the same model).
- ``assistant_loss``/``label_logprobs`` equal the unchunked loss, and never hold a ``[positions, vocab]``
  float32 tensor: at most ``chunk`` positions' logits at once, forward and backward.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from realmodel import build_real_model  # noqa: E402

from pipeline.modeling.packing import IGNORE, packed_tensors  # noqa: E402
from pipeline.training import ALL_LINEAR, kernels  # noqa: E402
from pipeline.training.kernels import assistant_loss, label_logprobs, merged_lora  # noqa: E402

LAYERS = 2  # build_real_model's layer count: 7 LoRA linears each


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return build_real_model(tmp_path_factory.mktemp("qwen") / "model", sharpness=1.0)


def _lora(base_dir, dtype, *, seed=0, std=0.05):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype),
        LoraConfig(r=4, lora_alpha=8, target_modules=list(ALL_LINEAR), task_type="CAUSAL_LM"),
    )
    for name, param in model.named_parameters():  # B starts at zero; make the adapter non-trivial
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=std)
    return model


def _batch(vocab, n=10, seed=0):
    import random

    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        length = rng.randint(8, 40)
        ids = [rng.randrange(4, vocab) for _ in range(length)]
        cut = rng.randint(2, length - 2)
        examples.append((ids, [IGNORE] * cut + ids[cut:]))
    return packed_tensors(examples, 64, 0)


def test_bf16_base_with_float32_adapters_is_patched_and_matches_peft(qwen):
    """peft keeps the adapters float32 over a bf16 base; the kernel takes every LoRA linear (0 before),
    its loss and gradients match peft's bf16 forward, and the gradients are float32 on the master weights."""
    import torch

    model = _lora(qwen, torch.bfloat16)
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all(p.dtype == torch.float32 for p in lora.values())  # peft's autocast_adapter_dtype
    batch = _batch(model.config.vocab_size)

    def loss_and_grads(fast):
        model.zero_grad()
        if fast:
            with merged_lora(model) as patched:
                assert patched == LAYERS * len(ALL_LINEAR)
                loss = assistant_loss(model, batch)
                loss.backward()
        else:
            loss = assistant_loss(model, batch)
            loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in lora.items()}

    reference, reference_grads = loss_and_grads(False)
    fast, fast_grads = loss_and_grads(True)
    assert fast == pytest.approx(reference, rel=2e-3)  # bf16 activations: ~3 significant digits
    for name, grad in reference_grads.items():
        assert fast_grads[name].dtype == torch.float32
        cos = torch.nn.functional.cosine_similarity(fast_grads[name].flatten(), grad.flatten(), dim=0)
        assert cos > 0.99, name
    assert all(type(m).forward is m.forward.__func__ for m in model.modules() if hasattr(m, "lora_A"))


def test_small_update_is_carried_as_precisely_as_peft(qwen):
    """An update 1e-4 the size of the base weight (a LoRA's early steps): what the kernel's bf16 output adds
    to the bf16 base output is as close to the exact update as what peft's adds (a merged bf16 weight
    buries it under the weight's rounding: ~3x further, measured on a 512x512 layer)."""
    import torch
    import torch.nn.functional as F

    model = _lora(qwen, torch.bfloat16)
    layer = model.base_model.model.model.layers[0].mlp.up_proj
    weight = layer.base_layer.weight
    with torch.no_grad():  # scale * B A a 1e-4 fraction of |W|
        delta = layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
        layer.lora_B["default"].weight.mul_(1e-4 * weight.float().abs().mean() / delta.abs().mean())
    torch.manual_seed(1)
    x = torch.randn(1024, weight.shape[1]).to(torch.bfloat16)
    with torch.no_grad():
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        update = layer.scaling["default"] * (x.float() @ a.t()) @ b.t()
        base = F.linear(x, weight).float()
        peft = layer(x)
        with merged_lora(model) as patched:
            assert patched
            fast = layer(x)
    assert fast.dtype == torch.bfloat16

    def error(y):
        return float((y.float() - base - update).norm() / update.norm())

    assert error(fast) <= 1.05 * error(peft)


def test_bf16_steps_with_the_kernel_follow_the_float32_reference(qwen):
    """Five AdamW steps on the same batches: the bf16 run with the kernel stays as close to the float32
    run (peft's forward) as peft's own bf16 run does (loss per step within 1e-2 relative of float32, and no
    further than 1.5x peft-bf16's deviation + 2e-3)."""
    import torch

    batches = [_batch(400, seed=s) for s in range(5)]

    def run(dtype, fast):
        model = _lora(qwen, dtype)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        optim = torch.optim.AdamW(params, lr=1e-3)
        losses = []
        with merged_lora(model) if fast else contextlib.nullcontext() as patched:
            assert not fast or patched == LAYERS * len(ALL_LINEAR)
            for batch in batches:
                loss = assistant_loss(model, batch)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optim.step()
                optim.zero_grad(set_to_none=True)
                losses.append(loss.item())
        assert all(p.dtype == torch.float32 for p in params)
        return losses

    exact = run(torch.float32, False)
    peft = run(torch.bfloat16, False)
    fast = run(torch.bfloat16, True)
    for e, p, f in zip(exact, peft, fast, strict=True):
        assert abs(f - e) <= 1e-2 * e
        assert abs(f - e) <= 1.5 * abs(p - e) + 2e-3
    assert exact[-1] < exact[0]  # the steps train


def test_patched_forward_runs_peft_for_another_adapter_or_none(qwen):
    """A frozen second adapter in the same model (a reference) and disabled adapters (the bare base) give
    peft's own outputs while the kernel is on; switching back gives the kernel's again."""
    import torch

    model = _lora(qwen, torch.float32)
    model.add_adapter("reference", model.peft_config["default"])
    for name, param in model.named_parameters():
        if "lora_B.reference" in name:
            torch.nn.init.normal_(param, std=0.05, generator=torch.Generator().manual_seed(7))
    model.eval()
    ids = _batch(model.config.vocab_size)["input_ids"]

    def logits():
        with torch.no_grad():
            return model(input_ids=ids).logits

    policy = logits()
    model.set_adapter("reference")
    reference = logits()
    with model.disable_adapter():
        bare = logits()
    model.set_adapter("default")
    assert not torch.allclose(policy, reference, atol=1e-3) and not torch.allclose(policy, bare, atol=1e-3)
    with merged_lora(model) as patched:
        assert patched == LAYERS * len(ALL_LINEAR)
        torch.testing.assert_close(logits(), policy, atol=1e-5, rtol=1e-5)
        model.set_adapter("reference")
        torch.testing.assert_close(logits(), reference, atol=1e-5, rtol=1e-5)
        model.set_adapter("default")
        with model.disable_adapter():
            torch.testing.assert_close(logits(), bare, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits(), policy, atol=1e-5, rtol=1e-5)


def test_chunked_loss_equals_the_whole_one(qwen):
    """Any chunk size gives the unchunked loss, log-probabilities and LoRA gradients (float32)."""
    import torch

    model = _lora(qwen, torch.float32)
    batch = _batch(model.config.vocab_size, n=12)
    labelled = int((batch["labels"][:, 1:] != IGNORE).sum())

    def run(chunk):
        model.zero_grad()
        loss = assistant_loss(model, batch, chunk=chunk)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        with torch.no_grad():
            logp, where = label_logprobs(model, batch, chunk=chunk)
        return loss.item(), grads, logp, where

    whole = run(labelled)
    hf = model(**{k: batch[k] for k in ("input_ids", "labels", "position_ids")}, use_cache=False).loss
    assert whole[0] == pytest.approx(hf.item(), rel=1e-5)
    for chunk in (1, 7, 100):
        loss, grads, logp, where = run(chunk)
        assert loss == pytest.approx(whole[0], rel=1e-6)
        for name, grad in whole[1].items():
            torch.testing.assert_close(grads[name], grad, atol=1e-7, rtol=1e-5)
        torch.testing.assert_close(logp, whole[2], atol=1e-6, rtol=1e-6)
        assert torch.equal(where, whole[3])


def test_chunked_loss_never_holds_all_positions_logits(qwen, monkeypatch):
    """Every float32 tensor of vocabulary width that the loss's forward and backward create holds at most
    a chunk's positions (recorded op by op; views of the weights aside): never the ``[positions, vocab]``
    logits. The default chunk is what ``LOGITS_BUDGET`` holds."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    model = _lora(qwen, torch.float32)
    vocab = model.config.vocab_size
    batch = _batch(vocab, n=12)
    labelled = int((batch["labels"][:, 1:] != IGNORE).sum())
    chunk = 16
    assert labelled > 4 * chunk
    monkeypatch.setattr(kernels, "LOGITS_BUDGET", chunk * 4 * vocab)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    class Widest(TorchDispatchMode):
        rows = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() in weights:
                    continue
                if t.dtype == torch.float32 and t.dim() and t.shape[-1] == vocab:
                    Widest.rows = max(Widest.rows, t.numel() // vocab)
            return out

    with Widest():
        loss = assistant_loss(model, batch)
        loss.backward()
    assert 0 < Widest.rows <= chunk
    with Widest(), torch.no_grad():
        label_logprobs(model, batch)
    assert Widest.rows <= chunk
