"""What a training step holds in memory: micro-batches and activation checkpointing change memory, never
the update.

``memory.micro_batches`` cuts a step's batch by a token budget; the SFT job runs the micro-batches with
their losses scaled by their share of the batch's labelled tokens and accumulates the gradients, so a small
``micro_batch_tokens`` trains the same adapter, with the same losses, as the whole batch at once (float32,
up to summation order). Activation checkpointing recomputes each block in the backward pass (its forward
runs twice) and gives the same gradients. ``token_budget`` and ``checkpointing_wanted`` resolve the spec's
settings (``None`` / ``auto``) as their docstrings state.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
from realmodel import build_real_model

from pipeline.modeling.placement import Placement
from pipeline.training.memory import (
    CHECKPOINTING_PARAMETERS,
    checkpointing_wanted,
    micro_batches,
    token_budget,
    token_bytes,
)

CPU = Placement(device="cpu", dtype="float32")
WORDS = "the quick brown fox jumps over the lazy dog while a timer counts down to zero".split()


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return build_real_model(tmp_path_factory.mktemp("qwen") / "model", sharpness=1.0)


def conversations(n: int) -> list[dict]:
    """``n`` chats of different lengths (so micro-batches hold different numbers of examples)."""
    out = []
    for i in range(n):
        ask = " ".join(WORDS[j % len(WORDS)] for j in range(i, i + 3 + 2 * i))
        reply = " ".join(WORDS[(j * 7) % len(WORDS)] for j in range(2 + (i * 5) % 11))
        out.append({"messages": [{"role": "user", "content": ask}, {"role": "assistant", "content": reply}]})
    return out


# ---- micro_batches -----------------------------------------------------------------------------------


def test_micro_batches_cut_in_order_within_the_budget():
    assert micro_batches([3, 4, 2, 5, 1], 7) == [[0, 1], [2, 3], [4]]
    assert micro_batches([3, 4, 2, 5, 1], 9) == [[0, 1, 2], [3, 4]]
    assert micro_batches([7, 7], 7) == [[0], [1]]  # exactly the budget fits
    assert micro_batches([1] * 5, 2) == [[0, 1], [2, 3], [4]]


def test_an_example_longer_than_the_budget_is_a_micro_batch_of_its_own():
    assert micro_batches([2, 50, 3, 3], 6) == [[0], [1], [2, 3]]
    assert micro_batches([50], 6) == [[0]]
    assert micro_batches([50, 60], 1) == [[0], [1]]


def test_no_budget_is_one_micro_batch_and_no_examples_none():
    assert micro_batches([5, 9, 2], None) == [[0, 1, 2]]
    assert micro_batches([], None) == []
    assert micro_batches([], 4) == []


@pytest.mark.parametrize("budget", [0, -3])
def test_a_budget_below_one_token_is_refused(budget):
    with pytest.raises(ValueError, match="positive"):
        micro_batches([1, 2], budget)
    with pytest.raises(ValueError, match="positive"):
        token_budget(budget, where=CPU, model=None, max_seq_len=8)


def test_every_example_is_in_exactly_one_micro_batch():
    lengths = [(i * 37) % 23 + 1 for i in range(64)]
    for budget in (1, 10, 23, 24, 100, 10**6):
        groups = micro_batches(lengths, budget)
        assert [i for g in groups for i in g] == list(range(64))
        assert all(len(g) == 1 or sum(lengths[i] for i in g) <= budget for g in groups)


# ---- token_budget / checkpointing_wanted ---------------------------------------------------------------


def llama_8b_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256)  # fmt: skip


def llama_8b() -> Any:
    """An 8B Llama-3-shaped model without weights (the meta device): its config and parameter shapes."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(llama_8b_config())


def test_the_budget_is_the_spec_value_and_no_split_on_the_cpu():
    assert token_budget(4096, where=CPU, model=None, max_seq_len=2048) == 4096
    assert token_budget(None, where=CPU, model=None, max_seq_len=2048) is None


