"""The DPO job: log-probabilities from the packed forward, the paper's loss (log 2 at the start, the parent as
the reference), learning the preference, resume, a self-describing adapter; tool calls on a real architecture."""

from __future__ import annotations

import json
import math

import pytest

from pipeline.environment import training_corpus
from pipeline.environment.tinymodel import TinyModelConfig, build_tokenizer, ensure_tiny_model
from pipeline.errors import RatchetError
from pipeline.loop.curation import save_dataset
from pipeline.modeling.packing import IGNORE, encode_chat
from pipeline.specs.modelspec import DpoSettings, LoraConfig
from pipeline.training import TrainConfig, train_lora, write_dataset
from pipeline.training.dpo import train_dpo
from pipeline.training.likelihood import sequence_logprobs

SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                        max_position_embeddings=96, bootstrap_steps=40, bootstrap_batch_size=32,
                        corpus_size=400, seed=2)  # fmt: skip
LORA = LoraConfig(rank=4, alpha=8)
FAST = DpoSettings(beta=0.5, lr=5e-3, batch_size=8, max_steps=8, sft_weight=0.0)  # the DPO term alone


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return ensure_tiny_model(config=SMALL, cache_dir=tmp_path_factory.mktemp("tiny"))


def _wrong(answer: str) -> str:
    return answer.translate(str.maketrans("0123456789", "1234567890"))


def pair_rows(n: int, seed: int = 4) -> list[dict]:
    """Preferred: the reference answer; other: the same answer with every digit moved by one."""
    rows = []
    for i, trace in enumerate(training_corpus(n, seed=seed)):
        *context, answer = trace["messages"]
        text = answer.get("content") or trace["metadata"]["expected"]
        rows.append({
            "messages": [*context, {"role": "assistant", "content": text}],
            "rejected": [*context, {"role": "assistant", "content": _wrong(text)}],
            "score": 1.0, "rejected_score": 0.0, "experience_id": i, "rejected_experience_id": 1000 + i,
        })  # fmt: skip
    return rows


@pytest.fixture(scope="module")
def pairs_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("pairs") / "ds"
    save_dataset(pair_rows(64), path)
    return path


def _margin(base_dir, adapter_dir, rows):
    """Mean summed log-probability of the preferred minus the other reply under base (+ adapter)."""
    import torch

    from pipeline.modeling.decoding import load_model

    model, tok = load_model(base_dir, adapter_dir)
    examples = [encode_chat(tok, r[k], 96) for r in rows for k in ("messages", "rejected")]
    with torch.no_grad():
        summed, _, _ = sequence_logprobs(model, examples, row_len=96, pad_id=0, device="cpu")
    return float((summed[0::2] - summed[1::2]).mean())


