"""What the dashboard shows of a candidate's held-out evaluation item by item: each item's change against
the parent (newly solved, newly failed, better, worse, unchanged), and one item's answers side by side."""

from __future__ import annotations

from typing import TYPE_CHECKING, get_args

from sqlalchemy import select

from pipeline.dashboard.lineage import get_generation_row
from pipeline.dashboard.replies import Change, HeldOutItem, ItemComparison, ItemFilters, ItemRow
from pipeline.errors import NotFoundError
from pipeline.registry import EvaluationItem, Generation
from pipeline.specs.contract import stored_contract

if TYPE_CHECKING:
    from sqlalchemy.orm import Session


__all__ = ["CHANGES", "held_out_item", "item_comparison"]

# "newly solved", "newly failed", "better", "worse", "unchanged"
CHANGES: tuple[Change, ...] = get_args(Change)


def _change(parent: float, candidate: float, solved: float) -> Change:
    if parent < solved <= candidate:
        return "newly solved"
    if candidate < solved <= parent:
        return "newly failed"
    if candidate > parent:
        return "better"
    if candidate < parent:
        return "worse"
    return "unchanged"


ROWS_PER_PAGE = 300


def item_comparison(
    *,
    session: Session,
    lineage: str,
    number: int,
    specialist: str | None = None,
    change: Change | None = None,
    offset: int = 0,
) -> ItemComparison:
    """The candidate against its parent item by item on the held-out suites: newly solved (total at or
    above the contract's ``selection.min_score``), newly failed, better, worse, unchanged; counts of all of
    them, and ``ROWS_PER_PAGE`` items from ``offset`` (a suite is a fixed, bounded list: offsets are fine)."""

    gen = get_generation_row(session, lineage, number)
    solved = stored_contract(gen.contract_version.spec).selection.min_score
    query = select(
        EvaluationItem.specialist,
        EvaluationItem.position,
        EvaluationItem.parent_value,
        EvaluationItem.candidate_value,
        EvaluationItem.messages,
    ).where(EvaluationItem.generation_id == gen.id)
    if specialist:
        query = query.where(EvaluationItem.specialist == specialist)
    counts: dict[str, dict[Change, int]] = {}
    items: list[ItemRow] = []
    for s, pos, pv, cv, messages in session.execute(
        query.order_by(EvaluationItem.specialist, EvaluationItem.position)
    ):
        kind = _change(pv, cv, solved)
        counts.setdefault(s, dict.fromkeys(CHANGES, 0))[kind] += 1
        if change and kind != change:
            continue
        prompt = next(
            (str(m.get("content") or "") for m in reversed(messages) if m.get("role") == "user"), ""
        )
        items.append(
            ItemRow(specialist=s, position=pos, parent=pv, candidate=cv, change=kind, prompt=prompt[:240])
        )
    return ItemComparison(
        lineage=lineage,
        number=gen.number,
        parent=None if gen.parent_id is None else _parent_number(session, gen),
        solved_at=solved,
        counts=counts,
        rows=items[offset : offset + ROWS_PER_PAGE],
        matching=len(items),
        offset=offset,
        next_offset=offset + ROWS_PER_PAGE if offset + ROWS_PER_PAGE < len(items) else None,
        filters=ItemFilters.model_validate({"specialist": specialist, "change": change}),
    )


def _parent_number(session: Session, gen: Generation) -> int | None:

    parent = session.get(Generation, gen.parent_id)
    return parent.number if parent else None


def held_out_item(
    *, session: Session, lineage: str, number: int, specialist: str, position: int
) -> HeldOutItem:
    """One held-out item with the parent's and the candidate's answers side by side."""

    gen = get_generation_row(session, lineage, number)
    row = session.scalar(
        select(EvaluationItem).where(
            EvaluationItem.generation_id == gen.id,
            EvaluationItem.specialist == specialist,
            EvaluationItem.position == position,
        )
    )
    if row is None:
        raise NotFoundError(f"generation {number} has no held-out item {specialist}/{position}")
    return HeldOutItem(
        lineage=lineage,
        number=gen.number,
        parent=_parent_number(session, gen),
        specialist=specialist,
        position=position,
        messages=row.messages,
        parent_answer=row.parent_answer,
        candidate_answer=row.candidate_answer,
        parent_value=row.parent_value,
        candidate_value=row.candidate_value,
    )
