"""A model-harness pair at work: load a generation's specialists and answer task items under its harness.

Used by collection (sampling the champion in the task environment), discovery and held-out evaluation
(greedy answers scored under the contract). Each specialist answers its own items with its own
adapter (or the bare base when it has none yet): in this process on one shared copy of the base holding
every adapter by name (``PairModel``), or on an OpenAI-compatible engine (``RATCHET_ROLLOUT_ENGINE=openai``,
``pipeline.modeling.samplers``). The divergence gate (``gates.divergence``) switches the same copy between
the candidate's, the parent's and no adapter.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from pipeline.errors import RatchetError
from pipeline.experience.toolcalls import answered_trace
from pipeline.loop.clock import CLOCK
from pipeline.modeling.decoding import SamplingConfig, load_model
from pipeline.modeling.placement import spec_placement, tokenizer_dir
from pipeline.modeling.prompting import decoding_for, render_messages
from pipeline.modeling.samplers import OpenAISampler, sampler_for
from pipeline.modeling.templating import encode_prompt
from pipeline.settings import get_settings
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


_PAIRS_LOCK = threading.Lock()
SMALL_MODEL_PARAMETERS = 50_000_000  # below this, two bases may be kept in memory at once


class PairModel:
    """One copy of a base holding every adapter it was asked for as a named peft adapter (unmerged).

    ``use(adapter_dir)`` makes the model that adapter (``set_adapter``) or the bare base (adapters disabled)
    for the duration of a ``with``: collection, discovery and evaluation answer every specialist of a pair,
    and both pairs of an evaluation, on this one copy -- the peak is one base, where merging a deep copy per
    specialist held up to three. Adapters are keyed by their weights file's identity (path, size, mtime: a
    retrained adapter is loaded again); beyond ``MAX_ADAPTERS`` the least recently used is deleted.
    """

    def __init__(self, base: PreTrainedModel, tokenizer: PreTrainedTokenizerBase):
        self.model: Any = base  # a PeftModel once the first adapter is loaded
        self.tokenizer = tokenizer
        self.names: dict[str, str] = {}  # adapter identity -> peft adapter name, least recently used first
        self._count = 0
        self.lock = threading.RLock()

    @contextlib.contextmanager
    def use(self, adapter_dir: Path | None) -> Iterator[Any]:
        """The model answering as base + ``adapter_dir`` (``None``: the bare base) inside the ``with``."""
        with self.lock:
            if adapter_dir is None:
                if not self.names:
                    yield self.model
                else:
                    with self.model.disable_adapter():
                        yield self.model
                return
            name = self._attach(Path(adapter_dir))  # may wrap the base: then ``self.model`` is new
            self.model.set_adapter(name)
            yield self.model

    def _attach(self, adapter_dir: Path) -> str:
        from peft import PeftModel

        ident = _identity(adapter_dir)
        name = self.names.pop(ident, None)
        if name is None:
            self._count += 1
            name = f"adapter{self._count}"  # peft nests modules by adapter name: no dots, no paths
            if isinstance(self.model, PeftModel):
                self.model.load_adapter(adapter_dir, adapter_name=name)
            else:
                self.model = PeftModel.from_pretrained(self.model, adapter_dir, adapter_name=name)
            self.model.eval()
        self.names[ident] = name  # most recent last
        while len(self.names) > MAX_ADAPTERS:
            old = self.names.pop(next(iter(self.names)))
            self.model.set_adapter(name)
            self.model.delete_adapter(old)
        return name


MAX_ADAPTERS = 16  # LoRA weights kept on the shared base (two pairs of up to 8 specialists)
_PAIRS: dict[tuple[str, str], PairModel] = {}


def _identity(adapter_dir: Path) -> str:
    stat = (Path(adapter_dir) / "adapter_model.safetensors").stat()
    return f"{Path(adapter_dir).resolve()}:{stat.st_size}:{stat.st_mtime_ns}"


def pair_model(pair: PairSpec) -> PairModel:
    """The process's shared model for ``pair``'s base, placement and tokenizer (loaded once; a large base
    replaces the last one, so one large base is held)."""
    key = (str(Path(pair.base_dir).resolve()), f"{pair.where}:{pair.tokenizer_dir}")
    with _PAIRS_LOCK:
        found = _PAIRS.pop(key, None)
        if found is None:
            model, tokenizer = load_model(pair.base_dir, where=pair.where, tokenizer_dir=pair.tokenizer_dir)
            found = PairModel(model, tokenizer)
            if sum(p.numel() for p in model.parameters()) >= SMALL_MODEL_PARAMETERS:
                _PAIRS.clear()
        _PAIRS[key] = found  # most recent last
        while len(_PAIRS) > 2:
            _PAIRS.pop(next(iter(_PAIRS)))
        return found


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

    ``temperature=None`` uses the harness's decoding parameters (greedy for the demo harness). Sampled where
    ``RATCHET_ROLLOUT_ENGINE`` says (``pipeline.modeling.samplers``): ``embedded``, in this process on the
    pair's one shared model (``pair_model``); ``openai``, on the engine, each adapter loaded by its versioned
    name and parity-probed against that shared model first (once per process).
    """
    settings = get_settings()
    total = sum(len(v) * num_samples for v in items_by_specialist.values())
    done = 0
    out: dict[str, list[list[dict[str, Any]]]] = {}
    shared: PairModel | None = None
    for specialist, items in items_by_specialist.items():
        if not items:
            out[specialist] = []
            continue
        if specialist not in pair.adapters:
            raise RatchetError(f"the pair has no specialist {specialist!r} (has {sorted(pair.adapters)})")
        shared = shared or pair_model(pair)
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
        tokenizer = shared.tokenizer
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

        adapter_dir = pair.adapters[specialist]
        with shared.use(adapter_dir) as model:
            sampler = sampler_for(settings, tokenizer=tokenizer, model=model, progress=report)
            served = None
            if isinstance(sampler, OpenAISampler):
                served = sampler.ready(  # a few of these prompts probed too: the probe is not recognisable
                    adapter_dir,
                    name=specialist,
                    model=model,
                    tolerance=settings.parity_tolerance,
                    prompts=prompts,
                )
            started = time.perf_counter()
            completions = sampler.sample(prompts, config, adapter=served)
            CLOCK.add("generate", time.perf_counter() - started)
        if served is not None:  # the engine reports no progress of its own
            report(1, 1)
        done += len(items) * num_samples
        out[specialist] = [
            [answered_trace(item, s.text, fmt=fmt, tools=tools) for s in samples]
            for item, samples in zip(items, completions, strict=True)
        ]
    return out
