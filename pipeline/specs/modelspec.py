"""The model spec: the frozen base model and the LoRA settings of each specialist.

The base is either a local Hugging Face causal-LM directory (``path:``) or the project-built tiny
Llama-style model (``tiny:``, its architecture plus bootstrap pretraining settings) — exactly one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from pipeline.environment.tinymodel import TinyModelConfig
from pipeline.specs.contract import Name, StrictModel
from pipeline.specs.loading import content_hash, load_spec


class PretrainConfig(StrictModel):
    """Bootstrap pretraining of the tiny base model on a task environment's corpus."""

    steps: int = Field(default=1000, ge=1, description="Optimizer steps.")
    batch_size: int = Field(default=64, ge=1, description="Sequences per step (packed into rows).")
    lr: float = Field(
        default=3e-3, gt=0, description="Peak learning rate (AdamW; linear warmup, then linear decay to 10%)."
    )
    seed: int = Field(default=0, description="Seed of initialisation, corpus sampling and data order.")
    corpus: Literal["demo"] = Field(
        default="demo", description="Task environment producing the text (`demo`: pipeline.environment)."
    )
    corpus_size: int = Field(
        default=20_000, ge=1, description="Complete traces drawn from the environment's training split."
    )


class TinyBaseConfig(StrictModel):
    """Architecture of the project-built tiny Llama-style model."""

    vocab: Literal["char"] = Field(default="char", description="Tokenizer kind (a character vocabulary).")
    hidden_size: int = Field(default=128, ge=8, description="Model width.")
    num_layers: int = Field(default=4, ge=1, description="Transformer blocks.")
    num_heads: int = Field(default=4, ge=1, description="Attention heads (must divide hidden_size).")
    intermediate_size: int = Field(default=256, ge=8, description="MLP inner width.")
    max_position_embeddings: int = Field(default=128, ge=8, description="Longest sequence (characters).")
    pretrain: PretrainConfig = Field(default_factory=PretrainConfig, description="Bootstrap pretraining.")

    @model_validator(mode="after")
    def _heads(self) -> TinyBaseConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must divide hidden_size ({self.hidden_size})")
        return self

    def to_tiny_model_config(self) -> TinyModelConfig:
        """The ``pipeline.environment.tinymodel.TinyModelConfig`` this spec describes (its hash names the cached build)."""

        return TinyModelConfig(
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=self.max_position_embeddings,
            bootstrap_steps=self.pretrain.steps,
            bootstrap_batch_size=self.pretrain.batch_size,
            bootstrap_lr=self.pretrain.lr,
            corpus_size=self.pretrain.corpus_size,
            seed=self.pretrain.seed,
        )


