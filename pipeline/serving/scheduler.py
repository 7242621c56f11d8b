"""Async micro-batching: requests arriving within ``max_wait_ms`` of each other (up to ``max_batch_size``)
share one mixed-adapter batch, decoded in a worker thread so the event loop keeps serving.

``submit(runtime, request)`` returns a ``Ticket``: iterate it for text deltas (streaming) or await
``ticket.result``. A batch only mixes requests for the same runtime, so a generation switch never mixes
old and new adapters; requests already queued for the old runtime still run on it. A batch uses at most
as many distinct adapters as the runtime may hold attached (``max_adapters_per_batch``); requests for
others wait for the next batch, in arrival order.

``ticket.abort(reason)`` stops a request: one still waiting is answered at once without being decoded,
one in a batch leaves it at the next decoding step (``GenerationRequest.abort``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pipeline.serving.runtime import Abort, GenerationRequest, GenerationResult

log = logging.getLogger(__name__)


@dataclass
class Ticket:
    """A submitted request: its text deltas as they come, then its result."""

    runtime: Any
    request: GenerationRequest
    result: asyncio.Future
    deltas: asyncio.Queue = field(default_factory=asyncio.Queue)
    started: bool = False  # taken into a batch

    def abort(self, reason: str) -> None:
        """Stop this request (call from the event loop); its result says ``reason``."""
        if self.request.abort is not None:
            self.request.abort.set(reason)
        if not self.started and not self.result.done():
            self.deltas.put_nowait(None)
            self.result.set_result(GenerationResult("", len(self.request.prompt_ids), 0, reason))

    async def stream(self) -> AsyncIterator[str]:
        while True:
            delta = await self.deltas.get()
            if delta is None:
                return
            yield delta


@dataclass
class SchedulerStats:
    batches: int = 0
    rows: int = 0
    max_rows: int = 0
    busy_seconds: float = 0.0


class MicroBatchScheduler:
    """Collects requests into batches (``max_batch_size`` rows, ``max_wait_ms`` wait) for a runtime."""

    def __init__(self, *, max_batch_size: int = 32, max_wait_ms: float = 5.0):
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        self.max_batch_size = max_batch_size
        self.max_wait = max_wait_ms / 1000.0
        self.stats = SchedulerStats()
        self._queue: asyncio.Queue[Ticket] | None = None
        self._held: list[Ticket] = []
        self._worker: asyncio.Task | None = None

    def _ensure_started(self) -> asyncio.Queue:
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._worker = asyncio.get_running_loop().create_task(self._run(), name="micro-batcher")
        return self._queue

    def submit(self, runtime: Any, request: GenerationRequest) -> Ticket:
        """Queue ``request`` for ``runtime`` (a ``MixtureRuntime``)."""
        queue = self._ensure_started()
        if request.abort is None:
            request = dataclasses.replace(request, abort=Abort())
        ticket = Ticket(runtime, request, asyncio.get_running_loop().create_future())
        queue.put_nowait(ticket)
        return ticket

    async def _collect(self) -> list[Ticket]:
        assert self._queue is not None
        first = self._held.pop(0) if self._held else await self._queue.get()
        while first.result.done():  # aborted while it waited
            first = self._held.pop(0) if self._held else await self._queue.get()
        batch = [first]
        cap = getattr(first.runtime, "max_adapters_per_batch", None)
        adapters = {_adapter(first)} - {None}

        def fits(t: Ticket) -> bool:
            if t.runtime is not first.runtime or len(batch) >= self.max_batch_size:
                return False
            name = _adapter(t)
            return cap is None or name is None or name in adapters or len(adapters) < cap

        def take(t: Ticket) -> None:
            if t.result.done():
                return
            if fits(t):
                batch.append(t)
                adapters.add(_adapter(t))
                adapters.discard(None)
            else:
                self._held.append(t)

        rest, self._held = self._held, []
        for t in rest:
            take(t)
        deadline = time.monotonic() + self.max_wait
        while len(batch) < self.max_batch_size:
            remaining = deadline - time.monotonic()
            try:
                t = (
                    self._queue.get_nowait()
                    if remaining <= 0
                    else await asyncio.wait_for(self._queue.get(), remaining)
                )
            except (TimeoutError, asyncio.QueueEmpty):
                break
            take(t)
        for t in batch:
            t.started = True
        return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._collect()

            def on_text(row: int, delta: str, batch: list[Ticket] = batch) -> None:
                loop.call_soon_threadsafe(batch[row].deltas.put_nowait, delta)

            started = time.perf_counter()
            try:
                results: list[GenerationResult] = await asyncio.to_thread(
                    batch[0].runtime.generate, [t.request for t in batch], on_text
                )
            except Exception as exc:  # a bug or an OOM: fail this batch, keep serving
                log.exception("batch of %d failed", len(batch))
                for t in batch:
                    t.deltas.put_nowait(None)
                    if not t.result.done():
                        t.result.set_exception(exc)
                continue
            self.stats.batches += 1
            self.stats.rows += len(batch)
            self.stats.max_rows = max(self.stats.max_rows, len(batch))
            self.stats.busy_seconds += time.perf_counter() - started
            await asyncio.sleep(0)  # let the queued deltas be delivered first
            for t, r in zip(batch, results, strict=True):
                t.deltas.put_nowait(None)
                if not t.result.done():
                    t.result.set_result(r)

    async def close(self) -> None:
        """Stop the worker (call after the requests in flight finished; any still queued are failed)."""
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        left = list(self._held)
        while self._queue is not None and not self._queue.empty():
            left.append(self._queue.get_nowait())
        for t in left:
            t.deltas.put_nowait(None)
            if not t.result.done():
                t.result.set_exception(RuntimeError("the server is shutting down"))
        self._worker, self._queue, self._held = None, None, []


def _adapter(ticket: Ticket) -> str | None:
    """The adapter a ticket's row needs attached (None: the base model, which needs none)."""
    runtime = ticket.runtime
    name = runtime.adapter_name(ticket.request.adapter) if hasattr(runtime, "adapter_name") else None
    return None if name is None or name == "__base__" else name
