"""The GRPO job at memory scale: an update cut into micro-batches by a token budget (the KL's reference pass
with it) takes the same step as all episodes at once, per-episode means kept; the KL's reference is the
parent's adapter in the same model, equal to the old merged copy of the parent pair; and only one copy of
the base's weights is ever run."""

from __future__ import annotations

import pytest

from pipeline.environment import sample_prompts, training_corpus
from pipeline.environment.tinymodel import build_tokenizer
from pipeline.modeling.placement import placement
from pipeline.scoring import EpisodeReward
from pipeline.specs.modelspec import GrpoSettings, LoraConfig
from pipeline.training.grpo import Episodes, policy_update, train_grpo
from pipeline.training.likelihood import encode_episode, policy_model, reference_of, sequence_logprobs
from pipeline.training.memory import micro_batches
from training.support import base_weight_copies

LORA = LoraConfig(rank=4, alpha=8)
SETTINGS = GrpoSettings(group_size=4, prompts_per_step=4, steps=3, lr=1e-2, kl_beta=0.1)
BUDGET = 100  # packed tokens: one to three episodes of this data per micro-batch


def _digits(trace) -> float:
    """A dense reward: the share of digits in the last reply (informative groups at every step)."""
    reply = trace["messages"][-1].get("content") or ""
    return sum(c.isdigit() for c in reply) / max(1, len(reply))


def _task() -> Episodes:
    return Episodes(items=sample_prompts("chat", 16, seed=1), view=lambda messages: messages, max_new_tokens=24,
                    reward=lambda trace: EpisodeReward(_digits(trace), None))  # fmt: skip


def _moved_policy(base_dir, parent):
    """The parent's adapter, trainable, with its weights moved away from the parent's."""
    import torch

    torch.manual_seed(0)
    model = policy_model(base_dir, rank=4, alpha=8, dropout=0.0, target_modules=LORA.target_modules,
                         parent_adapter_dir=parent, where=placement())  # fmt: skip
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    return model.train()


def _examples() -> list[tuple[list[int], list[int]]]:
    tok = build_tokenizer()
    return [encode_episode(tok, t["messages"], 96, fmt="compact") for t in training_corpus(12, seed=6)]


def test_a_micro_batched_update_is_the_whole_update(base_dir, parent):
    """Gradients and KL of one update with a small budget equal those of all episodes at once."""
    import torch

    examples = _examples()
    assert len(micro_batches([len(ids) for ids, _ in examples], BUDGET)) >= 4  # the budget really cuts
    advantages = torch.linspace(-1.5, 1.5, len(examples))
    model = _moved_policy(base_dir, parent)
    reference = reference_of(model, parent)
    params = [p for p in model.parameters() if p.requires_grad]
    shape = {"kl_beta": 0.1, "row_len": 96, "pad_id": 0, "device": "cpu", "reference": reference}
    results = []
    for budget in (None, BUDGET):
        kl = policy_update(model, examples, advantages, budget=budget, **shape)
        results.append((kl, [p.grad.clone() for p in params]))
        model.zero_grad(set_to_none=True)
    (kl_whole, whole), (kl_cut, cut) = results
    assert kl_whole > 1e-4 and kl_cut == pytest.approx(kl_whole, rel=1e-5)
    assert max(float(g.abs().max()) for g in whole) > 0
    for a, b in zip(whole, cut, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_the_kl_reference_is_the_merged_parent(base_dir, parent):
    """The KL the update reports is the k3 estimate toward the merged parent pair (the old reference)."""
    import torch

    from pipeline.modeling.decoding import load_model

    examples = _examples()
    model = _moved_policy(base_dir, parent)
    kl = policy_update(model, examples, torch.zeros(len(examples)), reference=reference_of(model, parent),
                       kl_beta=0.1, budget=BUDGET, row_len=96, pad_id=0, device="cpu")  # fmt: skip
    merged, _ = load_model(base_dir, parent)
    with torch.no_grad():
        _, ref_logp, _ = sequence_logprobs(merged, examples, row_len=96, pad_id=0, device="cpu")
        _, logp, _ = sequence_logprobs(model, examples, row_len=96, pad_id=0, device="cpu")
    gap = ref_logp - logp
    assert kl == pytest.approx(float((torch.exp(gap) - gap - 1).mean()), rel=1e-4)
    assert kl > 1e-4


def test_micro_batches_take_the_whole_jobs_steps(base_dir, parent, tmp_path):
    """The same rollouts (fixed seeds), rewards and adapter with a small budget as with none."""
    import torch
    from safetensors.torch import load_file

    common = {"base_model_dir": base_dir, "episodes": _task(), "settings": SETTINGS, "lora": LORA, "seed": 3,
              "parent_adapter_dir": parent}  # fmt: skip
    whole = train_grpo(output_dir=tmp_path / "whole", **common)
    cut = train_grpo(output_dir=tmp_path / "cut", micro_batch_tokens=BUDGET, **common)
    assert cut.loss_curve == whole.loss_curve and len(cut.loss_curve) == 3
    a = load_file(str(whole.adapter_dir / "adapter_model.safetensors"))
    b = load_file(str(cut.adapter_dir / "adapter_model.safetensors"))
    p = load_file(str(parent / "adapter_model.safetensors"))
    assert a.keys() == b.keys() == p.keys()
    assert max(float((a[k] - p[k]).abs().max()) for k in a) > 1e-4  # the job moved the parent
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6)
    assert [d.name for d in cut.adapter_dir.iterdir() if d.is_dir()] == []  # the reference is not saved


