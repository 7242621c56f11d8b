"""The tiny base model: a char-level Llama with a real transformers tokenizer, bootstrap-pretrained briefly.

``build_tiny_model`` writes a directory that plain ``AutoModelForCausalLM.from_pretrained(dir)`` and
``AutoTokenizer.from_pretrained(dir)`` load: ``model.safetensors`` + ``config.json``, a
``PreTrainedTokenizerFast`` (``tokenizer.json``, char-level, special tokens ``<s> </s> <pad> <unk>`` and
role markers) with a chat template, and ``build.json`` (config, its hash, corpus hash, final loss).
Pre-training sees only the environment's training split (never held-out items), and stops while the
model still fails often: self-training needs a base that sometimes succeeds, not one that always does.
``ensure_tiny_model`` reuses a cached build with the same config hash.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import string
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline.environment import training_corpus
from pipeline.modeling.packing import packed_tensors
from pipeline.modeling.templating import RowSkipped, encode_chat
from pipeline.specs.loading import content_hash

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
CHARS = string.printable[:-2]  # printable ASCII plus space, \t, \n, \r
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>{{ m['content'] or '' }}{{ eos_token }}"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] or '' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(frozen=True)
class TinyModelConfig:
    """Architecture and bootstrap pre-training of the tiny base model."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 256
    max_position_embeddings: int = 128
    bootstrap_steps: int = 1000  # measured: base held-out ~10-20%, sampling often enough to learn from
    bootstrap_batch_size: int = 64
    bootstrap_lr: float = 3e-3
    corpus_size: int = 20_000
    seed: int = 0

    def hash(self) -> str:
        return content_hash({"kind": "tiny-llama-v1", **asdict(self)})


def build_tokenizer() -> Any:
    """A char-level ``PreTrainedTokenizerFast`` with role markers and a chat template."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARS:
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=SPECIAL_TOKENS[4:],
        padding_side="left",
        model_max_length=4096,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _model_config(config: TinyModelConfig, tokenizer: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        max_position_embeddings=config.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        # Eager attention: for ~40-token sequences it beats sdpa on CPU (sdpa's masked path is slow there).
        attn_implementation="eager",
    )


def build_tiny_model(
    *,
    config: TinyModelConfig,
    corpus_texts: list[dict[str, Any]],
    output_dir: Path,
    seed: int | None = None,
    progress: Callable[[int, int, float], None] | None = None,
) -> Path:
    """Initialise and bootstrap-pretrain the tiny model on ``corpus_texts`` (complete traces, training
    split only; loss on assistant tokens), then save model + tokenizer + ``build.json`` to ``output_dir``.

    ``progress(step, total, loss)`` is called after each optimizer step. Deterministic given the seed
    (``config.seed`` unless ``seed`` is given).
    """
    import torch
    from transformers import LlamaForCausalLM

    seed = config.seed if seed is None else seed
    if any(t.get("metadata", {}).get("split") == "heldout" for t in corpus_texts):
        raise ValueError("bootstrap corpus contains held-out items")
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    model = LlamaForCausalLM(_model_config(config, tokenizer))
    model.train()
    examples = []
    for t in corpus_texts:
        try:
            examples.append(encode_chat(tokenizer, t["messages"], config.max_position_embeddings))
        except RowSkipped as exc:  # longer than the model's positions even cut: never trained half
            log.warning("a bootstrap trace is left out: %s", exc)
    optim = torch.optim.AdamW(
        model.parameters(), lr=config.bootstrap_lr, weight_decay=0.01, betas=(0.9, 0.98)
    )
    warmup = max(1, config.bootstrap_steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: min(1.0, (s + 1) / warmup) * max(0.1, 1 - s / config.bootstrap_steps)
    )
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(examples), generator=gen).tolist()
    at, loss_value, started = 0, float("nan"), time.perf_counter()
    for step in range(config.bootstrap_steps):
        if at + config.bootstrap_batch_size > len(order):
            order, at = torch.randperm(len(examples), generator=gen).tolist(), 0
        batch = [examples[i] for i in order[at : at + config.bootstrap_batch_size]]
        at += config.bootstrap_batch_size
        tensors = packed_tensors(batch, config.max_position_embeddings, tokenizer.pad_token_id)
        loss = model(**tensors, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        sched.step()
        optim.zero_grad(set_to_none=True)
        loss_value = float(loss.detach())
        if progress is not None:
            progress(step + 1, config.bootstrap_steps, loss_value)
        if (step + 1) % 100 == 0:
            log.info("bootstrap step %d/%d loss %.3f", step + 1, config.bootstrap_steps, loss_value)
    elapsed = time.perf_counter() - started
    log.info("tiny model pretrained: %d steps, loss %.3f, %.1fs", config.bootstrap_steps, loss_value, elapsed)

    output_dir = Path(output_dir)
    tmp = output_dir.with_name(output_dir.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.eval()
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    build = {
        "config": asdict(config),
        "config_hash": config.hash(),
        "seed": seed,
        "corpus_sha256": content_hash([t["messages"] for t in corpus_texts]),
        "corpus_size": len(corpus_texts),
        "final_loss": loss_value,
        "pretrain_seconds": round(elapsed, 2),
        "parameters": sum(p.numel() for p in model.parameters()),
        "attn_implementation": "eager",
    }
    (tmp / "build.json").write_text(json.dumps(build, indent=2) + "\n")
    if output_dir.exists():
        shutil.rmtree(output_dir)
    os.replace(tmp, output_dir)
    return output_dir


def tiny_model_built(model_dir: Path, config: TinyModelConfig) -> bool:
    """Whether ``model_dir`` holds a finished build of exactly ``config`` (its ``build.json`` says so)."""
    build_file = Path(model_dir) / "build.json"
    if not build_file.is_file() or not (Path(model_dir) / "model.safetensors").is_file():
        return False
    try:
        return json.loads(build_file.read_text()).get("config_hash") == config.hash()
    except json.JSONDecodeError:
        log.warning("ignoring unreadable %s; rebuilding", build_file)
        return False


def ensure_tiny_model(
    *,
    config: TinyModelConfig,
    cache_dir: Path,
    corpus_texts: Callable[[], list[dict[str, Any]]] | list[dict[str, Any]] | None = None,
    progress: Callable[[int, int, float], None] | None = None,
) -> Path:
    """Return ``cache_dir/tiny-<hash12>``, building it first unless a build with the same config exists.

    ``corpus_texts`` (a list or a zero-argument callable, called only when building) defaults to the
    environment's ``training_corpus(config.corpus_size, config.seed)``.
    """
    target = Path(cache_dir) / f"tiny-{config.hash()[:12]}"
    if tiny_model_built(target, config):
        return target
    if corpus_texts is None:
        corpus = training_corpus(config.corpus_size, config.seed)
    else:
        corpus = corpus_texts() if callable(corpus_texts) else corpus_texts
    target.parent.mkdir(parents=True, exist_ok=True)
    return build_tiny_model(config=config, corpus_texts=corpus, output_dir=target, progress=progress)
