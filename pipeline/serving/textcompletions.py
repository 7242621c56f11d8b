"""vLLM's text completions (``POST /v1/completions``) on the embedded engine: the rollout engine's protocol.

The loop's ``openai`` rollout engine (``pipeline.modeling.samplers``) sends prompts as token ids and reads
token ids and log-probabilities back, the way RL trainers drive vLLM; ``ratchet serve --expose-adapters``
answers the same requests so that the path is tested without vLLM. The request and response follow vLLM's
``CompletionRequest`` / ``CompletionResponse``:

- ``prompt``: a list of token ids (decoded from as given) or a string (encoded as literal text);
- ``max_tokens`` (vLLM's default 16), ``temperature`` (default 1.0), ``top_p``, ``seed``, ``stop``, ``n``
  (choice ``i`` is sampled with ``seed + i`` when a seed is given);
- ``logprobs: k``: each completion token's log-probability (the raw log-softmax, as vLLM reports by default)
  and the ``k`` most likely, in the legacy shape (``tokens``, ``token_logprobs``, ``top_logprobs``,
  ``text_offset``);
- vLLM's extras: ``prompt_logprobs: k`` (per choice, one entry per prompt token, the first ``None``; each a
  map from token id to ``{"logprob", "rank", "decoded_token"}`` holding the prompt's own token and the ``k``
  most likely) and ``return_token_ids`` (``prompt_token_ids`` and ``token_ids`` on each choice).

Completion ids (and their logprobs) include the end token a choice stopped on, as vLLM's do; the text does
not. A choice ends at the model's end tokens only (``CompletionView``), as in vLLM and the loop's own
decoding, not at every special token as chat serving ends a reply. Streaming, ``echo`` and batched prompts (a list of prompts) are refused with a 400 naming the parameter.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from pipeline.modeling.decoding import end_token_ids
from pipeline.modeling.templating import encode_text
from pipeline.serving.access import Access
from pipeline.serving.engines import EmbeddedEngine
from pipeline.serving.limits import read_body
from pipeline.serving.protocol import ApiError, parse_body, usage_of
from pipeline.serving.runtime import UNKNOWN, Abort, GenerationRequest, GenerationResult, MixtureRuntime

MAX_TOP = 20  # vLLM's default max_logprobs


class CompletionRequest(BaseModel):
    """vLLM's ``CompletionRequest`` as far as this engine honours it (unknown fields ignored, as vLLM does)."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr = Field(description="The served adapter (or specialist) name to decode with.")
    prompt: list[StrictInt] | StrictStr = Field(
        description="The prompt: token ids, decoded from as given, or text, encoded as literal text."
    )
    max_tokens: StrictInt = Field(default=16, ge=1, description="Most tokens to decode per choice.")
    temperature: float | None = Field(
        default=None, ge=0, description="Sampling temperature; 0: greedy; default 1."
    )
    top_p: float | None = Field(default=None, gt=0, le=1, description="Nucleus sampling mass; default 1.")
    seed: StrictInt | None = Field(default=None, description="Seed of choice 0 (choice i: seed + i).")
    n: StrictInt = Field(default=1, ge=1, le=64, description="Choices to decode for the prompt.")
    stop: StrictStr | list[StrictStr] | None = Field(
        default=None, description="Stop strings (cut from the text)."
    )
    logprobs: StrictInt | None = Field(
        default=None, ge=0, le=MAX_TOP, description="Completion tokens' logprobs and this many most likely."
    )
    prompt_logprobs: StrictInt | None = Field(
        default=None, ge=0, le=MAX_TOP, description="vLLM: prompt tokens' logprobs and this many most likely."
    )
    return_token_ids: StrictBool | None = Field(
        default=None, description="vLLM: add `prompt_token_ids` and `token_ids` to each choice."
    )
    stream: StrictBool | None = Field(default=None, description="Streaming: refused by this endpoint.")
    echo: StrictBool | None = Field(default=None, description="Echo the prompt: refused by this endpoint.")


class CompletionView:
    """The runtime as vLLM's completions decode with it: a row ends only at the model's end tokens
    (``decoding.end_token_ids``: its EOS and ``generation_config``'s), where vLLM and the loop's own decoding
    end, not at every special token as chat serving does (``MixtureRuntime.end_ids``). Everything else is
    the runtime's own, looked up at each use (its lock, model, adapters): rows of both share its forward
    passes one at a time, in separate batches (the scheduler batches per runtime object)."""

    def __init__(self, runtime: MixtureRuntime):
        self._runtime = runtime
        self.end_ids = end_token_ids(runtime.model, runtime.tokenizer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)

    def generate(self, requests: Any, on_text: Callable | None = None) -> list[GenerationResult]:
        return MixtureRuntime.generate(self, requests, on_text)  # type: ignore[arg-type]


