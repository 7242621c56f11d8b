"""The model spec: tiny or path base (exactly one), LoRA settings per specialist."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from pipeline.environment.tinymodel import TinyModelConfig
from pipeline.specs.loading import SpecError
from pipeline.specs.modelspec import ModelSpec, TinyBaseConfig, load_model_spec, model_spec_hash

ROOT = Path(__file__).resolve().parents[1]

PATH_BASE = """\
name: local
base:
  path: /models/some-hf-dir
specialists:
  chat: {}
"""


def load(tmp_path: Path, text: str) -> ModelSpec:
    path = tmp_path / "m.yaml"
    path.write_text(textwrap.dedent(text))
    return load_model_spec(path)


def issues(tmp_path: Path, text: str) -> list:
    with pytest.raises(SpecError) as info:
        load(tmp_path, text)
    return info.value.issues


def test_shipped_tiny_model():
    spec = load_model_spec(ROOT / "models" / "tiny.yaml")
    tiny = spec.base.tiny
    assert spec.base.path is None and tiny is not None
    assert (tiny.vocab, tiny.hidden_size, tiny.num_layers, tiny.num_heads, tiny.max_position_embeddings) == (
        "char",
        128,
        4,
        4,
        128,
    )
    # The shipped spec is the tiny model's own defaults: the same config hash, the same cached build.
    assert tiny.to_tiny_model_config() == TinyModelConfig()
    assert set(spec.specialists) == {"chat", "agent", "coding", "genui"}
    for entry in spec.specialists.values():
        assert (entry.lora.rank, entry.lora.alpha, entry.lora.dropout) == (16, 32.0, 0.0)
        assert entry.lora.target_modules == [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ]
    assert spec.tokenizer == "same_as_base" and spec.dtype == "float32"
    assert len(model_spec_hash(spec)) == 64


def test_tiny_config_maps_every_field():
    from dataclasses import asdict

    custom = TinyBaseConfig(
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        intermediate_size=96,
        max_position_embeddings=64,
        pretrain={"steps": 7, "batch_size": 3, "lr": 0.5, "seed": 9, "corpus_size": 11},
    )
    mapped, default = asdict(custom.to_tiny_model_config()), asdict(TinyModelConfig())
    assert all(mapped[k] != default[k] for k in default), mapped


def test_path_base_with_defaults(tmp_path):
    spec = load(tmp_path, PATH_BASE)
    assert spec.base.path == "/models/some-hf-dir" and spec.base.tiny is None
    assert spec.specialists["chat"].lora.rank == 16 and spec.specialists["chat"].training.epochs == 2.0


def test_exactly_one_base(tmp_path):
    both = PATH_BASE.replace("  path: /models/some-hf-dir", "  path: /m\n  tiny: {}")
    (issue,) = issues(tmp_path, both)
    assert issue.path == "base" and issue.line == 3 and "exactly one of `path`" in issue.message
    neither = PATH_BASE.replace("  path: /models/some-hf-dir", "  {}").replace("base:\n  {}", "base: {}")
    assert "exactly one of" in issues(tmp_path, neither)[0].message


def test_field_errors_are_located(tmp_path):
    text = """\
    name: bad
    base:
      tiny: {hidden_size: 130, num_heads: 4, vocab: bpe}
    dtype: float64
    specialists:
      chat:
        lora: {rank: 0, dropout: 1.5}
    """
    found = {i.path: i for i in issues(tmp_path, text)}
    assert "base.tiny.vocab" in found and found["base.tiny.vocab"].line == 3
    assert found["dtype"].line == 4 and "float32" in found["dtype"].message
    assert "specialists.chat.lora.rank" in found and "specialists.chat.lora.dropout" in found


def test_heads_must_divide_width(tmp_path):
    text = PATH_BASE.replace("  path: /models/some-hf-dir", "  tiny: {hidden_size: 130, num_heads: 4}")
    assert "must divide hidden_size" in issues(tmp_path, text)[0].message
