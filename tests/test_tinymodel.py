"""The tiny base model: plain transformers loading, the chat template, caching and determinism."""

from __future__ import annotations

import json

import pytest

from pipeline.environment import training_corpus
from pipeline.environment.tinymodel import (
    TinyModelConfig,
    build_tiny_model,
    build_tokenizer,
    ensure_tiny_model,
)

SMALL = TinyModelConfig(
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
    bootstrap_steps=8,
    bootstrap_batch_size=16,
    corpus_size=200,
    seed=1,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_tiny_model(config=SMALL, cache_dir=tmp_path_factory.mktemp("tiny"))


def test_tokenizer_is_char_level_with_specials_and_chat_template():
    tok = build_tokenizer()
    ids = tok("12+35=?", add_special_tokens=False)["input_ids"]
    assert len(ids) == 7 and tok.decode(ids) == "12+35=?"
    text = tok.apply_chat_template(
        [{"role": "user", "content": "1+2=?"}, {"role": "assistant", "content": "3"}], tokenize=False
    )
    assert text == "<s><|user|>1+2=?<|assistant|>3</s>"
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|assistant|>")
    assert len(tok(prompt, add_special_tokens=False)["input_ids"]) == 5  # specials are single tokens
    assert tok.pad_token_id is not None and tok.eos_token_id != tok.pad_token_id


def test_build_loads_with_plain_auto_classes(model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert (model_dir / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    ids = tok.apply_chat_template([{"role": "user", "content": "1+2=?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]  # fmt: skip
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    build = json.loads((model_dir / "build.json").read_text())
    assert build["config_hash"] == SMALL.hash() and build["config"]["hidden_size"] == 32


def test_ensure_reuses_cache_and_rebuilds_on_config_change(model_dir, tmp_path_factory):
    stamp = (model_dir / "model.safetensors").stat().st_mtime_ns
    calls = []
    again = ensure_tiny_model(
        config=SMALL, cache_dir=model_dir.parent, corpus_texts=lambda: calls.append(1) or []
    )
    assert again == model_dir and not calls
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == stamp
    other = TinyModelConfig(**{**SMALL.__dict__, "bootstrap_steps": 3})
    assert other.hash() != SMALL.hash()


def test_a_build_counts_only_for_its_own_config(model_dir, tmp_path):
    import shutil

    from pipeline.environment.tinymodel import tiny_model_built

    assert tiny_model_built(model_dir, SMALL)
    assert not tiny_model_built(model_dir, TinyModelConfig(**{**SMALL.__dict__, "bootstrap_steps": 3}))
    assert not tiny_model_built(tmp_path / "missing", SMALL)
    broken = shutil.copytree(model_dir, tmp_path / "broken")
    (broken / "build.json").write_text("{not json")
    assert not tiny_model_built(broken, SMALL)  # rebuilt, not trusted
    half = shutil.copytree(model_dir, tmp_path / "half")
    (half / "model.safetensors").unlink()
    assert not tiny_model_built(half, SMALL)


def test_build_is_deterministic_and_refuses_heldout(tmp_path):
    config = TinyModelConfig(**{**SMALL.__dict__, "bootstrap_steps": 3})
    corpus = training_corpus(64, seed=0)
    a = build_tiny_model(config=config, corpus_texts=corpus, output_dir=tmp_path / "a")
    b = build_tiny_model(config=config, corpus_texts=corpus, output_dir=tmp_path / "b")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    bad = [dict(corpus[0], metadata={**corpus[0]["metadata"], "split": "heldout"})]
    with pytest.raises(ValueError, match="held-out"):
        build_tiny_model(config=config, corpus_texts=bad, output_dir=tmp_path / "c")
