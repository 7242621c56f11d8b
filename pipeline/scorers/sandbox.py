"""The python_tests scorer: run model-written code against test code in a locked-down subprocess.

Isolation, layer by layer: a fresh temporary working directory (removed afterwards); ``python -I``
(no user site, no PYTHON* variables) with an emptied environment; resource limits set by the child
itself before any untrusted code runs (address space, CPU seconds, file size, no core dumps); an
audit hook that refuses sockets, subprocesses, ``os.system``/``exec``/``fork`` and ``ctypes``; a wall
clock limit enforced by the parent, which kills the whole process group. The child reports through
stdout with a per-run random marker the code under test does not see in its namespace.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Any

from pipeline.scorers.base import NOT_APPLICABLE, ScorerOutcome, TurnContext, fenced_blocks
from pipeline.scorers.config import PythonTestsScorer

# Runs in the child (``python -I -c RUNNER``). argv: memory bytes, cpu seconds. stdin: the marker.
RUNNER = r"""
import sys, resource
_mem, _cpu = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (_mem, _mem))
resource.setrlimit(resource.RLIMIT_CPU, (_cpu, _cpu))
resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

def _run():
    import json, os, socket, traceback, types
    marker = sys.stdin.readline().strip()
    sys.stdin.close()
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
        write(1, ("\n" + marker + dumps(result) + "\n").encode())
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
    write(1, ("\n" + marker + dumps(result) + "\n").encode())

_run()
"""


def extract_code(text: str) -> str:
    """The Python code of an answer: its ```python (or untagged) fenced blocks, else the whole text."""
    blocks = fenced_blocks(text, ("python", "py", "python3"))
    return "\n\n".join(blocks) if blocks else text


def run_python_tests(code: str, tests: str, *, timeout_s: float, memory_mb: int) -> dict[str, Any]:
    """Run ``code`` then ``tests`` in the sandbox; return ``{passed, total, failures, workdir, ...}``.

    ``tests`` is Python source: every ``test*`` function it defines is one test; without such
    functions the whole source is one test (it passes when it runs without an exception).
    """
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


def score_python_tests(cfg: PythonTestsScorer, ctx: TurnContext) -> ScorerOutcome:
    """Fraction of tests passed (or 1/0 without partial credit); None when the trace has no tests."""
    tests = ctx.metadata.get(cfg.tests_field)
    if not isinstance(tests, str) or not tests.strip():
        return NOT_APPLICABLE
    code = extract_code(ctx.text)
    if not code.strip():
        return ScorerOutcome(0.0, "no code in the answer")
    result = run_python_tests(code, tests, timeout_s=cfg.timeout_s, memory_mb=cfg.memory_mb)
    total = max(1, int(result.get("total", 1)))
    passed = int(result.get("passed", 0))
    value = passed / total if cfg.partial_credit else float(passed == total)
    failures = [str(f)[:300] for f in result.get("failures", [])]
    info = {"passed": passed, "total": total, "workdir": result.get("workdir")}
    return ScorerOutcome(value, "; ".join(failures[:3]) or None, info)
