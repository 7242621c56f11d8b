"""``ratchet dashboard``: the registry's web dashboard (pages and a JSON API) on loopback by default."""

from __future__ import annotations

from typing import Annotated

import typer

from pipeline.cli.app import app
from pipeline.dashboard import create_app
from pipeline.dashboard.webapp import LOOPBACK_HOSTS
from pipeline.errors import RatchetError
from pipeline.settings import get_settings


@app.command("dashboard")
def dashboard(
    host: Annotated[str, typer.Option(help="Interface to listen on (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port.")] = 8100,
    lineage: Annotated[str, typer.Option(help="Lineage shown first.")] = "main",
    allow_host: Annotated[
        list[str] | None,
        typer.Option(
            help="Host name browsers use to reach it (repeatable; loopback names are always allowed)."
        ),
    ] = None,
    trusted_proxy: Annotated[
        list[str] | None,
        typer.Option(
            help="Address or network of a reverse proxy whose X-Forwarded-For names the client (repeatable); "
            "otherwise the connection's peer is the client (wrong admin tokens are throttled per client)."
        ),
    ] = None,
) -> None:
    """See the lineage, each generation's evidence and the experience behind it in a browser.

    Read-only unless RATCHET_ADMIN_TOKEN is set: then promote, rollback and re-score are allowed to whoever
    presents the token (bearer, or the login form)."""
    import uvicorn

    if host in ("0.0.0.0", "::") and not allow_host:
        raise RatchetError(
            f"--host {host} listens on every interface: name the host browsers will use with --allow-host "
            "(requests for any other name are refused, against DNS rebinding)"
        )
    hosts = [*LOOPBACK_HOSTS, *(allow_host or []), *([] if host in ("0.0.0.0", "::") else [host])]
    settings = get_settings()
    settings.ensure_home()  # no home here: say so (`ratchet init` makes it) instead of opening an empty one
    web = create_app(settings, lineage_name=lineage, allowed_hosts=hosts, trusted_proxies=trusted_proxy or ())
    if host not in LOOPBACK_HOSTS:
        typer.echo(
            "note: the session cookie is Secure: off loopback, serve the dashboard behind TLS (a reverse proxy), "
            "or browsers will not send it back and the admin token crosses the network in clear",
            err=True,
        )
    mode = "actions allowed with the admin token" if settings.admin_token else "read-only"
    typer.echo(f"dashboard on http://{host}:{port}/ ({mode}); JSON API at /api, reference at /api/docs")
    # proxy_headers off: uvicorn would otherwise take the client address from X-Forwarded-For of any
    # loopback peer (its default), letting a local process pose as anyone; Access reads it from trusted
    # proxies only
    uvicorn.run(web, host=host, port=port, log_level="warning", proxy_headers=False)
