"""A lineage at a glance: every generation summarised once from its stored documents, the accuracy matrix, the
champion. ``lineage_summary`` is the one ``LineageSummary`` (``pipeline.registry.summaries``) that the dashboard's
``/api/lineage`` returns and ``ratchet lineage --json`` prints; ``pipeline.dashboard.lineage`` builds a generation's
page and the trends from the same per-generation summaries. Nothing here writes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import selectinload

from pipeline.errors import NotFoundError
from pipeline.gates.transfer import accuracy_matrix, matrix_view, measured
from pipeline.registry import Generation, GenerationAdapter
from pipeline.registry.documents import (
    CurateOutcome,
    GenerationEvaluation,
    GenerationState,
    evaluation_of,
    state_of,
)
from pipeline.registry.summaries import (
    CurationSummary,
    DiscoverySummary,
    GenerationSummary,
    LineageSummary,
    MatrixView,
)

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

__all__ = [
    "Parsed",
    "discovery_summary",
    "lineage_names",
    "lineage_summary",
    "method_label",
    "summaries",
    "summarise",
]


def lineage_names(*, session: Session) -> list[str]:
    """Every lineage in the registry, by name."""
    return list(session.scalars(select(Generation.lineage).distinct().order_by(Generation.lineage)))


# Each generation's summary (what the tree, the table and the trends need), parsed once from its row and kept
# while the row's ``updated_at`` stays the same: a decided generation never changes, so a lineage page reads
# two small columns per generation instead of every evaluation's item scores and every state document.
_SUMMARIES: dict[tuple[str, int, str], Parsed] = {}
_SUMMARY_LIMIT = 100_000


@dataclass(frozen=True)
class Parsed:
    """What one generation's row says, read once through its documents (``pipeline.registry.documents``)."""

    id: int
    number: int
    status: str
    parent_id: int | None
    harness_version_id: int
    trained: bool  # training made new adapters
    methods: tuple[str, ...]  # its adapters' training methods
    measured: dict[str, float]  # the accuracy matrix's cells, as the candidate and as the parent
    parent_measured: dict[str, float]
    means: dict[str, tuple[float, float, float] | None]  # held-out mean and 95% interval, per specialist
    parent_means: dict[str, tuple[float, float, float] | None]
    retention: dict[str, tuple[float, float, float] | None]
    parent_retention: dict[str, tuple[float, float, float] | None]
    router_accuracy: float | None
    parent_router_accuracy: float | None
    fields: dict[str, Any]  # the other GenerationSummary fields that do not depend on the other generations


def summarise(gen: Generation) -> Parsed:
    ev, state = evaluation_of(gen), state_of(gen)
    steps = state.steps
    curate = steps.curate or CurateOutcome()
    slots = sorted(gen.adapters, key=lambda a: a.specialist)
    return Parsed(
        id=gen.id,
        number=gen.number,
        status=str(gen.status),
        parent_id=gen.parent_id,
        router_accuracy=ev.router.accuracy if ev.router else None,
        parent_router_accuracy=ev.parent_router.accuracy if ev.parent_router else None,
        harness_version_id=gen.harness_version_id,
        trained=bool(steps.train and steps.train.adapters),
        methods=tuple(sorted({a.adapter.method for a in gen.adapters if a.adapter})),
        measured=measured(ev, "candidate"),
        parent_measured=measured(ev, "parent"),
        means={s: _mean_interval(v.candidate) for s, v in ev.items.items()},
        parent_means={s: _mean_interval(v.parent) for s, v in ev.items.items()},
        retention={n: _mean_interval(r.candidate) for n, r in ev.retention.items()},
        parent_retention={n: _mean_interval(r.parent) for n, r in ev.retention.items()},
        fields={
            "harness": f"{gen.harness_version.name} {gen.harness_version.version}",
            "contract": f"{gen.contract_version.name} {gen.contract_version.version}",
            "adapters": {a.specialist: (f"v{a.adapter.version}" if a.adapter else None) for a in slots},
            "methods": {a.specialist: (a.adapter.method if a.adapter else None) for a in slots},
            "scores": ev.scores,
            "overall": ev.overall,
            "parent_overall": ev.parent_overall,
            "attempt": ev.attempt,
            "unscored": ev.unscored,
            "divergence": ev.divergence,
            "curation": CurationSummary(
                kept={s: d.rows for s, d in curate.datasets.items()},
                dropped=curate.dropped,
                dropped_by_principal=curate.dropped_by_principal or {},
            ),
            "discovery": discovery_summary(state, ev),
            "decision": gen.decision,
            "step": gen.step,
            "seconds": state.seconds,
            "created_at": gen.created_at.isoformat(),
        },
    )


