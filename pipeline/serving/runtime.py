"""The embedded Mixture-of-LoRA runtime: one frozen base, every specialist adapter attached by name,
and batched generation where each row uses its own adapter (peft's per-sample ``adapter_names``).

``load_runtime`` checks every adapter before it touches the model (``pipeline.serving.adapters``: the file's
sha256 against the registry, safetensors only, the base model, rank and target modules, and, once loaded,
that every weight landed on a module). With ``max_loaded`` only that many stay attached: the others are
attached again on demand (least recently used evicted), and a batch never mixes more than fit.

``MixtureRuntime.generate`` decodes a list of ``GenerationRequest`` rows in one batch (left padding,
KV cache, per-row temperature / top-p / seed / stop strings / length, finished rows dropped from the
batch; a row may carry a grammar and ask for logprobs, see ``decoder``), calling ``on_text(row, delta)`` as
text becomes final, for streaming. A row whose ``Abort`` is set
(a timeout, a client that left) leaves the batch at the next step with what it produced so far. Greedy
rows give the same output in a mixed batch as alone (tested).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.errors import RatchetError
from pipeline.modeling.decoding import end_token_ids
from pipeline.modeling.grammar import GrammarSpec, check_grammar
from pipeline.modeling.placement import placement
from pipeline.modeling.templating import encode_prompt, encode_text
from pipeline.serving import mixlora
from pipeline.serving.adapters import (
    CONFIG,
    PICKLES,
    WEIGHTS,
    AdapterPool,
    AdapterSource,
    check_adapter_files,
    tree_sha256,
)
from pipeline.serving.decoder import Abort, GenerationRequest, GenerationResult, decode_batch  # noqa: F401 - Abort re-exported

if TYPE_CHECKING:
    from pipeline.modeling.placement import Placement

log = logging.getLogger(__name__)

BASE = "__base__"
UNKNOWN = "unknown_adapter"  # the finish reason of a row whose adapter was unloaded while it waited
__all__ = ["CONFIG", "PICKLES", "WEIGHTS", "AdapterSource", "check_adapter_files", "tree_sha256"]


def load_runtime(
    base_path: str | Path,
    adapters: Sequence[AdapterSource],
    *,
    specialists: Sequence[str] | None = None,
    base_model_id: int | None = None,
    device: str = "auto",
    where: Placement | None = None,
    tokenizer_dir: str | Path | None = None,
    tool_call_format: str = "openai",
    mix: str = "segments",
    max_rank: int | None = None,
    max_loaded: int | None = None,
) -> MixtureRuntime:
    """Load the base once, check and attach every adapter by specialist name (see ``check_adapter_files``).

    ``specialists`` lists every specialist served; one without an adapter is served by the base model.
    ``mix``: ``segments`` (``pipeline.serving.mixlora``: batched per-row LoRA, the default where supported)
    or ``peft`` (peft's per-sample ``adapter_names``) for mixed-adapter batches. ``where``: device and dtype
    (``pipeline.modeling.placement``; default: ``device`` with the dtype ``auto``); ``tool_call_format``: how prompts show tool calls.
    ``max_rank``: adapters of a higher rank are refused; ``max_loaded``: how many stay attached (None: all).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_path = Path(base_path)
    if not (base_path / "config.json").is_file():
        raise RatchetError(f"base model directory {base_path} has no config.json")
    if not any(base_path.glob("*.safetensors")):
        raise RatchetError(
            f"base model directory {base_path} has no safetensors weights (pickles are refused)"
        )

    where = where or placement(device=device)
    device = where.device
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or base_path)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=where.torch_dtype, use_safetensors=True)
    pool = AdapterPool(model, capacity=max_loaded, base_model_id=base_model_id, max_rank=max_rank)
    for src in adapters:
        pool.add(src)
    model = pool.model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    served = list(specialists) if specialists is not None else [a.specialist for a in adapters]
    runtime = MixtureRuntime(
        model, tokenizer, served, {a.specialist for a in adapters}, device, mix=mix, pool=pool
    )
    runtime.tool_call_format = tool_call_format
    return runtime


