"""OpenAI's Responses API on the chat turn pipeline: ``POST /v1/responses`` and ``GET /v1/responses/{id}``.

``install_responses(app, state, access, body_of)`` registers both routes (``create_app`` calls it). A request
(``responseitems.ResponsesRequest``; anything else is a 400 naming the parameter) becomes a chat request and
runs as a chat turn does: admitted, routed, decoded, timed out (504 / a ``response.failed`` event), stopped
when the client leaves, and recorded as experience before it is answered, with the response id
(``resp_<hex>``) as the trace's completion id and the request as it was under ``metadata.response``
(``responseitems.ResponseRecord``). ``GET`` rebuilds the Response from that stored trace.

Conversations kept server-side: ``previous_response_id`` continues the stored trace of that response (its
messages and reply, without its ``instructions``: they are not carried over); ``conversation`` (an id, or
``{id}``) continues the latest stored turn of that conversation sent with the same key (anyone may name any
conversation id: another key's turns in it never reach this prompt, for an admin key too). A chain's turns
share the registry's ``conversation_id``: the ``conversation`` named, else the chain's first response id (or
the client's ``metadata.conversation_id`` / ``session_id``). A response is read or continued by its
``previous_response_id`` only by the principal that created it (or an ``admin`` key); for anyone else, and
with ``store: false``, it does not exist (404). A continuation whose conversation with the new input is larger
than ``--max-body-bytes`` is a 400 naming ``previous_response_id`` / ``conversation`` (every turn stores its
whole conversation: a chain must not grow one row without bound).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from pipeline.experience.principals import Principal
from pipeline.registry import Experience, session_scope
from pipeline.serving.access import Access
from pipeline.serving.completions import response_headers, response_meta
from pipeline.serving.limits import watch_disconnect
from pipeline.serving.protocol import ApiError, ChatRequest, parse_body
from pipeline.serving.responseitems import ResponseRecord, ResponsesRequest, chat_body, history_of, record_of
from pipeline.serving.responseobjects import ResponseEvents, ResponseObject, logprobs_of, response_object
from pipeline.serving.traces import MAX_CONVERSATION_ID, ChatTurn
from pipeline.serving.turns import ServerState, cid_key

log = logging.getLogger(__name__)
# a chat parameter's name in a 400 -> the Responses parameter it came from
PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "logprobs": "include",
}


@dataclasses.dataclass(frozen=True)
class StoredTurn:
    """A served turn as the registry holds it (what ``GET`` and a continuation read)."""

    completion_id: str
    principal: str | None
    messages: list[dict[str, Any]]  # the conversation and the reply
    meta: dict[str, Any]
    tools: list[dict[str, Any]] | None
    conversation_id: str | None
    record: ResponseRecord | None  # None: a chat-completions turn

    def response(self) -> ResponseObject:
        assert self.record is not None
        reply, meta = self.messages[-1], self.meta
        return response_object(
            self.completion_id,
            self.record,
            model=meta.get("model", ""),
            tools=self.tools,
            meta=meta,
            message=reply,
            finish_reason=meta.get("finish_reason"),
            tokens=(meta.get("prompt_tokens", 0), meta.get("completion_tokens", 0)),
        )


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


def install_responses(
    app: FastAPI, state: ServerState, access: Access, body_of: Callable[[Request], Awaitable[bytes]]
) -> None:
    """Register ``POST /v1/responses`` and ``GET /v1/responses/{response_id}`` on ``app``."""

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request) -> Any:
        who = await access.require(request, "chat")
        if request.query_params.get("stream") not in (None, "false"):
            raise ApiError(400, "streaming a stored response is not supported", param="stream")
        stored = await find_response(state, response_id, who, param="response_id")
        return JSONResponse(stored.response().model_dump(mode="json"))

    @app.post("/v1/responses")
    async def create(request: Request) -> Any:
        who = await access.require(request, "chat")  # before admission: an unknown client takes no slot
        started = time.perf_counter()
        body = await asyncio.to_thread(_parse, await body_of(request))  # a large body is decoded off the loop
        if body.model != state.config.model_name:
            raise ApiError(
                404,
                f"model {body.model!r} does not exist: this server serves {state.config.model_name!r}",
                param="model",
                code="model_not_found",
            )
        if body.return_token_ids and state.config.engine == "external":  # the engine's ids never come back
            raise ApiError(400, "return_token_ids needs the embedded engine (not --engine external)",
                           param="return_token_ids")  # fmt: skip
        rid = new_response_id()
        history, conversation = await _kept(state, body, who, rid)
        chat = await asyncio.to_thread(chat_body, body, history)
        if history:
            _check_kept_size(chat["messages"], body, state.config.max_body_bytes)
        req = await asyncio.to_thread(_chat_request, chat)
        slot = state.admit()  # refused at once when full
        try:
            turn = await state.prepare(req, started=started, slot=slot, cid=rid)
        except ApiError as exc:
            slot.release()
            raise _renamed(exc) from None
        except BaseException:
            slot.release()
            raise
        record = record_of(body, turn.created, body.conversation_id())
        turn = dataclasses.replace(
            turn, principal=who, conversation=conversation, record={"response": record.model_dump()}
        )
        meta, headers = response_meta(turn), response_headers(turn)
        if body.stream:
            queue: asyncio.Queue = asyncio.Queue()
            watcher = asyncio.get_running_loop().create_task(watch_disconnect(request, turn.abort))
            state.produce(turn, queue)
            events = _events(state, turn, record, meta, queue, watcher)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        message, _finish, result = await state.answer(turn, request)

        def answer() -> JSONResponse:
            done = _reply(turn, record, meta, message, result)
            return JSONResponse(done.model_dump(mode="json"), headers=headers)

        # logprobs (tokens x (1 + top_logprobs) entries) are built and encoded off the event loop
        return await asyncio.to_thread(answer) if body.logprobs() else answer()


def _parse(raw: bytes) -> ResponsesRequest:
    """The body, or a 400 naming the top-level parameter (``text.format`` for the text config)."""
    try:
        return parse_body(raw, ResponsesRequest)
    except ApiError as exc:
        if exc.param:
            head = exc.param.split(".")
            exc.param = ".".join(head[:2]) if head[0] == "text" and len(head) > 1 else head[0]
        raise


def _chat_request(body: dict[str, Any]) -> ChatRequest:
    try:
        req = ChatRequest.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        param = PARAMS.get(str(err["loc"][0]), str(err["loc"][0])) if err["loc"] else None
        msg = err["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"{where}: {msg}" if where else msg, param=param) from None
    if (problem := req.unsupported()) is not None:
        raise _renamed(problem)
    return req


def _check_kept_size(messages: list[dict[str, Any]], body: ResponsesRequest, limit: int) -> None:
    """A 400 naming the continuation when the conversation kept server-side plus this input is larger than
    ``--max-body-bytes``: every turn stores its whole conversation, so a chain a client grows by a full body
    per request would otherwise grow one stored row (and the spool) without bound, beyond anything the
    client could have sent itself."""
    if not limit:
        return
    size = len(json.dumps(messages, ensure_ascii=False, separators=(",", ":")).encode())
    if size > limit:
        param = "previous_response_id" if body.previous_response_id is not None else "conversation"
        raise ApiError(
            400,
            f"the conversation continued is {size} bytes with this input, over the server's limit of {limit} "
            "bytes (--max-body-bytes): start a new conversation",
            param=param,
            code="context_length_exceeded",
        )


def _renamed(exc: ApiError) -> ApiError:
    """A chat turn's 400 naming the Responses parameter instead of the chat one."""
    if exc.param in PARAMS:
        exc.param = PARAMS[exc.param]
        exc.message = exc.message.replace("max_tokens", "max_output_tokens")
    return exc


