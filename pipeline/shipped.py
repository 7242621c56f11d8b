"""The files that ship with the package besides its code: the registry's Alembic migrations and the demo's
contract, harness and model spec. In the repository they are top-level folders (``migrations/``,
``contracts/``, ``harnesses/``, ``models/``); a built wheel carries copies under ``pipeline/_shipped/``
(``setup.py``'s ``build_py``). This module is the one place that finds them: the package's own data when it is
there (an installed wheel), else the checkout beside the package (the editable install used in development).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["DISTRIBUTION", "FOLDERS", "shipped_dir", "demo_specs"]

# The distribution's name on a package index (the import name stays ``pipeline``, the command ``ratchet``).
DISTRIBUTION = "ratchet-lineage"
# Top-level folders of the repository that the wheel carries under ``pipeline/_shipped/``.
FOLDERS = ("migrations", "contracts", "harnesses", "models")
PACKAGED = "_shipped"


def shipped_dir(name: str) -> Path:
    """The directory of the shipped folder ``name`` (one of ``FOLDERS``) as a filesystem path."""
    if name not in FOLDERS:
        raise ValueError(f"{name!r} is not a shipped folder ({', '.join(FOLDERS)})")
    packaged = resources.files("pipeline") / PACKAGED / name
    if packaged.is_dir():
        # a wheel installs into a directory (not a zip), so the resource is a real path; alembic and the spec
        # loaders need one
        return Path(str(packaged))
    checkout = Path(str(resources.files("pipeline"))).parent / name
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError(
        f"the shipped folder {name!r} is neither in the installed package ({packaged}) nor beside it "
        f"({checkout}): reinstall {DISTRIBUTION}"
    )


def demo_specs() -> dict[str, Path]:
    """The demo's contract, harness and model spec files (``ratchet init``'s and ``ratchet demo``'s defaults)."""
    return {
        "contract": shipped_dir("contracts") / "demo.yaml",
        "harness": shipped_dir("harnesses") / "demo.yaml",
        "model": shipped_dir("models") / "tiny.yaml",
    }
