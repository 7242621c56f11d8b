"""The advance lease: one process builds a candidate at a time, proves it on every write, and a run whose
owner is gone is taken over at once.

- ``owner_id()`` names this run: ``host:pid:start:token`` (the process's start time tells a reused pid
  apart; the token tells two runs of one process apart).
- ``Lease`` renews itself from a background thread every quarter of its length while a step runs, so a
  short lease (a minute by default) stays held through an hour of training and expires soon after its
  process stops.
- Fencing: while a process holds a lease, every registry transaction of that process that writes checks,
  before it commits and under a lock the takeover also needs, that the lease is still its own; a run that
  lost its lease (paused past expiry, then taken over) fails with ``LeaseLostError`` instead of writing
  beside the new owner.
- ``owner_gone(owner)``: the owner's lease expired (no renewal), or its process is dead on this host. The
  next run marks it crashed in the registry (audit log and the candidate's state) and takes over.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import event, select, update
from sqlalchemy.orm import Session

from pipeline.errors import ConflictError
from pipeline.registry import Generation
from pipeline.registry.db import hold_lock
from pipeline.registry.models import utcnow

log = logging.getLogger(__name__)

__all__ = ["Lease", "LeaseLostError", "held_leases", "owner_gone", "owner_id"]


class LeaseLostError(ConflictError):
    """Another run took this candidate over: this run must stop without writing."""


def _process_start(pid: int) -> str | None:
    """When process ``pid`` started (field 22 of ``/proc/PID/stat``, clock ticks since boot); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def owner_id() -> str:
    """A fresh owner name for one advance run of this process."""
    pid = os.getpid()
    return f"{socket.gethostname()}:{pid}:{_process_start(pid) or 0}:{uuid.uuid4().hex[:8]}"


def owner_gone(owner: str, expires_at: datetime | None, now: datetime) -> str | None:
    """Why the lease's owner is presumed gone (``None`` while it may still be working)."""
    if expires_at is not None and expires_at < now:
        return f"its lease expired at {expires_at:%H:%M:%S} UTC without renewal"
    parts = owner.split(":")
    if len(parts) != 4 or parts[0] != socket.gethostname() or not parts[1].isdigit():
        return None  # another host (or an old-style name): only the expiry tells
    pid = int(parts[1])
    start = _process_start(pid)
    if start is None or (parts[2] != "0" and start != parts[2]):
        return f"its process {pid} on this host is gone"
    return None


_active: dict[int, Lease] = {}
_active_lock = threading.Lock()


def held_leases() -> list[Lease]:
    with _active_lock:
        return list(_active.values())


@dataclass
class Lease:
    """A held lease on one candidate generation, renewed in the background until ``stop()``."""

    generation_id: int
    owner: str
    seconds: int
    engine: object  # the registry's Engine (typed loosely: sqlalchemy's Engine is imported lazily)
    lost: str | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Lease:
        with _active_lock:
            _active[self.generation_id] = self
        self._thread = threading.Thread(
            target=self._renew_loop, name=f"lease-{self.generation_id}", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with _active_lock:
            if _active.get(self.generation_id) is self:
                del _active[self.generation_id]

    def renew(self) -> bool:
        """Push the expiry ``seconds`` ahead, if the lease is still ours."""

        with Session(self.engine, info={"lease": True}) as session:  # type: ignore[arg-type]
            rows = session.execute(
                update(Generation)
                .where(Generation.id == self.generation_id, Generation.lease_owner == self.owner)
                .values(lease_expires_at=utcnow() + timedelta(seconds=self.seconds))
                .execution_options(synchronize_session=False)
            ).rowcount
            session.commit()
            holder = (
                None
                if rows
                else session.scalar(select(Generation.lease_owner).where(Generation.id == self.generation_id))
            )
        if not rows and holder is not None:  # (None: this run's own decide step released it)
            self.lost = f"taken over by {holder}"
            log.warning("lease on generation id %d lost: %s", self.generation_id, self.lost)
        return bool(rows)

    def _renew_loop(self) -> None:
        interval = max(0.2, self.seconds / 4)
        while not self._stop.wait(interval):
            try:
                if not self.renew():
                    return
            except Exception as exc:  # a dropped connection: try again next time, the lease has slack
                log.warning("could not renew the lease on generation id %d: %s", self.generation_id, exc)

    def check(self, session: Session) -> None:
        """Raise ``LeaseLostError`` unless the lease is still ours, holding the candidate's row (PostgreSQL:
        ``FOR UPDATE``; SQLite: the write lock) until ``session`` commits, so a takeover cannot slip in
        between this check and the commit."""

        with session.no_autoflush:  # the stored owner, not this transaction's pending changes
            if session.get_bind().dialect.name != "postgresql":
                hold_lock(session=session, key=f"generation:{self.generation_id}")
            owner = session.execute(
                select(Generation.lease_owner, Generation.number)
                .where(Generation.id == self.generation_id)
                .with_for_update()
            ).first()
        if owner is None or owner[0] != self.owner:
            holder = owner[0] if owner else None
            raise LeaseLostError(
                f"generation {owner[1] if owner else self.generation_id} is now advanced by {holder or 'nobody'} "
                f"(this run, {self.owner}, lost its lease): this run stops without writing"
            )


@event.listens_for(Session, "do_orm_execute")
def _note_write(state) -> None:
    from sqlalchemy import TextClause

    statement = state.statement
    if state.is_select or (
        isinstance(statement, TextClause) and statement.text.lstrip()[:6].upper() == "SELECT"
    ):
        return
    state.session.info["writes"] = True


@event.listens_for(Session, "after_flush")
def _note_flush(session: Session, _context) -> None:
    session.info["writes"] = True


@event.listens_for(Session, "before_commit")
def _fence(session: Session) -> None:
    """Every writing transaction of a process that holds a lease proves the lease first."""
    if not _active or session.info.get("lease"):
        return
    if not (session.info.pop("writes", False) or session.new or session.dirty or session.deleted):
        return  # reads only
    for lease in held_leases():
        if session.get_bind().url == lease.engine.url:  # type: ignore[attr-defined]
            lease.check(session)
