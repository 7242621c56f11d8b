"""Batched sampling and greedy decoding over a Hugging Face causal LM (optionally with a LoRA adapter).

A small custom loop instead of ``model.generate``: left-padded batches (prompts of similar length
grouped together), the model's KV cache (preallocated ``StaticCache`` on CUDA), ``torch.inference_mode``,
temperature / top-p sampling with a seeded ``torch.Generator`` on the model's device, ``k`` samples per
prompt, end-of-sequence and stop strings; rows that finished leave the batch (their KV-cache rows too),
and only the chosen ids and their log-probs cross to the host each step. ``sample`` returns completions
with their ids and log-probs, ``generate`` their texts. It adds what collection needs on top of
``model.generate`` (per-sequence stop strings, text out, one seeded generator for reproducible
experience) and is faster (``bench/decoding.py``, 800 sequences: 1.18-1.83x on the shared 2-core machine,
1.0x before rows left the batch).
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
    """How to decode: ``temperature == 0`` means greedy (and ``num_samples`` must then be 1). ``kv_cache``:
    ``auto`` (static on CUDA, dynamic elsewhere), ``static`` (preallocated) or ``dynamic`` (``kv_cache``)."""

    temperature: float = 0.7
    top_p: float = 1.0
    num_samples: int = 1
    max_new_tokens: int = 32
    stop: tuple[str, ...] = ()
    batch_size: int = 256
    seed: int = 0
    kv_cache: str = "auto"


GREEDY = SamplingConfig(temperature=0.0, num_samples=1)


@dataclass(frozen=True)
class Sample:
    """One completion: its text (stop string cut), the ids decoded (the end token it stopped on included)
    and each id's log-probability under the sampling distribution's model (the raw log-softmax)."""

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()


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


def sample(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    config: SamplingConfig = GREEDY,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> list[list[Sample]]:
    """Decode ``config.num_samples`` completions for each prompt, with their ids and log-probabilities;
    returns one list per prompt.

    Prompts are token ids, encoded by ``templating.encode_prompt`` (the chat template's scaffolding as
    special tokens, content as its literal text): text is refused, so no prompt is ever tokenized again with
    special-token parsing on. Completions stop at an end token (``end_token_ids``; kept in ``token_ids``), at
    the first stop string (excluded from the text; the ids keep the token that completed it) or after
    ``max_new_tokens``. ``progress(done_sequences, total_sequences)`` after each batch.

    Everything per token stays on the model's device (the seeded generator too: on a CPU run it is the CPU
    generator, so a seed gives the same completions as before); only the chosen ids and their log-probs
    cross to the host, and rows that finished leave the batch (``_decode_batch``).
    """
    import torch

    if config.temperature == 0 and config.num_samples != 1:
        raise ValueError("greedy decoding (temperature 0) gives one completion per prompt; set num_samples=1")
    if any(isinstance(p, str) for p in prompts):
        raise TypeError("generate() takes prompts as token ids (templating.encode_prompt), not text")
    encoded = [list(p) for p in prompts]
    jobs = [(p, s) for p in range(len(prompts)) for s in range(config.num_samples)]
    jobs.sort(key=lambda j: len(encoded[j[0]]))  # similar lengths share a batch: little left padding
    out: list[list[Sample]] = [[Sample("")] * config.num_samples for _ in prompts]
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(config.seed)
    total = len(jobs)
    with torch.inference_mode():
        for start in range(0, total, config.batch_size):
            chunk = jobs[start : start + config.batch_size]
            samples = _decode_batch(model, tokenizer, [encoded[p] for p, _ in chunk], config, gen)
            for (p, s), one in zip(chunk, samples, strict=True):
                out[p][s] = one
            if progress is not None:
                progress(min(start + config.batch_size, total), total)
    return out


def generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    config: SamplingConfig = GREEDY,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> list[list[str]]:
    """The texts of ``sample``: ``config.num_samples`` completions for each prompt, one list per prompt."""
    return [[s.text for s in row] for row in sample(model, tokenizer, prompts, config, progress=progress)]


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
) -> list[Sample]:
    """One left-padded batch. ``rows`` holds the batch positions (into ``prompts``) of the rows still in the
    model's batch; finished rows are dropped from it (ids, mask, positions and the KV cache's rows) once they
    are at least ``1/COMPACT_EVERY`` of it, so each drop's copy of the cache pays for itself."""
    import torch

    batch, width = len(prompts), max(len(p) for p in prompts)
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    input_ids, mask, positions = input_ids.to(device), mask.to(device), positions.to(device)
    eos = end_token_ids(model, tokenizer)
    streams = [TextStream(tokenizer) for _ in range(batch)]
    ids: list[list[int]] = [[] for _ in range(batch)]
    logprobs: list[list[float]] = [[] for _ in range(batch)]
    rows = list(range(batch))  # batch position of each row of the model's batch
    live = [True] * batch  # per row of the model's batch: still decoding
    cache_kw = cache_keyword(model)
    past = kv_cache(model, config, length=width + config.max_new_tokens)
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
        logits = result.logits[:, -1, :].float()
        picked = _pick(logits, config, gen, rows, batch)
        chosen = torch.log_softmax(logits, dim=-1).gather(-1, picked[:, None]).squeeze(-1)
        picked_list, chosen_list = picked.tolist(), chosen.tolist()  # the only per-token copy to the host
        for j, i in enumerate(rows):
            if not live[j]:
                continue
            ids[i].append(picked_list[j])
            logprobs[i].append(chosen_list[j])
            if picked_list[j] in eos:
                live[j] = False
                continue
            streams[i].push(picked_list[j])
            if config.stop and any(s in streams[i].text for s in config.stop):
                live[j] = False
        if not any(live):
            break
        step_ids = (
            picked[:, None]
            if all(live)
            else torch.where(torch.tensor(live, device=device), picked, pad_id)[:, None]
        )
        step_pos = step_pos[:, -1:] + 1
        finished = live.count(False)
        if finished * COMPACT_EVERY >= len(rows):
            keep = [j for j, on in enumerate(live) if on]
            index = torch.tensor(keep, device=device)
            select_rows(past, index)
            rows, live = [rows[j] for j in keep], [True] * len(keep)
            step_ids, step_pos, mask = step_ids[index], step_pos[index], mask[index]
        mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)
    return [
        Sample(_cut(s.final(), config.stop), tuple(t), tuple(lp))
        for s, t, lp in zip(streams, ids, logprobs, strict=True)
    ]


