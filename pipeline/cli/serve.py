"""``ratchet serve``: the generation as an OpenAI-compatible Mixture-of-LoRA server."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import typer

from pipeline.cli.app import app
from pipeline.cli.options import with_config
from pipeline.errors import RatchetError
from pipeline.registry import count_active_keys, get_engine, session_scope
from pipeline.serving.access import Access
from pipeline.serving.adapter_app import create_adapter_app
from pipeline.serving.limits import uvicorn_options
from pipeline.serving.scheduler import MicroBatchScheduler
from pipeline.serving.served import (
    SETTINGS_FIELDS,
    ServeConfig,
    engine_model_names,
    load_served,
    plan_generation,
)
from pipeline.serving.server import create_app
from pipeline.settings import get_settings

# Each option but host, port and expose_adapters is a field of ServeConfig (pipeline.cli.options): its
# description the help, its default the default. Those in SETTINGS_FIELDS come from the environment.


@app.command("serve")
@with_config(
    ServeConfig,
    names={"engine_model_template": "--engine-model", "adapter_roots": "--adapter-root"},
    skip=SETTINGS_FIELDS,
)
def serve(
    config: ServeConfig,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port.")] = 8000,
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

    settings = get_settings()
    settings.ensure_home()
    refuse_open_host(host, api_key=settings.api_key, registry_url=settings.registry_url)
    config = dataclasses.replace(config, **{name: getattr(settings, name) for name in SETTINGS_FIELDS})
    if expose_adapters:
        config.engine = "embedded"
        plan = plan_generation(get_engine(config.registry_url), config.lineage, config.generation)
        scheduler = MicroBatchScheduler(max_batch_size=config.max_batch_size, max_wait_ms=config.max_wait_ms)
        served = load_served(plan, config, scheduler)
        names = engine_model_names(config, served.specialists, plan.number)

        web = create_adapter_app(
            served.engine,  # type: ignore[arg-type]
            access=Access(db=get_engine(config.registry_url), api_key=settings.api_key),
            model_names={name: s for s, name in names.items()},
            max_body_bytes=config.max_body_bytes,
            adapter_roots=config.adapter_roots,
        )
        typer.echo(f"serving generation {plan.number}'s adapters as models on http://{host}:{port}/v1")
    else:
        web = create_app(config)
        typer.echo(
            f"serving {config.lineage} {config.generation} on http://{host}:{port}/v1 (model `{config.model_name}`)"
        )

    uvicorn.run(
        web, host=host, port=port, log_level="info", timeout_graceful_shutdown=30, **uvicorn_options(config)
    )


def refuse_open_host(host: str, *, api_key: str | None, registry_url: str) -> None:
    """Refuse to serve on a host other than loopback while no key exists: every client of the network
    could then chat anonymously, and nobody could be told apart."""
    if is_loopback(host) or api_key:
        return

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
