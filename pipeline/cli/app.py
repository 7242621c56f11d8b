"""The ``ratchet`` Typer application; each command module under ``pipeline.cli`` adds its commands to it."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="ratchet",
    help="Ratchet: recursive self-improvement of model-harness pairs under an HCP contract.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
