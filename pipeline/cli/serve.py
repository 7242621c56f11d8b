"""``ratchet serve``: the generation as an OpenAI-compatible Mixture-of-LoRA server."""

from __future__ import annotations

from typing import Annotated

import typer

from pipeline.cli.app import app
from pipeline.errors import RatchetError
from pipeline.serving.served import ServeConfig as C  # its defaults are the options' defaults


@app.command("serve")
def serve(
    generation: Annotated[
        str, typer.Option(help="`champion` (follows promotions live) or a generation number.")
    ] = C.generation,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    lineage: Annotated[str, typer.Option(help="Lineage whose generation is served.")] = C.lineage,
    engine: Annotated[
        str, typer.Option(help="`embedded` (transformers + peft in this process) or `external`.")
    ] = C.engine,
    engine_url: Annotated[
        str | None, typer.Option(help="External OpenAI-compatible multi-LoRA server (vLLM, SGLang).")
    ] = C.engine_url,
    engine_model: Annotated[
        str,
        typer.Option(
            help="Model name per adapter on the external engine (and of --expose-adapters); fields "
            "{specialist} {generation}. With {generation}, a new champion's adapters are loaded into the "
            "engine (/v1/load_lora_adapter) before turns go to them."
        ),
    ] = C.engine_model_template,
    max_batch_size: Annotated[
        int, typer.Option(min=1, help="Rows per mixed-adapter batch.")
    ] = C.max_batch_size,
    max_wait_ms: Annotated[
        float, typer.Option(min=0, help="How long a batch waits to fill.")
    ] = C.max_wait_ms,
    poll_seconds: Annotated[
        float, typer.Option(min=0, help="Registry poll for a new champion; 0: only POST /admin/reload.")
    ] = C.poll_seconds,
    threads: Annotated[
        int,
        typer.Option(min=0, help="Torch CPU threads; 0: torch's default. A tiny model is fastest with 1."),
    ] = C.threads,
    max_body_bytes: Annotated[
        int,
        typer.Option(min=0, help="Largest request body; a larger one gets 413 while it is read. 0: none."),
    ] = C.max_body_bytes,
    max_queue: Annotated[
        int,
        typer.Option(
            min=0, help="Chat requests in flight at once; one more gets 429 with Retry-After. 0: none."
        ),
    ] = C.max_queue,
    request_timeout_s: Annotated[
        float,
        typer.Option(min=0, help="A turn still decoding after this many seconds is stopped (504). 0: none."),
    ] = C.request_timeout_s,
    max_lora_rank: Annotated[
        int, typer.Option(min=1, help="Adapters of a higher rank are refused at load.")
    ] = C.max_lora_rank,
    max_loaded_adapters: Annotated[
        int,
        typer.Option(
            min=0, help="Adapters attached at once; the others are attached on demand (LRU). 0: all."
        ),
    ] = C.max_loaded_adapters,
    adapter_root: Annotated[
        list[str] | None,
        typer.Option(
            help="Directory besides the artifact store that /v1/load_lora_adapter may load adapters from "
            "(--expose-adapters; repeatable). Any other path is refused."
        ),
    ] = None,
    spool_max_bytes: Annotated[
        int,
        typer.Option(
            min=0,
            help="Bytes of served turns kept in the write-ahead spool while the registry does not take "
            "them; past it new chat requests get 503 with Retry-After. 0: no limit.",
        ),
    ] = C.spool_max_bytes,
    header_timeout_s: Annotated[
        float,
        typer.Option(
            min=0,
            help="A request's headers must arrive within this many seconds of the connection (or of the "
            "previous answer); else the connection is closed (408). 0: none.",
        ),
    ] = C.header_timeout_s,
    body_timeout_s: Annotated[
        float,
        typer.Option(min=0, help="A request body must arrive within this many seconds (else 408). 0: none."),
    ] = C.body_timeout_s,
    body_idle_s: Annotated[
        float,
        typer.Option(min=0, help="Longest gap without a byte of a request body (else 408). 0: none."),
    ] = C.body_idle_s,
    max_connections_per_client: Annotated[
        int,
        typer.Option(
            min=0,
            help="Open connections from one client address; one more is answered 429 and closed (behind a "
            "reverse proxy every client shares its address). 0: none.",
        ),
    ] = C.max_connections_per_client,
    max_requests_per_key: Annotated[
        int,
        typer.Option(min=0, help="Requests in flight per API key; one more gets 429. 0: none."),
    ] = C.max_requests_per_key,
    max_feedback: Annotated[
        int,
        typer.Option(min=0, help="POST /v1/feedback requests at once; one more gets 429. 0: none."),
    ] = C.max_feedback,
    rescore_timeout_s: Annotated[
        float,
        typer.Option(
            min=0,
            help="Re-scoring a turn after feedback that takes longer is stored as not verified. 0: none.",
        ),
    ] = C.rescore_timeout_s,
    allow_anonymous: Annotated[
        bool,
        typer.Option(
            help="Serve requests without a key (as `anonymous`, chat scope only) even when keys exist. "
            "Without any key they are served anyway, on loopback only."
        ),
    ] = C.allow_anonymous,
    expose_adapters: Annotated[
        bool,
        typer.Option(
            help="Serve each adapter as its own model, with no routing or logging (engine mode); adapters "
            "can be loaded at run time (vLLM's /v1/load_lora_adapter) when RATCHET_API_KEY is set."
        ),
    ] = False,
) -> None:
    """Serve a generation: route each turn to one specialist, answer, record it as experience."""

    import uvicorn

    from pipeline.settings import get_settings

    settings = get_settings()
    settings.ensure_home()
    if engine not in ("embedded", "external"):
        raise RatchetError(f"--engine must be `embedded` or `external`, not {engine!r}")
    refuse_open_host(host, api_key=settings.api_key, registry_url=settings.registry_url)
    config = C(
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
        allow_anonymous=allow_anonymous,
        device=settings.device,
        threads=threads,
        max_body_bytes=max_body_bytes,
        max_queue=max_queue,
        request_timeout_s=request_timeout_s,
        max_lora_rank=max_lora_rank,
        max_loaded_adapters=max_loaded_adapters,
        adapter_roots=tuple(adapter_root or C.adapter_roots),
        header_timeout_s=header_timeout_s,
        body_timeout_s=body_timeout_s,
        body_idle_s=body_idle_s,
        max_connections_per_client=max_connections_per_client,
        max_requests_per_key=max_requests_per_key,
        max_feedback=max_feedback,
        rescore_timeout_s=rescore_timeout_s,
        spool_max_bytes=spool_max_bytes,
    )
    if expose_adapters:
        from pipeline.registry import get_engine
        from pipeline.serving.adapter_app import create_adapter_app
        from pipeline.serving.scheduler import MicroBatchScheduler
        from pipeline.serving.served import engine_model_names, load_served, plan_generation

        config.engine = "embedded"
        plan = plan_generation(get_engine(config.registry_url), lineage, generation)
        served = load_served(
            plan, config, MicroBatchScheduler(max_batch_size=max_batch_size, max_wait_ms=max_wait_ms)
        )
        names = engine_model_names(config, served.specialists, plan.number)
        from pipeline.serving.access import Access

        web = create_adapter_app(
            served.engine,  # type: ignore[arg-type]
            access=Access(db=get_engine(config.registry_url), api_key=settings.api_key),
            model_names={name: s for s, name in names.items()},
            max_body_bytes=max_body_bytes,
            adapter_roots=config.adapter_roots,
        )
        typer.echo(f"serving generation {plan.number}'s adapters as models on http://{host}:{port}/v1")
    else:
        from pipeline.serving.server import create_app

        web = create_app(config)
        typer.echo(f"serving {lineage} {generation} on http://{host}:{port}/v1 (model `ratchet`)")
    from pipeline.serving.limits import uvicorn_options

    uvicorn.run(
        web, host=host, port=port, log_level="info", timeout_graceful_shutdown=30, **uvicorn_options(config)
    )


def refuse_open_host(host: str, *, api_key: str | None, registry_url: str) -> None:
    """Refuse to serve on a host other than loopback while no key exists: every client of the network
    could then chat anonymously, and nobody could be told apart."""
    if is_loopback(host) or api_key:
        return
    from pipeline.registry import count_active_keys, get_engine, session_scope

    with session_scope(get_engine(registry_url)) as session:
        if count_active_keys(session=session):
            return
    raise RatchetError(
        f"refusing to serve on {host} without an API key: create one (ratchet keys create --name NAME "
        "--scope chat) or set RATCHET_API_KEY, or serve on 127.0.0.1"
    )


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface only."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
