"""The embedded engine served the way vLLM / SGLang serve LoRA adapters: one OpenAI model per adapter.

``ratchet serve --expose-adapters`` runs this app: ``model`` names a specialist's adapter, the messages
are decoded as given (no routing, no views, no experience), so another ``ratchet serve --engine external``
can sit in front of it exactly as it would in front of vLLM. It is also how the external path is tested.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pipeline.serving.engines import EmbeddedEngine, EngineRequest, EngineResult, complete
from pipeline.serving.protocol import (
    ApiError,
    ChatRequest,
    chunk,
    completion_body,
    new_completion_id,
    parse_body,
    sse,
    usage_of,
)
from pipeline.serving.server import check_key, install_error_handlers


def create_adapter_app(engine: EmbeddedEngine, *, api_key: str | None = None) -> FastAPI:
    """An OpenAI-compatible multi-LoRA app over ``engine`` (model name = specialist)."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        await engine.scheduler.close()

    app = FastAPI(title="ratchet-adapters", lifespan=lifespan)
    install_error_handlers(app)
    names = list(engine.runtime.specialists)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        check_key(request, api_key)
        return {
            "object": "list",
            "data": [{"id": n, "object": "model", "created": 0, "owned_by": "ratchet"} for n in names],
        }

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        check_key(request, api_key)
        req = parse_body(await request.body(), ChatRequest)
        if req.model not in names:
            raise ApiError(
                404,
                f"model {req.model!r} does not exist: adapters are {', '.join(names)}",
                param="model",
                code="model_not_found",
            )
        messages = req.plain_messages()
        max_tokens = req.limit() or 64
        limit = engine.context_limit
        if limit and engine.count_tokens(messages) + max_tokens > limit:
            raise ApiError(
                400,
                f"prompt plus max_tokens exceed the context window of {limit} tokens",
                param="messages",
                code="context_length_exceeded",
            )
        ereq = EngineRequest(
            req.model,
            messages,
            max_tokens,
            req.temperature or 0.0,
            req.top_p if req.top_p is not None else 1.0,
            req.stops(),
            req.seed,
        )
        cid, created = new_completion_id(), int(time.time())
        if not req.stream:
            r = await complete(engine, ereq)
            return JSONResponse(
                completion_body(
                    cid=cid,
                    model=req.model,
                    message={"role": "assistant", "content": r.text},
                    finish_reason=r.finish_reason,
                    usage=usage_of(r.prompt_tokens, r.completion_tokens),
                    metadata={},
                    created=created,
                )
            )

        async def events():
            yield chunk(cid, req.model, created, {"role": "assistant", "content": ""})
            result = None
            async for item in engine.stream(ereq):
                if isinstance(item, EngineResult):
                    result = item
                else:
                    yield chunk(cid, req.model, created, {"content": item})
            yield chunk(cid, req.model, created, {}, result.finish_reason if result else "stop")
            if result is not None and req.stream_options is not None and req.stream_options.include_usage:
                yield sse(
                    {
                        "id": cid,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": req.model,
                        "choices": [],
                        "usage": usage_of(result.prompt_tokens, result.completion_tokens),
                    }
                )
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app
