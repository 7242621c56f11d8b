"""What the dashboard shows of experience: filtered keyset pages of traces, and one trace turn by turn.

Pages go newest first by id (keyset: ``before``/``after`` an id, never an offset, never a count of the
table). A filter an index serves (one of generation, specialist, source) is one indexed query. Any other
filter (free text, score range, feedback, verification, or several at once) walks the ids downward in
windows until the page is full or a time budget is spent, and then says how far down it searched, so a
rare match costs a bounded wait per page instead of a scan of a million rows.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import and_, func, select

from pipeline.errors import NotFoundError

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

__all__ = ["ExperienceQuery", "list_experience", "message_text", "trace_detail"]

SCAN_BUDGET_S = 0.15  # per page, for filters no index serves
FIRST_WINDOW = 20_000  # ids per scanned window (doubled while the budget lasts)


class ExperienceQuery(BaseModel):
    """The experience page's filters and cursor (query parameters of ``/experience`` and its API)."""

    model_config = ConfigDict(extra="forbid")

    lineage: str | None = Field(
        default=None,
        max_length=100,
        description="Lineage (default: the dashboard's) of `generation` and scores.",
    )
    generation: int | None = Field(default=None, ge=0, description="Traces served by this generation number.")
    specialist: str | None = Field(default=None, max_length=100, description="Traces of this specialist.")
    source: str | None = Field(default=None, max_length=32, description="deployment, simulation, import, ...")
    score_min: float | None = Field(
        default=None, description="Lowest contract total (the champion's contract)."
    )
    score_max: float | None = Field(default=None, description="Highest contract total.")
    feedback: Literal["any", "none", "rating", "correction"] | None = Field(
        default=None, description="Traces with any feedback, none, a rating, or a correction."
    )
    verified: Literal["yes", "no", "unscored"] | None = Field(
        default=None,
        description="Whether the contract verified the trace's outcome, or it is not scored yet.",
    )
    q: str | None = Field(default=None, max_length=200, description="Text the conversation contains.")
    before: int | None = Field(default=None, ge=1, description="Older than this trace id (next page).")
    after: int | None = Field(default=None, ge=0, description="Newer than this trace id (previous page).")
    limit: int = Field(default=50, ge=1, le=200, description="Traces per page.")

    @field_validator(
        "lineage", "generation", "specialist", "source", "score_min", "score_max", "feedback", "verified", "q",
        "before", "after", mode="before",
    )  # fmt: skip
    @classmethod
    def _blank_is_unset(cls, value: Any) -> Any:
        return None if isinstance(value, str) and not value.strip() else value  # an empty form field

    def active(self) -> dict[str, Any]:
        """The filters in use (no cursor), for links that keep them."""
        return {
            k: v
            for k, v in self.model_dump(exclude={"before", "after", "limit", "lineage"}).items()
            if v is not None and v != ""
        }


def message_text(message: dict[str, Any]) -> str:
    """A message's text: its content (text parts joined), else its tool calls as ``name(arguments)``."""
    content = message.get("content")
    if isinstance(content, list):
        content = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    text = "" if content is None else str(content)
    calls = message.get("tool_calls") or []
    if calls and not text:
        text = "; ".join(
            f"{(c.get('function') or {}).get('name', '?')}({(c.get('function') or {}).get('arguments', '')})"
            for c in calls
            if isinstance(c, dict)
        )
    return text


def _champion_contract(session: Session, lineage: str) -> int | None:
    from pipeline.registry import get_champion

    champion = get_champion(session=session, lineage=lineage)
    return champion.contract_version_id if champion else None


