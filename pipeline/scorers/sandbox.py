"""The python_tests scorer: run model-written code against test code in a locked-down subprocess.

Isolation, layer by layer: a fresh temporary working directory (removed afterwards); ``python -I``
(no user site, no PYTHON* variables) with an emptied environment; resource limits set by the child
itself before any untrusted code runs (address space, CPU seconds, file size, no core dumps); an
audit hook that refuses sockets, subprocesses, ``os.system``/``exec``/``fork`` and ``ctypes``; a wall
clock limit enforced by the parent, which kills the whole process group. The child reports through
stdout with a per-run random marker the code under test does not see in its namespace.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any

from pipeline.scorers.base import NOT_APPLICABLE, ScorerOutcome, TurnContext, fenced_blocks
from pipeline.scorers.config import PythonTestsScorer

# Runs in the child (``python -I -c RUNNER``). argv: memory bytes, cpu seconds. stdin: the marker.
# The job logic, shared by the one-off runner and the fork server's children. It runs after the
# limits are set and before any untrusted code: block sockets and process creation, exec the solution,
# then the tests, and report behind ``marker`` (a local the code under test does not get in its namespace).
JOB = r"""
def _run(marker, out_fd):
    import json, os, socket, sys, traceback, types
    write, dumps = os.write, json.dumps
    blocked = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
               "os.forkpty", "pty.", "ctypes.")

    def guard(event, args):
        if event.startswith(blocked):
            raise PermissionError(f"sandbox: {event} is not allowed")

    def no_socket(*args, **kwargs):
        raise PermissionError("sandbox: network access is not allowed")

    socket.socket = socket.create_connection = socket.socketpair = socket.fromfd = no_socket
    sys.addaudithook(guard)
    solution_src = open("solution.py", encoding="utf-8").read()
    tests_src = open("tests.py", encoding="utf-8").read()
    result = {"passed": 0, "total": 1, "failures": []}
    mod = types.ModuleType("solution")
    mod.__file__ = "solution.py"
    sys.modules["solution"] = mod
    try:
        exec(compile(solution_src, "solution.py", "exec"), mod.__dict__)
    except BaseException as exc:
        result["failures"].append("solution: " + "".join(traceback.format_exception_only(exc)).strip())
        write(out_fd, ("\n" + marker + dumps(result) + "\n").encode())
        return
    ns = dict(mod.__dict__)
    ns["__name__"] = "tests"
    try:
        exec(compile(tests_src, "tests.py", "exec"), ns)
        top_error = None
    except BaseException as exc:
        top_error = "tests: " + "".join(traceback.format_exception_only(exc)).strip()
    tests = [(k, v) for k, v in ns.items() if k.startswith("test") and callable(v)
             and getattr(getattr(v, "__code__", None), "co_filename", "") == "tests.py"]
    if top_error or not tests:
        result = {"passed": 0 if top_error else 1, "total": 1, "failures": [top_error] if top_error else []}
    else:
        result = {"passed": 0, "total": len(tests), "failures": []}
        for name, fn in tests:
            try:
                fn()
                result["passed"] += 1
            except BaseException as exc:
                msg = "".join(traceback.format_exception_only(exc)).strip()
                result["failures"].append(f"{name}: {msg}")
    write(out_fd, ("\n" + marker + dumps(result) + "\n").encode())


def _limit(mem, cpu):
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
"""

# One-off child (``python -I -c RUNNER``). argv: memory bytes, cpu seconds. stdin: the marker.
RUNNER = (
    JOB
    + r"""
import sys
_limit(int(sys.argv[1]), int(sys.argv[2]))
_marker = sys.stdin.readline().strip()
sys.stdin.close()
_run(_marker, 1)
"""
)

# Fork server (``python -I -c ZYGOTE``): reads one JSON job per stdin line, forks a fresh child per job
# (its own session, temp dir, limits, audit hook), enforces the wall-clock limit, removes the temp dir
# and answers one JSON line per job. Forking a warm interpreter costs ~1 ms instead of a ~50-100 ms start.
ZYGOTE = (
    JOB
    + r"""
import json, os, secrets, select, shutil, signal, sys, tempfile, time
import socket, traceback, types  # warm for the children

