# The zygote (trusted): a long-lived sandboxed process that starts one job per request. argv: control socket
# fd, "namespaces" or "plain", tmpfs bytes, shm bytes. A request on the control socket is the text
# "tests|script memory cpu processes timeout_ms" with three descriptors (SCM_RIGHTS); the zygote never reads
# what they carry. Per job it forks an entry process that (with "namespaces") enters new user, mount, PID,
# IPC and UTS namespaces and forks the job's PID 1: trusted code that mounts a private /proc, /tmp and
# /dev/shm, drops every capability, starts a session of its own (no signal of the job reaches the zygote or
# the entry), refuses a few syscalls for good (kernel.deny_syscalls) and runs the job, whose untrusted part
# always runs in a child of it. The entry enforces the
# time limit by killing PID 1 -- which takes every process of the job's PID namespace with it -- and reports
# once PID 1 is gone, that is once the namespace is empty. The reply is "done STATUS", "timeout" or, when
# even the entry had to be killed, "lost" (the host then retires this zygote).
import os
import select
import signal
import socket
import sys

_sock = socket.socket(fileno=int(sys.argv[1]))
_isolate = sys.argv[2] == "namespaces"
_tmp_bytes, _shm_bytes = int(sys.argv[3]), int(sys.argv[4])
_null = os.open("/dev/null", os.O_RDWR)
for _fd in (0, 1):
    os.dup2(_null, _fd)
TIMED_OUT = 250  # the entry's exit status when it had to kill the job
BACKSTOP_S = 5.0  # beyond the limit, how long the entry itself may take


def _start_job(kind, fds, limits):
    """The job's PID 1 (trusted): set up, then run the job; returns only through os._exit."""
    try:
        if _isolate:
            become_job_init(_tmp_bytes, _shm_bytes)  # noqa: F821 - from kernel.py
        os.setsid()
        deny_syscalls()  # noqa: F821 - from kernel.py
        job = tests_job if kind == "tests" else script_job  # noqa: F821 - from jobs.py
        os._exit(job(*fds, *limits) or 0)
    finally:
        os._exit(111)


def _wait(pid, timeout_s):
    """(exit status, timed out) of a child, killing it at the limit."""
    pidfd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([pidfd], [], [], max(0.0, timeout_s))
    finally:
        os.close(pidfd)
    if not ready:
        os.kill(pid, signal.SIGKILL)
    _, wait = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(wait), not ready


def _entry(kind, fds, limits, timeout_s):
    """Enter the job's namespaces, fork its PID 1, enforce the limit; exits with PID 1's status (or
    TIMED_OUT), only after PID 1 -- and with it the whole job -- is gone."""
    status = 111
    try:
        _sock.close()
        if _isolate:
            make_dumpable()  # noqa: F821 - from kernel.py (a non-dumpable process cannot write its uid map)
            enter_namespaces()  # noqa: F821 - from kernel.py
        init = os.fork()
        if init == 0:
            _start_job(kind, fds, limits)
        for fd in fds:
            os.close(fd)
        code, late = _wait(init, timeout_s)
        if not _isolate:  # without namespaces, what the job left in its session goes with it
            try:
                os.killpg(init, signal.SIGKILL)
            except OSError:
                pass
        status = TIMED_OUT if late else code if 0 <= code < TIMED_OUT else 128 + (-code & 0x7F)
    finally:
        os._exit(status)


make_undumpable()  # noqa: F821 - from kernel.py: no process of this uid may trace the zygote
while True:
    try:
        _message, _fds, _, _ = socket.recv_fds(_sock, 256, 3)
    except OSError:
        break
    if not _message:
        break
    _kind, *_numbers = _message.decode().split()
    _memory, _cpu, _processes, _timeout_ms = (int(x) for x in _numbers)
    _pid = os.fork()
    if _pid == 0:
        _entry(_kind, _fds, (_memory, _cpu, _processes), _timeout_ms / 1000)
    for _fd in _fds:
        os.close(_fd)
    _status, _lost = _wait(_pid, _timeout_ms / 1000 + BACKSTOP_S)
    _reply = "lost" if _lost else "timeout" if _status == TIMED_OUT else "done " + str(_status)
    try:
        _sock.send(_reply.encode())
    except OSError:
        break
