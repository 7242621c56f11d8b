# One job, run by the first process of its own namespaces (bubblewrap mode) or of its own session (process
# mode). That process is trusted and made non-dumpable; the untrusted part of every job runs in a child of
# it, with the limits set before it starts.


def tests_job(code_fd, tests_fd, result_fd, memory, cpu, processes):
    """An assertion-test run: fork the solution's process (it keeps only its two pipe ends and the model's
    code, and never reads the tests or the result descriptor), then read the tests and drive them."""
    import os

    set_limits(memory, cpu, processes)  # noqa: F821 - from wire.py
    make_undumpable()  # noqa: F821 - from kernel.py
    down_r, down_w = os.pipe()
    up_r, up_w = os.pipe()
    if os.fork() == 0:
        try:
            close_all_but({down_r, up_w, code_fd})  # noqa: F821 - from kernel.py
            null = os.open("/dev/null", os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            with os.fdopen(code_fd, "rb") as fh:
                code = fh.read().decode("utf-8", "replace")
            serve(code, down_r, up_w)  # noqa: F821 - from solution.py
        finally:
            os._exit(0)
    for fd in (down_r, up_w, code_fd):
        os.close(fd)
    with os.fdopen(tests_fd, "rb") as fh:
        tests = fh.read().decode("utf-8", "replace")
    drive(tests, down_w, up_r, result_fd)  # noqa: F821 - from driver.py


def script_job(code_fd, stdin_fd, stdout_fd, memory, cpu, processes):
    """One I/O case: the model's code as ``__main__`` in a child of this (trusted) process, with the case's
    input on stdin and its output on stdout; the host compares the output with the expected one, which
    never enters the sandbox. Returns the program's exit status."""
    import os

    make_undumpable()  # noqa: F821 - from kernel.py
    program = os.fork()
    if program == 0:
        status = 1
        try:
            status = _run_script(code_fd, stdin_fd, stdout_fd, memory, cpu, processes)
        finally:
            os._exit(status)
    for fd in (code_fd, stdin_fd, stdout_fd):
        os.close(fd)
    _, wait = os.waitpid(program, 0)
    code = os.waitstatus_to_exitcode(wait)
    return code if 0 <= code < 250 else 128 + (-code & 0x7F)


def _run_script(code_fd, stdin_fd, stdout_fd, memory, cpu, processes):
    import os
    import sys

    with os.fdopen(code_fd, "rb") as fh:
        code = fh.read().decode("utf-8", "replace")
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(stdin_fd, 0)
    os.dup2(stdout_fd, 1)
    os.dup2(null, 2)
    for fd in (stdin_fd, stdout_fd, null):
        os.close(fd)
    set_limits(memory, cpu, processes)  # noqa: F821 - from wire.py
    sys.argv = ["solution.py"]
    status = 0
    try:
        exec(compile(code, "solution.py", "exec"), {"__name__": "__main__", "__file__": "solution.py"})
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - the program failed
        status = 1
    try:
        sys.stdout.flush()
    except BaseException:  # noqa: BLE001 - its output is already what it is
        pass
    return status & 0xFF
