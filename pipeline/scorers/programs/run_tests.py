# One assertion-test run. argv: memory_bytes cpu_seconds max_processes code_fd result_fd; stdin: the tests.
# Before anything untrusted runs: the limits are set, this process becomes non-dumpable (the solution's
# process, same uid, can then neither trace it nor open its memory or descriptors under /proc), and it
# forks the solution's process, which keeps only its two pipe ends and the model's code and reads neither
# stdin (the tests) nor the result descriptor. Only then does this process read the tests and drive them.
import os
import sys

set_limits(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))  # noqa: F821 - from wire.py
_code_fd, _result_fd = int(sys.argv[4]), int(sys.argv[5])
make_undumpable()  # noqa: F821 - from wire.py
_down_r, _down_w = os.pipe()
_up_r, _up_w = os.pipe()
if os.fork() == 0:
    os.close(_down_w)
    os.close(_up_r)
    os.close(_result_fd)
    _null = os.open("/dev/null", os.O_RDWR)
    for _fd in (0, 1, 2):
        os.dup2(_null, _fd)
    with os.fdopen(_code_fd, "rb") as _fh:
        _code = _fh.read().decode("utf-8", "replace")
    try:
        serve(_code, _down_r, _up_w)  # noqa: F821 - from solution.py
    finally:
        os._exit(0)
os.close(_down_r)
os.close(_up_w)
os.close(_code_fd)
drive(sys.stdin.buffer.read().decode("utf-8", "replace"), _down_w, _up_r, _result_fd)  # noqa: F821
