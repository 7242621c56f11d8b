"""Answered means stored (issue 22 section 1): every turn a client got a 200 for is in the registry after a
``kill -9`` of the server, a PostgreSQL outage or a SQLite write lock held past the busy timeout; a full
spool refuses new turns (503 + Retry-After) instead of answering and losing them; a torn spool record is
replayed up to the last whole record. Real ``ratchet serve`` processes, the tiny model, real databases."""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

import httpx
import pytest

from pipeline.registry import upgrade_db
from pipeline.serving.recorder import ExperienceRecorder, served_trace_row
from pipeline.serving.served import ServeConfig
from pipeline.serving.server import create_app
from pipeline.serving.spool import Spool
from serving.support import ServerThread, experience_rows, register_generation

BODY = {"model": "ratchet", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
PROMPTS = ("12+35=?", "hello", "counter 1+2", "f adds 1", "timer 3+4")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _row(cid: str, text: str = "hi"):
    return served_trace_row(
        messages=[{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}],
        metadata={"summaries": {"1": "ok"}},
        routes=[],
        specialist="chat",
        completion_id=cid,
        generation_id=None,
        harness_version_id=None,
        principal="anonymous",
    )


def _stored(url: str) -> dict[str, object]:
    return {e.completion_id: e for e in experience_rows(url)}


# ----------------------------------------------------------------------------------------- the spool
def test_a_torn_record_is_replayed_up_to_the_last_whole_one(tmp_path):
    spool = Spool(tmp_path / "spool")
    spool.start(lambda entries, error: None)
    futures = [spool.append("turn", {"n": i, "text": "é" * i}).future for i in range(5)]
    for f in futures:
        f.result(5)
    spool.stop()  # a crash: nothing was committed, the file keeps every record
    path = spool.live.path
    blob = path.read_bytes()
    assert blob.count(b"\n") == 5
    path.write_bytes(blob[:-7])  # the last record torn in the middle
    os.close(spool.live.fd)  # the dead process's lock goes with it
    other = Spool(tmp_path / "spool")
    replayed = other.adopt()
    assert [e.data["n"] for e in replayed] == [0, 1, 2, 3]
    assert replayed[3].data["text"] == "é" * 3
    other.committed(replayed)  # stored: the dead file is emptied and deleted
    assert not path.exists()


def test_a_live_servers_file_is_not_replayed_by_another(tmp_path):
    first = Spool(tmp_path / "s")
    first.start(lambda entries, error: None)
    first.append("turn", {"n": 1}).future.result(5)
    second = Spool(tmp_path / "s")
    assert second.adopt() == []  # first still holds its file's lock
    assert first.live.path.exists()
    first.stop()
    os.close(first.live.fd)  # first dies
    assert [e.data for e in Spool(tmp_path / "s").adopt()] == [{"n": 1}]


def test_group_commit_and_replay_into_the_registry_are_idempotent(tmp_path):
    url = f"sqlite:///{tmp_path / 'r.db'}"
    upgrade_db(url)
    from pipeline.registry import get_engine

    db = get_engine(url)
    rec = ExperienceRecorder(db, spool_dir=tmp_path / "spool", flush_seconds=0.05)
    futures: list = []

    def put(k: int) -> None:
        for i in range(25):
            futures.append(rec.append("turn", asdict(_row(f"c-{k}-{i}"))))

    threads = [threading.Thread(target=put, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for f in futures:
        f.result(10)
    assert rec.spool.fsyncs < 200  # many turns per fsync
    rec.append("summary", {"completion_id": "c-0-0", "index": "1", "summary": "model-written"}).result(5)
    assert rec.flush(10)
    stored = _stored(url)
    assert len(stored) == 200 and stored["c-0-0"].meta["summaries"] == {"1": "model-written"}
    # the same records again, as after a crash between the commit and the truncation: nothing twice
    rec.spool.stop()
    os.close(rec.spool.live.fd)
    again = Spool(tmp_path / "spool2")
    again.start(lambda entries, error: None)
    for i in range(3):
        again.append("turn", asdict(_row(f"c-0-{i}"))).future.result(5)
    again.stop()
    os.close(again.live.fd)
    rec2 = ExperienceRecorder(db, spool_dir=tmp_path / "spool2", flush_seconds=0.05)
    assert rec2.flush(10) and rec2.failures == 0 and rec2.written == 0
    assert len(_stored(url)) == 200
    rec2.close()
    assert list((tmp_path / "spool2").glob("*.spool")) == []  # everything committed: no file left


# ----------------------------------------------------------------------------------- real servers
class Serve:
    """``ratchet serve`` in its own process (so it can be killed), on a free port."""

    def __init__(self, tmp: Path, url: str, home: Path, *extra: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {
            **os.environ,
            "RATCHET_DATABASE_URL": url,
            "RATCHET_HOME": str(home),
            "RATCHET_DEVICE": "cpu",
        }
        cmd = [
            sys.executable,
            "-c",
            "from pipeline.cli import main; main()",
            "serve",
            "--port",
            str(self.port),
        ]
        cmd += ["--poll-seconds", "0", "--threads", "1", *extra]
        self.log_path = tmp / f"serve-{self.port}.log"
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT, text=True
        )
        deadline = time.monotonic() + 180  # a busy shared machine: torch's import alone can take long
        while True:
            assert self.proc.poll() is None, self.log()
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not start\n" + self.log()
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text()[-4000:]

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=120)


class Traffic:
    """``clients`` threads sending chat turns until stopped; the completion ids answered with 200."""

    def __init__(self, url: str, clients: int = 16):
        self.url, self.ok, self.statuses = url, [], {}
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(k,), daemon=True) for k in range(clients)]
        for t in self.threads:
            t.start()

    def _client(self, k: int) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as http:
            i = 0
            while not self.stop_event.is_set():
                i += 1
                body = {**BODY, "messages": [{"role": "user", "content": PROMPTS[(k + i) % len(PROMPTS)]}]}
                try:
                    if (k + i) % 4 == 0:  # streamed: the turn counts once [DONE] arrived
                        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                            status, lines = r.status_code, [line for line in r.iter_lines() if line]
                        done = status == 200 and lines[-1] == "data: [DONE]"
                        cid = httpx.Response(200, content=lines[0][6:]).json()["id"] if done else None
                    else:
                        r = http.post("/v1/chat/completions", json=body)
                        status, cid = r.status_code, (r.json()["id"] if r.status_code == 200 else None)
                except (httpx.HTTPError, IndexError, ValueError):
                    status, cid = -1, None
                    time.sleep(0.05)
                with self.lock:
                    self.statuses[status] = self.statuses.get(status, 0) + 1
                    if cid is not None:
                        self.ok.append(cid)

    def answered(self) -> int:
        with self.lock:
            return len(self.ok)

    def wait_for(self, n: int, seconds: float = 120) -> None:
        deadline = time.monotonic() + seconds
        while self.answered() < n:
            assert time.monotonic() < deadline, f"only {self.answered()} turns answered: {self.statuses}"
            time.sleep(0.05)

    def stop(self) -> list[str]:
        self.stop_event.set()
        for t in self.threads:
            t.join(150)
        return list(self.ok)