def list_experience(
    *, session: Session, lineage: str, query: ExperienceQuery, budget_s: float = SCAN_BUDGET_S
) -> dict[str, Any]:
    """One page of traces matching ``query``, newest first, with the cursors of the next pages."""
    from pipeline.registry import Generation, Score
    from pipeline.registry.experience import RAW_EXPERIENCE
    from pipeline.registry.models import load_json

    e, s = RAW_EXPERIENCE, Score.__table__
    numbers = dict(
        session.execute(select(Generation.id, Generation.number).where(Generation.lineage == lineage)).all()
    )
    contract_id = _champion_contract(session, lineage)
    conditions = []
    indexed = 0
    if query.generation is not None:
        gen_id = next((i for i, n in numbers.items() if n == query.generation), None)
        if gen_id is None:
            raise NotFoundError(f"lineage {lineage!r} has no generation {query.generation}")
        conditions.append(e.c.generation_id == gen_id)
        indexed += 1
    if query.specialist:
        conditions.append(e.c.specialist == query.specialist)
        indexed += 1
    if query.source:
        conditions.append(e.c.source == query.source)
        indexed += 1
    scanned = indexed > 1
    if query.score_min is not None:
        conditions.append(s.c.value >= query.score_min)
    if query.score_max is not None:
        conditions.append(s.c.value <= query.score_max)
    if query.verified == "yes":
        conditions.append(s.c.verified.is_(True))
    elif query.verified == "no":
        conditions.append(s.c.verified.is_(False))
    elif query.verified == "unscored":
        conditions.append(s.c.id.is_(None))
    if query.feedback == "none":
        conditions.append(e.c.feedback.is_(None))
    elif query.feedback == "any":
        conditions.append(and_(e.c.feedback.is_not(None), e.c.feedback != "null"))
    elif query.feedback in ("rating", "correction"):
        conditions.append(e.c.feedback.like(f'%"{query.feedback}"%'))
    if query.q:
        pattern = "%" + query.q.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        text_match = (
            e.c.messages.ilike(pattern, escape="\\")
            if session.get_bind().dialect.name == "postgresql"
            else e.c.messages.like(pattern, escape="\\")  # SQLite's LIKE ignores ASCII case already
        )
        conditions.append(text_match)
    scanned = scanned or len(conditions) > indexed
    joined = e.outerjoin(
        s, and_(s.c.experience_id == e.c.id, s.c.contract_version_id == contract_id, s.c.scorer == "total")
    )
    columns = select(
        e.c.id, e.c.created_at, e.c.source, e.c.specialist, e.c.generation_id, e.c.messages, e.c.feedback,
        s.c.value, s.c.verified,
    ).select_from(joined)  # fmt: skip
    newer = query.after is not None and query.before is None
    order = e.c.id.asc() if newer else e.c.id.desc()
    lowest, highest = session.execute(select(func.min(e.c.id), func.max(e.c.id))).one()
    rows: list[Any] = []
    searched_to: int | None = None
    if lowest is not None:
        if not scanned:
            stmt = columns.where(*conditions)
            stmt = stmt.where(e.c.id > query.after) if newer else stmt
            stmt = stmt.where(e.c.id < query.before) if query.before is not None else stmt
            rows = list(session.execute(stmt.order_by(order).limit(query.limit + 1)))
        else:
            started, window = time.perf_counter(), FIRST_WINDOW
            edge = (query.after + 1) if newer else (query.before if query.before is not None else highest + 1)
            while len(rows) <= query.limit:
                lo, hi = (edge, edge + window) if newer else (edge - window, edge)
                stmt = columns.where(*conditions, e.c.id >= lo, e.c.id < hi)
                rows += list(session.execute(stmt.order_by(order).limit(query.limit + 1 - len(rows))))
                edge = hi if newer else lo
                if (edge > highest) if newer else (edge <= lowest):
                    break
                if time.perf_counter() - started > budget_s and len(rows) <= query.limit:
                    searched_to = edge  # stopped early: the ids beyond ``edge`` are not searched yet
                    break
                window *= 2
    more = len(rows) > query.limit
    rows = rows[: query.limit]
    if newer:
        rows.reverse()
    items = []
    for r in rows:
        messages = load_json(r.messages) or []
        user = next((m for m in messages if isinstance(m, dict) and m.get("role") == "user"), {})
        last = next(
            (m for m in reversed(messages) if isinstance(m, dict) and m.get("role") == "assistant"), {}
        )
        items.append(
            {
                "id": r.id,
                "created_at": r.created_at.isoformat()
                if hasattr(r.created_at, "isoformat")
                else str(r.created_at),
                "source": r.source,
                "specialist": r.specialist,
                "generation": numbers.get(r.generation_id),
                "prompt": message_text(user)[:200],
                "answer": message_text(last)[:200],
                "score": r.value,
                "verified": r.verified,
                "feedback": r.feedback not in (None, "null"),
            }
        )
    first_id, last_id = (items[0]["id"], items[-1]["id"]) if items else (None, None)
    older = None
    if newer:
        older = last_id if last_id is not None and last_id > (lowest or 0) else None
    elif more:
        older = last_id
    elif searched_to is not None:
        older = searched_to
    return {
        "lineage": lineage,
        "filters": query.active(),
        "traces": items,
        "older": older,  # pass as ``before``
        "newer": first_id if (query.before is not None or newer) and first_id is not None else None,
        "searched_to": searched_to,  # set when the page stopped early: ids below it are not searched yet
        "scanned": scanned,
        "contract_version_id": contract_id,
        "newest_id": highest,
    }


