"""Served turns as experience: trace rows built on the request path, written in batches off it.

``ExperienceRecorder`` owns a writer thread that inserts queued ``TraceRow``s every ``flush_seconds`` (or
``batch_size`` rows); ``flush()`` waits until everything queued so far is stored and ``close()`` flushes
and stops, so a graceful shutdown loses nothing that was served.

A served trace is ``{"messages": request messages + the assistant reply, "metadata": {...}, "feedback":
null}`` with ``content_hash = sha256(canonical trace JSON + completion id)`` (the same conversation served
twice is two events). Metadata: ``specialist``, ``generation``, ``latency_ms``, ``prompt_tokens``,
``completion_tokens``, ``route_reason``, ``route_method``, ``route_scores``, ``finish_reason``, ``model``,
``engine``, and ``summaries`` (``{assistant message index: summary}``, server-side only); the client's own
metadata beside them when its principal may certify, else under ``claimed``. The row names its principal.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
import time
from typing import Any

from pipeline.registry import TraceRow, insert_traces, session_scope

log = logging.getLogger(__name__)


def canonical(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def served_trace_row(
    *,
    messages: list[dict[str, Any]],
    metadata: dict[str, Any],
    routes: list[dict[str, Any]],
    specialist: str,
    completion_id: str,
    generation_id: int | None,
    harness_version_id: int | None,
    principal: str,
) -> TraceRow:
    trace = {"messages": messages, "metadata": metadata, "feedback": None}
    digest = hashlib.sha256((canonical(trace) + completion_id).encode()).hexdigest()
    return TraceRow(
        content_hash=digest,
        messages=canonical(messages),
        metadata=canonical(metadata),
        feedback=None,
        routes=canonical(routes),
        specialist=specialist,
        source="deployment",
        generation_id=generation_id,
        harness_version_id=harness_version_id,
        completion_id=completion_id,
        principal=principal,
    )


class ExperienceRecorder:
    """Batched, off-request-path writer of served traces to the registry."""

    def __init__(self, db: Any, *, flush_seconds: float = 0.5, batch_size: int = 256):
        self.db = db  # a SQLAlchemy engine
        self.flush_seconds = flush_seconds
        self.batch_size = batch_size
        self.written = 0
        self._queue: queue.Queue[TraceRow | threading.Event | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="experience-writer", daemon=True)
        self._thread.start()

    def record(self, row: TraceRow) -> None:
        self._queue.put(row)

    def flush(self, timeout: float = 30.0) -> bool:
        """Block until every row queued before this call is stored."""
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)

    def _write(self, rows: list[TraceRow]) -> None:
        if not rows:
            return
        for attempt in range(3):
            try:
                with session_scope(self.db) as session:
                    self.written += insert_traces(session=session, rows=rows)
                return
            except Exception:  # the registry is down or locked: retry, then log (never crash serving)
                log.exception("writing %d served traces failed (attempt %d)", len(rows), attempt + 1)
                time.sleep(0.2 * (attempt + 1))

    def _run(self) -> None:
        pending: list[TraceRow] = []
        waiters: list[threading.Event] = []
        deadline = time.monotonic() + self.flush_seconds
        stop = False
        while not stop:
            try:
                item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                item = ...
            if item is None:
                stop = True
            elif isinstance(item, threading.Event):
                waiters.append(item)
            elif isinstance(item, TraceRow):
                pending.append(item)
            if stop or waiters or len(pending) >= self.batch_size or time.monotonic() >= deadline:
                self._write(pending)
                pending = []
                for w in waiters:
                    w.set()
                waiters = []
                deadline = time.monotonic() + self.flush_seconds
