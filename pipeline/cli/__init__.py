"""The ``ratchet`` command line. Each sub-module adds its commands to ``app``.

A command's module is imported only when that command runs or shows its own help (``pipeline.cli.app``),
and heavy libraries (torch, mlflow, prefect, transformers) only inside the commands that use them, so
``ratchet --help`` stays fast. A ``RatchetError`` (the user's mistake) is printed as
one line on stderr with a non-zero exit; anything else is our bug and keeps its traceback.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import warnings

import click
import typer

from pipeline.cli.app import COMMANDS, app
from pipeline.errors import RatchetError

try:  # typer >= 0.20 ships its own copy of click; its usage errors do not derive from click's
    from typer._click.exceptions import ClickException as _TyperClickException
except ImportError:  # pragma: no cover - older typer uses click itself
    _TyperClickException = click.ClickException

__all__ = ["app", "main"]


def _register_commands() -> None:
    """Import every command's module (each adds its commands to ``app``); ``main`` imports only the one it runs."""
    for module in dict.fromkeys(module for module, _ in COMMANDS.values()):
        importlib.import_module(module)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``ratchet`` console script."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # The commands draw their own progress bars: no per-file "Loading weights" bars, no INFO line per
    # Prefect task (set these variables to see them again).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # CRITICAL: Prefect logs a failed task's traceback at ERROR, also for a user's mistake that main() prints
    # as one line below (our bugs still reach main() and keep their traceback).
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "CRITICAL")
    # peft asks transformers 5 a question under its old name; nothing the user can act on.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    command = typer.main.get_group(app)  # the commands' modules load when one is resolved
    try:
        rc = command.main(args=argv, prog_name="ratchet", standalone_mode=False)
    except RatchetError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except (click.exceptions.Abort, typer.Abort):
        click.echo("aborted", err=True)
        sys.exit(130)
    except (click.ClickException, _TyperClickException) as exc:  # usage errors: one line, exit 2
        exc.show()
        sys.exit(exc.exit_code)
    except (click.exceptions.Exit, typer.Exit) as exc:
        sys.exit(getattr(exc, "exit_code", 0))
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # SQLite's write lock held past the busy timeout: one line, not a traceback
        from pipeline.loop.lease import (
            held_leases,
        )  # lazy: keeps ratchet --help light
        from pipeline.registry.db import registry_busy  # lazy: keeps ratchet --help light

        busy = registry_busy(exc, ours=frozenset(lease.owner for lease in held_leases()))
        if busy is None:
            raise
        click.echo(f"error: {busy}", err=True)
        sys.exit(busy.exit_code)
    if isinstance(rc, int) and rc:
        sys.exit(rc)
