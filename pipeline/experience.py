"""Experience ingest: stream a JSONL file of traces into the registry.

One trace per line: ``{"messages": [...], "metadata": {...}, "feedback": ...}`` in OpenAI chat format.
Reading is streamed (memory stays flat for a multi-GB file), inserts are batched, a trace already
stored (same content hash) is counted as a duplicate, and every malformed line goes to the
quarantine table with its line number and reason. Nothing is silently dropped.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from pipeline.errors import NotFoundError, RatchetError
from pipeline.registry.experience import SOURCES, TraceRow

log = logging.getLogger(__name__)

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
TRACE_KEYS = frozenset({"messages", "metadata", "feedback", "routes", "id"})
MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "refusal"})
DEFAULT_MAX_LINE_BYTES = 1 << 20  # 1 MiB
RAW_KEEP = 4096  # bytes of a bad line kept in quarantine
_SORT = orjson.OPT_SORT_KEYS


class TraceError(ValueError):
    """Why one trace is malformed (the message becomes the quarantine reason)."""


def _check_content(content: Any, where: str) -> None:
    if content is None or isinstance(content, str):
        return
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise TraceError(f"{where}.content[{j}]: expected a content part object with a 'type'")
        return
    raise TraceError(
        f"{where}.content: expected a string, null or a list of parts, got {type(content).__name__}"
    )


def _check_tool_calls(calls: Any, where: str) -> None:
    if not isinstance(calls, list):
        raise TraceError(f"{where}.tool_calls: expected a list")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise TraceError(
                f"{where}.tool_calls[{j}]: expected {{'function': {{'name': str, 'arguments': str}}}}"
            )
        if not isinstance(fn.get("arguments", ""), str):
            raise TraceError(f"{where}.tool_calls[{j}].function.arguments: expected a JSON string")


def validate_trace(obj: Any) -> dict[str, Any]:
    """Check one decoded trace against the OpenAI chat shape; raise ``TraceError`` naming the bad field."""
    if type(obj) is not dict:
        raise TraceError(f"expected a JSON object per line, got {type(obj).__name__}")
    for key in obj:
        if key not in TRACE_KEYS:
            raise TraceError(f"unknown field {key!r}; expected {sorted(TRACE_KEYS)}")
    messages = obj.get("messages")
    if type(messages) is not list or not messages:
        raise TraceError("messages: expected a non-empty list of chat messages")
    for i, msg in enumerate(messages):
        if type(msg) is not dict:
            raise TraceError(f"messages[{i}]: expected an object with 'role' and 'content'")
        for key in msg:
            if key not in MESSAGE_KEYS:
                raise TraceError(f"messages[{i}]: unknown field {key!r}")
        role = msg.get("role")
        if role not in ROLES:
            raise TraceError(f"messages[{i}].role: expected one of {sorted(ROLES)}, got {role!r}")
        content = msg.get("content")
        if type(content) is not str:
            if "content" not in msg and not msg.get("tool_calls"):
                raise TraceError(f"messages[{i}]: missing 'content'")
            _check_content(content, f"messages[{i}]")
        if "tool_calls" in msg:
            if role != "assistant":
                raise TraceError(f"messages[{i}].tool_calls: only assistant messages make tool calls")
            _check_tool_calls(msg["tool_calls"], f"messages[{i}]")
        elif role == "tool" and type(msg.get("tool_call_id")) is not str:
            raise TraceError(
                f"messages[{i}].tool_call_id: a tool message needs the id of the call it answers"
            )
    metadata = obj.get("metadata")
    if metadata is None:
        metadata = {}
    elif type(metadata) is not dict:
        raise TraceError("metadata: expected an object")
    feedback = obj.get("feedback")
    if feedback is not None:
        _check_feedback(feedback)
    routes = obj.get("routes") or []
    if type(routes) is not list or any(type(r) is not dict or "specialist" not in r for r in routes):
        raise TraceError("routes: expected a list of {'turn': int, 'specialist': str, ...}")
    return {"messages": messages, "metadata": metadata, "feedback": feedback, "routes": routes}


def _check_feedback(feedback: Any) -> None:
    if isinstance(feedback, bool) or not isinstance(feedback, int | float | dict):
        raise TraceError("feedback: expected null, a number, or {'rating': number, 'correction': str}")
    if isinstance(feedback, dict):
        if feedback.keys() - {"rating", "correction", "comment"}:
            raise TraceError("feedback: expected keys rating, correction, comment")
        rating = feedback.get("rating")
        if rating is not None and (isinstance(rating, bool) or not isinstance(rating, int | float)):
            raise TraceError("feedback.rating: expected a number")
        if feedback.get("correction") is not None and not isinstance(feedback["correction"], str):
            raise TraceError("feedback.correction: expected a string")


def trace_row(
    trace: dict[str, Any],
    *,
    source: str,
    generation_id: int | None = None,
    harness_version_id: int | None = None,
    completion_id: str | None = None,
) -> TraceRow:
    """Serialise a validated trace canonically and compute its content hash."""
    messages = orjson.dumps(trace["messages"], option=_SORT)
    metadata = orjson.dumps(trace.get("metadata") or {}, option=_SORT)
    feedback = trace.get("feedback")
    feedback_json = None if feedback is None else orjson.dumps(feedback, option=_SORT)
    routes = trace.get("routes") or []
    digest = hashlib.sha256(messages)
    digest.update(b"\x1e")
    digest.update(metadata)
    digest.update(b"\x1e")
    digest.update(feedback_json or b"null")
    if completion_id is not None:
        digest.update(b"\x1e" + completion_id.encode())
    specialist = routes[-1]["specialist"] if routes else trace["metadata"].get("specialist")
    return TraceRow(
        content_hash=digest.hexdigest(),
        messages=messages.decode(),
        metadata=metadata.decode(),
        feedback=None if feedback_json is None else feedback_json.decode(),
        routes=orjson.dumps(routes, option=_SORT).decode(),
        specialist=specialist if isinstance(specialist, str) else None,
        source=source,
        generation_id=generation_id,
        harness_version_id=harness_version_id,
        completion_id=completion_id,
    )


@dataclass
class IngestResult:
    """What one ingest did: every line is counted in exactly one of stored/duplicate/quarantined."""

    file: str
    lines: int = 0
    stored: int = 0
    duplicate: int = 0
    quarantined: int = 0
    reasons: dict[str, int] = field(default_factory=dict)


def iter_lines(path: Path, *, max_line_bytes: int) -> Iterator[tuple[int, bytes | None, str | None]]:
    """Yield (line number, raw bytes, None) or (line number, None, reason) for oversized lines.

    Lines longer than ``max_line_bytes`` are never held in memory whole: the rest is skipped in chunks.
    """
    with open(path, "rb") as fh:
        number = 0
        while True:
            line = fh.readline(max_line_bytes + 1)
            if not line:
                return
            number += 1
            if len(line) > max_line_bytes and not line.endswith(b"\n"):
                size = len(line)
                while line and not line.endswith(b"\n"):
                    line = fh.readline(1 << 20)
                    size += len(line)
                yield number, None, f"oversized line ({size} bytes > limit {max_line_bytes})"
                continue
            yield number, line, None


def _reason_kind(reason: str) -> str:
    return reason.split(":", 1)[0].split(" (", 1)[0]


def ingest_file(
    path: str | Path,
    *,
    session_factory: Callable[[], Any],
    source: str = "import",
    generation_id: int | None = None,
    harness_version_id: int | None = None,
    batch_size: int = 2000,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    progress: Callable[[int, int], None] | None = None,
) -> IngestResult:
    """Stream ``path`` into the registry; each batch is committed on its own (a crash loses nothing stored).

    ``session_factory`` returns a context manager yielding a Session (e.g. ``session_scope``).
    ``progress(bytes_done, bytes_total)`` is called after every batch.
    """
    from pipeline.registry.experience import insert_traces, quarantine_lines

    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "no such file"
        raise NotFoundError(f"{path}: {what} (expected a JSONL file of traces)")
    if source not in SOURCES:
        raise RatchetError(f"unknown source {source!r}: expected one of {', '.join(SOURCES)}")
    total = os.path.getsize(path)
    result = IngestResult(file=str(path))
    rows: list[TraceRow] = []
    bad: list[tuple[int, str, str]] = []
    seen: set[str] = set()
    done = 0

    def flush() -> None:
        with session_factory() as session:
            stored = insert_traces(session=session, rows=rows)
            if bad:
                quarantine_lines(session=session, source_file=str(path), entries=bad)
        result.stored += stored
        result.duplicate += len(rows) - stored
        rows.clear()
        bad.clear()
        if progress:
            progress(done, total)

    for number, raw, problem in iter_lines(path, max_line_bytes=max_line_bytes):
        result.lines += 1
        done += len(raw) if raw is not None else 0
        if raw is not None and not raw.strip():
            result.lines -= 1  # blank lines (e.g. a trailing newline) are not traces
            continue
        if problem is None:
            try:
                trace = validate_trace(orjson.loads(raw))
                row = trace_row(
                    trace, source=source, generation_id=generation_id, harness_version_id=harness_version_id
                )
            except orjson.JSONDecodeError as exc:
                problem = "invalid UTF-8" if "utf-8" in str(exc).lower() else f"bad JSON: {exc}"
            except TraceError as exc:
                problem = f"wrong shape: {exc}"
            else:
                if row.content_hash in seen:
                    result.duplicate += 1
                else:
                    seen.add(row.content_hash)
                    rows.append(row)
        if problem is not None:
            result.quarantined += 1
            kind = _reason_kind(problem)
            result.reasons[kind] = result.reasons.get(kind, 0) + 1
            text = (raw or b"")[:RAW_KEEP].decode("utf-8", errors="replace")
            bad.append((number, problem, text))
        if len(rows) >= batch_size or len(bad) >= batch_size:
            flush()
            seen.clear()
    flush()
    log.info("ingested %s: %s", path, result)
    return result
