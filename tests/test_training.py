"""The LoRA job: assistant-only labels, packing without cross-attention, resume, lineage, tracking,
parent continuation, and expert iteration improving held-out accuracy on the tiny model."""

from __future__ import annotations

import json

import pytest

from pipeline.environment import FAMILIES, collect, evaluate, heldout_suite, sample_prompts, training_corpus
from pipeline.environment.tinymodel import TinyModelConfig, build_tokenizer, ensure_tiny_model
from pipeline.errors import RatchetError
from pipeline.modeling.decoding import load_model
from pipeline.modeling.packing import IGNORE, encode_chat, packed_tensors
from pipeline.training import TrainConfig, train_lora, write_dataset

SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                        max_position_embeddings=96, bootstrap_steps=40, bootstrap_batch_size=32,
                        corpus_size=400, seed=2)  # fmt: skip
FAST = TrainConfig(rank=4, alpha=8, max_steps=6, batch_size=16, checkpoint_every=2, lr=1e-3, warmup_steps=1)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return ensure_tiny_model(config=SMALL, cache_dir=tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "ds"
    write_dataset(training_corpus(120, seed=4), path)
    return path


def _adapter_tensors(adapter_dir):
    from safetensors.torch import load_file

    return load_file(str(adapter_dir / "adapter_model.safetensors"))


def test_labels_cover_assistant_turns_only():
    tok = build_tokenizer()
    trace = training_corpus(2, seed=0)[1]  # an agent trace: OpenAI tool_calls rendered compactly
    ids, labels = encode_chat(tok, trace["messages"], max_len=128)
    trained = tok.decode([i for i, label in zip(ids, labels, strict=True) if label != IGNORE])
    assert trained == trace["metadata"]["expected"] + "</s>"
    assert tok.decode(ids).startswith("<s><|user|>")


def test_only_the_final_assistant_turn_is_a_target():
    """Exemplars and earlier turns are context: a held-out answer placed in them is never trained on."""
    tok = build_tokenizer()
    messages = [
        {"role": "user", "content": "12+35=?"},
        {"role": "assistant", "content": "47"},  # e.g. a few-shot exemplar
        {"role": "user", "content": "20+21=?"},
        {"role": "assistant", "content": "41"},
    ]
    ids, labels = encode_chat(tok, messages, max_len=128)
    assert tok.decode([i for i, label in zip(ids, labels, strict=True) if label != IGNORE]) == "41</s>"
    assert "47" in tok.decode(ids)


def test_packed_rows_do_not_attend_across_examples(base_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    tok = build_tokenizer()
    examples = [encode_chat(tok, t["messages"], 96) for t in training_corpus(6, seed=1)]
    packed = packed_tensors(examples, 96, tok.pad_token_id)
    assert packed["input_ids"].shape[0] < len(examples)  # several examples share a row
    with torch.no_grad():
        logits = model(
            input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False
        ).logits
        for ids, _ in examples:
            alone = model(input_ids=torch.tensor([ids])).logits[0]
            row, col = _find(packed["input_ids"], ids)
            torch.testing.assert_close(logits[row, col : col + len(ids)], alone, atol=1e-4, rtol=1e-4)


def test_merged_lora_and_label_only_loss_equal_pefts_forward_and_hf_loss(base_dir):
    """The training step's fast path computes the same loss and the same LoRA gradients as peft + HF."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from pipeline.training import ALL_LINEAR
    from pipeline.training.kernels import assistant_loss, merged_lora

    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir),
        LoraConfig(r=4, lora_alpha=8, target_modules=list(ALL_LINEAR), task_type="CAUSAL_LM"),
    )
    for name, param in model.named_parameters():  # B starts at zero; make the adapter non-trivial
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    tok = build_tokenizer()
    batch = packed_tensors([encode_chat(tok, t["messages"], 96) for t in training_corpus(12, seed=3)], 96, 0)

    def loss_and_grads(fast):
        model.zero_grad()
        if fast:
            with merged_lora(model) as merged:
                assert merged == 2 * len(ALL_LINEAR)  # every LoRA linear of both layers
                loss = assistant_loss(model, batch)
        else:
            loss = model(**batch, use_cache=False).loss
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    reference, reference_grads = loss_and_grads(False)
    fast, fast_grads = loss_and_grads(True)
    assert fast == pytest.approx(reference, rel=1e-5)
    for name, grad in reference_grads.items():
        torch.testing.assert_close(fast_grads[name], grad, atol=1e-6, rtol=1e-4)
    assert all(type(m).forward is m.forward.__func__ for m in model.modules() if hasattr(m, "lora_A"))


def test_fast_path_only_where_it_is_exact(base_dir):
    """Half-precision bases with peft's float32 adapters take the kernel too (its thin path, every LoRA
    linear); a tokenizer whose saved state truncates still encodes whole conversations."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from pipeline.training import ALL_LINEAR
    from pipeline.training.kernels import merged_lora

    half = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16),
        LoraConfig(r=4, lora_alpha=8, target_modules=list(ALL_LINEAR), task_type="CAUSAL_LM"),
    )
    with merged_lora(half) as merged:
        assert merged == 2 * len(ALL_LINEAR)
    tok = build_tokenizer()
    messages = training_corpus(1, seed=5)[0]["messages"]
    whole = encode_chat(tok, messages, 128)
    tok.backend_tokenizer.enable_truncation(max_length=2)
    assert encode_chat(tok, messages, 128) == whole and len(whole[0]) > 2


