"""Judging the successor: held-out evaluation of both pairs in the same run, then the promotion gates."""

from __future__ import annotations

from typing import Any

from pipeline.advance import AdvanceConfig, Progress, contract_of, load_generation, mark_step
from pipeline.errors import RatchetError
from pipeline.successor import registered_model_name


def evaluate_step(
    *, generation_id: int, config: AdvanceConfig, progress: Progress | None = None
) -> dict[str, Any]:
    """Score the champion and the candidate on the contract's held-out suites in the same run; compare."""
    from pipeline.evaluation import compare_pairs
    from pipeline.heldout import resolve_suites, score_pair
    from pipeline.pair import pair_for_generation
    from pipeline.registry import get_engine, session_scope, set_generation_status

    engine = get_engine()
    with session_scope(engine) as session:
        gen = load_generation(session, generation_id)
        if gen.status in ("candidate", "training"):
            set_generation_status(session=session, generation=gen, status="evaluating")
        contract = contract_of(gen)
        candidate, champion = (
            pair_for_generation(gen),
            pair_for_generation(load_generation(session, gen.parent_id)),
        )
    # the generation's specialists only (a lineage may serve a subset of the contract's specialists)
    suites = {s: items for s, items in resolve_suites(contract).items() if s in candidate.adapters}
    if not suites:
        raise RatchetError("the contract declares no held-out suites: nothing to evaluate a candidate on")
    report = (lambda who: lambda d, t: progress(f"evaluate {who}", d, t)) if progress else (lambda who: None)
    champ_scores = score_pair(champion, suites, contract, progress=report("champion"))
    cand_scores = score_pair(candidate, suites, contract, progress=report("candidate"))
    comparison = compare_pairs(champ_scores, cand_scores, gates=contract.promotion)
    evaluation = {
        "scores": {s: round(c.candidate, 4) for s, c in comparison.specialists.items()},
        "overall": round(comparison.candidate_overall, 4),
        "parent_scores": {s: round(c.champion, 4) for s, c in comparison.specialists.items()},
        "parent_overall": round(comparison.champion_overall, 4),
        "comparison": comparison.to_dict(),
    }
    evaluation["router"], classifier = measure_routing(candidate.harness, generation_id=generation_id)
    with session_scope(engine) as session:
        gen = load_generation(session, generation_id)
        gen.evaluation = evaluation
        if classifier is not None:
            gen.state = {**(gen.state or {}), "router_classifier": classifier}
        parent = load_generation(session, gen.parent_id)
        if not (parent.evaluation or {}).get("scores"):  # generation 0 gets its held-out scores too
            parent.evaluation = {
                **(parent.evaluation or {}),
                "scores": evaluation["parent_scores"],
                "overall": evaluation["parent_overall"],
            }
        mark_step(session, gen, "evaluate", {"promote": comparison.promote, "decision": comparison.decision})
    return evaluation


def decide_step(
    *, generation_id: int, config: AdvanceConfig, tracker: Any = None, progress: Progress | None = None
) -> dict[str, Any]:
    """Apply the gates' verdict: promote (registry champion and MLflow aliases in one step) or reject."""
    from pipeline.registry import get_engine, promote_generation, session_scope, set_generation_status

    with session_scope(get_engine()) as session:
        gen = load_generation(session, generation_id)
        comparison = (gen.evaluation or {}).get("comparison") or {}
        decision = comparison.get("decision", "reject: not evaluated")
        if comparison.get("promote"):
            promote_generation(session=session, generation=gen, reason=decision, actor="advance")
            if tracker is not None:  # inside the transaction: an alias failure rolls the promotion back
                for slot in gen.adapters:
                    if slot.adapter is not None and slot.adapter.mlflow_model_version:
                        tracker.set_alias(
                            registered_model_name(config.lineage, slot.specialist),
                            "champion",
                            slot.adapter.mlflow_model_version,
                        )
            status = "promoted"
        else:
            set_generation_status(
                session=session, generation=gen, status="rejected", reason=decision, actor="advance"
            )
            status = "rejected"
        mark_step(session, gen, "decide", {"status": status})
        gen.lease_owner, gen.lease_expires_at = None, None
        return {
            "generation": gen.number,
            "status": status,
            "decision": decision,
            "overall": (gen.evaluation or {}).get("overall"),
            "parent_overall": (gen.evaluation or {}).get("parent_overall"),
        }


def measure_routing(
    harness: Any, *, generation_id: int, items_per_family: int = 50
) -> tuple[dict[str, Any], Any]:
    """Router accuracy on the labelled held-out turns, recorded per generation.

    In ``learned``/``hybrid`` mode a small classifier is first fitted on the lineage's experience that
    scored at least the selection threshold, labelled with the specialist that served it (held-out
    items never among them); it is returned (as a dict) to be stored with the generation for serving.
    """
    from pipeline.curation import load_candidates
    from pipeline.registry import get_engine, session_scope
    from pipeline.serving.routereval import (
        fit_router_classifier,
        heldout_routing_items,
        measure_router,
        routing_items,
    )

    items = heldout_routing_items(items_per_family)
    if harness.routing.mode == "signals":
        return measure_router(harness, items), None
    with session_scope(get_engine()) as session:
        gen = load_generation(session, generation_id)
        threshold = contract_of(gen).selection.min_score
        candidates = load_candidates(session=session, contract_version_id=gen.contract_version_id)
    traces = [
        {"messages": c.messages, "metadata": {"specialist": c.specialist}}
        for c in candidates
        if (c.score or 0) >= threshold and c.metadata.get("split") != "heldout" and c.source != "evaluation"
    ]
    if not traces:
        return measure_router(harness, items), None
    classifier = fit_router_classifier(routing_items(traces), labels=sorted(harness.specialists))
    return measure_router(harness, items, classifier=classifier), classifier.to_dict()
