"""What the dashboard shows of a lineage: its tree, a generation's evidence, held-out items, trends, adapters.

Keyword-only data functions over a session; each returns plain JSON-ready data, which the JSON API returns
as is and the pages render. Nothing here writes.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from sqlalchemy import select
from sqlalchemy.orm import selectinload

from pipeline.errors import NotFoundError
from pipeline.gates.transfer import matrix_view, measured
from pipeline.loop import discovery

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from pipeline.registry import Generation

__all__ = ["generation_detail", "lineage_names", "lineage_overview", "split_reasons", "trends"]


def lineage_names(*, session: Session) -> list[str]:
    from pipeline.registry import Generation

    return list(session.scalars(select(Generation.lineage).distinct().order_by(Generation.lineage)))


# Each generation's summary (what the tree, the table and the trends need), parsed once from its row and kept
# while the row's ``updated_at`` stays the same: a decided generation never changes, so a lineage page reads
# two small columns per generation instead of every evaluation's item scores and every state document.
_SUMMARIES: dict[tuple[str, int, str], dict[str, Any]] = {}
_SUMMARY_LIMIT = 100_000


def _summarise(gen: Generation) -> dict[str, Any]:
    ev = gen.evaluation or {}
    steps = (gen.state or {}).get("steps") or {}
    items = ev.get("items") or {}
    return {
        "id": gen.id,
        "number": gen.number,
        "parent_id": gen.parent_id,
        "status": gen.status,
        "decision": gen.decision,
        "created_at": gen.created_at.isoformat(),
        "harness_version_id": gen.harness_version_id,
        "harness": f"{gen.harness_version.name} {gen.harness_version.version}",
        "contract": f"{gen.contract_version.name} {gen.contract_version.version}",
        "overall": ev.get("overall"),
        "parent_overall": ev.get("parent_overall"),
        "attempt": ev.get("attempt"),
        "means": {s: _mean_interval(v.get("candidate") or []) for s, v in items.items()},
        "parent_means": {s: _mean_interval(v.get("parent") or []) for s, v in items.items()},
        "retention": {
            n: _mean_interval(r.get("candidate") or []) for n, r in (ev.get("retention") or {}).items()
        },
        "parent_retention": {
            n: _mean_interval(r.get("parent") or []) for n, r in (ev.get("retention") or {}).items()
        },
        "measured": measured(ev, "candidate"),  # the accuracy matrix's cells (pipeline.gates.transfer)
        "parent_measured": measured(ev, "parent"),
        "router": (ev.get("router") or {}).get("accuracy"),
        "parent_router": (ev.get("parent_router") or {}).get("accuracy"),
        "trained": bool((steps.get("train") or {}).get("adapters")),
        "methods": sorted({a.adapter.method for a in gen.adapters if a.adapter}),
    }


def _summaries(session: Session, lineage: str) -> list[dict[str, Any]]:
    from pipeline.registry import Generation, GenerationAdapter

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
            _SUMMARIES[(url, gen.id, str(gen.updated_at))] = _summarise(gen)
    return [_SUMMARIES[k] for k in keys if k in _SUMMARIES]


def _method(summary: dict[str, Any], parent: dict[str, Any] | None) -> str:
    """How the generation was built, in a few words: its new adapters' training method, and whether
    co-design changed the harness."""
    if summary["parent_id"] is None:
        return "base"
    label = "+".join(summary["methods"]) if summary["trained"] else "no new adapters"
    if parent is not None and summary["harness_version_id"] != parent["harness_version_id"]:
        label += " + harness"
    return label


def lineage_overview(*, session: Session, lineage: str) -> dict[str, Any]:
    """Every generation of ``lineage`` as a node (status, overall held-out score, method), the champion,
    and the held-out score of generation 0 and of the champion (the improvement at a glance)."""
    gens = _summaries(session, lineage)
    if not gens:
        raise NotFoundError(f"lineage {lineage!r} has no generations: run `ratchet init`")
    by_id = {g["id"]: g for g in gens}
    nodes = []
    for g in gens:
        parent = by_id.get(g["parent_id"])
        nodes.append(
            {
                "number": g["number"],
                "parent": parent["number"] if parent else None,
                "status": g["status"],
                "overall": g["overall"],
                "parent_overall": g["parent_overall"],
                "attempt": g["attempt"],
                "method": _method(g, parent),
                "champion": g["status"] == "promoted",
                "harness": g["harness"],
                "contract": g["contract"],
                "decision": g["decision"],
                "created_at": g["created_at"],
            }
        )
    champion = next((n for n in nodes if n["champion"]), None)
    first = nodes[0]
    return {
        "lineage": lineage,
        "generations": nodes,
        "matrix": matrix_view(gens, nodes, champion["number"] if champion else None),
        "champion": champion["number"] if champion else None,
        "first_overall": first["overall"],
        "champion_overall": champion["overall"] if champion else None,
        "promotions": sum(
            1 for g in gens if g["parent_id"] is not None and g["status"] in ("promoted", "retired")
        ),
        "rejections": sum(1 for g in gens if g["status"] == "rejected"),
    }


def get_generation_row(session: Session, lineage: str, number: int) -> Generation:
    from pipeline.registry import get_generation

    return get_generation(session=session, number=number, lineage=lineage)


def mlflow_run_link(tracking_uri: str | None, experiment_id: str | None, run_id: str | None) -> str | None:
    """The MLflow UI's page of a run, when the tracking URI is a server (a local store has no UI to link)."""
    if not run_id or not tracking_uri or not tracking_uri.startswith(("http://", "https://")):
        return None
    base = tracking_uri.rstrip("/")
    return (
        f"{base}/#/experiments/{experiment_id}/runs/{run_id}" if experiment_id else f"{base}/#/runs/{run_id}"
    )


