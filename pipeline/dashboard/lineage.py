"""What the dashboard shows of a generation: its evidence (adapters, held-out comparison, the gates' verdict,
router, curation, collection, discovery) and the lineage's trends. The lineage at a glance is ``overview``.

Keyword-only data functions over a session; each reads a generation's stored documents through their models
(``pipeline.registry.documents``) and returns plain JSON-ready data. Nothing here writes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from pipeline.dashboard.overview import discovery_summary, method_label, summaries, summarise
from pipeline.loop.promotion import t_quantile
from pipeline.registry import Generation, TrainingDataset, get_generation
from pipeline.registry.documents import AdapterMetrics, CurateOutcome, evaluation_of, state_of
from pipeline.specs.contract import stored_contract

if TYPE_CHECKING:
    from sqlalchemy.orm import Session


__all__ = ["generation_detail", "split_reasons", "trends"]


def get_generation_row(session: Session, lineage: str, number: int) -> Generation:

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

    gen = get_generation_row(session, lineage, number)
    parent = session.get(Generation, gen.parent_id) if gen.parent_id else None
    ev, state = evaluation_of(gen), state_of(gen)
    steps = state.steps
    contract = stored_contract(gen.contract_version.spec)
    gates = contract.promotion
    datasets = {
        d.specialist: d
        for d in session.scalars(select(TrainingDataset).where(TrainingDataset.generation_id == gen.id))
    }
    trained = set(steps.train.adapters if steps.train else ())
    ungated = {name for name, spec in contract.specialists.items() if spec.ungated}
    adapters = []
    for slot in gen.adapters:
        a = slot.adapter
        ds = datasets.get(slot.specialist)
        metrics = AdapterMetrics.read(a.metrics if a else None)
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
                    tracking_uri, metrics.mlflow_experiment_id, a.mlflow_run_id if a else None
                ),
                "final_loss": metrics.final_loss,
                "final_reward": metrics.final_reward,
                "steps": metrics.steps,
                "loss_curve": [list(point) for point in metrics.loss_curve],
                "dataset": {"id": ds.id, "sha256": ds.sha256, "rows": ds.num_rows} if ds else None,
            }
        )
    comparison, verdict = ev.comparison, ev.verdict
    # the gate's own non-inferiority results where the verdict has them (older verdicts: the t bound)
    tested = {t.test: t.passed for t in verdict.tests} if verdict else {}
    z95 = 1.959963984540054
    specialists = []
    for s, c in sorted(comparison.specialists.items() if comparison else ()):
        n = int(c.n)
        half = t_quantile(0.975, n - 1) * c.se if n > 1 else z95 * c.se
        floor = c.delta - t_quantile(1 - gates.regression_error_rate, max(1, n - 1)) * c.se
        specialists.append(
            {
                "specialist": s,
                "n": n,
                "parent": c.champion,
                "candidate": c.candidate,
                "delta": c.delta,
                "se": c.se,
                "interval": [c.delta - half, c.delta + half],
                "floor": floor,
                "tolerance": gates.tolerance(s),
                "passes_tolerance": tested.get(f"noninferiority:{s}", floor > -gates.tolerance(s)),
            }
        )
    curate = steps.curate or CurateOutcome()
    kept = {s: d.rows for s, d in curate.datasets.items()}
    dropped = curate.dropped
    reasons = sorted({r for per in dropped.values() for r in per})
    by_principal = curate.dropped_by_principal  # None: curated before principals were recorded
    principal_reasons = sorted({r for per in (by_principal or {}).values() for r in per})
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
        "method": method_label(summarise(gen), parent.harness_version_id if parent else None),
        "adapters": adapters,
        "heldout": {
            "specialists": specialists,
            "overall": ev.overall,
            "parent_overall": ev.parent_overall,
            "delta": comparison.delta if comparison else None,
            "se": comparison.se if comparison else None,
            "attempt": ev.attempt,
            "ungated": sorted(ungated & {slot.specialist for slot in gen.adapters}),
        },
        "verdict": {
            "decision": gen.decision,
            "promote": verdict.promote if verdict else None,
            "rate": verdict.rate if verdict else None,
            "lower": verdict.lower if verdict else None,
            "tests": [t.as_stored() for t in verdict.tests] if verdict else [],
            "min_improvement": gates.min_improvement,
            "false_promotion_rate": gates.false_promotion_rate,
            "reasons": (verdict.reasons if verdict else []) or split_reasons(gen.decision),
        },
        "router": ev.router.as_stored() if ev.router else None,
        "parent_router": ev.parent_router.as_stored() if ev.parent_router else None,
        "curation": {
            "kept": kept,
            "dropped": dropped,
            "reasons": reasons,
            "dropped_by_principal": by_principal,  # principal -> reason -> turns (``Drops.principals``)
            "principal_reasons": principal_reasons,
            "skipped": {s: d.skipped for s, d in curate.datasets.items() if d.skipped},
        },
        "collection": {
            k: v
            for k, v in (steps.collect.as_stored() if steps.collect else {}).items()
            if not isinstance(v, dict | list)
        },
        "discovery": {s: d.model_dump() for s, d in discovery_summary(state, ev).items()},
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


def trends(*, session: Session, lineage: str) -> dict[str, Any]:
    """Held-out score per specialist over generations with 95% intervals (from the stored item scores),
    and router accuracy, for every evaluated generation; generation 0 from its first evaluation."""
    gens = summaries(session, lineage)
    numbers = {g.id: g.number for g in gens}
    scores: dict[str, list[dict[str, Any]]] = {}
    router: list[dict[str, Any]] = []

    def point(s: str, number: int, m: tuple[float, float, float] | None, status: str) -> None:
        if m:
            scores.setdefault(s, []).append(
                {"generation": number, "score": m[0], "low": m[1], "high": m[2], "status": status}
            )

    first = next((g for g in gens if g.means), None)
    if first is not None and first.parent_id in numbers:  # the parent of the first evaluated candidate
        for s, m in first.parent_means.items():
            point(s, numbers[first.parent_id], m, "base")
        if first.parent_router_accuracy is not None:
            router.append(
                {
                    "generation": numbers[first.parent_id],
                    "accuracy": first.parent_router_accuracy,
                    "status": "base",
                }
            )
    for g in gens:
        number, status, accuracy = g.number, g.status, g.router_accuracy
        for s, m in g.means.items():
            point(s, number, m, status)
        if accuracy is not None and g.means:
            router.append({"generation": number, "accuracy": accuracy, "status": status})
    # retention suites beside them: each generation's own measurement; one measured only as a parent (generation
    # 0, or a champion older than the suite) from the first child that measured it
    retention: dict[str, list[dict[str, Any]]] = {}

    def kept(name: str, number: int, m: tuple[float, float, float], status: str) -> None:
        retention.setdefault(name, []).append(
            {"generation": number, "score": m[0], "low": m[1], "high": m[2], "status": status}
        )

    done = {(name, g.number) for g in gens for name, m in g.retention.items() if m}
    for g in gens:
        for name, m in g.retention.items():
            if m:
                kept(name, g.number, m, g.status)
        parent = numbers.get(g.parent_id)
        for name, m in g.parent_retention.items():
            if m and parent is not None and (name, parent) not in done:
                done.add((name, parent))
                kept(name, parent, m, "parent")
    for points in retention.values():
        points.sort(key=lambda p: p["generation"])
    return {"lineage": lineage, "scores": scores, "router": router, "retention": retention}
