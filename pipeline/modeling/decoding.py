"""Batched sampling and greedy decoding over a Hugging Face causal LM (optionally with a LoRA adapter).

A small custom loop instead of ``model.generate``: left-padded batches (prompts of similar length
grouped together), the model's KV cache, ``torch.inference_mode``, temperature / top-p sampling with a
seeded ``torch.Generator``, ``k`` samples per prompt, end-of-sequence and stop strings, and rows that
finished stop being extended (the batch stops when every row is done). It adds what collection needs
on top of ``generate`` (per-sequence stop strings, text out, one seeded generator for reproducible
experience) at the same speed (``bench/decoding.py``: 1.01x on the shared 2-core machine).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.modeling.detokenization import TextStream
from pipeline.modeling.placement import placement

if TYPE_CHECKING:
    from pipeline.modeling.placement import Placement

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingConfig:
    """How to decode: ``temperature == 0`` means greedy (and ``num_samples`` must then be 1)."""

    temperature: float = 0.7
    top_p: float = 1.0
    num_samples: int = 1
    max_new_tokens: int = 32
    stop: tuple[str, ...] = ()
    batch_size: int = 256
    seed: int = 0


GREEDY = SamplingConfig(temperature=0.0, num_samples=1)


def attn_implementation_for(base_model_dir: Path) -> str | None:
    """The attention implementation a model directory asks for (tiny builds record ``eager`` in build.json)."""
    build = Path(base_model_dir) / "build.json"
    return json.loads(build.read_text()).get("attn_implementation") if build.is_file() else None


def load_model(
    base_model_dir: Path,
    adapter_dir: Path | None = None,
    *,
    merge: bool = True,
    where: Placement | None = None,
    tokenizer_dir: Path | None = None,
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` for inference; with ``adapter_dir`` the LoRA is applied (and merged into
    a private copy of the weights when ``merge``, which makes decoding faster). ``where``: device and dtype
    (``pipeline.modeling.placement``; default: ``auto`` for both); ``tokenizer_dir``: default the base's. Offline only."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = where or placement()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or base_model_dir)
    tokenizer.padding_side = "left"
    attn = attn_implementation_for(base_model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        base_model_dir, dtype=where.torch_dtype, **({"attn_implementation": attn} if attn else {})
    ).to(where.device)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
        if merge:
            model = model.merge_and_unload()
    model.eval()
    return model, tokenizer


def generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    config: SamplingConfig = GREEDY,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> list[list[str]]:
    """Decode ``config.num_samples`` completions for each prompt; returns one list per prompt.

    Prompts are token ids, encoded by ``templating.encode_prompt`` (the chat template's scaffolding as
    special tokens, content as its literal text): text is refused, so no prompt is ever tokenized again with
    special-token parsing on. Completions stop at an end token (``end_token_ids``), at the first stop string
    (excluded from the text) or after ``max_new_tokens``. ``progress(done_sequences, total_sequences)``
    after each batch.
    """
    import torch

    if config.temperature == 0 and config.num_samples != 1:
        raise ValueError("greedy decoding (temperature 0) gives one completion per prompt; set num_samples=1")
    if any(isinstance(p, str) for p in prompts):
        raise TypeError("generate() takes prompts as token ids (templating.encode_prompt), not text")
    encoded = [list(p) for p in prompts]
    jobs = [(p, s) for p in range(len(prompts)) for s in range(config.num_samples)]
    jobs.sort(key=lambda j: len(encoded[j[0]]))  # similar lengths share a batch: little left padding
    out: list[list[str]] = [[""] * config.num_samples for _ in prompts]
    gen = torch.Generator().manual_seed(config.seed)
    total = len(jobs)
    with torch.inference_mode():
        for start in range(0, total, config.batch_size):
            chunk = jobs[start : start + config.batch_size]
            texts = _decode_batch(model, tokenizer, [encoded[p] for p, _ in chunk], config, gen)
            for (p, s), text in zip(chunk, texts, strict=True):
                out[p][s] = text
            if progress is not None:
                progress(min(start + config.batch_size, total), total)
    return out


def end_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """Every id that ends a reply: the tokenizer's EOS and each EOS of the model's ``generation_config``
    (chat models list several, e.g. ``<|im_end|>`` beside ``<|endoftext|>``)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if configured is not None:
        ids |= {configured} if isinstance(configured, int) else set(configured)
    return ids


def _decode_batch(
    model: Any, tokenizer: Any, prompts: list[list[int]], config: SamplingConfig, gen: Any
) -> list[str]:
    import torch

    batch, width = len(prompts), max(len(p) for p in prompts)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    device = next(model.parameters()).device
    input_ids, mask, positions = input_ids.to(device), mask.to(device), positions.to(device)
    eos = torch.tensor(sorted(end_token_ids(model, tokenizer)), dtype=torch.long)
    streams = [TextStream(tokenizer) for _ in range(batch)]
    done = torch.zeros(batch, dtype=torch.bool)
    past = None
    cache_kw = cache_keyword(model)
    step_ids, step_pos = input_ids, positions
    for _ in range(config.max_new_tokens):
        result = model(  # logits of the last position only: the prefill skips the vocabulary matmul
            input_ids=step_ids,
            attention_mask=mask,
            position_ids=step_pos,
            use_cache=True,
            logits_to_keep=1,
            **{cache_kw: past},
        )
        past = getattr(result, cache_kw)
        # picked on the CPU (the seeded generator lives there; a no-op copy on a CPU run)
        next_ids = _pick(result.logits[:, -1, :].float().cpu(), config, gen)
        next_ids = torch.where(done, torch.full_like(next_ids, pad_id), next_ids)
        newly_done = torch.isin(next_ids, eos)
        ids_list = next_ids.tolist()
        for i in (~done & ~newly_done).nonzero().flatten().tolist():
            streams[i].push(ids_list[i])
            if config.stop and any(s in streams[i].text for s in config.stop):
                newly_done[i] = True
        done |= newly_done
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones((batch, 1), dtype=torch.long, device=device)], dim=1)
        step_pos = step_pos[:, -1:] + 1
        step_ids = next_ids[:, None].to(device)
    return [_cut(s.final(), config.stop) for s in streams]


def cache_keyword(model: Any) -> str:
    """The KV cache's name as ``model``'s forward takes it and its output carries it: ``cache`` from the
    transformers 5 release that renamed it, ``past_key_values`` before (both are inside our ``>=5.0,<6`` pin:
    5.17 has the old name, 5.25 the new). The one place either decoding loop asks."""
    core = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(core.forward).parameters else "past_key_values"


def _pick(logits: Any, config: SamplingConfig, gen: Any) -> Any:
    import torch

    if config.temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / config.temperature, dim=-1)
    if config.top_p < 1.0:
        sorted_probs, idx = probs.sort(dim=-1, descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < config.top_p
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_probs)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def _cut(text: str, stop: tuple[str, ...]) -> str:
    for s in stop:
        at = text.find(s)
        if at >= 0:
            text = text[:at]
    return text