def generation_detail(
    *, session: Session, lineage: str, number: int, tracking_uri: str | None = None
) -> dict[str, Any]:
    """Everything behind one generation's decision: versions, adapters (MLflow run, dataset, loss curve),
    held-out scores against the parent per specialist with deltas and intervals, the gate's verdict,
    router accuracy and confusion, and what curation kept and dropped (by specialist and reason, and by the
    principal whose turn it was and reason)."""
    from pipeline.loop.promotion import (
        t_quantile,  # the gates' own quantiles: the page shows what they computed
    )
    from pipeline.registry import Generation, TrainingDataset
    from pipeline.specs.contract import stored_contract

    gen = get_generation_row(session, lineage, number)
    parent = session.get(Generation, gen.parent_id) if gen.parent_id else None
    ev = gen.evaluation or {}
    steps = (gen.state or {}).get("steps") or {}
    contract = stored_contract(gen.contract_version.spec)
    gates = contract.promotion
    datasets = {
        d.specialist: d
        for d in session.scalars(select(TrainingDataset).where(TrainingDataset.generation_id == gen.id))
    }
    trained = set(((steps.get("train") or {}).get("adapters") or {}).keys())
    ungated = {name for name, spec in contract.specialists.items() if spec.ungated}
    adapters = []
    for slot in gen.adapters:
        a = slot.adapter
        ds = datasets.get(slot.specialist)
        metrics = (a.metrics or {}) if a else {}
        adapters.append(
            {
                "specialist": slot.specialist,
                "adapter_id": a.id if a else None,
                "version": a.version if a else None,
                "new": slot.specialist in trained,
                # no held-out suite judges it (the contract says `ungated: true`): no gate of its own
                "ungated": slot.specialist in ungated,
                "rank": a.rank if a else None,
                "sha256": a.sha256 if a else None,
                "method": a.method if a else None,
                "mlflow_run_id": a.mlflow_run_id if a else None,
                "mlflow_link": mlflow_run_link(
                    tracking_uri, metrics.get("mlflow_experiment_id"), a.mlflow_run_id if a else None
                ),
                "final_loss": metrics.get("final_loss"),
                "final_reward": metrics.get("final_reward"),
                "steps": metrics.get("steps"),
                "loss_curve": metrics.get("loss_curve") or [],
                "dataset": {"id": ds.id, "sha256": ds.sha256, "rows": ds.num_rows} if ds else None,
            }
        )
    comparison = ev.get("comparison") or {}
    verdict = ev.get("verdict") or {}
    # the gate's own non-inferiority results where the verdict has them (older verdicts: the t bound)
    tested = {t["test"]: t["passed"] for t in verdict.get("tests") or []}
    z95 = 1.959963984540054
    specialists = []
    for s, c in sorted((comparison.get("specialists") or {}).items()):
        n = int(c["n"])
        half = t_quantile(0.975, n - 1) * c["se"] if n > 1 else z95 * c["se"]
        floor = c["delta"] - t_quantile(1 - gates.regression_error_rate, max(1, n - 1)) * c["se"]
        specialists.append(
            {
                "specialist": s,
                "n": n,
                "parent": c["champion"],
                "candidate": c["candidate"],
                "delta": c["delta"],
                "se": c["se"],
                "interval": [c["delta"] - half, c["delta"] + half],
                "floor": floor,
                "tolerance": gates.tolerance(s),
                "passes_tolerance": tested.get(f"noninferiority:{s}", floor > -gates.tolerance(s)),
            }
        )
    curate = steps.get("curate") or {}
    kept = {s: d.get("rows", 0) for s, d in (curate.get("datasets") or {}).items()}
    dropped = curate.get("dropped") or {}
    reasons = sorted({r for per in dropped.values() for r in per})
    by_principal = curate.get("dropped_by_principal")  # absent: curated before principals were recorded
    principal_reasons = (
        sorted({r for per in by_principal.values() if isinstance(per, dict) for r in per})
        if isinstance(by_principal, dict)
        else []
    )
    return {
        "lineage": lineage,
        "number": gen.number,
        "status": gen.status,
        "step": gen.step,
        "parent": parent.number if parent else None,
        "harness": {
            "id": gen.harness_version_id,
            "name": gen.harness_version.name,
            "version": gen.harness_version.version,
        },
        "contract": {
            "id": gen.contract_version_id,
            "name": gen.contract_version.name,
            "version": gen.contract_version.version,
        },
        "base_model": gen.base_model.name,
        "created_at": gen.created_at.isoformat(),
        "method": _method(
            _summarise(gen), {"harness_version_id": parent.harness_version_id} if parent else None
        ),
        "adapters": adapters,
        "heldout": {
            "specialists": specialists,
            "overall": ev.get("overall"),
            "parent_overall": ev.get("parent_overall"),
            "delta": comparison.get("delta"),
            "se": comparison.get("se"),
            "attempt": ev.get("attempt"),
            "ungated": sorted(ungated & {slot.specialist for slot in gen.adapters}),
        },
        "verdict": {
            "decision": gen.decision,
            "promote": verdict.get("promote"),
            "rate": verdict.get("rate"),
            "lower": verdict.get("lower"),
            "tests": verdict.get("tests") or [],
            "min_improvement": gates.min_improvement,
            "false_promotion_rate": gates.false_promotion_rate,
            "reasons": verdict.get("reasons") or split_reasons(gen.decision),
        },
        "router": ev.get("router"),
        "parent_router": ev.get("parent_router"),
        "curation": {
            "kept": kept,
            "dropped": dropped,
            "reasons": reasons,
            "dropped_by_principal": by_principal,  # principal -> reason -> turns (``Drops.principals``)
            "principal_reasons": principal_reasons,
            "skipped": {
                s: d["skipped"] for s, d in (curate.get("datasets") or {}).items() if d.get("skipped")
            },
        },
        "collection": {
            k: v for k, v in (steps.get("collect") or {}).items() if not isinstance(v, dict | list)
        },
        "discovery": discovery.discovery_summary(steps.get("discover"), ev.get("discovery")),
    }


