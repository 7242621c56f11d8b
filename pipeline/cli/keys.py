"""``ratchet keys ...``: the API keys of ``ratchet serve`` -- who may chat, certify, rate, correct, administer."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from pipeline.cli.app import app
from pipeline.experience.principals import OPERATOR, SCOPES, parse_scopes
from pipeline.registry import create_api_key, get_engine, list_api_keys, revoke_api_key, session_scope
from pipeline.settings import get_settings

keys_app = typer.Typer(
    help="API keys of `ratchet serve`: each key is a principal with scopes (chat, certify, rate, correct, admin).",
    no_args_is_help=True,
)
app.add_typer(keys_app, name="keys")


def _session():  # noqa: ANN202 - a context manager from the registry

    get_settings().ensure_home()
    return session_scope(get_engine())


@keys_app.command("create")
def create(
    name: Annotated[
        str, typer.Option(help="The key's name: the principal its traces and feedback are stored under.")
    ],
    scope: Annotated[str, typer.Option(help=f"Comma-separated scopes: {', '.join(SCOPES)}.")] = "chat",
) -> None:
    """Create a key and print it (shown once: the registry keeps only its sha256)."""

    scopes = parse_scopes(scope)
    with _session() as session:
        row, value = create_api_key(session=session, name=name, scopes=scopes, actor=OPERATOR)
        typer.echo(f"created key {row.name!r} with scopes {', '.join(row.scopes)}; it is shown only now:")
    typer.echo(value)


@keys_app.command("list")
def list_keys(
    as_json: Annotated[bool, typer.Option("--json", help="One JSON array.")] = False,
) -> None:
    """Every key by name, with its scopes and whether it is revoked (never its value)."""

    with _session() as session:
        rows = [
            {
                "name": r.name,
                "scopes": list(r.scopes),
                "created_at": r.created_at.isoformat(),
                "revoked_at": r.revoked_at.isoformat() if r.revoked_at else None,
            }
            for r in list_api_keys(session=session)
        ]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        typer.echo("no keys (ratchet keys create --name NAME --scope chat)")
    for r in rows:
        state = f"revoked {r['revoked_at']}" if r["revoked_at"] else "active"
        typer.echo(f"{r['name']:<24} {','.join(r['scopes']):<32} {state}")


@keys_app.command("revoke")
def revoke(name: Annotated[str, typer.Argument(help="The key's name.")]) -> None:
    """Revoke a key: a running server refuses it within seconds. Its name stays taken."""

    with _session() as session:
        revoke_api_key(session=session, name=name, actor=OPERATOR)
    typer.echo(f"revoked {name!r}")
