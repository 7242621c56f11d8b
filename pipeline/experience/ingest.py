"""Experience ingest: stream a JSONL file of traces into the registry.

One trace per line: ``{"messages": [...], "metadata": {...}, "feedback": ...}`` in OpenAI chat format.
Reading is streamed (memory stays flat for a multi-GB file), inserts are batched, a trace already
stored (same content hash) is counted as a duplicate, and every malformed line goes to the
quarantine table with its line number and reason. Nothing is silently dropped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from pipeline.errors import NotFoundError, RatchetError
from pipeline.experience.principals import LOOP, OPERATOR
from pipeline.experience.principals import NAME as PRINCIPAL_NAME
from pipeline.experience.toolcalls import normalize_tool_calls, tools_problem
from pipeline.registry.experience import (
    ANY_CONTENT,
    SOURCES,
    TraceRow,
    insert_traces,
    line_key,
    quarantine_lines,
    quarantined_lines,
)

log = logging.getLogger(__name__)

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
TRACE_KEYS = frozenset({"messages", "metadata", "feedback", "routes", "id"})
MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "refusal"})
DEFAULT_MAX_LINE_BYTES = 1 << 20  # 1 MiB
RAW_KEEP = 4096  # bytes of a bad line kept in quarantine
REASON_KEEP = 500  # characters of a quarantine reason (it may quote the input)
MAX_NAME_CHARS = 100  # the registry's specialist column
MAX_DEPTH = 254  # nesting orjson writes back (and every later reader of the stored JSON can take)
_SORT = orjson.OPT_SORT_KEYS
# an integer of 19 or more digits, which orjson would round to a float beyond 64 bits (as in registry.models)
_LONG_NUMBER = re.compile(rb"(?<![\d.eE])-?\d{19,}(?![\d.eE])")
_DIGITS = bytes.maketrans(b"123456789", b"000000000")  # a run of 19 digits becomes 19 zeros: a fast pre-check


class TraceError(ValueError):
    """Why one trace is malformed (the message becomes the quarantine reason)."""


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_name(value: Any, where: str) -> None:
    if type(value) is str and 0 < len(value) <= MAX_NAME_CHARS and value.isprintable():
        return
    raise TraceError(
        f"{where}: expected a specialist name (1 to {MAX_NAME_CHARS} printable characters), got {_show(value)}"
    )


def _check_scores(scores: Any, where: str) -> None:
    # a router's scores: {specialist: {signal: number}} (pipeline.serving.router.RouteDecision); plain loops:
    # this runs for every ingested line
    if scores is None:
        return
    ok = type(scores) is dict
    for signals in scores.values() if ok else ():
        ok = type(signals) is dict and all(type(x) is int or type(x) is float for x in signals.values())
        if not ok:
            break
    if not ok:
        raise TraceError(f"{where}: expected {{specialist: {{signal: number}}}}, got {_show(scores)}")


def _check_routes(routes: Any, turns: int) -> None:
    shape = "{'turn': int, 'specialist': str, 'reason': str, 'scores': {...}}"
    if type(routes) is not list:
        raise TraceError(f"routes: expected a list of {shape}, got {_show(routes)}")
    for i, route in enumerate(routes):
        if type(route) is not dict:
            raise TraceError(f"routes[{i}]: expected {shape}, got {_show(route)}")
        turn = route.get("turn")
        if type(turn) is not int or not 0 <= turn < turns:
            raise TraceError(
                f"routes[{i}].turn: expected the index of a message (0 to {turns - 1}), got {_show(turn)}"
            )
        _check_name(route.get("specialist"), f"routes[{i}].specialist")
        if route.get("reason") is not None and type(route["reason"]) is not str:
            raise TraceError(f"routes[{i}].reason: expected text, got {_show(route['reason'])}")
        _check_scores(route.get("scores"), f"routes[{i}].scores")


def _check_metadata(metadata: dict[str, Any]) -> None:
    # the fields Ratchet itself reads with a type (the rest of metadata is the scorers' and the user's)
    if metadata.get("specialist") is not None:
        _check_name(metadata["specialist"], "metadata.specialist")
    summaries = metadata.get("summaries")
    if summaries is not None and (
        type(summaries) is not dict or not all(type(v) is str for v in summaries.values())
    ):
        raise TraceError(f"metadata.summaries: expected {{turn: text}}, got {_show(summaries)}")
    _check_scores(metadata.get("route_scores"), "metadata.route_scores")
    if problem := tools_problem(metadata.get("tools")):  # what a chat template is given in training
        raise TraceError(f"metadata.tools{'' if problem.startswith('[') else ': '}{problem}")


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
        # arguments that are not JSON text (an object, as some clients write them) are stored as JSON text
        # (``validate_trace``: ``toolcalls.normalize_tool_calls``)


def validate_trace(obj: Any) -> dict[str, Any]:
    """Check one decoded trace against the OpenAI chat shape; raise ``TraceError`` naming the bad field."""
    if type(obj) is not dict:
        raise TraceError(f"expected a JSON object per line, got {type(obj).__name__}")
    for key in obj:
        if key not in TRACE_KEYS:
            raise TraceError(f"unknown field {_show(key)}; expected {sorted(TRACE_KEYS)}")
    messages = obj.get("messages")
    if type(messages) is not list or not messages:
        raise TraceError("messages: expected a non-empty list of chat messages")
    for i, msg in enumerate(messages):
        if type(msg) is not dict:
            raise TraceError(f"messages[{i}]: expected an object with 'role' and 'content'")
        for key in msg:
            if key not in MESSAGE_KEYS:
                raise TraceError(f"messages[{i}]: unknown field {_show(key)}")
        role = msg.get("role")
        if type(role) is not str or role not in ROLES:
            raise TraceError(f"messages[{i}].role: expected one of {sorted(ROLES)}, got {_show(role)}")
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
    _check_metadata(metadata)
    feedback = obj.get("feedback")
    if feedback is not None:
        _check_feedback(feedback)
    routes = obj.get("routes")
    routes = [] if routes is None else routes
    _check_routes(routes, len(messages))
    messages = normalize_tool_calls(messages)  # tool-call arguments stored as JSON text, whoever wrote them
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


def _nesting(obj: Any) -> int:
    deepest, stack = 0, [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if type(value) in (dict, list):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in (value.values() if type(value) is dict else value))
    return deepest


def parse_line(raw: bytes) -> dict[str, Any]:
    """Decode and validate one JSONL line; raise ``TraceError`` with the quarantine reason."""
    obj = decode_json(raw)
    try:
        return validate_trace(obj)
    except TraceError as exc:
        raise TraceError(f"wrong shape: {exc}") from None


def decode_json(raw: bytes) -> Any:
    """Decode one untrusted JSON text (a line, a record); raise ``TraceError`` with the quarantine reason.

    Exact: an integer beyond 64 bits (which orjson would round to a float) is read by the standard parser.
    """
    nul = raw.find(b"\x00")
    if nul >= 0:
        raise TraceError(
            f"bad JSON: raw NUL byte at byte {nul} (JSON text has none; a string writes \\u0000)"
        )
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if "utf-8" in str(exc).lower():
            raise TraceError("invalid UTF-8") from None
        raise TraceError(f"bad JSON: {exc}") from None
    # brackets over-count (they may sit in strings); only then is the real depth measured
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH and _nesting(obj) > MAX_DEPTH:
        raise TraceError(f"too deeply nested: more than {MAX_DEPTH} levels of lists and objects")
    if b"0" * 19 in raw.translate(_DIGITS) and _LONG_NUMBER.search(raw) is not None:
        try:
            obj = json.loads(raw.decode("utf-8"))
        except ValueError as exc:  # Python's limit on an integer's digits
            raise TraceError(f"number too large: {str(exc).split(':')[0]}") from None
    return obj


def _dumps(value: Any) -> bytes:
    try:
        return orjson.dumps(value, option=_SORT)
    except orjson.JSONEncodeError:  # an integer beyond 64 bits: the standard encoder writes it exactly
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True).encode()


def trace_row(
    trace: dict[str, Any],
    *,
    source: str,
    generation_id: int | None = None,
    harness_version_id: int | None = None,
    completion_id: str | None = None,
    principal: str | None = None,
    conversation_id: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    served_tokens: dict[str, Any] | None = None,
) -> TraceRow:
    """Serialise a validated trace canonically and compute its content hash; ``principal``: who sent it.
    ``conversation_id`` / ``tools`` / ``served_tokens``: the ``Experience`` columns of the same names (the
    first two are part of the content hash: the same messages in another conversation are another trace)."""
    messages = _dumps(trace["messages"])
    metadata = _dumps(trace.get("metadata") or {})
    feedback = trace.get("feedback")
    feedback_json = None if feedback is None else _dumps(feedback)
    routes = trace.get("routes") or []
    digest = hashlib.sha256(messages)
    digest.update(b"\x1e")
    digest.update(metadata)
    digest.update(b"\x1e")
    digest.update(feedback_json or b"null")
    if completion_id is not None:
        digest.update(b"\x1e" + completion_id.encode())
    tools_json = None if tools is None else _dumps(tools)
    if conversation_id is not None or tools_json is not None:
        digest.update(b"\x1e" + (conversation_id or "").encode() + b"\x1e" + (tools_json or b"null"))
    specialist = routes[-1]["specialist"] if routes else trace["metadata"].get("specialist")
    return TraceRow(
        content_hash=digest.hexdigest(),
        messages=messages.decode(),
        metadata=metadata.decode(),
        feedback=None if feedback_json is None else feedback_json.decode(),
        routes=_dumps(routes).decode(),
        specialist=specialist if isinstance(specialist, str) else None,
        source=source,
        generation_id=generation_id,
        harness_version_id=harness_version_id,
        completion_id=completion_id,
        principal=principal,
        conversation_id=conversation_id,
        tools=None if tools_json is None else tools_json.decode(),
        served_tokens=None if served_tokens is None else _dumps(served_tokens).decode(),
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


def iter_lines(
    path: Path, *, max_line_bytes: int
) -> Iterator[tuple[int, bytes | None, str | None, str | None]]:
    """Yield (line number, raw bytes, None, None), or (line number, None, reason, sha256 of the line) for
    oversized lines.

    Lines longer than ``max_line_bytes`` are never held in memory whole: the rest is skipped in chunks (and
    hashed on the way, so that quarantine knows the line by its content too).
    """
    with open(path, "rb") as fh:
        number = 0
        while True:
            line = fh.readline(max_line_bytes + 1)
            if not line:
                return
            number += 1
            if len(line) > max_line_bytes and not line.endswith(b"\n"):
                size, digest = len(line), hashlib.sha256(line)
                while line and not line.endswith(b"\n"):
                    line = fh.readline(1 << 20)
                    size += len(line)
                    digest.update(line)
                yield (
                    number,
                    None,
                    f"oversized line ({size} bytes > limit {max_line_bytes})",
                    digest.hexdigest(),
                )
                continue
            yield number, line, None, None


def reason_kind(reason: str) -> str:
    """What a quarantine reason is counted under in a summary: its text before the first ``:`` or `` (``."""
    return reason.split(":", 1)[0].split(" (", 1)[0]


def quarantine_text(raw: bytes | None) -> str:
    """What quarantine keeps of a bad line: its first ``RAW_KEEP`` bytes as text. Invalid UTF-8 becomes
    U+FFFD; a raw NUL (no database text column takes one) becomes JSON's own escape ``\\u0000``, which
    turns a line whose only fault is that NUL into the valid JSON line it meant."""
    return (raw or b"")[:RAW_KEEP].decode("utf-8", errors="replace").replace("\x00", "\\u0000")


def already_quarantined(earlier: tuple[Any, Any], number: int, digest: str) -> bool:
    """Whether this file's line ``number`` with this content is in quarantine already (a line quarantined
    before its hash was kept matches any content at its number, as before)."""
    numbers, keys = earlier
    key = line_key(digest)
    i = bisect_left(numbers, number)
    while i < len(numbers) and numbers[i] == number:
        if keys[i] in (key, ANY_CONTENT):
            return True
        i += 1
    return False


def ingest_file(
    path: str | Path,
    *,
    session_factory: Callable[[], Any],
    source: str = "import",
    principal: str = OPERATOR,
    generation_id: int | None = None,
    harness_version_id: int | None = None,
    batch_size: int = 2000,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    progress: Callable[[int, int], None] | None = None,
) -> IngestResult:
    """Stream ``path`` into the registry; each batch is committed on its own (a crash loses nothing stored).

    Rerunnable: a trace already stored counts as a duplicate, and a line of this file already quarantined
    (same file name, line number and content, e.g. by a run that was killed) counts as quarantined without a
    second quarantine row; a different bad line at the same number (a rotated log) gets its own row. ``session_factory`` returns a context manager yielding a Session (e.g.
    ``session_scope``). ``progress(bytes_done, bytes_total)`` is called after every batch.

    Ingest is the operator's own trusted path: the traces' metadata and feedback count as given (a key's
    ``certify``, ``rate`` and ``correct`` scopes together). ``principal`` names whose traces they are:
    ``operator`` (the default: the operator's own) or the outside party they came from (``--principal``),
    whose share of a specialist's dataset the contract caps (``selection.max_share_per_principal``).
    """

    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "no such file"
        raise NotFoundError(f"{path}: {what} (expected a JSONL file of traces)")
    if source not in SOURCES:
        raise RatchetError(f"unknown source {source!r}: expected one of {', '.join(SOURCES)}")
    if principal == LOOP or not PRINCIPAL_NAME.fullmatch(principal):
        raise RatchetError(
            f"principal {principal!r}: expected a letter, then letters, digits, _ . - (and not {LOOP!r}, the "
            "loop's own practice)"
        )
    # a file name that is not UTF-8 (Linux allows any bytes) is kept with its odd bytes escaped
    source_file = os.fsencode(path).decode("utf-8", errors="backslashreplace")
    total = os.path.getsize(path)
    done = 0

    def entries() -> Iterator[tuple[int, bytes | None, TraceRow | str, str | None]]:
        nonlocal done
        for number, raw, problem, digest in iter_lines(path, max_line_bytes=max_line_bytes):
            done += len(raw) if raw is not None else 0
            if raw is not None and not raw.strip():
                continue  # blank lines (e.g. a trailing newline) are not traces
            if problem is None:
                try:
                    row = trace_row(
                        parse_line(raw),
                        source=source,
                        generation_id=generation_id,
                        harness_version_id=harness_version_id,
                        principal=principal,
                    )
                except TraceError as exc:
                    problem = str(exc)
                else:
                    yield number, raw, row, digest
                    continue
            yield number, raw, problem, digest

    result = store_traces(
        entries(),
        result=IngestResult(file=str(path)),
        source_file=source_file,
        session_factory=session_factory,
        batch_size=batch_size,
        after_batch=(lambda: progress(done, total)) if progress else None,
    )
    log.info("ingested %s: %s", path, result)
    return result


def store_traces(
    entries: Iterable[tuple[int, bytes | None, TraceRow | str, str | None]],
    *,
    result: IngestResult,
    source_file: str,
    session_factory: Callable[[], Any],
    batch_size: int,
    after_batch: Callable[[], None] | None = None,
) -> IngestResult:
    """Store ``entries`` into ``result``'s counts, in batches of ``batch_size`` each committed on its own.

    An entry is ``(number, raw, row or the reason it cannot be one, sha256 of raw or None)``: a row already
    stored (or already in its batch) counts as a duplicate; a reason is quarantined under ``source_file``
    once per number and content (a rerun after a crash adds no second row). ``after_batch`` is called
    after every batch is committed.
    """
    with session_factory() as session:
        earlier = quarantined_lines(session=session, source_file=source_file)
    rows: list[TraceRow] = []
    bad: list[tuple[int, str, str, str]] = []
    seen: set[str] = set()

    def flush() -> None:
        with session_factory() as session:
            stored = insert_traces(session=session, rows=rows)
            if bad:
                quarantine_lines(session=session, source_file=source_file, entries=bad)
        result.stored += stored
        result.duplicate += len(rows) - stored
        rows.clear()
        bad.clear()
        if after_batch:
            after_batch()

    for number, raw, row, digest in entries:
        result.lines += 1
        if isinstance(row, TraceRow):
            if row.content_hash in seen:
                result.duplicate += 1
            else:
                seen.add(row.content_hash)
                rows.append(row)
        else:
            result.quarantined += 1
            kind = reason_kind(row)
            result.reasons[kind] = result.reasons.get(kind, 0) + 1
            digest = digest or hashlib.sha256(raw or b"").hexdigest()
            if not already_quarantined(earlier, number, digest):
                reason = row if len(row) <= REASON_KEEP else row[: REASON_KEEP - 3] + "..."
                bad.append((number, reason, quarantine_text(raw), digest))
        if len(rows) >= batch_size or len(bad) >= batch_size:
            flush()
            seen.clear()
    flush()
    return result