def _serve():
    for line in sys.stdin:
        job = json.loads(line)
        workdir = tempfile.mkdtemp(prefix="ratchet-pytests-")
        with open(os.path.join(workdir, "solution.py"), "w", encoding="utf-8") as fh:
            fh.write(job["code"])
        with open(os.path.join(workdir, "tests.py"), "w", encoding="utf-8") as fh:
            fh.write(job["tests"])
        marker = "@@ratchet-result-" + secrets.token_hex(16) + "@@"
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(r)
                os.setsid()
                os.chdir(workdir)
                os.environ.clear()
                os.environ.update({"PATH": os.defpath, "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir})
                null = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(null, fd)
                _limit(job["memory"], job["cpu"])
                _run(marker, w)
            finally:
                os._exit(0)
        os.close(w)
        deadline = time.monotonic() + job["timeout"]
        chunks, timed_out = [], False
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            ready, _, _ = select.select([r], [], [], left)
            if not ready:
                continue
            data = os.read(r, 65536)
            if not data:
                break
            chunks.append(data)
        if timed_out:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _, status = os.waitpid(pid, 0)
        os.close(r)
        shutil.rmtree(workdir, ignore_errors=True)
        out = b"".join(chunks).decode("utf-8", "replace")
        result = None
        for part in out.splitlines():
            if part.startswith(marker):
                try:
                    result = json.loads(part[len(marker):])
                except ValueError:
                    result = None
        answer = {"id": job["id"], "workdir": workdir, "timed_out": timed_out, "result": result,
                  "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                  "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()

_serve()
"""
)


def extract_code(text: str) -> str:
    """The Python code of an answer: its ```python (or untagged) fenced blocks, else the whole text."""
    blocks = fenced_blocks(text, ("python", "py", "python3"))
    return "\n\n".join(blocks) if blocks else text


class ForkServer:
    """A warm, locked-down interpreter that forks one fresh child per job (see ``ZYGOTE``).

    Thread-safe (one job at a time per server). If the server dies it is restarted on the next job.
    """

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._next = 0

    def _start(self) -> subprocess.Popen:
        env = {"PATH": os.defpath, "LANG": "C.UTF-8", "HOME": tempfile.gettempdir()}
        return subprocess.Popen(
            [sys.executable, "-I", "-c", ZYGOTE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            cwd=tempfile.gettempdir(),
            start_new_session=True,
            close_fds=True,
            text=True,
            bufsize=1,
        )

    def run(self, code: str, tests: str, *, timeout_s: float, memory_mb: int) -> dict[str, Any] | None:
        """The job's answer, or None when the server could not answer (the caller falls back)."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
            self._next += 1
            job = {
                "id": self._next,
                "code": code,
                "tests": tests,
                "timeout": float(timeout_s),
                "memory": memory_mb << 20,
                "cpu": max(1, int(timeout_s) + 1),
            }
            try:
                self._proc.stdin.write(json.dumps(job) + "\n")  # type: ignore[union-attr]
                line = self._proc.stdout.readline()  # type: ignore[union-attr]
            except (BrokenPipeError, OSError):
                line = ""
            if not line:
                self.close()
                return None
            answer = json.loads(line)
            return answer if answer.get("id") == job["id"] else None

    def close(self) -> None:
        if self._proc is not None:
            _kill_group(self._proc.pid)
            self._proc.wait()
            self._proc = None


_SERVERS: dict[int, ForkServer] = {}
_SERVERS_LOCK = threading.Lock()


def _server() -> ForkServer:
    """One fork server per thread of this process (scoring uses a small thread pool)."""
    key = threading.get_ident()
    with _SERVERS_LOCK:
        if key not in _SERVERS:
            _SERVERS[key] = ForkServer()
            if len(_SERVERS) == 1:
                atexit.register(_close_servers)
        return _SERVERS[key]


def _close_servers() -> None:
    for server in list(_SERVERS.values()):
        server.close()


def run_python_tests(code: str, tests: str, *, timeout_s: float, memory_mb: int) -> dict[str, Any]:
    """Run ``code`` then ``tests`` in the sandbox; return ``{passed, total, failures, workdir, ...}``.

    ``tests`` is Python source: every ``test*`` function it defines is one test; without such
    functions the whole source is one test (it passes when it runs without an exception).
    Each run is a fresh process (forked from a warm sandbox server where the OS allows, else started).
    """
    if hasattr(os, "fork"):
        answer = _server().run(code, tests, timeout_s=timeout_s, memory_mb=memory_mb)
        if answer is not None:
            return _interpret(answer, timeout_s)
    return _run_once(code, tests, timeout_s=timeout_s, memory_mb=memory_mb)


def _interpret(answer: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    workdir = answer["workdir"]
    if answer["timed_out"]:
        return {"passed": 0, "total": 1, "failures": [f"timed out after {timeout_s:g}s"], "workdir": workdir}
    result = answer["result"]
    if result is None:
        why = f"exit code {answer['exit']}"
        if answer.get("signal"):
            why = f"killed by signal {signal.Signals(answer['signal']).name}"
        return {"passed": 0, "total": 1, "failures": [f"test run crashed ({why})"], "workdir": workdir}
    return {**result, "workdir": workdir}


def _run_once(code: str, tests: str, *, timeout_s: float, memory_mb: int) -> dict[str, Any]:
    """One sandboxed run in a newly started interpreter (the fallback of the fork server)."""
    workdir = tempfile.mkdtemp(prefix="ratchet-pytests-")
    marker = f"@@ratchet-result-{secrets.token_hex(16)}@@"
    try:
        with open(os.path.join(workdir, "solution.py"), "w", encoding="utf-8") as fh:
            fh.write(code)
        with open(os.path.join(workdir, "tests.py"), "w", encoding="utf-8") as fh:
            fh.write(tests)
        out_path, err_path = os.path.join(workdir, ".stdout"), os.path.join(workdir, ".stderr")
        cpu = max(1, int(timeout_s) + 1)
        env = {"PATH": os.defpath, "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", RUNNER, str(memory_mb << 20), str(cpu)],
                cwd=workdir,
                env=env,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                start_new_session=True,
                close_fds=True,
            )
            timed_out = False
            try:
                proc.stdin.write((marker + "\n").encode())  # type: ignore[union-attr]
                proc.stdin.close()  # type: ignore[union-attr]
            except BrokenPipeError:
                pass
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc.pid)
                proc.wait()
        stdout = _tail(out_path)
        stderr = _tail(err_path)
        if timed_out:
            return {
                "passed": 0,
                "total": 1,
                "failures": [f"timed out after {timeout_s:g}s"],
                "workdir": workdir,
            }
        result = None
        for line in stdout.splitlines():
            if line.startswith(marker):
                try:
                    result = json.loads(line[len(marker) :])
                except json.JSONDecodeError:
                    result = None
        if result is None:
            why = f"exit code {proc.returncode}"
            if proc.returncode < 0:
                why = f"killed by signal {signal.Signals(-proc.returncode).name}"
            last = stderr.strip().splitlines()[-1:] or [""]
            reason = f"test run crashed ({why}) {last[0][:300]}".strip()
            return {"passed": 0, "total": 1, "failures": [reason], "workdir": workdir}
        result["workdir"] = workdir
        return result
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _tail(path: str, limit: int = 64 << 10) -> str:
    with open(path, "rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        fh.seek(max(0, size - limit))
        return fh.read().decode("utf-8", errors="replace")


# The same code against the same tests gives the same result: samples repeat a lot (identical attempts,
# experience re-scored under a new contract version), so results are kept for the life of the process.
_RESULTS: dict[bytes, dict[str, Any]] = {}
_RESULTS_MAX = 200_000


def score_python_tests(cfg: PythonTestsScorer, ctx: TurnContext) -> ScorerOutcome:
    """Fraction of tests passed (or 1/0 without partial credit); None when the trace has no tests."""
    tests = ctx.metadata.get(cfg.tests_field)
    if not isinstance(tests, str) or not tests.strip():
        return NOT_APPLICABLE
    code = extract_code(ctx.text)
    if not code.strip():
        return ScorerOutcome(0.0, "no code in the answer")
    key = hashlib.sha256(f"{cfg.timeout_s}\x00{cfg.memory_mb}\x00{code}\x00{tests}".encode()).digest()
    result = _RESULTS.get(key)
    if result is None:
        result = run_python_tests(code, tests, timeout_s=cfg.timeout_s, memory_mb=cfg.memory_mb)
        if "timed out" not in " ".join(map(str, result.get("failures", []))):  # timing can vary: rerun those
            if len(_RESULTS) >= _RESULTS_MAX:
                _RESULTS.pop(next(iter(_RESULTS)))
            _RESULTS[key] = result
    total = max(1, int(result.get("total", 1)))
    passed = int(result.get("passed", 0))
    value = passed / total if cfg.partial_credit else float(passed == total)
    failures = [str(f)[:300] for f in result.get("failures", [])]
    info = {"passed": passed, "total": total, "workdir": result.get("workdir")}
    return ScorerOutcome(value, "; ".join(failures[:3]) or None, info)
