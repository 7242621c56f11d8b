"""The ``ratchet`` Typer application; each command module under ``pipeline.cli`` adds its commands to it.

A command module is imported only when one of its commands runs or shows its own ``--help``: ``ratchet
--help`` lists every command from ``COMMANDS`` (name -> module, the first paragraph of its help) without
importing any of them (``tests/test_imports.py`` checks the table against the commands themselves).
"""

from __future__ import annotations

import importlib
from difflib import get_close_matches
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

# name -> (module that adds it to ``app``, first paragraph of its help); in the order ``--help`` lists them
COMMANDS: dict[str, tuple[str, str]] = {
    "lineage": (
        "pipeline.cli.advance",
        "Show every generation: parent, status, harness, adapters, held-out scores and the decision.",
    ),
    "advance": (
        "pipeline.cli.advance",
        "Build the next generation(s) from the champion; promote each only if it beats its parent.",
    ),
    "promote": (
        "pipeline.cli.advance",
        "Make GENERATION the champion by hand (audited); refused when it makes no sense.",
    ),
    "rollback": ("pipeline.cli.advance", "Retire the champion and restore its parent (audited)."),
    "abandon": (
        "pipeline.cli.advance",
        "Fail the lineage's in-flight candidate (audited); the next `ratchet advance` starts a new one.",
    ),
    "sync-aliases": (
        "pipeline.cli.advance",
        "Point MLflow's `champion` aliases at the registry's champion (after MLflow was unreachable).",
    ),
    "demo": (
        "pipeline.cli.advance",
        "The whole loop on embedded defaults: build the tiny base, register generation 0, advance, show the "
        "lineage.",
    ),
    "init": (
        "pipeline.cli.core",
        "Create the home (RATCHET_HOME) if needed, register a contract, harness and base model, and create\n"
        "generation 0 (the first champion).",
    ),
    "ingest": (
        "pipeline.cli.core",
        "Stream traces into the registry; malformed lines are quarantined with their line number and reason.\n"
        "Ingest is the operator's trusted path: the traces' metadata, ratings and corrections count as given.",
    ),
    "score": (
        "pipeline.cli.core",
        "Score every unscored trace under a contract version; earlier versions' scores are kept.",
    ),
    "dashboard": (
        "pipeline.cli.dashboard",
        "See the lineage, each generation's evidence and the experience behind it in a browser.",
    ),
    "serve": (
        "pipeline.cli.serve",
        "Serve a generation: route each turn to one specialist, answer, record it as experience.",
    ),
    "up": (
        "pipeline.cli.up",
        "Start a Prefect server, a process worker per pool (ratchet-cpu, ratchet-gpu), the MLflow UI, the\n"
        "dashboard and the server; print their addresses; stop all of it on Ctrl-C or SIGTERM.",
    ),
    "contract": (
        "pipeline.cli.contract",
        "HCP contracts, harnesses and model specs: lint, JSON Schemas, dry-run scoring.",
    ),
    "db": ("pipeline.cli.core", "Create, upgrade or downgrade the registry's schema (Alembic migrations)."),
    "keys": (
        "pipeline.cli.keys",
        "API keys of `ratchet serve`: each key is a principal with scopes (chat, certify, rate, correct, admin).",
    ),
}


class LazyGroup(TyperGroup):
    """The top-level group: lists ``COMMANDS`` from the table, imports a command's module when it is resolved."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.suggest_commands = (
            False  # typer would suggest from the loaded commands only: see resolve_command
        )

    def list_commands(self, ctx: Any) -> list[str]:
        return list(dict.fromkeys([*COMMANDS, *self.commands]))

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        """The loaded command, or (for listing) a stand-in with the table's help; ``resolve_command`` loads."""
        if cmd_name in self.commands:
            return self.commands[cmd_name]
        if cmd_name in COMMANDS:
            return TyperCommand(cmd_name, help=COMMANDS[cmd_name][1])
        return None

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        name = args[0] if args else None
        if name in COMMANDS and name not in self.commands:
            self.commands[name] = load_command(name)
        try:
            return super().resolve_command(ctx, args)
        except Exception as exc:  # "No such command": suggest from every command, loaded or not
            message = getattr(exc, "message", None)
            matches = (
                get_close_matches(name, self.list_commands(ctx)) if name and isinstance(message, str) else []
            )
            if matches:
                exc.message = f"{message.rstrip('.')}. Did you mean {', '.join(repr(m) for m in matches)}?"
            raise


def load_command(name: str) -> Any:
    """Import the module of command ``name`` (it adds itself to ``app``) and return its click command."""
    importlib.import_module(COMMANDS[name][0])
    command = typer.main.get_group(app).commands.get(name)
    if command is None:
        raise RuntimeError(
            f"{COMMANDS[name][0]} does not define the command {name!r} (pipeline.cli.app.COMMANDS)"
        )
    return command


app = typer.Typer(
    name="ratchet",
    help="Ratchet: recursive self-improvement of model-harness pairs under an HCP contract.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=LazyGroup,
)
