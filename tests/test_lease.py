"""The advance lease on SQLite and PostgreSQL: renewed while a step runs, proven on every write, and taken
over at once from a run whose process is gone."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from registry.test_races import _seed
from sqlalchemy import select, update

from pipeline.errors import ConflictError
from pipeline.loop.advance import begin_candidate, release_candidate
from pipeline.loop.candidate import AdvanceConfig
from pipeline.loop.lease import Lease, LeaseLostError, owner_id
from pipeline.registry import AuditLog, Generation, get_engine, register_harness, session_scope
from pipeline.registry.models import utcnow


@pytest.fixture
def registry(registry_url, monkeypatch):
    """The settings' registry is ``registry_url`` (what ``begin_candidate`` opens), seeded with a champion."""
    from pipeline.settings import get_settings

    monkeypatch.setenv("RATCHET_DATABASE_URL", registry_url)
    get_settings.cache_clear()
    _seed(get_engine(), generations=2)
    return get_engine()


def _lease_of(engine, gen_id):
    with session_scope(engine) as s:
        gen = s.get(Generation, gen_id)
        return gen.lease_owner, gen.lease_expires_at


def test_the_lease_is_renewed_while_a_step_runs(registry):
    config = AdvanceConfig(lease_seconds=1)
    owner = owner_id()
    gen_id = begin_candidate(config=config, owner=owner)
    lease = Lease(gen_id, owner, 1, registry).start()
    try:
        time.sleep(2.5)  # two and a half lease lengths: without renewal it would have expired
        held, expires = _lease_of(registry, gen_id)
        assert held == owner and expires > utcnow()
        with pytest.raises(ConflictError, match="is being advanced by"):
            begin_candidate(config=config, owner="other-host:1:1:abcd")
    finally:
        lease.stop()
        release_candidate(generation_id=gen_id, owner=owner)
    assert _lease_of(registry, gen_id) == (None, None)


def test_a_run_that_lost_its_lease_cannot_write(registry):
    owner = owner_id()
    gen_id = begin_candidate(config=AdvanceConfig(), owner=owner)
    lease = Lease(gen_id, owner, 60, registry).start()
    try:
        with session_scope(registry) as s:  # still ours: writes go through
            register_harness(session=s, name="before", version="1", spec={})
        with registry.begin() as conn:  # another run takes it over (this one was paused past its expiry)
            conn.execute(
                update(Generation).where(Generation.id == gen_id).values(lease_owner="elsewhere:1:1:beef")
            )
        with pytest.raises(LeaseLostError, match="now advanced by elsewhere:1:1:beef"):
            with session_scope(registry) as s:
                register_harness(session=s, name="after", version="1", spec={})
        with session_scope(registry) as s:  # nothing of the fenced transaction was stored; reads still work
            names = s.scalars(select(AuditLog.details)).all()
            assert any(d.get("name") == "before" for d in names)
            assert not any(d.get("name") == "after" for d in names)
        assert lease.renew() is False and lease.lost == "taken over by elsewhere:1:1:beef"
    finally:
        lease.stop()


HOLD_AND_DIE = """
import os, sys
from pipeline.loop.advance import begin_candidate
from pipeline.loop.candidate import AdvanceConfig
from pipeline.loop.lease import owner_id
owner = owner_id()
begin_candidate(config=AdvanceConfig(lease_seconds=3600), owner=owner)
print(owner, flush=True)
os.kill(os.getpid(), 9)  # gone without releasing, as kill -9 or a power cut leaves it
"""


def test_a_dead_owner_on_this_host_is_marked_crashed_and_taken_over_at_once(registry, registry_url):
    env = {**os.environ, "RATCHET_DATABASE_URL": registry_url}
    proc = subprocess.run(
        [sys.executable, "-c", HOLD_AND_DIE], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -9, proc.stderr
    dead = proc.stdout.strip()
    with session_scope(registry) as s:
        gen = s.scalar(select(Generation).where(Generation.lease_owner == dead))
        gen_id, number = gen.id, gen.number
        assert gen.lease_expires_at > utcnow() + timedelta(minutes=50)  # the lease alone would hold an hour
    started = time.monotonic()
    me = owner_id()
    assert begin_candidate(config=AdvanceConfig(), owner=me) == gen_id
    assert time.monotonic() - started < 10
    with session_scope(registry) as s:
        gen = s.get(Generation, gen_id)
        assert gen.number == number and gen.lease_owner == me
        assert [c["owner"] for c in gen.state["crashes"]] == [dead]
        crashed = s.scalars(select(AuditLog).where(AuditLog.action == "crashed")).all()
        assert len(crashed) == 1 and dead in crashed[0].message and "is gone" in crashed[0].message
    release_candidate(generation_id=gen_id, owner=me)


def test_another_hosts_run_is_taken_over_only_once_its_lease_expired(registry):
    far = "gpu-7.cluster:4242:123:cafe"
    assert far.split(":")[0] != socket.gethostname()
    gen_id = begin_candidate(config=AdvanceConfig(lease_seconds=600), owner=far)
    with pytest.raises(ConflictError, match=f"is being advanced by {far}"):
        begin_candidate(config=AdvanceConfig(), owner=owner_id())  # alive as far as we can tell
    with session_scope(registry) as s:  # its renewals stop: the lease runs out
        s.execute(
            update(Generation)
            .where(Generation.id == gen_id)
            .values(lease_expires_at=utcnow() - timedelta(seconds=1))
        )
    me = owner_id()
    assert begin_candidate(config=AdvanceConfig(), owner=me) == gen_id
    with session_scope(registry) as s:
        crash = s.get(Generation, gen_id).state["crashes"][-1]
        assert crash["owner"] == far and "expired" in crash["why"]
    release_candidate(generation_id=gen_id, owner=me)
