"""The DPO job at memory scale: a step cut into micro-batches by a token budget takes the same update as the
whole batch at once; the reference is the parent's adapter inside the same model (``likelihood.reference_of``),
which gives the loss curve the old merged copy of the parent pair gave; and only one copy of the base's
weights is ever run."""

from __future__ import annotations

import math

import pytest

from pipeline.environment import training_corpus
from pipeline.environment.tinymodel import build_tokenizer
from pipeline.loop.curation import save_dataset
from pipeline.modeling.placement import placement
from pipeline.specs.modelspec import DpoSettings, LoraConfig
from pipeline.training import batch_indices
from pipeline.training.dpo import encode_pairs, pair_lengths, pair_logprobs, reference_logprobs, train_dpo
from pipeline.training.likelihood import optimizer, policy_model, reference_of
from pipeline.training.memory import micro_batches
from training.support import base_weight_copies

LORA = LoraConfig(rank=4, alpha=8)
SETTINGS = DpoSettings(beta=0.5, lr=5e-3, batch_size=8, max_steps=4, sft_weight=0.5)
BUDGET = 120  # packed tokens: two or three pairs of this data per micro-batch


def _rows(n: int) -> list[dict]:
    """Preferred: the reference answer; other: the same answer with every digit moved by one."""
    rows = []
    for i, trace in enumerate(training_corpus(n, seed=4)):
        *context, answer = trace["messages"]
        text = answer.get("content") or trace["metadata"]["expected"]
        wrong = text.translate(str.maketrans("0123456789", "1234567890"))
        rows.append({"messages": [*context, {"role": "assistant", "content": text}],
                     "rejected": [*context, {"role": "assistant", "content": wrong}],
                     "score": 1.0, "rejected_score": 0.0, "experience_id": i, "rejected_experience_id": 1000 + i})  # fmt: skip
    return rows


@pytest.fixture(scope="module")
def pairs_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("pairs") / "ds"
    save_dataset(_rows(32), path)
    return path


def _adapter(result):
    from safetensors.torch import load_file

    return load_file(str(result.adapter_dir / "adapter_model.safetensors"))


def test_the_budget_cuts_each_batch(pairs_dir):
    """The budget used below really splits every step's batch into several micro-batches."""
    from datasets import load_from_disk

    pairs, _, _ = encode_pairs(build_tokenizer(), load_from_disk(str(pairs_dir)).to_list(), 96, fmt="compact",
                               where="test")  # fmt: skip
    for step in range(SETTINGS.max_steps):
        batch = batch_indices(len(pairs), SETTINGS.batch_size, step, 0)
        assert len(micro_batches(pair_lengths(pairs, batch), BUDGET)) >= 3


def test_micro_batches_take_the_whole_batchs_update(base_dir, pairs_dir, parent, tmp_path):
    """Same loss curve and adapter (float32) with a small token budget as with the whole batch at once."""
    import torch

    common = {"base_model_dir": base_dir, "dataset_dir": pairs_dir, "settings": SETTINGS, "lora": LORA,
              "parent_adapter_dir": parent}  # fmt: skip
    whole = train_dpo(output_dir=tmp_path / "whole", **common)
    cut = train_dpo(output_dir=tmp_path / "cut", micro_batch_tokens=BUDGET, **common)
    assert cut.completed and [s for s, _ in cut.loss_curve] == [1, 2, 3, 4]
    for (_, a), (_, b) in zip(whole.loss_curve, cut.loss_curve, strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5)
    a, b = _adapter(whole), _adapter(cut)
    assert a.keys() == b.keys()
    moved = max(float((a[k] - torch.zeros_like(a[k])).abs().max()) for k in a if "lora_B" in k)
    assert moved > 0
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)


def _old_reference_curve(base_dir, pairs_dir, parent) -> list[float]:
    """The job's loss curve as it was computed with the old reference: a second copy of the base with the
    parent's adapter merged into it (``decoding.load_model``), the policy trained as the job trains it."""
    import torch
    import torch.nn.functional as F
    from datasets import load_from_disk

    from pipeline.modeling.decoding import load_model
    from pipeline.training.kernels import merged_lora

    torch.manual_seed(0)
    where = placement()
    pairs, _, _ = encode_pairs(build_tokenizer(), load_from_disk(str(pairs_dir)).to_list(), 96, fmt="compact",
                               where="test")  # fmt: skip
    shape = {"row_len": 96, "pad_id": 0, "device": where.device}
    merged, _ = load_model(base_dir, parent)
    with torch.no_grad():
        ref_chosen, ref_rejected = pair_logprobs(merged, pairs, list(range(len(pairs))), **shape)
    del merged
    model = policy_model(base_dir, rank=4, alpha=8, dropout=0.0, target_modules=LORA.target_modules,
                         parent_adapter_dir=parent, where=where)  # fmt: skip
    model.train()
    params, optim, sched = optimizer(model, lr=SETTINGS.lr, warmup_steps=SETTINGS.warmup_steps)
    tokens = torch.tensor([sum(label != -100 for label in c[1]) for c, _ in pairs], dtype=torch.float32)
    curve = []
    with merged_lora(model):
        for step in range(SETTINGS.max_steps):
            batch = batch_indices(len(pairs), SETTINGS.batch_size, step, 0)
            index = torch.tensor(batch)
            chosen, rejected = pair_logprobs(model, pairs, batch, **shape)
            margin = SETTINGS.beta * ((chosen - ref_chosen[index]) - (rejected - ref_rejected[index]))
            loss = -F.logsigmoid(margin).mean() + SETTINGS.sft_weight * (-chosen / tokens[index]).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            curve.append(float(loss.detach()))
    return curve


