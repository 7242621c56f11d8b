"""A base model with real proportions for the benchmarks, built locally (nothing is downloaded).

``ensure_real_model(cache_dir)`` returns ``cache_dir/real-qwen3-<hash12>``, building it on first use:

- a random-weight ``Qwen3ForCausalLM`` whose layers are Qwen3-0.6B's (hidden 1024, MLP 3072, 16 query
  heads and 8 KV heads of 128, RMSNorm 1e-6, RoPE theta 1e6, SiLU, tied embeddings, 40,960 positions)
  with fewer of them (``LAYERS``) so a benchmark run on a 2-core CPU takes minutes;
- a byte-level BPE tokenizer with a 32,768-token vocabulary, trained here with ``tokenizers`` on the
  Python standard library's sources (local text), Qwen's special tokens and a ChatML chat template
  (EOS ``<|im_end|>``, pad ``<|endoftext|>``).

``traces(cache_dir, n, seed, held_out)`` makes chat traces with a realistic length spread from the same
text: a user turn asking to continue a piece of a source file and the assistant turn continuing it,
30-400 tokens in all (log-uniform), from disjoint sets of files for training and evaluation.

Throughput does not depend on the weights, and the LoRA loss comparison only needs both sides to start
from the same weights. Shared by ``bench/serve.py`` and ``bench/train.py`` (``--model real``).
"""

from __future__ import annotations

import json
import math
import random
import sys
import sysconfig
from pathlib import Path
from typing import Any

LAYERS = 2  # Qwen3-0.6B has 28; two keep each benchmark within a few minutes on 2 cores
VOCAB = 32_768
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# Qwen3-0.6B's config.json, but the number of layers and the vocabulary size.
QWEN3_06B = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
}
MIN_TOKENS, MAX_TOKENS = 30, 400


def corpus_files() -> list[Path]:
    """The standard library's Python sources (no test suites), sorted: the same text on every run."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        p for p in root.rglob("*.py") if not {"test", "tests", "site-packages", "idle_test"} & set(p.parts)
    )


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def spec(layers: int = LAYERS) -> dict[str, Any]:
    files = corpus_files()
    return {
        "kind": "bench-real-qwen3-v1",
        "config": {**QWEN3_06B, "num_hidden_layers": layers, "vocab_size": VOCAB},
        "tokenizer": {"model": "bytelevel-bpe", "vocab": VOCAB, "special": SPECIAL, "template": CHATML},
        "corpus": {"python": sys.version.split()[0], "files": len(files)},
    }


def ensure_real_model(cache_dir: Path, layers: int = LAYERS) -> Path:
    """The cached build for ``spec(layers)`` (built first when missing; ``build.json`` marks it done)."""
    import hashlib

    wanted = spec(layers)
    digest = hashlib.sha256(json.dumps(wanted, sort_keys=True).encode()).hexdigest()[:12]
    target = Path(cache_dir) / f"real-qwen3-{digest}"
    marker = target / "build.json"
    if marker.is_file() and json.loads(marker.read_text()) == wanted:
        return target
    import shutil
    import tempfile

    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".build-"))
    tok = _train_tokenizer([t for t in map(_read, corpus_files()) if t])
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(0)
    cfg = Qwen3Config(
        **wanted["config"], eos_token_id=eos, pad_token_id=pad, bos_token_id=None, dtype="float32"
    )
    model = Qwen3ForCausalLM(cfg)
    model.generation_config = GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    (tmp / "build.json").write_text(json.dumps(wanted, sort_keys=True))
    tmp.chmod(0o755)  # mkdtemp's 0700 otherwise
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def _train_tokenizer(texts: list[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        model_max_length=QWEN3_06B["max_position_embeddings"],
    )
    tok.chat_template = CHATML
    return tok


def traces(tokenizer: Any, n: int, *, seed: int, held_out: bool = False) -> list[dict[str, Any]]:
    """``n`` two-turn traces of 30-400 tokens (log-uniform) cut from the standard library's sources.

    Every tenth file is held out (``held_out=True`` draws only from those, otherwise never): evaluation
    text is never trained on. The prompt is 30-70% of the piece; the assistant continues it.
    """
    files = [p for i, p in enumerate(corpus_files()) if (i % 10 == 0) == held_out]
    rng = random.Random(seed)
    backend = tokenizer.backend_tokenizer
    overhead = 12  # ChatML markers, roles and the instruction
    cache: dict[Path, tuple[str, list[tuple[int, int]]] | None] = {}
    out: list[dict[str, Any]] = []
    while len(out) < n:
        path = rng.choice(files)
        if path not in cache:
            text = _read(path)
            cache[path] = (text, backend.encode(text).offsets) if text else None
        if cache[path] is None:
            continue
        text, offsets = cache[path]
        total = round(math.exp(rng.uniform(math.log(MIN_TOKENS), math.log(MAX_TOKENS)))) - overhead
        if len(offsets) < total + 1:
            continue
        start = rng.randrange(len(offsets) - total)
        cut = start + max(1, round(total * rng.uniform(0.3, 0.7)))
        end = start + total
        prompt = text[offsets[start][0] : offsets[cut][0]]
        reply = text[offsets[cut][0] : offsets[end - 1][1]]
        if not prompt.strip() or not reply.strip():
            continue
        out.append(
            {
                "messages": [
                    {"role": "user", "content": f"Continue this code:\n{prompt}"},
                    {"role": "assistant", "content": reply},
                ]
            }
        )
    return out
