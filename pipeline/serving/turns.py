"""The running server's state: the generation served now, and route -> answer -> summary -> record.

``ServerState`` holds the served generation (swapped atomically when a new champion is promoted; requests
in flight keep the one they started with), the micro-batching scheduler, the server-side ``TurnMemory``
(who served which assistant message, and its summary) and the experience recorder.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from pipeline.errors import RatchetError
from pipeline.harness import DecodingParams
from pipeline.serving.engines import EngineRequest, EngineResult, complete
from pipeline.serving.protocol import ApiError, ChatRequest, new_completion_id
from pipeline.serving.recorder import ExperienceRecorder, served_trace_row
from pipeline.serving.router import RouteDecision, route_turn, turn_from_messages
from pipeline.serving.scheduler import MicroBatchScheduler
from pipeline.serving.served import ServeConfig, Served, champion_id, load_served, plan_generation
from pipeline.serving.views import (
    ContextOverflowError,
    TurnMemory,
    TurnRecord,
    build_view,
    extract_summary,
    summary_messages,
)
from pipeline.toolcalls import assistant_message

log = logging.getLogger(__name__)


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
    started: float  # perf_counter at arrival, for the recorded latency


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

    # ------------------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        cfg = self.config
        from pipeline.registry import get_engine

        self.db = await asyncio.to_thread(get_engine, cfg.registry_url or _default_url())
        self.recorder = ExperienceRecorder(self.db, flush_seconds=cfg.flush_seconds)
        plan = await asyncio.to_thread(plan_generation, self.db, cfg.lineage, cfg.generation)
        self.current = await asyncio.to_thread(load_served, plan, cfg, self.scheduler)
        if cfg.follows_champion() and cfg.poll_seconds > 0:
            self.poller = asyncio.get_running_loop().create_task(self._poll(), name="champion-poller")

    async def stop(self) -> None:
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

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.config.poll_seconds)
            try:
                await self.reload()
            except Exception:
                log.exception(
                    "checking for a new champion failed; still serving generation %s",
                    self.current.number if self.current else None,
                )

    async def reload(self) -> dict[str, Any]:
        """Switch to the lineage's champion if it changed (no-op when serving a pinned generation)."""
        cfg = self.config
        async with self.reload_lock:
            assert self.current is not None
            before = self.current.number
            if cfg.follows_champion():
                gen_id = await asyncio.to_thread(champion_id, self.db, cfg.lineage)
                if gen_id is not None and gen_id != self.current.generation_id:
                    plan = await asyncio.to_thread(plan_generation, self.db, cfg.lineage, "champion")
                    new = await asyncio.to_thread(load_served, plan, cfg, self.scheduler)
                    old, self.current = self.current, new
                    log.info("switched from generation %d to %d", old.number, new.number)
                    asyncio.get_running_loop().call_later(
                        60, lambda: asyncio.ensure_future(old.engine.aclose())
                    )
            return {
                "generation": self.current.number,
                "previous": before,
                "switched": self.current.number != before,
            }

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

    async def prepare(self, req: ChatRequest, *, started: float) -> ChatTurn:
        """Route the request and build the specialist's view of the conversation."""
        served = self.current
        assert served is not None
        messages = req.plain_messages()
        tool_names = req.tool_names()
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if tool_names else None
        turn = turn_from_messages(
            messages, issuer_of=self.memory.issuers(messages), tools_offered=bool(tool_names)
        )
        learned = None if turn.tool_result_for else await self.learned_scores(served, turn.text, messages)
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
        try:
            view = build_view(
                messages,
                decision.specialist,
                harness=served.harness,
                memory=self.memory,
                count_tokens=lambda msgs: served.engine.count_tokens(msgs, tools),
                max_new_tokens=max_tokens,
                context_limit=limit,
            )
        except ContextOverflowError as exc:
            raise ApiError(400, str(exc), param="messages", code="context_length_exceeded") from None
        ereq = EngineRequest(
            specialist=decision.specialist,
            messages=view,
            max_tokens=max_tokens,
            temperature=req.temperature if req.temperature is not None else dec.temperature,
            top_p=req.top_p if req.top_p is not None else dec.top_p,
            stop=tuple(dict.fromkeys(req.stops() + tuple(dec.stop))),
            seed=req.seed,
            tools=tools,
        )
        return ChatTurn(req, served, decision, ereq, messages, new_completion_id(), int(time.time()), started)

    def answer_message(self, turn: ChatTurn, result: EngineResult) -> tuple[dict, str]:
        """The reply: the engine's native tool calls, or the model's text read by the parser the loop uses
        (``toolcalls.assistant_message``)."""
        names = turn.req.tool_names()
        if names and result.tool_calls:
            return {"role": "assistant", "content": None, "tool_calls": result.tool_calls}, "tool_calls"
        message = assistant_message(
            result.text, names, turn.served.harness.tool_call_format, seed_text=turn.cid
        )
        return message, "tool_calls" if message.get("tool_calls") else result.finish_reason

    async def complete_turn(self, turn: ChatTurn) -> tuple[dict, str, EngineResult]:
        """Decode, build the reply and record the turn (run as its own task: a client that disconnects
        does not cancel it)."""
        result = await complete(turn.served.engine, turn.ereq)
        message, finish = self.answer_message(turn, result)
        self.finish_turn(turn, message, result)
        return message, finish, result

    def track(self, key: str, task: asyncio.Task) -> None:
        """Keep ``task`` until it is done; shutdown waits for every tracked task."""
        self.pending[key] = task
        task.add_done_callback(lambda _t: self.pending.pop(key, None))

    def finish_turn(self, turn: ChatTurn, message: dict, result: EngineResult) -> None:
        latency_ms = round((time.perf_counter() - turn.started) * 1000, 2)
        self.memory.remember(message, TurnRecord(turn.decision.specialist, extract_summary(message)))
        task = asyncio.get_running_loop().create_task(
            self._summarize_and_record(turn, message, result, latency_ms)
        )
        self.track(turn.cid, task)

    async def _summarize_and_record(
        self, turn: ChatTurn, message: dict, result: EngineResult, latency_ms: float
    ) -> None:
        served, decision, messages, cid = turn.served, turn.decision, turn.messages, turn.cid
        summary = extract_summary(message)
        if served.harness.context.other_specialists == "summary" and not message.get("tool_calls"):
            try:
                summary = await self._summarize(served, turn.ereq, message) or summary
            except Exception:
                log.exception("summary of %s failed; keeping the extractive one", cid)
        self.memory.remember(message, TurnRecord(decision.specialist, summary))
        routes, summaries = [], {}
        for i, m in enumerate(messages):
            rec = self.memory.lookup(m) if m.get("role") == "assistant" else None
            if rec is not None:
                routes.append(
                    {"turn": i, "specialist": rec.specialist, "reason": "earlier turn", "scores": {}}
                )
                summaries[str(i)] = rec.summary
        routes.append(decision.as_route(len(messages)))
        summaries[str(len(messages))] = summary
        metadata = {
            # what the client said it knows about the turn (e.g. the expected answer, tests, a schema): the
            # contract's scorers read it; the server's own fields below always win
            **(turn.req.metadata or {}),
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
            "engine": self.config.engine,
            "summaries": summaries,
        }
        row = served_trace_row(
            messages=[*messages, message],
            metadata=metadata,
            routes=routes,
            specialist=decision.specialist,
            completion_id=cid,
            generation_id=served.generation_id,
            harness_version_id=served.harness_version_id,
        )
        assert self.recorder is not None
        self.recorder.record(row)

    async def _summarize(self, served: Served, ereq: EngineRequest, message: dict) -> str:
        budget = (served.engine.context_limit or 10**9) - self.config.summary_tokens
        prompt = summary_messages(ereq.messages, message)
        while served.engine.count_tokens(prompt) > budget and len(prompt) > 3:
            prompt = prompt[:1] + prompt[2:] if prompt[0]["role"] == "system" else prompt[1:]
        if served.engine.count_tokens(prompt) > budget:
            return ""
        r = await complete(served.engine, EngineRequest(ereq.specialist, prompt, self.config.summary_tokens))
        return " ".join(r.text.split())


def _default_url() -> str:
    from pipeline.settings import get_settings

    settings = get_settings()
    settings.ensure_home()
    return settings.registry_url
