"""Chat examples as token ids with assistant-only labels, and packed batches without cross-attention.

``encode_chat`` renders messages with the tokenizer's own chat template and marks only the final
assistant turn as labels: the example's training target is the serving specialist's own last reply;
earlier turns -- few-shot exemplars, other specialists' replies, the conversation so far -- are context. ``pack_examples`` packs a batch of examples into as few rows as fit the longest example
(first-fit decreasing); ``packed_tensors`` gives ``input_ids``/``labels``/``position_ids`` with the
positions restarting at 0 for each example and NO attention mask: transformers (>= 4.56 / 5.x) then
derives a block-diagonal causal mask from the position ids (``masking_utils.find_packed_sequence_indices``),
so packed examples never attend to each other, with sdpa or eager attention, on CPU too. The first token of
every example is a prompt token (label -100), so no loss crosses an example boundary.
"""

from __future__ import annotations

from typing import Any

from pipeline.toolcalls import from_openai, render_tool_calls

IGNORE = -100


def model_messages(messages: list[dict[str, Any]], fmt: str = "compact") -> list[dict[str, Any]]:
    """Messages as the chat template takes them, tool calls in the contract's ``tool_call_format``:

    - ``openai``: assistant ``tool_calls`` stay structured (arguments as objects, as Hugging Face chat
      templates expect them; the template writes them, e.g. ``<tool_call>{json}</tool_call>``) and tool
      results keep their ``tool_call_id``;
    - ``json`` / ``compact``: the calls become the assistant's text in that format (``pipeline.toolcalls``).

    Content parts are joined into one text; fields a template does not know are left out."""
    out = []
    for m in messages:
        role, content = m["role"], m.get("content")
        if isinstance(content, list):
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        msg: dict[str, Any] = {"role": role, "content": content or ""}
        calls = m.get("tool_calls") if role == "assistant" else None
        if calls and fmt == "openai":
            msg["tool_calls"] = [
                {"id": tc.get("id", ""), "type": "function", "function": dict(call)}
                for tc, call in zip(calls, from_openai(calls), strict=True)
            ]
        elif calls:
            text = render_tool_calls(from_openai(calls), fmt)
            msg["content"] = f"{msg['content']}\n{text}" if msg["content"] else text
        if role == "tool" and m.get("tool_call_id"):
            msg["tool_call_id"] = m["tool_call_id"]
        if m.get("name") and role == "tool":
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _template(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, **kw: Any
) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, **kw)


def render_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    fmt: str = "compact",
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text for generation: the conversation so far (tool calls in ``fmt``, the offered tools'
    schemas given to the template) plus the assistant header."""
    return _template(tokenizer, model_messages(messages, fmt), tools, add_generation_prompt=True)


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def encode_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    max_len: int,
    *,
    fmt: str = "compact",
    tools: list[dict[str, Any]] | None = None,
) -> tuple[list[int], list[int]]:
    """Token ids and labels for a conversation; labels are -100 except on the final assistant turn
    (its content and end marker).

    Two renders: the conversation before the final assistant turn with the generation prompt (one prompt
    segment, tokenized in one piece as at generation time), then the conversation through it (the rest is
    the turn, trained on). Messages after it carry no label and are left out. A template that is not
    prefix-stable -- it rewrites history (drops earlier reasoning, say) or opens the generation prompt with
    text the stored turn lacks (a forced ``<think>``) -- is handled: the labels start where the two renders
    first differ, and only if what follows still holds the turn's own text (else ``ValueError``, and the
    caller leaves the example out): only what the model produced is labelled.
    """
    msgs = model_messages(messages, fmt)
    ids: list[int] = []
    labels: list[int] = []
    last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
    if last is None:  # no assistant turn: all prompt
        _append(tokenizer, _template(tokenizer, msgs, tools), ids, labels, train=False)
        return ids[:max_len], labels[:max_len]
    prefix = _template(tokenizer, msgs[:last], tools, add_generation_prompt=True)
    full = _template(tokenizer, msgs[: last + 1], tools)
    split = len(prefix) if full.startswith(prefix) else _common_prefix(prefix, full)
    answer = msgs[last]["content"].strip()
    if split < len(prefix) and answer and answer not in full[split:]:
        raise ValueError("the chat template rewrites the final assistant turn; cannot locate its tokens")
    _append(tokenizer, full[:split], ids, labels, train=False)
    _append(tokenizer, full[split:], ids, labels, train=True)
    return ids[:max_len], labels[:max_len]


def _append(tokenizer: Any, text: str, ids: list[int], labels: list[int], *, train: bool) -> None:
    if not text:
        return
    # Fast tokenizers: the Rust tokenizer itself (~5x less overhead per call), unless its saved state
    # would truncate or pad (transformers' own call switches those off first).
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.truncation is None and backend.padding is None:
        piece = backend.encode(text, add_special_tokens=False).ids
    else:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids.extend(piece)
    labels.extend(piece if train else [IGNORE] * len(piece))


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
    for row in rows:  # plain lists, one tensor per field: building tensors per example costs more
        used = 0
        for i in row:
            ids, labs = examples[i]
            n = min(len(ids), row_len)
            input_ids += ids[:n]
            labels += labs[:n]
            positions += range(n)
            owner += [i] * n
            used += n
        # Trailing pad continues the positions of a last dummy segment starting at 0 (labels ignored).
        input_ids += [pad_id] * (width - used)
        labels += [IGNORE] * (width - used)
        positions += range(width - used)
        owner += [-1] * (width - used)
    shape = (len(rows), width)
    out = {
        "input_ids": torch.tensor(input_ids, dtype=torch.long).view(shape),
        "labels": torch.tensor(labels, dtype=torch.long).view(shape),
        "position_ids": torch.tensor(positions, dtype=torch.long).view(shape),
    }
    if owners:
        out["example_index"] = torch.tensor(owner, dtype=torch.long).view(shape)
    return out