class MixtureRuntime:
    """A loaded generation: the base with its adapters, the tokenizer, and batched decoding."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        specialists: Sequence[str],
        adapters: set[str],
        device: str,
        mix: str = "segments",
        pool: AdapterPool | None = None,
    ):
        import threading

        self.lock = threading.Lock()  # one forward pass at a time: the per-row adapter state is shared
        self.model = model
        self.tokenizer = tokenizer
        self.specialists = list(specialists)
        self.adapters = set(adapters)
        self.device = device
        self.pool = pool if pool is not None else AdapterPool(model)
        cfg = getattr(model, "config", None)
        self.context_limit = int(getattr(cfg, "max_position_embeddings", 0) or tokenizer.model_max_length)
        self.vocab_size = int(getattr(cfg, "vocab_size", 0) or len(tokenizer))  # the logits' width
        special = set(tokenizer.all_special_ids)
        self.end_ids = (special - ({tokenizer.unk_token_id} - {None})) | end_token_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.mix = "segments" if mix == "segments" and mixlora.supported(model) else "peft"
        self.segmented = None
        self.lora_mode: str | None = None  # mixlora's mode after every (re)install; None: its own choice
        self._calibration: dict = {}  # mixlora's layer grouping, kept across re-installs
        self._install()
        self.tool_call_format = "openai"  # how prompts show tool calls (the served harness's format)

    @property
    def max_adapters_per_batch(self) -> int | None:
        """How many distinct adapters one batch may use (the adapter budget; None: any number)."""
        return self.pool.capacity

    def _install(self) -> None:
        """Take over the attached adapters' LoRA layers (``mixlora``) for mixed batches, again after the
        attached set changed."""

        self.model = self.pool.model
        if self.segmented is not None:
            self.segmented.set_rows([])  # the calibration forward runs through the old layers
        names = [
            self.pool.peft_name(n) for n in self.adapters if n not in self.pool or n in self.pool.attached
        ]
        if self.mix == "segments" and names and mixlora.supported(self.model):
            # with an adapter budget the LoRA stays separate: a merged copy of the base per adapter would
            # defeat the budget, and re-merging on every swap costs more than the batch (measured)
            budget = self.pool.capacity is not None
            self.segmented = mixlora.install(
                self.model,
                sorted(names),
                calibration=self._calibration,
                **({"merge_budget_bytes": 0} if budget else {}),
            )
            if self.lora_mode is not None:
                self.segmented.mode = self.lora_mode
        elif self.mix == "segments" and names:
            self.mix, self.segmented = "peft", None  # an adapter kind mixlora does not take over
            for module in self.model.modules():  # give the layers back their own forward
                module.__dict__.pop("forward", None)

    def _ensure(self, rows: list[str]) -> None:
        """Attach the rows' adapters (``AdapterPool.ensure``); re-take the layers when the set changed,
        also when attaching failed half-way."""
        import time

        before, started = set(self.pool.attached), time.perf_counter()
        try:
            self.pool.ensure(rows)
        finally:
            if set(self.pool.attached) != before:
                self._install()
                took, stats = time.perf_counter() - started, self.pool.stats
                stats.swaps += 1
                stats.swap_seconds += took
                stats.max_swap_seconds = max(stats.max_swap_seconds, took)

    def add_adapter(self, src: AdapterSource, *, name: str) -> None:
        """Check ``src`` and serve it as ``name`` from now on (``POST /v1/load_lora_adapter``)."""
        if name in self.specialists or name == BASE:
            raise RatchetError(f"an adapter named {name!r} is already loaded")
        checked = self.pool.check(src)  # hashing the files does not hold up decoding
        with self.lock:
            self.pool.add(src, name=name, checked=checked)
            self.adapters.add(name)
            self.specialists.append(name)
            self._install()

    def remove_adapter(self, name: str) -> None:
        """Stop serving ``name`` and free its weights (``POST /v1/unload_lora_adapter``)."""
        with self.lock:
            self.specialists.remove(name)
            self.adapters.discard(name)
            if name in self.pool:
                self.pool.remove(name)
            self._install()

    def adapter_name(self, specialist: str) -> str:
        """The peft adapter serving ``specialist`` (``__base__`` for a specialist with no adapter yet)."""
        return specialist if specialist in self.adapters else BASE

    def encode(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Prompt token ids for a conversation: ``templating.encode_prompt``, the ids training gives the same
        context (tool calls in the harness's format, the offered tools' schemas given to the template; what
        the client sent is inert text, only the template's scaffolding is special tokens). A template that
        refuses the conversation raises ``jinja2.TemplateError``."""

        return encode_prompt(self.tokenizer, messages, fmt=self.tool_call_format, tools=tools)

    def count_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
        return len(self.encode(messages, tools))

    def check_grammar(self, spec: GrammarSpec) -> None:
        """Compile ``spec`` for this tokenizer now (cached for the decoding), or raise ``GrammarError``."""
        check_grammar(self.tokenizer, spec, vocab_size=self.vocab_size)

    def generate(
        self, requests: Sequence[GenerationRequest], on_text: Callable[[int, str], None] | None = None
    ) -> list[GenerationResult]:
        """Decode every request in one mixed-adapter batch; ``on_text(i, delta)`` streams row ``i``'s text.

        Rows are decoded grouped by adapter (contiguous segments) and returned in the caller's order. Rows
        using more distinct adapters than may be attached at once are decoded in consecutive batches.
        """
        import torch

        out: list[GenerationResult | None] = [None] * len(requests)
        live = []
        for i, r in enumerate(requests):
            gone = r.adapter != BASE and r.adapter not in self.specialists
            why = UNKNOWN if gone else r.aborted()
            if why is not None:  # never decoded: no work is spent on it
                out[i] = GenerationResult("", len(r.prompt_ids), 0, why)
            else:
                live.append(i)
        live.sort(key=lambda i: self.adapter_name(requests[i].adapter))
        with self.lock, torch.inference_mode():
            for rows in self._batches(live, requests):
                report = None if on_text is None else (lambda row, d, rows=rows: on_text(rows[row], d))
                self._ensure([self.adapter_name(requests[i].adapter) for i in rows])
                for i, result in zip(
                    rows, decode_batch(self, [requests[i] for i in rows], report), strict=True
                ):
                    out[i] = result
        return out  # type: ignore[return-value]

    def _batches(self, rows: list[int], requests: Sequence[GenerationRequest]) -> list[list[int]]:
        """``rows`` (sorted by adapter) cut so that no batch uses more adapters than may be attached."""
        cap = self.max_adapters_per_batch
        batches: list[list[int]] = [[]]
        seen: set[str] = set()
        for i in rows:
            name = self.adapter_name(requests[i].adapter)
            managed = name in self.pool
            if cap is not None and managed and name not in seen and len(seen) >= cap:
                batches.append([])
                seen = set()
            if managed:
                seen.add(name)
            batches[-1].append(i)
        return [b for b in batches if b]

    def label_scores(
        self, messages: list[dict[str, Any]], labels: Sequence[str], adapter: str
    ) -> dict[str, float]:
        """Constrained label decoding: P(label | conversation) under ``adapter``, over ``labels`` only."""
        import torch

        prompt = self.encode(messages)
        rows = [prompt + encode_text(self.tokenizer, lab) for lab in labels]
        if self.tokenizer.eos_token_id is not None:
            rows = [r + [self.tokenizer.eos_token_id] for r in rows]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, width - len(r) :] = torch.tensor(r)
            mask[i, width - len(r) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with self.lock, torch.inference_mode():
            self._ensure([self.adapter_name(adapter)])
            out = self.model(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=pos.to(self.device),
                **self._adapter_kwargs([self.adapter_name(adapter)] * len(rows)),
            )
            logp = torch.log_softmax(out.logits.float(), dim=-1)
        totals = []
        for i, r in enumerate(rows):
            n = len(r) - len(prompt)
            targets = torch.tensor(r[len(prompt) :], device=logp.device)
            steps = logp[i, width - n - 1 : width - 1].gather(-1, targets[:, None])
            totals.append(float(steps.sum()))
        probs = torch.softmax(torch.tensor(totals), dim=0).tolist()
        return dict(zip(labels, probs, strict=True))

    def _adapter_kwargs(self, names: list[str]) -> dict[str, Any]:
        """Per-row adapters for the next forward call (rows must be grouped by adapter for ``segments``)."""
        from peft import PeftModel

        names = [self.pool.peft_name(n) for n in names]
        if self.segmented is not None:
            self.segmented.set_rows(names)
            return {}
        return {"adapter_names": names} if isinstance(self.model, PeftModel) else {}
