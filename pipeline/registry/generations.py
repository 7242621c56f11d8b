"""Generations (model-harness pairs in a lineage), their adapters, and champion moves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, selectinload

from pipeline.errors import ConflictError, NotFoundError, RatchetError
from pipeline.registry.adapter_source import check_adapter_source
from pipeline.registry.db import hold_lock
from pipeline.registry.documents import AdapterMetrics, GenerationEvaluation, GenerationState, evaluation_of
from pipeline.registry.models import (
    IN_FLIGHT,
    Adapter,
    Generation,
    GenerationAdapter,
    GenerationStatus,
)
from pipeline.registry.versions import audit
from pipeline.settings import get_settings

# Which status may follow which (manual overrides go through promote/rollback instead).
TRANSITIONS: dict[str, set[str]] = {
    "candidate": {"training", "evaluating", "failed", "rejected", "promoted"},
    "training": {"evaluating", "failed", "candidate"},
    "evaluating": {"promoted", "rejected", "failed", "training"},
    "promoted": {"retired"},
    "rejected": set(),
    "failed": set(),
    "retired": set(),
}


def _load(session: Session):
    return select(Generation).options(
        selectinload(Generation.adapters).selectinload(GenerationAdapter.adapter)
    )


def create_generation(
    *,
    session: Session,
    lineage: str = "main",
    base_model_id: int,
    harness_version_id: int,
    contract_version_id: int,
    specialists: list[str],
    adapters: dict[str, int | None] | None = None,
    parent_id: int | None = None,
    status: str = GenerationStatus.candidate,
    actor: str = "ratchet",
    state: GenerationState | dict[str, Any] | None = None,
) -> Generation:
    """Create the next generation of ``lineage`` with one adapter slot per specialist ("none yet" = None).

    Refused (``ConflictError``) while another generation of the lineage is in flight, so two racing
    ``advance`` runs produce one candidate.
    """
    adapters = adapters or {}
    unknown = set(adapters) - set(specialists)
    if unknown:
        raise RatchetError(
            f"adapters given for unknown specialists {sorted(unknown)}; expected {specialists}"
        )
    hold_lock(session=session, key=f"lineage:{lineage}")
    latest = session.scalar(select(func.max(Generation.number)).where(Generation.lineage == lineage))
    number = 0 if latest is None else latest + 1
    gen = Generation(
        lineage=lineage,
        number=number,
        parent_id=parent_id,
        base_model_id=base_model_id,
        harness_version_id=harness_version_id,
        contract_version_id=contract_version_id,
        status=str(status),
        state=GenerationState.model_validate(state or {}).as_stored(),
        evaluation=GenerationEvaluation().as_stored(),
        adapters=[GenerationAdapter(specialist=s, adapter_id=adapters.get(s)) for s in specialists],
    )
    try:
        with session.begin_nested():
            session.add(gen)
            session.flush()
    except IntegrityError:
        if gen in session:
            session.expunge(gen)
        in_flight = get_in_flight(session=session, lineage=lineage)
        if in_flight is not None:
            raise ConflictError(
                f"generation {in_flight.number} of lineage {lineage!r} is already {in_flight.status}: "
                "wait for it to finish (or resume it with `ratchet advance`)"
            ) from None
        raise ConflictError(
            f"generation {number} of lineage {lineage!r} was created concurrently; retry"
        ) from None
    audit(
        session=session,
        actor=actor,
        entity="generations",
        entity_id=gen.id,
        action="create",
        details={"lineage": lineage, "number": number, "status": gen.status, "parent_id": parent_id},
    )
    return gen


def get_generation(*, session: Session, number: int, lineage: str = "main") -> Generation:
    gen = session.scalar(_load(session).where(Generation.lineage == lineage, Generation.number == number))
    if gen is None:
        raise NotFoundError(f"no generation {number} in lineage {lineage!r}: see `ratchet lineage`")
    return gen


def get_champion(*, session: Session, lineage: str = "main") -> Generation | None:
    """The promoted generation of the lineage (at most one, enforced by a unique partial index)."""
    return session.scalar(
        _load(session).where(Generation.lineage == lineage, Generation.status == GenerationStatus.promoted)
    )


def get_in_flight(*, session: Session, lineage: str = "main") -> Generation | None:
    """The candidate being built, if any (at most one per lineage)."""
    return session.scalar(
        _load(session).where(
            Generation.lineage == lineage, Generation.status.in_([str(s) for s in IN_FLIGHT])
        )
    )


def list_generations(*, session: Session, lineage: str = "main") -> list[Generation]:
    return list(
        session.scalars(_load(session).where(Generation.lineage == lineage).order_by(Generation.number))
    )


def set_generation_status(
    *,
    session: Session,
    generation: Generation,
    status: str,
    reason: str | None = None,
    actor: str = "ratchet",
    step: str | None = None,
) -> Generation:
    """Move a generation along its life cycle (checked against ``TRANSITIONS``) and audit it."""
    status = str(status)
    hold_lock(session=session, key=f"lineage:{generation.lineage}")
    session.refresh(generation)  # another process may have moved it since it was read
    before = generation.status
    if status != before and status not in TRANSITIONS[before]:
        raise ConflictError(f"generation {generation.number} cannot go from {before} to {status}")
    if status == GenerationStatus.promoted:
        return promote_generation(session=session, generation=generation, reason=reason, actor=actor)
    generation.status = status
    if reason is not None:
        generation.decision = reason
    if step is not None:
        generation.step = step
    session.flush()
    audit(
        session=session,
        actor=actor,
        entity="generations",
        entity_id=generation.id,
        action="status",
        details={"from": before, "to": status, "number": generation.number},
        message=reason,
    )
    return generation


def promote_generation(
    *, session: Session, generation: Generation, reason: str | None = None, actor: str = "ratchet"
) -> Generation:
    """Make ``generation`` the lineage's champion; the previous champion is retired, in one transaction.

    Champion moves of one lineage are serialized (``hold_lock``) and re-read what they act on, so racing
    promotions and rollbacks leave exactly one champion and the later one either applies to the new state
    or is refused with a ``ConflictError`` saying why."""
    hold_lock(session=session, key=f"lineage:{generation.lineage}")
    session.refresh(generation)
    if generation.status == GenerationStatus.promoted:
        raise ConflictError(f"generation {generation.number} is already the champion")
    if generation.status in (GenerationStatus.failed, GenerationStatus.training):
        raise ConflictError(
            f"generation {generation.number} is {generation.status}: only a built generation can be promoted"
        )
    previous = get_champion(session=session, lineage=generation.lineage)
    if previous is not None:
        previous.status = GenerationStatus.retired
        session.flush()
        audit(
            session=session,
            actor=actor,
            entity="generations",
            entity_id=previous.id,
            action="retire",
            details={"number": previous.number, "successor": generation.number},
        )
    before = generation.status
    generation.status = GenerationStatus.promoted
    if reason is not None:
        generation.decision = reason
    session.flush()
    audit(
        session=session,
        actor=actor,
        entity="generations",
        entity_id=generation.id,
        action="promote",
        details={
            "from": before,
            "number": generation.number,
            "previous_champion": previous.number if previous else None,
        },
        message=reason,
    )
    return generation


def rollback_champion(*, session: Session, lineage: str = "main", actor: str = "user") -> Generation:
    """Retire the champion and restore its parent as champion (refused when there is no parent)."""
    hold_lock(session=session, key=f"lineage:{lineage}")
    champion = session.scalar(
        _load(session)
        .where(Generation.lineage == lineage, Generation.status == GenerationStatus.promoted)
        .execution_options(populate_existing=True)
    )
    if champion is None:
        raise ConflictError(f"lineage {lineage!r} has no champion to roll back")
    if champion.parent_id is None:
        raise ConflictError(f"generation {champion.number} has no parent: there is nothing to roll back to")
    parent = session.get(Generation, champion.parent_id, populate_existing=True)
    assert parent is not None
    if parent.status not in (GenerationStatus.retired, GenerationStatus.rejected):
        raise ConflictError(
            f"generation {parent.number} (the parent of champion {champion.number}) is {parent.status}: "
            "only a retired or rejected generation can be restored"
        )
    champion.status = GenerationStatus.retired
    champion.decision = f"rolled back to generation {parent.number} by {actor}"
    session.flush()
    parent.status = GenerationStatus.promoted
    session.flush()
    audit(
        session=session,
        actor=actor,
        entity="generations",
        entity_id=champion.id,
        action="rollback",
        details={"from": champion.number, "to": parent.number},
    )
    return parent


def abandon_generation(*, session: Session, lineage: str = "main", reason: str, actor: str) -> Generation:
    """Fail the lineage's in-flight candidate for ``reason`` (audited), so that the next ``ratchet advance``
    starts a new one. Its lease is cleared: a run still building it loses the lease and stops at its next
    write (``lease.LeaseLostError``). An evaluated candidate's tests stay spent on its suites (the spending
    ledger, ``pipeline.registry.ledger``): its comparison was made, whatever became of it."""
    hold_lock(session=session, key=f"lineage:{lineage}")
    gen = session.scalar(
        _load(session)
        .where(Generation.lineage == lineage, Generation.status.in_([str(s) for s in IN_FLIGHT]))
        .execution_options(populate_existing=True)
    )
    if gen is None:
        raise ConflictError(f"lineage {lineage!r} has no candidate in flight: there is nothing to abandon")
    before, holder = gen.status, gen.lease_owner
    gen.status = GenerationStatus.failed
    gen.decision = f"abandoned by {actor}: {reason}"
    gen.lease_owner, gen.lease_expires_at = None, None
    session.flush()
    audit(
        session=session,
        actor=actor,
        entity="generations",
        entity_id=gen.id,
        action="abandon",
        details={
            "number": gen.number,
            "from": before,
            "after_step": gen.step,
            "lease_owner": holder,
            "evaluated": evaluation_of(gen).comparison is not None,
        },
        message=reason,
    )
    return gen


def next_adapter_version(*, session: Session, base_model_id: int, specialist: str) -> int:
    current = session.scalar(
        select(func.max(Adapter.version)).where(
            Adapter.base_model_id == base_model_id, Adapter.specialist == specialist
        )
    )
    return (current or 0) + 1


def create_adapter(
    *,
    session: Session,
    specialist: str,
    base_model_id: int,
    rank: int,
    alpha: float,
    target_modules: list[str],
    artifact_uri: str,
    sha256: str,
    parent_adapter_id: int | None = None,
    mlflow_run_id: str | None = None,
    dataset_sha256: str | None = None,
    metrics: AdapterMetrics | dict[str, Any] | None = None,
    method: str = "sft",
    actor: str = "ratchet",
    artifact_root: Path | None = None,
) -> Adapter:
    """Record a trained adapter (its files stay at ``artifact_uri``, checked by ``sha256`` again when loaded).

    The source is checked first (``check_adapter_source``): a directory inside ``artifact_root`` (default:
    the Ratchet home's artifact store) with safetensors weights, a peft config and the given sha256; it is
    recorded resolved. Versions of one specialist's adapter are numbered 1, 2, 3, ... without gaps, also
    when several processes create them at once (the numbering is serialized by ``hold_lock``)."""
    root = artifact_root if artifact_root is not None else get_settings().artifacts_dir
    artifact_uri = str(check_adapter_source(artifact_uri=artifact_uri, sha256=sha256, artifact_root=root))
    hold_lock(session=session, key=f"adapter:{base_model_id}:{specialist}")
    row = Adapter(
        specialist=specialist,
        version=next_adapter_version(session=session, base_model_id=base_model_id, specialist=specialist),
        base_model_id=base_model_id,
        rank=rank,
        alpha=alpha,
        target_modules=list(target_modules),
        artifact_uri=artifact_uri,
        sha256=sha256,
        parent_adapter_id=parent_adapter_id,
        mlflow_run_id=mlflow_run_id,
        dataset_sha256=dataset_sha256,
        method=method,
        metrics=AdapterMetrics.model_validate(metrics or {}).as_stored(),
    )
    session.add(row)
    session.flush()
    audit(
        session=session,
        actor=actor,
        entity="adapters",
        entity_id=row.id,
        action="create",
        details={"specialist": specialist, "version": row.version, "sha256": sha256, "method": method},
    )
    return row


def set_generation_adapter(
    *,
    session: Session,
    generation: Generation,
    specialist: str,
    adapter_id: int | None,
    actor: str = "ratchet",
) -> None:
    """Point a generation's specialist slot at an adapter (exactly one slot per specialist)."""
    slot = next((a for a in generation.adapters if a.specialist == specialist), None)
    if slot is None:
        raise RatchetError(f"generation {generation.number} has no specialist {specialist!r}")
    slot.adapter_id = adapter_id
    session.flush()
    audit(
        session=session,
        actor=actor,
        entity="generations",
        entity_id=generation.id,
        action="set_adapter",
        details={"specialist": specialist, "adapter_id": adapter_id},
    )
