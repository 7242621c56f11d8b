"""What every importer shares: a turn read from another system's trace store enters the registry exactly as a
line of ``ratchet ingest`` does (the same validation, canonical rows and content hash, so importing the same
source twice adds nothing), and what cannot be read is quarantined per record, with its reason.

Records are untrusted input: JSON only (never code), each record bounded in size (``MAX_RECORD_BYTES``) and
decoded under ingest's rules (``ingest.decode_json``: no NUL byte, bounded nesting, exact big integers).

Principals: ratings, corrections and expectations found in a store count only as given by the principal named
on the command line, and only with its scopes (``pipeline.experience.principals``): ``operator`` (the default)
has every scope; the name of an API key in this registry has the key's scopes (none once revoked); any other
name has none. What does not count is kept under ``feedback.claimed`` / ``metadata.claimed``, shown and never
scored, as a served turn's client without those scopes.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select

from pipeline.errors import RatchetError
from pipeline.experience.ingest import (
    DEFAULT_MAX_LINE_BYTES,
    IngestResult,
    TraceError,
    decode_json,
    iter_lines,
    store_traces,
    trace_row,
    validate_trace,
)
from pipeline.experience.principals import LOOP, NAME, OPERATOR, OPERATOR_PRINCIPAL, Principal
from pipeline.experience.toolcalls import arguments_text, tools_problem
from pipeline.registry.experience import SOURCES, TraceRow
from pipeline.registry.models import ApiKey

log = logging.getLogger(__name__)

MAX_RECORD_BYTES = DEFAULT_MAX_LINE_BYTES  # one turn as read (its messages, tools and assessments)
MAX_CONVERSATION_CHARS = 100  # the registry's column; a longer id is stored as its sha256
# an expectation's name -> the metadata key the contract's scorers read it from (``principals``: certify)
EXPECTED_KEYS = {
    "expected": "expected",
    "expected_response": "expected",
    "expected_output": "expected",
    "expected_answer": "expected",
    "tests": "tests",
    "schema": "schema",
    "expected_call": "expected_call",
    "split": "split",
}
CORRECTION_NAMES = frozenset({"correction", "corrected_response", "corrected_answer"})
MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id", "refusal")


class Origin(BaseModel):
    """Where an imported turn came from (``metadata.origin``): the store and the record's ids there."""

    model_config = ConfigDict(extra="forbid")

    system: str = Field(description="The trace store: mlflow, otel, langfuse or openai.")
    trace: str | None = Field(None, description="The trace's (or stored completion's) id in that store.")
    span: str | None = Field(None, description="The span's (or observation's) id of the chat call, if any.")
    experiment: str | None = Field(None, description="The MLflow experiment id the trace was found in.")


@dataclass
class Assessments:
    """What a store says about a turn: a rating, a corrected answer, expectations (verification material)."""

    rating: float | None = None
    correction: str | None = None
    expectations: dict[str, Any] = field(default_factory=dict)
    others: dict[str, Any] = field(default_factory=dict)  # other judgements, shown as metadata.assessments


@dataclass
class Turn:
    """One turn read from a store, ready for the ingest path, or why it cannot be (``problem``)."""

    number: int  # where it sits in its source (a line, the n-th record): quarantine's line number
    raw: bytes  # the record as read, JSON: what quarantine keeps and knows it by
    messages: list[dict[str, Any]] | None = None  # OpenAI chat messages, the answer last
    metadata: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None
    conversation_id: str | None = None
    assessments: Assessments = field(default_factory=Assessments)
    problem: str | None = None


