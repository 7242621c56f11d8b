"""A model-harness pair at work: load a generation's specialists and answer task items under its harness.

Used by collection (sampling the champion in the task environment) and by held-out evaluation
(greedy answers scored under the contract). Each specialist answers its own items with its own
adapter (or the bare base when it has none yet).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from pipeline.errors import RatchetError
from pipeline.experience.toolcalls import answered_trace
from pipeline.loop.clock import CLOCK
from pipeline.modeling.decoding import load_model
from pipeline.modeling.placement import spec_placement, tokenizer_dir
from pipeline.modeling.prompting import decoding_for, render_messages
from pipeline.modeling.templating import encode_prompt
from pipeline.specs.harness import HarnessSpec
from pipeline.specs.loading import file_sha256
from pipeline.specs.modelspec import ModelSpec

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from pipeline.modeling.placement import Placement
    from pipeline.registry import Generation

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PairSpec:
    """What a generation serves: the base directory, one adapter directory (or None) per specialist, the
    harness; and where it runs (device, dtype: ``pipeline.modeling.placement``) with which tokenizer."""

    base_dir: Path
    adapters: dict[str, Path | None]
    harness: HarnessSpec
    where: Placement | None = None
    tokenizer_dir: Path | None = None


def pair_for_generation(generation: Generation) -> PairSpec:
    """The pair a registry ``Generation`` row describes (adapter files are checked against their sha256)."""

    adapters: dict[str, Path | None] = {}
    for slot in generation.adapters:
        if slot.adapter is None:
            adapters[slot.specialist] = None
            continue
        path = Path(slot.adapter.artifact_uri)
        weights = path / "adapter_model.safetensors"
        if not weights.is_file():
            raise RatchetError(f"adapter {slot.specialist} v{slot.adapter.version}: {weights} is missing")
        if file_sha256(weights) != slot.adapter.sha256:
            raise RatchetError(
                f"adapter {slot.specialist} v{slot.adapter.version}: {weights} does not match the sha256 in the "
                "registry (the file was changed after training)"
            )
        adapters[slot.specialist] = path
    spec = ModelSpec.model_validate(generation.base_model.spec)
    return PairSpec(
        base_dir=Path(generation.base_model.path),
        adapters=adapters,
        harness=HarnessSpec.model_validate(generation.harness_version.spec),
        where=spec_placement(spec.dtype),
        tokenizer_dir=tokenizer_dir(spec.tokenizer, generation.base_model.path),
    )


_MODELS: dict[tuple[str, str | None, str], tuple[Any, Any]] = {}
_MODELS_LOCK = threading.Lock()
SMALL_MODEL_PARAMETERS = 50_000_000  # below this, keep several merged copies in memory


def cached_model(
    base_dir: Path,
    adapter_dir: Path | None,
    *,
    where: Placement | None = None,
    tokenizer_dir: Path | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``(model, tokenizer)`` for a base + adapter, merged for decoding, kept for reuse in this process.

    Keyed by the adapter's weights file identity (path, size, mtime), so a retrained adapter is reloaded,
    and by the placement and tokenizer.
    Small models keep up to 16 merged copies (collection, co-design and evaluation reload the same
    pairs many times); larger ones keep only the most recent.
    """
    ident = None
    if adapter_dir is not None:
        stat = (Path(adapter_dir) / "adapter_model.safetensors").stat()
        ident = f"{Path(adapter_dir).resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    place = f"{where}:{tokenizer_dir}"
    key = (str(Path(base_dir).resolve()), ident, place)
    with _MODELS_LOCK:
        found = _MODELS.pop(key, None)
        if found is None:
            base, tokenizer = _MODELS.get((key[0], None, place)) or _load_base(base_dir, where, tokenizer_dir)
            if adapter_dir is None:
                found = (base, tokenizer)
            else:  # a private copy of the loaded base, with the adapter merged in (no re-reading the base)
                from peft import PeftModel

                model = PeftModel.from_pretrained(copy.deepcopy(base), adapter_dir).merge_and_unload()
                found = (model.eval(), tokenizer)
        _MODELS[key] = found  # most recent last
        size = sum(p.numel() for p in found[0].parameters())
        keep = 16 if size < SMALL_MODEL_PARAMETERS else 1
        while len(_MODELS) > keep:
            _MODELS.pop(next(iter(_MODELS)))
        return found


def _load_base(
    base_dir: Path, where: Placement | None, tokenizer_dir: Path | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:

    base = load_model(base_dir, where=where, tokenizer_dir=tokenizer_dir)
    _MODELS[(str(Path(base_dir).resolve()), None, f"{where}:{tokenizer_dir}")] = base
    return base


def offered_tools(harness: HarnessSpec, specialist: str) -> list[dict[str, Any]]:
    """The harness's tools for ``specialist`` as OpenAI tool dicts (what a chat template and a parser take)."""
    return [t.model_dump(mode="json", exclude_none=True) for t in harness.tools_for(specialist)]


def answer_items(
    pair: PairSpec,
    items_by_specialist: dict[str, list[dict[str, Any]]],
    *,
    num_samples: int = 1,
    temperature: float | None = None,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, list[list[dict[str, Any]]]]:
    """Answer every item with its specialist; returns, per specialist and item, ``num_samples`` traces.

    ``temperature=None`` uses the harness's decoding parameters (greedy for the demo harness).
    """
    from pipeline.modeling.decoding import (  # lazy: looked up per call: tests replace generate
        SamplingConfig,
        generate,
    )

    total = sum(len(v) * num_samples for v in items_by_specialist.values())
    done = 0
    out: dict[str, list[list[dict[str, Any]]]] = {}
    for specialist, items in items_by_specialist.items():
        if not items:
            out[specialist] = []
            continue
        if specialist not in pair.adapters:
            raise RatchetError(f"the pair has no specialist {specialist!r} (has {sorted(pair.adapters)})")
        decoding = decoding_for(pair.harness, specialist)
        temp = decoding.temperature if temperature is None else temperature
        config = SamplingConfig(
            temperature=temp,
            top_p=decoding.top_p if temp > 0 else 1.0,
            num_samples=num_samples if temp > 0 else 1,
            max_new_tokens=decoding.max_new_tokens,
            stop=tuple(decoding.stop),
            seed=seed,
        )
        model, tokenizer = cached_model(
            pair.base_dir, pair.adapters[specialist], where=pair.where, tokenizer_dir=pair.tokenizer_dir
        )
        fmt = pair.harness.tool_call_format
        tools = offered_tools(pair.harness, specialist)
        try:
            prompts = [
                encode_prompt(
                    tokenizer,
                    render_messages(pair.harness, specialist, it["messages"]),
                    fmt=fmt,
                    tools=(it.get("metadata") or {}).get("tools") or tools,
                )
                for it in items
            ]
        except TemplateError as exc:  # the model and the harness do not fit (``probes`` checks at init)
            raise RatchetError(
                f"specialist {specialist!r}: the chat template refuses a task item's prompt: {exc}"
            ) from None
        base_done = done

        share = len(items) * num_samples

        def report(n: int, of: int, base_done: int = base_done, share: int = share) -> None:
            if progress is not None:
                progress(base_done + round(share * n / max(of, 1)), total)

        started = time.perf_counter()
        completions = generate(model, tokenizer, prompts, config, progress=report)
        CLOCK.add("generate", time.perf_counter() - started)
        done += len(items) * num_samples
        out[specialist] = [
            [answered_trace(item, text, fmt=fmt, tools=tools) for text in texts]
            for item, texts in zip(items, completions, strict=True)
        ]
    return out
