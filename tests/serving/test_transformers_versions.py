"""The serving decoder and the loop's decoding run on the lowest transformers our ``>=5.0,<6`` pin allows;
the highest, 5.25.0 (the newest 5.x on the package registry when this was written), is the one the project
installs and the rest of the suite runs on. (5.17, the release the serving crash below was reported on, was
covered here before; it names the cache as 5.0 does, and a second install doubled the test's time.)

Between them the KV cache changed name (``past_key_values`` up to 5.17, ``cache`` by 5.25: keyword and
output field; on main the serving decoder passed ``cache=`` and read ``out.cache``, so on 5.17 its first
request failed with ``AttributeError: 'CausalLMOutputWithPast' object has no attribute 'cache'``), and so
did the cache classes' internals (``StaticCache`` layers, row selection): ``decoding.cache_keyword``,
``decoding.kv_cache`` and ``decoding.select_rows`` are the one place each is asked.

Each version is installed from the package registry into a folder of the test's own, with what it needs
that the project's environment holds in a newer release (huggingface-hub < 2; for 5.0: tokenizers <= 0.23.0,
and kernels < 0.11 -- the kernels release 5.25 requires makes 5.0's import fail), ahead of the project's on
``PYTHONPATH``; the runtime's and both decoding loops' own tests then run against it in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOWEST = "5.0.0"
HUB = "huggingface-hub>=1.5,<2"
VERSIONS = {LOWEST: [HUB, "tokenizers==0.22.2", "kernels>=0.10.2,<0.11"]}  # version: what it needs besides
TESTS = [
    "tests/serving/test_runtime.py",
    "tests/test_decoding.py",
    "tests/serving/test_decoder_outputs.py",
    "tests/serving/test_device_decoding.py",
]


@pytest.mark.parametrize("version", list(VERSIONS))
def test_the_decoders_run_on_older_transformers(tmp_path, version):
    pins = VERSIONS[version]
    target = tmp_path / f"transformers-{version}"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
         "--target", str(target), f"transformers=={version}", *pins],
        check=True, timeout=600,
    )  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), str(ROOT), str(ROOT / "tests")])}
    found = subprocess.run(
        [sys.executable, "-c", "import transformers; print(transformers.__version__)"],
        env=env, capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    assert found.stdout.strip() == version
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout


HIGHEST = "5.25.0"  # the newest 5.x on the package registry when this was written


def test_the_rest_of_the_suite_runs_on_the_highest_allowed_transformers():
    """The other end of the pin: the environment ``make install`` builds resolves ``transformers>=5.0,<6`` to
    the newest 5.x, which every other test runs on; an environment held back to an older one fails here."""
    import transformers
    from packaging.version import Version

    installed = Version(transformers.__version__)
    assert Version(HIGHEST) <= installed < Version("6"), installed
