"""Starting sandboxed Python programs: under bubblewrap, or (explicitly) as plain processes.

``launcher()`` returns the ``Launcher`` for the configured mode (``RATCHET_SANDBOX``):

- ``bubblewrap`` (the default): the program runs under Debian's ``bwrap`` in its own user, PID, network,
  IPC, UTS and mount namespaces: a read-only root made only of ``/usr`` and the Python interpreter's
  installation (the registry, the artifact store, the project source and everything under ``/home``,
  ``/root`` or ``/etc`` are not there, or are hidden under an empty tmpfs where they lie below a bound
  directory), a read-only ``/dev``, a ``/proc`` that shows only its own processes, no network but its
  own loopback, an unprivileged uid (65534; a root host drops to it before ``bwrap`` starts, so the
  kernel enforces ``RLIMIT_NPROC``), no capabilities, a new session (no terminal injection) and an empty
  environment. When ``bwrap`` or the process that started it dies, the kernel kills every process of the
  sandbox's PID namespace. The program run there is the zygote (``pipeline.sandbox.zygote``), which gives
  every job namespaces of its own inside this sandbox.
- ``process``: the same programs as plain processes with resource limits, an emptied environment and
  a temporary work dir (as uid 65534 when the host is root; otherwise as the user, and this process
  then makes itself non-dumpable so they cannot reach its descriptors). They can read what that user
  can read, reach the network and leave processes behind: for trusted data only.

``bwrap`` missing or not working is a ``SandboxUnavailable`` error naming the reason and both ways out;
nothing falls back to the weaker mode by itself. Resource limits are set by the sandboxed programs
themselves (``programs/wire.py``: ``set_limits``) before any untrusted code runs.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pipeline.errors import RatchetError
from pipeline.settings import get_settings

log = logging.getLogger(__name__)

Mode = Literal["bubblewrap", "process"]
SANDBOX_UID = 65534  # "nobody": owns nothing of the host's (a root host drops to it for bubblewrap)
PROCESS_UID = 65533  # what a root host drops to in process mode: never the uid bubblewrap zygotes run as
TMP_BYTES = 16 << 20  # the private /tmp (a tmpfs: memory)
SHM_BYTES = 1 << 20  # /dev/shm; the rest of /dev is read-only


class SandboxUnavailable(RatchetError):
    """No working sandbox for untrusted code: the run stops rather than run it unprotected."""


def unavailable(reason: str) -> SandboxUnavailable:
    return SandboxUnavailable(
        f"model-written code cannot run safely here: {reason}. Install bubblewrap (Debian/Ubuntu: "
        "`apt-get install bubblewrap`), or set RATCHET_SANDBOX=process to run it as plain processes "
        "(no kernel isolation: for trusted data only)"
    )


@dataclass(frozen=True)
class Limits:
    """What one sandboxed process may use (set inside it before untrusted code runs)."""

    memory_mb: int = 256
    cpu_s: int = 6
    # RLIMIT_NPROC inside the sandbox's own user namespace (bubblewrap only): with the per-process memory
    # limit, a run can hold at most processes x memory_mb (no cgroup bounds the sum).
    processes: int = 12

    def argv(self, mode: Mode) -> list[str]:
        # In process mode RLIMIT_NPROC would count every process of the user: 0 leaves it unset.
        return [
            str(self.memory_mb << 20),
            str(self.cpu_s),
            str(self.processes if mode == "bubblewrap" else 0),
        ]


@dataclass
class Run:
    """One started process and what must be cleaned up after it."""

    proc: subprocess.Popen
    workdir: str | None = None

    def close(self) -> None:
        """Kill the process's whole session (and with it the sandbox) and remove its work dir."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


# What the sandboxed interpreter runs first: the program's compiled code, read from the descriptor in argv[1]
# (compiling a 20 kB program in every sandbox would cost more than starting the interpreter).
BOOT = (
    "import marshal,os,sys\nfd=int(sys.argv.pop(1))\nchunks=[]\nwhile True:\n"
    "    chunk=os.read(fd,65536)\n    if not chunk:\n        break\n    chunks.append(chunk)\n"
    "os.close(fd)\ncode=marshal.loads(b''.join(chunks))\ndel marshal,fd,chunks,chunk\nexec(code)"
)
COMPILE = (
    "import marshal,sys;sys.stdout.buffer.write(marshal.dumps(compile(sys.stdin.read(),'sandbox','exec')))"
)


