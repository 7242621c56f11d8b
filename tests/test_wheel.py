"""A built wheel, installed (not editable) into a fresh virtualenv outside the checkout, runs the commands from a
directory outside the checkout: every file it needs besides its code (the migrations, the demo's contract,
harness and model spec) ships inside it.

The new virtualenv gets the wheel only (``--no-deps``); the development venv's dependencies are made visible by
a ``.pth`` line naming its site-packages. A directory added that way is not scanned for ``.pth`` files, so
the development venv's editable ``pipeline`` finder is never installed: ``pipeline`` is imported from the
wheel (checked). Nothing is downloaded: the wheel is built offline without build isolation."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import httpx
import pytest
from smalllineage import ADVANCE_ARGS, write_small_specs

from pipeline.shipped import FOLDERS, PACKAGED

ROOT = Path(__file__).resolve().parent.parent
# what a source distribution holds (MANIFEST.in): the wheel is built from a copy of these, so the build's
# scratch files (build/, *.egg-info) never land in the checkout
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "flows.py", "pipeline", *(
    "migrations", "contracts", "harnesses", "models"))  # fmt: skip


def build_wheel(tmp: Path) -> Path:
    src, dist = tmp / "src", tmp / "dist"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["-w", str(dist), str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = dist.glob("*.whl")
    return wheel


def install_wheel(wheel: Path, venv: Path) -> Path:
    """A fresh venv with the wheel installed and the development venv's packages visible; its bin folder."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index"]
        + [str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(purelib) / "ratchet-dev-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv / "bin"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Installed:
    """The wheel's ``ratchet`` run from ``cwd`` (outside the checkout) with the default home ``./.ratchet``."""

    def __init__(self, bin_dir: Path, cwd: Path):
        self.bin, self.cwd = bin_dir, cwd
        self.env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("RATCHET_") and k not in ("PYTHONPATH", "MLFLOW_TRACKING_URI", "VIRTUAL_ENV")
        }
        self.env.update(
            OMP_NUM_THREADS="1",
            RATCHET_DEVICE="cpu",
            RATCHET_SANDBOX=os.environ.get("RATCHET_SANDBOX", "bubblewrap"),
            PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        )

    def python(self, code: str) -> str:
        out = subprocess.run(
            [str(self.bin / "python"), "-c", code], cwd=self.cwd, env=self.env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    def run(self, *args: str, ok: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        out = subprocess.run(
            [str(self.bin / "ratchet"), *args],
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if ok:
            assert out.returncode == 0, f"ratchet {' '.join(args)}:\n{out.stdout}\n{out.stderr}"
        return out

    def start(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(
            [str(self.bin / "ratchet"), *args],
            cwd=self.cwd,
            env={**self.env, "RATCHET_API_KEY": "k"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )


def wait_for(proc: subprocess.Popen, url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{url} did not answer within {timeout:.0f} s"
        time.sleep(0.2)


def stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    tmp = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(tmp)
    names = set(zipfile.ZipFile(wheel).namelist())
    assert wheel.name.startswith("ratchet_lineage-"), wheel.name
    for folder in FOLDERS:  # setup.py copies the folders pipeline.shipped reads
        shipped = {n.split("/", 3)[3] for n in names if n.startswith(f"pipeline/{PACKAGED}/{folder}/")}
        assert shipped == {
            p.relative_to(ROOT / folder).as_posix()
            for p in (ROOT / folder).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        }, folder
    assert "flows.py" in names and "pipeline/dashboard/templates/base.html" in names
    work = tmp / "work"
    work.mkdir()
    return Installed(install_wheel(wheel, tmp / "venv"), work)


@pytest.mark.timeout(900)
def test_the_installed_wheel_runs_the_commands_outside_the_checkout(installed):
    env = installed
    where = env.python("import pipeline, flows; print(pipeline.__file__); print(flows.__file__)").splitlines()
    venv = env.bin.parent.resolve()
    assert all(Path(p).resolve().is_relative_to(venv) for p in where), where  # not the editable checkout
    assert not Path(where[0]).resolve().is_relative_to(ROOT)

    # no home here yet: a registry command says where it would be and how to make it, and makes nothing
    home = env.cwd / ".ratchet"
    missing = env.run("lineage", ok=False)
    assert missing.returncode != 0 and "ratchet init" in missing.stderr and str(home) in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1, missing.stderr
    assert not home.exists()

    # init on the shipped demo specs (found inside the wheel), then the registry commands
    assert "created generation 0" in env.run("init").stdout and home.is_dir()
    assert "registry at revision" in env.run("db", "upgrade").stdout
    assert "at revision" in env.run("db", "current").stdout
    assert "main" in env.run("lineage").stdout

    # a small lineage beside it: ingest, advance one generation, look at it
    specs = write_small_specs(env.cwd / "specs")
    small = ("--lineage", "small")
    env.run("init", "--model", str(specs["model"]), "--contract", str(specs["contract"]), *small)
    assert "stored" in env.run("ingest", str(specs["feedback"]), "--source", "deployment", *small).stdout
    env.run("advance", *ADVANCE_ARGS, *small)
    assert "lineage small" in env.run("lineage", *small).stdout

    # serve the trained generation (its adapter loaded): one chat turn
    port = free_port()
    server = env.start("serve", "--port", str(port), "--threads", "1", "--generation", "1", *small)
    try:
        wait_for(server, f"http://127.0.0.1:{port}/health")
        answer = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            headers={"Authorization": "Bearer k"},
            json={"model": "ratchet", "messages": [{"role": "user", "content": "12+35=?"}], "max_tokens": 4},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["role"] == "assistant"
    finally:
        out = stop(server)
    assert "Application shutdown complete" in out, out

    # the dashboard: its templates come from the wheel
    port = free_port()
    board = env.start("dashboard", "--port", str(port), *small)
    try:
        wait_for(board, f"http://127.0.0.1:{port}/")
        page = httpx.get(f"http://127.0.0.1:{port}/", timeout=30)
        assert page.status_code == 200 and "small" in page.text
    finally:
        stop(board)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_installed_wheel_runs_the_demo(installed, tmp_path):
    """``ratchet demo`` from the wheel (its shipped specs; the tiny base build alone takes many minutes)."""
    env = Installed(installed.bin, tmp_path / "demo")
    env.cwd.mkdir()
    out = env.run("demo", "--generations", "1", "--prompts", "48", "--samples", "1", timeout=3500)
    assert "demo finished" in out.stdout and (env.cwd / ".ratchet" / "registry.db").is_file()
