"""A served turn and its experience row: what was asked, who answered, and what is stored about it.

``ChatTurn`` is one request on its way through the server (``turns.ServerState`` prepares and completes it;
the chat and Responses routes share it). ``trace_row`` builds its registry row: the client's messages and
the reply, routes and summaries, the server's metadata (the client's own beside it when its principal may
certify, else under ``claimed``; a route's ``record`` fields; ``choice`` / ``choices`` when the request asked
for ``n`` > 1), the client's ``tools``, the conversation it belongs to and the token ids the engine decoded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.experience.principals import ANONYMOUS_PRINCIPAL, Principal
from pipeline.experience.toolcalls import parse_tool_calls
from pipeline.registry import TraceRow
from pipeline.registry.documents import ServedTokens
from pipeline.serving.engines import EngineRequest, EngineResult
from pipeline.serving.limits import Slot
from pipeline.serving.protocol import ChatRequest
from pipeline.serving.recorder import served_trace_row
from pipeline.serving.router import RouteDecision
from pipeline.serving.runtime import Abort
from pipeline.serving.served import ServeConfig, Served
from pipeline.serving.views import TurnMemory

# finish reasons of a turn stopped before its end, and what the recorded experience says about them
STOPPED = {
    "timeout": "stopped at the request timeout of {:g} s; the reply is what was produced until then",
    "disconnected": "the client disconnected; the reply is what was produced until then",
    "error": "constrained decoding failed (the grammar could not go on); the reply is what was produced until then",
}


@dataclass(frozen=True)
class ChatTurn:
    """One request on its way through the server: what was asked, who answers, what the engine gets."""

    req: ChatRequest
    served: Served  # the generation this turn started on (kept even if a new champion is swapped in)
    decision: RouteDecision
    ereq: EngineRequest
    messages: list[dict]  # the client's messages, as sent
    cid: str
    created: int  # unix seconds, as the OpenAI protocol reports it
    started: float  # perf_counter at arrival, for the recorded latency and the timeout
    slot: Slot | None = None  # its admission, released when decoding ends
    principal: Principal = ANONYMOUS_PRINCIPAL  # who asked (``pipeline.serving.access``)
    conversation: str | None = None  # links the turns of one conversation (a Responses chain)
    record: dict[str, Any] = field(default_factory=dict)  # a route's own fields for the trace's metadata
    choice: int = 0  # its index among the request's ``n`` choices (each one a served, recorded turn)

    @property
    def abort(self) -> Abort:
        assert self.ereq.abort is not None
        return self.ereq.abort


MAX_CONVERSATION_ID = 100


def conversation_of(turn: ChatTurn) -> str | None:
    """The conversation ``turn`` belongs to: the route's (a Responses chain), else the client's metadata
    ``conversation_id`` or ``session_id`` when it is a string of at most 100 characters."""
    if turn.conversation:
        return turn.conversation
    client = turn.req.metadata or {}
    for key in ("conversation_id", "session_id"):
        value = client.get(key)
        if isinstance(value, str) and 0 < len(value) <= MAX_CONVERSATION_ID:
            return value
    return None


def served_tokens(turn: ChatTurn, message: dict, result: EngineResult) -> dict[str, ServedTokens] | None:
    """The ids the engine was given and decoded, keyed by the reply's index in the stored messages (None when
    the engine does not report them, or when the reply stored is not what was decoded: calls dropped by
    ``parallel_tool_calls: false``)."""
    if result.prompt_ids is None or result.completion_ids is None or not result.tokenizer:
        return None
    calls = message.get("tool_calls") or []
    if turn.req.parallel_tool_calls is False and len(calls) == 1 and not result.tool_calls:
        parsed = parse_tool_calls(result.text, turn.req.tool_names(), turn.served.harness.tool_call_format)
        if len(parsed or []) > 1:
            return None
    tokens = ServedTokens(
        tokenizer=result.tokenizer,
        prompt_ids=list(result.prompt_ids),
        completion_ids=list(result.completion_ids),
    )
    return {str(len(turn.messages)): tokens}


def trace_row(
    turn: ChatTurn,
    message: dict,
    result: EngineResult,
    *,
    latency_ms: float,
    summary: str,
    memory: TurnMemory,
    config: ServeConfig,
) -> TraceRow:
    """The turn's experience row (``recorder.served_trace_row``): the client's messages and the reply, the
    routes and summaries of the assistant messages this server remembers, and the server's metadata."""
    served, decision, messages, cid = turn.served, turn.decision, turn.messages, turn.cid
    stopped = result.finish_reason in STOPPED
    routes, summaries = [], {}
    for i, m in enumerate(messages):
        rec = memory.lookup(m) if m.get("role") == "assistant" else None
        if rec is not None:
            routes.append({"turn": i, "specialist": rec.specialist, "reason": "earlier turn", "scores": {}})
            summaries[str(i)] = rec.summary
    routes.append(decision.as_route(len(messages)))
    summaries[str(len(messages))] = summary
    client = turn.req.metadata or {}
    metadata = {
        # what the client said it knows about the turn (the expected answer, tests, a schema...): the
        # contract's scorers read it only when the client may certify; otherwise it is kept apart as
        # `claimed` (shown, never scored). The server's own fields below always win.
        **(client if turn.principal.may("certify") else {"claimed": client} if client else {}),
        **turn.record,
        "specialist": decision.specialist,
        "generation": served.number,
        "latency_ms": latency_ms,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "route_reason": decision.reason,
        "route_method": decision.method,
        "route_scores": decision.scores,
        "finish_reason": result.finish_reason,
        "model": turn.req.model,
        "engine": config.engine,
        "summaries": summaries,
    }
    names = getattr(served.engine, "model_names", None)
    if names:
        metadata["engine_model"] = names.get(decision.specialist)
    if stopped:
        metadata["stopped"] = STOPPED[result.finish_reason].format(config.request_timeout_s)
    if turn.req.choices() > 1:
        metadata["choice"], metadata["choices"] = turn.choice, turn.req.choices()
    row = served_trace_row(
        messages=[*messages, message],
        metadata=metadata,
        routes=routes,
        specialist=decision.specialist,
        completion_id=cid,
        generation_id=served.generation_id,
        harness_version_id=served.harness_version_id,
        principal=turn.principal.name,
        tools=[t.model_dump(exclude_none=True) for t in turn.req.tools] if turn.req.tools else None,
        conversation_id=conversation_of(turn),
        served_tokens=served_tokens(turn, message, result),
    )
    return row
