"""What the dashboard shows of an adapter's provenance: the dataset it was trained on and the traces in it
(keyset pages), its parent, the generations that use it. The other direction, a trace's adapters, is in
``trace.trace_detail``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import select

from pipeline.dashboard.replies import AdapterDetail, AdapterTrace, DatasetRef, GenerationUse
from pipeline.errors import NotFoundError
from pipeline.registry import (
    Adapter,
    DatasetExample,
    Experience,
    Generation,
    GenerationAdapter,
    TrainingDataset,
)

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

__all__ = ["adapter_detail", "inside"]


def inside(root: Path, path: str | None) -> str | None:
    """``path`` relative to the artifact store ``root`` (for links), or None when it lies elsewhere."""
    if not path:
        return None
    try:
        return Path(path).resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return None


def adapter_detail(
    *,
    session: Session,
    adapter_id: int,
    artifacts: Path,
    lineage: str,
    before: int | None = None,
    limit: int = 50,
) -> AdapterDetail:
    """An adapter's provenance: its dataset (sha256, rows) and the traces in it (keyset pages, newest
    first, each with who sent it), its parent adapter, the generations that use it, and its self-describing
    files (paths relative to the artifact store ``artifacts``; ``lineage``: the one its page links into)."""

    a = session.get(Adapter, adapter_id)
    if a is None:
        raise NotFoundError(f"no adapter {adapter_id}")
    uses = session.execute(
        select(Generation.lineage, Generation.number, Generation.status, Generation.id)
        .join(GenerationAdapter, GenerationAdapter.generation_id == Generation.id)
        .where(GenerationAdapter.adapter_id == a.id)
        .order_by(Generation.number)
    ).all()
    dataset = None
    if a.dataset_sha256:
        ids = [u.id for u in uses]
        dataset = session.scalar(
            select(TrainingDataset)
            .where(
                TrainingDataset.sha256 == a.dataset_sha256,
                TrainingDataset.specialist == a.specialist,
                TrainingDataset.generation_id.in_(ids) if ids else True,
            )
            .order_by(TrainingDataset.generation_id)
            .limit(1)
        )
    traces: list[AdapterTrace] = []
    next_before = None
    if dataset is not None:
        q = (
            select(
                Experience.id,
                Experience.source,
                Experience.specialist,
                Experience.principal,
                Experience.created_at,
            )
            .join(DatasetExample, DatasetExample.experience_id == Experience.id)
            .where(DatasetExample.dataset_id == dataset.id)
        )
        if before is not None:
            q = q.where(Experience.id < before)
        rows = session.execute(q.order_by(Experience.id.desc()).limit(limit + 1)).all()
        traces = [
            AdapterTrace(
                id=r.id,
                source=r.source,
                specialist=r.specialist,
                principal=r.principal,  # who sent it (None: served before principals were recorded)
                created_at=r.created_at.isoformat(),
            )
            for r in rows[:limit]
        ]
        next_before = rows[limit - 1].id if len(rows) > limit else None
    metrics = a.metrics or {}
    return AdapterDetail(
        id=a.id,
        lineage=lineage,
        specialist=a.specialist,
        version=a.version,
        rank=a.rank,
        alpha=a.alpha,
        target_modules=a.target_modules,
        sha256=a.sha256,
        method=a.method,
        metrics={k: v for k, v in metrics.items() if k != "loss_curve"},
        loss_curve=metrics.get("loss_curve") or [],
        mlflow_run_id=a.mlflow_run_id,
        mlflow_model_version=a.mlflow_model_version,
        parent_adapter_id=a.parent_adapter_id,
        artifact_path=inside(artifacts, a.artifact_uri),
        created_at=a.created_at.isoformat(),
        used_by=[GenerationUse(lineage=u.lineage, number=u.number, status=u.status) for u in uses],
        dataset=DatasetRef(id=dataset.id, sha256=dataset.sha256, rows=dataset.num_rows) if dataset else None,
        dataset_path=inside(artifacts, dataset.path) if dataset else None,
        traces=traces,
        next_before=next_before,
    )
