"""Adapters a runtime serves: checked before they touch the model, attached by name, and kept within a budget.

``check_adapter_files`` checks an adapter directory against what the registry says (the file's sha256,
safetensors only, peft type, rank, target modules, base model, and the server's ``max_rank``);
``attach`` adds one to a model and checks that every weight landed on a module. Any mismatch is a
``RatchetError`` naming the adapter, never a silent fall-back to the base model.

``AdapterPool`` holds every adapter a runtime may serve and keeps at most ``capacity`` of them attached
(least recently used evicted). An evicted adapter is attached again on demand from its safetensors
file: the bytes read are hashed and must be the bytes verified when it was added, and those same bytes
are what is loaded (no window between check and load).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import RatchetError
from pipeline.serving.adapter_weights import check_weights_header
from pipeline.specs.loading import file_sha256

log = logging.getLogger(__name__)

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
PICKLES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


@dataclass(frozen=True)
class AdapterSource:
    """A registry adapter to attach: where its files are and what the registry says about them."""

    specialist: str  # the name it is attached under (a specialist, or a runtime-loaded model name)
    path: Path
    sha256: str
    rank: int
    target_modules: tuple[str, ...]
    base_model_id: int | None = None


def tree_sha256(path: Path) -> str:
    """sha256 over a directory's files (relative name + bytes, sorted by name)."""
    digest = hashlib.sha256()
    for f in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        digest.update(f.relative_to(path).as_posix().encode() + b"\0")
        digest.update(bytes.fromhex(file_sha256(f)))
    return digest.hexdigest()


def where(src: AdapterSource) -> str:
    return f"adapter for specialist {src.specialist!r} at {src.path}"


