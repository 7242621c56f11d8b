"""Fast mixed-LoRA batches: each row of a batch adds its own adapter's low-rank update.

Equivalent to peft's per-sample ``adapter_names`` (``_mixed_batch_forward``) without its per-layer Python
work (index lists rebuilt per layer and call, gather/scatter copies, one module call per adapter).
``install`` replaces the forward of every plain LoRA ``Linear`` of a ``PeftModel`` with ``base(x) + delta``:

- ``stacked`` (default while ``adapters x rank <= max_stacked``): a layer's adapters' ``A`` are
  concatenated into one ``[in, n*r]`` matrix and their ``scaling * B`` into one ``[n*r, out]``; a per-row
  mask keeps each row's own block: ``result += ((x @ A_cat) * mask) @ B_cat``. Layers that read the same
  input (q/k/v, gate/up; found by one calibration forward) share one ``x @ A`` product. A few tensor ops
  per layer whatever the adapter mix, at ``n`` times the (small) LoRA flops;
- ``segments``: rows grouped by adapter (the runtime sorts them), each contiguous segment adds
  ``x[s:e] @ A_k @ B_k``.

Rows served by the base (``__base__``) get a zero mask. A model with other LoRA kinds (DoRA, embeddings,
``modules_to_save``) is left to peft's own mixed-batch path (``supported`` says which).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class MixedLora:
    """The batch's per-row adapters, shared by every taken-over layer."""

    adapters: list[str]
    rank: int
    mode: str = "stacked"
    names: list[str] = field(default_factory=list)
    segments: list[tuple[int, int, int]] = field(default_factory=list)  # (adapter index, start, end)
    row_runs: list[tuple[int, int, int]] = field(default_factory=list)  # the same, base rows (-1) included
    mask: Any = None  # [rows, n*rank], on the model's device: 1 on each row's own adapter block
    version: int = 0
    layers: int = 0
    groups: int = 0
    device: Any = None  # where the mask is built: the LoRA weights' device and dtype
    dtype: Any = None

    def set_rows(self, names: list[str]) -> None:
        """Per-row adapters for the next forward calls (grouped by adapter for ``segments``). The mask is
        built on the device, once per batch composition: the rows' adapter indices go over (one small
        copy), each row's block is compared there; layers broadcast it over the row's positions."""
        if names == self.names and self.mask is not None:
            return
        import torch

        self.names = list(names)
        ids = [self.adapters.index(n) if n in self.adapters else -1 for n in names]
        segs: list[tuple[int, int, int]] = []
        for i, k in enumerate(ids):
            if segs and segs[-1][0] == k:
                segs[-1] = (k, segs[-1][1], i + 1)
            else:
                segs.append((k, i, i + 1))
        self.segments = [s for s in segs if s[0] >= 0]
        self.row_runs = segs
        blocks = torch.arange(len(self.adapters) * self.rank, device=self.device) // self.rank
        rows = torch.tensor(ids, dtype=torch.long, device=self.device)
        self.mask = (blocks[None, :] == rows[:, None]).to(self.dtype or torch.float32)
        self.version += 1


def supported(model: Any) -> bool:
    """Whether every LoRA layer of ``model`` is a plain LoRA ``Linear`` (no variants, no extra modules)."""
    from peft import PeftModel
    from peft.tuners.lora.layer import Linear, LoraLayer

    if not isinstance(model, PeftModel):
        return False
    if any(getattr(cfg, "modules_to_save", None) for cfg in model.peft_config.values()):
        return False
    return all(
        type(m) is Linear and not m.lora_variant and not m.merged
        for m in model.modules()
        if isinstance(m, LoraLayer)
    )


@dataclass
class _Group:
    """LoRA layers reading the same input: one ``x @ A`` product for all of them."""

    a: Any  # [in, members * n * r]
    width: int  # n * r
    members: int
    x: Any = None
    h: Any = None
    version: int = -1


def install(
    model: Any,
    adapters: list[str],
    *,
    max_stacked: int = 512,
    merge_budget_bytes: int = 256 << 20,
    calibration: dict | None = None,
) -> MixedLora:
    """Take over ``model``'s LoRA layers (check ``supported`` first); returns the shared batch state.

    ``calibration``: a cache of which layers share an input, kept by the caller across installs on the
    same model (the layers' grouping does not depend on which adapters they hold)."""
    import torch
    from peft.tuners.lora.layer import Linear

    layers = [m for m in model.modules() if isinstance(m, Linear)]
    rank = max((r for m in layers for r in m.r.values()), default=1)
    weight_bytes = sum(m.base_layer.weight.numel() * m.base_layer.weight.element_size() for m in layers)
    merge = weight_bytes * len(adapters) <= merge_budget_bytes
    mode = "merged" if merge else "stacked" if len(adapters) * rank <= max_stacked else "segments"
    state = MixedLora(adapters=list(adapters), rank=rank, mode=mode, layers=len(layers))
    if layers:
        state.device, state.dtype = layers[0].base_layer.weight.device, layers[0].base_layer.weight.dtype
    n = len(adapters)
    key = tuple(id(m) for m in layers)
    leaders = calibration.get(key) if calibration is not None else None
    if leaders is None:
        leaders = _calibrate(model, layers)
        if calibration is not None:
            calibration.clear()
            calibration[key] = leaders
    groups: dict[int, list[int]] = {}
    for i, leader in enumerate(leaders):
        groups.setdefault(leader, []).append(i)
    state.groups = len(groups)
    for members in groups.values():
        parts = [_stack(layers[i], adapters, rank) for i in members]
        group = _Group(a=torch.cat([a for a, _ in parts], dim=1), width=n * rank, members=len(members))
        for pos, (i, (_a, b_cat)) in enumerate(zip(members, parts, strict=True)):
            merged = _merged(layers[i], adapters) if merge else None
            layers[i].forward = _forward(
                state, layers[i].base_layer, group, pos * n * rank, b_cat, _a, merged
            )
    return state