def split_reasons(decision: str | None) -> list[str]:
    """The reasons of a decision written before they were stored apart: ``"reject: a (x; y); b"`` ->
    ``["a (x; y)", "b"]`` (a semicolon inside parentheses belongs to its reason)."""
    if not decision:
        return []
    text = decision.split(": ", 1)[1] if decision.startswith(("promote: ", "reject: ")) else decision
    out, depth, current = [], 0, []
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == ";" and depth == 0:
            out.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
    out.append("".join(current).strip())
    return [r for r in out if r]


def _mean_interval(values: list[float]) -> tuple[float, float, float] | None:
    import numpy as np

    if not values:
        return None
    a = np.asarray(values, dtype=np.float64)
    half = 1.959963984540054 * (float(a.std(ddof=1)) / math.sqrt(len(a))) if len(a) > 1 else 0.0
    mean = float(a.mean())
    return mean, mean - half, mean + half


def trends(*, session: Session, lineage: str) -> dict[str, Any]:
    """Held-out score per specialist over generations with 95% intervals (from the stored item scores),
    and router accuracy, for every evaluated generation; generation 0 from its first evaluation."""
    gens = _summaries(session, lineage)
    numbers = {g["id"]: g["number"] for g in gens}
    scores: dict[str, list[dict[str, Any]]] = {}
    router: list[dict[str, Any]] = []

    def point(s: str, number: int, m: tuple[float, float, float] | None, status: str) -> None:
        if m:
            scores.setdefault(s, []).append(
                {"generation": number, "score": m[0], "low": m[1], "high": m[2], "status": status}
            )

    first = next((g for g in gens if g["means"]), None)
    if first is not None and first["parent_id"] in numbers:  # the parent of the first evaluated candidate
        for s, m in first["parent_means"].items():
            point(s, numbers[first["parent_id"]], m, "base")
        if first["parent_router"] is not None:
            router.append(
                {
                    "generation": numbers[first["parent_id"]],
                    "accuracy": first["parent_router"],
                    "status": "base",
                }
            )
    for g in gens:
        for s, m in g["means"].items():
            point(s, g["number"], m, g["status"])
        if g["router"] is not None and g["means"]:
            router.append({"generation": g["number"], "accuracy": g["router"], "status": g["status"]})
    # retention suites beside them: each generation's own measurement; one measured only as a parent (generation
    # 0, or a champion older than the suite) from the first child that measured it
    retention: dict[str, list[dict[str, Any]]] = {}

    def kept(name: str, number: int, m: tuple[float, float, float], status: str) -> None:
        retention.setdefault(name, []).append(
            {"generation": number, "score": m[0], "low": m[1], "high": m[2], "status": status}
        )

    done = {(name, g["number"]) for g in gens for name, m in g["retention"].items() if m}
    for g in gens:
        for name, m in g["retention"].items():
            if m:
                kept(name, g["number"], m, g["status"])
        parent = numbers.get(g["parent_id"])
        for name, m in g["parent_retention"].items():
            if m and parent is not None and (name, parent) not in done:
                done.add((name, parent))
                kept(name, parent, m, "parent")
    for points in retention.values():
        points.sort(key=lambda p: p["generation"])
    return {"lineage": lineage, "scores": scores, "router": router, "retention": retention}
