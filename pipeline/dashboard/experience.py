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
FIRST_WINDOW = 2_000  # ids in the first scanned window; the next ones are sized to the time left
TURNS_PER_PAGE = 200  # messages of one trace per page
VIEWS_PER_PAGE = 10  # each rebuilt view reads the conversation before it: bounded per page
MAX_WINDOW = 160_000
MIN_WINDOW = 1_000


class ExperienceQuery(BaseModel):
    """The experience page's filters and cursor (query parameters of ``/experience`` and its API)."""

    model_config = ConfigDict(extra="forbid")

    lineage: str | None = Field(
        default=None,
        max_length=100,
        description="Lineage (default: the dashboard's) of `generation` and scores.",
    )
    generation: int | None = Field(
        default=None, ge=0, le=2**31, description="Traces served by this generation number."
    )
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
    before: int | None = Field(
        default=None, ge=1, le=2**63 - 1, description="Older than this trace id (next page)."
    )
    after: int | None = Field(
        default=None, ge=0, le=2**63 - 1, description="Newer than this trace id (previous page)."
    )
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
    """A message's text (``serving.router.message_text``), else its tool calls as ``name(arguments)``."""
    from pipeline.serving.router import message_text as content_text

    text = content_text(message)
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
    prompt, answer, tool = _previews(e.c.messages, session.get_bind().dialect.name)

    def columns(*bounds: Any) -> Any:
        # the id window bounds the score side of the join too: PostgreSQL then probes the score index for
        # the window's ids instead of hashing every score of the contract (an anti-join for "unscored")
        on = and_(
            s.c.experience_id == e.c.id,
            s.c.contract_version_id == contract_id,
            s.c.scorer == "total",
            *bounds,
        )
        return select(
            e.c.id, e.c.created_at, e.c.source, e.c.specialist, e.c.generation_id, e.c.feedback, prompt, answer,
            tool, s.c.value, s.c.verified,
        ).select_from(e.outerjoin(s, on))  # fmt: skip

    newer = query.after is not None and query.before is None
    order = e.c.id.asc() if newer else e.c.id.desc()
    # two single-aggregate queries: SQLite answers each from the primary key, a min and max together scan
    lowest = session.scalar(select(func.min(e.c.id)))
    highest = session.scalar(select(func.max(e.c.id)))
    rows: list[Any] = []
    searched_to: int | None = None
    if lowest is not None:
        before = min(query.before, highest + 1) if query.before is not None else highest + 1
        after = max(query.after, lowest - 1) if newer and query.after is not None else lowest - 1
        if not scanned:
            cursor = e.c.id > after if newer else e.c.id < before
            rows = list(
                session.execute(columns().where(*conditions, cursor).order_by(order).limit(query.limit + 1))
            )
        else:
            started, window = time.perf_counter(), FIRST_WINDOW
            edge = after + 1 if newer else before
            while len(rows) <= query.limit:
                lo, hi = (edge, edge + window) if newer else (edge - window, edge)
                bounds = (s.c.experience_id >= lo, s.c.experience_id < hi)
                stmt = columns(*bounds).where(*conditions, e.c.id >= lo, e.c.id < hi)
                window_started = time.perf_counter()
                rows += list(session.execute(stmt.order_by(order).limit(query.limit + 1 - len(rows))))
                now = time.perf_counter()
                edge = hi if newer else lo
                if (edge > highest) if newer else (edge <= lowest):
                    break
                left = budget_s - (now - started)
                if left <= 0 and len(rows) <= query.limit:
                    searched_to = edge  # stopped early: the ids beyond ``edge`` are not searched yet
                    break
                # the next window takes at most half the time left at the rate this one ran (at least
                # MIN_WINDOW ids, so that a page always gets on), doubling at most
                rate = window / max(now - window_started, 1e-6)
                window = int(max(MIN_WINDOW, min(window * 2, MAX_WINDOW, rate * max(left, 0.0) / 2)))
    more = len(rows) > query.limit
    rows = rows[: query.limit]
    if newer:
        rows.reverse()
    items = [
        {
            "id": r.id,
            "created_at": r.created_at.isoformat()
            if hasattr(r.created_at, "isoformat")
            else str(r.created_at),
            "source": r.source,
            "specialist": r.specialist,
            "generation": numbers.get(r.generation_id),
            "prompt": _text(r.prompt),
            "answer": _text(r.answer) or (f"tool call {_text(r.tool)}" if r.tool else ""),
            "score": r.value,
            "verified": r.verified,
            "feedback": r.feedback not in (None, "null"),
        }
        for r in rows
    ]
    first_id, last_id = (items[0]["id"], items[-1]["id"]) if items else (None, None)
    if newer:  # walking up: older is where this page starts, newer where it ends or where the scan stopped
        older = last_id if last_id is not None and last_id > lowest else None
        newer_cursor = searched_to - 1 if searched_to is not None else (first_id if more else None)
    else:
        older = last_id if more else searched_to
        newer_cursor = first_id if query.before is not None and first_id is not None else None
    return {
        "lineage": lineage,
        "filters": query.active(),
        "traces": items,
        "older": older,  # pass as ``before``
        "newer": newer_cursor,  # pass as ``after``
        "searched_to": searched_to,  # set when the page stopped early: ids beyond it are not searched yet
        "direction": "newer" if newer else "older",
        "scanned": scanned,
        "contract_version_id": contract_id,
        "newest_id": highest,
    }


PREVIEW_CHARS = 200


