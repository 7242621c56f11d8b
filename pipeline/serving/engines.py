"""Engines that decode for the router: the embedded Mixture-of-LoRA runtime (default) or an external
OpenAI-compatible multi-LoRA server (vLLM / SGLang serving each adapter under a model name).

Both take the same ``EngineRequest`` (a specialist and its view of the conversation) and yield text
deltas followed by one ``EngineResult``, so routing, views, summaries and experience logging in front of
them are identical. ``ratchet serve --expose-adapters`` serves the embedded engine in the external
engines' shape (model name = specialist), which is how the external path is tested.

A request's ``abort`` (``runtime.Abort``) stops it: the embedded engine drops its row from the batch, the
external one closes its stream (which the engine sees as a client leaving); either way the text so far
comes back with the abort's reason as the finish reason. ``ExternalEngine.load_adapter`` /
``unload_adapter`` use vLLM's runtime LoRA endpoints (``/v1/load_lora_adapter``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pipeline.errors import RatchetError
from pipeline.modeling.grammar import GrammarSpec
from pipeline.modeling.templating import encode_prompt, encode_text, tokenizer_fingerprint
from pipeline.serving.decoder import TokenLogprob
from pipeline.serving.runtime import UNKNOWN, Abort, AdapterSource, GenerationRequest, MixtureRuntime
from pipeline.serving.scheduler import MicroBatchScheduler


@dataclass(frozen=True)
class EngineRequest:
    """One decode: which specialist, the messages it sees, and decoding parameters."""

    specialist: str
    messages: list[dict[str, Any]]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    tools: list[dict[str, Any]] | None = None  # offered to engines whose models call tools natively
    abort: Abort | None = None  # set to stop it (timeout, client gone)
    grammar: GrammarSpec | None = None  # constrained decoding (embedded engine)
    logprobs: int | None = None  # None: none; 0: the chosen token's; k: and the top k (embedded engine)
    # the client's own OpenAI parameters (response_format, tool_choice, parallel_tool_calls, logprobs,
    # top_logprobs) that the external engine sends unchanged; the embedded engine ignores them
    passthrough: dict[str, Any] = field(default_factory=dict)


@dataclass
class EngineResult:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    tool_calls: list[dict[str, Any]] | None = None  # when the engine parsed calls itself (external)
    prompt_ids: list[int] | None = None  # the ids decoded from (embedded engine)
    completion_ids: list[int] | None = None  # the ids decoded, the end token included (embedded engine)
    tokenizer: str | None = None  # ``tokenizer_fingerprint`` of the tokenizer of those ids
    logprobs: list[TokenLogprob] | None = None  # one per completion token, when asked


class Engine(Protocol):
    """What the router needs from a decoding backend."""

    context_limit: int | None

    def count_tokens(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> int: ...

    def stream(self, request: EngineRequest) -> AsyncIterator[str | EngineResult]: ...

    def check_grammar(self, spec: GrammarSpec) -> None: ...

    async def label_scores(
        self, messages: list[dict[str, Any]], labels: Sequence[str], specialist: str
    ) -> dict[str, float]: ...

    async def aclose(self) -> None: ...


class EmbeddedEngine:
    """The in-process runtime behind the shared micro-batching scheduler."""

    def __init__(self, runtime: MixtureRuntime, scheduler: MicroBatchScheduler):
        self.runtime = runtime
        self.scheduler = scheduler
        self.context_limit: int | None = runtime.context_limit

    def count_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
        return self.runtime.count_tokens(messages, tools)

    def check_grammar(self, spec: GrammarSpec) -> None:
        """Compile ``spec`` for the served tokenizer (cached), or raise ``GrammarError``. It may take up to
        ``grammar.COMPILE_SECONDS`` on a hostile schema: call it off the event loop."""
        self.runtime.check_grammar(spec)

    async def stream(self, request: EngineRequest) -> AsyncIterator[str | EngineResult]:
        if request.specialist not in self.runtime.specialists:
            raise RatchetError(f"specialist {request.specialist!r} is not served by this generation")
        ids = await asyncio.to_thread(
            self.runtime.encode, request.messages, request.tools
        )  # off the event loop
        ticket = self.scheduler.submit(
            self.runtime,
            GenerationRequest(
                adapter=request.specialist,
                prompt_ids=tuple(ids),
                max_new_tokens=request.max_tokens,
                temperature=request.temperature,
                top_p=request.top_p,
                stop=request.stop,
                seed=request.seed,
                abort=request.abort,
                grammar=request.grammar,
                logprobs=request.logprobs,
            ),
        )
        if request.abort is not None:
            request.abort.on_set(ticket.abort)
        async for delta in ticket.stream():
            yield delta
        r = await ticket.result
        if r.finish_reason == UNKNOWN:
            raise RatchetError(f"specialist {request.specialist!r} was unloaded before it was served")
        yield EngineResult(
            r.text,
            r.prompt_tokens,
            r.completion_tokens,
            r.finish_reason,
            prompt_ids=list(ids),
            completion_ids=list(r.completion_ids),
            tokenizer=tokenizer_fingerprint(self.runtime.tokenizer),
            # OpenAI's content logprobs leave out the end token (completion_ids keep it)
            logprobs=None if r.logprobs is None else r.logprobs[: r.completion_tokens],
        )

    async def label_scores(
        self, messages: list[dict[str, Any]], labels: Sequence[str], specialist: str
    ) -> dict[str, float]:
        return await asyncio.to_thread(self.runtime.label_scores, messages, list(labels), specialist)

    async def aclose(self) -> None:
        return None


class ExternalEngine:
    """An OpenAI-compatible server that serves each adapter as a model (``model_names[specialist]``)."""

    def __init__(
        self,
        base_url: str,
        *,
        model_names: dict[str, str],
        api_key: str | None = None,
        context_limit: int | None = None,
        tokenizer: Any = None,
        chars_per_token: float = 3.5,
        timeout: float = 120.0,
    ):
        import httpx

        self.base_url = base_url.rstrip("/")
        if not self.base_url.endswith("/v1"):
            self.base_url += "/v1"
        self.model_names = model_names
        self.context_limit = context_limit
        self.tokenizer = tokenizer
        self.chars_per_token = chars_per_token
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout)

    def count_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
        if self.tokenizer is not None:
            return len(encode_prompt(self.tokenizer, messages, fmt="openai", tools=tools))
        chars = sum(len(str(m.get("content") or "")) + 8 for m in messages) + len(str(tools or ""))
        return int(chars / self.chars_per_token) + 1

    def check_grammar(self, spec: GrammarSpec) -> None:
        """Nothing to check here: the external engine enforces the client's own parameters (``passthrough``)."""
        return None

    def _body(self, request: EngineRequest) -> dict[str, Any]:
        model = self.model_names.get(request.specialist)
        if model is None:
            raise RatchetError(f"specialist {request.specialist!r} has no model name on the external engine")
        body: dict[str, Any] = {
            "model": model,
            "messages": request.messages,
            "max_tokens": request.max_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if request.stop:
            body["stop"] = list(request.stop)
        if request.seed is not None:
            body["seed"] = request.seed
        if request.tools:
            body["tools"] = request.tools
        body.update(request.passthrough)  # the client's response_format, tool_choice, logprobs ... unchanged
        return body

    async def stream(self, request: EngineRequest) -> AsyncIterator[str | EngineResult]:
        """The engine's stream, read in its own task so that an abort can close it at any moment."""
        queue: asyncio.Queue = asyncio.Queue()
        reader = asyncio.get_running_loop().create_task(self._read(request, queue))
        # cancelled before its first step, the reader never ran: answer for it
        reader.add_done_callback(lambda t: t.cancelled() and queue.put_nowait(self._stopped(request, "")))
        if request.abort is not None:
            request.abort.on_set(lambda _reason: reader.cancel())
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, EngineResult):
                    return
        finally:
            reader.cancel()

    async def _read(self, request: EngineRequest, queue: asyncio.Queue) -> None:
        text = ""
        try:
            async for item in self._events(request):
                if isinstance(item, str):
                    text += item
                queue.put_nowait(item)
        except asyncio.CancelledError:  # aborted: what came so far, and why it stopped
            queue.put_nowait(self._stopped(request, text))
        except Exception as exc:
            queue.put_nowait(exc)

    def _stopped(self, request: EngineRequest, text: str) -> EngineResult:
        reason = (request.abort.reason if request.abort is not None else None) or "cancelled"
        if self.tokenizer is not None:
            tokens = encode_text(self.tokenizer, text)  # the model's text, counted as text
        else:
            tokens = []
        return EngineResult(text, self.count_tokens(request.messages), len(tokens), reason)

    async def _events(self, request: EngineRequest) -> AsyncIterator[str | EngineResult]:
        text, finish, usage, calls = "", "stop", {}, {}
        logprobs: list[TokenLogprob] = []
        async with self.client.stream("POST", "/chat/completions", json=self._body(request)) as resp:
            if resp.status_code >= 400:
                detail = (await resp.aread()).decode(errors="replace")[:300]
                raise RuntimeError(f"external engine answered {resp.status_code}: {detail}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if isinstance(chunk.get("error"), dict):  # an OpenAI error event (e.g. the adapter unloaded)
                    raise RuntimeError(f"external engine: {str(chunk['error'].get('message'))[:300]}")
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("content"):
                        text += delta["content"]
                        yield delta["content"]
                    for tc in delta.get("tool_calls") or []:
                        slot = calls.setdefault(
                            tc.get("index", 0),
                            {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
                        )
                        slot["id"] = tc.get("id") or slot["id"]
                        fn = tc.get("function") or {}
                        slot["function"]["name"] += fn.get("name") or ""
                        slot["function"]["arguments"] += fn.get("arguments") or ""
                    logprobs += [
                        _token_logprob(item) for item in (choice.get("logprobs") or {}).get("content") or []
                    ]
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
        yield EngineResult(
            text,
            int(usage.get("prompt_tokens", self.count_tokens(request.messages))),
            int(usage.get("completion_tokens", 0)),
            "stop" if finish == "tool_calls" else finish,
            [calls[k] for k in sorted(calls)] or None,
            logprobs=logprobs or None,
        )

    async def label_scores(
        self, messages: list[dict[str, Any]], labels: Sequence[str], specialist: str
    ) -> dict[str, float]:
        raise RatchetError("entry-adapter label decoding needs the embedded engine; use a trained classifier")

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        import httpx

        try:
            return await self.client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise RatchetError(f"external engine {self.base_url}{path} unreachable: {exc!r}") from None

    async def model_ids(self) -> set[str]:
        """The model names the engine serves now (``GET /v1/models``)."""
        resp = await self._call("GET", "/models")
        if resp.status_code >= 400:
            raise RatchetError(f"external engine {self.base_url}: GET /models answered {resp.status_code}")
        return {str(m.get("id")) for m in resp.json().get("data") or []}

    async def load_adapter(self, name: str, src: AdapterSource) -> None:
        """Have the engine load ``src`` as model ``name`` (vLLM's ``POST /v1/load_lora_adapter``; the
        sha256 and base model id are extra fields that the project's own engine checks)."""
        body = {
            "lora_name": name,
            "lora_path": str(src.path),
            "sha256": src.sha256,
            "base_model_id": src.base_model_id,
        }
        resp = await self._call("POST", "/load_lora_adapter", json=body)
        if resp.status_code >= 400:
            raise RatchetError(
                f"external engine {self.base_url} refused to load adapter {name!r} from {src.path}: "
                f"{resp.status_code} {_message(resp)}"
            )

    async def unload_adapter(self, name: str) -> None:
        resp = await self._call("POST", "/unload_lora_adapter", json={"lora_name": name})
        if resp.status_code >= 400:
            raise RatchetError(
                f"external engine {self.base_url} refused to unload {name!r}: {resp.status_code} {_message(resp)}"
            )

    async def aclose(self) -> None:
        await self.client.aclose()


def _token_logprob(item: dict[str, Any]) -> TokenLogprob:
    """An OpenAI ``logprobs.content`` item as a ``TokenLogprob``."""

    def raw(entry: dict[str, Any]) -> list[int]:
        given = entry.get("bytes")
        return list(given) if isinstance(given, list) else list(str(entry.get("token", "")).encode())

    top = [
        (str(t.get("token", "")), float(t.get("logprob", 0.0)), raw(t))
        for t in item.get("top_logprobs") or []
        if isinstance(t, dict)
    ]
    return TokenLogprob(str(item.get("token", "")), float(item.get("logprob", 0.0)), raw(item), top)


def _message(resp: Any) -> str:
    """The error message of an engine's answer (OpenAI's or vLLM's error shape, or its text)."""
    try:
        data = resp.json()
    except ValueError:
        return resp.text[:300]
    err = data.get("error", data) if isinstance(data, dict) else data
    return str(err.get("message", err) if isinstance(err, dict) else err)[:300]


async def complete(engine: Engine, request: EngineRequest) -> EngineResult:
    """Run a request to the end and return its result."""
    result = None
    async for item in engine.stream(request):
        if isinstance(item, EngineResult):
            result = item
    assert result is not None
    return result
