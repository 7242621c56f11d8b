"""API keys of ``ratchet serve``: created, listed and revoked by the operator; looked up by their sha256."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from pipeline.errors import NotFoundError, RatchetError
from pipeline.experience.principals import Principal, check_key_name, key_digest, new_key, ordered
from pipeline.registry.models import ApiKey, utcnow
from pipeline.registry.versions import audit


def create_api_key(*, session: Session, name: str, scopes: frozenset[str], actor: str) -> tuple[ApiKey, str]:
    """A new key named ``name`` with ``scopes``; returns the row and the key's value (shown once, never
    stored). A name in use, even by a revoked key, is refused: a name is a principal, and experience already
    stored under it must keep meaning the same party."""
    check_key_name(name)
    if session.scalar(select(ApiKey.id).where(ApiKey.name == name)) is not None:
        raise RatchetError(f"a key named {name!r} already exists (names are never reused; pick another)")
    value = new_key()
    row = ApiKey(name=name, key_sha256=key_digest(value), scopes=ordered(scopes))
    session.add(row)
    try:
        session.flush()
    except IntegrityError:
        raise RatchetError(
            f"a key named {name!r} already exists (names are never reused; pick another)"
        ) from None
    audit(session=session, actor=actor, entity="api_key", entity_id=row.id, action="create",
          details={"name": name, "scopes": row.scopes})  # fmt: skip
    return row, value


def list_api_keys(*, session: Session, include_revoked: bool = True) -> list[ApiKey]:
    """Every key, oldest first."""
    stmt = select(ApiKey).order_by(ApiKey.id)
    if not include_revoked:
        stmt = stmt.where(ApiKey.revoked_at.is_(None))
    return list(session.scalars(stmt))


def revoke_api_key(*, session: Session, name: str, actor: str) -> ApiKey:
    """Revoke the key named ``name`` (its name stays taken)."""
    row = session.scalar(select(ApiKey).where(ApiKey.name == name))
    if row is None:
        raise NotFoundError(f"no key named {name!r}")
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        audit(session=session, actor=actor, entity="api_key", entity_id=row.id, action="revoke",
              details={"name": name})  # fmt: skip
    return row


def active_principals(*, session: Session) -> dict[str, Principal]:
    """sha256 of each key not revoked -> its principal (what a server authenticates against)."""
    rows = session.execute(
        select(ApiKey.key_sha256, ApiKey.name, ApiKey.scopes).where(ApiKey.revoked_at.is_(None))
    )
    return {digest: Principal(name, frozenset(scopes or ())) for digest, name, scopes in rows}


def count_active_keys(*, session: Session) -> int:
    return int(
        session.scalar(select(func.count()).select_from(ApiKey).where(ApiKey.revoked_at.is_(None))) or 0
    )