def record_bytes(record: Any) -> bytes:
    """A record as JSON text (what quarantine keeps); ``TraceError`` when it is not JSON data."""
    try:
        return orjson.dumps(record, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    except (orjson.JSONEncodeError, TypeError) as exc:
        raise TraceError(f"not JSON data: {exc}") from None


def failed(number: int, record: Any, problem: str) -> Turn:
    """A record that cannot be read: quarantined with ``problem``."""
    try:
        raw = record if isinstance(record, bytes) else record_bytes(record)
    except TraceError:
        raw = repr(record)[:4096].encode()
    return Turn(number=number, raw=raw, problem=problem)


def conversation_key(value: Any) -> str | None:
    """A store's session / conversation id as the registry keeps it (text; a long one as its sha256)."""
    if value is None or value == "":
        return None
    text = value if isinstance(value, str) else orjson.dumps(value).decode()
    if len(text) <= MAX_CONVERSATION_CHARS and text.isprintable():
        return text
    return "sha256:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def chat_message(message: Any) -> dict[str, Any]:
    """An OpenAI chat message as a trace stores it: its known fields, None ones left out, tool calls as
    ``{"id", "type", "function": {"name", "arguments"}}`` (arguments as JSON text)."""
    if not isinstance(message, dict):
        raise TraceError(f"expected a chat message object, got {type(message).__name__}")
    out = {k: message[k] for k in MESSAGE_FIELDS if message.get(k) is not None}
    if out.get("content") is None and isinstance(message.get("content_parts"), list):
        out["content"] = message["content_parts"]  # a stored completion's message with content parts
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        if not calls:
            del out["tool_calls"]
        else:
            out["tool_calls"] = [_tool_call(c) for c in calls]
    if out.get("role") == "assistant" and "content" not in out and "tool_calls" not in out:
        out["content"] = ""
    return out


def _tool_call(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        return call  # validate_trace names what is wrong with it
    out = {
        "type": "function",
        "function": {"name": fn.get("name"), "arguments": arguments_text(fn.get("arguments"))},
    }
    if call.get("id") is not None:
        out["id"] = call["id"]
    return out


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Tool definitions in the OpenAI chat shape: ``{"type": "function", "function": {...}}``; a flat
    ``{"type": "function", "name", "parameters"}`` (Responses API, OTel GenAI) is lifted into it."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        return tools  # tools_problem names it
    out = []
    for tool in tools:
        if isinstance(tool, dict) and "function" not in tool and isinstance(tool.get("name"), str):
            fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
            tool = {"type": "function", "function": fn}
        out.append(tool)
    return out


def resolve_principal(*, session: Any, name: str) -> Principal:
    """The principal ``name`` with its scopes: ``operator`` has every scope, a key's name the key's (none
    once revoked), any other name none."""
    if name == LOOP or not NAME.fullmatch(name):
        raise RatchetError(
            f"principal {name!r}: expected a letter, then letters, digits, _ . - (and not {LOOP!r}, the "
            "loop's own practice)"
        )
    if name == OPERATOR:
        return OPERATOR_PRINCIPAL
    row = session.execute(select(ApiKey.scopes, ApiKey.revoked_at).where(ApiKey.name == name)).first()
    scopes = frozenset(row.scopes or ()) if row is not None and row.revoked_at is None else frozenset()
    return Principal(name, scopes)


def _feedback(found: Assessments, who: Principal) -> dict[str, Any] | None:
    feedback: dict[str, Any] = {}
    claimed: dict[str, Any] = {}
    for name, value, scope in (("rating", found.rating, "rate"), ("correction", found.correction, "correct")):
        if value is None:
            continue
        target = feedback if who.may(scope) else claimed
        target[name], target[f"{name}_by"] = value, who.name
    if claimed:
        feedback["claimed"] = claimed
    return feedback or None


def _metadata(turn: Turn, who: Principal) -> dict[str, Any]:
    metadata = {k: v for k, v in turn.metadata.items() if v is not None}
    material: dict[str, Any] = {}
    for name, value in turn.assessments.expectations.items():
        key = EXPECTED_KEYS.get(name)
        if key is None:
            material.setdefault("expectations", {})[name] = value
        else:
            material[key] = value
    if material:
        if who.may("certify"):
            metadata.update(material)
        else:
            metadata["claimed"] = material
    if turn.assessments.others:
        metadata["assessments"] = turn.assessments.others
    return metadata


def turn_row(
    turn: Turn, *, who: Principal, source: str, generation_id: int | None, harness_version_id: int | None
) -> TraceRow:
    """The experience row of a turn read from a store; ``TraceError`` with the quarantine reason."""
    if len(turn.raw) > MAX_RECORD_BYTES:
        raise TraceError(f"oversized record ({len(turn.raw)} bytes > limit {MAX_RECORD_BYTES})")
    decode_json(turn.raw)  # the record passes ingest's rules for untrusted JSON
    last = turn.messages[-1] if isinstance(turn.messages, list) and turn.messages else None
    if not isinstance(last, dict) or last.get("role") != "assistant":
        raise TraceError("wrong shape: no answer (the last message is not the assistant's)")
    if problem := tools_problem(turn.tools):
        raise TraceError(f"tools{'' if problem.startswith('[') else ': '}{problem}")
    try:
        trace = validate_trace({"messages": turn.messages, "metadata": _metadata(turn, who)})
    except TraceError as exc:
        raise TraceError(f"wrong shape: {exc}") from None
    trace["feedback"] = _feedback(turn.assessments, who)
    try:
        return trace_row(
            trace,
            source=source,
            generation_id=generation_id,
            harness_version_id=harness_version_id,
            principal=who.name,
            conversation_id=turn.conversation_id,
            tools=turn.tools,
        )
    except (orjson.JSONEncodeError, TypeError, ValueError) as exc:
        raise TraceError(f"not JSON data: {exc}") from None


def import_turns(
    turns: Iterable[Turn],
    *,
    label: str,
    session_factory: Callable[[], Any],
    source: str = "import",
    principal: str = OPERATOR,
    generation_id: int | None = None,
    harness_version_id: int | None = None,
    batch_size: int = 2000,
) -> IngestResult:
    """Store ``turns`` (as ``ingest_file`` stores lines): each batch committed on its own, a turn already
    stored counted as a duplicate, a record that cannot be read quarantined under ``label`` (the source: a
    file, ``mlflow:<experiment>``) once per number and content. ``IngestResult.lines`` counts turns."""
    if source not in SOURCES:
        raise RatchetError(f"unknown source {source!r}: expected one of {', '.join(SOURCES)}")
    with session_factory() as session:
        who = resolve_principal(session=session, name=principal)
    if principal != OPERATOR and not who.scopes:
        log.warning(
            "principal %r has no key in this registry: its ratings, corrections and expectations are kept as "
            "claimed, never counted (ratchet keys create --name %s --scope certify,rate,correct)",
            principal,
            principal,
        )

    def entries() -> Iterator[tuple[int, bytes, TraceRow | str, None]]:
        for turn in turns:
            row: TraceRow | str | None = turn.problem
            if row is None:
                try:
                    row = turn_row(
                        turn,
                        who=who,
                        source=source,
                        generation_id=generation_id,
                        harness_version_id=harness_version_id,
                    )
                except TraceError as exc:
                    row = str(exc)
            yield turn.number, turn.raw, row, None

    result = store_traces(
        entries(),
        result=IngestResult(file=label),
        source_file=label,
        session_factory=session_factory,
        batch_size=batch_size,
    )
    log.info("imported %s: %s", label, result)
    return result


def json_lines(path: Any, *, max_line_bytes: int) -> Iterator[tuple[int, Any, str | None]]:
    """(line number, decoded JSON, None) or (line number, the raw bytes or None, why not) per non-blank
    line of a JSONL file, streamed."""
    for number, raw, problem, _digest in iter_lines(path, max_line_bytes=max_line_bytes):
        if raw is not None and not raw.strip():
            continue
        if problem is not None:
            yield number, None, problem
            continue
        try:
            yield number, decode_json(raw), None
        except TraceError as exc:
            yield number, raw, str(exc)
