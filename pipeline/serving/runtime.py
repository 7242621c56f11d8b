"""The embedded Mixture-of-LoRA runtime: one frozen base, every specialist adapter attached by name,
and batched generation where each row uses its own adapter (peft's per-sample ``adapter_names``).

``load_runtime`` checks every adapter before it touches the model: the file's sha256 against the
registry, safetensors only (a pickle is never loaded), the base model, rank and target modules, and,
once loaded, that every weight landed on a module. Any mismatch is a ``RatchetError`` naming the
adapter, never a silent fall-back to the base model.

``MixtureRuntime.generate`` decodes a list of ``GenerationRequest`` rows in one batch (left padding,
KV cache, per-row temperature / top-p / seed / stop strings / length, finished rows dropped from the
batch), calling ``on_text(row, delta)`` as text becomes final, for streaming. Greedy rows give the same
output in a mixed batch as alone (tested).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.decoding import end_token_ids
from pipeline.detokenization import TextStream
from pipeline.errors import RatchetError
from pipeline.spec import file_sha256

if TYPE_CHECKING:
    from pipeline.placement import Placement

log = logging.getLogger(__name__)

BASE = "__base__"
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
PICKLES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


@dataclass(frozen=True)
class AdapterSource:
    """A registry adapter to attach: where its files are and what the registry says about them."""

    specialist: str
    path: Path
    sha256: str
    rank: int
    target_modules: tuple[str, ...]
    base_model_id: int | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """One row of a batch: the prompt tokens, the adapter (specialist name or ``__base__``) and decoding."""

    adapter: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclass
class GenerationResult:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" or "length"


def tree_sha256(path: Path) -> str:
    """sha256 over a directory's files (relative name + bytes, sorted by name)."""
    digest = hashlib.sha256()
    for f in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        digest.update(f.relative_to(path).as_posix().encode() + b"\0")
        digest.update(bytes.fromhex(file_sha256(f)))
    return digest.hexdigest()