def test_kill_9_under_load_loses_no_answered_turn(registry, tmp_path):
    home = tmp_path / "home"
    server = Serve(tmp_path, registry, home)
    traffic = Traffic(server.url, clients=16)
    try:
        traffic.wait_for(60)
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(30)
    finally:
        answered = traffic.stop()
        server.stop()
    restarted = Serve(tmp_path, registry, home)  # replays the dead process's spool
    try:
        deadline = time.monotonic() + 60
        while restarted.health().get("spool", {}).get("records") and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        restarted.stop()
    missing = set(answered) - set(_stored(registry))
    assert not missing, f"{len(missing)} of {len(answered)} answered turns lost by kill -9"
    assert list((home / "spool").rglob("*.spool")) == []  # all replayed, and nothing left behind


# ------------------------------------------------------------------------------ a PostgreSQL outage
def _pg_bin() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    return found[-1].parent if found else None


class PrivatePostgres:
    """A PostgreSQL cluster of this test alone (never the shared one), run as ``postgres``."""

    def __init__(self, bin_dir: Path):
        self.bin = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="ratchet-pg-"))
        os.chmod(self.root, 0o755)
        self.data, self.port = self.root / "data", _free_port()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        shutil.chown(self.root, "postgres", "postgres")
        self._as_postgres(str(self.bin / "initdb"), "-D", str(self.data), "--auth=trust", "-U", "postgres")
        self.start()

    def _as_postgres(self, *cmd: str) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        subprocess.run([*prefix, *cmd], check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        opts = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} -c fsync=off"
        self._as_postgres(
            str(self.bin / "pg_ctl"),
            "-D",
            str(self.data),
            "-o",
            opts,
            "-l",
            str(self.root / "log"),
            "-w",
            "start",
        )

    def stop(self) -> None:
        self._as_postgres(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")

    def remove(self) -> None:
        try:
            self.stop()
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def private_postgres():
    bin_dir = _pg_bin()
    can_switch = os.geteuid() != 0 or shutil.which("runuser") is not None
    if bin_dir is None or not can_switch:
        if os.environ.get("RATCHET_REQUIRE_POSTGRES") == "1":
            pytest.fail(
                "RATCHET_REQUIRE_POSTGRES=1 but no PostgreSQL binaries under /usr/lib/postgresql/*/bin"
            )
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl) under /usr/lib/postgresql/*/bin")
    pg = PrivatePostgres(bin_dir)
    try:
        yield pg
    finally:
        from pipeline.registry import dispose_engines

        dispose_engines()
        pg.remove()


def test_a_postgres_outage_during_traffic_loses_no_answered_turn(private_postgres, tiny_artifacts, tmp_path):
    pg = private_postgres
    upgrade_db(pg.url)
    register_generation(pg.url, tiny_artifacts)
    server = Serve(tmp_path, pg.url, tmp_path / "home")
    traffic = Traffic(server.url, clients=16)
    try:
        traffic.wait_for(20)
        pg.stop()
        before = traffic.answered()
        time.sleep(3)
        health = server.health()
        during = traffic.answered()
        pg.start()
        traffic.wait_for(traffic.answered() + 20)
        answered = traffic.stop()
        deadline = time.monotonic() + 60
        while server.health().get("spool", {}).get("records") and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        traffic.stop()
        server.stop()
    assert during > before  # the server kept answering through the outage
    missing = set(answered) - set(_stored(pg.url))
    assert not missing, (
        f"{len(missing)} of {len(answered)} answered turns lost by a 3 s outage\n{server.log()}"
    )
    assert health["status"] == "degraded" and health["spool"]["failures"] > 0, health


# ----------------------------------------------------------------------------------- a SQLite lock
def _hold_write_lock(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=1, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")  # the write lock, until rollback
    return conn


@pytest.mark.parametrize("hold_s", [36, pytest.param(95, marks=pytest.mark.slow)])
def test_a_sqlite_write_lock_past_the_busy_timeout_loses_no_answered_turn(registry, tmp_path, hold_s):
    """The registry's busy timeout is 30 s: the lock is held for 36 s, so a write fails meanwhile (95 s:
    past the three tries of the in-memory recorder before the spool, which dropped their turns)."""
    server = Serve(tmp_path, registry, tmp_path / "home")
    traffic = Traffic(server.url, clients=8)
    try:
        traffic.wait_for(10)
        lock = _hold_write_lock(registry.removeprefix("sqlite:///"))
        started, depths = time.monotonic(), []
        while time.monotonic() - started < hold_s:
            depths.append(server.health().get("spool", {}))
            time.sleep(1)
        degraded = server.health()
        lock.rollback()
        lock.close()
        traffic.wait_for(traffic.answered() + 10)
        answered = traffic.stop()
        deadline = time.monotonic() + 60
        while server.health().get("spool", {}).get("records") and time.monotonic() < deadline:
            time.sleep(0.1)
        after = server.health()
    finally:
        traffic.stop()
        server.stop()
    missing = set(answered) - set(_stored(registry))
    assert not missing, f"{len(missing)} of {len(answered)} answered turns lost by the lock"
    turns = [d["turns"] for d in depths]
    assert turns[-1] > turns[len(turns) // 4] > 0, depths  # the depth grew while the registry was locked
    assert depths[-1]["oldest_s"] > 25 and depths[-1]["bytes"] > 0, depths[-1]
    assert degraded["status"] == "degraded" and degraded["spool"]["failures"] >= 1, degraded
    assert after["status"] == "ok" and after["spool"]["turns"] == 0, after


# ---------------------------------------------------------------------------------- a full spool
def test_a_full_spool_refuses_new_turns_until_the_registry_takes_them(registry):
    cfg = ServeConfig(
        registry_url=registry, device="cpu", poll_seconds=0, flush_seconds=0.05, spool_max_bytes=6000
    )
    app = create_app(cfg)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        assert http.post("/v1/chat/completions", json=BODY).status_code == 200
        assert app.state.ratchet.recorder.flush(10)
        lock = _hold_write_lock(registry.removeprefix("sqlite:///"))
        answered, refused = [], None
        try:
            for _ in range(60):
                r = http.post("/v1/chat/completions", json=BODY)
                if r.status_code == 503:
                    refused = r
                    break
                assert r.status_code == 200, r.text
                answered.append(r.json()["id"])
            assert refused is not None, "the spool never filled"
            assert refused.headers["retry-after"].isdigit()
            assert "--spool-max-bytes" in refused.json()["error"]["message"]
            spool = http.get("/health").json()["spool"]
            assert spool["bytes"] >= 6000 and spool["turns"] == len(answered), spool
        finally:
            lock.rollback()
            lock.close()
        assert app.state.ratchet.recorder.flush(60)
        r = http.post("/v1/chat/completions", json=BODY)
        assert r.status_code == 200  # answered again once the registry took the spool
        assert app.state.ratchet.recorder.flush(10)
    assert set(answered) | {r.json()["id"]} <= set(_stored(registry))


def test_a_model_written_summary_follows_its_spooled_turn_into_the_registry(registry):
    """The turn is spooled (and answered) with the extractive summary; the model-written one, made after the
    answer, reaches the stored row as its own record: the registry ends with what the server remembers."""
    app = create_app(ServeConfig(registry_url=registry, device="cpu", poll_seconds=0, flush_seconds=0.05))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        state = app.state.ratchet
        cids = [http.post("/v1/chat/completions", json=BODY).json()["id"] for _ in range(3)]
        deadline = time.monotonic() + 30
        while state.pending and time.monotonic() < deadline:  # the summaries, written after the answers
            time.sleep(0.02)
        assert state.recorder.flush(10)
        stored = _stored(registry)
        for cid in cids:
            row = stored[cid]
            reply = row.messages[-1]
            assert row.meta["summaries"]["1"] == state.memory.lookup(reply).summary


def test_a_failed_partial_write_does_not_hide_later_answered_records(tmp_path, monkeypatch):
    """Found in review: ENOSPC after a partial os.write leaves half a record in the live file; the batch fails (503)
    but later batches are appended after the torn bytes, and replay stops there: answered turns lost."""
    import errno
    import os

    from pipeline.serving import spool as spool_mod
    from pipeline.serving.spool import Spool

    real_write, calls = os.write, {"n": 0}

    def flaky_write(fd, data):
        calls["n"] += 1
        if calls["n"] == 1:
            return real_write(fd, data[: len(data) // 2])  # the disk took half ...
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")  # ... then is full
        return real_write(fd, data)

    first = Spool(tmp_path / "s")
    durable = []
    first.start(lambda entries, error: durable.extend(e.data["n"] for e in entries if error is None))
    monkeypatch.setattr(spool_mod.os, "write", flaky_write)
    bad = first.append("turn", {"n": 0})
    try:
        bad.future.result(5)
    except OSError:
        pass  # its request got 503: fine
    good = first.append("turn", {"n": 1})
    good.future.result(5)  # durable: this one's client was answered
    monkeypatch.setattr(spool_mod.os, "write", real_write)
    assert durable == [1]
    # the process dies (kill -9): its lock goes with it; the next start adopts the file
    os.close(first.live.fd)
    replayed = Spool(tmp_path / "s").adopt()
    assert [e.data["n"] for e in replayed] == [1], "an answered, fsynced record is not replayed"


@pytest.mark.parametrize("keepable", [True, False])
def test_a_record_the_registry_refuses_is_kept_aside_and_the_writer_goes_on(tmp_path, keepable):
    """A turn the registry refuses as data (here: a second turn under a stored completion id) is kept under
    `rejected/` (fsynced), or, where even that fails, logged; either way the writer stores what follows."""
    from pipeline.registry import get_engine

    url = f"sqlite:///{tmp_path / 'r.db'}"
    upgrade_db(url)
    spool = tmp_path / "spool"
    spool.mkdir()
    if not keepable:
        (spool / "rejected").write_text("a file where the directory belongs")
    rec = ExperienceRecorder(get_engine(url), spool_dir=spool, flush_seconds=0.05)
    try:
        rec.append("turn", asdict(_row("c-1"))).result(10)
        assert rec.flush(10)
        rec.append("turn", asdict(_row("c-1", text="another reply"))).result(10)  # same id, other trace
        rec.append("turn", asdict(_row("c-2"))).result(10)
        assert rec.flush(10)
        assert set(_stored(url)) == {"c-1", "c-2"} and rec.rejected == 1
        kept = list((spool / "rejected").glob("*.spool")) if keepable else []
        assert len(kept) == (1 if keepable else 0)
    finally:
        rec.close()


def test_a_server_on_an_external_registry_makes_its_spool_home(tmp_path, monkeypatch):
    """`ratchet serve --registry-url ...` with no home yet: the home then only holds this machine's spool, so it
    is made; a server on the home's own registry still refuses a missing home with one line (``ratchet init``).
    (Found by a clean checkout: module-scoped servers start before a test's RATCHET_HOME exists.)"""
    from pipeline.serving.turns import spool_dir
    from pipeline.settings import HomeMissing, get_settings

    home = tmp_path / "nowhere" / "home"
    monkeypatch.setenv("RATCHET_HOME", str(home))
    get_settings.cache_clear()
    external = ServeConfig(registry_url=f"sqlite:///{tmp_path / 'elsewhere.db'}")
    spool = spool_dir(external)
    assert home.is_dir() and spool.parent == home / "spool"
    shutil.rmtree(home)
    with pytest.raises(HomeMissing):
        spool_dir(ServeConfig())
    assert not home.exists()
    get_settings.cache_clear()
