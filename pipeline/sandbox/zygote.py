"""Jobs of model-written code, each in namespaces of its own, started by a long-lived sandboxed zygote.

Starting a sandbox and an interpreter per run costs ~25 ms of CPU; a zygote -- one long-lived program in
the launcher's sandbox (``programs/zygote.py``) -- forks a job in ~3 ms instead. Per job it enters new
user, mount, PID, IPC and UTS namespaces (bubblewrap mode) and the job's first process mounts a /proc that
shows only the job's own processes and a private /tmp and /dev/shm, forbids further user namespaces and
drops every capability before anything untrusted runs; the job keeps the sandbox's read-only root, its
network namespace (loopback only, used by one job at a time) and uid 65534. At the time limit the zygote
kills the job, and with its PID namespace every process the job started. The zygote only ever receives
descriptors (SCM_RIGHTS): the code, the tests and the verdicts pass between this process and the job
without going through it, so no job can find another's data in it.

``zygote(launcher)`` lends an idle zygote of that launcher (starting one when none is idle) for one job.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from pipeline.sandbox.launcher import SHM_BYTES, TMP_BYTES, Launcher, Limits, Run
from pipeline.sandbox.programs import program_source

RECYCLE_AFTER = 5000  # jobs per zygote before a fresh one replaces it


class ZygoteLost(Exception):
    """The zygote did not answer (it died, or its sandbox was killed): the job has no status."""


@dataclass
class Zygote:
    """One zygote process and the control socket to it."""

    launcher: Launcher
    run: Run
    control: socket.socket
    jobs: int = 0
    broken: bool = False

    @classmethod
    def start(cls, launcher: Launcher, *, capture_stderr: bool = False) -> Zygote:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        isolation = "namespaces" if launcher.mode == "bubblewrap" else "plain"
        try:
            run = launcher.start(
                launcher.compile(program_source("zygote")),
                [str(theirs.fileno()), isolation, str(TMP_BYTES), str(SHM_BYTES)],
                pass_fds=(theirs.fileno(),),
                capture_stderr=capture_stderr,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return cls(launcher, run, ours)

    def submit(self, kind: str, fds: list[int], limits: Limits, timeout_s: float) -> None:
        """Start a job (``tests`` or ``script``) on the child ends ``fds`` (sent as copies: the caller
        closes its own, and may hand them to another zygote if this one is gone)."""
        numbers = limits.argv(self.launcher.mode)
        message = " ".join([kind, *numbers, str(max(1, int(timeout_s * 1000)))]).encode()
        try:
            socket.send_fds(self.control, [message], fds)
        except OSError as exc:
            self.broken = True
            raise ZygoteLost(f"the zygote is gone ({exc})") from None
        self.jobs += 1

    def finish(self, timeout_s: float) -> tuple[bool, int | None]:
        """Wait for the job's end: (timed out, exit status or None)."""
        self.control.settimeout(max(0.1, timeout_s))
        try:
            reply = self.control.recv(64).decode()
        except (OSError, TimeoutError):
            reply = ""
        if not reply or reply == "lost":
            self.broken = True
            raise ZygoteLost("the zygote did not report the end of the job")
        if reply == "timeout":  # the job is gone with its namespace; retiring the zygote costs ~20 ms
            self.broken = True
            return True, None
        return False, int(reply.split()[1])

    def close(self) -> None:
        self.control.close()
        self.run.close()


@dataclass
class _Pool:
    idle: list[Zygote] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


_POOLS: dict[tuple[str, str], _Pool] = {}
_POOLS_LOCK = threading.Lock()


class _Starter:
    """Starts zygotes from one long-lived thread. bwrap dies with its parent (``--die-with-parent``: the
    kernel's parent-death signal), and the parent is the *thread* that started it: a zygote started from a
    scoring worker would die with that worker. This thread lives as long as the process."""

    def __init__(self) -> None:
        import queue

        self.requests: queue.Queue = queue.Queue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def start(self, launcher: Launcher) -> Zygote:
        import concurrent.futures

        with self.lock:
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._serve, name="sandbox-zygotes", daemon=True)
                self.thread.start()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self.requests.put((launcher, done))
        return done.result()

    def _serve(self) -> None:
        while True:
            launcher, done = self.requests.get()
            try:
                done.set_result(Zygote.start(launcher))
            except BaseException as exc:  # noqa: BLE001 - handed to the thread that asked
                done.set_exception(exc)


_STARTER = _Starter()


@contextlib.contextmanager
def zygote(launcher: Launcher) -> Iterator[Zygote]:
    """An idle zygote of ``launcher`` for one job (returned afterwards unless it broke or is due for
    recycling)."""
    key = (launcher.mode, launcher.python)
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = _Pool()
            if len(_POOLS) == 1:
                atexit.register(close_all)
    found = None
    with pool.lock:
        while pool.idle and found is None:
            found = pool.idle.pop()
            if found.run.proc.poll() is not None:  # it died while idle (killed from outside)
                found.close()
                found = None
    z = found or _STARTER.start(launcher)
    try:
        yield z
    except BaseException:
        z.broken = True
        raise
    finally:
        if z.broken or z.jobs >= RECYCLE_AFTER or z.run.proc.poll() is not None:
            z.close()
        else:
            with pool.lock:
                pool.idle.append(z)


def close_all() -> None:
    """Stop every idle zygote (at exit; a zygote in use goes when its job ends)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
    for pool in pools:
        with pool.lock:
            idle, pool.idle = pool.idle, []
        for z in idle:
            z.close()


def probe(launcher: Launcher) -> str | None:
    """None when ``launcher`` runs a job end to end (a zygote, a job in its own namespaces, a verdict), else
    why not (the last line the sandbox printed)."""
    import time

    try:
        z = Zygote.start(launcher, capture_stderr=True)
    except OSError as exc:
        return f"could not start {launcher.bwrap or launcher.python}: {exc}"
    verdict = b""
    try:
        fds = [os.pipe() for _ in range(3)]  # code, tests, results
        z.submit("tests", [fds[0][0], fds[1][0], fds[2][1]], Limits(), 30.0)
        for theirs in (fds[0][0], fds[1][0], fds[2][1]):
            os.close(theirs)
        for write in (fds[0][1], fds[1][1]):
            os.write(write, b"x = 1\n")
            os.close(write)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (chunk := os.read(fds[2][0], 65536)):
            verdict += chunk
        os.close(fds[2][0])
        z.finish(30.0)
    except (OSError, ZygoteLost):
        pass
    finally:
        z.control.close()  # the zygote ends at its socket's end; what it printed is then all there
        try:
            z.run.proc.wait(timeout=10)
        except Exception:  # noqa: BLE001 - it would not end: kill it
            z.run.close()
        err = z.run.proc.stderr.read().decode("utf-8", "replace") if z.run.proc.stderr else ""
        z.run.close()
    if b'"ok":true' in verdict:
        return None
    return (err.strip().splitlines() or ["no verdict from a test run"])[-1]
