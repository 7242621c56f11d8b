"""The decoding loop of one mixed-adapter batch (``MixtureRuntime.generate`` calls it under its lock).

Left-padded prefill, then one token per step for every live row with the KV cache; each row has its own
adapter (set per forward call), sampling, seed, stop strings and length. A finished row, or one whose
``Abort`` was set (a timeout, a client that left), is dropped from the batch and its cache at once; text
is reported through ``on_text(row, delta)`` as it becomes final (held back while it may start a stop
string).

A row may carry a grammar (``pipeline.modeling.grammar``): rows with and without one share the batch; each
grammar row has its own matcher, whose token bitmask is applied to its logits before sampling (greedy or
sampled), the end tokens allowed only where the grammar is complete; the chosen token advances it. A row
may ask for ``logprobs``; every result carries ``completion_ids``, exactly the ids decoded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pipeline.modeling.decoding import cache_keyword, select_rows
from pipeline.modeling.detokenization import TextStream
from pipeline.modeling.grammar import (
    GrammarError,
    GrammarSpec,
    allocate_bitmask,
    apply_bitmask,
    new_matcher,
    token_bytes,
)

log = logging.getLogger(__name__)


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
    grammar: GrammarSpec | None = None  # constrain the completion (None: free text)
    logprobs: int | None = None  # None: none; 0: the chosen token's; k: and the k most likely

    def aborted(self) -> str | None:
        return None if self.abort is None else self.abort.reason


@dataclass(frozen=True)
class TokenLogprob:
    """One decoded token's log-probability (OpenAI's ``logprobs.content`` item): its text, its UTF-8
    bytes, and the ``top`` most likely tokens as ``(text, logprob, bytes)``."""

    token: str
    logprob: float
    bytes: list[int]
    top: list[tuple[str, float, list[int]]]


@dataclass
class GenerationResult:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop", "length", or why it was stopped ("timeout", "disconnected", "error")
    completion_ids: list[int] = field(default_factory=list)  # every id decoded, the end token included
    logprobs: list[TokenLogprob] | None = None  # one per completion id, when the request asked


def _holdback(text: str, stop: tuple[str, ...]) -> int:
    """How many trailing characters might start a stop string (kept back from streaming)."""
    best = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def _pick(logits: Any, reqs: list[GenerationRequest], gens: list[Any]) -> Any:
    """The next id of every row, chosen on the logits' device (a ``[rows]`` tensor there: the caller copies
    it to the host once and feeds it back as the next step's input without a copy back).

    Sampled rows (temperature > 0) take ``torch.multinomial``'s single-draw algorithm,
    ``argmax(probs / q)`` with ``q ~ Exp(1)`` drawn from the row's own generator (on the device), without
    copying its probabilities to the host; on the CPU a seed decodes exactly as ``multinomial`` did."""
    import torch

    picked = logits.argmax(dim=-1)
    sampled = [i for i, r in enumerate(reqs) if r.temperature > 0]
    draws = []
    for i in sampled:  # per row as before (its own temperature, top-p and generator), nothing synchronised
        r = reqs[i]
        probs = torch.softmax(logits[i].float() / r.temperature, dim=-1)
        if r.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < r.top_p
            probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p * keep)
        draws.append((probs / torch.empty_like(probs).exponential_(1, generator=gens[i])).argmax())
    if draws:
        picked[torch.tensor(sampled, device=logits.device)] = torch.stack(draws)
    return picked


def _token(vocab_bytes: list[bytes], tok: int) -> tuple[str, list[int]]:
    raw = vocab_bytes[tok] if tok < len(vocab_bytes) else b""
    return raw.decode("utf-8", errors="replace"), list(raw)


def _logprobs(logp: Any, rows: list[int], ks: list[int], chosen: list[int], vocab_bytes: list[bytes]) -> list:
    """``TokenLogprob`` of batch rows ``rows`` (``logp``: their log-softmax, one line each; ``ks``: top k)."""
    import torch

    picked = logp.gather(1, torch.tensor([chosen[b] for b in rows], device=logp.device)[:, None])[:, 0]
    k = max(ks)
    top_v, top_i = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    picked, top_v, top_i = picked.tolist(), top_v.tolist(), top_i.tolist()
    out = []
    for n, b in enumerate(rows):
        text, raw = _token(vocab_bytes, chosen[b])
        top = [
            (*_token(vocab_bytes, t), v) for t, v in zip(top_i[n][: ks[n]], top_v[n][: ks[n]], strict=True)
        ]
        out.append(TokenLogprob(text, picked[n], raw, [(t, v, r) for t, r, v in top]))
    return out


def decode_batch(
    rt: Decodable, reqs: list[GenerationRequest], on_text: Callable | None
) -> list[GenerationResult]:
    """Decode ``reqs`` in one batch. Log-probabilities (``logprobs``) are the model's own: the log-softmax of
    its logits before the grammar's mask, the temperature and top-p (as vLLM's default ``raw_logprobs``), so a
    constrained token may have a low one."""
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
    gens = [  # on the device: sampling draws there (``_pick``)
        torch.Generator(device=rt.device).manual_seed(r.seed if r.seed is not None else torch.seed() % 2**63)
        for r in reqs
    ]
    streams = [TextStream(rt.tokenizer) for _ in range(n)]
    texts, sent, counts = [""] * n, [0] * n, [0] * n
    finish = ["length"] * n
    decoded: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list[TokenLogprob] | None] = [None if r.logprobs is None else [] for r in reqs]
    matchers: list[Any] = [None] * n
    failed = [False] * n  # a grammar that could not be compiled: the row ends as "error"
    bitmask, vocab_bytes, vocab = None, [], 0
    active = list(range(n))  # original row index of each batch row
    names = [rt.adapter_name(r.adapter) for r in reqs]
    past = None
    cache_kw = cache_keyword(rt.model)
    step_ids, step_pos = ids, pos
    while active:
        out = rt.model(
            input_ids=step_ids,
            attention_mask=mask,
            position_ids=step_pos,
            **{cache_kw: past},  # `cache` or `past_key_values`, by the transformers version
            use_cache=True,
            logits_to_keep=1,  # only the last position is decoded from: prefill skips the vocabulary matmul
            **rt._adapter_kwargs([names[i] for i in active]),
        )
        past = getattr(out, cache_kw)
        logits = out.logits[:, -1, :]
        if not vocab:  # the first step: the logits' width is known
            vocab = logits.shape[-1]
            for i, r in enumerate(reqs):
                if r.grammar is not None:
                    try:
                        matchers[i] = new_matcher(
                            rt.tokenizer, r.grammar, vocab_size=vocab, stop_ids=rt.end_ids
                        )
                    except GrammarError as exc:
                        log.warning("row %d: %s", i, exc)
                        failed[i] = True
            if any(r.logprobs is not None for r in reqs):
                vocab_bytes = token_bytes(rt.tokenizer, vocab)
        constrained = [b for b, i in enumerate(active) if matchers[i] is not None]
        lp_rows = [b for b, i in enumerate(active) if reqs[i].logprobs is not None]
        dead: set[int] = set()
        if constrained or lp_rows:
            logits = logits.float()
        logp = torch.log_softmax(logits[lp_rows], dim=-1) if lp_rows else None  # before the mask
        if constrained:
            if bitmask is None:
                bitmask = allocate_bitmask(n, vocab)
            for b in constrained:
                matchers[active[b]].fill_next_token_bitmask(bitmask, b)
            apply_bitmask(logits, bitmask, constrained)
            nothing = (bitmask[constrained] == 0).all(dim=-1).tolist()  # no token allowed at all
            for b, none_left in zip(constrained, nothing, strict=True):
                if none_left:  # nothing is allowed (no end token to finish on): the row ends here
                    dead.add(b)
                    logits[b, 0] = 0.0
        picked = _pick(logits, [reqs[i] for i in active], [gens[i] for i in active])
        chosen = picked.tolist()  # the step's one copy to the host
        if lp_rows:
            for b, item in zip(
                lp_rows,
                _logprobs(
                    logp, lp_rows, [reqs[active[b]].logprobs or 0 for b in lp_rows], chosen, vocab_bytes
                ),
                strict=True,
            ):
                logprobs[active[b]].append(item)  # type: ignore[union-attr]
        keep: list[int] = []
        for b, i in enumerate(active):
            tok, r, matcher = chosen[b], reqs[i], matchers[i]
            done = False
            why = r.aborted()
            if why is not None:  # stopped from outside: the row leaves the batch with what it has
                texts[i], finish[i], done = streams[i].final(), why, True
            elif failed[i] or b in dead:
                complete = matcher is not None and matcher.is_completed()
                texts[i], finish[i], done = streams[i].final(), "stop" if complete else "error", True
            else:
                decoded[i].append(tok)
                if matcher is not None and not matcher.accept_token(tok):
                    log.warning("row %d: the grammar refused token %d it allowed", i, tok)
                    texts[i], finish[i], done = streams[i].final(), "error", True
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
                        if matcher is not None and matcher.is_completed():
                            finish[i] = "stop"  # the grammar is complete: nothing was cut
            if logprobs[i] is not None and len(logprobs[i]) > len(decoded[i]):  # type: ignore[arg-type]
                logprobs[i].pop()  # type: ignore[union-attr] # a token not decoded (aborted, dead)
            upto = len(texts[i]) if done else len(texts[i]) - _holdback(texts[i], r.stop)
            if on_text is not None and upto > sent[i]:
                on_text(i, texts[i][sent[i] : upto])
            sent[i] = max(sent[i], upto)
            if not done:
                keep.append(b)
        next_ids = picked[:, None]
        if len(keep) < len(active):
            if not keep:
                break
            sel = torch.tensor(keep, dtype=torch.long, device=rt.device)
            select_rows(past, sel)
            mask, step_pos, next_ids = mask[sel], step_pos[sel], next_ids[sel]
            active = [active[b] for b in keep]
        mask = torch.cat([mask, torch.ones((len(active), 1), dtype=torch.long, device=rt.device)], dim=1)
        step_pos = step_pos[:, -1:] + 1
        step_ids = next_ids
    return [
        GenerationResult(texts[i], len(reqs[i].prompt_ids), counts[i], finish[i], decoded[i], logprobs[i])
        for i in range(n)
    ]
