"""The embedded engine served the way vLLM / SGLang serve LoRA adapters: one OpenAI model per adapter.

``ratchet serve --expose-adapters`` runs this app: ``model`` names an adapter, the messages are decoded as
given (no routing, no views, no experience), so another ``ratchet serve --engine external`` can sit in
front of it exactly as it would in front of vLLM. It is also how the external path is tested.

Adapters are added and removed at run time with vLLM's endpoints: ``POST /v1/load_lora_adapter``
(``{"lora_name", "lora_path"}``, optionally ``sha256`` and ``base_model_id``, which vLLM does not have) and
``POST /v1/unload_lora_adapter`` (``{"lora_name"}``). A loaded name is listed by ``/v1/models`` (with vLLM's
``parent``: None for a name the bare base answers) and can be requested as ``model``. Loading checks what
``load_runtime`` checks (safetensors only, a valid header of float LoRA weights of the config's rank, the
sha256 when given, the rank maximum, the base model id when given, every weight landing on a module) and
needs the ``admin`` scope (``RATCHET_API_KEY``, or a key granted it): without any key configured, both
endpoints are refused. Only directories inside the artifact store (``RATCHET_HOME``'s) or an
``adapter_roots`` directory are loaded; any other path, a URL, or a link leading outside is refused (400).
Every refusal is one line.

Unloading a name ends the requests in flight for it: a stream gets an OpenAI-style error event
(``data: {"error": {...}}``) and is closed, a non-streamed request a 404 error; the unload itself succeeds.

A chat request is decoded as vLLM decodes it: the offered ``tools`` rendered into the prompt;
``response_format`` (``json_schema`` / ``json_object``) and a forced ``tool_choice`` (``required`` or named,
``parallel_tool_calls``) enforced by constrained decoding (``pipeline.serving.constraints``; tools under
``auto`` with a response format: calls or the format's JSON), a call answered as native ``tool_calls``
(finish reason ``tool_calls``; streamed as tool-call deltas once decoded); ``logprobs`` / ``top_logprobs``
(one entry per token of the text, none for the end token). Unknown parameters are ignored, as vLLM does;
what it does not do (``n`` > 1, penalties, ``logit_bias`` ...) is a 400 naming the parameter.

vLLM's text completions (``POST /v1/completions``) take a prompt as token ids and give back token ids and
log-probabilities, of the completion and (vLLM's ``prompt_logprobs``) of the prompt: the loop's ``openai``
rollout engine and its parity probe speak it (``pipeline.serving.textcompletions``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import weakref
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from pipeline.errors import RatchetError
from pipeline.experience.principals import ANONYMOUS
from pipeline.experience.toolcalls import assistant_message
from pipeline.modeling.grammar import GrammarSpec
from pipeline.serving.access import Access
from pipeline.serving.adapters import CONFIG, WEIGHTS, AdapterSource
from pipeline.serving.completions import call_deltas, logprobs_body
from pipeline.serving.constraints import checked_grammar, logprobs_wanted
from pipeline.serving.engines import EmbeddedEngine, EngineRequest, EngineResult
from pipeline.serving.limits import read_body, watch_disconnect
from pipeline.serving.protocol import (
    REFUSED,
    ApiError,
    ChatRequest,
    chunk,
    completion_body,
    new_completion_id,
    parse_body,
    sse,
    unknown_model,
    usage_of,
)
from pipeline.serving.runtime import BASE, Abort
from pipeline.serving.server import install_error_handlers
from pipeline.serving.textcompletions import UNLOADED, install_completions
from pipeline.settings import get_settings
from pipeline.specs.loading import file_sha256

log = logging.getLogger(__name__)

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
    adapter_roots: Sequence[str | Path] = (),
) -> FastAPI:
    """An OpenAI-compatible multi-LoRA app over ``engine``; ``model_names``: served model name -> the
    runtime's specialist (default: each specialist under its own name). ``access``: who may do what
    (default: ``RATCHET_API_KEY`` = ``api_key`` only). ``adapter_roots``: directories besides the artifact
    store that ``/v1/load_lora_adapter`` may load from."""
    access = access or Access(api_key=api_key)
    roots = [get_settings().artifacts_dir, *map(Path, adapter_roots)]

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        await engine.scheduler.close()

    app = FastAPI(title="ratchet-adapters", lifespan=lifespan)
    install_error_handlers(app)
    runtime = engine.runtime
    names = dict(model_names or {s: s for s in runtime.specialists})  # changed by load / unload
    # served name -> the aborts of its requests being answered (ended by unload; weak: a request whose
    # response never started leaves no trace)
    inflight: dict[str, weakref.WeakSet[Abort]] = {}

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
        # vLLM's ``parent``: None for a name the bare base answers, the base's name for an adapter
        bare = [n for n, s in names.items() if runtime.adapter_name(s) == BASE]
        parent = {n: None if n in bare else (bare[0] if bare else BASE) for n in names}
        return {
            "object": "list",
            "data": [
                {"id": n, "object": "model", "created": 0, "owned_by": "ratchet", "parent": parent[n]}
                for n in names
            ],
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
            src = await asyncio.to_thread(_source, body, roots)
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
        for abort in inflight.pop(body.lora_name, set()):  # they leave their batch at its next step
            abort.set(UNLOADED)
        if target not in names.values():
            await asyncio.to_thread(runtime.remove_adapter, target)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        await access.require(request, "chat")
        req = parse_body(await read_body(request, max_body_bytes), ChatRequest)
        if req.model not in names:
            raise unknown_model(req.model, names)
        refusal = _refusal(req)
        if refusal is not None:
            raise refusal
        messages = req.plain_messages()
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []] if req.tool_names() else None
        max_tokens = req.limit() or 64
        limit = engine.context_limit
        if limit and engine.count_tokens(messages, tools) + max_tokens > limit:
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
            tools=tools,
            abort=Abort(),
            grammar=await checked_grammar(req, engine, fmt=CALL_FORMAT),
            logprobs=logprobs_wanted(req),
        )
        calls = ereq.grammar is not None and ereq.grammar.kind == "tool_calls"  # read back as tool_calls
        cid, created = new_completion_id(), int(time.time())
        inflight.setdefault(req.model, weakref.WeakSet()).add(ereq.abort)  # type: ignore[arg-type]
        watcher = asyncio.get_running_loop().create_task(watch_disconnect(request, ereq.abort))  # type: ignore[arg-type]

        def done() -> None:
            watcher.cancel()
            inflight.get(req.model, set()).discard(ereq.abort)  # type: ignore[arg-type]

        if not req.stream:
            try:
                r = await _complete(engine, ereq, req.model)
            finally:
                done()
            message = _message(r.text, req, ereq.grammar, cid)
            body = completion_body(
                cid=cid,
                model=req.model,
                message=message,
                finish_reason="tool_calls" if message.get("tool_calls") else r.finish_reason,
                usage=usage_of(r.prompt_tokens, r.completion_tokens),
                metadata={},
                created=created,
            )
            body["choices"][0]["logprobs"] = _logprobs(r)
            return JSONResponse(body)

        async def events():
            try:
                yield chunk(cid, req.model, created, {"role": "assistant", "content": ""})
                result = None
                try:
                    async for item in engine.stream(ereq):
                        if isinstance(item, EngineResult):
                            result = item
                        elif not calls:  # a call (or its JSON alternative) is sent once read back
                            yield chunk(cid, req.model, created, {"content": item})
                    if result is not None and result.finish_reason == UNLOADED:
                        raise RatchetError(unloaded(req.model))
                except RatchetError as exc:  # unloaded before or while it was decoded
                    yield sse(ApiError(404, str(exc), param="model", code="model_not_found").body())
                    return
                except Exception:  # a failed batch: the client is told, not cut off
                    log.exception("stream for %s failed", req.model)
                    yield sse(ApiError(500, "the engine failed on this request", type="server_error").body())
                    return
                finish = result.finish_reason if result else "stop"
                if calls and result is not None:
                    message = _message(result.text, req, ereq.grammar, cid)
                    for delta in _deltas(message):
                        yield chunk(cid, req.model, created, delta)
                    finish = "tool_calls" if message.get("tool_calls") else finish
                last = {"index": 0, "delta": {}, "finish_reason": finish, "logprobs": None}
                if result is not None:
                    last["logprobs"] = _logprobs(result)
                yield sse(
                    {
                        "id": cid,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": req.model,
                        "choices": [last],
                    }
                )
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
                done()
                ereq.abort.set("disconnected")  # type: ignore[union-attr]

        return StreamingResponse(events(), media_type="text/event-stream")

    install_completions(
        app,
        engine,
        access=access,
        names=names,
        max_body_bytes=max_body_bytes,
        unloaded=unloaded,
        inflight=inflight,
    )
    return app


CALL_FORMAT = "json"  # a forced call is decoded as the renderer's JSON and answered as native tool_calls


def _refusal(req: ChatRequest) -> ApiError | None:
    """The 400 for a parameter this engine does not honour: ``n`` > 1, a non-neutral ``REFUSED`` one, a
    ``tool_choice`` naming no offered tool, ``top_logprobs`` without ``logprobs`` (unknown parameters are
    ignored, as vLLM does)."""
    if req.choices() > 1:
        return ApiError(400, "n > 1 is not supported by this engine: send one request per choice", param="n")
    known = req.model_copy()
    known.__pydantic_extra__ = {k: v for k, v in (req.model_extra or {}).items() if k in REFUSED}
    return known.unsupported()


def _message(text: str, req: ChatRequest, grammar: GrammarSpec | None, cid: str) -> dict[str, Any]:
    """The reply: under a tool-call grammar, the calls it wrote as ``tool_calls`` (else its JSON as text)."""
    if grammar is None or grammar.kind != "tool_calls":
        return {"role": "assistant", "content": text}
    return assistant_message(text, req.tool_names(), CALL_FORMAT, seed_text=cid)


def _deltas(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A read-back reply as stream deltas: its text, or each call's head then its arguments (OpenAI's)."""
    if not message.get("tool_calls"):
        return [{"content": message["content"]}] if message.get("content") else []
    return call_deltas(message["tool_calls"])


