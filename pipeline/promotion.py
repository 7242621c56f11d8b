"""Promotion: apply the contract's gates to the candidate's evaluation; promote it or reject it.

The registry's champion and the MLflow alias ``champion`` of each adapter move together in one transaction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.candidate import AdvanceConfig, Progress, load_generation, mark_step

if TYPE_CHECKING:
    from pipeline.tracking import Tracker


def decide_step(
    *,
    generation_id: int,
    config: AdvanceConfig,
    tracker: Tracker | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Apply the gates' verdict: promote (registry champion and MLflow aliases in one step) or reject."""
    from pipeline.registry import get_engine, promote_generation, session_scope, set_generation_status
    from pipeline.tracking import registered_model_name

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