def test_one_copy_of_the_base_is_run(base_dir, parent, tmp_path):
    """Rollouts, the KL's reference pass and the update all run the same base weights."""
    with base_weight_copies() as seen:
        train_grpo(base_model_dir=base_dir, output_dir=tmp_path / "job", episodes=_task(), settings=SETTINGS,
                   lora=LORA, parent_adapter_dir=parent, micro_batch_tokens=BUDGET)  # fmt: skip
    assert len(seen) == 1, seen


KEY = "engine-admin-key"


@pytest.fixture(scope="module")
def engine_models(tmp_path_factory):
    """The serving tests' tiny random Llama (char tokenizer), a random adapter as the GRPO job's parent and
    another (an older adapter an engine might still serve)."""
    from serving.support import build_adapter, build_base

    root = tmp_path_factory.mktemp("engine")
    base = build_base(root / "base")
    return {"root": root, "base": base, "parent": build_adapter(base, root / "parent", seed=1),
            "old": build_adapter(base, root / "old", seed=2)}  # fmt: skip


@pytest.fixture
def engine(engine_models, tmp_path, monkeypatch):
    """``ratchet serve --expose-adapters``' app (vLLM's protocol) over the bare base, loading adapters from the
    models' and the test's directories, as the loop's ``openai`` rollout engine."""
    from serving.support import ServerThread

    from pipeline.serving.adapter_app import create_adapter_app
    from pipeline.serving.engines import EmbeddedEngine
    from pipeline.serving.runtime import load_runtime
    from pipeline.serving.scheduler import MicroBatchScheduler
    from pipeline.settings import get_settings

    runtime = load_runtime(engine_models["base"], [], specialists=["base"], device="cpu")
    app = create_adapter_app(EmbeddedEngine(runtime, MicroBatchScheduler()), api_key=KEY,
                             model_names={"base": "base"}, adapter_roots=[engine_models["root"], tmp_path])  # fmt: skip
    with ServerThread(app) as server:
        monkeypatch.setenv("RATCHET_ROLLOUT_ENGINE", "openai")
        monkeypatch.setenv("RATCHET_ROLLOUT_ENGINE_URL", server.url)
        monkeypatch.setenv("RATCHET_ROLLOUT_ENGINE_API_KEY", KEY)
        get_settings.cache_clear()
        try:
            yield server
        finally:
            get_settings.cache_clear()


def _lengthy() -> Episodes:
    """Paid for the reply's length: sampled replies differ in length, so every group has a signal."""
    return Episodes(items=sample_prompts("chat", 8, seed=1), view=lambda messages: messages, max_new_tokens=16,
                    reward=lambda t: EpisodeReward(len(t["messages"][-1].get("content") or "") / 16, None))  # fmt: skip


