"""``ratchet dashboard``: the registry's web dashboard (pages and a JSON API) on loopback by default."""

from __future__ import annotations

from typing import Annotated

import typer

from pipeline.cli.app import app


@app.command("dashboard")
def dashboard(
    host: Annotated[str, typer.Option(help="Interface to listen on (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port.")] = 8100,
    lineage: Annotated[str, typer.Option(help="Lineage shown first.")] = "main",
) -> None:
    """See the lineage, each generation's evidence and the experience behind it in a browser.

    Read-only unless RATCHET_ADMIN_TOKEN is set: then promote, rollback and re-score are allowed to whoever
    presents the token (bearer, or the login form)."""
    import uvicorn

    from pipeline.dashboard import create_app
    from pipeline.settings import get_settings

    settings = get_settings()
    web = create_app(settings, lineage_name=lineage)
    mode = "actions allowed with the admin token" if settings.admin_token else "read-only"
    typer.echo(f"dashboard on http://{host}:{port}/ ({mode}); JSON API at /api, reference at /api/docs")
    uvicorn.run(web, host=host, port=port, log_level="warning")