def test_the_reference_in_the_same_model_gives_the_merged_copys_loss_curve(
    base_dir, pairs_dir, parent, tmp_path
):
    result = train_dpo(base_model_dir=base_dir, dataset_dir=pairs_dir, output_dir=tmp_path / "job",
                       settings=SETTINGS, lora=LORA, parent_adapter_dir=parent)  # fmt: skip
    old = _old_reference_curve(base_dir, pairs_dir, parent)
    assert [v for _, v in result.loss_curve] == pytest.approx(old, abs=2e-5)
    assert not math.isclose(old[0], old[-1], abs_tol=1e-3)  # the policy moved away from its reference
    assert sorted(p.name for p in result.adapter_dir.iterdir() if p.is_dir()) == []  # no reference saved


def test_reference_logprobs_are_the_parents_whatever_the_policy(base_dir, pairs_dir, parent):
    """With the policy's adapter moved away from the parent, the reference pass (in micro-batches) still
    scores every pair as the merged parent pair does, and leaves the policy as it was."""
    import torch
    from datasets import load_from_disk

    from pipeline.modeling.decoding import load_model

    where = placement()
    pairs, _, _ = encode_pairs(build_tokenizer(), load_from_disk(str(pairs_dir)).to_list(), 96, fmt="compact",
                               where="test")  # fmt: skip
    shape = {"row_len": 96, "pad_id": 0, "device": where.device}
    model = policy_model(base_dir, rank=4, alpha=8, dropout=0.0, target_modules=LORA.target_modules,
                         parent_adapter_dir=parent, where=where)  # fmt: skip
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    everything = list(range(len(pairs)))
    with torch.no_grad():
        before = pair_logprobs(model, pairs, everything, **shape)
    chosen, rejected = reference_logprobs(model, reference_of(model, parent), pairs, budget=BUDGET, **shape)
    merged, _ = load_model(base_dir, parent)
    with torch.no_grad():
        want_chosen, want_rejected = pair_logprobs(merged, pairs, everything, **shape)
        after = pair_logprobs(model, pairs, everything, **shape)
    torch.testing.assert_close(chosen, want_chosen, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(rejected, want_rejected, rtol=1e-5, atol=1e-4)
    assert float((before[0] - want_chosen).abs().max()) > 1e-2  # the policy is not the reference
    torch.testing.assert_close(after[0], before[0])
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable


def test_one_copy_of_the_base_is_run(base_dir, pairs_dir, parent, tmp_path):
    """Every forward of the job (reference pass and training) runs the same base weights."""
    with base_weight_copies() as seen:
        train_dpo(base_model_dir=base_dir, dataset_dir=pairs_dir, output_dir=tmp_path / "job", settings=SETTINGS,
                  lora=LORA, parent_adapter_dir=parent, micro_batch_tokens=BUDGET)  # fmt: skip
    assert len(seen) == 1, seen


def test_two_processes_take_the_same_steps_as_one(base_dir, pairs_dir, parent, tmp_path):
    """Under ``torchrun`` (gloo, 2 processes, ``distributed.launch``) each process runs its share of the
    reference pass and of every step's micro-batches; the gradients summed over them give the loss curve and
    adapter of one process (float32 rounding: the partial sums are added in another order)."""
    import torch

    from pipeline.training.torchrun import launch

    common = {"base_model_dir": base_dir, "dataset_dir": pairs_dir, "settings": SETTINGS, "lora": LORA,
              "parent_adapter_dir": parent, "micro_batch_tokens": BUDGET}  # fmt: skip
    one = train_dpo(output_dir=tmp_path / "one", **common)
    two = launch(method="dpo", processes=2, output_dir=tmp_path / "two", **common)
    assert two.completed and [s for s, _ in two.loss_curve] == [s for s, _ in one.loss_curve]
    for (_, a), (_, b) in zip(one.loss_curve, two.loss_curve, strict=True):
        assert b == pytest.approx(a, rel=1e-4, abs=1e-5)
    a, b = _adapter(one), _adapter(two)
    assert two.adapter_sha256 and a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-6)