def _previews(messages: Any, dialect: str) -> tuple[Any, Any, Any]:
    """SQL for a trace's first prompt, last message and last tool call's name, cut to ``PREVIEW_CHARS``:
    a list page reads a few hundred characters per trace, not whole conversations."""
    from sqlalchemy import case, cast

    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import JSONB

        doc = cast(messages, JSONB)
        first = case(
            (doc[0]["role"].astext == "system", doc[1]["content"].astext), else_=doc[0]["content"].astext
        )
        last, tool = doc[-1]["content"].astext, doc[-1]["tool_calls"][0]["function"]["name"].astext
    else:
        role = func.json_extract(messages, "$[0].role")
        first = case(
            (role == "system", func.json_extract(messages, "$[1].content")),
            else_=func.json_extract(messages, "$[0].content"),
        )
        last = func.json_extract(messages, "$[#-1].content")
        tool = func.json_extract(messages, "$[#-1].tool_calls[0].function.name")
    cut = PREVIEW_CHARS + 1
    return (
        func.substr(first, 1, cut).label("prompt"),
        func.substr(last, 1, cut).label("answer"),
        func.substr(tool, 1, 100).label("tool"),
    )


def _text(value: Any) -> str:
    text = "" if value is None else str(value)
    return text[:PREVIEW_CHARS] + ("…" if len(text) > PREVIEW_CHARS else "")


def _views(
    row: Any, messages: list[dict[str, Any]], routes: dict[int, dict[str, Any]], summaries: dict[str, str],
    wanted: set[int],
) -> dict[int, Any]:  # fmt: skip
    """What the specialist of each turn in ``wanted`` was shown, rebuilt from the trace's routes and summaries
    under the harness that served it (the context policy, exemplars and ``keep_turns``; the token budget's
    trimming needs the model's tokenizer and is not redone here)."""
    from pipeline.errors import RatchetError
    from pipeline.harness import HarnessSpec
    from pipeline.serving.views import TurnMemory, TurnRecord, build_view

    if row.harness_version is None:
        return {}
    harness = HarnessSpec.model_validate(row.harness_version.spec)
    memory = TurnMemory()
    views: dict[int, Any] = {}
    for i, m in enumerate(messages[: max(wanted) + 1]):
        route = routes.get(i)
        if m.get("role") != "assistant" or route is None:
            continue
        if i in wanted:
            try:
                views[i] = build_view(messages[:i], route["specialist"], harness=harness, memory=memory,
                                      count_tokens=lambda _view: 0, max_new_tokens=0)  # fmt: skip
            except (RatchetError, TypeError, ValueError, AttributeError) as exc:  # a trace of odd shape
                views[i] = f"cannot rebuild this view: {exc}"
        memory.remember(m, TurnRecord(route["specialist"], summaries.get(str(i), "")))
    return views


def _number_or_text(value: Any) -> float | str:
    return value if isinstance(value, int | float) and not isinstance(value, bool) else str(value)


def _routes(raw: Any) -> dict[int, dict[str, Any]]:
    """The trace's route entries by turn, as the dashboard shows them (entries of another shape left out)."""
    out: dict[int, dict[str, Any]] = {}
    for r in raw if isinstance(raw, list) else []:
        turn = r.get("turn") if isinstance(r, dict) else None
        if not isinstance(turn, int) or isinstance(turn, bool):
            continue
        scores = r.get("scores") if isinstance(r.get("scores"), dict) else {}
        out[turn] = {
            "turn": turn,
            "specialist": str(r.get("specialist", "")),
            "reason": str(r.get("reason", "")),
            "scores": {
                str(k): (
                    {str(a): _number_or_text(b) for a, b in v.items()}
                    if isinstance(v, dict)
                    else {"": str(v)}
                )
                for k, v in scores.items()
            },
        }
    return out


def trace_detail(
    *, session: Session, experience_id: int, lineage: str, turn_offset: int = 0
) -> dict[str, Any]:
    """One trace turn by turn (``TURNS_PER_PAGE`` messages from ``turn_offset``): each turn's route decision
    (specialist, reason, signal scores), the view the specialist answered from (for the newest
    ``VIEWS_PER_PAGE`` served turns of the page) and its hidden summary where it was served, every scorer's
    score under every contract version (and replaced scores), feedback, and the adapters it trained. The
    trace is untrusted: routes, scores and summaries of an unexpected shape are left out or shown as text."""
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
    messages = [m for m in (row.messages if isinstance(row.messages, list) else []) if isinstance(m, dict)]
    routes = _routes(row.routes)
    meta = dict(row.meta) if isinstance(row.meta, dict) else {"value": row.meta}
    summaries = meta.pop("summaries", None)
    summaries = {str(k): str(v) for k, v in summaries.items()} if isinstance(summaries, dict) else {}
    window = range(max(0, turn_offset), min(len(messages), max(0, turn_offset) + TURNS_PER_PAGE))
    shown = [i for i in window if i in routes and messages[i].get("role") == "assistant"][-VIEWS_PER_PAGE:]
    views = _views(row, messages, routes, summaries, set(shown)) if shown else {}
    turns = []
    for i in window:
        m = messages[i]
        turns.append(
            {
                "index": i,
                "role": str(m.get("role", "?")),
                "text": message_text(m) if not m.get("tool_calls") else str(m.get("content") or ""),
                "tool_calls": m.get("tool_calls") if isinstance(m.get("tool_calls"), list) else [],
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
        "turn_count": len(messages),
        "turn_offset": window.start,
        "next_turns": window.stop if window.stop < len(messages) else None,
        "previous_turns": max(0, window.start - TURNS_PER_PAGE) if window.start > 0 else None,
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
