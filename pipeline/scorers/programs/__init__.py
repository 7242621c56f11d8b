"""Programs that run inside the python_tests sandbox (never imported by the host).

A program is sent to a fresh interpreter (``python -I -S -c SOURCE``) as the text of several of these
files in a row (``PROGRAMS``); they use the standard library only, and imports that start fast.

- ``wire.py``: the message format between the two processes of a test run, and resource limits;
- ``solution.py``: runs the model's code and answers calls into it (untrusted: it may do anything);
- ``driver.py``: runs the test code and reports each test's verdict to the host; it never runs the
  model's code, only talks to the solution over a pipe and receives plain data or stand-ins;
- ``run_tests.py``: one assertion-test run: forks the solution's process, then drives the tests;
- ``script.py``: runs the model's code as a program on one I/O case (the host compares its output).
"""

import functools
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROGRAMS = {"tests": ("wire", "solution", "driver", "run_tests"), "script": ("wire", "script")}


@functools.cache
def program_source(program: str) -> str:
    """The source sent to the sandboxed interpreter for ``program`` (a key of ``PROGRAMS``)."""
    return "\n\n".join((HERE / f"{name}.py").read_text(encoding="utf-8") for name in PROGRAMS[program])
