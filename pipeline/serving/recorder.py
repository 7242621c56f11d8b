"""Served turns as experience: trace rows built on the request path, stored durably before the answer.

``ExperienceRecorder`` puts every served turn, every later model-written summary and every feedback in the
write-ahead spool (``pipeline.serving.spool``) and returns once it is fsynced: ``await record(row)`` before
the response is sent means what a client was answered survives a crash, a registry outage or a lock. A
writer thread moves durable records into the registry in batches (every ``flush_seconds`` or ``batch_size``
records), in order, idempotently (a replayed turn already stored is skipped), retrying forever with backoff
(``failures`` counts the writes failed in a row: the server says ``degraded`` meanwhile); a record the
registry refuses as data (not as an outage) is moved to ``rejected/`` beside the spool, kept and logged.
At start the files of dead processes are replayed first. ``flush()`` waits until everything accepted so
far is stored; ``close()`` drains and stops (what the registry did not take stays in the spool for the
next start). ``full()``: the unstored records reached ``max_bytes`` (new turns are refused, 503).
Without ``spool_dir`` records wait in memory only (a crash loses them): the benchmark's comparison.

A served trace is ``{"messages": request messages + the assistant reply, "metadata": {...}, "feedback":
null}`` with ``content_hash = sha256(canonical trace JSON + completion id)`` (the same conversation served
twice is two events). Metadata: ``specialist``, ``generation``, ``latency_ms``, ``prompt_tokens``,
``completion_tokens``, ``route_reason``, ``route_method``, ``route_scores``, ``finish_reason``, ``model``,
``engine``, and ``summaries`` (``{assistant message index: summary}``, server-side only: the extractive
summary when spooled, replaced by the model-written one when it arrives); the client's own metadata beside
them when its principal may certify, else under ``claimed``. The row names its principal, and keeps beside
the trace the client's ``tools``, the conversation it belongs to (``conversation_id``) and the token ids the
server decoded (``served_tokens``, ``ServedTokens`` by assistant message index).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from sqlalchemy.exc import DataError, IntegrityError

from pipeline.errors import NotFoundError
from pipeline.experience.toolcalls import normalize_tool_calls
from pipeline.registry import TraceRow, attach_feedback, insert_traces, session_scope
from pipeline.registry.documents import ServedTokens
from pipeline.registry.experience import set_served_summary
from pipeline.serving.spool import Entry, Spool, encode

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
    tools: list[dict[str, Any]] | None = None,
    conversation_id: str | None = None,
    served_tokens: dict[str, ServedTokens] | None = None,
) -> TraceRow:
    """The row of one served turn; ``tools`` (the client's, OpenAI chat shape), ``conversation_id`` and
    ``served_tokens`` (by assistant message index) are stored beside the trace, outside its content hash."""
    messages = normalize_tool_calls(messages)  # a client's object arguments stored as JSON text, as ours
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
        tools=canonical(tools) if tools is not None else None,
        conversation_id=conversation_id,
        served_tokens=(
            canonical({k: v.model_dump() for k, v in served_tokens.items()}) if served_tokens else None
        ),
    )


class ExperienceRecorder:
    """Durable (spooled) served turns, summaries and feedback, moved into the registry by a writer thread."""

    def __init__(
        self,
        db: Any,
        *,
        spool_dir: Path | None = None,
        max_bytes: int = 64 << 20,
        flush_seconds: float = 0.5,
        batch_size: int = 256,
    ):
        self.db = db  # a SQLAlchemy engine
        self.flush_seconds = flush_seconds
        self.batch_size = batch_size
        self.max_bytes = max_bytes
        self.written = 0  # turns inserted by this recorder
        self.failures = 0  # registry writes failed in a row (0: the last one worked)
        self.last_error: str | None = None
        self.rejected = 0  # records the registry refused as data, kept under rejected/
        self._cond = threading.Condition()
        self._ready: deque[Entry] = deque()  # durable, waiting for the writer
        self._unfinished: dict[int, Entry] = {}  # accepted, not stored yet (oldest first)
        self._ids: dict[int, int] = {}  # id(entry) -> its sequence number
        self._seq = 0
        self._turns = self._bytes = 0
        self._cids: dict[str, int] = {}  # completion ids of turns not stored yet
        self._flushing = 0
        self._stop = self._abandon = False
        self.spool = Spool(spool_dir) if spool_dir is not None else None
        if self.spool is not None:
            replayed = self.spool.adopt()
            with self._cond:
                for entry in replayed:
                    self._accept(entry)
                self._ready.extend(replayed)
            self.spool.start(self._durable)
        self._thread = threading.Thread(target=self._run, name="experience-writer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------- accepting
    async def record(self, row: TraceRow) -> None:
        """Spool a served turn; returns once it is on disk (raises ``OSError`` if the disk refused it)."""
        await asyncio.wrap_future(self.append("turn", dataclasses.asdict(row)))

    async def record_summary(self, *, completion_id: str, index: int, summary: str) -> None:
        """Spool the model-written summary of a spooled turn's reply (message ``index``)."""
        data = {"completion_id": completion_id, "index": str(index), "summary": summary}
        await asyncio.wrap_future(self.append("summary", data))

    async def record_feedback(self, **fields: Any) -> None:
        """Spool feedback (``registry.attach_feedback``'s keyword arguments but the session)."""
        await asyncio.wrap_future(self.append("feedback", fields))

    def append(self, kind: str, data: dict[str, Any]) -> Future:
        """Accept one record; the future resolves once it is durable (at once without a spool)."""
        with self._cond:
            if self.spool is None:
                entry = Entry(kind, data, time.time(), 0, future=Future())
                entry.future.set_result(None)  # type: ignore[union-attr]
                self._accept(entry)
                self._ready.append(entry)
                self._cond.notify_all()
            else:
                entry = self.spool.append(kind, data)
                self._accept(entry)
        return entry.future  # type: ignore[return-value]

    def _accept(self, entry: Entry) -> None:
        self._seq += 1
        self._unfinished[self._seq] = entry
        self._ids[id(entry)] = self._seq
        self._bytes += entry.size
        if entry.kind == "turn":
            self._turns += 1
            cid = entry.data.get("completion_id") or ""
            self._cids[cid] = self._cids.get(cid, 0) + 1

    def _finish(self, entry: Entry) -> None:
        self._unfinished.pop(self._ids.pop(id(entry)), None)
        self._bytes -= entry.size
        if entry.kind == "turn":
            self._turns -= 1
            cid = entry.data.get("completion_id") or ""
            if self._cids.get(cid, 0) <= 1:
                self._cids.pop(cid, None)
            else:
                self._cids[cid] -= 1

    def _durable(self, entries: list[Entry], error: OSError | None) -> None:
        with self._cond:
            if error is None:
                self._ready.extend(entries)
            else:  # never on disk: the requests fail, nothing is to be stored
                for entry in entries:
                    self._finish(entry)
            self._cond.notify_all()

    # ------------------------------------------------------------------------------------------ state
    def holds(self, completion_id: str) -> bool:
        """Whether a turn with this completion id is accepted and not stored yet."""
        return completion_id in self._cids

    def full(self) -> bool:
        """The unstored records reached ``max_bytes`` (0: no limit; never without a spool)."""
        return self.spool is not None and self.max_bytes > 0 and self._bytes >= self.max_bytes

    def depth(self) -> dict[str, Any]:
        """What is accepted and not in the registry yet: turns, records, bytes, the oldest one's age."""
        with self._cond:
            oldest = next(iter(self._unfinished.values()), None)
            return {
                "turns": self._turns,
                "records": len(self._unfinished),
                "bytes": self._bytes,
                "oldest_s": round(time.time() - oldest.at, 3) if oldest is not None else 0.0,
            }

    def flush(self, timeout: float = 30.0) -> bool:
        """Block until every record accepted before this call is stored (False: ``timeout`` passed)."""
        with self._cond:
            target = self._seq
            self._flushing += 1
            self._cond.notify_all()
            try:
                return self._cond.wait_for(
                    lambda: not self._unfinished or next(iter(self._unfinished)) > target, timeout
                )
            finally:
                self._flushing -= 1

    async def stored(self, timeout: float = 30.0, poll_s: float = 0.02) -> bool:
        """``flush`` for the event loop: waits without holding a thread (the threads every turn's decoding
        runs on must not wait on a registry that takes no writes), False when ``timeout`` passed."""
        with self._cond:
            target = self._seq
            self._flushing += 1
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        try:
            while True:
                with self._cond:
                    if not self._unfinished or next(iter(self._unfinished)) > target:
                        return True
                if time.monotonic() >= deadline:
                    return False
                await asyncio.sleep(poll_s)
        finally:
            with self._cond:
                self._flushing -= 1

    def close(self, timeout: float = 30.0) -> None:
        """Store what is accepted (for up to ``timeout``) and stop; the rest stays in the spool."""
        if self.spool is not None:
            self.spool.stop()  # what is queued reaches the disk, and the writer
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self._cond:
                self._abandon = True
                self._cond.notify_all()
            self._thread.join(5)
            log.warning(
                "%d served records are not in the registry yet: they stay in the spool for the next start",
                len(self._unfinished),
            )
        if self.spool is not None:
            self.spool.close()

    # ----------------------------------------------------------------------------------------- writer
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._ready and not self._stop:
                    self._cond.wait()
                if self._abandon or (self._stop and not self._ready):
                    return
                deadline = time.monotonic() + self.flush_seconds
                while len(self._ready) < self.batch_size and not (self._stop or self._flushing):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                batch = [self._ready.popleft() for _ in range(min(self.batch_size, len(self._ready)))]
            if not self._store(batch):
                return

    def _store(self, batch: list[Entry]) -> bool:
        """Write ``batch`` until the registry takes it (False: abandoned at shutdown)."""
        delay = 0.1
        while True:
            try:
                self._write(batch)
                break
            except (IntegrityError, DataError, ValueError, TypeError, KeyError) as exc:  # the data itself
                if len(batch) > 1:
                    return all(self._store([entry]) for entry in batch)
                self._reject(batch[0], exc)
                break
            except Exception as exc:  # the registry is down or locked: retry until it takes them
                self.failures += 1
                self.last_error = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
                if self.failures == 1 or self.failures % 20 == 0:
                    log.warning(
                        "storing %d served records failed (%d in a row, retrying): %s",
                        len(batch),
                        self.failures,
                        self.last_error,
                    )
                with self._cond:
                    if self._cond.wait_for(lambda: self._abandon, delay):
                        return False
                delay = min(delay * 2, 2.0)
        if self.failures:
            log.info("the registry takes served records again after %d failed writes", self.failures)
        self.failures, self.last_error = 0, None
        if self.spool is not None:
            self.spool.committed(batch)
        with self._cond:
            for entry in batch:
                self._finish(entry)
            self._cond.notify_all()
        return True

    def _write(self, batch: list[Entry]) -> None:
        rows: dict[str, TraceRow] = {}
        later: list[Entry] = []
        for entry in batch:
            if entry.kind == "turn":
                row = TraceRow(**entry.data)
                rows[row.completion_id or row.content_hash] = row
            elif entry.kind == "summary" and entry.data["completion_id"] in rows:
                cid = entry.data["completion_id"]
                rows[cid] = with_summary(rows[cid], entry.data["index"], entry.data["summary"])
            elif entry.kind in ("summary", "feedback"):
                later.append(entry)
            else:
                raise ValueError(f"unknown spool record kind {entry.kind!r}")
        with session_scope(self.db) as session:
            written = insert_traces(session=session, rows=list(rows.values()))
            for entry in later:
                if entry.kind == "summary":
                    set_served_summary(session=session, **entry.data)
                    continue
                try:
                    attach_feedback(session=session, **entry.data)
                except NotFoundError:  # checked when it was sent; its turn was rejected since
                    log.warning("feedback for %s: no such served turn", entry.data.get("completion_id"))
        self.written += written

    def _reject(self, entry: Entry, exc: Exception) -> None:
        """Keep a record the registry refuses (never retried, never lost) under ``rejected/``."""
        self.rejected += 1
        log.error("the registry refuses a spooled %s record (%s): kept under rejected/", entry.kind, exc)
        if self.spool is None:
            log.error("refused record: %s", canonical(entry.data))
            return
        path = self.spool.directory / "rejected" / f"{time.time_ns()}.spool"
        try:  # fsynced before the spooled original is let go; a failure is logged, never the writer's end
            path.parent.mkdir(exist_ok=True)
            with open(path, "wb") as f:
                f.write(encode(entry.kind, entry.data, entry.at))
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            log.error("keeping the refused record under %s failed (%s): %s", path, exc, canonical(entry.data))


def with_summary(row: TraceRow, index: str, summary: str) -> TraceRow:
    """``row`` with ``metadata.summaries[index]`` set (its content hash kept: it names the served turn)."""
    metadata = json.loads(row.metadata)
    metadata.setdefault("summaries", {})[index] = summary
    return dataclasses.replace(row, metadata=canonical(metadata))