def _find(rows, ids):
    for r, row in enumerate(rows.tolist()):
        for c in range(len(row) - len(ids) + 1):
            if row[c : c + len(ids)] == ids:
                return r, c
    raise AssertionError("example not found in packed rows")


def test_train_save_lineage_tracking_and_plain_peft_loading(base_dir, dataset_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from pipeline.registry.tracking import MLflowTracker

    tracker = MLflowTracker(
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_root=tmp_path / "art"
    )
    steps = []
    result = train_lora(base_model_dir=base_dir, dataset_dir=dataset_dir, output_dir=tmp_path / "job",
                        config=FAST, lineage={"parent_generation": 0, "contract_hash": "c1", "harness_hash": "h1"},
                        tracker=tracker, progress=lambda s, n, loss: steps.append(s))  # fmt: skip
    assert (
        result.completed
        and result.steps == 6
        and steps == [1, 2, 3, 4, 5, 6]
        and result.resumed_from_step == 0
    )
    files = {p.name for p in result.adapter_dir.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "lineage.json"} <= files
    assert not any(name.endswith(".bin") for name in files)
    assert not (tmp_path / "job" / "checkpoint").exists()
    lineage = json.loads((result.adapter_dir / "lineage.json").read_text())
    assert lineage["contract_hash"] == "c1" and lineage["adapter_sha256"] == result.adapter_sha256
    assert (
        len(lineage["dataset_sha256"]) == 64
        and len(lineage["base_model_sha256"]) == 64
        and lineage["code_version"]
    )
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), result.adapter_dir)
    assert any("lora_B" in n and p.abs().sum() > 0 for n, p in model.named_parameters())
    run = tracker.client.get_run(result.run_id)
    assert run.data.params["rank"] == "4" and run.data.params["dataset_sha256"] == lineage["dataset_sha256"]
    assert len(tracker.client.get_metric_history(result.run_id, "train_loss")) == 6
    assert any(f.path == "adapter" for f in tracker.client.list_artifacts(result.run_id))


def test_interrupted_job_resumes_from_checkpoint_with_the_same_result(base_dir, dataset_dir, tmp_path):
    whole = train_lora(
        base_model_dir=base_dir, dataset_dir=dataset_dir, output_dir=tmp_path / "whole", config=FAST
    )
    first = train_lora(base_model_dir=base_dir, dataset_dir=dataset_dir, output_dir=tmp_path / "cut", config=FAST,
                       stop_after_steps=3)  # fmt: skip
    assert not first.completed and first.steps == 3
    # the newest two are kept: one to fall back to when the newest is damaged (tests/test_training_faults.py)
    kept = sorted(p.name for p in (tmp_path / "cut" / "checkpoint").iterdir())
    assert kept == ["step-0000002", "step-0000003"]
    second = train_lora(
        base_model_dir=base_dir, dataset_dir=dataset_dir, output_dir=tmp_path / "cut", config=FAST
    )
    assert second.completed and second.resumed_from_step == 3 and second.steps == 6
    a, b = _adapter_tensors(whole.adapter_dir), _adapter_tensors(second.adapter_dir)
    assert a.keys() == b.keys()
    for key in a:
        assert (a[key] - b[key]).abs().max() < 1e-5, key
    other = TrainConfig(**{**FAST.__dict__, "lr": 2e-3})
    train_lora(base_model_dir=base_dir, dataset_dir=dataset_dir, output_dir=tmp_path / "x", config=FAST,
               stop_after_steps=2)  # fmt: skip
    with pytest.raises(RatchetError, match="different job"):
        train_lora(base_model_dir=base_dir, dataset_dir=dataset_dir, output_dir=tmp_path / "x", config=other)