def check_adapter_files(
    src: AdapterSource, *, base_model_id: int | None, module_names: Sequence[str]
) -> dict:
    """Check an adapter before loading it; return its peft config (``adapter_config.json``).

    The registry's sha256 may be that of the weights file or of the whole adapter directory (``tree_sha256``).
    """
    where = f"adapter for specialist {src.specialist!r} at {src.path}"
    path = Path(src.path)
    if not path.is_dir():
        raise RatchetError(f"{where}: directory not found")
    weights = path / WEIGHTS
    if not weights.is_file():
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLES)
        extra = f" (found {', '.join(pickles)}: pickled weights are never loaded)" if pickles else ""
        raise RatchetError(f"{where}: no {WEIGHTS}{extra}; re-save the adapter with safetensors")
    actual = file_sha256(weights)
    if src.sha256 not in (actual, tree_sha256(path)):
        raise RatchetError(
            f"{where}: sha256 {actual[:12]} does not match the registry's {src.sha256[:12]} (file changed?)"
        )
    if base_model_id is not None and src.base_model_id is not None and src.base_model_id != base_model_id:
        raise RatchetError(
            f"{where}: trained on base model id {src.base_model_id}, but the generation serves base model "
            f"id {base_model_id}"
        )
    try:
        config = json.loads((path / CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise RatchetError(f"{where}: unreadable {CONFIG}: {exc}") from None
    if str(config.get("peft_type", "")).upper() != "LORA":
        raise RatchetError(f"{where}: peft_type is {config.get('peft_type')!r}, expected LORA")
    if int(config.get("r", -1)) != src.rank:
        raise RatchetError(f"{where}: rank r={config.get('r')} but the registry says {src.rank}")
    targets = config.get("target_modules")
    if isinstance(targets, list) and set(targets) != set(src.target_modules):
        raise RatchetError(
            f"{where}: target modules {sorted(targets)} but the registry says {sorted(src.target_modules)}"
        )
    for t in targets if isinstance(targets, list) else []:
        if not any(n == t or n.endswith("." + t) for n in module_names):
            raise RatchetError(f"{where}: target module {t!r} does not exist in the base model")
    return config


def _attach(model: Any, src: AdapterSource, config: dict) -> Any:
    """Add one adapter to ``model`` (wrapping it in a PeftModel first) and load its safetensors weights."""
    from peft import LoraConfig, PeftModel, set_peft_model_state_dict
    from safetensors.torch import load_file

    where = f"adapter for specialist {src.specialist!r} at {src.path}"
    known = set(LoraConfig.__dataclass_fields__)
    cfg = LoraConfig(**{k: v for k, v in config.items() if k in known})
    cfg.inference_mode = True
    if isinstance(model, PeftModel):
        model.add_adapter(src.specialist, cfg)
    else:
        model = PeftModel(model, cfg, adapter_name=src.specialist)
    state = load_file(str(Path(src.path) / WEIGHTS))
    try:
        result = set_peft_model_state_dict(model, state, adapter_name=src.specialist)
    except RuntimeError as exc:  # shape mismatch
        raise RatchetError(
            f"{where}: weights do not fit the base model: {str(exc).splitlines()[0]}"
        ) from None
    unexpected = [k for k in result.unexpected_keys if "lora_" in k]
    missing = [k for k in result.missing_keys if f".{src.specialist}." in k and "lora_" in k]
    if len(unexpected) == len([k for k in state if "lora_" in k]) or not state:
        raise RatchetError(f"{where}: its weights match no module of the base model")
    if unexpected or missing:
        first = (unexpected or missing)[0]
        what = "matches no module" if unexpected else "is missing from the file"
        raise RatchetError(
            f"{where}: weight {first} {what} ({len(unexpected)} unmatched, {len(missing)} missing)"
        )
    return model


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
) -> MixtureRuntime:
    """Load the base once, check and attach every adapter by specialist name (see ``check_adapter_files``).

    ``specialists`` lists every specialist served; one without an adapter is served by the base model.
    ``mix``: ``segments`` (``pipeline.serving.mixlora``: batched per-row LoRA, the default where supported)
    or ``peft`` (peft's per-sample ``adapter_names``) for mixed-adapter batches. ``where``: device and dtype
    (``pipeline.placement``; default: ``device`` with the dtype ``auto``); ``tool_call_format``: how prompts show tool calls.
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
    from pipeline.placement import placement

    where = where or placement(device=device)
    device = where.device
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or base_path)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=where.torch_dtype, use_safetensors=True)
    names = [n for n, _ in model.named_modules()]
    for src in adapters:
        config = check_adapter_files(src, base_model_id=base_model_id, module_names=names)
        model = _attach(model, src, config)
        log.info("attached adapter %s from %s", src.specialist, src.path)
    model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    served = list(specialists) if specialists is not None else [a.specialist for a in adapters]
    runtime = MixtureRuntime(model, tokenizer, served, {a.specialist for a in adapters}, device, mix=mix)
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
    ):
        import threading

        from pipeline.serving import mixlora

        self.lock = threading.Lock()  # one forward pass at a time: the per-row adapter state is shared
        self.model = model
        self.tokenizer = tokenizer
        self.specialists = list(specialists)
        self.adapters = set(adapters)
        self.device = device
        cfg = getattr(model, "config", None)
        self.context_limit = int(getattr(cfg, "max_position_embeddings", 0) or tokenizer.model_max_length)
        special = set(tokenizer.all_special_ids)
        self.end_ids = (special - ({tokenizer.unk_token_id} - {None})) | end_token_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.mix = "segments" if mix == "segments" and mixlora.supported(model) else "peft"
        self.segmented = mixlora.install(model, sorted(adapters)) if self.mix == "segments" else None
        self.tool_call_format = "openai"  # how prompts show tool calls (the served harness's format)

    def adapter_name(self, specialist: str) -> str:
        """The peft adapter serving ``specialist`` (``__base__`` for a specialist with no adapter yet)."""
        return specialist if specialist in self.adapters else BASE

    def encode(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Prompt token ids for a conversation (the training chat rendering, with the assistant header;
        tool calls in the harness's format, the offered tools' schemas given to the template)."""
        from pipeline.packing import render_prompt

        text = render_prompt(self.tokenizer, messages, fmt=self.tool_call_format, tools=tools)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def count_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
        return len(self.encode(messages, tools))

    def generate(
        self, requests: Sequence[GenerationRequest], on_text: Callable[[int, str], None] | None = None
    ) -> list[GenerationResult]:
        """Decode every request in one mixed-adapter batch; ``on_text(i, delta)`` streams row ``i``'s text.

        Rows are decoded grouped by adapter (contiguous segments) and returned in the caller's order.
        """
        import torch

        order = sorted(range(len(requests)), key=lambda i: self.adapter_name(requests[i].adapter))
        report = None if on_text is None else (lambda row, delta: on_text(order[row], delta))
        with self.lock, torch.inference_mode():
            results = _decode(self, [requests[i] for i in order], report)
        out: list[GenerationResult] = [results[0]] * len(order)
        for pos, i in enumerate(order):
            out[i] = results[pos]
        return out

    def label_scores(
        self, messages: list[dict[str, Any]], labels: Sequence[str], adapter: str
    ) -> dict[str, float]:
        """Constrained label decoding: P(label | conversation) under ``adapter``, over ``labels`` only."""
        import torch

        prompt = self.encode(messages)
        rows = [prompt + self.tokenizer(lab, add_special_tokens=False)["input_ids"] for lab in labels]
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

        if self.segmented is not None:
            self.segmented.set_rows(names)
            return {}
        return {"adapter_names": names} if isinstance(self.model, PeftModel) else {}


def _holdback(text: str, stop: tuple[str, ...]) -> int:
    """How many trailing characters might start a stop string (kept back from streaming)."""
    best = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def _pick(logits: Any, reqs: list[GenerationRequest], gens: list[Any]) -> list[int]:
    import torch

    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for i, r in enumerate(reqs):
        if r.temperature <= 0:
            out.append(greedy[i])
            continue
        probs = torch.softmax(logits[i].float() / r.temperature, dim=-1)
        if r.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < r.top_p
            probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p * keep)
        out.append(int(torch.multinomial(probs.cpu(), 1, generator=gens[i])))
    return out


