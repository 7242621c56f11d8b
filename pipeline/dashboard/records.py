"""What the dashboard shows of the registry's records: contract and harness versions (and a side-by-side
diff of two), the quarantine and the audit log (keyset pages, newest first). Read-only data functions."""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Literal, TypeVar

import yaml
from pydantic import JsonValue
from sqlalchemy import select

from pipeline.dashboard.replies import (
    AuditEntry,
    AuditPage,
    DiffRow,
    GenerationUse,
    QuarantineEntry,
    QuarantinePage,
    VersionDetail,
    VersionDiff,
    VersionList,
    VersionRef,
    VersionRow,
)
from pipeline.errors import NotFoundError, RatchetError
from pipeline.registry import AuditLog, ContractVersion, Generation, HarnessVersion, Quarantine

if TYPE_CHECKING:
    from sqlalchemy import ColumnElement
    from sqlalchemy.orm import Session


Row = TypeVar("Row", "AuditLog", "Quarantine")

__all__ = ["audit_page", "diff_versions", "list_versions", "quarantine_page", "version_detail"]

Kind = Literal["contracts", "harnesses"]


def _model(kind: str):

    if kind == "contracts":
        return ContractVersion
    if kind == "harnesses":
        return HarnessVersion
    raise NotFoundError(f"no such record kind {kind!r}: expected contracts or harnesses")


def list_versions(*, session: Session, kind: Kind) -> VersionList:
    model = _model(kind)
    rows = [
        VersionRow(
            id=r.id,
            name=r.name,
            version=r.version,
            sha256=r.content_hash,
            created_at=r.created_at.isoformat(),
            parent_id=r.parent_id if kind == "harnesses" else None,
        )
        for r in session.scalars(select(model).order_by(model.name, model.id))
    ]
    return VersionList(kind=kind, versions=rows)


def _spec_text(spec: JsonValue) -> str:
    return yaml.safe_dump(spec, sort_keys=False, allow_unicode=True, width=100)


def version_detail(*, session: Session, kind: Kind, version_id: int) -> VersionDetail:
    model = _model(kind)
    row = session.get(model, version_id)
    if row is None:
        raise NotFoundError(f"no {kind[:-1]} version with id {version_id}")

    column = Generation.contract_version_id if kind == "contracts" else Generation.harness_version_id
    used = session.execute(
        select(Generation.lineage, Generation.number, Generation.status)
        .where(column == row.id)
        .order_by(Generation.number)
    ).all()
    return VersionDetail(
        kind=kind,
        id=row.id,
        name=row.name,
        version=row.version,
        sha256=row.content_hash,
        created_at=row.created_at.isoformat(),
        spec=row.spec,
        yaml=_spec_text(row.spec),
        used_by=[GenerationUse(lineage=u.lineage, number=u.number, status=u.status) for u in used],
    )


def _ref(detail: VersionDetail) -> VersionRef:
    return VersionRef(id=detail.id, name=detail.name, version=detail.version, sha256=detail.sha256)


def diff_versions(*, session: Session, kind: Kind, a: int, b: int) -> VersionDiff:
    """Two versions side by side as aligned rows: ``(op, left line no, left, right line no, right)`` with
    ``op`` one of equal, replace, delete, insert (difflib's opcodes over the specs' YAML)."""
    left, right = (
        version_detail(session=session, kind=kind, version_id=a),
        version_detail(session=session, kind=kind, version_id=b),
    )
    la, lb = left.yaml.splitlines(), right.yaml.splitlines()
    rows: list[DiffRow] = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=la, b=lb, autojunk=False).get_opcodes():
        span = max(i2 - i1, j2 - j1)
        for k in range(span):
            i, j = i1 + k, j1 + k
            rows.append(
                DiffRow(
                    op=op,
                    left_no=i + 1 if i < i2 else None,
                    left=la[i] if i < i2 else None,
                    right_no=j + 1 if j < j2 else None,
                    right=lb[j] if j < j2 else None,
                )
            )
    changed = sum(1 for r in rows if r.op != "equal")
    return VersionDiff(kind=kind, a=_ref(left), b=_ref(right), rows=rows, changed_lines=changed)


def _page(
    session: Session, model: type[Row], *, before: int | None, limit: int, where: list[ColumnElement[bool]]
) -> tuple[list[Row], int | None]:
    if not 1 <= limit <= 500:
        raise RatchetError(f"limit {limit} is out of range: expected 1 to 500")
    q = select(model).where(*where)
    if before is not None:
        q = q.where(model.id < before)
    rows = list(session.scalars(q.order_by(model.id.desc()).limit(limit + 1)))
    return rows[:limit], (rows[limit - 1].id if len(rows) > limit else None)


def quarantine_page(
    *, session: Session, before: int | None = None, limit: int = 50, source_file: str | None = None
) -> QuarantinePage:
    """Refused input lines, newest first: file, line number, reason and the raw text (shown as text)."""

    where = [Quarantine.source_file == source_file] if source_file else []
    rows, older = _page(session, Quarantine, before=before, limit=limit, where=where)
    return QuarantinePage(
        entries=[
            QuarantineEntry(
                id=r.id,
                source_file=r.source_file,
                line=r.line_number,
                reason=r.reason,
                raw=r.raw[:4000],
                truncated=len(r.raw) > 4000,
                created_at=r.created_at.isoformat(),
            )
            for r in rows
        ],
        older=older,
        filters={"source_file": source_file} if source_file else {},
    )


def audit_page(
    *,
    session: Session,
    before: int | None = None,
    limit: int = 50,
    entity: str | None = None,
    action: str | None = None,
    actor: str | None = None,
) -> AuditPage:
    """Every state change, newest first (who, what, which record, details)."""

    where = []
    if entity:
        where.append(AuditLog.entity == entity)
    if action:
        where.append(AuditLog.action == action)
    if actor:
        where.append(AuditLog.actor == actor)
    rows, older = _page(session, AuditLog, before=before, limit=limit, where=where)
    return AuditPage(
        entries=[
            AuditEntry(
                id=r.id,
                at=r.at.isoformat(),
                actor=r.actor,
                entity=r.entity,
                entity_id=r.entity_id,
                action=r.action,
                details=r.details,
                message=r.message,
            )
            for r in rows
        ],
        older=older,
        filters={k: v for k, v in {"entity": entity, "action": action, "actor": actor}.items() if v},
    )