def _merged(module: Any, adapters: list[str]) -> list[Any]:
    """``(W + scaling * B A)^T`` per adapter (``None`` where the layer has no such adapter)."""
    base = module.base_layer
    w = base.weight.detach()
    out = []
    for name in adapters:
        if name not in module.lora_A:
            out.append(None)
            continue
        delta = (module.lora_B[name].weight.detach() @ module.lora_A[name].weight.detach()) * module.scaling[
            name
        ]
        out.append((w + delta.to(w.dtype)).t().contiguous())
    return out


def _stack(module: Any, adapters: list[str], rank: int) -> tuple[Any, Any]:
    """``A`` of every adapter side by side ``[in, n*r]`` and ``scaling * B`` stacked ``[n*r, out]``."""
    import torch

    base = module.base_layer
    n = len(adapters)
    dtype, device = base.weight.dtype, base.weight.device
    a_cat = torch.zeros(base.in_features, n * rank, dtype=dtype, device=device)
    b_cat = torch.zeros(n * rank, base.out_features, dtype=dtype, device=device)
    for k, name in enumerate(adapters):
        if name in module.lora_A:
            r = module.r[name]
            a_cat[:, k * rank : k * rank + r] = module.lora_A[name].weight.detach().t()
            b_cat[k * rank : k * rank + r, :] = (
                module.lora_B[name].weight.detach() * module.scaling[name]
            ).t()
    return a_cat, b_cat


def _forward(
    state: MixedLora, base: Any, group: _Group, offset: int, b_cat: Any, a_cat: Any, merged: list | None
):
    import torch

    rank, width = state.rank, group.width

    def forward(x: Any, *args: Any, **kwargs: Any) -> Any:
        if state.mode == "merged" and state.segments and merged is not None:
            flat = x.reshape(-1, x.shape[-1])
            per_row = flat.shape[0] // len(state.names)
            out = torch.empty(flat.shape[0], base.out_features, dtype=flat.dtype, device=flat.device)
            for k, start, end in state.row_runs:
                w_t = merged[k] if k >= 0 else None
                rows = slice(start * per_row, end * per_row)
                torch.mm(flat[rows], w_t if w_t is not None else base.weight.t(), out=out[rows])
            if base.bias is not None:
                out += base.bias
            return out.view(*x.shape[:-1], base.out_features)
        result = base(x, *args, **kwargs)
        if not state.segments:
            return result
        if state.mode == "segments":
            for k, start, end in state.segments:
                block = slice(k * rank, (k + 1) * rank)
                result[start:end] += ((x[start:end].to(a_cat.dtype) @ a_cat[:, block]) @ b_cat[block]).to(
                    result.dtype
                )
            return result
        if group.x is not x or group.version != state.version:
            flat = x.reshape(-1, x.shape[-1]).to(group.a.dtype)
            h = flat @ group.a  # [rows * positions, members * n * r]; each row keeps its own blocks:
            h.view(state.mask.shape[0], -1, group.members, width).mul_(state.mask[:, None, None, :])
            group.h, group.x, group.version = h, x, state.version
        out = result.view(-1, result.shape[-1])
        out.addmm_(group.h[:, offset : offset + width].to(out.dtype), b_cat.to(out.dtype))
        return result

    return forward


def _calibrate(model: Any, layers: list[Any]) -> list[int]:
    """For each layer, the index of the first layer that read the same input tensor in one forward."""
    import torch

    seen: list[Any] = [None] * len(layers)
    handles = [m.register_forward_pre_hook(_record(seen, i)) for i, m in enumerate(layers)]
    try:
        with torch.inference_mode():
            device = next(model.parameters()).device
            model(input_ids=torch.tensor([[1, 2, 3]], device=device))
    finally:
        for h in handles:
            h.remove()
    leaders = []
    for i, x in enumerate(seen):
        leader = next((j for j in range(i) if seen[j] is not None and seen[j] is x), i)
        leaders.append(leader)
    return leaders


def _record(seen: list[Any], i: int):
    def hook(_module: Any, args: tuple) -> None:
        seen[i] = args[0]

    return hook
