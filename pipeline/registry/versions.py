"""Content-addressed versions: base models, harnesses and contracts, the files they name, and the audit log."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline.errors import ConflictError, NotFoundError
from pipeline.registry.db import hold_lock
from pipeline.registry.locations import stored_path
from pipeline.registry.models import AuditLog, BaseModelRow, ContractVersion, HarnessVersion, StoredFile
from pipeline.specs.loading import content_hash


def audit(
    *,
    session: Session,
    actor: str,
    entity: str,
    entity_id: int | None,
    action: str,
    details: dict[str, Any] | None = None,
    message: str | None = None,
) -> AuditLog:
    """Append one entry to the audit log (the log is never updated or deleted)."""
    row = AuditLog(
        actor=actor, entity=entity, entity_id=entity_id, action=action, details=details or {}, message=message
    )
    session.add(row)
    return row


def _register_versioned(
    *,
    session: Session,
    model: type[HarnessVersion] | type[ContractVersion],
    kind: str,
    name: str,
    version: str,
    spec: dict[str, Any],
    actor: str,
    **extra: Any,
) -> HarnessVersion | ContractVersion:
    digest = content_hash(spec)
    hold_lock(session=session, key=f"{kind}:{name}:{version}")  # two processes registering it at once
    existing = session.scalar(select(model).where(model.name == name, model.version == version))
    if existing is not None:
        if existing.content_hash != digest:
            raise ConflictError(
                f"{kind} {name!r} version {version!r} is already registered with different content "
                f"(stored sha256 {existing.content_hash[:12]}, new {digest[:12]}): give the changed {kind} "
                "a new version"
            )
        return existing
    row = model(name=name, version=version, content_hash=digest, spec=spec, **extra)
    session.add(row)
    session.flush()
    audit(
        session=session,
        actor=actor,
        entity=model.__tablename__,
        entity_id=row.id,
        action="register",
        details={"name": name, "version": version, "sha256": digest},
    )
    return row


def register_harness(
    *,
    session: Session,
    name: str,
    version: str,
    spec: dict[str, Any],
    parent_id: int | None = None,
    actor: str = "user",
) -> HarnessVersion:
    """Store a harness version; the same content twice is a no-op, new content under an old name is refused."""
    return _register_versioned(  # type: ignore[return-value]
        session=session,
        model=HarnessVersion,
        kind="harness",
        name=name,
        version=version,
        spec=spec,
        actor=actor,
        parent_id=parent_id,
    )


def register_contract(
    *, session: Session, name: str, version: str, spec: dict[str, Any], actor: str = "user"
) -> ContractVersion:
    """Store a contract version; the same content twice is a no-op, new content under an old name is refused."""
    return _register_versioned(  # type: ignore[return-value]
        session=session,
        model=ContractVersion,
        kind="contract",
        name=name,
        version=version,
        spec=spec,
        actor=actor,
    )


def register_base_model(
    *, session: Session, name: str, path: str, spec: dict[str, Any], actor: str = "user"
) -> BaseModelRow:
    """Store a base model by name; re-registering the same name with another spec is refused."""
    # hashed as stored (relative to a home it lies in: the home may move); a registry written before paths were
    # stored so hashed the absolute path, which is accepted too
    digest = content_hash({"spec": spec, "path": stored_path(path)})
    hold_lock(session=session, key=f"base_model:{name}")
    existing = session.scalar(select(BaseModelRow).where(BaseModelRow.name == name))
    if existing is not None:
        if existing.content_hash not in (digest, content_hash({"spec": spec, "path": path})):
            raise ConflictError(
                f"base model {name!r} is already registered with a different spec or path "
                f"({existing.path}): register it under a new name"
            )
        return existing
    row = BaseModelRow(name=name, path=path, spec=spec, content_hash=digest)
    session.add(row)
    session.flush()
    audit(
        session=session,
        actor=actor,
        entity="base_models",
        entity_id=row.id,
        action="register",
        details={"name": name, "path": stored_path(path)},
    )
    return row


def get_contract_version(
    *, session: Session, name: str | None = None, version: str | None = None, id: int | None = None
) -> ContractVersion:
    """One contract version, by id, or by name (+ version; the newest when version is omitted)."""
    query = select(ContractVersion)
    if id is not None:
        query = query.where(ContractVersion.id == id)
    if name is not None:
        query = query.where(ContractVersion.name == name)
    if version is not None:
        query = query.where(ContractVersion.version == version)
    row = session.scalars(query.order_by(ContractVersion.id.desc())).first()
    if row is None:
        what = f"id {id}" if id is not None else f"{name or ''} {version or ''}".strip() or "any"
        raise NotFoundError(f"no contract version {what} in the registry: register one with `ratchet init`")
    return row


def get_harness_version(*, session: Session, id: int) -> HarnessVersion:
    row = session.get(HarnessVersion, id)
    if row is None:
        raise NotFoundError(f"no harness version with id {id} in the registry")
    return row


def store_file(*, session: Session, content: bytes) -> str:
    """Keep a file's bytes under their sha256 (stored once; the same bytes again are a no-op)."""
    import hashlib

    digest = hashlib.sha256(content).hexdigest()
    hold_lock(session=session, key=f"file:{digest}")
    if session.get(StoredFile, digest) is None:
        session.add(StoredFile(sha256=digest, size=len(content), content=content))
        session.flush()
    return digest


def load_stored_file(*, session: Session, sha256: str) -> bytes:
    """The bytes stored under ``sha256``; a file registered before files were kept is a clear error."""
    row = session.get(StoredFile, sha256)
    if row is None:
        raise NotFoundError(
            f"no file with sha256 {sha256[:12]} in the registry: register the contract again with "
            "`ratchet init` (which stores the files it names) or give its file location"
        )
    return row.content
