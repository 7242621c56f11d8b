"""A Langfuse trace export -> turns: ``ratchet ingest --from langfuse FILE``.

The file holds traces as Langfuse's public API returns them (``GET /api/public/traces/{id}``: camelCase
``id``, ``sessionId``, ``observations``, ``scores``): a JSON array of them, ``{"data": [...]}`` (a page of the
list endpoint), one trace object, or JSONL with one trace per line. Each observation of type ``GENERATION``
(oldest first) is one turn: its ``input`` is OpenAI chat messages, or ``{"messages": [...], "tools": [...]}``
as Langfuse's OpenAI integration logs a call with tools, its ``output`` the answer (a message, or text); the
trace's ``sessionId`` is the conversation.

Scores (a score with an ``observationId`` belongs to that generation, any other to the trace's last one):
``NUMERIC`` and ``BOOLEAN`` are the turn's rating (the newest wins), ``CORRECTION`` its corrected answer
(``stringValue``); categorical and text scores are shown (``metadata.assessments``). They count only as the
command line's principal may (``intake``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.errors import RatchetError
from pipeline.experience.ingest import TraceError, decode_json
from pipeline.experience.sources.intake import (
    Assessments,
    Origin,
    Turn,
    chat_message,
    chat_tools,
    conversation_key,
    failed,
    json_lines,
    record_bytes,
)

MAX_FILE_BYTES = (
    64 << 20
)  # a whole-file export read at once (~30x its size in memory as Python objects); JSONL streams
MAX_TRACE_BYTES = 64 << 20  # one trace (a line of JSONL) with all its observations


def _answer(output: Any) -> dict[str, Any]:
    if isinstance(output, list) and output:
        output = output[0]  # n > 1: the first choice
    if isinstance(output, str):
        return {"role": "assistant", "content": output}
    if isinstance(output, dict):
        choices = output.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            output = choices[0].get("message")
        return chat_message({**output, "role": "assistant"}) if isinstance(output, dict) else _answer(output)
    raise TraceError("output: expected an assistant message or text")


def generation_messages(observation: dict[str, Any]) -> tuple[list[dict[str, Any]], Any]:
    """(the conversation, the tools offered) of one GENERATION observation."""
    given, tools = observation.get("input"), None
    if isinstance(given, dict) and "messages" in given:
        given, tools = given["messages"], given.get("tools")
    if isinstance(given, str):
        given = [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise TraceError("input: expected OpenAI chat messages (a list, or {'messages': [...]})")
    return [*(chat_message(m) for m in given), _answer(observation.get("output"))], tools


def _scores(trace: dict[str, Any], ids: list[str]) -> dict[str, Assessments]:
    found = {i: Assessments() for i in ids}
    scores = [s for s in trace.get("scores") or [] if isinstance(s, dict)]
    for score in sorted(scores, key=lambda s: str(s.get("timestamp") or "")):
        target = found.get(score.get("observationId")) or found[ids[-1]]
        kind, value, text = score.get("dataType"), score.get("value"), score.get("stringValue")
        if (
            kind in ("NUMERIC", "BOOLEAN", None)
            and isinstance(value, int | float)
            and not isinstance(value, bool)
        ):
            target.rating = float(value)
        elif kind == "CORRECTION" and isinstance(text, str):
            target.correction = text
        elif isinstance(score.get("name"), str):
            target.others[score["name"]] = text if text is not None else value
    return found


def trace_turns(trace: Any, number: int) -> Iterator[Turn]:
    """The turns of one exported trace (its GENERATION observations), or its one quarantined record."""
    if not isinstance(trace, dict) or not isinstance(trace.get("observations"), list):
        yield failed(
            number,
            trace,
            "wrong shape: expected a Langfuse trace {'id', 'observations': [...], 'scores': [...]}",
        )
        return
    trace_id = trace.get("id") if isinstance(trace.get("id"), str) else None
    if not isinstance(trace.get("scores"), list | None):
        yield failed(number, trace, f"wrong shape: scores: expected a list (trace {trace_id})")
        return
    generations = [o for o in trace["observations"] if isinstance(o, dict) and o.get("type") == "GENERATION"]
    generations.sort(key=lambda o: str(o.get("startTime") or ""))
    if not generations:
        yield failed(number, {"id": trace_id}, f"no GENERATION observation in trace {trace_id}")
        return
    judged = _scores(trace, [str(o.get("id")) for o in generations])
    conversation = conversation_key(trace.get("sessionId"))
    for obs in generations:
        record = {"trace": trace_id, "observation": obs}
        try:
            messages, tools = generation_messages(obs)
            origin = Origin(system="langfuse", trace=trace_id, span=str(obs.get("id")))
            yield Turn(
                number=number,
                raw=record_bytes(record),
                messages=messages,
                metadata={"origin": origin.model_dump(exclude_none=True), "model": obs.get("model")},
                tools=chat_tools(tools),
                conversation_id=conversation,
                assessments=judged[str(obs.get("id"))],
            )
        except TraceError as exc:
            yield failed(number, record, f"wrong shape: {exc} (observation {obs.get('id')})")


def langfuse_turns(path: Path) -> Iterator[Turn]:
    """Every turn of a Langfuse trace export; ``RatchetError`` when the file is not one."""
    whole, why_not = None, f"over {MAX_FILE_BYTES} bytes"
    if path.stat().st_size <= MAX_FILE_BYTES:
        try:
            whole = decode_json(path.read_bytes())
        except TraceError as exc:
            why_not = str(exc)
    if isinstance(whole, dict) and isinstance(whole.get("data"), list):
        whole = whole["data"]
    elif isinstance(whole, dict):
        whole = [whole]
    if isinstance(whole, list):
        if whole and not any(isinstance(t, dict) and "observations" in t for t in whole):
            raise RatchetError(f"{path}: not a Langfuse trace export (no trace with 'observations')")
        for number, trace in enumerate(whole, 1):
            yield from trace_turns(trace, number)
        return
    lines = json_lines(path, max_line_bytes=MAX_TRACE_BYTES)
    first = next(lines, None)
    if (
        first is None
        or first[2] is not None
        or not isinstance(first[1], dict)
        or "observations" not in first[1]
    ):
        why = "empty" if first is None else f"line {first[0]}: {first[2] or 'no observations'}"
        raise RatchetError(
            f"{path}: not a Langfuse trace export (as one JSON document: {why_not}; as JSONL: {why})"
        )
    for number, trace, problem in itertools.chain([first], lines):
        if problem is not None:
            yield failed(number, trace or b"", problem)
        else:
            yield from trace_turns(trace, number)