ENGINE_SETTINGS = GrpoSettings(group_size=4, prompts_per_step=2, steps=2, lr=5e-2, kl_beta=0.1)


def test_grpo_rolls_out_on_the_openai_engine(engine_models, engine, tmp_path, caplog):
    """Each step's policy is saved, loaded on the engine by its versioned name, probed against the trainer's
    forward, sampled there, then unloaded: two steps, two adapters, none left loaded or on disk."""
    import logging

    import httpx

    with caplog.at_level(logging.INFO, logger="pipeline.modeling.samplers"):
        result = train_grpo(base_model_dir=engine_models["base"], output_dir=tmp_path / "job", episodes=_lengthy(),
                            settings=ENGINE_SETTINGS, lora=LORA, parent_adapter_dir=engine_models["parent"])  # fmt: skip
    assert result.completed and len(result.loss_curve) == 2
    probed = [r.args[0] for r in caplog.records if r.getMessage().startswith("parity probe passed")]
    assert len(probed) == 2 and len(set(probed)) == 2, probed  # the updated policy is a new adapter
    assert all(name.startswith("job-grpo-") for name in probed)
    listed = httpx.get(engine.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"]
    assert {m["id"] for m in listed} == {"base"}  # every step's adapter unloaded
    assert not (tmp_path / "job" / "rollout-adapter").exists()


def test_an_engine_serving_other_weights_under_the_policys_name_is_refused(engine_models, engine, tmp_path):
    """The engine already has the step's versioned name, mapped to an older adapter (the silent stale-weights
    failure): the load is taken as done, the parity probe sees other weights and the job stops in one line."""
    import httpx
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from pipeline.modeling.samplers import EngineRefused, versioned_name

    policy = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(engine_models["base"]),
                                       engine_models["parent"], is_trainable=True)  # fmt: skip
    policy.save_pretrained(tmp_path / "first", selected_adapters=["default"], safe_serialization=True)
    name = versioned_name(
        tmp_path / "first", "job-grpo"
    )  # the job's first step's policy, as the engine names it
    loaded = httpx.post(engine.url + "/v1/load_lora_adapter", headers={"Authorization": f"Bearer {KEY}"},
                        json={"lora_name": name, "lora_path": str(engine_models["old"])})  # fmt: skip
    assert loaded.status_code == 200, loaded.text
    with pytest.raises(EngineRefused) as refused:
        train_grpo(base_model_dir=engine_models["base"], output_dir=tmp_path / "job", episodes=_lengthy(),
                   settings=ENGINE_SETTINGS, lora=LORA, parent_adapter_dir=engine_models["parent"])  # fmt: skip
    message = str(refused.value)
    assert "\n" not in message and repr(name) in message and "stale" in message
    assert not (tmp_path / "job" / "rollout-adapter").exists()


def test_an_engine_that_recognises_the_fixed_probe_is_caught_on_the_steps_prompts(
    engine_models, engine, tmp_path, monkeypatch
):
    """An engine that answers the fixed probe prompts with the policy's weights and every other prompt with
    an older adapter's passes the fixed probe; the step's own prompts, spot-checked, refuse it in one line."""
    from modeling.test_samplers import RecognisingProxy
    from transformers import AutoTokenizer

    from pipeline.modeling.samplers import EngineRefused, OpenAISampler, probe_prompts
    from pipeline.settings import get_settings

    tok = AutoTokenizer.from_pretrained(engine_models["base"])
    old = OpenAISampler(engine.url, api_key=KEY, tokenizer=tok).load(engine_models["old"], name="old")
    with RecognisingProxy(engine.url, stale=old, probe=probe_prompts(tok)) as proxy:
        monkeypatch.setenv("RATCHET_ROLLOUT_ENGINE_URL", proxy.url)
        get_settings.cache_clear()
        with pytest.raises(EngineRefused) as refused:
            train_grpo(base_model_dir=engine_models["base"], output_dir=tmp_path / "job", episodes=_lengthy(),
                       settings=ENGINE_SETTINGS, lora=LORA, parent_adapter_dir=engine_models["parent"])  # fmt: skip
    assert "\n" not in str(refused.value) and "differ from the trainer's" in str(refused.value)
