"""The OpenAI-compatible server: route -> answer -> summary for every turn, experience for every turn.

``create_app(config)`` builds the FastAPI app behind ``ratchet serve``:

- ``POST /v1/chat/completions`` (plain or ``stream: true`` SSE ending with ``[DONE]``; tools and tool
  calls; ``usage``; ``response_format``, ``tool_choice`` and ``parallel_tool_calls`` enforced by constrained
  decoding (``constraints``); ``n``; ``logprobs``; vLLM's ``return_token_ids``: ``completions``). A parameter
  it does not honour is a 400 naming it (``ChatRequest.unsupported``). The response names the specialist
  that served the turn in the header ``X-Ratchet-Specialist`` and in ``metadata.specialist`` (never an
  adapter path; every ``metadata`` value a string). ``POST /v1/responses``: ``pipeline.serving.responses``.
- ``GET /v1/models``; ``POST /v1/feedback`` (``completion_id``, ``rating``, ``correction``);
  ``POST /admin/reload`` (switch to a newly promoted champion now); ``GET /health``.
- With ``config.poll_seconds`` the registry is polled and a new champion is loaded in the background and
  swapped in; requests in flight finish on the generation they started with.
- Client mistakes get OpenAI error objects with 4xx. Every endpoint but ``/health`` knows who is asking
  (``pipeline.serving.access``): chat and feedback need the ``chat`` scope, ``/admin/*`` the ``admin`` scope.
  What a turn's client attaches as verification material counts only with ``certify`` (else it is kept as
  ``claimed``); a rating counts only with ``rate``, a correction only with ``correct`` (else both are kept
  under ``feedback.claimed``, shown and never scored).
- Limits (``pipeline.serving.limits``): a body over ``max_body_bytes`` is refused while it is read (413),
  one slower than ``body_timeout_s`` / ``body_idle_s`` too (408, as are headers slower than
  ``header_timeout_s``); a chat turn is admitted once its body is in, and beyond ``max_queue`` turns in
  flight it gets 429 (503 while stopping or loading a generation) with ``Retry-After``, as does a request
  beyond ``max_requests_per_key`` of its key or ``max_feedback`` feedback requests (re-scoring a turn is
  bounded by ``rescore_timeout_s``; regular expressions run on RE2: nothing a client sends stalls the
  others); a turn past ``request_timeout_s`` is stopped (504, or an error event ending the
  stream); a client that disconnects has its row dropped from the batch. Both stopped turns are recorded
  with what was produced until then.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictStr
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.errors import NotFoundError, RatchetError
from pipeline.experience.principals import SCOPES, Principal, parse_scopes
from pipeline.registry import Experience, create_api_key, list_api_keys, revoke_api_key, session_scope
from pipeline.scoring import rescore_experience
from pipeline.serving.access import Access
from pipeline.serving.completions import ChoiceQueue, completion_response, completion_stream, response_headers
from pipeline.serving.limits import Admission, KeyLimit, Slot, read_body, watch_disconnect
from pipeline.serving.protocol import ApiError, ChatRequest, parse_body
from pipeline.serving.responses import install_responses
from pipeline.serving.served import ServeConfig
from pipeline.serving.turns import ServerState, cid_key

log = logging.getLogger(__name__)


class FeedbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    completion_id: StrictStr = Field(min_length=1)
    rating: float | None = None
    correction: StrictStr | None = None


class FeedbackResponse(BaseModel):
    """``POST /v1/feedback``'s answer: what was stored, and whether it counts."""

    object: str = Field(default="feedback", description="Always `feedback`.")
    completion_id: str = Field(description="The served turn the feedback is about.")
    ok: bool = Field(default=True, description="The feedback was stored.")
    counted: dict[str, bool] = Field(
        description="Per field sent (`rating`, `correction`): whether it counts (the key holds `rate` / "
        "`correct`); what does not count is kept under `feedback.claimed`, shown and never scored."
    )
    rescored: int = Field(description="Contract versions the turn was scored again under.")


class KeyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: StrictStr = Field(min_length=1, max_length=100)
    scopes: list[StrictStr] = Field(min_length=1, max_length=len(SCOPES))


class KeyInfo(BaseModel):
    """An API key as the server shows it: by name, never by value."""

    name: str = Field(description="The key's name: the principal its requests are stored under.")
    scopes: list[str] = Field(description="What the key may do.")
    created_at: str = Field(description="When it was created (ISO 8601).")
    revoked_at: str | None = Field(description="When it was revoked; null while it is valid.")
    key: str | None = Field(default=None, description="The key itself: only in the answer that created it.")


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return error_response(ApiError(exc.status_code, str(exc.detail), code=code))

    @app.exception_handler(Exception)
    async def _bug(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return JSONResponse(
            {
                "error": {
                    "message": "internal server error",
                    "type": "server_error",
                    "param": None,
                    "code": None,
                }
            },
            status_code=500,
        )


def create_app(config: ServeConfig) -> FastAPI:
    """The routed Mixture-of-LoRA server for ``config`` (loads the generation when the app starts)."""
    state = ServerState(config)
    access = Access(api_key=config.api_key, allow_anonymous=config.allow_anonymous)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        access.db = state.db
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="ratchet", lifespan=lifespan)
    app.state.ratchet = state
    app.state.access = access
    install_error_handlers(app)
    app.add_middleware(KeyLimit, limit=config.max_requests_per_key)  # 429 before a busy key's body is read
    feedbacks = Admission(config.max_feedback, option="--max-feedback")  # bodies held, turns re-scored

    async def body_of(request: Request) -> bytes:
        return await read_body(
            request, config.max_body_bytes, timeout_s=config.body_timeout_s, idle_s=config.body_idle_s
        )

    @app.get("/health")
    async def health() -> dict[str, Any]:
        spool = _spool_health(state)
        return {
            # degraded (still HTTP 200: the server answers, and keeps what it answered): the registry is
            # not taking served turns (writes failing, or the oldest unstored one waiting too long)
            "status": "degraded" if spool["degraded"] else "ok",
            "generation": state.current.number if state.current else None,
            "in_flight": state.admission.inflight,  # chat turns admitted and still decoding
            "refused": state.admission.refused,  # 429 / 503 answers since the start
            "spool": spool,
        }

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        await access.require(request, "chat")
        assert state.current is not None
        return {
            "object": "list",
            "data": [
                {
                    "id": config.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "ratchet",
                    "generation": state.current.number,
                    "specialists": state.current.specialists,
                }
            ],
        }

    @app.post("/admin/reload")
    async def reload(request: Request) -> dict[str, Any]:
        await access.require(request, "admin")
        return await state.reload(retry=True)

    @app.get("/admin/keys", response_model=list[KeyInfo])
    async def keys(request: Request) -> list[KeyInfo]:
        await access.require(request, "admin")
        return await asyncio.to_thread(_list_keys, state.db)

    @app.post("/admin/keys", response_model=KeyInfo)
    async def create_key(request: Request) -> KeyInfo:
        who = await access.require(request, "admin")
        body = parse_body(await body_of(request), KeyRequest)
        try:
            return await asyncio.to_thread(_create_key, state.db, body, who.name)
        except RatchetError as exc:
            raise ApiError(400, str(exc), param="name") from None
        finally:
            access.forget()

    @app.post("/admin/keys/{name}/revoke", response_model=KeyInfo)
    async def revoke_key(name: str, request: Request) -> KeyInfo:
        who = await access.require(request, "admin")
        try:
            return await asyncio.to_thread(_revoke_key, state.db, name, who.name)
        except NotFoundError as exc:
            raise ApiError(404, str(exc), param="name", code="not_found") from None
        finally:
            access.forget()

    @app.post("/v1/feedback", response_model=FeedbackResponse)
    async def feedback(request: Request) -> FeedbackResponse:
        who = await access.require(request, "chat")
        slot = feedbacks.admit()  # before the body: at most --max-feedback bodies held at once
        try:
            body = parse_body(await body_of(request), FeedbackRequest)
        finally:
            slot.release()
        if body.rating is None and body.correction is None:
            raise ApiError(400, "feedback needs a rating, a correction, or both", param="rating")
        # its turn still decoding (a streamed turn's id comes in its first chunk): waited for without a slot,
        # so a client waiting on its own long turns holds nobody else's feedback up
        tasks = [state.pending.get(cid_key(body.completion_id, what)) for what in ("turn", "stream")]
        if running := [task for task in tasks if task is not None]:
            await asyncio.wait(running, timeout=30)
        slot = feedbacks.admit()  # storing and re-scoring: again at most --max-feedback at once
        try:
            return await handle_feedback(body, who)
        finally:
            slot.release()

    async def handle_feedback(body: FeedbackRequest, who: Principal) -> FeedbackResponse:
        assert state.recorder is not None
        if state.recorder.full():  # the cap on unstored records holds for feedback too
            raise ApiError(
                503,
                f"the registry is not taking writes and {config.spool_max_bytes} bytes wait in the spool "
                "(--spool-max-bytes); retry later",
                type="server_error",
                code="service_unavailable",
                headers={"Retry-After": "5"},
            )
        counted = await _spool_feedback(state, body, who)  # durable from here on
        assert state.recorder is not None
        if not await state.recorder.stored() and any(counted.values()):  # no thread held while it waits
            raise ApiError(
                503,
                "the feedback is kept and will be stored, but the registry is not taking writes now and the "
                "turn could not be scored again: send it again later to have it re-scored",
                type="server_error",
                code="service_unavailable",
                headers={"Retry-After": "5"},
            )
        rescored = (
            await asyncio.to_thread(_rescore, state.db, body.completion_id, config.rescore_timeout_s)
            if any(counted.values())
            else 0
        )
        return FeedbackResponse(completion_id=body.completion_id, counted=counted, rescored=rescored)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        who = await access.require(request, "chat")  # before admission: an unknown client takes no slot
        started = time.perf_counter()
        # Admitted once the body is in (read with its timeouts): a client trickling a body holds no place.
        req = await asyncio.to_thread(parse_body, await body_of(request), ChatRequest)  # off the event loop
        if (refusal := req.unsupported()) is not None:
            raise refusal
        if req.return_token_ids and config.engine == "external":  # the engine's ids never reach this server
            raise ApiError(400, "return_token_ids needs the embedded engine (not --engine external)",
                           param="return_token_ids")  # fmt: skip
        if req.model != config.model_name:
            raise ApiError(
                404,
                f"model {req.model!r} does not exist: this server serves {config.model_name!r}",
                param="model",
                code="model_not_found",
            )
        if config.max_queue and req.choices() > config.max_queue:  # would wait for room that never comes
            raise ApiError(400, f"n {req.choices()} is more than --max-queue {config.max_queue}", param="n")
        slots: list[Slot] = []
        try:
            for _ in range(req.choices()):  # one row of the batch per choice, refused at once when full
                slots.append(state.admit())
            turn = await state.prepare(req, started=started, slot=slots[0])
            turns = state.choices(dataclasses.replace(turn, principal=who), slots[1:])
        except BaseException:
            for slot in slots:
                slot.release()
            raise
        headers = response_headers(turn)
        if req.stream:
            queue: asyncio.Queue = asyncio.Queue()
            watcher = asyncio.get_running_loop().create_task(watch_disconnect(request, turn.abort))
            for t in turns:
                state.produce(t, ChoiceQueue(queue, t.choice))
            return StreamingResponse(
                completion_stream(state, turns, queue, watcher),
                media_type="text/event-stream",
                headers=headers,
            )
        replies = await state.answer_all(turns, request)
        if req.logprobs:  # n x tokens x (1 + top_logprobs) entries: built and encoded off the event loop
            return await asyncio.to_thread(
                lambda: JSONResponse(completion_response(turns, replies), headers=headers)
            )
        return JSONResponse(completion_response(turns, replies), headers=headers)

    install_responses(app, state, access, body_of)

    return app


