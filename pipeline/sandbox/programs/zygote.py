# The zygote (trusted): a long-lived sandboxed process that starts one job per request. argv: control socket
# fd, "namespaces" or "plain", tmpfs bytes, shm bytes. A request on the control socket is the text
# "tests|script memory cpu processes timeout_ms" with three descriptors (SCM_RIGHTS); the zygote never reads
# what they carry. Per job it forks an entry process that (with "namespaces") enters new user, mount, PID,
# IPC and UTS namespaces and forks the job's PID 1; that process mounts a private /proc, /tmp and /dev/shm,
# drops every capability and runs the job. At the time limit the entry is killed, and with it (parent-death
# signal, then the PID namespace) every process of the job. The reply is "done STATUS" or "timeout".
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


def _start_job(kind, fds, limits):
    """Set up the job's first process and run the job: returns only through os._exit."""
    try:
        if _isolate:
            become_job_init(_tmp_bytes, _shm_bytes)  # noqa: F821 - from kernel.py
        else:
            os.setsid()  # the job's session: what it leaves behind there is killed with it
        job = tests_job if kind == "tests" else script_job  # noqa: F821 - from jobs.py
        job(*fds, *limits)
    finally:
        os._exit(0)


def _entry(kind, fds, limits):
    """With namespaces: the job's entry, which enters them and forks the job's PID 1 (returns only through
    os._exit, with that process's status); without: the job's first process itself."""
    _sock.close()
    if not _isolate:
        _start_job(kind, fds, limits)
    status = 111
    try:
        enter_namespaces()  # noqa: F821 - from kernel.py
        init = os.fork()
        if init == 0:
            _start_job(kind, fds, limits)
        for fd in fds:
            os.close(fd)
        _, wait = os.waitpid(init, 0)
        status = os.waitstatus_to_exitcode(wait)
    finally:
        os._exit(status if 0 <= status < 256 else 128 + (-status & 0x7F))


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
        _entry(_kind, _fds, (_memory, _cpu, _processes))
    for _fd in _fds:
        os.close(_fd)
    _pidfd = os.pidfd_open(_pid)
    _ready, _, _ = select.select([_pidfd], [], [], _timeout_ms / 1000)
    if not _ready:  # over time: the entry, its PID 1 (parent-death signal) and the job's namespaces go
        os.kill(_pid, signal.SIGKILL)
    _, _wait = os.waitpid(_pid, 0)
    os.close(_pidfd)
    if not _isolate:  # without namespaces, what the job left in its session goes with it
        try:
            os.killpg(_pid, signal.SIGKILL)
        except OSError:
            pass
    _reply = "done " + str(os.waitstatus_to_exitcode(_wait)) if _ready else "timeout"
    try:
        _sock.send(_reply.encode())
    except OSError:
        break
