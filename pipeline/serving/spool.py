"""The write-ahead spool: what the server answered is on disk before the client gets the answer.

Every served turn (its ``TraceRow``), every model-written summary that arrives after it, and every
feedback is appended here and fsynced before the response is sent or the stream ends; a background writer
(``recorder.ExperienceRecorder``) then moves the records into the registry and tells the spool what is
committed, which truncates or deletes the files that hold nothing unstored any more.

Files: one directory per registry (``<home>/spool/<sha256(registry URL)[:16]>/``, so a home shared by two
registries never replays one's turns into the other), one live file per server process,
``<unix ns>-<pid>-<n>.spool``, rotated past ``segment_bytes``. Each record is one line
``<crc32 of the JSON, 8 hex> <JSON>\\n``; the JSON is ``{"k": kind, "t": unix time, "d": data}`` with kind
``turn`` (the row's fields), ``summary`` (``cid``, ``index``, ``summary``: a model-written summary that
replaces the extractive one the turn was spooled with, under ``metadata.summaries[index]`` of the row with
that completion id) or ``feedback`` (``registry.attach_feedback``'s arguments). A torn write (a crash in
the middle of a record) leaves a last line without its newline or with a wrong CRC: reading stops there,
and the records before it are replayed.

Group commit: ``append`` only queues the encoded record and returns a ``Future``; one thread writes every
record queued meanwhile with a single ``write`` and a single ``fsync``, then resolves all their futures
(async callers await them with ``asyncio.wrap_future``: the event loop never waits on the disk).

Ownership: a process holds an exclusive ``flock`` on each of its files for as long as they exist (a file
is locked before it gets its ``.spool`` name). At start, ``adopt`` takes every file of the directory it can
lock: the files of dead processes (a live server's files stay locked, so two servers sharing a home never
process each other's); their records are replayed before anything new. Inserting a turn is idempotent (its
content hash is unique), a summary or a feedback is set again to the same value, so replaying a record
that was committed just before a crash stores nothing twice (a replayed feedback adds one more audit
entry). A file is emptied (``ftruncate``) before it is unlinked, so a process that opened it just before
finds nothing to replay.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
import time
import zlib
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SUFFIX = ".spool"
GROUP_COMMIT_S = 0.002  # how long the fsync thread gathers records before it writes them


@dataclass(eq=False)
class Segment:
    """One spool file this process holds (locked): how many records it has, how many are committed."""

    path: Path
    fd: int
    size: int = 0
    appended: int = 0
    committed: int = 0
    sealed: bool = False  # no more records go to it: it is deleted once all its records are committed


@dataclass(eq=False)
class Entry:
    """One durable record on its way to the registry."""

    kind: str  # turn | summary | feedback
    data: dict[str, Any]
    at: float  # unix time it was spooled
    size: int  # its bytes in the file
    segment: Segment | None = None  # None: an in-memory recorder (no spool)
    future: Future | None = field(default=None, repr=False)


def encode(kind: str, data: dict[str, Any], at: float) -> bytes:
    body = json.dumps({"k": kind, "t": at, "d": data}, ensure_ascii=False, separators=(",", ":"))
    raw = body.encode()
    return b"%08x " % zlib.crc32(raw) + raw + b"\n"


def decode(blob: bytes) -> tuple[list[tuple[str, dict[str, Any], float, int]], int]:
    """The whole records at the start of ``blob`` (kind, data, time, size) and the bytes they take; reading
    stops at the first torn or corrupt record."""
    records, pos = [], 0
    while True:
        end = blob.find(b"\n", pos)
        if end < 0:
            break
        line = blob[pos:end]
        crc, _, raw = line.partition(b" ")
        try:
            if len(crc) != 8 or int(crc, 16) != zlib.crc32(raw):
                break
            rec = json.loads(raw)
            records.append((rec["k"], rec["d"], float(rec["t"]), end + 1 - pos))
        except (ValueError, KeyError, TypeError):
            break
        pos = end + 1
    return records, pos


def _lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


class Spool:
    """Append-only, group-committed spool files of this process, and the adopted files of dead ones."""

    def __init__(self, directory: Path, *, segment_bytes: int = 8 << 20):
        self.directory = directory
        self.segment_bytes = segment_bytes
        self._pending: list[tuple[Entry, bytes]] = []
        self._cond = threading.Condition()
        self._io = threading.Lock()  # the live file: writes, rotation, truncation
        self._serial = 0
        self._closed = False
        # called in the fsync thread with each batch and None once it is on disk, or the OSError that kept it off
        self.on_durable: Any = None
        self.fsyncs = 0
        directory.mkdir(parents=True, exist_ok=True)
        self.live = self._new_segment()
        self._thread = threading.Thread(target=self._run, name="spool-fsync", daemon=True)

    def start(self, on_durable: Any) -> None:
        self.on_durable = on_durable
        self._thread.start()

    # ----------------------------------------------------------------------------------------- files
    def _new_segment(self) -> Segment:
        self._serial += 1
        name = f"{time.time_ns()}-{os.getpid()}-{self._serial}"
        tmp = self.directory / f".{name}.tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_APPEND, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # locked before anyone can see it under its real name
        path = self.directory / f"{name}{SUFFIX}"
        os.rename(tmp, path)
        _fsync_dir(self.directory)
        return Segment(path, fd)

    def adopt(self) -> list[Entry]:
        """Take every file no live process holds (theirs stay locked) and return its whole records, oldest
        file first; a torn record at the end of a file is logged and left out."""
        entries: list[Entry] = []
        for path in sorted(self.directory.glob(f"*{SUFFIX}"), key=_order):
            if path == self.live.path:
                continue
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                continue
            if not _lock(fd) or os.fstat(fd).st_ino != _inode(path):
                os.close(fd)  # a live server's file, or one deleted meanwhile
                continue
            with open(fd, "rb", closefd=False) as f:
                blob = f.read()
            records, used = decode(blob)
            if used < len(blob):
                log.warning(
                    "%s: %d bytes after the last whole record (a torn write) are not replayed",
                    path.name,
                    len(blob) - used,
                )
            seg = Segment(path, fd, size=used, appended=len(records), sealed=True)
            entries += [Entry(k, d, t, n, seg) for k, d, t, n in records]
            if not records:
                self._remove(seg)
            else:
                log.info("replaying %d spooled records of %s", len(records), path.name)
        return entries

    def _remove(self, seg: Segment) -> None:
        os.ftruncate(seg.fd, 0)  # a process that opened it before the unlink finds it empty
        seg.path.unlink(missing_ok=True)
        os.close(seg.fd)
        seg.fd = -1

    # -------------------------------------------------------------------------------------- appending
    def append(self, kind: str, data: dict[str, Any]) -> Entry:
        """Queue one record; ``entry.future`` resolves once it is fsynced (or fails with the OS error)."""
        at = time.time()
        blob = encode(kind, data, at)
        entry = Entry(kind, data, at, len(blob), future=Future())
        with self._cond:
            if self._closed:
                raise RuntimeError("the spool is closed")
            self._pending.append((entry, blob))
            self._cond.notify()
        return entry

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                # group commit window (PostgreSQL's commit_delay): the turns of one decoded batch finish one
                # after another on the event loop; gathering them for a moment lets one fsync cover them all
                deadline = time.monotonic() + GROUP_COMMIT_S
                while not self._closed and (left := deadline - time.monotonic()) > 0:
                    self._cond.wait(left)
                batch, self._pending = self._pending, []
                if not batch and self._closed:
                    return
            try:
                with self._io:
                    seg = self.live
                    if seg.size >= self.segment_bytes:
                        seg.sealed = True
                        seg = self.live = self._new_segment()
                    data = b"".join(blob for _, blob in batch)
                    written = 0
                    while written < len(data):
                        written += os.write(seg.fd, data[written:])
                    os.fdatasync(seg.fd)
                    self.fsyncs += 1
                    seg.size += len(data)
                    seg.appended += len(batch)
                    for entry, _ in batch:
                        entry.segment = seg
            except OSError as exc:  # disk full, I/O error: these turns are not durable; their requests fail
                log.error("writing %d records to the spool failed: %s", len(batch), exc)
                self._cut_torn_write()
                self.on_durable([e for e, _ in batch], exc)
                for entry, _ in batch:
                    entry.future.set_exception(exc)  # type: ignore[union-attr]
                continue
            self.on_durable([e for e, _ in batch], None)
            for entry, _ in batch:
                entry.future.set_result(None)  # type: ignore[union-attr]

    def _cut_torn_write(self) -> None:
        """Drop whatever a failed write left after the live file's last whole record (a replay stops at a
        torn record, so later records appended after it would be lost); if even that fails, seal the file
        there and go on in a new one."""
        with self._io:
            seg = self.live
            try:
                os.ftruncate(seg.fd, seg.size)
            except OSError as exc:
                log.error("cutting a torn write off %s failed (%s): starting a new spool file", seg.path, exc)
                seg.sealed = True
                try:
                    self.live = self._new_segment()
                except OSError:
                    log.exception("no new spool file either: the next write is tried in the old one")

    # -------------------------------------------------------------------------------------- committing
    def committed(self, entries: list[Entry]) -> None:
        """``entries`` are in the registry: delete sealed files with nothing unstored left, and empty the
        live file when everything in it is stored."""
        touched: dict[int, Segment] = {}
        for e in entries:
            if e.segment is not None:
                e.segment.committed += 1
                touched[id(e.segment)] = e.segment
        with self._io:
            for seg in touched.values():
                if seg.fd < 0 or seg.committed < seg.appended:
                    continue
                if seg.sealed:
                    self._remove(seg)
                elif seg.size:
                    os.ftruncate(seg.fd, 0)
                    seg.size = seg.appended = seg.committed = 0

    def stop(self) -> None:
        """Take no more records; return once the queued ones are written."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(30)

    def close(self) -> None:
        """``stop``, and delete the live file if everything in it is committed (otherwise it keeps what is
        not, for the next start)."""
        self.stop()
        with self._io:
            seg = self.live
            if seg.fd >= 0 and seg.committed >= seg.appended:
                self._remove(seg)
            elif seg.fd >= 0:
                os.close(seg.fd)
                seg.fd = -1


def _order(path: Path) -> tuple[int, int, int]:
    try:
        ns, pid, n = (int(x) for x in path.stem.split("-"))
        return ns, pid, n
    except ValueError:
        return 0, 0, 0


def _inode(path: Path) -> int:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return -1


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