def _logprobs(result: EngineResult) -> dict[str, Any] | None:
    """OpenAI's ``logprobs`` of a result, without the end token's entry (it is not part of the text)."""
    if result.logprobs is None:
        return None
    return logprobs_body(replace(result, logprobs=result.logprobs[: result.completion_tokens]))


def unloaded(model: str) -> str:
    return f"model {model!r} was unloaded while this request was being answered"


async def _complete(engine: EmbeddedEngine, ereq: EngineRequest, model: str) -> EngineResult:
    try:
        result = None
        async for item in engine.stream(ereq):
            if isinstance(item, EngineResult):
                result = item
        assert result is not None
        if result.finish_reason == UNLOADED:
            raise RatchetError(unloaded(model))
        return result
    except RatchetError as exc:  # unloaded while it waited or was decoded
        raise ApiError(404, str(exc), param="model", code="model_not_found") from None


def allowed_directory(lora_path: str, roots: Sequence[Path], at: str) -> Path:
    """``lora_path`` resolved (links followed), when it is an existing directory inside one of ``roots``;
    a URL, a missing path or anything outside them is a ``RatchetError``."""
    if "://" in lora_path:
        raise RatchetError(f"{at}: lora_path must be a directory on the engine's disk, not a URL")
    try:
        path = Path(lora_path).resolve(strict=True)
    except (OSError, RuntimeError, ValueError):  # missing, a loop of links, a NUL byte
        raise RatchetError(f"{at}: no such directory") from None
    if not any(path.is_relative_to(root.resolve()) for root in roots):
        raise RatchetError(
            f"{at}: outside the directories adapters are loaded from ({', '.join(map(str, roots))}); "
            "put it in the artifact store or start the engine with --adapter-root"
        )
    if not path.is_dir():
        raise RatchetError(f"{at}: not a directory")
    return path