def check_adapter_files(
    src: AdapterSource,
    *,
    base_model_id: int | None,
    module_names: Sequence[str],
    max_rank: int | None = None,
) -> tuple[dict, str]:
    """Check an adapter before loading it; return its peft config (``adapter_config.json``) and the sha256
    of its weights file.

    The registry's sha256 may be that of the weights file or of the whole adapter directory (``tree_sha256``).
    """
    at = where(src)
    path = Path(src.path)
    if not path.is_dir():
        raise RatchetError(f"{at}: directory not found")
    weights = path / WEIGHTS
    if not weights.is_file():
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLES)
        extra = f" (found {', '.join(pickles)}: pickled weights are never loaded)" if pickles else ""
        raise RatchetError(f"{at}: no {WEIGHTS}{extra}; re-save the adapter with safetensors")
    actual = file_sha256(weights)
    if src.sha256 not in (actual, tree_sha256(path)):
        raise RatchetError(
            f"{at}: sha256 {actual[:12]} does not match the registry's {src.sha256[:12]} (file changed?)"
        )
    if base_model_id is not None and src.base_model_id is not None and src.base_model_id != base_model_id:
        raise RatchetError(
            f"{at}: trained on base model id {src.base_model_id}, but the generation serves base model "
            f"id {base_model_id}"
        )
    try:
        config = json.loads((path / CONFIG).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RatchetError(f"{at}: unreadable {CONFIG}: {str(exc).splitlines()[0][:200]}") from None
    if not isinstance(config, dict):
        raise RatchetError(f"{at}: {CONFIG} is not a JSON object")
    if str(config.get("peft_type", "")).upper() != "LORA":
        raise RatchetError(f"{at}: peft_type is {config.get('peft_type')!r}, expected LORA")
    try:
        rank = int(config.get("r", -1))
        ranks = [src.rank, *(int(r) for r in (config.get("rank_pattern") or {}).values())]
    except (TypeError, ValueError, AttributeError):
        raise RatchetError(f"{at}: {CONFIG}'s r or rank_pattern is not a whole number") from None
    if rank != src.rank:
        raise RatchetError(f"{at}: rank r={rank} but the registry says {src.rank}")
    if max_rank is not None and max(ranks) > max_rank:
        raise RatchetError(
            f"{at}: rank {max(ranks)} is above this server's maximum of {max_rank} (--max-lora-rank)"
        )
    check_weights_header(weights, ranks, at)
    targets = config.get("target_modules")
    if isinstance(targets, list) and not all(isinstance(t, str) for t in targets):
        raise RatchetError(f"{at}: {CONFIG}'s target_modules is not a list of module names")
    if isinstance(targets, list) and set(targets) != set(src.target_modules):
        raise RatchetError(
            f"{at}: target modules {sorted(targets)} but the registry says {sorted(src.target_modules)}"
        )
    for t in targets if isinstance(targets, list) else []:
        if not any(n == t or n.endswith("." + t) for n in module_names):
            raise RatchetError(f"{at}: target module {t!r} does not exist in the base model")
    return config, actual


def read_weights(src: AdapterSource, sha256: str) -> dict[str, Any]:
    """The adapter's tensors, from bytes whose sha256 must be ``sha256`` (the weights file as checked)."""
    from safetensors.torch import load

    try:
        data = (Path(src.path) / WEIGHTS).read_bytes()
    except OSError as exc:
        raise RatchetError(f"{where(src)}: cannot read {WEIGHTS}: {exc}") from None
    actual = hashlib.sha256(data).hexdigest()
    if actual != sha256:
        raise RatchetError(
            f"{where(src)}: sha256 {actual[:12]} is no longer the {sha256[:12]} checked at load (file changed?)"
        )
    try:
        return load(data)
    except Exception as exc:  # safetensors' own error type (or an OverflowError) for a corrupt file
        why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise RatchetError(f"{where(src)}: {WEIGHTS} is not a valid safetensors file ({why})") from None


def attach(model: Any, name: str, src: AdapterSource, config: dict, state: dict[str, Any]) -> Any:
    """Add one adapter named ``name`` to ``model`` (wrapping it in a PeftModel first) with the weights
    ``state``; returns the model. On a mismatch the half-added adapter is removed again."""
    from peft import LoraConfig, PeftModel, set_peft_model_state_dict

    known = set(LoraConfig.__dataclass_fields__)
    try:
        cfg = LoraConfig(**{k: v for k, v in config.items() if k in known})
        cfg.inference_mode = True
        if isinstance(model, PeftModel):
            model.add_adapter(name, cfg)
        else:
            model = PeftModel(model, cfg, adapter_name=name)
    except (TypeError, ValueError) as exc:  # peft refusing the config's values
        if isinstance(model, PeftModel) and name in model.peft_config:
            model.delete_adapter(name)
        why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise RatchetError(f"{where(src)}: {CONFIG} is not a LoRA config peft takes ({why})") from None
    try:
        _load_state(model, name, src, state, set_peft_model_state_dict)
    except RatchetError:
        model.delete_adapter(name)
        raise
    return model


def _load_state(model: Any, name: str, src: AdapterSource, state: dict, set_state: Any) -> None:
    at = where(src)
    try:
        result = set_state(model, state, adapter_name=name)
    except RuntimeError as exc:  # shape mismatch
        raise RatchetError(f"{at}: weights do not fit the base model: {str(exc).splitlines()[0]}") from None
    unexpected = [k for k in result.unexpected_keys if "lora_" in k]
    missing = [k for k in result.missing_keys if f".{name}." in k and "lora_" in k]
    if len(unexpected) == len([k for k in state if "lora_" in k]) or not state:
        raise RatchetError(f"{at}: its weights match no module of the base model")
    if unexpected or missing:
        first = (unexpected or missing)[0]
        what = "matches no module" if unexpected else "is missing from the file"
        raise RatchetError(
            f"{at}: weight {first} {what} ({len(unexpected)} unmatched, {len(missing)} missing)"
        )


@dataclass
class PoolStats:
    """Hits and misses count rows of batches (was the row's adapter attached when its batch began)."""

    hits: int = 0
    misses: int = 0
    loads: int = 0
    evictions: int = 0
    max_attached: int = 0  # the most adapters the model held at once (read from peft, after every load)
    load_seconds: float = 0.0  # reading, checking and attaching adapters
    swaps: int = 0  # batches that changed the attached set
    swap_seconds: float = 0.0  # the same batches' loads plus re-taking the layers (mixlora)
    max_swap_seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / max(1, self.hits + self.misses)


# adapter_config.json fields that do not change the modules or the scaling of an attached adapter
SHAPE_FREE = {
    "base_model_name_or_path",
    "revision",
    "inference_mode",
    "peft_version",
    "auto_mapping",
    "task_type",
}


@dataclass
class _Slot:
    """A peft adapter of the model, with what an adapter must match to have its weights copied in."""

    shape: str  # the adapter config without the SHAPE_FREE fields
    params: dict[str, Any] | None  # file key -> the model's parameter (None: not copied in place)


class AdapterPool:
    """Every adapter a runtime may serve (checked when added); at most ``capacity`` attached at a time.

    With a ``capacity``, attached adapters live in peft adapters named ``slot<k>`` (``peft_name``): an
    evicted adapter's slot takes the next one's weights in place when their configs match (no module is
    rebuilt), otherwise it is deleted and the newcomer added. Not thread-safe: the runtime calls it under
    its lock.
    """

    def __init__(
        self,
        model: Any,
        *,
        capacity: int | None = None,
        base_model_id: int | None = None,
        max_rank: int | None = None,
    ):
        if capacity is not None and capacity < 1:
            raise RatchetError(f"the adapter budget must be at least 1, not {capacity}")
        self.model = model
        self.capacity = capacity
        self.base_model_id = base_model_id
        self.max_rank = max_rank
        self.sources: dict[str, tuple[AdapterSource, dict, str]] = {}  # name -> (source, config, sha256)
        self.attached: OrderedDict[str, str] = OrderedDict()  # name -> peft name, least recently used first
        self.stats = PoolStats()
        self._module_names = [n for n, _ in model.named_modules()]
        self._slots: dict[str, _Slot] = {}
        self._next_slot = 0

    def __contains__(self, name: str) -> bool:
        return name in self.sources

    def names(self) -> list[str]:
        return list(self.sources)

    def peft_name(self, name: str) -> str:
        """The peft adapter an attached adapter lives in (other names unchanged)."""
        return self.attached.get(name, name)

    def check(self, src: AdapterSource) -> tuple[dict, str]:
        """``check_adapter_files`` with this pool's base model and rank maximum (reads files only)."""
        return check_adapter_files(
            src, base_model_id=self.base_model_id, module_names=self._module_names, max_rank=self.max_rank
        )

    def add(
        self, src: AdapterSource, *, name: str | None = None, checked: tuple[dict, str] | None = None
    ) -> None:
        """Check ``src`` (unless ``checked`` says how it passed) and attach it under ``name`` (default: its
        specialist), evicting the least recently used if full."""
        name = name or src.specialist
        if name in self.sources:
            raise RatchetError(f"{where(src)}: an adapter named {name!r} is already loaded")
        config, sha = checked or self.check(src)
        if self.capacity is not None and len(self.attached) >= self.capacity:
            self._detach(next(iter(self.attached)))
            self.stats.evictions += 1
        started = time.perf_counter()
        self._attach(name, src, config, read_weights(src, sha), started)  # all its weights are checked
        self.sources[name] = (src, config, sha)
        log.info("attached adapter %s from %s", name, src.path)

    def remove(self, name: str) -> None:
        self.sources.pop(name)
        if name in self.attached:
            self._detach(name)

    def ensure(self, rows: Iterable[str]) -> bool:
        """Attach the adapter of every row (at most ``capacity`` distinct ones), most recently used last;
        returns whether the attached set changed."""
        rows = [n for n in rows if n in self.sources]
        self.stats.hits += sum(n in self.attached for n in rows)
        self.stats.misses += sum(n not in self.attached for n in rows)
        wanted = list(dict.fromkeys(rows))
        if self.capacity is not None and len(wanted) > self.capacity:
            raise ValueError(f"{len(wanted)} adapters in one batch, but only {self.capacity} fit")
        missing = [n for n in wanted if n not in self.attached]
        for n in missing:
            self._bring(n, keep=wanted)
        for n in wanted:
            self.attached.move_to_end(n)
        return bool(missing)

    def _bring(self, name: str, *, keep: Sequence[str]) -> None:
        """Attach ``name``, in the least recently used one's slot when the pool is full."""
        src, config, sha = self.sources[name]
        started = time.perf_counter()
        state = read_weights(src, sha)
        if self.capacity is None or len(self.attached) < self.capacity:
            self._attach(name, src, config, state, started)
            return
        victim = next(n for n in self.attached if n not in keep)
        self.stats.evictions += 1
        slot = self._slots[self.attached[victim]]
        if slot.params is not None and slot.shape == _shape(config) and _same_keys(slot.params, state):
            import torch

            with torch.no_grad():
                for key, tensor in state.items():
                    slot.params[key].copy_(tensor)
            self.attached[name] = self.attached.pop(victim)
            self._loaded(started)
            return
        self._detach(victim)
        self._attach(name, src, config, state, started)

    def _attach(self, name: str, src: AdapterSource, config: dict, state: dict, started: float) -> None:
        slot = name
        if self.capacity is not None:
            slot, self._next_slot = f"slot{self._next_slot}", self._next_slot + 1
        self.model = attach(self.model, slot, src, config, state)  # peft puts it on the base's device
        self.model.eval()  # new modules (dropout) start in training mode
        params = dict(self.model.named_parameters())
        keys = {
            k: "{0}.{2}.{1}".format(*k.rpartition(".")[::2], slot) for k in state
        }  # a.b.w -> a.b.<slot>.w
        copied = {k: params[p] for k, p in keys.items() if p in params}
        self._slots[slot] = _Slot(_shape(config), copied if len(copied) == len(state) else None)
        self.attached[name] = slot
        self._fix_active()
        self._loaded(started)

    def _loaded(self, started: float) -> None:
        self.stats.loads += 1
        self.stats.load_seconds += time.perf_counter() - started
        self.stats.max_attached = max(self.stats.max_attached, len(self.model.peft_config))

    def _detach(self, name: str) -> None:
        import warnings

        slot = self.attached.pop(name)
        self._slots.pop(slot, None)
        with warnings.catch_warnings():  # peft warns when the active adapter goes; rows name their own
            warnings.simplefilter("ignore", UserWarning)
            self.model.delete_adapter(slot)
        self._fix_active()

    def _fix_active(self) -> None:
        """peft may keep pointing at a deleted adapter as the active one (its forward then fails); rows name
        their own adapters, so any attached one will do."""
        left = list(self.model.peft_config)
        if left and self.model.active_adapter not in left:
            self.model.set_adapter(left[0], inference_mode=True)


def _shape(config: dict) -> str:
    return json.dumps({k: v for k, v in config.items() if k not in SHAPE_FREE}, sort_keys=True, default=str)


def _same_keys(params: dict[str, Any], state: dict[str, Any]) -> bool:
    return params.keys() == state.keys() and all(params[k].shape == state[k].shape for k in state)