@dataclass(frozen=True)
class Launcher:
    """Starts sandboxed Python programs in one mode (``python -I -S``, the program's code over a pipe)."""

    mode: Mode
    python: str
    binds: tuple[str, ...] = ()  # host directories bound read-only at the same path
    symlinks: tuple[tuple[str, str], ...] = ()  # (target, link) for merged-/usr layouts
    masks: tuple[str, ...] = ()  # paths inside a bound directory hidden under an empty tmpfs
    drop_to: int | None = None  # uid to become before starting (a root host)
    setpriv: str | None = None  # util-linux's setpriv drops to ``drop_to`` (so subprocess can vfork)
    bwrap: str | None = None
    env: dict[str, str] = field(default_factory=lambda: {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})

    def command(self, source: str, args: list[str]) -> list[str]:
        """The command line that runs ``python -I -S -c source args`` in this launcher's sandbox."""
        python = [self.python, "-I", "-S", "-c", source, *args]
        if self.setpriv is not None:
            drop = [
                self.setpriv,
                f"--reuid={self.drop_to}",
                f"--regid={self.drop_to}",
                "--clear-groups",
                "--",
            ]
        else:
            drop = []
        if self.mode == "process":
            return [*drop, *python]
        assert self.bwrap is not None
        # No --disable-userns: the zygote gives each job user, PID, mount and IPC namespaces of its own, and
        # each job then forbids any further one itself (user.max_user_namespaces = 0).
        cmd = [self.bwrap, "--unshare-all", "--unshare-user", "--die-with-parent"]
        cmd += ["--new-session", "--cap-drop", "ALL", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
        cmd += ["--hostname", "sandbox"]
        for path in self.binds:
            cmd += ["--ro-bind", path, path]
        for target, link in self.symlinks:
            cmd += ["--symlink", target, link]
        for path in self.masks:
            cmd += ["--tmpfs", path]
        cmd += ["--proc", "/proc", "--dev", "/dev", "--size", str(SHM_BYTES), "--tmpfs", "/dev/shm"]
        cmd += ["--size", str(TMP_BYTES), "--tmpfs", "/tmp"]
        cmd += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp", "--clearenv"]
        for key, value in {**self.env, "HOME": "/tmp", "TMPDIR": "/tmp"}.items():
            cmd += ["--setenv", key, value]
        return [*drop, *cmd, "--", *python]

    def compile(self, source: str) -> bytes:
        """``source`` compiled by the sandbox's own interpreter (marshalled code object), once per process.
        Our own source, compiled outside any sandbox: nothing untrusted is involved."""
        return _compiled(self.python, source)

    def start(
        self, program: bytes, args: list[str], *, pass_fds: tuple[int, ...] = (), capture_stderr: bool = False
    ) -> Run:
        """Start a compiled program (``compile``) with arguments ``args`` and descriptors ``pass_fds``; its
        stdin and stdout are nothing, its stderr a pipe (``capture_stderr``) or nothing."""
        code_r, code_w = os.pipe()
        try:
            run = self._spawn(
                args=[str(code_r), *args], pass_fds=(code_r, *pass_fds), capture_stderr=capture_stderr
            )
        finally:
            os.close(code_r)
        try:
            view = memoryview(program)
            while view:
                view = view[os.write(code_w, view) :]
        except OSError:  # it died before reading its code; the caller sees it fail
            pass
        finally:
            os.close(code_w)
        return run

    def _spawn(self, *, args: list[str], pass_fds: tuple[int, ...], capture_stderr: bool) -> Run:
        workdir = None
        env = dict(self.env)
        if self.mode == "process":
            workdir = tempfile.mkdtemp(prefix="ratchet-sandbox-")
            if self.drop_to is not None:
                os.chown(workdir, self.drop_to, self.drop_to)
            env.update(HOME=workdir, TMPDIR=workdir)
        drop: dict = {}
        if self.drop_to is not None and self.setpriv is None:
            drop = {"user": self.drop_to, "group": self.drop_to, "extra_groups": []}
        proc = subprocess.Popen(
            self.command(BOOT, args),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE if capture_stderr else subprocess.DEVNULL,
            pass_fds=pass_fds,
            cwd=workdir or "/",
            env=env,
            start_new_session=True,
            **drop,
        )
        return Run(proc, workdir)


def _others_can_use(path: Path) -> bool:
    """Whether a user who owns nothing can reach ``path`` (every directory above it searchable) and read it."""
    path = Path(os.path.realpath(path))
    for parent in path.parents:
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return False
    mode = os.stat(path).st_mode
    return bool(mode & stat.S_IROTH) and (not stat.S_ISDIR(mode) or bool(mode & stat.S_IXOTH))


def _interpreters() -> list[tuple[str, str]]:
    """(interpreter, installation prefix) candidates: this Python's base interpreter first."""
    base = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    out = [(base, os.path.realpath(sys.base_prefix))]
    for path in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(path):
            real = os.path.realpath(path)
            out.append((real, str(Path(real).parent.parent)))
    return out


def _sensitive_paths() -> list[str]:
    """What sandboxed code must never see: the registry, the artifact store, the project source."""

    settings = get_settings()
    paths = [settings.home, settings.artifacts_dir, Path(__file__).resolve().parent.parent]
    url = settings.registry_url
    if url.startswith("sqlite:///"):
        paths.append(Path(url.removeprefix("sqlite:///")).parent)
    return sorted({os.path.realpath(p) for p in paths})


def _layout(prefix: str) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    binds, links = ["/usr"], []
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            links.append((os.readlink(top), top))
        elif os.path.isdir(top):
            binds.append(top)
    if not any(prefix == b or prefix.startswith(b + "/") for b in binds):
        binds.append(prefix)
    return tuple(binds), tuple(links)


def _make_undumpable() -> None:
    """prctl(PR_SET_DUMPABLE, 0) for this process (stdlib has no prctl; ctypes calls libc's)."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:
        raise unavailable("this process could not make itself non-dumpable for process mode")


@functools.cache
def _compiled(python: str, source: str) -> bytes:
    done = subprocess.run(
        [python, "-I", "-S", "-c", COMPILE],
        input=source.encode("utf-8"),
        capture_output=True,
        timeout=60,
        check=True,
    )
    return done.stdout


def build_launcher(mode: Mode) -> Launcher:
    """The launcher of ``mode`` for this host (not yet tried: ``pipeline.sandbox.launcher()`` does that)."""
    root = os.geteuid() == 0
    drop_to = (SANDBOX_UID if mode == "bubblewrap" else PROCESS_UID) if root else None
    usable = [(py, prefix) for py, prefix in _interpreters() if not root or _others_can_use(Path(py))]
    if not usable:
        raise unavailable(f"no Python interpreter that uid {SANDBOX_UID} may read (tried: {_interpreters()})")
    python, prefix = usable[0]
    setpriv = shutil.which("setpriv") if root else None
    if mode == "process":
        if not root:
            # The code runs as this user: without this, it could open this process's descriptors (the
            # driver's result pipe) or memory under /proc. Root drops the code to another uid instead.
            _make_undumpable()
        return Launcher(mode="process", python=python, drop_to=drop_to, setpriv=setpriv)
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise unavailable("bubblewrap is not installed (no `bwrap` on PATH)")
    binds, links = _layout(prefix)
    masks = tuple(
        p
        for p in _sensitive_paths()
        if any(p == b or p.startswith(b + "/") for b in binds) and os.path.isdir(p)
    )
    return Launcher(
        mode="bubblewrap",
        python=python,
        binds=binds,
        symlinks=links,
        masks=masks,
        drop_to=drop_to,
        setpriv=setpriv,
        bwrap=bwrap,
    )
