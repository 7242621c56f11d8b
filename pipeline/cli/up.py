"""``ratchet up``: the whole single-machine stack in one command (``pipeline.cli.stack``)."""

from __future__ import annotations

from typing import Annotated

import typer

from pipeline.cli.app import app
from pipeline.cli.stack import StackConfig


@app.command("up")
def up_cmd(
    host: Annotated[str, typer.Option(help="Interface every part listens on.")] = StackConfig.host,
    prefect_port: Annotated[
        int, typer.Option(min=1, max=65535, help="Prefect server (API and UI).")
    ] = StackConfig.prefect_port,
    mlflow_port: Annotated[int, typer.Option(min=1, max=65535, help="MLflow UI.")] = StackConfig.mlflow_port,
    dashboard_port: Annotated[
        int, typer.Option(min=1, max=65535, help="`ratchet dashboard`.")
    ] = StackConfig.dashboard_port,
    serve_port: Annotated[
        int, typer.Option(min=1, max=65535, help="`ratchet serve` (OpenAI-compatible API).")
    ] = StackConfig.serve_port,
    lineage: Annotated[
        str, typer.Option(help="Lineage the dashboard shows and the server serves.")
    ] = StackConfig.lineage,
    gpu_slots: Annotated[
        int,
        typer.Option(min=1, help="Slots of the global concurrency limit `ratchet-gpu`: GPU steps at once."),
    ] = StackConfig.gpu_slots,
    startup_timeout: Annotated[
        float, typer.Option(min=1, help="Seconds each part may take to answer its health check.")
    ] = StackConfig.startup_timeout_s,
) -> None:
    """Start a Prefect server, a process worker per pool (ratchet-cpu, ratchet-gpu), the MLflow UI, the
    dashboard and the server; print their addresses; stop all of it on Ctrl-C or SIGTERM."""
    from pipeline.cli.stack import run_stack

    config = StackConfig(
        host=host,
        prefect_port=prefect_port,
        mlflow_port=mlflow_port,
        dashboard_port=dashboard_port,
        serve_port=serve_port,
        lineage=lineage,
        gpu_slots=gpu_slots,
        startup_timeout_s=startup_timeout,
    )
    run_stack(config, echo=typer.echo)
