"""Chat examples as token ids with assistant-only labels, and packed batches without cross-attention.

``encode_chat`` (``pipeline.modeling.templating``, re-exported here with the other encoders) renders messages with the
tokenizer's own chat template, content inert (a role marker a client or the model wrote is text, never a
special token), and marks only the final assistant turn as labels: the example's training target is the
serving specialist's own last reply; earlier turns -- few-shot exemplars, other specialists' replies, the
conversation so far -- are context, and the oldest of them go when the example is longer than allowed (its
end never does). ``pack_examples`` packs a batch of examples into as few rows as fit the longest example
(first-fit decreasing); ``packed_tensors`` gives ``input_ids``/``labels``/``position_ids`` with the
positions restarting at 0 for each example and NO attention mask: transformers (>= 4.56 / 5.x) then
derives a block-diagonal causal mask from the position ids (``masking_utils.find_packed_sequence_indices``),
so packed examples never attend to each other, with sdpa or eager attention, on CPU too. It also gives
``cu_seq_lens``, the segments' cumulative lengths over the flattened rows (flash-attention's varlen
convention), with which a padding-free attention (``pipeline.training.attention``) builds no mask at all. The first token of
every example is a prompt token (label -100), so no loss crosses an example boundary.

Served ids (``encode_reply``): a reply the server decoded was stored with exactly the ids the model was given
and wrote (``registry.documents.ServedTokens``). Re-rendering the stored text can give other ids (BPE has
many segmentations of one string and the model may sample a non-canonical one; a harness may render the
conversation differently from its stored messages): the retokenization drift of multi-turn RL. So an
example whose reply was served by this very tokenizer (``templating.tokenizer_fingerprint``) and fits
``max_len`` is ``prompt_ids + completion_ids``, labels exactly on ``completion_ids`` (the end token it
stopped on included); any other is re-rendered by ``encode_chat`` (its oldest turns may then be cut).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.modeling.templating import (
    IGNORE,
    encode_chat,
    encode_prompt,
    model_messages,
    render_prompt,
    tokenizer_fingerprint,
)

__all__ = ["IGNORE", "RERENDERED", "SERVED", "encode_chat", "encode_prompt", "encode_reply", "model_messages",
           "pack_examples", "packed_tensors", "render_prompt", "served_example"]  # fmt: skip

SERVED = "served"  # an example on the ids the model was served
RERENDERED = "re-rendered"  # an example rendered from its messages (no served ids, or unusable ones)
OTHER_TOKENIZER = "other tokenizer"  # served ids unused: another tokenizer (or chat template) served them
SERVED_TOO_LONG = "served ids over max_seq_len"  # served ids unused: prompt and reply do not fit
BAD_IDS = "served ids unreadable"  # served ids unused: not ids, none, or an id outside the vocabulary


def _ids(value: Any, size: int) -> list[int] | None:
    if not isinstance(value, list) or not value:
        return None
    if not all(type(i) is int and 0 <= i < size for i in value):
        return None
    return value


def served_example(
    tokenizer: Any, served: Mapping[str, Any] | None, max_len: int
) -> tuple[tuple[list[int], list[int]] | None, str | None]:
    """``((ids, labels), None)``: the served ``prompt_ids`` then ``completion_ids``, labels exactly on the
    completion; or ``(None, why)`` when they cannot stand for the reply (``OTHER_TOKENIZER``,
    ``SERVED_TOO_LONG``, ``BAD_IDS``; ``why`` None: nothing was served)."""
    if not served:
        return None, None
    if not isinstance(served.get("tokenizer"), str):
        return None, BAD_IDS
    if served["tokenizer"] != tokenizer_fingerprint(tokenizer):
        return None, OTHER_TOKENIZER
    size = len(tokenizer)
    prompt, completion = _ids(served.get("prompt_ids"), size), _ids(served.get("completion_ids"), size)
    if prompt is None or completion is None:  # a prompt token first: no loss crosses an example boundary
        return None, BAD_IDS
    if len(prompt) + len(completion) > max_len:
        return None, SERVED_TOO_LONG
    return (prompt + completion, [IGNORE] * len(prompt) + completion), None


def encode_reply(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    max_len: int,
    *,
    fmt: str = "compact",
    tools: list[dict[str, Any]] | None = None,
    served: Mapping[str, Any] | None = None,
) -> tuple[list[int], list[int], str]:
    """``(ids, labels, how)``: the example of ``messages``' final assistant turn on the ids it was served
    (``served_example``; ``how`` is ``SERVED``), else re-rendered by ``encode_chat`` (``how`` is
    ``RERENDERED``, or ``"re-rendered: <why>"`` when served ids were there and could not be used). Raises as
    ``encode_chat`` only when it re-renders."""
    example, why = served_example(tokenizer, served, max_len)
    if example is not None:
        return example[0], example[1], SERVED
    ids, labels = encode_chat(tokenizer, messages, max_len, fmt=fmt, tools=tools)
    return ids, labels, RERENDERED if why is None else f"{RERENDERED}: {why}"


def pack_examples(lengths: list[int], row_len: int) -> list[list[int]]:
    """Group example indices into rows of at most ``row_len`` tokens (first-fit decreasing)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        need = min(lengths[i], row_len)
        for r, free in enumerate(room):
            if free >= need:
                rows[r].append(i)
                room[r] -= need
                break
        else:
            rows.append([i])
            room.append(row_len - need)
    return rows


def packed_tensors(
    examples: list[tuple[list[int], list[int]]], row_len: int, pad_id: int, *, owners: bool = False
) -> dict[str, Any]:
    """Pack examples into a ``[rows, L]`` batch (L = longest packed row) with per-example positions.

    Rows are at most as long as the batch's longest example (capped at ``row_len``): a packed row then
    never costs more attention than a padded one, and the saving is exactly the padding. ``owners``: also
    ``example_index``, the index of the example each position belongs to (-1 on padding), for losses that
    sum per example (preference and RL training).
    """
    import torch

    row_len = min(row_len, max(len(ids) for ids, _ in examples))
    rows = pack_examples([len(ids) for ids, _ in examples], row_len)
    width = max(sum(min(len(examples[i][0]), row_len) for i in row) for row in rows)
    input_ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    owner: list[int] = []
    starts: list[int] = []
    for row in rows:  # plain lists, one tensor per field: building tensors per example costs more
        used = 0
        for i in row:
            ids, labs = examples[i]
            n = min(len(ids), row_len)
            starts.append(len(input_ids))
            input_ids += ids[:n]
            labels += labs[:n]
            positions += range(n)
            owner += [i] * n
            used += n
        # Trailing pad continues the positions of a last dummy segment starting at 0 (labels ignored).
        if used < width:
            starts.append(len(input_ids))
        input_ids += [pad_id] * (width - used)
        labels += [IGNORE] * (width - used)
        positions += range(width - used)
        owner += [-1] * (width - used)
    shape = (len(rows), width)
    out = {
        "input_ids": torch.tensor(input_ids, dtype=torch.long).view(shape),
        "labels": torch.tensor(labels, dtype=torch.long).view(shape),
        "position_ids": torch.tensor(positions, dtype=torch.long).view(shape),
        "cu_seq_lens": torch.tensor([*starts, len(input_ids)], dtype=torch.int32),
    }
    if owners:
        out["example_index"] = torch.tensor(owner, dtype=torch.long).view(shape)
    return out