async def _kept(
    state: ServerState, body: ResponsesRequest, who: Principal, rid: str
) -> tuple[list[dict[str, Any]], str | None]:
    """The conversation kept server-side that ``body`` continues, and the turn's conversation id."""
    named = body.conversation_id()
    if body.previous_response_id is not None:
        if named is not None:
            raise ApiError(400, "give previous_response_id or conversation, not both", param="conversation")
        prev = await find_response(state, body.previous_response_id, who, param="previous_response_id")
        return history_of(prev.messages, prev.record), prev.conversation_id or prev.completion_id
    if named is not None:
        await _flush(state)
        # only the asker's own turns: anyone may name any conversation id, so another principal's turn in it
        # (an admin's included) would put that principal's text in this prompt and this experience
        latest = await _registry(_latest, state.db, named, who.name)
        return (history_of(latest.messages, latest.record) if latest else []), named
    client = body.metadata or {}
    # the client's own conversation id, as chat turns store it (``traces.conversation_of``); else this
    # response starts a conversation
    own = any(0 < len(client.get(k) or "") <= MAX_CONVERSATION_ID for k in ("conversation_id", "session_id"))
    return [], None if own else rid


async def find_response(state: ServerState, rid: str, who: Principal, *, param: str) -> StoredTurn:
    """The stored response ``rid`` as ``who`` may see it (waiting for it if it is still decoding), else 404:
    the same answer whether it does not exist, is someone else's, or was not to be stored."""
    for what in ("turn", "stream"):
        task = state.pending.get(cid_key(rid, what))
        if task is not None:
            await asyncio.wait([task], timeout=30)
    assert state.recorder is not None
    if state.recorder.holds(rid):
        await _flush(state)
    stored = await _registry(_read, state.db, rid)
    if (
        stored is None
        or stored.record is None
        or not stored.record.store
        or not (stored.principal == who.name or who.may("admin"))
    ):
        raise ApiError(404, f"no response with id {rid!r}", param=param, code="not_found")
    return stored


