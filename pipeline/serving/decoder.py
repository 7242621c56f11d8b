"""The decoding loop of one mixed-adapter batch (``MixtureRuntime.generate`` calls it under its lock).

Left-padded prefill, then one token per step for every live row with the KV cache; each row has its own
adapter (set per forward call), sampling, seed, stop strings and length. A finished row, or one whose
``Abort`` was set (a timeout, a client that left), is dropped from the batch and its cache at once; text
is reported through ``on_text(row, delta)`` as it becomes final (held back while it may start a stop
string).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pipeline.modeling.detokenization import TextStream


class Decodable(Protocol):
    """What the loop needs of ``MixtureRuntime`` (a protocol: the runtime imports this module)."""

    model: Any
    tokenizer: Any
    device: Any
    pad_id: int
    end_ids: set[int]
    context_limit: int

    def adapter_name(self, specialist: str) -> str: ...

    def _adapter_kwargs(self, names: list[str]) -> dict[str, Any]: ...


class Abort:
    """Stops a request from the event loop: its row leaves the batch at the next decoding step and finishes
    with ``reason`` (``timeout``, ``disconnected``), keeping the text it produced so far."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self._callbacks: list[Callable[[str], None]] = []

    def set(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason  # read by the decoding thread at its next step
            for callback in self._callbacks:
                callback(reason)

    def on_set(self, callback: Callable[[str], None]) -> None:
        if self.reason is not None:
            callback(self.reason)
        else:
            self._callbacks.append(callback)


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
    abort: Abort | None = field(default=None, compare=False)

    def aborted(self) -> str | None:
        return None if self.abort is None else self.abort.reason


@dataclass
class GenerationResult:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop", "length", or why it was stopped ("timeout", "disconnected")


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


def decode_batch(
    rt: Decodable, reqs: list[GenerationRequest], on_text: Callable | None
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
            why = r.aborted()
            if why is not None:  # stopped from outside: the row leaves the batch with what it has
                texts[i], finish[i], done = streams[i].final(), why, True
            elif tok in rt.end_ids:
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