def discovery_summary(
    state: GenerationState, evaluation: GenerationEvaluation
) -> dict[str, DiscoverySummary]:
    """Per specialist: variants tried and found by discovery, and how the champion and the candidate answer
    the found ones (mean contract totals, greedy); empty when the generation had no discovery."""
    found = state.steps.discover.specialists if state.steps.discover else {}
    out = {}
    for s, d in sorted(found.items()):
        answered = evaluation.discovery.get(s)
        out[s] = DiscoverySummary(
            tried=d.tried,
            found=d.found,
            champion=answered.champion if answered else None,
            candidate=answered.candidate if answered else None,
        )
    return out


def summaries(session: Session, lineage: str) -> list[Parsed]:
    url = session.get_bind().url.render_as_string(hide_password=True)
    heads = session.execute(
        select(Generation.id, Generation.updated_at)
        .where(Generation.lineage == lineage)
        .order_by(Generation.number)
    ).all()
    keys = [(url, i, str(updated)) for i, updated in heads]
    missing = [k[1] for k in keys if k not in _SUMMARIES]
    if len(_SUMMARIES) + len(missing) > _SUMMARY_LIMIT:
        _SUMMARIES.clear()
        missing = [k[1] for k in keys]
    for chunk in range(0, len(missing), 500):
        rows = session.scalars(
            select(Generation)
            .where(Generation.id.in_(missing[chunk : chunk + 500]))
            .options(
                selectinload(Generation.adapters).selectinload(GenerationAdapter.adapter),
                selectinload(Generation.harness_version),
                selectinload(Generation.contract_version),
            )
        )
        for gen in rows:
            _SUMMARIES[(url, gen.id, str(gen.updated_at))] = summarise(gen)
    return [_SUMMARIES[k] for k in keys if k in _SUMMARIES]


def method_label(summary: Parsed, parent_harness_version_id: int | None) -> str:
    """How the generation was built, in a few words: its new adapters' training method, and whether
    co-design changed the harness."""
    if summary.parent_id is None:
        return "base"
    label = "+".join(summary.methods) if summary.trained else "no new adapters"
    if parent_harness_version_id is not None and summary.harness_version_id != parent_harness_version_id:
        label += " + harness"
    return label


def lineage_summary(*, session: Session, lineage: str) -> LineageSummary:
    """Every generation of ``lineage`` (status, versions, adapters, held-out scores, accuracy-matrix row,
    curation, discovery, the decision), the accuracy matrix, the champion, and the held-out score of
    generation 0 and of the champion (the improvement at a glance): what ``ratchet lineage --json`` prints
    and ``/api/lineage`` returns."""
    gens = summaries(session, lineage)
    if not gens:
        raise NotFoundError(f"lineage {lineage!r} has no generations: run `ratchet init`")
    by_id = {g.id: g for g in gens}
    parents = [by_id.get(g.parent_id) for g in gens]
    matrix = accuracy_matrix(
        [
            {"generation": g.number, "parent": p.number if p else None,
             "candidate": g.measured, "parent_measured": g.parent_measured}
            for g, p in zip(gens, parents, strict=True)
        ]
    )  # fmt: skip
    nodes = [
        GenerationSummary(
            **g.fields,
            number=g.number,
            status=g.status,
            router_accuracy=g.router_accuracy,
            parent_router_accuracy=g.parent_router_accuracy,
            parent=p.number if p else None,
            champion=g.status == "promoted",
            method=method_label(g, p.harness_version_id if p else None),
            accuracy=matrix["rows"][g.number],
            backward_transfer=matrix["backward_transfer"][g.number],
        )
        for g, p in zip(gens, parents, strict=True)
    ]
    champion = next((n for n in nodes if n.champion), None)
    view = matrix_view(
        [{"measured": g.measured, "parent_measured": g.parent_measured} for g in gens],
        [n.model_dump() for n in nodes],
        champion.number if champion else None,
    )
    return LineageSummary(
        lineage=lineage,
        lineages=lineage_names(session=session),
        generations=nodes,
        matrix=MatrixView.model_validate(view),
        champion=champion.number if champion else None,
        first_overall=nodes[0].overall,
        champion_overall=champion.overall if champion else None,
        promotions=sum(1 for g in gens if g.parent_id is not None and g.status in ("promoted", "retired")),
        rejections=sum(1 for g in gens if g.status == "rejected"),
    )


def _mean_interval(values: list[float]) -> tuple[float, float, float] | None:
    if not values:
        return None
    a = np.asarray(values, dtype=np.float64)
    half = 1.959963984540054 * (float(a.std(ddof=1)) / math.sqrt(len(a))) if len(a) > 1 else 0.0
    mean = float(a.mean())
    return mean, mean - half, mean + half
