"""Errors that are the user's mistake (bad input), as opposed to our bugs.

The CLI prints a ``RatchetError`` as one line and exits non-zero; anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations


class RatchetError(Exception):
    """A user's mistake: what went wrong, where, and what was expected, in one line."""

    exit_code: int = 1


class NotFoundError(RatchetError):
    """Something the user named (a file, a generation, a version) does not exist."""


class ConflictError(RatchetError):
    """The request contradicts what is already stored (e.g. a version name reused with new content)."""
