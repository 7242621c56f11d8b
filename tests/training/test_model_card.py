"""Each adapter's model card (README.md beside its weights): Hugging Face's ``ModelCard`` format, filled from
its lineage when it is saved, and rewritten with its held-out scores and the decision once its generation is
decided."""

from __future__ import annotations

import json

import pytest
from huggingface_hub import ModelCard

from pipeline.training.artifacts import save_adapter

RECORD = {
    "lineage": "main",
    "generation": 3,
    "parent_generation": 2,
    "specialist": "coding",
    "method": "dpo",
    "base_model": "tiny-llama-test",
    "base_model_sha256": "b" * 64,
    "contract": "demo 1.2.0",
    "contract_sha256": "c" * 64,
    "harness": "demo 1",
    "harness_sha256": "h" * 64,
    "dataset_sha256": "d" * 64,
    "dataset_rows": 57,
    "pairs": 55,
    "parent_adapter_sha256": "p" * 64,
    "steps": 7,
    "final_loss": 0.6931,
    "code_version": "abc1234",
}


@pytest.fixture(scope="module")
def peft_model():
    """A real (tiny, random) causal LM with a LoRA on it: what a training job saves."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)  # fmt: skip
    return get_peft_model(LlamaForCausalLM(config), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))


def test_a_saved_adapter_has_a_model_card_from_its_lineage(peft_model, tmp_path):
    adapter_dir, sha = save_adapter(peft_model, tmp_path / "job", record=RECORD)
    card = ModelCard.load(adapter_dir / "README.md")
    assert card.data.base_model == "tiny-llama-test" and card.data.library_name == "peft"
    assert {"ratchet", "lora", "dpo", "lineage:main", "specialist:coding"} <= set(card.data.tags)
    text = card.text
    assert "main: generation 3, coding" in text
    assert f"sha256 `{'d' * 64}`, 57 rows, 55 pairs trained on" in text  # the dataset: hash and size
    assert "generation 2" in text and "p" * 64 in text  # the parent and its adapter
    assert "demo 1.2.0" in text and "c" * 64 in text  # the contract version
    assert f"sha256 `{sha}`" in text and "0.6931" in text
    assert "Not evaluated yet" in text  # its scores come with the decision


def test_the_card_is_rewritten_with_the_scores_and_the_decision(peft_model, tmp_path):
    from pipeline.training.cards import CardScores, write_model_card

    adapter_dir, _ = save_adapter(peft_model, tmp_path / "job", record=RECORD)
    weights = (adapter_dir / "adapter_model.safetensors").read_bytes()
    lineage = (adapter_dir / "lineage.json").read_text()
    scores = CardScores(decision="rejected", candidate=0.41, champion=0.45, overall=0.5, champion_overall=0.52,
                        retention={"coding-basics": (0.8, 0.7)},
                        reasons=("the improvement is not significant",))  # fmt: skip
    write_model_card(adapter_dir, scores=scores)  # the record is read back from lineage.json
    card = ModelCard.load(adapter_dir / "README.md")
    assert card.data.base_model == "tiny-llama-test"
    assert "**Decision: rejected**" in card.text and "- the improvement is not significant" in card.text
    assert "| held-out: coding | 0.4500 | 0.4100 |" in card.text
    assert "| held-out: overall | 0.5200 | 0.5000 |" in card.text
    assert "| retention: coding-basics | 0.8000 | 0.7000 |" in card.text
    assert "Not evaluated yet" not in card.text
    # the weights and the training record are untouched; no temporary file is left behind
    assert (adapter_dir / "adapter_model.safetensors").read_bytes() == weights
    assert (adapter_dir / "lineage.json").read_text() == lineage and json.loads(lineage)["generation"] == 3
    assert sorted(p.name for p in adapter_dir.iterdir()) == [
        "README.md", "adapter_config.json", "adapter_model.safetensors", "lineage.json"]  # fmt: skip