class BaseModelConfig(StrictModel):
    """Exactly one of ``path`` (a local HF causal-LM directory) or ``tiny`` (the built tiny model)."""

    path: str | None = Field(default=None, description="Local Hugging Face causal-LM directory.")
    tiny: TinyBaseConfig | None = Field(
        default=None, description="Architecture of the project-built tiny model."
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> BaseModelConfig:
        if (self.path is None) == (self.tiny is None):
            raise ValueError(
                "give exactly one of `path` (a local model directory) or `tiny` (the built tiny model)"
            )
        return self


ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear projection of a Llama-style block: the default LoRA targets."""


class LoraConfig(StrictModel):
    """LoRA hyperparameters of one specialist's adapter (the one place of their defaults:
    ``pipeline.training.job.TrainConfig`` takes its defaults from here)."""

    rank: int = Field(default=16, ge=1, description="LoRA rank r.")
    alpha: float = Field(default=32.0, gt=0, description="LoRA alpha (scale = alpha / rank).")
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: list[str] = Field(
        default_factory=lambda: list(ALL_LINEAR),
        min_length=1,
        description="Module names that get adapters.",
    )


class TrainDefaults(StrictModel):
    """SFT training settings of one specialist's adapter (the one place of their defaults: the job's
    ``TrainConfig`` takes its defaults from here, and ``TrainConfig.from_spec`` every value)."""

    lr: float = Field(default=5e-4, gt=0, description="Learning rate.")
    epochs: float = Field(default=2.0, gt=0, description="Passes over the curated (accumulated) dataset.")
    batch_size: int = Field(default=64, ge=1, description="Examples per step.")
    max_steps: int | None = Field(default=None, ge=1, description="Step cap (overrides epochs); null: none.")
    max_seq_len: int | None = Field(
        default=None,
        ge=8,
        description="Training sequence length in tokens (longer examples are cut); null: the base's "
        "context length (max_position_embeddings), at most 2048.",
    )
    warmup_steps: int = Field(
        default=10,
        ge=0,
        description="Optimizer steps of linear learning-rate warm-up (AdamW; constant after).",
    )
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay of the LoRA weights.")
    checkpoint_every: int = Field(
        default=50,
        ge=1,
        description="Optimizer steps between checkpoints (adapter, optimizer, scheduler, RNG state); an "
        "interrupted job resumes from the newest.",
    )
    micro_batch_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Tokens (examples' ids, summed) per forward/backward: each step's batch (`batch_size`, "
        "the optimizer's batch, unchanged) runs as consecutive micro-batches within this budget, their "
        "gradients accumulated (an example longer than it is a micro-batch of its own); the same update up "
        "to float rounding. Also bounds dpo's and grpo's forwards. null: on a GPU, derived from the free "
        "device memory when the job starts (`pipeline.training.memory.token_budget` states the formula); "
        "on the CPU, no split (the whole batch in one forward).",
    )
    activation_checkpointing: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="Recompute each transformer block's activations in the backward pass instead of keeping "
        "them (less memory, about a third more compute). `auto`: on for a base of at least 1B parameters; "
        "on a GPU also when one `max_seq_len` sequence's activations would not fit 80% of the free memory "
        "without it (`pipeline.training.memory.checkpointing_wanted`); off otherwise (every CPU run of a "
        "base under 1B parameters).",
    )
    processes: int = Field(
        default=1,
        ge=1,
        description="Training processes of one job (`torchrun`, one GPU each, gloo on the CPU): each runs "
        "its share of every step's micro-batches and the gradients are summed before each update; only the "
        "first writes checkpoints, the adapter and metrics. 1: the job runs in the step's own process.",
    )


class DpoSettings(StrictModel):
    """Direct preference optimisation on pairs from experience (``pipeline.training.dpo``)."""

    beta: float = Field(
        default=0.1,
        gt=0,
        description="Strength of the implicit KL to the reference (the parent pair): larger keeps the successor "
        "closer to its parent.",
    )
    lr: float = Field(default=1e-4, gt=0, description="Learning rate (AdamW, after `warmup_steps`).")
    epochs: float = Field(default=2.0, gt=0, description="Passes over the preference pairs.")
    batch_size: int = Field(default=32, ge=1, description="Pairs per optimizer step.")
    max_steps: int | None = Field(default=None, ge=1, description="Step cap (overrides epochs); null: none.")
    max_pairs: int = Field(
        default=4000, ge=1, description="Most pairs per generation (largest margins kept, newest first)."
    )
    sft_weight: float = Field(
        default=1.0,
        ge=0,
        description="Weight of the preferred reply's mean negative log-likelihood beside the DPO loss (RPO; 0: "
        "pure DPO). Pure DPO lowers the preferred reply's probability along with the other's: on the demo it "
        "lost 0.09 held-out in one generation, where 1.0 gained 0.075 (bench/methods.py).",
    )
    warmup_steps: int = Field(
        default=10, ge=0, description="Optimizer steps of linear learning-rate warm-up (constant after)."
    )
    checkpoint_every: int = Field(
        default=50,
        ge=1,
        description="Optimizer steps between checkpoints; an interrupted job resumes from the newest.",
    )


class GrpoSettings(StrictModel):
    """Online RL on the task source's training prompts (``pipeline.training.grpo``)."""

    group_size: int = Field(
        default=8, ge=2, description="Samples per prompt (k); advantages are relative to the group's mean."
    )
    prompts_per_step: int = Field(default=32, ge=1, description="Prompts per optimizer step.")
    steps: int = Field(
        default=40,
        ge=1,
        description="Optimizer steps; each samples fresh rollouts from the policy (on-policy).",
    )
    lr: float = Field(
        default=5e-5,
        gt=0,
        description="Learning rate (AdamW, after `warmup_steps`). RL's gradient is noisier than SFT's: too high a "
        "rate drifts away from the parent while the reward stays flat (the tiny model: 2e-3 lost 0.10 "
        "held-out, 3e-4 gained).",
    )
    kl_beta: float = Field(
        default=0.04, ge=0, description="Weight of the per-token KL penalty toward the parent pair (0: none)."
    )
    temperature: float = Field(default=1.0, gt=0, description="Sampling temperature of the rollouts.")
    max_turns: int = Field(
        default=3,
        ge=1,
        description="Most assistant turns per episode. Where the task source has an action substrate, a reply "
        "that calls tools has the calls executed against it and gets their results back, until a reply calls "
        "none or this many were written; 1: single replies.",
    )
    warmup_steps: int = Field(
        default=5,
        ge=0,
        description="Updates of linear learning-rate warm-up (constant after; a step whose groups all tied "
        "makes no update and does not count).",
    )
    checkpoint_every: int = Field(
        default=20, ge=1, description="Steps between checkpoints; an interrupted job resumes from the newest."
    )


