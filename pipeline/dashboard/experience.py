"""What the dashboard shows of experience: filtered keyset pages of traces (one trace turn by turn is
``trace``), and what a trace's final turn is worth.

Pages go newest first by id (keyset: ``before``/``after`` an id, never an offset, never a count of the
table). A filter an index serves (one of generation, specialist, source, principal, conversation) is one
indexed query. Any other filter (free text, score range, feedback, verification, or several at once) walks the
ids downward in windows until the page is full or a time budget is spent, and then says how far down it
searched, so a rare match costs a bounded wait per page instead of a scan of a million rows.

A trace's score and verdict are its ``final`` row's under the champion's contract (``scoring.trace``): the
final assistant turn, the only one a trace can teach. Its verdict (``final_status``) is *passed* (a verifying
check applied and none failed: the only one that may be learned from), *failed* (with the checks that
failed), *not verified* (no verifying check applied: its score is form only, never shown as a pass), or
*not scored* (no ``final`` row under that contract, e.g. scored before those rows existed). The ``total`` row
(the mean over every scored turn) is shown on the trace page beside it, labelled, and never read as a verdict.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator
from sqlalchemy import and_, func, select

from pipeline.dashboard.replies import ExperiencePage, Status, TraceRow
from pipeline.errors import NotFoundError
from pipeline.experience.eligibility import UNKNOWN_PRINCIPAL
from pipeline.experience.texts import message_text as content_text
from pipeline.registry import Generation, Score, get_champion
from pipeline.registry.experience import RAW_EXPERIENCE
from pipeline.registry.models import load_json
from pipeline.scoring.trace import FINAL

if TYPE_CHECKING:
    from sqlalchemy import ColumnElement, Label, Row, Select
    from sqlalchemy.orm import Session

__all__ = [
    "FAILED",
    "NOT_SCORED",
    "NOT_VERIFIED",
    "PASSED",
    "ExperienceQuery",
    "champion_contract",
    "failed_checks",
    "final_status",
    "list_experience",
    "message_text",
]

SCAN_BUDGET_S = 0.15  # per page, for filters no index serves
FIRST_WINDOW = 2_000  # ids in the first scanned window; the next ones are sized to the time left
MAX_WINDOW = 160_000
MIN_WINDOW = 1_000
PASSED, FAILED, NOT_VERIFIED, NOT_SCORED = "passed", "failed", "not verified", "not scored"


def final_status(*, scored: bool, verified: bool | None, failed: list[str]) -> Status:
    """A trace's verdict from its ``final`` row (see the module doc): ``scored`` (the row exists), its
    ``verified`` (a verifying scorer applied to the final turn) and ``failed`` (the verifying checks on it
    that failed). A failed check wins over anything the row says beside it."""
    if not scored:
        return NOT_SCORED
    if failed:
        return FAILED
    return PASSED if verified else NOT_VERIFIED


def failed_checks(raw: JsonValue) -> list[str]:
    """The ``failed`` list of a ``final`` row's details (the list, or its JSON text), as names; anything of
    another shape is kept as one name, so that it still reads as a failure."""
    if isinstance(raw, str):
        try:
            raw = load_json(raw)
        except ValueError:
            return [raw]
    if raw is None:
        return []
    if isinstance(raw, list):
        return [c if isinstance(c, str) else str(c) for c in raw]
    return [str(raw)]


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
    principal: str | None = Field(
        default=None,
        max_length=100,
        description=f"Traces sent by this principal (an API key's name, `anonymous`, `operator`, `ratchet`; "
        f"`{UNKNOWN_PRINCIPAL}`: served before principals were recorded).",
    )
    score_min: float | None = Field(
        default=None, description="Lowest score of the final turn (under the champion's contract)."
    )
    score_max: float | None = Field(default=None, description="Highest score of the final turn.")
    feedback: Literal["any", "none", "rating", "correction", "claimed"] | None = Field(
        default=None,
        description="Traces with any feedback, none, a counted rating, a counted correction, or feedback "
        "kept as claimed (from a principal without the `rate`/`correct` scope; never scored).",
    )
    verified: Literal["yes", "failed", "no", "unscored"] | None = Field(
        default=None,
        description="The final turn's verdict under the champion's contract: `yes` passed (a verifying check "
        "applied and none failed), `failed` (a verifying check failed), `no` not verified (no verifying check "
        "applied), `unscored` (no final-turn score under that contract yet).",
    )
    conversation: str | None = Field(
        default=None, max_length=100, description="Turns of this conversation (its `conversation_id`)."
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
        "lineage", "generation", "specialist", "source", "principal", "score_min", "score_max", "feedback",
        "verified", "conversation", "q", "before", "after", mode="before",
    )  # fmt: skip
    @classmethod
    def _blank_is_unset(cls, value: object) -> object:
        return None if isinstance(value, str) and not value.strip() else value  # an empty form field

    def active(self) -> dict[str, str | int | float]:
        """The filters in use (no cursor), for links that keep them."""
        return {
            k: v
            for k, v in self.model_dump(exclude={"before", "after", "limit", "lineage"}).items()
            if v is not None and v != ""
        }


def message_text(message: dict[str, JsonValue]) -> str:
    """A message's text (``pipeline.experience.texts.message_text``), else its tool calls as ``name(arguments)``."""

    text = content_text(message)
    calls = message.get("tool_calls") or []
    if calls and not text:
        text = "; ".join(
            f"{(c.get('function') or {}).get('name', '?')}({(c.get('function') or {}).get('arguments', '')})"
            for c in calls
            if isinstance(c, dict)
        )
    return text


