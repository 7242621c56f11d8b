"""The replies of an OpenAI-compatible rollout engine, checked: every byte it sends is untrusted.

``reply_samples`` turns a ``/v1/completions`` reply into ``decoding.Sample`` s, ``prompt_values`` reads one
prompt's ``prompt_logprobs``; a field missing or of the wrong type, a count other than asked for, an id
outside the vocabulary, a log-probability that is not a finite number <= 0, more tokens than ``max_tokens``
is an ``EngineRefused`` of one line (``pipeline.modeling.samplers`` raises nothing else for a bad reply).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from pipeline.errors import RatchetError
from pipeline.modeling.decoding import Sample, SamplingConfig

LOGPROB_SLACK = 1e-3  # a log-softmax is <= 0; a float rounding above it is tolerated


class EngineRefused(RatchetError):
    """The rollout engine does not serve what the trainer holds (the parity probe failed), or cannot be used."""


def reply_samples(
    body: dict[str, Any],
    config: SamplingConfig,
    *,
    vocab: int,
    text_of: Callable[[Sequence[int], Sequence[str]], str],
    at: str,
) -> list[Sample]:
    """The samples of one reply: exactly ``num_samples`` choices indexed 0.., each with token ids inside
    the vocabulary (at most ``max_new_tokens``) and one finite log-probability <= 0 per id."""
    choices = body["choices"]
    if not all(isinstance(c, dict) for c in choices):
        raise EngineRefused(f"{at}: a choice is not an object")
    indices = sorted(c.get("index") for c in choices if is_int(c.get("index")))
    if len(choices) != config.num_samples or indices != list(range(config.num_samples)):
        raise EngineRefused(f"{at}: {len(choices)} choices, asked for n={config.num_samples}")
    out = []
    for c in sorted(choices, key=lambda c: c["index"]):
        ids = c.get("token_ids")
        if ids is None:
            raise EngineRefused(
                f"{at}: no token_ids in the reply (vLLM >= 0.10.2 returns them for return_token_ids)"
            )
        if not isinstance(ids, list) or not all(is_int(t) and 0 <= t < vocab for t in ids):
            raise EngineRefused(
                f"{at}: token_ids are not ids of this tokenizer's vocabulary (0..{vocab - 1})"
            )
        if len(ids) > config.max_new_tokens:
            raise EngineRefused(f"{at}: {len(ids)} tokens, more than max_tokens={config.max_new_tokens}")
        lp = c.get("logprobs")
        values = lp.get("token_logprobs") if isinstance(lp, dict) else None
        if not isinstance(values, list) or len(values) != len(ids):
            raise EngineRefused(
                f"{at}: {len(ids)} token ids, {len(values) if isinstance(values, list) else 'no'} logprobs"
            )
        out.append(Sample(text_of(ids, config.stop), tuple(ids), checked_logprobs(values, at)))
    return out


def prompt_values(body: dict[str, Any], prompt: Sequence[int], at: str) -> list[float]:
    """The log-probability of each of ``prompt``'s tokens after the first in a reply's first choice's
    ``prompt_logprobs`` (vLLM's: one row per prompt token, the first None, each keyed by token id)."""
    first = body["choices"][0] if body["choices"] else None
    rows = first.get("prompt_logprobs") if isinstance(first, dict) else None
    if not isinstance(rows, list) or len(rows) != len(prompt):
        raise EngineRefused(
            f"{at}: no prompt_logprobs of the {len(prompt)} prompt tokens "
            "(the parity probe needs vLLM's prompt_logprobs)"
        )
    values = []
    for p, t in enumerate(prompt[1:], start=1):
        entry = rows[p].get(str(t)) if isinstance(rows[p], dict) else None
        values.append(entry.get("logprob") if isinstance(entry, dict) else None)
    return list(checked_logprobs(values, f"{at}: prompt_logprobs"))


def is_int(value: Any) -> bool:
    return type(value) is int  # not a bool, not a float


def one_line(text: str) -> str:
    return " ".join(text.split())[:300]


def checked_logprobs(values: Sequence[Any], at: str) -> tuple[float, ...]:
    """``values`` as log-probabilities: each a finite number <= 0 (``LOGPROB_SLACK`` for rounding)."""
    bad = next(
        (v for v in values if type(v) not in (int, float) or not math.isfinite(v) or v > LOGPROB_SLACK), None
    )
    if bad is not None or any(v is None for v in values):
        raise EngineRefused(f"{at}: a log-probability is {bad!r}, not a finite number <= 0")
    return tuple(float(v) for v in values)