def _decode(
    rt: MixtureRuntime, reqs: list[GenerationRequest], on_text: Callable | None
) -> list[GenerationResult]:
    import torch

    n = len(reqs)
    if n == 0:
        return []
    width = max(len(r.prompt_ids) for r in reqs)
    ids = torch.full((n, width), rt.pad_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, r in enumerate(reqs):
        ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids, dtype=torch.long)
        mask[i, width - len(r.prompt_ids) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    ids, mask, pos = ids.to(rt.device), mask.to(rt.device), pos.to(rt.device)
    gens = [
        torch.Generator().manual_seed(r.seed if r.seed is not None else torch.seed() % 2**63) for r in reqs
    ]
    streams = [TextStream(rt.tokenizer) for _ in range(n)]
    texts, sent, counts = [""] * n, [0] * n, [0] * n
    finish = ["length"] * n
    active = list(range(n))  # original row index of each batch row
    names = [rt.adapter_name(r.adapter) for r in reqs]
    past = None
    step_ids, step_pos = ids, pos
    while active:
        out = rt.model(
            input_ids=step_ids,
            attention_mask=mask,
            position_ids=step_pos,
            cache=past,
            use_cache=True,
            logits_to_keep=1,  # only the last position is decoded from: prefill skips the vocabulary matmul
            **rt._adapter_kwargs([names[i] for i in active]),
        )
        past = out.cache
        chosen = _pick(out.logits[:, -1, :], [reqs[i] for i in active], [gens[i] for i in active])
        keep: list[int] = []
        for b, i in enumerate(active):
            tok, r = chosen[b], reqs[i]
            done = False
            if tok in rt.end_ids:
                texts[i], finish[i], done = streams[i].final(), "stop", True
            else:
                counts[i] += 1
                streams[i].push(tok)
                texts[i] = streams[i].text
                hit = min((texts[i].find(s) for s in r.stop if s in texts[i]), default=-1)
                if hit >= 0:
                    texts[i], finish[i], done = texts[i][:hit], "stop", True
                elif counts[i] >= r.max_new_tokens or len(r.prompt_ids) + counts[i] >= rt.context_limit:
                    # at the limit: a last, incomplete character as decode shows it
                    texts[i], done = streams[i].final(), True
            upto = len(texts[i]) if done else len(texts[i]) - _holdback(texts[i], r.stop)
            if on_text is not None and upto > sent[i]:
                on_text(i, texts[i][sent[i] : upto])
            sent[i] = max(sent[i], upto)
            if not done:
                keep.append(b)
        next_ids = torch.tensor(chosen, dtype=torch.long, device=rt.device)[:, None]
        if len(keep) < len(active):
            if not keep:
                break
            sel = torch.tensor(keep, dtype=torch.long, device=rt.device)
            past.batch_select_indices(sel)
            mask, step_pos, next_ids = mask[sel], step_pos[sel], next_ids[sel]
            active = [active[b] for b in keep]
        mask = torch.cat([mask, torch.ones((len(active), 1), dtype=torch.long, device=rt.device)], dim=1)
        step_pos = step_pos[:, -1:] + 1
        step_ids = next_ids
    return [GenerationResult(texts[i], len(reqs[i].prompt_ids), counts[i], finish[i]) for i in range(n)]
