"""Running code we do not trust: a bubblewrap sandbox whose zygote starts each job in namespaces of its own.

``launcher(mode)`` is the checked ``Launcher`` of a mode (``RATCHET_SANDBOX``: ``bubblewrap`` by default,
or ``process``); ``zygote(launcher)`` lends a zygote that runs one job (see ``launcher`` and ``zygote`` for
what each guarantees). ``bubblewrap`` missing or not working is a ``SandboxUnavailable`` error; nothing
falls back to the weaker mode by itself.
"""

from __future__ import annotations

import functools

from pipeline.sandbox.launcher import (
    SANDBOX_UID,
    Launcher,
    Limits,
    Mode,
    Run,
    SandboxUnavailable,
    build_launcher,
    unavailable,
)
from pipeline.sandbox.zygote import Zygote, ZygoteLost, probe, zygote
from pipeline.settings import get_settings

__all__ = [
    "SANDBOX_UID",
    "Launcher",
    "Limits",
    "Mode",
    "Run",
    "SandboxUnavailable",
    "Zygote",
    "ZygoteLost",
    "launcher",
    "sandbox_problem",
    "zygote",
]


@functools.cache
def _checked(mode: Mode) -> Launcher:
    built = build_launcher(mode)
    problem = probe(built)
    if problem is not None:
        raise unavailable(f"{mode} sandbox does not work here ({problem})")
    return built


def launcher(mode: Mode | None = None) -> Launcher:
    """The launcher of ``mode`` (default: the ``RATCHET_SANDBOX`` setting), tried once per process."""
    if mode is None:
        mode = get_settings().sandbox
    return _checked(mode)


def sandbox_problem(mode: Mode = "bubblewrap") -> str | None:
    """Why ``mode`` cannot run here, or None when it can (for status lines and test skips)."""
    try:
        launcher(mode)
    except SandboxUnavailable as exc:
        return str(exc)
    return None