def champion_contract(session: Session, lineage: str) -> int | None:
    """The contract version of ``lineage``'s champion (what pages score traces under); None without one."""

    champion = get_champion(session=session, lineage=lineage)
    return champion.contract_version_id if champion else None


def list_experience(
    *, session: Session, lineage: str, query: ExperienceQuery, budget_s: float = SCAN_BUDGET_S
) -> ExperiencePage:
    """One page of traces matching ``query``, newest first, with the cursors of the next pages. Each trace
    carries its final turn's score and verdict under the champion's contract (``status``, ``verified``: it
    passed, ``failed``: the checks that failed), its principal, and whether its feedback counts or is claimed."""

    e, s = RAW_EXPERIENCE, Score.__table__
    dialect = session.get_bind().dialect.name
    numbers = dict(
        session.execute(select(Generation.id, Generation.number).where(Generation.lineage == lineage)).all()
    )
    contract_id = champion_contract(session, lineage)
    failed_text, failed_count = _failed_sql(s.c.details, dialect)
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
    if query.principal:
        unknown = query.principal == UNKNOWN_PRINCIPAL
        conditions.append(e.c.principal.is_(None) if unknown else e.c.principal == query.principal)
        indexed += 1
    if query.conversation is not None:
        conditions.append(e.c.conversation_id == query.conversation)
        indexed += 1
    scanned = indexed > 1
    if query.score_min is not None:
        conditions.append(s.c.value >= query.score_min)
    if query.score_max is not None:
        conditions.append(s.c.value <= query.score_max)
    if query.verified == "yes":
        conditions.append(and_(s.c.verified.is_(True), failed_count == 0))
    elif query.verified == "failed":
        conditions.append(and_(s.c.id.is_not(None), failed_count > 0))
    elif query.verified == "no":
        conditions.append(and_(s.c.id.is_not(None), s.c.verified.is_not(True), failed_count == 0))
    elif query.verified == "unscored":
        conditions.append(s.c.id.is_(None))
    if query.feedback == "none":
        conditions.append(e.c.feedback.is_(None))
    elif query.feedback == "any":
        conditions.append(and_(e.c.feedback.is_not(None), e.c.feedback != "null"))
    elif query.feedback is not None:  # a key at the top of the document: counted (or the claimed part)
        conditions.append(_has_key(e.c.feedback, query.feedback, dialect))
    if query.q:
        pattern = "%" + query.q.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        text_match = (
            e.c.messages.ilike(pattern, escape="\\")
            if dialect == "postgresql"
            else e.c.messages.like(pattern, escape="\\")  # SQLite's LIKE ignores ASCII case already
        )
        conditions.append(text_match)
    scanned = scanned or len(conditions) > indexed
    prompt, answer, tool = _previews(e.c.messages, dialect)

    def columns(*bounds: ColumnElement[bool]) -> Select:
        # the id window bounds the score side of the join too: PostgreSQL then probes the score index for
        # the window's ids instead of hashing every score of the contract (an anti-join for "unscored")
        on = and_(
            s.c.experience_id == e.c.id,
            s.c.contract_version_id == contract_id,
            s.c.scorer == FINAL,
            *bounds,
        )
        return select(
            e.c.id, e.c.created_at, e.c.source, e.c.specialist, e.c.principal, e.c.generation_id, e.c.feedback,
            e.c.conversation_id, prompt, answer, tool, s.c.id.label("score_id"), s.c.value, s.c.verified,
            failed_text,
        ).select_from(e.outerjoin(s, on))  # fmt: skip

    newer = query.after is not None and query.before is None
    order = e.c.id.asc() if newer else e.c.id.desc()
    # two single-aggregate queries: SQLite answers each from the primary key, a min and max together scan
    lowest = session.scalar(select(func.min(e.c.id)))
    highest = session.scalar(select(func.max(e.c.id)))
    rows: list[Row] = []
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
    items = [_item(r, numbers) for r in rows]
    first_id, last_id = (items[0].id, items[-1].id) if items else (None, None)
    if newer:  # walking up: older is where this page starts, newer where it ends or where the scan stopped
        older = last_id if last_id is not None and last_id > lowest else None
        newer_cursor = searched_to - 1 if searched_to is not None else (first_id if more else None)
    else:
        older = last_id if more else searched_to
        newer_cursor = first_id if query.before is not None and first_id is not None else None
    return ExperiencePage(
        lineage=lineage,
        filters=query.active(),
        traces=items,
        older=older,  # pass as ``before``
        newer=newer_cursor,  # pass as ``after``
        searched_to=searched_to,  # set when the page stopped early: ids beyond it are not searched yet
        direction="newer" if newer else "older",
        scanned=scanned,
        contract_version_id=contract_id,
        newest_id=highest,
    )


