"""OpenAI stored chat completions -> turns: ``ratchet ingest --from openai FILE``.

A completion created with ``store=True`` is listed by ``client.chat.completions.list()`` (a ``ChatCompletion``
with its ``metadata``) and its input by ``client.chat.completions.messages.list(id)``
(``ChatCompletionStoreMessage``s). The file is JSONL, one stored completion per line: the ``ChatCompletion``
as the SDK dumps it plus ``"messages"``, its input messages (and, optionally, ``"tools"``, the tools the
request offered, which the store does not return)::

    with open("stored.jsonl", "w") as out:
        for c in client.chat.completions.list():
            messages = [m.model_dump() for m in client.chat.completions.messages.list(c.id)]
            out.write(json.dumps({**c.model_dump(), "messages": messages}) + "\\n")

Each line is one turn: the input messages, then the first choice's message. A ``conversation_id`` or
``session_id`` in the completion's metadata is its conversation. The store has no ratings.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.errors import RatchetError
from pipeline.experience.ingest import DEFAULT_MAX_LINE_BYTES, TraceError
from pipeline.experience.sources.intake import (
    Origin,
    Turn,
    chat_message,
    chat_tools,
    conversation_key,
    failed,
    json_lines,
    record_bytes,
)

CONVERSATION_KEYS = ("conversation_id", "session_id")


def completion_turn(line: Any, number: int) -> Turn:
    """The turn of one stored completion, or why it cannot be read. Only what is read is checked (the id, the
    first choice's message, string metadata; the messages as ``ratchet ingest`` checks them): a field the API
    adds later does not make a completion unreadable. (The ``openai`` SDK is not imported: it would cost
    every command of ``pipeline.cli.core`` a second.)"""
    if not isinstance(line, dict):
        return failed(
            number, line, "wrong shape: expected a stored ChatCompletion object with its 'messages'"
        )
    try:
        given, choices, meta = line.get("messages"), line.get("choices"), line.get("metadata") or {}
        if not isinstance(line.get("id"), str) or line.get("object", "chat.completion") != "chat.completion":
            raise TraceError("expected a ChatCompletion ('id', 'object': 'chat.completion')")
        if not isinstance(given, list) or not given:
            raise TraceError("messages: expected the completion's input messages (a non-empty list)")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise TraceError("choices: expected a non-empty list")
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise TraceError("metadata: expected string values")
        answer = choices[0].get("message")
        if not isinstance(answer, dict) or answer.get("role", "assistant") != "assistant":
            raise TraceError("choices[0].message: expected the assistant's message")
        origin = Origin(system="openai", trace=line["id"])
        return Turn(
            number=number,
            raw=record_bytes(line),
            messages=[
                *(chat_message(m) for m in given),
                chat_message({**answer, "role": "assistant"}),
            ],
            metadata={"origin": origin.model_dump(exclude_none=True), "model": line.get("model")},
            tools=chat_tools(line.get("tools")),
            conversation_id=conversation_key(next((meta[k] for k in CONVERSATION_KEYS if meta.get(k)), None)),
        )
    except TraceError as exc:
        return failed(number, line, f"wrong shape: {exc}")


def stored_completion_turns(path: Path) -> Iterator[Turn]:
    """Every stored completion in a JSONL file; ``RatchetError`` when its first line is not one."""
    lines = json_lines(path, max_line_bytes=DEFAULT_MAX_LINE_BYTES)
    first = next(lines, None)
    if first is None or first[2] is not None or not isinstance(first[1], dict) or "choices" not in first[1]:
        why = "empty" if first is None else f"line {first[0]}: {first[2] or 'no choices'}"
        raise RatchetError(f"{path}: not OpenAI stored completions as JSONL ({why})")
    yield completion_turn(first[1], first[0])
    for number, line, problem in lines:
        yield failed(number, line or b"", problem) if problem is not None else completion_turn(line, number)
