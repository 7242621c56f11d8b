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

Every byte a client sends is untrusted: a ``seed`` (plus ``n - 1``) outside what a torch generator takes, a
string or boolean for a number, more than ``MAX_STOPS`` stop strings, an id outside the vocabulary, a
``prompt_logprobs`` request whose logits would pass ``MAX_PROMPT_LOGPROB_VALUES`` are one-line 400s before
anything is decoded (a bad seed would have failed the whole batch, other clients' rows with it). A text
prompt is tokenized, and the prompt's logprobs decoded, off the event loop. The choices of a request whose
client disconnects, or whose model is unloaded (a 404), leave their batch at the next step.
"""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

from pipeline.errors import RatchetError
from pipeline.modeling.decoding import end_token_ids
from pipeline.modeling.templating import encode_text
from pipeline.serving.access import Access
from pipeline.serving.engines import EmbeddedEngine
from pipeline.serving.limits import read_body, watch_disconnect
from pipeline.serving.protocol import ApiError, parse_body, unknown_model, usage_of
from pipeline.serving.runtime import UNKNOWN, Abort, GenerationRequest, GenerationResult, MixtureRuntime

UNLOADED = "unloaded"  # the abort (and finish) reason of a request whose model was unloaded

MAX_TOP = 20  # vLLM's default max_logprobs
MAX_STOPS = 64  # stop strings per request: each is looked for in every row's text at every step of its batch
SEEDS = (-(2**63), 2**64 - 1)  # what a torch generator takes: beyond it, the whole batch failed
MAX_PROMPT_LOGPROB_VALUES = 1 << 28
"""Most prompt positions x vocabulary a ``prompt_logprobs`` request may score (one teacher-forced forward's
logits, ``[prompt_len, vocab]``, held at once: 2**28 values are 512 MiB in bf16): beyond, a 400."""
LOGSOFTMAX_ROWS = 1024  # prompt positions log-softmaxed in float32 at a time


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
        default=None, description=f"Stop strings (cut from the text); at most {MAX_STOPS}."
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

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _numbers(cls, value: Any) -> Any:
        if isinstance(value, (str, bool)):  # pydantic's lax float takes `true` and `"0.5"`
            raise ValueError("must be a number")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        return value


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
    inflight: dict[str, weakref.WeakSet[Abort]],
) -> None:
    """Add ``POST /v1/completions`` to ``app``; ``names``: served model name -> the runtime's adapter (read
    at each request: load and unload change it); ``unloaded(model)``: the error of a request whose model was
    unloaded while it waited or was decoded; ``inflight``: served name -> the aborts of its requests being
    answered (the unload endpoint sets them: the rows leave their batch). A client that disconnects ends
    its choices' rows too (``limits.watch_disconnect``)."""

    view = CompletionView(engine.runtime)

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        await access.require(request, "chat")
        req = parse_body(await read_body(request, max_body_bytes), CompletionRequest)
        if req.model not in names:
            raise unknown_model(req.model, names)
        for flag in ("stream", "echo"):
            if getattr(req, flag):
                raise ApiError(400, f"{flag} is not supported by this endpoint", param=flag)
        if req.seed is not None and not SEEDS[0] <= req.seed <= req.seed + req.n - 1 <= SEEDS[1]:
            raise ApiError(400, f"seed (plus n - 1) must be within {SEEDS[0]}..{SEEDS[1]}", param="seed")
        runtime = engine.runtime
        ids = await asyncio.to_thread(_prompt_ids, req, runtime)  # a long text: tokenized off the loop
        if engine.context_limit and len(ids) + req.max_tokens > engine.context_limit:
            raise ApiError(
                400,
                f"prompt plus max_tokens exceed the context window of {engine.context_limit} tokens",
                param="prompt",
                code="context_length_exceeded",
            )
        if req.prompt_logprobs is not None and len(ids) * runtime.vocab_size > MAX_PROMPT_LOGPROB_VALUES:
            raise ApiError(
                400,
                f"prompt_logprobs of a {len(ids)}-token prompt would score {len(ids) * runtime.vocab_size} "
                f"values, above this engine's limit of {MAX_PROMPT_LOGPROB_VALUES} (prompt tokens x "
                "vocabulary): send a shorter prompt",
                param="prompt_logprobs",
            )
        adapter = names[req.model]
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        abort = Abort()  # one for every choice: unload and disconnect end them all
        inflight.setdefault(req.model, weakref.WeakSet()).add(abort)
        watcher = asyncio.get_running_loop().create_task(watch_disconnect(request, abort))
        try:
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
                        abort=abort,
                        logprobs=req.logprobs,
                    ),
                )
                for i in range(req.n)
            ]
            try:
                results: list[GenerationResult] = list(await asyncio.gather(*(t.result for t in tickets)))
            finally:  # a failed batch or a cancelled request: the other choices leave theirs too
                abort.set("ended")
            if any(r.finish_reason in (UNKNOWN, UNLOADED) for r in results) or req.model not in names:
                raise ApiError(404, unloaded(req.model), param="model", code="model_not_found")
            if abort.reason == "disconnected":  # nobody reads the answer: nothing more is computed
                raise ApiError(499, "the client disconnected", code="client_disconnected")
            scored = None
            if req.prompt_logprobs is not None:
                try:
                    scored = await asyncio.to_thread(
                        prompt_logprobs, runtime, ids, adapter, req.prompt_logprobs
                    )
                except RatchetError:  # unloaded between decoding and scoring
                    raise ApiError(404, unloaded(req.model), param="model", code="model_not_found") from None
        finally:
            watcher.cancel()
            inflight.get(req.model, weakref.WeakSet()).discard(abort)
        # each prompt token decoded: off the loop
        choices = await asyncio.to_thread(_choices, results, req, ids, scored, runtime.tokenizer)
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

    with runtime.lock, torch.inference_mode():
        if adapter not in runtime.specialists:  # unloaded since the request was admitted: never the base's
            raise RatchetError(f"{adapter!r} is not served")
        name = runtime.adapter_name(adapter)
        runtime._ensure([name])
        x = torch.tensor([ids], device=runtime.device)
        logits = runtime.model(input_ids=x, use_cache=False, **runtime._adapter_kwargs([name])).logits[0, :-1]
    targets = torch.tensor(ids[1:], device=logits.device)
    parts: list[tuple[Any, Any, Any, Any]] = []
    for at in range(0, len(ids) - 1, LOGSOFTMAX_ROWS):  # position p predicts token p + 1; float32 by chunks
        logp = torch.log_softmax(logits[at : at + LOGSOFTMAX_ROWS].float(), dim=-1)
        chosen = logp.gather(-1, targets[at : at + LOGSOFTMAX_ROWS, None])[:, 0]
        top_v, top_i = logp.topk(top, dim=-1) if top else (logp[:, :0], logp[:, :0].long())
        parts.append((chosen, (logp > chosen[:, None]).sum(-1) + 1, top_v, top_i))
    if not parts:  # a one-token prompt: nothing to score
        return [None]
    chosen, ranks, top_v, top_i = (torch.cat(t) for t in zip(*parts, strict=True))
    rows: list[dict[int, tuple[float, int]] | None] = [None]
    for p, (tok, lp, rank) in enumerate(zip(ids[1:], chosen.tolist(), ranks.tolist(), strict=True)):
        row = {
            int(t): (float(v), k + 1)
            for k, (t, v) in enumerate(zip(top_i[p].tolist(), top_v[p].tolist(), strict=True))
        }
        row[tok] = (float(lp), int(rank))
        rows.append(row)
    return rows


def _choices(
    results: list[GenerationResult],
    req: CompletionRequest,
    ids: list[int],
    scored: list[dict[int, tuple[float, int]] | None] | None,
    tokenizer: Any,
) -> list[dict[str, Any]]:
    """The choices in vLLM's shape; the prompt's logprobs built once, the same rows in every choice."""
    rows = None
    if scored is not None:
        rows = [
            None
            if row is None
            else {
                str(t): {"logprob": lp, "rank": rank, "decoded_token": tokenizer.decode([t])}
                for t, (lp, rank) in row.items()
            }
            for row in scored
        ]
    return [_choice(i, r, req, ids, rows) for i, r in enumerate(results)]


def _choice(
    index: int,
    r: GenerationResult,
    req: CompletionRequest,
    ids: list[int],
    prompt_rows: list[dict[str, Any] | None] | None,
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
    if prompt_rows is not None:
        choice["prompt_logprobs"] = prompt_rows
    if req.return_token_ids:
        choice["prompt_token_ids"] = list(ids)
        choice["token_ids"] = list(r.completion_ids)
    return choice
