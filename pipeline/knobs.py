"""Described fields of the plain config dataclasses (``ServeConfig``, ``AdvanceConfig``, ``StackConfig``).

Each carries what a pydantic ``Field`` would (a description, bounds) without importing pydantic, because
those classes load with the command line and ``ratchet --help`` must stay fast. ``pipeline.cli.options``
turns such a class into command options: the description is the option's help, the default its default,
the bounds its ``min``/``max``; the class is the one place of all three.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def described(default: Any, description: str, *, ge: float | None = None, le: float | None = None) -> Any:
    """A dataclass field with ``default``, its ``description`` and inclusive bounds (``ge``, ``le``)."""
    bounds = {k: v for k, v in (("ge", ge), ("le", le)) if v is not None}
    return dataclasses.field(default=default, metadata={"description": description, **bounds})
