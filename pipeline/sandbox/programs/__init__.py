"""Programs that run inside the python_tests sandbox (never imported by the host).

A program is sent to a fresh interpreter (``python -I -S``, compiled code over a pipe) as the text of
several of these files in a row (``PROGRAMS``); they use the standard library only.

- ``wire.py``: the message format between the two processes of a test run, and resource limits;
- ``kernel.py``: unshare, mount, capabilities and prctl through libc (ctypes), for trusted code only;
- ``solution.py``: runs the model's code and answers calls into it (untrusted: it may do anything);
- ``driver.py``: runs the test code and reports each test's verdict to the host; it never runs the
  model's code, only talks to the solution over a pipe and receives plain data or stand-ins;
- ``jobs.py``: one test run (forks the solution's process, then drives the tests) or one I/O case;
- ``zygote.py``: the long-lived process that starts each job in namespaces of its own.
"""

import functools
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROGRAMS = {"zygote": ("wire", "kernel", "solution", "driver", "jobs", "zygote")}


@functools.cache
def program_source(program: str) -> str:
    """The source sent to the sandboxed interpreter for ``program`` (a key of ``PROGRAMS``)."""
    return "\n\n".join((HERE / f"{name}.py").read_text(encoding="utf-8") for name in PROGRAMS[program])