COMPACT_EVERY = 8
"""Finished rows leave the batch once they are at least 1/8 of it: each drop copies the KV cache, which at an
8B model's batch of 256 is about as large as the weights (one decode step's memory traffic); dropping at
every finish would add up to one step per row (an estimate, not measured on a GPU)."""


def cache_keyword(model: Any) -> str:
    """The KV cache's name as ``model``'s forward takes it and its output carries it: ``cache`` from the
    transformers 5 release that renamed it, ``past_key_values`` before (both are inside our ``>=5.0,<6`` pin:
    5.17 has the old name, 5.25 the new). The one place either decoding loop asks."""
    core = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(core.forward).parameters else "past_key_values"


def kv_cache(model: Any, config: SamplingConfig, *, length: int) -> Any:
    """The KV cache a batch starts with: ``None`` (the model makes a ``DynamicCache``, which grows by
    concatenation: a copy of the whole cache every step) or a ``StaticCache`` preallocated for ``length``
    positions and written in place. ``config.kv_cache == "auto"``: static on a CUDA device, dynamic elsewhere
    -- on the CPU the static cache attends over all ``length`` positions from the first step and measured
    3-12% slower (``bench/decoding.py``'s load, tiny model, 800 sequences); on a GPU it was not measured. Static only for models
    that declare it (``_can_compile_fullgraph``, transformers' own test for a static cache); others dynamic."""
    kind = config.kv_cache
    if kind not in ("auto", "static", "dynamic"):
        raise ValueError(f"kv_cache must be auto, static or dynamic, not {kind!r}")
    core = model.get_base_model() if hasattr(model, "get_base_model") else model
    if kind == "auto":
        kind = "static" if next(model.parameters()).device.type == "cuda" else "dynamic"
    if kind == "dynamic" or not getattr(core, "_can_compile_fullgraph", False):
        return None
    from transformers import StaticCache

    return StaticCache(config=core.config, max_cache_len=length)


def select_rows(cache: Any, index: Any) -> None:
    """Keep only the batch rows ``index`` of ``cache``, in place (dynamic and static layers alike:
    ``reorder_cache`` index-selects every layer's keys and values along the batch dimension)."""
    cache.reorder_cache(index)


def _pick(logits: Any, config: SamplingConfig, gen: Any, rows: list[int], batch: int) -> Any:
    """The next id of each row of ``logits`` (float32, one row per entry of ``rows``), on their device.

    Sampling is ``torch.multinomial``'s own single-draw algorithm, ``argmax(probs / q)`` with ``q ~ Exp(1)``,
    with ``q`` drawn for all ``batch`` rows of the batch and the rows still in it taken: the generator
    advances as it did when every row stayed in the batch, so a seed gives the same completions."""
    import torch

    if config.temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / config.temperature, dim=-1)
    if config.top_p < 1.0:
        sorted_probs, idx = probs.sort(dim=-1, descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < config.top_p
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_probs)
    noise = torch.empty((batch, probs.shape[-1]), dtype=probs.dtype, device=probs.device)
    noise.exponential_(1, generator=gen)
    if len(rows) < batch:
        noise = noise[torch.tensor(rows, device=probs.device)]
    return (probs / noise).argmax(dim=-1)


def _cut(text: str, stop: tuple[str, ...]) -> str:
    for s in stop:
        at = text.find(s)
        if at >= 0:
            text = text[:at]
    return text
