"""The running server's state: the generation served now, and route -> answer -> summary -> record.

``ServerState`` holds the served generation (swapped atomically when a new champion is promoted; requests
in flight keep the one they started with), the micro-batching scheduler, the server-side ``TurnMemory``
(who served which assistant message, and its summary), the admission of turns and the experience recorder.

A turn still decoding ``request_timeout_s`` after it arrived is stopped (its row leaves the batch) and the
client gets 504; a client that disconnects stops its turn the same way. Either turn is still recorded,
with what the model produced until then and ``finish_reason`` ``timeout`` or ``disconnected`` (its
summary is not generated: no more work is spent on it).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from pipeline.errors import RatchetError
from pipeline.experience.toolcalls import assistant_message
from pipeline.registry import TraceRow, get_engine
from pipeline.serving.constraints import checked_grammar, logprobs_wanted
from pipeline.serving.engines import EngineRequest, EngineResult, complete
from pipeline.serving.limits import Admission, Slot, watch_disconnect
from pipeline.serving.protocol import ApiError, ChatRequest, new_completion_id
from pipeline.serving.recorder import ExperienceRecorder
from pipeline.serving.router import route_turn, turn_from_messages
from pipeline.serving.runtime import Abort
from pipeline.serving.scheduler import MicroBatchScheduler
from pipeline.serving.served import (
    ServeConfig,
    Served,
    champion_id,
    load_served,
    plan_generation,
    sync_engine_adapters,
)
from pipeline.serving.traces import STOPPED, ChatTurn, trace_row
from pipeline.serving.views import (
    ContextOverflowError,
    TurnMemory,
    TurnRecord,
    build_view,
    extract_summary,
    summary_messages,
)
from pipeline.settings import get_settings
from pipeline.specs.harness import DecodingParams

log = logging.getLogger(__name__)
PREPARING_THREADS = 2  # requests whose view is fitted to the window at once (the others wait their turn)


class ServerState:
    """The running server: the generation served now, the batcher, the memory of turns, the recorder."""

    def __init__(self, config: ServeConfig):
        self.config = config
        self.scheduler = MicroBatchScheduler(
            max_batch_size=config.max_batch_size, max_wait_ms=config.max_wait_ms
        )
        self.memory = TurnMemory()
        self.recorder: ExperienceRecorder | None = None
        self.current: Served | None = None
        self.pending: dict[str, asyncio.Task] = {}
        self.reload_lock = asyncio.Lock()
        self.poller: asyncio.Task | None = None
        self.db: Any = None  # the registry's SQLAlchemy engine
        self.admission = Admission(config.max_queue)
        self.busy: str | None = None  # why no turn is admitted now even below the limit
        self.failed: dict[int, str] = {}  # generation id -> why switching to it failed (not retried by polls)
        self.engine_loaded: set[str] = set()  # external engine model names this server loaded
        # fitting a conversation to the window renders the chat template (the whole conversation, its tools)
        # and counts tokens, several times: CPU work that scales with what the client sent, done here off the
        # event loop and off the default executor the decoding steps run on, so a heavy request holds nobody
        self.preparing = ThreadPoolExecutor(max_workers=PREPARING_THREADS, thread_name_prefix="prepare")

    # ------------------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        cfg = self.config

        self.db = await asyncio.to_thread(get_engine, cfg.registry_url or _default_url())
        self.recorder = await asyncio.to_thread(
            ExperienceRecorder,
            self.db,
            spool_dir=spool_dir(cfg) if cfg.spool else None,
            max_bytes=cfg.spool_max_bytes,
            flush_seconds=cfg.flush_seconds,
        )
        plan = await asyncio.to_thread(plan_generation, self.db, cfg.lineage, cfg.generation)
        self.current = await asyncio.to_thread(load_served, plan, cfg, self.scheduler)
        if cfg.engine == "external":
            try:  # the engine may come up later: serve anyway, as before
                self.engine_loaded |= await sync_engine_adapters(self.current, previous=None)
            except RatchetError as exc:
                log.warning("%s", exc)
        if cfg.follows_champion() and cfg.poll_seconds > 0:
            self.poller = asyncio.get_running_loop().create_task(self._poll(), name="champion-poller")

    def admit(self) -> Slot:
        """Admit one chat turn, or refuse it at once (``limits.Admission``; 503 while the spool is full)."""
        stats = self.scheduler.stats
        per_turn = stats.busy_seconds / stats.rows if stats.rows else 1.0
        if self.recorder is not None and self.recorder.full():
            self.admission.refused += 1
            raise ApiError(
                503,
                f"the registry is not taking served turns and {self.config.spool_max_bytes} bytes wait in "
                "the spool (--spool-max-bytes); retry later",
                type="server_error",
                code="service_unavailable",
                headers={"Retry-After": "5"},
            )
        return self.admission.admit(busy=self.busy, seconds_per_turn=per_turn)

    async def stop(self) -> None:
        self.busy = "stopping"
        if self.poller is not None:
            self.poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.poller
        deadline = time.monotonic() + 60  # turns in flight and their summaries (which spawn records)
        while self.pending and time.monotonic() < deadline:
            await asyncio.wait(list(self.pending.values()), timeout=max(0.0, deadline - time.monotonic()))
        await self.scheduler.close()
        if self.recorder is not None:
            await asyncio.to_thread(self.recorder.close)
        if self.current is not None:
            await self.current.engine.aclose()
        self.preparing.shutdown(wait=False, cancel_futures=True)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.config.poll_seconds)
            try:
                await self.reload(retry=False)
            except Exception:
                log.exception(
                    "checking for a new champion failed; still serving generation %s",
                    self.current.number if self.current else None,
                )

    async def reload(self, *, retry: bool = True) -> dict[str, Any]:
        """Switch to the lineage's champion if it changed (no-op when serving a pinned generation). A
        champion that fails to load is logged once and the old one kept; polls do not retry it
        (``retry``: ``POST /admin/reload`` does)."""
        cfg = self.config
        async with self.reload_lock:
            assert self.current is not None
            before = self.current.number
            error = None
            if cfg.follows_champion():
                gen_id = await asyncio.to_thread(champion_id, self.db, cfg.lineage)
                if gen_id is not None and gen_id != self.current.generation_id:
                    if retry or gen_id not in self.failed:
                        error = await self._switch()
                    else:
                        error = self.failed[gen_id]
            return {
                "generation": self.current.number,
                "previous": before,
                "switched": self.current.number != before,
                **({"error": error} if error else {}),
            }

    async def _switch(self) -> str | None:
        """Load the champion and swap it in; on a failure keep the old one and return why."""
        cfg, old = self.config, self.current
        assert old is not None
        plan = await asyncio.to_thread(plan_generation, self.db, cfg.lineage, "champion")
        self.busy = "loading a new generation"
        try:
            new = await asyncio.to_thread(load_served, plan, cfg, self.scheduler)
            if cfg.engine == "external":
                try:
                    self.engine_loaded |= await sync_engine_adapters(new, previous=old)
                except BaseException:
                    await new.engine.aclose()
                    raise
        except RatchetError as exc:
            why = str(exc)
            self.failed[plan.generation_id] = why
            log.error("not switching to generation %d: %s; still serving %d", plan.number, why, old.number)
            return why
        finally:
            self.busy = None
        self.current = new
        self.failed.pop(plan.generation_id, None)
        log.info("switched from generation %d to %d", old.number, new.number)
        asyncio.get_running_loop().call_later(60, lambda: asyncio.ensure_future(self._retire(old, new)))
        return None

    async def _retire(self, old: Served, new: Served) -> None:
        """After the old generation's turns had time to finish: unload what this server loaded for it on
        an external engine, and close its engine."""
        for name in sorted((set(old.engine_adapters) - set(new.engine_adapters)) & self.engine_loaded):
            try:
                await old.engine.unload_adapter(name)  # type: ignore[attr-defined]
                self.engine_loaded.discard(name)
            except Exception as exc:
                log.warning("could not unload %s from the external engine: %s", name, exc)
        await old.engine.aclose()

    # ------------------------------------------------------------------------------------------ chat
    async def learned_scores(
        self, served: Served, text: str, messages: list[dict]
    ) -> dict[str, float] | None:
        policy = served.harness.routing
        if policy.mode == "signals":
            return None
        labels = policy.learned.labels or served.specialists
        if served.classifier is not None:
            return served.classifier.scores(text)
        try:
            return await served.engine.label_scores([{"role": "user", "content": text}], labels, policy.entry)
        except RatchetError:
            return None

    async def prepare(
        self, req: ChatRequest, *, started: float, slot: Slot | None = None, cid: str | None = None
    ) -> ChatTurn:
        """Route the request and build the specialist's view of the conversation and its decoding constraints
        (``pipeline.serving.constraints``); a view the model's chat template refuses, or a grammar the library
        cannot compile, is the client's 400 (one line), never a 500. ``cid``: the turn's id (default a new
        ``chatcmpl-...``)."""

        def _refused(exc: TemplateError) -> str:
            said = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            return f"the model's chat template refuses this conversation: {said}"

        served = self.current
        assert served is not None
        messages = req.plain_messages()
        tool_names = req.tool_names()
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if tool_names else None
        turn = turn_from_messages(
            messages, issuer_of=self.memory.issuers(messages), tools_offered=bool(tool_names)
        )
        try:
            learned = None if turn.tool_result_for else await self.learned_scores(served, turn.text, messages)
        except TemplateError as exc:  # the model's chat template refuses the router's prompt
            raise ApiError(400, _refused(exc), param="messages") from None
        decision = route_turn(turn, served.harness.routing, learned=learned, specialists=served.specialists)
        sp = served.harness.specialists.get(decision.specialist)
        dec = sp.decoding if sp is not None else DecodingParams()
        max_tokens = req.limit() or dec.max_new_tokens
        limit = served.engine.context_limit
        if limit and max_tokens >= limit:
            raise ApiError(
                400,
                f"max_tokens {max_tokens} does not fit the model's context window of {limit} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        fit = functools.partial(
            build_view,
            messages,
            decision.specialist,
            harness=served.harness,
            memory=self.memory,
            count_tokens=lambda msgs: served.engine.count_tokens(msgs, tools),
            max_new_tokens=max_tokens,
            context_limit=limit,
        )
        try:
            view = await asyncio.get_running_loop().run_in_executor(self.preparing, fit)
        except ContextOverflowError as exc:
            raise ApiError(400, str(exc), param="messages", code="context_length_exceeded") from None
        except TemplateError as exc:  # e.g. a system prompt, a tool result or two calls the template refuses
            raise ApiError(400, _refused(exc), param="messages") from None
        external = self.config.engine == "external"
        fmt = served.harness.tool_call_format
        grammar = None if external else await checked_grammar(req, served.engine, fmt=fmt)
        ereq = EngineRequest(
            specialist=decision.specialist,
            messages=view,
            max_tokens=max_tokens,
            temperature=req.temperature if req.temperature is not None else dec.temperature,
            top_p=req.top_p if req.top_p is not None else dec.top_p,
            stop=tuple(dict.fromkeys(req.stops() + tuple(dec.stop))),
            seed=req.seed,
            tools=tools,
            abort=Abort(),
            grammar=grammar,
            logprobs=logprobs_wanted(req),
            passthrough=req.passthrough() if external else {},
        )
        cid = cid or new_completion_id()
        return ChatTurn(req, served, decision, ereq, messages, cid, int(time.time()), started, slot)

    def choices(self, turn: ChatTurn, slots: list[Slot]) -> list[ChatTurn]:
        """The request's ``n`` choices: ``turn`` and one more row per extra slot, sharing its view and its
        abort (one client), each its own served turn: completion id ``<id>-<i>``, seed ``seed + i``."""
        ereq = turn.ereq
        return [turn] + [
            replace(
                turn,
                ereq=replace(ereq, seed=None if ereq.seed is None else ereq.seed + i),
                cid=f"{turn.cid}-{i}",
                slot=slot,
                choice=i,
            )
            for i, slot in enumerate(slots, start=1)
        ]

    def answer_message(self, turn: ChatTurn, result: EngineResult) -> tuple[dict, str]:
        """The reply: the engine's native tool calls, or the model's text read by the parser the loop uses
        (``toolcalls.assistant_message``); ``parallel_tool_calls: false`` keeps the first call only."""
        names = turn.req.tool_names()
        if names and result.tool_calls:
            message = {"role": "assistant", "content": None, "tool_calls": result.tool_calls}
        else:
            message = assistant_message(
                result.text, names, turn.served.harness.tool_call_format, seed_text=turn.cid
            )
        if turn.req.parallel_tool_calls is False and len(message.get("tool_calls") or []) > 1:
            message = {**message, "tool_calls": message["tool_calls"][:1]}
        return message, "tool_calls" if message.get("tool_calls") else result.finish_reason

    async def complete_turn(
        self, turn: ChatTurn, on_delta: Callable[[str], None] | None = None
    ) -> tuple[dict, str, EngineResult]:
        """Decode (text deltas to ``on_delta``), build the reply and record the turn (run as its own task:
        a client that disconnects does not cancel it); stopped at the request timeout."""
        timeout = self.config.request_timeout_s
        timer = None
        if timeout > 0:
            left = max(0.0, timeout - (time.perf_counter() - turn.started))
            timer = asyncio.get_running_loop().call_later(left, turn.abort.set, "timeout")
        try:
            result = None
            async for item in turn.served.engine.stream(turn.ereq):
                if isinstance(item, EngineResult):
                    result = item
                elif on_delta is not None:
                    on_delta(item)
            assert result is not None
        finally:
            if timer is not None:
                timer.cancel()
            if turn.slot is not None:
                turn.slot.release()
        message, finish = self.answer_message(turn, result)
        await self.finish_turn(turn, message, result)  # durable before the client gets it
        return message, finish, result

    def produce(self, turn: ChatTurn, queue: Any) -> asyncio.Task:
        """Decode and record ``turn`` in its own tracked task (a client that leaves mid-stream still leaves its
        turn in the experience); text deltas, then the reply ``(message, finish, result)`` or the exception, go
        to ``queue.put_nowait``."""

        async def produce() -> None:
            try:
                queue.put_nowait(await self.complete_turn(turn, queue.put_nowait))
            except Exception as exc:
                log.exception("stream %s failed", turn.cid)
                queue.put_nowait(exc)

        task = asyncio.get_running_loop().create_task(produce())
        self.track(cid_key(turn.cid, "stream"), task)
        return task

    async def answer(self, turn: ChatTurn, request: Any) -> tuple[dict, str, EngineResult]:
        """A non-streamed turn's ``(message, finish, result)`` (``answer_all`` of one)."""
        return (await self.answer_all([turn], request))[0]

    async def answer_all(self, turns: list[ChatTurn], request: Any) -> list[tuple[dict, str, EngineResult]]:
        """Decode and record ``turns`` (one request's choices, sharing an abort) in tracked tasks while watching
        ``request`` for a disconnect; 504 (``timeout_error``) when they are not done at the request timeout."""
        watcher = asyncio.get_running_loop().create_task(watch_disconnect(request, turns[0].abort))
        tasks = []
        for turn in turns:
            tasks.append(asyncio.get_running_loop().create_task(self.complete_turn(turn)))
            self.track(cid_key(turn.cid, "turn"), tasks[-1])
        try:
            await asyncio.wait(tasks, timeout=self.time_left(turns[0]))
        finally:
            watcher.cancel()
        if not all(task.done() for task in tasks):
            raise self.timeout_error()
        replies = [task.result() for task in tasks]
        if any(result.finish_reason == "timeout" for _m, _f, result in replies):
            raise self.timeout_error()
        if any(result.finish_reason == "error" for _m, _f, result in replies):
            raise self.decoding_error()
        return replies

    def time_left(self, turn: ChatTurn) -> float | None:
        """Seconds the client still waits for ``turn`` (None: no timeout). Past the timeout it gets 504
        even while the engine is still busy; the stopped turn is recorded when the engine lets go of it."""
        timeout = self.config.request_timeout_s
        if timeout <= 0:
            return None
        return max(0.0, timeout - (time.perf_counter() - turn.started)) + 0.25  # one step to stop cleanly

    def decoding_error(self) -> ApiError:
        """A row whose grammar could not go on (``finish_reason`` ``error``): the server's fault, recorded as a
        stopped turn."""
        return ApiError(
            500, "constrained decoding failed; the turn was recorded as stopped", type="server_error"
        )

    def timeout_error(self) -> ApiError:
        return ApiError(
            504,
            f"the request was still decoding after {self.config.request_timeout_s:g} s (--request-timeout-s) "
            "and was stopped",
            type="server_error",
            code="timeout",
        )

    def track(self, key: str, task: asyncio.Task) -> None:
        """Keep ``task`` until it is done; shutdown waits for every tracked task."""
        self.pending[key] = task
        task.add_done_callback(lambda _t: self.pending.pop(key, None))

    async def finish_turn(self, turn: ChatTurn, message: dict, result: EngineResult) -> None:
        """Record the turn with its extractive summary; returns once it is in the spool (the client is
        answered after that). A model-written summary (``other_specialists: summary``) follows later, as
        its own spooled record the writer applies to the stored row."""
        latency_ms = round((time.perf_counter() - turn.started) * 1000, 2)
        summary = extract_summary(message)
        stopped = result.finish_reason in STOPPED
        if not stopped:  # a stopped reply never reached the client
            self.memory.remember(message, TurnRecord(turn.decision.specialist, summary))
        row = self.trace_row(turn, message, result, latency_ms, summary)
        assert self.recorder is not None
        try:
            await self.recorder.record(row)
        except OSError as exc:  # not durable: the client must not believe it was answered
            log.error("turn %s could not be spooled: %s", turn.cid, exc)
            raise ApiError(
                503,
                "the server could not store this turn; retry shortly",
                type="server_error",
                code="service_unavailable",
                headers={"Retry-After": "5"},
            ) from None
        if (
            turn.served.harness.context.other_specialists == "summary"
            and not message.get("tool_calls")
            and not stopped
        ):
            task = asyncio.get_running_loop().create_task(self._summarize_later(turn, message, summary))
            self.track(turn.cid, task)

    async def _summarize_later(self, turn: ChatTurn, message: dict, extractive: str) -> None:
        """The model-written summary of the reply: remembered for later views, and spooled as a follow-up
        of the turn's record."""
        try:
            summary = await self._summarize(turn.served, turn.ereq, message)
        except Exception:
            log.exception("summary of %s failed; keeping the extractive one", turn.cid)
            return
        if not summary or summary == extractive:
            return
        self.memory.remember(message, TurnRecord(turn.decision.specialist, summary))
        assert self.recorder is not None
        try:
            await self.recorder.record_summary(
                completion_id=turn.cid, index=len(turn.messages), summary=summary
            )
        except OSError as exc:
            log.error(
                "the summary of %s could not be spooled (its turn keeps the extractive one): %s",
                turn.cid,
                exc,
            )

    def trace_row(
        self, turn: ChatTurn, message: dict, result: EngineResult, latency_ms: float, summary: str
    ) -> TraceRow:
        """The turn's experience row (``traces.trace_row``)."""
        return trace_row(
            turn,
            message,
            result,
            latency_ms=latency_ms,
            summary=summary,
            memory=self.memory,
            config=self.config,
        )

    async def _summarize(self, served: Served, ereq: EngineRequest, message: dict) -> str:
        budget = (served.engine.context_limit or 10**9) - self.config.summary_tokens

        def fit() -> list[dict] | None:  # renders and counts the conversation: off the event loop
            prompt = summary_messages(ereq.messages, message)
            while served.engine.count_tokens(prompt) > budget and len(prompt) > 3:
                prompt = prompt[:1] + prompt[2:] if prompt[0]["role"] == "system" else prompt[1:]
            return None if served.engine.count_tokens(prompt) > budget else prompt

        prompt = await asyncio.get_running_loop().run_in_executor(self.preparing, fit)
        if prompt is None:
            return ""
        r = await complete(served.engine, EngineRequest(ereq.specialist, prompt, self.config.summary_tokens))
        return " ".join(r.text.split())


def cid_key(cid: str, what: str) -> str:
    return f"{cid}:{what}"


def spool_dir(config: ServeConfig) -> Path:
    """``config.spool_dir``, or ``<home>/spool/<first 16 hex of sha256(registry URL)>``: one spool per
    registry, so a home shared by two registries never replays one's turns into the other."""
    if config.spool_dir:
        return Path(config.spool_dir)

    settings = get_settings()
    url = config.registry_url or _default_url()
    # on the home's own registry the home must exist (`ratchet init`); on another registry the home only holds
    # this machine's files, as with RATCHET_DATABASE_URL, and is made
    home = settings.ensure_home() if url == settings.registry_url else settings.create_home()
    return home / "spool" / hashlib.sha256(url.encode()).hexdigest()[:16]


def _default_url() -> str:

    settings = get_settings()
    settings.ensure_home()
    return settings.registry_url