def _source(body: LoadLoraRequest, roots: Sequence[Path]) -> AdapterSource:
    """What the request says about the adapter, as ``load_runtime`` checks it (rank and targets from its
    own config; without a sha256 the weights file's own is used, so only later changes are caught)."""
    at = f"adapter {body.lora_name!r} at {body.lora_path[:300]!r}"  # repr: one line, whatever it holds
    path = allowed_directory(body.lora_path, roots, at)
    try:
        config = json.loads((path / CONFIG).read_text())
    except FileNotFoundError:
        raise RatchetError(f"{at}: no {CONFIG} (not a peft adapter directory?)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RatchetError(f"{at}: unreadable {CONFIG}: {str(exc).splitlines()[0][:200]}") from None
    if not isinstance(config, dict):
        raise RatchetError(f"{at}: {CONFIG} is not a JSON object")
    weights = path / WEIGHTS
    sha = body.sha256 or (file_sha256(weights) if weights.is_file() else "")
    targets = config.get("target_modules")
    rank = config.get("r", -1)
    return AdapterSource(
        specialist=body.lora_name,
        path=path,
        sha256=sha,
        rank=rank if type(rank) is int else -1,  # anything else is refused by check_adapter_files
        target_modules=tuple(map(str, targets)) if isinstance(targets, list) else (),
        base_model_id=body.base_model_id,
    )
