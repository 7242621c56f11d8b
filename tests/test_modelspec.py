"""The model spec: tiny or path base (exactly one), LoRA settings per specialist."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from pipeline.environment.tinymodel import TinyModelConfig
from pipeline.specs.loading import SpecError
from pipeline.specs.modelspec import ModelSpec, TinyBaseConfig, base_hash, load_model_spec, model_spec_hash

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


# -- every training knob of a job is set from the model spec (issue 24: one config source) ---------------------

# What the job takes from elsewhere than the specialist's spec: the advance's seed, the harness's format.
NOT_FROM_SPEC = {"seed", "tool_call_format"}


def _other_value(name: str, default):
    """A valid value of a spec field unlike its default (bounds: rates below 1, lengths at least 8)."""
    if name == "target_modules":
        return ["q_proj", "v_proj"]
    if name == "activation_checkpointing":
        return "on"
    if default is None:
        return 40
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 3
    return round(default * 1.5 + 0.25, 6)


def test_every_training_knob_of_the_job_is_set_from_the_model_spec(tmp_path):
    """Each field of the SFT job's ``TrainConfig`` is a field of the specialist's ``lora`` or ``training``
    section (a knob missing there fails here), and a value written in the YAML reaches the job's config
    through the training step's own builder (``job_for``); so do dpo's and grpo's warm-up and checkpoint
    interval."""
    import dataclasses

    import yaml

    from pipeline.specs.modelspec import DpoSettings, GrpoSettings, LoraConfig, TrainDefaults
    from pipeline.training.job import TrainConfig
    from pipeline.training.step import job_for

    sections = {"lora": LoraConfig.model_fields, "training": TrainDefaults.model_fields}
    written: dict[str, dict] = {"lora": {}, "training": {}}
    for field in dataclasses.fields(TrainConfig):
        if field.name in NOT_FROM_SPEC:
            continue
        section = next((s for s, fields in sections.items() if field.name in fields), None)
        assert section is not None, f"TrainConfig.{field.name} cannot be set from a model spec"
        default = sections[section][field.name].get_default(call_default_factory=True)
        written[section][field.name] = _other_value(field.name, default)
    method = {
        name: {"warmup_steps": cls().warmup_steps + 2, "checkpoint_every": cls().checkpoint_every + 3}
        for name, cls in (("dpo", DpoSettings), ("grpo", GrpoSettings))
    }
    spec = load(
        tmp_path,
        yaml.safe_dump(
            {"name": "m", "base": {"path": "/models/x"}, "specialists": {"chat": {**written, **method}}}
        ),
    )

    _, kwargs = job_for("sft", spec, "chat", seed=5, fmt="openai", dataset=("/data", "0" * 64, 3))
    config = kwargs["config"]
    for values in written.values():
        for name, value in values.items():
            got = getattr(config, name)
            assert (list(got) if name == "target_modules" else got) == value, name
    assert (config.seed, config.tool_call_format) == (5, "openai")
    for name, values in method.items():
        _, kwargs = job_for(name, spec, "chat", seed=5, fmt="openai", dataset=("/data", "0" * 64, 3))
        assert kwargs["settings"].model_dump(include=set(values)) == values, name


def test_the_job_config_defaults_are_the_model_specs():
    from pipeline.specs.modelspec import SpecialistModel
    from pipeline.training.job import TrainConfig

    assert TrainConfig() == TrainConfig.from_spec(SpecialistModel(), seed=0, tool_call_format="compact")


def test_the_built_base_is_addressed_by_what_builds_it():
    """A new training knob or LoRA rank must not rebuild the tiny base (14 minutes on 2 cores): its directory
    name hashes the ``base`` section only; a change to the base itself gets a new directory."""
    spec = load_model_spec(ROOT / "models" / "tiny.yaml")
    chat = spec.specialists["chat"]
    retrained = spec.model_copy(
        update={
            "specialists": {
                **spec.specialists,
                "chat": chat.model_copy(
                    update={"lora": chat.lora.model_copy(update={"rank": chat.lora.rank * 2})}
                ),
            }
        }
    )
    assert model_spec_hash(retrained) != model_spec_hash(spec)
    assert base_hash(retrained) == base_hash(spec)
    wider = spec.model_copy(
        update={
            "base": spec.base.model_copy(
                update={"tiny": spec.base.tiny.model_copy(update={"hidden_size": 256})}
            )
        }
    )
    assert base_hash(wider) != base_hash(spec)