async def _spool_feedback(state: ServerState, body: FeedbackRequest, who: Principal) -> dict[str, bool]:
    """Put the feedback in the spool (``registry.attach_feedback`` stores it as ``who`` may: what does not
    count is kept under ``feedback.claimed``); returns, per field sent, whether it counts. A completion id
    neither waiting in the spool nor stored is the client's 404."""
    recorder = state.recorder
    assert recorder is not None
    if not recorder.holds(body.completion_id):
        try:
            known = await asyncio.to_thread(_served_turn_stored, state.db, body.completion_id)
        except SQLAlchemyError:
            raise ApiError(
                503, "the registry is unavailable; retry shortly", type="server_error",
                code="service_unavailable", headers={"Retry-After": "5"},
            ) from None  # fmt: skip
        if not known:
            raise ApiError(
                404,
                f"no served completion with id {body.completion_id!r}",
                param="completion_id",
                code="not_found",
            )
    may = {"rating": who.may("rate"), "correction": who.may("correct")}
    counted = {
        f: may[f]
        for f, value in (("rating", body.rating), ("correction", body.correction))
        if value is not None
    }
    try:
        await recorder.record_feedback(
            completion_id=body.completion_id, rating=body.rating, correction=body.correction, principal=who.name,
            may_rate=may["rating"], may_correct=may["correction"],
        )  # fmt: skip
    except OSError:
        raise ApiError(
            503, "the server could not store the feedback; retry shortly", type="server_error",
            code="service_unavailable", headers={"Retry-After": "5"},
        ) from None  # fmt: skip
    return counted


