"""OTLP JSON spans with the OpenTelemetry GenAI semantic conventions -> turns: ``ratchet ingest --from otel FILE``.

The file is what the SDK's OTLP JSON file exporter writes (``opentelemetry-exporter-otlp-json-file``): one
``ExportTraceServiceRequest`` per line, ``{"resourceSpans": [{"scopeSpans": [{"spans": [...]}]}]}`` (a file
holding one such object over several lines reads too). A span is a turn when it carries a conversation:

- ``gen_ai.input.messages`` / ``gen_ai.output.messages`` (JSON text of parts-based messages: ``text``,
  ``tool_call``, ``tool_call_response`` parts) with ``gen_ai.system_instructions``, as attributes or on a
  ``gen_ai.client.inference.operation.details`` event;
- the older ``gen_ai.prompt`` / ``gen_ai.completion`` attributes (OpenAI chat messages as JSON text);
- the older events ``gen_ai.system.message``, ``gen_ai.user.message``, ``gen_ai.assistant.message``,
  ``gen_ai.tool.message`` and ``gen_ai.choice``.

``gen_ai.tool.definitions`` are its tools, ``gen_ai.conversation.id`` its conversation, and a
``gen_ai.evaluation.result`` event's ``gen_ai.evaluation.score.value`` its rating (counted as the command line's
principal may). Spans without any of these (HTTP calls, tools, agents) are not turns and are skipped.
"""

from __future__ import annotations

import base64
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

MAX_BATCH_BYTES = 64 << 20  # one exported batch (a line): many spans
ROLE_EVENTS = {
    "gen_ai.system.message": "system",
    "gen_ai.user.message": "user",
    "gen_ai.assistant.message": "assistant",
    "gen_ai.tool.message": "tool",
}
DETAILS_EVENT = "gen_ai.client.inference.operation.details"
MESSAGE_KEYS = ("gen_ai.input.messages", "gen_ai.output.messages", "gen_ai.system_instructions")


def any_value(value: Any) -> Any:
    """An OTLP JSON ``AnyValue`` as plain data (an int given as text is an int; bytes are base64 text)."""
    if not isinstance(value, dict):
        return None
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        try:
            return int(value["intValue"])
        except (TypeError, ValueError):
            return None
    for key in ("boolValue", "doubleValue"):
        if key in value:
            return value[key]
    if "arrayValue" in value:
        return [any_value(v) for v in (value["arrayValue"] or {}).get("values") or []]
    if "kvlistValue" in value:
        return attributes((value["kvlistValue"] or {}).get("values"))
    if "bytesValue" in value:
        return value["bytesValue"]
    return None


def attributes(items: Any) -> dict[str, Any]:
    """OTLP JSON ``attributes`` (``[{"key", "value": AnyValue}]``) as a dict."""
    if not isinstance(items, list):
        return {}
    return {
        i["key"]: any_value(i.get("value"))
        for i in items
        if isinstance(i, dict) and isinstance(i.get("key"), str)
    }


def _json(value: Any, where: str) -> Any:
    if isinstance(value, str):
        try:
            return decode_json(value.encode("utf-8", "surrogatepass"))
        except TraceError as exc:
            raise TraceError(f"{where}: {exc}") from None
    return value


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return record_bytes(value).decode()