def install_completions(
    app: FastAPI,
    engine: EmbeddedEngine,
    *,
    access: Access,
    names: dict[str, str],
    max_body_bytes: int,
    unloaded: Callable[[str], str],
) -> None:
    """Add ``POST /v1/completions`` to ``app``; ``names``: served model name -> the runtime's adapter (read
    at each request: load and unload change it); ``unloaded(model)``: the error of a request whose model was
    unloaded while it waited."""

    view = CompletionView(engine.runtime)

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        await access.require(request, "chat")
        req = parse_body(await read_body(request, max_body_bytes), CompletionRequest)
        if req.model not in names:
            raise ApiError(
                404,
                f"model {req.model!r} does not exist: adapters are {', '.join(names)}",
                param="model",
                code="model_not_found",
            )
        for flag in ("stream", "echo"):
            if getattr(req, flag):
                raise ApiError(400, f"{flag} is not supported by this endpoint", param=flag)
        runtime = engine.runtime
        ids = _prompt_ids(req, runtime)
        if engine.context_limit and len(ids) + req.max_tokens > engine.context_limit:
            raise ApiError(
                400,
                f"prompt plus max_tokens exceed the context window of {engine.context_limit} tokens",
                param="prompt",
                code="context_length_exceeded",
            )
        adapter = names[req.model]
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        tickets = [
            engine.scheduler.submit(
                view,
                GenerationRequest(
                    adapter=adapter,
                    prompt_ids=tuple(ids),
                    max_new_tokens=req.max_tokens,
                    temperature=1.0 if req.temperature is None else req.temperature,
                    top_p=1.0 if req.top_p is None else req.top_p,
                    stop=stop,
                    seed=None if req.seed is None else req.seed + i,
                    abort=Abort(),
                    logprobs=req.logprobs,
                ),
            )
            for i in range(req.n)
        ]
        results: list[GenerationResult] = list(await asyncio.gather(*(t.result for t in tickets)))
        if any(r.finish_reason == UNKNOWN for r in results):
            raise ApiError(404, unloaded(req.model), param="model", code="model_not_found")
        scored = None
        if req.prompt_logprobs is not None:
            scored = await asyncio.to_thread(prompt_logprobs, runtime, ids, adapter, req.prompt_logprobs)
        choices = [_choice(i, r, req, ids, scored, runtime.tokenizer) for i, r in enumerate(results)]
        return JSONResponse(
            {
                "id": "cmpl-" + uuid.uuid4().hex,
                "object": "text_completion",
                "created": int(time.time()),
                "model": req.model,
                "choices": choices,
                "usage": usage_of(len(ids), sum(len(r.completion_ids) for r in results)),
            }
        )


def _prompt_ids(req: CompletionRequest, runtime: MixtureRuntime) -> list[int]:
    """The prompt's token ids (text encoded as literal text), each inside the vocabulary."""
    ids = encode_text(runtime.tokenizer, req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
    if not ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    bad = next((t for t in ids if not 0 <= t < runtime.vocab_size), None)
    if bad is not None:
        raise ApiError(
            400,
            f"prompt token id {bad} is outside the vocabulary (0..{runtime.vocab_size - 1})",
            param="prompt",
        )
    return ids


def prompt_logprobs(
    runtime: MixtureRuntime, ids: list[int], adapter: str, top: int = 0
) -> list[dict[int, tuple[float, int]] | None]:
    """Each prompt token's log-probability given the tokens before it under ``adapter`` (one teacher-forced
    forward, as vLLM's ``prompt_logprobs``): ``None`` for the first, then ``{token id: (logprob, rank)}``
    holding the prompt's own token and the ``top`` most likely (rank 1 = most likely)."""
    import torch

    name = runtime.adapter_name(adapter)
    with runtime.lock, torch.inference_mode():
        runtime._ensure([name])
        x = torch.tensor([ids], device=runtime.device)
        out = runtime.model(input_ids=x, use_cache=False, **runtime._adapter_kwargs([name]))
        logp = torch.log_softmax(out.logits[0, :-1].float(), dim=-1)  # position p predicts token p + 1
    targets = torch.tensor(ids[1:], device=logp.device)
    chosen = logp.gather(-1, targets[:, None])[:, 0]
    ranks = (logp > chosen[:, None]).sum(-1) + 1
    top_v, top_i = logp.topk(top, dim=-1) if top else (logp[:, :0], logp[:, :0].long())
    rows: list[dict[int, tuple[float, int]] | None] = [None]
    for p, (tok, lp, rank) in enumerate(zip(ids[1:], chosen.tolist(), ranks.tolist(), strict=True)):
        row = {
            int(t): (float(v), k + 1)
            for k, (t, v) in enumerate(zip(top_i[p].tolist(), top_v[p].tolist(), strict=True))
        }
        row[tok] = (float(lp), int(rank))
        rows.append(row)
    return rows


def _choice(
    index: int,
    r: GenerationResult,
    req: CompletionRequest,
    ids: list[int],
    scored: list[dict[int, tuple[float, int]] | None] | None,
    tokenizer: Any,
) -> dict[str, Any]:
    """One choice in vLLM's shape (``CompletionResponseChoice``)."""
    choice: dict[str, Any] = {
        "index": index,
        "text": r.text,
        "logprobs": None,
        "finish_reason": r.finish_reason,
        "stop_reason": None,
    }
    if r.logprobs is not None:
        offsets, at = [], 0
        for t in r.logprobs:
            offsets.append(at)
            at += len(t.token)
        choice["logprobs"] = {
            "text_offset": offsets,
            "token_logprobs": [t.logprob for t in r.logprobs],
            "tokens": [t.token for t in r.logprobs],
            "top_logprobs": [{text: lp for text, lp, _raw in t.top} for t in r.logprobs],
        }
    if scored is not None:
        choice["prompt_logprobs"] = [
            None
            if row is None
            else {
                str(t): {"logprob": lp, "rank": rank, "decoded_token": tokenizer.decode([t])}
                for t, (lp, rank) in row.items()
            }
            for row in scored
        ]
    if req.return_token_ids:
        choice["prompt_token_ids"] = list(ids)
        choice["token_ids"] = list(r.completion_ids)
    return choice