async def _flush(state: ServerState) -> None:
    """Wait until the served turns spooled so far are in the registry (503 when it does not take them)."""
    assert state.recorder is not None
    if not await state.recorder.stored(10.0):
        raise _unavailable()


async def _registry(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return await asyncio.to_thread(fn, *args)
    except SQLAlchemyError:
        raise _unavailable() from None


def _unavailable() -> ApiError:
    return ApiError(
        503, "the registry is unavailable; retry shortly", type="server_error",
        code="service_unavailable", headers={"Retry-After": "5"},
    )  # fmt: skip


def _stored(row: Experience) -> StoredTurn:
    meta = row.meta or {}
    record = meta.get("response")
    return StoredTurn(
        completion_id=row.completion_id or "",
        principal=row.principal,
        messages=list(row.messages or []),
        meta=meta,
        tools=row.tools,
        conversation_id=row.conversation_id,
        record=ResponseRecord.model_validate(record) if isinstance(record, dict) else None,
    )


def _read(db: Any, rid: str) -> StoredTurn | None:
    with session_scope(db) as session:
        row = session.scalar(select(Experience).where(Experience.completion_id == rid))
        return None if row is None else _stored(row)


def _latest(db: Any, conversation: str, principal: str) -> StoredTurn | None:
    """The newest served turn of ``conversation`` sent by ``principal`` that may be continued (not a response
    stored with ``store: false``)."""
    query = select(Experience).where(
        Experience.conversation_id == conversation,
        Experience.source == "deployment",
        Experience.principal == principal,
    )
    with session_scope(db) as session:
        for row in session.scalars(query.order_by(Experience.id.desc()).limit(50)):
            turn = _stored(row)
            if turn.record is None or turn.record.store:
                return turn
    return None


# ----------------------------------------------------------------------------------- the turn itself
def _reply(
    turn: ChatTurn, record: ResponseRecord, meta: dict[str, Any], message: dict[str, Any], result: Any
) -> ResponseObject:
    return response_object(
        turn.cid,
        record,
        model=turn.req.model,
        tools=[t.model_dump(exclude_none=True) for t in turn.req.tools or []],
        meta=meta,
        message=message,
        finish_reason=result.finish_reason,
        tokens=(result.prompt_tokens, result.completion_tokens),
        logprobs=logprobs_of(getattr(result, "logprobs", None)),
        token_ids=(result.prompt_ids, result.completion_ids) if turn.req.return_token_ids else (None, None),
    )


async def _events(
    state: ServerState,
    turn: ChatTurn,
    record: ResponseRecord,
    meta: dict[str, Any],
    queue: asyncio.Queue,
    watcher: asyncio.Task,
) -> AsyncIterator[str]:
    """The Responses event stream: created, in progress, the output (text deltas as they are decoded; a
    reply with tools offered is only known whole), then completed / incomplete, or failed."""
    ev = ResponseEvents()
    tools = [t.model_dump(exclude_none=True) for t in turn.req.tools or []]
    pending = response_object(turn.cid, record, model=turn.req.model, tools=tools, meta=meta)
    text_id = f"msg_{turn.cid.removeprefix('resp_')}"
    buffer, opened = bool(turn.req.tool_names()), False
    try:
        yield ev.lifecycle("created", pending)
        yield ev.lifecycle("in_progress", pending)
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), state.time_left(turn))
            except TimeoutError:
                yield ev.lifecycle("failed", _failed(pending, state.timeout_error().message))
                return
            if isinstance(item, Exception):
                yield ev.lifecycle("failed", _failed(pending, "internal server error"))
                return
            if isinstance(item, tuple):
                message, _finish, result = item
                break
            if not buffer and item:
                if not opened:
                    for line in ev.open_text(text_id, 0):
                        yield line
                    opened = True
                yield ev.delta(text_id, 0, item)
        done = _reply(turn, record, meta, message, result)
        if done.status == "failed":
            why = state.decoding_error() if result.finish_reason == "error" else state.timeout_error()
            yield ev.lifecycle("failed", _failed(done, why.message))
            return

        def ending() -> list[str]:
            end = "incomplete" if done.status == "incomplete" else "completed"
            return [*ev.items(done, opened=opened), ev.lifecycle(end, done)]

        # logprobs (tokens x (1 + top_logprobs) entries) are built and encoded off the event loop
        for line in await asyncio.to_thread(ending) if turn.req.logprobs else ending():
            yield line
    finally:  # closed early (the client left) or done: either way nothing more is decoded for it
        watcher.cancel()
        turn.abort.set("disconnected")


def _failed(response: ResponseObject, why: str) -> ResponseObject:
    error = {"code": "server_error", "message": why}
    return response.model_validate(
        {**response.model_dump(), "status": "failed", "error": error, "output": []}
    )
