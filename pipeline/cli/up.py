"""``ratchet up``: the whole single-machine stack in one command (``pipeline.cli.stack``)."""

from __future__ import annotations

import typer

from pipeline.cli.app import app
from pipeline.cli.options import with_config
from pipeline.cli.stack import StackConfig, run_stack


@app.command("up")
@with_config(StackConfig, names={"startup_timeout_s": "--startup-timeout"})
def up_cmd(config: StackConfig) -> None:
    """Start a Prefect server, a process worker per pool (ratchet-cpu, ratchet-gpu), the MLflow UI, the
    dashboard and the server; print their addresses; stop all of it on Ctrl-C or SIGTERM."""
    run_stack(config, echo=typer.echo)
