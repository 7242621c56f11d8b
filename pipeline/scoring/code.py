"""The python_tests scorer: the model's code against tests, judged by a process that never runs that code.

``metadata.<tests_field>`` holds the tests, in one of two forms:

- **assertion tests**: Python source; each ``test*`` function it defines is one test (without any, the
  whole source is one test, passed when it runs without an exception). Two sandboxed processes per run
  (``pipeline.sandbox``): the *solution* (``programs/solution.py``) runs the model's code; the *driver*
  (``programs/driver.py``) runs the test code, in which the solution's names are stand-ins whose every
  use becomes a request over a pipe, answered with plain data (builtins only, rebuilt by the driver) or
  another stand-in. The driver reports each test's verdict to this process over a pipe that the
  solution's process has no way to reach, and never executes anything the solution sends: exiting early,
  writing to inherited descriptors, walking frames or patching the harness, the test module or builtins
  all happen in the solution's own process and can only fail tests. The test code never enters the
  solution's sandbox, so the model's code cannot read the expected values.
- **I/O tests**: a list of ``{"stdin": ..., "stdout": ...}`` cases; the model's code runs as a program
  (``programs/script.py``) once per case in a fresh sandbox, and this process compares what it printed
  with the expected output (``io_match``), which never enters the sandbox. A case passes with the right
  output and exit status 0.

A run that passes its wall-clock limit is killed with everything it started (the verdicts reported by
then count; the rest fail). The same code against the same tests under the same limits gives the same
result, so results are kept for the life of the process (timeouts excepted).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import selectors
import time
from collections.abc import Iterator
from typing import Any

from pipeline.sandbox import Launcher, Limits, Zygote, ZygoteLost, launcher, zygote
from pipeline.scoring.context import NOT_APPLICABLE, ScorerOutcome, TurnContext, fenced_blocks
from pipeline.specs.scorers import PythonTestsScorer

MAX_OUTPUT = 1 << 20  # bytes of a program's output that are read (more is a failure)
MAX_RESULTS = 1 << 20  # bytes of verdicts a driver may send
DONE = b'{"done":true}\n'  # the driver's last line
JOB_GRACE_S = 2.0  # beyond a job's time limit, how long the zygote may take to report its end


def extract_code(text: str) -> str:
    """The Python code of an answer: its ```python (or untagged) fenced blocks, else the whole text."""
    blocks = fenced_blocks(text, ("python", "py", "python3"))
    return "\n\n".join(blocks) if blocks else text


def _limits(timeout_s: float, memory_mb: int) -> Limits:
    return Limits(memory_mb=memory_mb, cpu_s=max(1, math.ceil(timeout_s)) + 1)


def _utf8(text: str) -> bytes:
    """Text as UTF-8, lone surrogates included (a model's text may hold them; never a host error)."""
    return text.encode("utf-8", "surrogatepass")


def _send(fd: int, data: bytes, deadline: float) -> bool:
    """Write all of ``data`` to a pipe and close it, giving up at the deadline (a stopped or dead reader
    must never hold the host); True when everything was written."""
    view = memoryview(data)
    try:
        os.set_blocking(fd, False)
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_WRITE)
            while view:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    if left <= 0:
                        return False
                    continue
                try:
                    view = view[os.write(fd, view[:65536]) :]
                except BlockingIOError:
                    continue
        return True
    except (BrokenPipeError, OSError):  # the reader died: the run fails on its own
        return False
    finally:
        os.close(fd)


def run_python_tests(
    code: str, tests: str, *, timeout_s: float, memory_mb: int, sandbox: Launcher | None = None
) -> dict[str, Any]:
    """Run assertion ``tests`` against ``code`` as one sandboxed job: ``{passed, total, failures, timed_out}``.
    Verdicts reported after the time limit do not count."""
    sandbox = sandbox or launcher()
    deadline = time.monotonic() + timeout_s
    (code_r, code_w), (tests_r, tests_w), (results_r, results_w) = os.pipe(), os.pipe(), os.pipe()
    with _job(
        sandbox, "tests", [code_r, tests_r, results_w], [code_w, tests_w, results_r], timeout_s, memory_mb
    ) as z:
        _send(code_w, _utf8(code), deadline)  # a job that cannot read it simply fails
        _send(tests_w, _utf8(tests), deadline)
        try:
            lines, late = _read_until_done(results_r, deadline)
        finally:
            os.close(results_r)
        timed_out = _finish(z, deadline)[0]
    return _verdict(lines, timed_out or late, timeout_s)


@contextlib.contextmanager
def _job(
    sandbox: Launcher, kind: str, theirs: list[int], ours: list[int], timeout_s: float, memory_mb: int
) -> Iterator[Zygote]:
    """A zygote running one job on the child ends ``theirs`` (closed here once handed over); ``ours`` are
    closed when no zygote takes it. A zygote found dead is replaced once."""
    limits = _limits(timeout_s, memory_mb)
    for attempt in (1, 2):
        with zygote(sandbox) as z:
            try:
                z.submit(kind, theirs, limits, timeout_s)
            except ZygoteLost:
                if attempt == 1:
                    continue
                for fd in [*theirs, *ours]:
                    os.close(fd)
                raise
            for fd in theirs:
                os.close(fd)
            yield z
            return


def _finish(z: Zygote, deadline: float) -> tuple[bool, int | None]:
    """(timed out, exit status) of the job. A zygote that stopped answering leaves the verdicts read so far;
    past the deadline that counts as a timeout."""
    try:
        return z.finish(max(0.0, deadline - time.monotonic()) + JOB_GRACE_S)
    except ZygoteLost:
        return time.monotonic() >= deadline, None


def _read_until_done(fd: int, deadline: float) -> tuple[list[bytes], bool]:
    """The driver's lines until its last one, the end of its output, or the deadline (then True)."""
    buffer = b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while DONE not in buffer and len(buffer) <= MAX_RESULTS:
            left = deadline - time.monotonic()
            if left <= 0:
                return buffer.split(b"\n"), True
            if not sel.select(left):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buffer += chunk
    return buffer.split(b"\n"), False


def _verdict(lines: list[bytes], timed_out: bool, timeout_s: float) -> dict[str, Any]:
    total, passed, failures, finished, reported = 1, 0, [], False, 0
    for raw in lines:
        try:
            entry = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(entry, dict):
            continue
        if isinstance(entry.get("total"), int) and entry["total"] > 0:
            total = entry["total"]
        elif "test" in entry:
            reported += 1
            if entry.get("ok") is True:
                passed += 1
            else:
                failures.append(f"{entry.get('test')}: {str(entry.get('error'))[:300]}")
        elif entry.get("done") is True:
            finished = True
    if not finished:
        why = f"timed out after {timeout_s:g}s" if timed_out else "the test run crashed"
        failures.append(f"{why} ({total - reported} of {total} tests without a verdict)")
    return {"passed": min(passed, total), "total": total, "failures": failures, "timed_out": timed_out}


def run_io_tests(
    code: str,
    cases: list[dict[str, Any]],
    *,
    timeout_s: float,
    memory_mb: int,
    match: str = "lines",
    sandbox: Launcher | None = None,
) -> dict[str, Any]:
    """Run ``code`` as a program once per ``{stdin, stdout}`` case, each a job; compare outputs here."""
    sandbox = sandbox or launcher()
    passed, failures, timed_out = 0, [], False
    for i, case in enumerate(cases):
        deadline = time.monotonic() + timeout_s
        (code_r, code_w), (in_r, in_w), (out_r, out_w) = os.pipe(), os.pipe(), os.pipe()
        with _job(sandbox, "script", [code_r, in_r, out_w], [code_w, in_w, out_r], timeout_s, memory_mb) as z:
            _send(code_w, _utf8(code), deadline)  # a program that cannot read it fails the case
            out, late = _exchange(in_w, out_r, _utf8(str(case.get("stdin", ""))), deadline)
            late_job, status = _finish(z, deadline)
        late = late or late_job
        timed_out |= late
        expected = str(case.get("stdout", ""))
        got = out.decode("utf-8", "replace") if out is not None else None
        if late:
            failures.append(f"case {i + 1}: timed out after {timeout_s:g}s")
        elif got is None:
            failures.append(f"case {i + 1}: printed more than {MAX_OUTPUT} bytes")
        elif not same_output(got, expected, match):
            failures.append(f"case {i + 1}: expected {expected[:100]!r}, got {got[:100]!r}")
        elif status != 0:
            failures.append(f"case {i + 1}: exit status {status}")
        else:
            passed += 1
    return {"passed": passed, "total": max(1, len(cases)), "failures": failures, "timed_out": timed_out}


def _exchange(stdin: int, stdout: int, data: bytes, deadline: float) -> tuple[bytes | None, bool]:
    """Feed ``data`` to a program's stdin while reading its stdout until it closes it or the deadline;
    both descriptors are closed here. Returns (output, or None when over ``MAX_OUTPUT``; timed out)."""
    out = bytearray()
    pending = memoryview(data)
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(stdout, selectors.EVENT_READ)
            if pending:
                os.set_blocking(stdin, False)
                sel.register(stdin, selectors.EVENT_WRITE)
            else:
                os.close(stdin)
                stdin = -1
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    return bytes(out), True
                for key, _ in sel.select(left):
                    if key.fd == stdin:
                        try:
                            pending = pending[os.write(stdin, pending[:65536]) :]
                        except BlockingIOError:
                            continue
                        except OSError:  # it stopped reading its input: what it printed still counts
                            pending = pending[:0]
                        if not pending:
                            sel.unregister(stdin)
                            os.close(stdin)
                            stdin = -1
                    else:
                        chunk = os.read(stdout, 65536)
                        if not chunk:
                            sel.unregister(stdout)
                            continue
                        out += chunk
                        if len(out) > MAX_OUTPUT:
                            return None, False
        return bytes(out), False
    finally:
        for fd in (stdin, stdout):
            if fd >= 0:
                os.close(fd)


def same_output(got: str, expected: str, match: str) -> bool:
    """``exact``: the same text; ``lines``: the same lines once trailing spaces and trailing empty lines are
    dropped; ``tokens``: the same whitespace-separated tokens."""
    if match == "exact":
        return got == expected
    if match == "tokens":
        return got.split() == expected.split()
    return [line.rstrip() for line in got.rstrip().splitlines()] == [
        line.rstrip() for line in expected.rstrip().splitlines()
    ]


# Results per (mode, limits, code, tests): samples repeat a lot (identical attempts, experience re-scored
# under a new contract version).
_RESULTS: dict[bytes, dict[str, Any]] = {}
_RESULTS_MAX = 200_000


def score_python_tests(cfg: PythonTestsScorer, ctx: TurnContext) -> ScorerOutcome:
    """Fraction of tests passed (or 1/0 without partial credit); not applicable when the trace has no tests.
    The value verifies the outcome: the tests ran."""
    tests = ctx.certified(cfg, cfg.tests_field)
    io = isinstance(tests, list)
    if io:
        if not tests or not all(isinstance(c, dict) and "stdout" in c for c in tests):
            return ScorerOutcome(
                None, f"metadata.{cfg.tests_field}: expected a list of {{stdin, stdout}} cases"
            )
    elif not isinstance(tests, str) or not tests.strip():
        return NOT_APPLICABLE
    code = extract_code(ctx.text)
    if not code.strip():
        return ScorerOutcome(0.0, "no code in the answer", verified=True)
    sandbox = launcher()  # raises SandboxUnavailable: the scoring run stops with the reason
    spec = json.dumps([sandbox.mode, cfg.timeout_s, cfg.memory_mb, cfg.io_match, code, tests], sort_keys=True)
    key = hashlib.sha256(spec.encode()).digest()
    result = _RESULTS.get(key)
    if result is None:
        if io:
            result = run_io_tests(
                code,
                tests,
                timeout_s=cfg.timeout_s,
                memory_mb=cfg.memory_mb,
                match=cfg.io_match,
                sandbox=sandbox,
            )
        else:
            result = run_python_tests(
                code, tests, timeout_s=cfg.timeout_s, memory_mb=cfg.memory_mb, sandbox=sandbox
            )
        if not result["timed_out"]:  # timing can vary: rerun those
            if len(_RESULTS) >= _RESULTS_MAX:
                _RESULTS.pop(next(iter(_RESULTS)))
            _RESULTS[key] = result
    total = max(1, int(result["total"]))
    passed = int(result["passed"])
    value = passed / total if cfg.partial_credit else float(passed == total)
    failures = [str(f)[:300] for f in result["failures"]]
    info = {"passed": passed, "total": total, "sandbox": sandbox.mode}
    return ScorerOutcome(value, "; ".join(failures[:3]) or None, info, verified=True)