def parts_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """GenAI parts-based messages as OpenAI chat messages: text parts joined as content, ``tool_call`` parts
    as tool calls, each ``tool_call_response`` part as a tool message."""
    messages = _json(messages, where)
    if not isinstance(messages, list):
        raise TraceError(f"{where}: expected a list of messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("parts"), list):
            raise TraceError(f"{where}[{i}]: expected {{'role', 'parts': [...]}}")
        role, texts, calls = message.get("role"), [], []
        for part in message["parts"]:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":  # reasoning, files and blobs are not kept
                texts.append(_text(part.get("content")))
            elif kind == "tool_call":
                calls.append(
                    {
                        "id": part.get("id"),
                        "function": {"name": part.get("name"), "arguments": part.get("arguments")},
                    }
                )
            elif kind == "tool_call_response":
                response = part.get("response", part.get("result"))
                out.append({"role": "tool", "tool_call_id": part.get("id"), "content": _text(response)})
        if texts or calls or role != "tool":
            msg: dict[str, Any] = {"role": role, "content": "".join(texts) if texts or not calls else None}
            if calls:
                msg["tool_calls"] = calls
            if message.get("name"):
                msg["name"] = message["name"]
            out.append(chat_message(msg))
    return out


def _instructions(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    value = _json(value, "gen_ai.system_instructions")
    if isinstance(value, list):
        value = "".join(
            _text(p.get("content")) for p in value if isinstance(p, dict) and p.get("type") == "text"
        )
    return [{"role": "system", "content": _text(value)}]


def _openai_messages(value: Any, where: str, role: str) -> list[dict[str, Any]]:
    value = _json(value, where) if isinstance(value, str) and value[:1] in "[{" else value
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, dict):
        value = [value.get("message", value)]
    if not isinstance(value, list):
        raise TraceError(f"{where}: expected chat messages")
    return [
        chat_message({"role": role, **m} if isinstance(m, dict) and "role" not in m else m) for m in value
    ]


def _event_messages(events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    answer = None
    for name, attrs in events:
        if name in ROLE_EVENTS:
            msg = {"role": attrs.get("role") or ROLE_EVENTS[name], "content": attrs.get("content")}
            if attrs.get("tool_calls") is not None:
                msg["tool_calls"] = _json(attrs["tool_calls"], f"{name}.tool_calls")
            if attrs.get("id") is not None and msg["role"] == "tool":
                msg["tool_call_id"] = attrs["id"]
            out.append(chat_message(msg))
        elif name == "gen_ai.choice" and answer is None and attrs.get("index", 0) in (0, None):
            message = _json(attrs.get("message"), "gen_ai.choice.message") or {}
            if not isinstance(message, dict):
                message = {"content": message}
            message = {"content": attrs.get("content"), "tool_calls": attrs.get("tool_calls"), **message}
            if isinstance(message.get("tool_calls"), str):
                message["tool_calls"] = _json(message["tool_calls"], "gen_ai.choice.tool_calls")
            answer = chat_message({**message, "role": "assistant"})
    return out + ([answer] if answer is not None else [])


def span_turn(span: dict[str, Any], number: int) -> Turn | None:
    """The turn one span carries, None for a span that is not a GenAI chat call."""
    attrs = attributes(span.get("attributes"))
    given = span.get("events")
    events = [
        (e.get("name"), attributes(e.get("attributes")))
        for e in (given if isinstance(given, list) else [])
        if isinstance(e, dict) and isinstance(e.get("name"), str)
    ]
    for name, event_attrs in events:
        if name == DETAILS_EVENT:
            attrs.update({k: v for k, v in event_attrs.items() if k in MESSAGE_KEYS})
    talk = [e for e in events if e[0] in ROLE_EVENTS or e[0] == "gen_ai.choice"]
    has = any(k in attrs for k in (*MESSAGE_KEYS, "gen_ai.prompt", "gen_ai.completion"))
    if not has and not talk:
        return None
    trace_id, span_id = _id(span.get("traceId")), _id(span.get("spanId"))
    record = {
        "traceId": trace_id,
        "spanId": span_id,
        "name": span.get("name"),
        "attributes": attrs,
        "events": events,
    }
    try:
        if given is not None and not isinstance(given, list):
            raise TraceError("events: expected a list")
        if "gen_ai.input.messages" in attrs or "gen_ai.output.messages" in attrs:
            messages = _instructions(attrs.get("gen_ai.system_instructions"))
            messages += parts_messages(attrs.get("gen_ai.input.messages", "[]"), "gen_ai.input.messages")
            messages += parts_messages(attrs.get("gen_ai.output.messages", "[]"), "gen_ai.output.messages")[
                :1
            ]
        elif "gen_ai.prompt" in attrs or "gen_ai.completion" in attrs:
            messages = _openai_messages(attrs.get("gen_ai.prompt", []), "gen_ai.prompt", "user")
            messages += _openai_messages(
                attrs.get("gen_ai.completion", []), "gen_ai.completion", "assistant"
            )[:1]
        else:
            messages = _event_messages(talk)
        found = Assessments()
        for name, event_attrs in events:
            score = event_attrs.get("gen_ai.evaluation.score.value")
            if (
                name == "gen_ai.evaluation.result"
                and isinstance(score, int | float)
                and not isinstance(score, bool)
            ):
                found.rating = float(score)
        tools = attrs.get("gen_ai.tool.definitions")
        origin = Origin(system="otel", trace=trace_id, span=span_id)
        return Turn(
            number=number,
            raw=record_bytes(record),
            messages=messages,
            metadata={
                "origin": origin.model_dump(exclude_none=True),
                "model": attrs.get("gen_ai.response.model") or attrs.get("gen_ai.request.model"),
            },
            tools=chat_tools(_json(tools, "gen_ai.tool.definitions")),
            conversation_id=conversation_key(attrs.get("gen_ai.conversation.id")),
            assessments=found,
        )
    except TraceError as exc:
        return failed(number, record, f"wrong shape: {exc} (span {span_id})")


def _id(value: Any) -> str | None:
    """A trace or span id as hex (OTLP JSON writes hex; protobuf's JSON mapping base64)."""
    if not isinstance(value, str) or not value:
        return None
    if len(value) in (16, 32) and all(c in "0123456789abcdefABCDEF" for c in value):
        return value.lower()
    try:
        return base64.b64decode(value, validate=True).hex()
    except ValueError:
        return value[:64]


def request_turns(request: Any, number: int) -> Iterator[Turn]:
    """The turns of one ``ExportTraceServiceRequest``."""
    if not isinstance(request, dict) or not isinstance(request.get("resourceSpans"), list):
        yield failed(number, request, "wrong shape: expected an OTLP JSON object {'resourceSpans': [...]}")
        return
    for resource in request["resourceSpans"]:
        scopes = resource.get("scopeSpans") if isinstance(resource, dict) else None
        for scope in scopes if isinstance(scopes, list) else []:
            spans = scope.get("spans") if isinstance(scope, dict) else None
            for span in spans if isinstance(spans, list) else []:
                turn = (
                    span_turn(span, number)
                    if isinstance(span, dict)
                    else failed(number, span, "wrong shape: span: expected an object")
                )
                if turn is not None:
                    yield turn


def otlp_turns(path: Path) -> Iterator[Turn]:
    """Every GenAI turn in an OTLP JSON file; ``RatchetError`` when the file is not OTLP JSON at all."""
    lines = json_lines(path, max_line_bytes=MAX_BATCH_BYTES)
    first = next(lines, None)
    if first is None:
        raise RatchetError(f'{path}: empty (expected OTLP JSON: one {{"resourceSpans": [...]}} per line)')
    number, obj, problem = first
    if problem is not None or not isinstance(obj, dict) or "resourceSpans" not in obj:
        whole = _whole(path)
        if whole is None:
            why = problem or "no 'resourceSpans'"
            raise RatchetError(f"{path}: not an OTLP JSON file (line {number}: {why})")
        yield from request_turns(whole, 1)
        return
    yield from request_turns(obj, number)
    for number, obj, problem in lines:
        if problem is not None:
            yield failed(number, obj or b"", problem)
        else:
            yield from request_turns(obj, number)


def _whole(path: Path) -> dict[str, Any] | None:
    """The file as one OTLP JSON object (pretty-printed over several lines), or None."""
    if path.stat().st_size > MAX_BATCH_BYTES:
        return None
    try:
        obj = decode_json(path.read_bytes())
    except TraceError:
        return None
    return obj if isinstance(obj, dict) and "resourceSpans" in obj else None