def _item(r: Row, numbers: dict[int, int]) -> TraceRow:
    """One row of the list as the API returns it."""
    scored = r.score_id is not None
    failed = failed_checks(r.failed) if scored else []
    status = final_status(scored=scored, verified=r.verified, failed=failed)
    feedback = _feedback_doc(r.feedback)
    return TraceRow(
        id=r.id,
        created_at=r.created_at.isoformat() if hasattr(r.created_at, "isoformat") else str(r.created_at),
        source=r.source,
        specialist=r.specialist,
        principal=r.principal,  # None: served before principals were recorded
        generation=numbers.get(r.generation_id),
        prompt=_text(r.prompt),
        answer=_text(r.answer) or (f"tool call {_text(r.tool)}" if r.tool else ""),
        score=r.value if scored else None,  # the final turn's, whatever its verdict: read ``status``
        status=status,
        verified=None if status == NOT_SCORED else status == PASSED,
        failed=failed,
        feedback=feedback is not None,
        feedback_counted=isinstance(feedback, dict) and ("rating" in feedback or "correction" in feedback),
        feedback_claimed=isinstance(feedback, dict) and "claimed" in feedback,
        conversation_id=r.conversation_id,
    )


def _feedback_doc(text: str | None) -> JsonValue:
    """A trace's stored feedback document (None when there is none); text that is not JSON stays text."""
    if text is None or text == "null":
        return None
    try:
        return load_json(text)
    except ValueError:
        return text


def _failed_sql(details: ColumnElement, dialect: str) -> tuple[Label, ColumnElement[int]]:
    """SQL for a score row's ``details.failed``: its JSON text (for display) and how many checks it names (a
    list's length; 0 when absent or null; 1 for anything else, which ``failed_checks`` shows as one)."""
    from sqlalchemy import case, cast

    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import JSONB

        doc = cast(details, JSONB)["failed"]
        kind, length, text = func.jsonb_typeof(doc), func.jsonb_array_length(doc), doc.astext
    else:
        kind = func.json_type(details, "$.failed")
        length, text = func.json_array_length(details, "$.failed"), func.json_extract(details, "$.failed")
    count = case((kind == "array", length), (kind.is_(None) | (kind == "null"), 0), else_=1)
    return text.label("failed"), count


def _has_key(feedback: ColumnElement, key: str, dialect: str) -> ColumnElement[bool]:
    """SQL: the stored feedback document has ``key`` at its top (a counted ``rating`` or ``correction``, or the
    ``claimed`` part) -- not merely somewhere inside it, as a claimed rating is. The LIKE goes first: it
    rules out most documents without parsing them."""
    from sqlalchemy import case, cast

    quoted = f'%"{key}"%'
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import JSONB

        return and_(feedback.like(quoted), cast(feedback, JSONB)[key].is_not(None))
    return and_(
        feedback.like(quoted),
        case((func.json_valid(feedback) == 1, func.json_type(feedback, f"$.{key}")), else_=None).is_not(None),
    )


PREVIEW_CHARS = 200


def _previews(messages: ColumnElement, dialect: str) -> tuple[Label, Label, Label]:
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


def _text(value: object) -> str:
    text = "" if value is None else str(value)
    return text[:PREVIEW_CHARS] + ("…" if len(text) > PREVIEW_CHARS else "")