def test_successor_continues_parent_weights(base_dir, dataset_dir, tmp_path):
    parent = train_lora(
        base_model_dir=base_dir, dataset_dir=dataset_dir, output_dir=tmp_path / "p", config=FAST
    )
    zero = TrainConfig(**{**FAST.__dict__, "lr": 1e-12, "max_steps": 1})
    child = train_lora(base_model_dir=base_dir, dataset_dir=dataset_dir, output_dir=tmp_path / "c", config=zero,
                       parent_adapter_dir=parent.adapter_dir)  # fmt: skip
    a, b = _adapter_tensors(parent.adapter_dir), _adapter_tensors(child.adapter_dir)
    assert all((a[k] - b[k]).abs().max() < 1e-6 for k in a)
    assert json.loads((child.adapter_dir / "lineage.json").read_text())["parent_adapter"] == str(
        parent.adapter_dir
    )


def test_bad_dataset_is_a_user_error(base_dir, tmp_path):
    with pytest.raises(RatchetError, match="save_to_disk"):
        train_lora(base_model_dir=base_dir, dataset_dir=tmp_path, output_dir=tmp_path / "o", config=FAST)


def _expert_iteration(base_dir, work, *, family, generations, prompts, heldout, train):
    """collect -> accumulate -> train (continuing the LoRA) -> evaluate, per generation."""
    suite = heldout_suite(family, heldout, seed=0)
    model, tok = load_model(base_dir)
    accuracy = [evaluate(model, tok, suite).accuracy]
    adapter, kept = None, []
    for gen in range(1, generations + 1):
        got = collect(
            model, tok, sample_prompts(family, prompts, seed=gen), num_samples=4, temperature=0.7, seed=gen
        )
        assert all(t["metadata"]["verified"] and t["metadata"]["split"] == "train" for t in got.traces)
        kept.extend(got.traces)
        if not kept:  # nothing verified yet: the champion stays, no successor this generation
            accuracy.append(accuracy[-1])
            continue
        write_dataset(kept, work / f"data-{gen}")
        adapter = train_lora(base_model_dir=base_dir, dataset_dir=work / f"data-{gen}", output_dir=work / f"g{gen}",
                             config=train, parent_adapter_dir=adapter).adapter_dir  # fmt: skip
        model, tok = load_model(base_dir, adapter)
        accuracy.append(evaluate(model, tok, suite).accuracy)
    return accuracy, len(kept)


def test_expert_iteration_loop_runs_end_to_end(base_dir, tmp_path):
    train = TrainConfig(rank=4, alpha=8, epochs=1.0, batch_size=32, lr=1e-3, warmup_steps=1)
    accuracy, kept = _expert_iteration(base_dir, tmp_path, family="chat", generations=2, prompts=60, heldout=40,
                                       train=train)  # fmt: skip
    assert len(accuracy) == 3 and all(0.0 <= a <= 1.0 for a in accuracy)
    with pytest.raises(RatchetError, match="no traces"):
        write_dataset([], tmp_path / "empty")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_expert_iteration_improves_heldout_accuracy(tmp_path, seed):
    """The demo's claim, measured: three generations raise mean held-out accuracy over the four families."""
    base = ensure_tiny_model(config=TinyModelConfig(seed=seed), cache_dir=tmp_path / "cache")
    train = TrainConfig(lr=5e-4, epochs=2.0, batch_size=64, seed=seed)
    first, last = [], []
    for family in FAMILIES:
        accuracy, kept = _expert_iteration(base, tmp_path / family, family=family, generations=3, prompts=750,
                                           heldout=200, train=train)  # fmt: skip
        assert kept > 0
        first.append(accuracy[0])
        last.append(accuracy[-1])
    assert sum(last) > sum(first), (first, last)


def test_families_cover_the_demo_specialists():
    assert set(FAMILIES) == {"chat", "agent", "coding", "genui"}