class SpecialistModel(StrictModel):
    """A specialist's adapter settings."""

    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA hyperparameters.")
    method: Literal["sft", "dpo", "grpo"] = Field(
        default="sft",
        description="How the successor's adapter is trained: `sft` (verified experience, filtered), `dpo` "
        "(preference pairs of replies to the same prompt, reference = the parent), `grpo` (online RL on "
        "the task source's training prompts with the contract's scorers as reward; needs `tasks`).",
    )
    training: TrainDefaults = Field(
        default_factory=TrainDefaults,
        description="Settings of `method: sft` (`max_seq_len` also bounds dpo's and grpo's sequences).",
    )
    dpo: DpoSettings = Field(default_factory=DpoSettings, description="Settings of `method: dpo`.")
    grpo: GrpoSettings = Field(default_factory=GrpoSettings, description="Settings of `method: grpo`.")


class ModelSpec(StrictModel):
    """A model spec (one YAML file under ``models/``)."""

    name: Name = Field(description="Base model name (unique in the registry).")
    description: str = Field(default="", description="What this model is.")
    base: BaseModelConfig = Field(description="The frozen base model.")
    tokenizer: str = Field(
        default="same_as_base",
        description="Tokenizer directory (relative to this file; with a chat template), or `same_as_base` "
        "(the base's own tokenizer).",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="Weights dtype in collection, training, evaluation and serving. `auto`: bfloat16 on a GPU "
        "that supports it, float32 on the CPU. bfloat16 on a CPU with AVX512-BF16 or AMX is fast (serving); "
        "half precision on a CPU without native support is honoured, with a warning: slow.",
    )
    quantization: Literal["none", "nf4"] = Field(
        default="none",
        description="Quantization of the frozen base while training (QLoRA). `nf4`: the base's linear weights "
        "loaded as 4-bit NormalFloat through bitsandbytes where the device supports it "
        "(`pipeline.modeling.quantization`), computed in `dtype`; the LoRA weights stay float32 and are saved "
        "unquantized. `none`: the base in `dtype`.",
    )
    specialists: dict[Name, SpecialistModel] = Field(min_length=1, description="One adapter per specialist.")


def load_model_spec(path: str | Path) -> ModelSpec:
    """Load and validate a model spec YAML file (raises ``SpecError`` listing every problem)."""
    return load_spec(path, ModelSpec)


def model_spec_hash(spec: ModelSpec) -> str:
    """The model spec's content address."""
    return content_hash(spec)


def base_hash(spec: ModelSpec) -> str:
    """The built base model's content address: only what builds it (``base``), so a change to a specialist's
    LoRA or training settings reuses the base already built."""
    return content_hash(spec.base)
