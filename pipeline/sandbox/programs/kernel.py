# The kernel calls the sandbox's own programs need and Python's standard library lacks (unshare, mount,
# capabilities, prctl), through libc with ctypes. Only trusted code calls them, before any untrusted code runs.
import ctypes
import os

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID = 0x10000000, 0x20000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
_LIBC = ctypes.CDLL(None, use_errno=True)


def _check(rc, what):
    if rc != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, what + ": " + os.strerror(errno))


def prctl(option, value):
    _check(_LIBC.prctl(option, value, 0, 0, 0), "prctl " + str(option))


def make_undumpable():
    """Processes of the same uid can no longer trace this one or open its memory and descriptors."""
    prctl(PR_SET_DUMPABLE, 0)


def make_dumpable():
    """Undo ``make_undumpable`` (a process must be dumpable to write its own uid map)."""
    prctl(PR_SET_DUMPABLE, 1)


def _write(path, text):
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def enter_namespaces():
    """New user, mount, PID, IPC and UTS namespaces for this process (the next fork is PID 1 of the new
    PID namespace); this user keeps its uid and gid inside, with no other uid mapped."""
    uid, gid = os.getuid(), os.getgid()
    _check(_LIBC.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", str(uid) + " " + str(uid) + " 1")
    _write("/proc/self/gid_map", str(gid) + " " + str(gid) + " 1")


def _mount(source, target, fstype, flags, data=None):
    enc = [None if x is None else x.encode() for x in (source, target, fstype, data)]
    _check(_LIBC.mount(enc[0], enc[1], enc[2], flags, enc[3]), "mount " + target)


def become_job_init(tmp_bytes, shm_bytes):
    """As PID 1 of the new namespaces: die with the parent, see only this job's processes in /proc, get a
    private /tmp and /dev/shm, forbid further user namespaces, then give up every capability for good."""
    prctl(PR_SET_PDEATHSIG, 9)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=" + str(tmp_bytes) + ",mode=1777")
    _mount(
        "tmpfs",
        "/dev/shm",
        "tmpfs",
        MS_NOSUID | MS_NODEV | MS_NOEXEC,
        "size=" + str(shm_bytes) + ",mode=1777",
    )
    _write("/proc/sys/user/max_user_namespaces", "0")
    for cap in range(64):  # the bounding set: nothing can be regained through an exec
        if _LIBC.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # past the last capability this kernel knows

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [
            ("effective", ctypes.c_uint32),
            ("permitted", ctypes.c_uint32),
            ("inheritable", ctypes.c_uint32),
        ]

    _check(_LIBC.capset(ctypes.byref(Header(0x20080522, 0)), (Data * 2)()), "capset")
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    os.chdir("/tmp")


def close_all_but(keep):
    """Close every descriptor of this process except ``keep``."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


# Syscalls a job never needs and that reach outside the limits or other processes: memory that no rlimit
# counts (memfd), kernel keyrings (shared by every process of the uid, so by concurrent jobs), io_uring,
# userfaultfd, perf and bpf, tracing and another process's memory or descriptors.
_DENIED = {
    # machine: (audit arch, x32 numbers to refuse, syscall numbers)
    "x86_64": (
        0xC000003E,
        True,
        (101, 310, 311, 312, 319, 321, 323, 298, 248, 249, 250, 425, 426, 427, 438, 447),
    ),
    "aarch64": (
        0xC00000B7,
        False,
        (117, 270, 271, 272, 279, 280, 282, 241, 217, 218, 219, 425, 426, 427, 438, 447),
    ),
}


def deny_syscalls():
    """Install a seccomp filter (this process and its children, for good) refusing ``_DENIED`` with EPERM,
    and every syscall made through another ABI (i386 or x32). Raises on a machine it has no table for."""
    import struct

    machine = os.uname().machine
    if machine not in _DENIED:
        raise OSError(0, "no syscall table for " + machine)
    arch, x32, numbers = _DENIED[machine]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    body = [(ld, 0, 0, 4), ("jeq-arch", arch), (ld, 0, 0, 0)]  # seccomp_data: nr at 0, arch at 4
    if x32:
        body.append(("jge-deny", 0x40000000))
    body += [("jeq-deny", n) for n in numbers]
    deny = len(body) + 1  # the instruction after the final "allow"
    program = []
    for i, item in enumerate(body):
        if item[0] == "jeq-arch":  # another ABI: refused
            program.append(struct.pack("HBBI", jeq, 0, deny - (i + 1), item[1]))
        elif item[0] in ("jeq-deny", "jge-deny"):
            program.append(
                struct.pack("HBBI", jge if item[0] == "jge-deny" else jeq, deny - (i + 1), 0, item[1])
            )
        else:
            program.append(struct.pack("HBBI", *item))
    program.append(struct.pack("HBBI", ret, 0, 0, 0x7FFF0000))  # SECCOMP_RET_ALLOW
    program.append(struct.pack("HBBI", ret, 0, 0, 0x00050000 | 1))  # SECCOMP_RET_ERRNO | EPERM
    buffer = ctypes.create_string_buffer(b"".join(program))

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prctl(PR_SET_NO_NEW_PRIVS, 1)
    _check(_LIBC.prctl(22, 2, ctypes.byref(Program(len(program), ctypes.addressof(buffer))), 0, 0), "seccomp")
