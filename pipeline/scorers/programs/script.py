# One I/O case (untrusted side). argv: memory_bytes cpu_seconds max_processes code_fd. The model's code
# comes over ``code_fd``; it then runs as ``__main__`` with the case's input on stdin and its output on
# stdout, which the host compares with the expected output (this process never sees it).
import os
import sys

with os.fdopen(int(sys.argv[4]), "rb") as _fh:
    _code = _fh.read().decode("utf-8", "replace")
set_limits(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))  # noqa: F821 - from wire.py
sys.argv = ["solution.py"]
_globals = {"__name__": "__main__", "__file__": "solution.py", "__builtins__": __builtins__}
exec(compile(_code, "solution.py", "exec"), _globals)
