"""``ratchet serve``: the generation as an OpenAI-compatible Mixture-of-LoRA server."""

from __future__ import annotations

from typing import Annotated

import typer

from pipeline.cli.app import app
from pipeline.errors import RatchetError


@app.command("serve")
def serve(
    generation: Annotated[
        str, typer.Option(help="`champion` (follows promotions live) or a generation number.")
    ] = "champion",
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    lineage: Annotated[str, typer.Option(help="Lineage whose generation is served.")] = "main",
    engine: Annotated[
        str, typer.Option(help="`embedded` (transformers + peft in this process) or `external`.")
    ] = "embedded",
    engine_url: Annotated[
        str | None, typer.Option(help="External OpenAI-compatible multi-LoRA server (vLLM, SGLang).")
    ] = None,
    engine_model: Annotated[
        str, typer.Option(help="External engine's model name per adapter; fields {specialist} {generation}.")
    ] = "{specialist}",
    max_batch_size: Annotated[int, typer.Option(min=1, help="Rows per mixed-adapter batch.")] = 32,
    max_wait_ms: Annotated[float, typer.Option(min=0, help="How long a batch waits to fill.")] = 5.0,
    poll_seconds: Annotated[
        float, typer.Option(min=0, help="Registry poll for a new champion; 0: only POST /admin/reload.")
    ] = 5.0,
    threads: Annotated[
        int,
        typer.Option(min=0, help="Torch CPU threads; 0: torch's default. A tiny model is fastest with 1."),
    ] = 0,
    expose_adapters: Annotated[
        bool,
        typer.Option(help="Serve each adapter as its own model, with no routing or logging (engine mode)."),
    ] = False,
) -> None:
    """Serve a generation: route each turn to one specialist, answer, record it as experience."""

    import uvicorn

    from pipeline.serving.served import ServeConfig
    from pipeline.settings import get_settings

    settings = get_settings()
    settings.ensure_home()
    if engine not in ("embedded", "external"):
        raise RatchetError(f"--engine must be `embedded` or `external`, not {engine!r}")
    config = ServeConfig(
        registry_url=settings.registry_url,
        lineage=lineage,
        generation=generation,
        engine=engine,  # type: ignore[arg-type]
        engine_url=engine_url,
        engine_api_key=settings.engine_api_key,
        engine_model_template=engine_model,
        max_batch_size=max_batch_size,
        max_wait_ms=max_wait_ms,
        poll_seconds=poll_seconds,
        api_key=settings.api_key,
        device=settings.device,
        threads=threads,
    )
    if expose_adapters:
        from pipeline.registry import get_engine
        from pipeline.serving.adapter_app import create_adapter_app
        from pipeline.serving.scheduler import MicroBatchScheduler
        from pipeline.serving.served import load_served, plan_generation

        config.engine = "embedded"
        plan = plan_generation(get_engine(config.registry_url), lineage, generation)
        served = load_served(
            plan, config, MicroBatchScheduler(max_batch_size=max_batch_size, max_wait_ms=max_wait_ms)
        )
        web = create_adapter_app(served.engine, api_key=settings.api_key)  # type: ignore[arg-type]
        typer.echo(f"serving generation {plan.number}'s adapters as models on http://{host}:{port}/v1")
    else:
        from pipeline.serving.server import create_app

        web = create_app(config)
        typer.echo(f"serving {lineage} {generation} on http://{host}:{port}/v1 (model `ratchet`)")
    uvicorn.run(web, host=host, port=port, log_level="info", timeout_graceful_shutdown=30)