def test_per_token_memory_of_an_8b_model_by_the_stated_formula():
    """``token_bytes`` on Llama-3-8B's shape, bf16: 32 blocks of ``2 (10 h + 4 i + 2 kv)`` bytes, plus the
    head's ``14 V``; with checkpointing one block's inputs per layer and one block recomputed."""
    model = types.SimpleNamespace(config=llama_8b_config())  # the formula reads the config only
    bf16 = Placement(device="cuda", dtype="bfloat16")
    block = 2 * (10 * 4096 + 4 * 14336 + 2 * 1024)
    head = 14 * 128256
    assert token_bytes(model, bf16, max_seq_len=2048, checkpointing=False) == 32 * block + head
    assert token_bytes(model, bf16, max_seq_len=2048, checkpointing=True) == 32 * 2 * 4096 + block + head
    model.config._attn_implementation = "eager"  # scores materialised: quadratic in the row
    assert (
        token_bytes(model, bf16, max_seq_len=2048, checkpointing=False)
        == 32 * (block + 2 * 2 * 32 * 2048) + head
    )


def test_a_gpu_budget_is_the_free_memory_over_the_per_token_bytes(monkeypatch, caplog):
    """On a GPU (its free memory given: this machine has none) the budget is ``(0.8 free - 12 trainable) /
    token_bytes``: an 8B model in bf16 with 120 GiB free fits about 12.5k tokens a micro-batch without
    checkpointing and 3.6x as many with it; a budget below one sequence warns and still runs."""
    from pipeline.training import memory

    model = llama_8b()
    for p in model.parameters():
        p.requires_grad_(False)
    bf16 = Placement(device="cuda", dtype="bfloat16")
    monkeypatch.setattr(memory, "_free_bytes", lambda device: 120 * 2**30)
    off = token_budget(None, where=bf16, model=model, max_seq_len=2048)
    assert off == int(0.8 * 120 * 2**30 // token_bytes(model, bf16, max_seq_len=2048, checkpointing=False))
    assert 12_000 < off < 13_000
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    on = token_budget(None, where=bf16, model=model, max_seq_len=2048)
    assert 3.5 < on / off < 3.7
    assert checkpointing_wanted("auto", model, bf16, max_seq_len=2048)  # 8B: on whatever the memory

    monkeypatch.setattr(memory, "_free_bytes", lambda device: 2 * 2**30)
    with caplog.at_level("WARNING", logger="pipeline.training.memory"):
        assert token_budget(None, where=bf16, model=model, max_seq_len=2048) < 2048
    assert "may not fit" in caplog.text


def test_checkpointing_auto_is_on_from_one_billion_parameters():
    big = llama_8b()
    assert sum(p.numel() for p in big.parameters()) >= CHECKPOINTING_PARAMETERS
    assert checkpointing_wanted("auto", big, CPU)
    small = llama_8b().__class__(big.config.__class__(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                       num_attention_heads=4, vocab_size=400))  # fmt: skip
    assert not checkpointing_wanted("auto", small, CPU)
    assert checkpointing_wanted("on", small, CPU) and not checkpointing_wanted("off", big, CPU)
    with pytest.raises(ValueError, match="auto, on or off"):
        checkpointing_wanted("sometimes", small, CPU)


# ---- the SFT job -----------------------------------------------------------------------------------------


def train(base: Path, tmp: Path, name: str, **config) -> tuple[list[float], dict]:
    """A 3-step SFT job (float32, 8 examples a step); its per-step losses and trained adapter."""
    from safetensors.torch import load_file

    from pipeline.training import TrainConfig, train_lora, write_dataset

    data = tmp / "data"
    if not data.exists():
        write_dataset(conversations(12), data)
    losses: list[float] = []
    result = train_lora(
        base_model_dir=base,
        dataset_dir=data,
        output_dir=tmp / name,
        config=TrainConfig(rank=4, alpha=8, lr=1e-2, batch_size=8, max_steps=3, warmup_steps=1, **config),
        where=CPU,
        progress=lambda _step, _total, loss: losses.append(loss),
    )
    return losses, load_file(str(result.adapter_dir / "adapter_model.safetensors"))


def test_micro_batches_train_the_same_adapter_as_the_whole_batch(base, tmp_path):
    """A budget of 40 tokens cuts each 8-example step into several micro-batches (the examples are 15-50
    tokens); the losses and the adapter match the unsplit job's."""
    import torch

    from pipeline.training import batch_indices
    from pipeline.training.job import encode_rows

    whole, adapter = train(base, tmp_path, "whole")
    split, split_adapter = train(base, tmp_path, "split", micro_batch_tokens=40)

    from transformers import AutoTokenizer

    examples, _ = encode_rows(
        AutoTokenizer.from_pretrained(base), conversations(12), 512, fmt="compact", where=""
    )
    cuts = [
        len(micro_batches([len(examples[i][0]) for i in batch_indices(12, 8, s, 0)], 40)) for s in range(3)
    ]
    assert min(cuts) >= 3, cuts  # the budget really splits every step
    assert split == pytest.approx(whole, rel=1e-5)
    assert adapter.keys() == split_adapter.keys()
    for key, value in adapter.items():
        torch.testing.assert_close(split_adapter[key], value, rtol=1e-5, atol=1e-7, msg=key)


def test_activation_checkpointing_recomputes_blocks_with_the_same_gradients(base):
    """With checkpointing on, each decoder block's forward runs again in the backward pass (twice per step);
    the loss and every LoRA gradient equal those without it."""
    import torch

    from pipeline.modeling.packing import packed_tensors
    from pipeline.training.kernels import assistant_loss, merged_lora
    from pipeline.training.likelihood import policy_model

    examples = [([3, 5, 7, 9, 11, 13], [-100, -100, 7, 9, 11, 13]), ([4, 6, 8, 10], [-100, 6, 8, 10])]
    tensors = packed_tensors(examples, 64, 0)
    runs = {}
    for setting in ("off", "on"):
        torch.manual_seed(0)
        model = policy_model(base, rank=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"],
                             parent_adapter_dir=None, where=CPU, activation_checkpointing=setting)  # fmt: skip
        model.train()
        with torch.no_grad():  # B = 0 would leave A without a gradient
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
        calls = []
        block = model.get_base_model().model.layers[0]  # a module inside it: recomputing calls it again
        block.mlp.register_forward_pre_hook(lambda *_, seen=calls: seen.append(1))
        with merged_lora(model):
            loss = assistant_loss(model, tensors)
            loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        runs[setting] = (float(loss.detach()), grads, len(calls))
    (loss_off, grads_off, calls_off), (loss_on, grads_on, calls_on) = runs["off"], runs["on"]
    assert (calls_off, calls_on) == (1, 2)
    assert loss_on == pytest.approx(loss_off, rel=1e-6)
    assert grads_on.keys() == grads_off.keys() and grads_off
    for name, grad in grads_off.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grads_on[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_activation_checkpointing_trains_the_same_adapter(base, tmp_path):
    import torch

    off, adapter = train(base, tmp_path, "off", activation_checkpointing="off")
    on, on_adapter = train(base, tmp_path, "on", activation_checkpointing="on", micro_batch_tokens=60)
    assert on == pytest.approx(off, rel=1e-5)
    for key, value in adapter.items():
        torch.testing.assert_close(on_adapter[key], value, rtol=1e-5, atol=1e-7, msg=key)


def test_how_a_step_runs_is_not_part_of_the_jobs_key():
    """A job interrupted under one budget resumes under another (the key is what it computes)."""
    from pipeline.training.job import TrainConfig

    plain = TrainConfig()
    assert plain.key() == TrainConfig(micro_batch_tokens=64, activation_checkpointing="on", processes=2).key()
    assert plain.key() != TrainConfig(lr=1e-3).key()