def test_real_architecture_sharded_without_pad_token_trains_full_length_examples(tmp_path):
    """A Qwen3 with a byte-level BPE tokenizer, no pad token and sharded weights (tests/realmodel.py):
    examples longer than 128 tokens are kept whole (the model's context length decides), padding falls back
    to EOS, and the adapter is saved with the sharded base's weights hash and loads with peft."""
    from peft import PeftModel
    from realmodel import build_real_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.specs.loading import file_sha256, weights_sha256
    from pipeline.training.job import sequence_limit

    base = build_real_model(tmp_path / "qwen")
    shards = sorted(base.glob("model-*.safetensors"))
    assert len(shards) > 1 and not (base / "model.safetensors").exists()
    tokenizer = AutoTokenizer.from_pretrained(base)
    assert tokenizer.pad_token_id is None
    reply = " ".join(["Résumé 😀 naïve café déjà vu"] * 12)
    rows = [
        {"messages": [{"role": "user", "content": f"say it {i}"}, {"role": "assistant", "content": reply}]}
        for i in range(8)
    ]
    write_dataset(rows, tmp_path / "ds")
    ids, labels = encode_chat(tokenizer, rows[0]["messages"], sequence_limit(base))
    assert sequence_limit(base) == 512 and 128 < len(ids) < 512
    assert tokenizer.decode([i for i, lab in zip(ids, labels, strict=True) if lab != IGNORE]).startswith(
        reply
    )
    result = train_lora(base_model_dir=base, dataset_dir=tmp_path / "ds", output_dir=tmp_path / "job",
                        config=FAST)  # fmt: skip
    assert result.completed and result.steps == 6
    lineage = json.loads((result.adapter_dir / "lineage.json").read_text())
    assert lineage["base_model_sha256"] == weights_sha256(base)
    assert lineage["base_model_sha256"] not in {file_sha256(s) for s in shards}
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), result.adapter_dir)
    assert any("lora_B" in n and p.abs().sum() > 0 for n, p in model.named_parameters())


def test_weights_hash_names_a_missing_shard(tmp_path):
    from pipeline.specs.loading import weights_sha256

    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps(
            {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
        )
    )
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x")
    with pytest.raises(RatchetError, match="model-00002-of-00002.safetensors"):
        weights_sha256(tmp_path)
    with pytest.raises(RatchetError, match="no model.safetensors"):
        weights_sha256(tmp_path / "nowhere")


# -- dpo's and grpo's checkpoint interval is the model spec's (issue 24: one config source) --------------------


def _checkpoints(job_dir) -> list[str]:
    return sorted(p.name for p in (job_dir / "checkpoint").glob("step-*"))


def test_the_dpo_checkpoint_interval_follows_the_spec(base_dir, tmp_path):
    """Interrupted after 5 steps with ``checkpoint_every: 2``: checkpoints at steps 4 and 5 (the newest two
    kept); the hard-coded interval of 50 left step 5 only. The job resumes from step 5."""
    from pipeline.loop.curation import save_dataset
    from pipeline.specs.modelspec import DpoSettings, LoraConfig
    from pipeline.training.dpo import train_dpo

    rows = []
    for i, trace in enumerate(training_corpus(32, seed=4)):
        *context, answer = trace["messages"]
        text = answer.get("content") or trace["metadata"]["expected"]
        rows.append({"messages": [*context, {"role": "assistant", "content": text}],
                     "rejected": [*context, {"role": "assistant", "content": text + "0"}],
                     "score": 1.0, "rejected_score": 0.0, "experience_id": i, "rejected_experience_id": 100 + i})  # fmt: skip
    save_dataset(rows, tmp_path / "pairs")
    settings = DpoSettings(lr=5e-3, batch_size=8, max_steps=8, warmup_steps=1, checkpoint_every=2)
    job = {"base_model_dir": base_dir, "dataset_dir": tmp_path / "pairs", "output_dir": tmp_path / "job",
           "settings": settings, "lora": LoraConfig(rank=4, alpha=8)}  # fmt: skip
    assert not train_dpo(**job, stop_after_steps=5).completed
    assert _checkpoints(tmp_path / "job") == ["step-0000004", "step-0000005"]
    assert train_dpo(**job).resumed_from_step == 5


def test_the_grpo_checkpoint_interval_follows_the_spec(base_dir, tmp_path):
    from pipeline.scoring import EpisodeReward
    from pipeline.specs.modelspec import GrpoSettings, LoraConfig
    from pipeline.training.grpo import Episodes, train_grpo

    episodes = Episodes(items=sample_prompts("chat", 8, seed=2), view=lambda messages: messages, max_new_tokens=8,
                        reward=lambda trace: EpisodeReward(float("1" in trace["messages"][-1].get("content", "")), None))  # fmt: skip
    settings = GrpoSettings(group_size=2, prompts_per_step=2, steps=4, warmup_steps=1, checkpoint_every=1)
    job = {"base_model_dir": base_dir, "output_dir": tmp_path / "job", "episodes": episodes, "settings": settings,
           "lora": LoraConfig(rank=4, alpha=8)}  # fmt: skip
    assert not train_grpo(**job, stop_after_steps=3).completed
    assert _checkpoints(tmp_path / "job") == ["step-0000002", "step-0000003"]
