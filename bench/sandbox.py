"""What containment costs: python_tests runs per second, sandboxed, against the plain way to run them.

    python bench/sandbox.py [--jobs 400] [--workers 4]

Each job is a distinct demo coding answer (``def f(x):return x+N``) against its two assertions, run the way
scoring runs them (a thread pool of ``--workers``). Printed: runs per second under bubblewrap (one sandbox
per run: the driver and the solution's process, PID/network/mount namespaces, uid 65534), as plain
processes (``RATCHET_SANDBOX=process``), and the baseline a user would write without any of this -- one
``python -I -c`` subprocess per run with the code and the tests pasted together (no isolation, and a
verdict the code itself could forge) -- with the ratio of each to the baseline.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.sandbox import launcher, sandbox_problem  # noqa: E402
from pipeline.scoring.code import run_python_tests  # noqa: E402


def jobs(n: int) -> list[tuple[str, str]]:
    return [(f"def f(x):return x+{i}", f"assert f(0)=={i}\nassert f(7)=={i + 7}\n") for i in range(n)]


def plain(code: str, tests: str) -> bool:
    done = subprocess.run([sys.executable, "-I", "-c", code + "\n" + tests], capture_output=True, timeout=10)
    return done.returncode == 0


def rate(fn, work: list[tuple[str, str]], workers: int) -> tuple[float, int]:
    fn(*work[0])  # warm: the sandbox's probe and compiled programs
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        passed = sum(bool(r) for r in pool.map(lambda job: fn(*job), work))
    return len(work) / (time.perf_counter() - started), passed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=400)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    work = jobs(args.jobs)
    baseline, ok = rate(plain, work, args.workers)
    print(f"baseline (python -I -c per run, no isolation): {baseline:.1f} runs/s ({ok}/{len(work)} passed)")
    for mode in ("bubblewrap", "process"):
        if mode == "bubblewrap" and sandbox_problem(mode):
            print(f"{mode}: unavailable ({sandbox_problem(mode)})")
            continue
        box = launcher(mode)

        def run(code: str, tests: str, box=box) -> bool:
            result = run_python_tests(code, tests, timeout_s=5, memory_mb=256, sandbox=box)
            return result["passed"] == result["total"]

        per_s, ok = rate(run, work, args.workers)
        print(f"{mode}: {per_s:.1f} runs/s ({ok}/{len(work)} passed): {per_s / baseline:.2f}x the baseline")


if __name__ == "__main__":
    main()