def test_sequence_logprobs_equal_a_plain_forward_of_each_example(base_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    tok = build_tokenizer()
    examples = [encode_chat(tok, t["messages"], 96) for t in training_corpus(7, seed=5)]
    with torch.no_grad():
        summed, logp, owner = sequence_logprobs(model, examples, row_len=96, pad_id=0, device="cpu")
        for i, (ids, labels) in enumerate(examples):
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
            want = sum(
                float(logits[p, labels[p + 1]]) for p in range(len(ids) - 1) if labels[p + 1] != IGNORE
            )
            assert abs(float(summed[i]) - want) < 1e-4
            assert int((owner == i).sum()) == sum(label != IGNORE for label in labels)
    assert logp.shape == owner.shape


def test_dpo_starts_at_log_2_and_learns_the_preference(base_dir, pairs_dir, tmp_path):
    from pipeline.registry.tracking import MLflowTracker

    tracker = MLflowTracker(
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_root=tmp_path / "art"
    )
    result = train_dpo(base_model_dir=base_dir, dataset_dir=pairs_dir, output_dir=tmp_path / "job",
                       settings=FAST, lora=LORA, tracker=tracker, lineage={"generation": 1})  # fmt: skip
    # a fresh adapter (B = 0) is the reference (the bare base) at step 0: every margin is 0, the loss log 2
    assert result.loss_curve[0] == (1, pytest.approx(math.log(2), abs=1e-4))
    assert result.completed and result.steps == 8 and result.final_loss < math.log(2)
    rows = pair_rows(64)[:16]
    assert _margin(base_dir, result.adapter_dir, rows) > _margin(base_dir, None, rows) + 0.2
    record = json.loads((result.adapter_dir / "lineage.json").read_text())
    assert record["method"] == "dpo" and record["reference"] == "base model" and record["pairs"] == 64
    assert record["adapter_sha256"] == result.adapter_sha256 and record["generation"] == 1
    client = tracker.client
    for metric in ("train_loss", "reward_margin", "reward_accuracy", "chosen_reward", "rejected_reward"):
        assert len(client.get_metric_history(result.run_id, metric)) == 8, metric
    assert client.get_metric_history(result.run_id, "reward_accuracy")[-1].value > 0.5
    assert client.get_run(result.run_id).data.tags["method"] == "dpo"


def test_the_parent_is_the_reference(base_dir, pairs_dir, tmp_path):
    """Continuing a parent that already prefers something: the loss still starts at log 2 (the reference is
    the parent, not the base), and the implicit KL holds the successor to it."""
    sft_data = tmp_path / "sft"
    write_dataset(training_corpus(120, seed=4), sft_data)
    parent = train_lora(base_model_dir=base_dir, dataset_dir=sft_data, output_dir=tmp_path / "parent",
                        config=TrainConfig(rank=4, alpha=8, max_steps=10, batch_size=16, lr=5e-3))  # fmt: skip
    result = train_dpo(base_model_dir=base_dir, dataset_dir=pairs_dir, output_dir=tmp_path / "child",
                       settings=FAST, lora=LORA, parent_adapter_dir=parent.adapter_dir)  # fmt: skip
    assert result.loss_curve[0] == (1, pytest.approx(math.log(2), abs=1e-4))
    assert json.loads((result.adapter_dir / "lineage.json").read_text())["reference"] == "parent adapter"


def test_an_interrupted_dpo_job_resumes_with_the_same_result(base_dir, pairs_dir, tmp_path):
    from safetensors.torch import load_file

    settings = FAST.model_copy(update={"max_steps": 6})
    whole = train_dpo(base_model_dir=base_dir, dataset_dir=pairs_dir, output_dir=tmp_path / "w", settings=settings,
                      lora=LORA)  # fmt: skip
    cut = train_dpo(base_model_dir=base_dir, dataset_dir=pairs_dir, output_dir=tmp_path / "c", settings=settings,
                    lora=LORA, stop_after_steps=3)  # fmt: skip
    assert not cut.completed and cut.steps == 3
    rest = train_dpo(base_model_dir=base_dir, dataset_dir=pairs_dir, output_dir=tmp_path / "c", settings=settings,
                     lora=LORA)  # fmt: skip
    assert rest.resumed_from_step == 3 and rest.steps == 6
    a = load_file(str(whole.adapter_dir / "adapter_model.safetensors"))
    b = load_file(str(rest.adapter_dir / "adapter_model.safetensors"))
    assert all((a[k] - b[k]).abs().max() < 1e-5 for k in a)


def test_a_dataset_without_pairs_is_a_user_error(base_dir, tmp_path):
    plain = tmp_path / "plain"
    write_dataset(training_corpus(4, seed=1), plain)
    with pytest.raises(RatchetError, match="rejected"):
        train_dpo(
            base_model_dir=base_dir, dataset_dir=plain, output_dir=tmp_path / "j", settings=FAST, lora=LORA
        )


def test_dpo_on_a_real_architecture_with_tool_calls(tmp_path):
    """Qwen3 with a byte-level BPE, ChatML with tools, no pad token: the tool call is rendered by the
    template in both replies and only the replies are compared."""
    from realmodel import build_real_model

    base = build_real_model(tmp_path / "qwen", sharpness=1.0)
    tools = [{"type": "function", "function": {"name": "set_timer", "parameters": {
        "type": "object", "properties": {"minutes": {"type": "integer"}}}}}]  # fmt: skip

    def call(minutes):
        arguments = json.dumps({"minutes": minutes})
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "set_timer", "arguments": arguments}}]}  # fmt: skip

    rows = [
        {"messages": [{"role": "user", "content": f"timer for {m} minutes"}, call(m)],
         "rejected": [{"role": "user", "content": f"timer for {m} minutes"}, call(m + 1)],
         "score": 1.0, "rejected_score": 0.0, "experience_id": m, "rejected_experience_id": 100 + m, "tools": tools}
        for m in range(5, 21)
    ]  # fmt: skip
    save_dataset(rows, tmp_path / "pairs")
    result = train_dpo(base_model_dir=base, dataset_dir=tmp_path / "pairs", output_dir=tmp_path / "job",
                       settings=DpoSettings(beta=0.5, lr=1e-2, batch_size=8, max_steps=6, sft_weight=0.0), lora=LORA,
                       tool_call_format="openai")  # fmt: skip
    assert result.examples == 16 and result.loss_curve[0] == (1, pytest.approx(math.log(2), abs=1e-4))
    assert result.final_loss < math.log(2)


def test_the_sft_weight_adds_the_preferred_replys_mean_nll(base_dir, pairs_dir, tmp_path):
    """RPO: at step 1 the loss is log 2 plus the preferred replies' mean per-token NLL under the reference."""
    import torch

    from pipeline.modeling.decoding import load_model
    from pipeline.training import batch_indices

    result = train_dpo(base_model_dir=base_dir, dataset_dir=pairs_dir, output_dir=tmp_path / "job",
                       settings=FAST.model_copy(update={"sft_weight": 1.0, "max_steps": 1}), lora=LORA)  # fmt: skip
    model, tok = load_model(base_dir)
    rows = [pair_rows(64)[i] for i in batch_indices(64, FAST.batch_size, 0, 0)]
    examples = [encode_chat(tok, r["messages"], 96) for r in rows]
    with torch.no_grad():
        summed, _, _ = sequence_logprobs(model, examples, row_len=96, pad_id=0, device="cpu")
    tokens = torch.tensor([sum(label != IGNORE for label in labels) for _, labels in examples])
    nll = float((-summed / tokens).mean())
    assert result.loss_curve[0] == (1, pytest.approx(math.log(2) + nll, abs=1e-3))
