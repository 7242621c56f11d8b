"""Packaging beyond pyproject.toml: the wheel carries the repository's top-level ``migrations/``,
``contracts/``, ``harnesses/`` and ``models/`` folders as package data under ``pipeline/_shipped/``
(``pipeline.shipped`` finds them there, or in the checkout for an editable install). They stay top-level in
the repository, where Alembic's tooling and the README expect them; setuptools' ``package-dir`` mapping would
make each one an importable package of its own, so they are copied at build time instead."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
FOLDERS = ("migrations", "contracts", "harnesses", "models")  # = pipeline.shipped.FOLDERS (checked by a test)


class BuildWithShippedFolders(build_py):
    """``build_py`` that also copies the shipped folders into the built package (not for an editable install,
    which reads them from the checkout)."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for name in FOLDERS:
            target = Path(self.build_lib) / "pipeline" / "_shipped" / name
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(HERE / name, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


setup(cmdclass={"build_py": BuildWithShippedFolders})