def _served_turn_stored(db: Any, completion_id: str) -> bool:
    from sqlalchemy import select

    with session_scope(db) as session:
        return (
            session.scalar(select(Experience.id).where(Experience.completion_id == completion_id)) is not None
        )


def _rescore(db: Any, completion_id: str, timeout_s: float) -> int:
    """Score the turn again under every contract version that scored it (the old scores stay in the
    history): a rating or correction that arrives late still counts. Returns how many re-scored it. Runs in a
    thread; a scoring still running after ``timeout_s`` is stored as not verified (``rescore_experience``)."""
    from sqlalchemy import select

    with session_scope(db) as session:
        experience_id = session.scalar(select(Experience.id).where(Experience.completion_id == completion_id))
        if experience_id is None:
            return 0
        done = rescore_experience(
            session=session,
            experience_ids=[experience_id],
            reason="feedback arrived after scoring",
            timeout_s=timeout_s,
        )
    return len(done)


def _spool_health(state: ServerState) -> dict[str, Any]:
    """What waits to be stored: turns, records and bytes not in the registry yet, the oldest one's age,
    the registry writes failed in a row and the last error; ``degraded`` when they fail, when the oldest
    waits more than 10 s (a write blocked on a lock), or when the spool is full."""
    recorder = state.recorder
    if recorder is None:
        return {"degraded": False}
    depth = recorder.depth()
    return {
        **depth,
        "max_bytes": state.config.spool_max_bytes,
        "durable": recorder.spool is not None,
        "failures": recorder.failures,
        "last_error": recorder.last_error,
        "degraded": bool(recorder.failures or recorder.full() or depth["oldest_s"] > 10),
    }


def _key_info(row: Any, value: str | None = None) -> KeyInfo:
    return KeyInfo(
        name=row.name,
        scopes=list(row.scopes),
        created_at=row.created_at.isoformat(),
        revoked_at=row.revoked_at.isoformat() if row.revoked_at else None,
        key=value,
    )


def _list_keys(db: Any) -> list[KeyInfo]:

    with session_scope(db) as session:
        return [_key_info(row) for row in list_api_keys(session=session)]


def _create_key(db: Any, body: KeyRequest, actor: str) -> KeyInfo:

    with session_scope(db) as session:
        row, value = create_api_key(
            session=session, name=body.name, scopes=parse_scopes(body.scopes), actor=actor
        )
        return _key_info(row, value)


def _revoke_key(db: Any, name: str, actor: str) -> KeyInfo:

    with session_scope(db) as session:
        return _key_info(revoke_api_key(session=session, name=name, actor=actor))
