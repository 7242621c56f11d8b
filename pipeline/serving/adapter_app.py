"""The embedded engine served the way vLLM / SGLang serve LoRA adapters: one OpenAI model per adapter.

``ratchet serve --expose-adapters`` runs this app: ``model`` names an adapter, the messages are decoded as
given (no routing, no views, no experience), so another ``ratchet serve --engine external`` can sit in
front of it exactly as it would in front of vLLM. It is also how the external path is tested.

Adapters are added and removed at run time with vLLM's endpoints: ``POST /v1/load_lora_adapter``
(``{"lora_name", "lora_path"}``, optionally ``sha256`` and ``base_model_id``, which vLLM does not have) and
``POST /v1/unload_lora_adapter`` (``{"lora_name"}``). A loaded name is listed by ``/v1/models`` and can be
requested as ``model``. Loading checks what ``load_runtime`` checks (safetensors only, the sha256 when
given, the rank maximum, the base model id when given, every weight landing on a module) and needs the
``admin`` scope (``RATCHET_API_KEY``, or a key granted it): without any key configured, both endpoints are
refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from pipeline.errors import RatchetError
from pipeline.principals import ANONYMOUS
from pipeline.serving.access import Access
from pipeline.serving.adapters import CONFIG, WEIGHTS, AdapterSource
from pipeline.serving.engines import EmbeddedEngine, EngineRequest, EngineResult
from pipeline.serving.limits import read_body, watch_disconnect
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
from pipeline.serving.runtime import Abort
from pipeline.serving.server import install_error_handlers
from pipeline.spec import file_sha256

NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_\-:]{0,127}$")  # no dots: peft nests modules by name


class LoadLoraRequest(BaseModel):
    """vLLM's ``LoadLoRAAdapterRequest`` (unknown fields ignored, as vLLM does), with optional checks."""

    model_config = ConfigDict(extra="ignore")
    lora_name: StrictStr = Field(description="The model name the adapter is served under.")
    lora_path: StrictStr = Field(min_length=1, description="The adapter directory on the engine's disk.")
    sha256: StrictStr | None = Field(
        default=None, description="The weights file's (or directory's) sha256; checked when given."
    )
    base_model_id: StrictInt | None = Field(
        default=None, description="The registry's base model id it was trained on; checked when given."
    )


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: StrictStr = Field(description="The model name to stop serving.")


def create_adapter_app(
    engine: EmbeddedEngine,
    *,
    api_key: str | None = None,
    access: Access | None = None,
    model_names: dict[str, str] | None = None,
    max_body_bytes: int = 0,
) -> FastAPI:
    """An OpenAI-compatible multi-LoRA app over ``engine``; ``model_names``: served model name -> the
    runtime's specialist (default: each specialist under its own name). ``access``: who may do what
    (default: ``RATCHET_API_KEY`` = ``api_key`` only)."""
    access = access or Access(api_key=api_key)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        await engine.scheduler.close()

    app = FastAPI(title="ratchet-adapters", lifespan=lifespan)
    install_error_handlers(app)
    runtime = engine.runtime
    names = dict(model_names or {s: s for s in runtime.specialists})  # changed by load / unload

    async def admin(request: Request) -> None:
        if (await access.principal(request)).name == ANONYMOUS:
            raise ApiError(
                403,
                "runtime adapter loading is off: start the engine with RATCHET_API_KEY set, or create a key "
                "with the admin scope (ratchet keys create --scope admin)",
                code="forbidden",
            )
        await access.require(request, "admin")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        await access.require(request, "chat")
        return {
            "object": "list",
            "data": [{"id": n, "object": "model", "created": 0, "owned_by": "ratchet"} for n in names],
        }

    @app.post("/v1/load_lora_adapter")
    async def load_lora(request: Request) -> PlainTextResponse:
        await admin(request)
        body = parse_body(await read_body(request, max_body_bytes), LoadLoraRequest)
        if not NAME.match(body.lora_name):
            raise ApiError(
                400,
                f"lora_name {body.lora_name!r}: expected letters, digits, _ - : (at most 128, no dots)",
                param="lora_name",
            )
        if body.lora_name in names:
            raise ApiError(
                400, f"The lora adapter '{body.lora_name}' has already been loaded.", param="lora_name"
            )
        try:
            src = await asyncio.to_thread(_source, body)
            await asyncio.to_thread(runtime.add_adapter, src, name=body.lora_name)
        except RatchetError as exc:
            raise ApiError(400, str(exc), param="lora_path") from None
        names[body.lora_name] = body.lora_name
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(request: Request) -> PlainTextResponse:
        await admin(request)
        body = parse_body(await read_body(request, max_body_bytes), UnloadLoraRequest)
        if body.lora_name not in names:
            raise ApiError(
                404,
                f"The lora adapter '{body.lora_name}' cannot be found.",
                param="lora_name",
                code="not_found",
            )
        target = names.pop(body.lora_name)
        if target not in names.values():
            await asyncio.to_thread(runtime.remove_adapter, target)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        await access.require(request, "chat")
        req = parse_body(await read_body(request, max_body_bytes), ChatRequest)
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
            names[req.model],
            messages,
            max_tokens,
            req.temperature or 0.0,
            req.top_p if req.top_p is not None else 1.0,
            req.stops(),
            req.seed,
            abort=Abort(),
        )
        cid, created = new_completion_id(), int(time.time())
        watcher = asyncio.get_running_loop().create_task(watch_disconnect(request, ereq.abort))  # type: ignore[arg-type]
        if not req.stream:
            try:
                r = await _complete(engine, ereq)
            finally:
                watcher.cancel()
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
            try:
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
            finally:  # the client left (or all was sent): its row leaves the batch
                watcher.cancel()
                ereq.abort.set("disconnected")  # type: ignore[union-attr]

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


async def _complete(engine: EmbeddedEngine, ereq: EngineRequest) -> EngineResult:
    try:
        result = None
        async for item in engine.stream(ereq):
            if isinstance(item, EngineResult):
                result = item
        assert result is not None
        return result
    except RatchetError as exc:  # unloaded while it waited
        raise ApiError(404, str(exc), param="model", code="model_not_found") from None


def _source(body: LoadLoraRequest) -> AdapterSource:
    """What the request says about the adapter, as ``load_runtime`` checks it (rank and targets from its
    own config; without a sha256 the weights file's own is used, so only later changes are caught)."""
    path = Path(body.lora_path)
    at = f"adapter {body.lora_name!r} at {path}"
    try:
        config = json.loads((path / CONFIG).read_text())
    except FileNotFoundError:
        raise RatchetError(f"{at}: no {CONFIG} (not a peft adapter directory?)") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise RatchetError(f"{at}: unreadable {CONFIG}: {exc}") from None
    weights = path / WEIGHTS
    sha = body.sha256 or (file_sha256(weights) if weights.is_file() else "")
    targets = config.get("target_modules")
    return AdapterSource(
        specialist=body.lora_name,
        path=path,
        sha256=sha,
        rank=int(config.get("r", -1)),
        target_modules=tuple(targets) if isinstance(targets, list) else (),
        base_model_id=body.base_model_id,
    )