def _views(row: Any, messages: list[dict[str, Any]], routes: dict[int, dict[str, Any]]) -> dict[int, Any]:
    """What each served turn's specialist was shown, rebuilt from the trace's routes and summaries under
    the harness that served it (the context policy, exemplars and ``keep_turns``; the token budget's
    trimming needs the model's tokenizer and is not redone here)."""
    from pipeline.errors import RatchetError
    from pipeline.harness import HarnessSpec
    from pipeline.serving.views import TurnMemory, TurnRecord, build_view

    if row.harness_version is None:
        return {}
    harness = HarnessSpec.model_validate(row.harness_version.spec)
    summaries = (row.meta or {}).get("summaries") or {}
    memory = TurnMemory()
    views: dict[int, Any] = {}
    for i, m in enumerate(messages):
        route = routes.get(i)
        if m.get("role") != "assistant" or route is None:
            continue
        try:
            views[i] = build_view(
                messages[:i],
                route["specialist"],
                harness=harness,
                memory=memory,
                count_tokens=lambda _view: 0,
                max_new_tokens=0,
            )
        except RatchetError as exc:
            views[i] = str(exc)
        memory.remember(m, TurnRecord(route["specialist"], str(summaries.get(str(i), ""))))
    return views


def trace_detail(*, session: Session, experience_id: int, lineage: str) -> dict[str, Any]:
    """One trace turn by turn: each turn's route decision (specialist, reason, signal scores), the view the
    specialist answered from and its hidden summary where it was served, every scorer's score under every
    contract version (and replaced scores), feedback, and the adapters it trained."""
    from sqlalchemy.orm import selectinload

    from pipeline.registry import (
        ContractVersion,
        DatasetExample,
        Experience,
        Generation,
        GenerationAdapter,
        Score,
        ScoreHistory,
        TrainingDataset,
    )

    row = session.scalar(
        select(Experience)
        .where(Experience.id == experience_id)
        .options(selectinload(Experience.harness_version))
    )
    if row is None:
        raise NotFoundError(f"no trace {experience_id}")
    messages = [m for m in (row.messages or []) if isinstance(m, dict)]
    routes = {int(r["turn"]): r for r in (row.routes or []) if isinstance(r, dict) and "turn" in r}
    meta = dict(row.meta or {})
    summaries = meta.pop("summaries", None) or {}
    views = _views(row, messages, routes) if routes else {}
    turns = []
    for i, m in enumerate(messages):
        turns.append(
            {
                "index": i,
                "role": str(m.get("role", "?")),
                "text": message_text(m) if not m.get("tool_calls") else str(m.get("content") or ""),
                "tool_calls": m.get("tool_calls") or [],
                "tool_call_id": m.get("tool_call_id"),
                "route": routes.get(i),
                "summary": summaries.get(str(i)),
                "view": views.get(i),
            }
        )
    contracts = {
        c.id: f"{c.name} {c.version}"
        for c in session.scalars(
            select(ContractVersion).where(
                ContractVersion.id.in_(select(Score.contract_version_id).where(Score.experience_id == row.id))
            )
        )
    }
    scores: dict[str, list[dict[str, Any]]] = {}
    for sc in session.scalars(select(Score).where(Score.experience_id == row.id).order_by(Score.scorer)):
        scores.setdefault(contracts.get(sc.contract_version_id, str(sc.contract_version_id)), []).append(
            {"scorer": sc.scorer, "value": sc.value, "verified": sc.verified, "details": sc.details}
        )
    history = [
        {
            "scorer": h.scorer,
            "value": h.value,
            "verified": h.verified,
            "reason": h.reason,
            "superseded_at": h.superseded_at.isoformat(),
        }  # fmt: skip
        for h in session.scalars(
            select(ScoreHistory).where(ScoreHistory.experience_id == row.id).order_by(ScoreHistory.id)
        )
    ]
    trained = session.execute(
        select(
            Generation.lineage, Generation.number, GenerationAdapter.specialist, GenerationAdapter.adapter_id
        )
        .select_from(DatasetExample)
        .join(TrainingDataset, TrainingDataset.id == DatasetExample.dataset_id)
        .join(Generation, Generation.id == TrainingDataset.generation_id)
        .join(
            GenerationAdapter,
            and_(
                GenerationAdapter.generation_id == Generation.id,
                GenerationAdapter.specialist == TrainingDataset.specialist,
            ),
        )
        .where(DatasetExample.experience_id == row.id)
        .order_by(Generation.number)
    ).all()
    generation = session.get(Generation, row.generation_id) if row.generation_id else None
    return {
        "id": row.id,
        "lineage": lineage,
        "source": row.source,
        "specialist": row.specialist,
        "generation": generation.number if generation else None,
        "generation_lineage": generation.lineage if generation else None,
        "harness": (
            f"{row.harness_version.name} {row.harness_version.version}" if row.harness_version else None
        ),
        "created_at": row.created_at.isoformat(),
        "completion_id": row.completion_id,
        "turns": turns,
        "metadata": meta,
        "feedback": row.feedback,
        "scores": scores,
        "score_history": history,
        "trained": [
            {
                "lineage": t.lineage,
                "generation": t.number,
                "specialist": t.specialist,
                "adapter_id": t.adapter_id,
            }
            for t in trained
        ],
    }
