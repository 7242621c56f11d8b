"""What the dashboard shows of one trace: the conversation turn by turn (each turn's route, the view its
specialist answered from, its hidden summary), who sent it and what they claimed, its final turn's verdict
beside every score under every contract version, feedback (counted, with who gave it, or claimed), and the
adapters it trained.

Who sent a trace is its *principal* (``pipeline.experience.principals``). What a client attached without the scope to
certify it is kept under ``metadata.claimed``, and feedback from a principal without ``rate``/``correct``
under ``feedback.claimed``: both are shown here labelled as claimed, and no scorer reads them. The verdict is
the ``final`` row's (``experience.final_status``): a trace whose final turn no verifying check passed reads
"not verified" or "failed: <checks>", never a score that looks like a pass.

The trace is untrusted: routes, scores, summaries, claims and feedback of an unexpected shape are left out or
shown as text (the pages escape everything).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import JsonValue
from sqlalchemy import and_, select

from pipeline.dashboard.conversation import neighbour_turns, offered_tools, served_token_counts
from pipeline.dashboard.experience import (
    FAILED,
    NOT_SCORED,
    PASSED,
    champion_contract,
    failed_checks,
    final_status,
    message_text,
)
from pipeline.dashboard.replies import (
    ChampionVerdict,
    FeedbackEntry,
    RouteDecision,
    ScoreChange,
    ScoreLine,
    TraceDetail,
    TrainedAdapter,
    Turn,
    Verdict,
)
from pipeline.errors import NotFoundError, RatchetError
from pipeline.experience.principals import ANONYMOUS, LOOP, OPERATOR
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
from pipeline.scoring.trace import FINAL, TOTAL
from pipeline.serving.views import TurnMemory, TurnRecord, build_view
from pipeline.specs.harness import HarnessSpec

if TYPE_CHECKING:
    from sqlalchemy.orm import Session


__all__ = ["trace_detail"]

TURNS_PER_PAGE = 200  # messages of one trace per page
VIEWS_PER_PAGE = 10  # each rebuilt view reads the conversation before it: bounded per page
FEEDBACK_FIELDS = ("rating", "correction")  # what a scorer may read of feedback (``feedback``, corrections)
PRINCIPAL_NOTES = {
    ANONYMOUS: "no API key: what it attached is claimed, never scored",
    OPERATOR: "the operator (ratchet ingest, or RATCHET_API_KEY)",
    LOOP: "the loop's own practice (collection, discovery, evaluation)",
}


def principal_note(principal: str | None) -> str:
    """What a principal is, in a few words."""
    if principal is None:
        return "served before principals were recorded: nobody vouched for what its client sent"
    return PRINCIPAL_NOTES.get(principal, "an API key the operator granted scopes to")


def _entries(doc: dict[str, JsonValue], fields: list[str]) -> list[FeedbackEntry]:
    """``fields`` of a feedback document, each with who gave it (``<field>_by`` when a name, else None)."""
    out = []
    for f in fields:
        by = doc.get(f"{f}_by")
        out.append(FeedbackEntry(field=f, value=doc[f], by=by if isinstance(by, str) else None))
    return out


def split_feedback(raw: JsonValue) -> tuple[list[FeedbackEntry], list[FeedbackEntry]]:
    """A trace's feedback as (counted, claimed) entries ``{"field", "value", "by"}``: the rating and correction
    at the top of the document, which the contract's scorers read, and everything under ``claimed`` (from
    principals without the scope to make it count), which none reads. A bare number or bool is a counted
    rating (``scorers.text.feedback_rating``); a ``claimed`` part of another shape is one entry, shown as text."""
    if isinstance(raw, bool | int | float):
        return [FeedbackEntry(field="rating", value=raw, by=None)], []
    if not isinstance(raw, dict):
        return [], []
    counted = _entries(raw, [f for f in FEEDBACK_FIELDS if f in raw])
    claimed_doc = raw.get("claimed")
    if claimed_doc is None:
        return counted, []
    if not isinstance(claimed_doc, dict):
        return counted, [FeedbackEntry(field="claimed", value=claimed_doc, by=None)]
    named = [f for f in FEEDBACK_FIELDS if f in claimed_doc]
    by_fields = {f"{f}_by" for f in claimed_doc}
    rest = sorted(k for k in claimed_doc if k not in FEEDBACK_FIELDS and k not in by_fields)
    return counted, _entries(claimed_doc, named + rest)


def _score_rows(rows: list[Score]) -> tuple[list[ScoreLine], Verdict]:
    """One contract version's score rows, each labelled with what it is (the final turn's, the mean over the
    turns, a scorer's) and what it says of the final turn; and that version's verdict."""
    final = next((r for r in rows if r.scorer == FINAL), None)
    total = next((r for r in rows if r.scorer == TOTAL), None)
    details = final.details if final is not None and isinstance(final.details, dict) else {}
    failed = failed_checks(details.get("failed")) if final is not None else []
    status = final_status(scored=final is not None, verified=final.verified if final else None, failed=failed)
    turn = details.get("turn") if isinstance(details.get("turn"), int) else None
    verified_by = details.get("verified_by") if isinstance(details.get("verified_by"), list) else []
    verdict = Verdict(
        status=status,
        verified=status == PASSED,  # passed: the only verdict that may be learned from
        value=final.value if final is not None else None,
        failed=failed,
        verified_by=[str(v) for v in verified_by],
        turn=turn,
        total=total.value if total is not None else None,
        # scored before ``final`` rows were recorded: ``ratchet score`` scores it again
        legacy=final is None and total is not None,
    )
    out = []
    for r in sorted(rows, key=lambda r: (r.scorer != FINAL, r.scorer != TOTAL, r.scorer)):
        if r.scorer == FINAL:
            label, check = (
                "the final assistant turn" + (f" (message {turn})" if turn is not None else ""),
                status,
            )
            if status == FAILED:
                check = f"failed: {', '.join(failed)}"
        elif r.scorer == TOTAL:
            label, check = "mean over the scored turns (shown, never selected on)", ""
        else:
            label = "scorer: mean over the turns it applied to"
            check = (
                "failed on the final turn"
                if r.scorer in failed
                else ("checked the final turn" if r.verified else "")
            )
        out.append(ScoreLine(scorer=r.scorer, value=r.value, verified=r.verified, details=r.details,
                             label=label, check=check))  # fmt: skip
    return out, verdict


def _views(
    row: Experience, messages: list[dict[str, JsonValue]], routes: dict[int, RouteDecision],
    summaries: dict[str, str], wanted: set[int],
) -> dict[int, list[dict[str, JsonValue]] | str]:  # fmt: skip
    """What the specialist of each turn in ``wanted`` was shown, rebuilt from the trace's routes and summaries
    under the harness that served it (the context policy, exemplars and ``keep_turns``; the token budget's
    trimming needs the model's tokenizer and is not redone here)."""

    if row.harness_version is None:
        return {}
    harness = HarnessSpec.model_validate(row.harness_version.spec)
    memory = TurnMemory()
    views: dict[int, list[dict[str, JsonValue]] | str] = {}
    for i, m in enumerate(messages[: max(wanted) + 1]):
        route = routes.get(i)
        if m.get("role") != "assistant" or route is None:
            continue
        if i in wanted:
            try:
                views[i] = build_view(messages[:i], route.specialist, harness=harness, memory=memory,
                                      count_tokens=lambda _view: 0, max_new_tokens=0)  # fmt: skip
            except (RatchetError, TypeError, ValueError, AttributeError) as exc:  # a trace of odd shape
                views[i] = f"cannot rebuild this view: {exc}"
        memory.remember(m, TurnRecord(route.specialist, summaries.get(str(i), "")))
    return views


def _number_or_text(value: JsonValue) -> float | str:
    return value if isinstance(value, int | float) and not isinstance(value, bool) else str(value)


def _routes(raw: JsonValue) -> dict[int, RouteDecision]:
    """The trace's route entries by turn, as the dashboard shows them (entries of another shape left out)."""
    out: dict[int, RouteDecision] = {}
    for r in raw if isinstance(raw, list) else []:
        turn = r.get("turn") if isinstance(r, dict) else None
        if not isinstance(turn, int) or isinstance(turn, bool):
            continue
        scores = r.get("scores") if isinstance(r.get("scores"), dict) else {}
        out[turn] = RouteDecision(
            turn=turn,
            specialist=str(r.get("specialist", "")),
            reason=str(r.get("reason", "")),
            scores={
                str(k): (
                    {str(a): _number_or_text(b) for a, b in v.items()}
                    if isinstance(v, dict)
                    else {"": str(v)}
                )
                for k, v in scores.items()
            },
        )
    return out


def trace_detail(
    *, session: Session, experience_id: int, lineage: str, turn_offset: int = 0, token_ids: bool = False
) -> TraceDetail:
    """One trace turn by turn (``TURNS_PER_PAGE`` messages from ``turn_offset``): each turn's route decision
    (specialist, reason, signal scores), the view the specialist answered from (for the newest
    ``VIEWS_PER_PAGE`` served turns of the page) and its hidden summary where it was served; its principal;
    its metadata and, apart, what its client claimed; its final turn's verdict under the champion's contract
    of ``lineage`` (``verdict``) and under each contract version that scored it (``finals``), beside every
    scorer's score, labelled (and replaced scores); its feedback, counted (with who gave it) and claimed; the
    adapters it trained; its conversation and the turns beside it there; the tools its client offered; and
    per served assistant message the token ids' counts and tokenizer (the ids themselves with ``token_ids``)."""
    from sqlalchemy.orm import selectinload

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
    claimed_metadata = meta.pop("claimed", None)
    window = range(max(0, turn_offset), min(len(messages), max(0, turn_offset) + TURNS_PER_PAGE))
    shown = [i for i in window if i in routes and messages[i].get("role") == "assistant"][-VIEWS_PER_PAGE:]
    views = _views(row, messages, routes, summaries, set(shown)) if shown else {}
    tokens = served_token_counts(row.served_tokens, ids=token_ids)
    turns = []
    for i in window:
        m = messages[i]
        turns.append(
            Turn(
                index=i,
                role=str(m.get("role", "?")),
                text=message_text(m) if not m.get("tool_calls") else str(m.get("content") or ""),
                tool_calls=m.get("tool_calls") if isinstance(m.get("tool_calls"), list) else [],
                tool_call_id=m.get("tool_call_id"),
                route=routes.get(i),
                summary=summaries.get(str(i)),
                view=views.get(i),
                tokens=tokens.get(i),
            )
        )
    contracts = {
        c.id: f"{c.name} {c.version}"
        for c in session.scalars(
            select(ContractVersion).where(
                ContractVersion.id.in_(select(Score.contract_version_id).where(Score.experience_id == row.id))
            )
        )
    }
    by_contract: dict[int, list[Score]] = {}
    for sc in session.scalars(select(Score).where(Score.experience_id == row.id).order_by(Score.scorer)):
        by_contract.setdefault(sc.contract_version_id, []).append(sc)
    scores: dict[str, list[ScoreLine]] = {}
    verdicts: dict[int, Verdict] = {}
    for contract_id, rows in by_contract.items():
        scores[contracts.get(contract_id, str(contract_id))], verdicts[contract_id] = _score_rows(rows)
    champion_id = champion_contract(session, lineage)
    unscored = Verdict(status=NOT_SCORED, verified=False, value=None, failed=[], verified_by=[], turn=None,
                       total=None, legacy=False)  # fmt: skip
    verdict = ChampionVerdict(
        **verdicts.get(champion_id, unscored).model_dump(),  # type: ignore[arg-type]
        contract=None if champion_id is None else contracts.get(champion_id) or _contract_label(session, champion_id),
    )  # fmt: skip
    counted_feedback, claimed_feedback = split_feedback(row.feedback)
    history = [
        ScoreChange(
            scorer=h.scorer,
            value=h.value,
            verified=h.verified,
            reason=h.reason,
            superseded_at=h.superseded_at.isoformat(),
        )  # fmt: skip
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
    conversation = row.conversation_id
    previous, following = (
        neighbour_turns(session, conversation_id=conversation, experience_id=row.id)
        if conversation is not None
        else (None, None)
    )
    return TraceDetail(
        id=row.id,
        lineage=lineage,
        source=row.source,
        specialist=row.specialist,
        generation=generation.number if generation else None,
        generation_lineage=generation.lineage if generation else None,
        harness=f"{row.harness_version.name} {row.harness_version.version}" if row.harness_version else None,
        created_at=row.created_at.isoformat(),
        completion_id=row.completion_id,
        principal=row.principal,  # None: served before principals were recorded
        principal_note=principal_note(row.principal),
        turns=turns,
        turn_count=len(messages),
        turn_offset=window.start,
        next_turns=window.stop if window.stop < len(messages) else None,
        previous_turns=max(0, window.start - TURNS_PER_PAGE) if window.start > 0 else None,
        metadata=meta,
        claimed_metadata=claimed_metadata,  # what the client sent without `certify`: never scored
        feedback=row.feedback,
        counted_feedback=counted_feedback,
        claimed_feedback=claimed_feedback,
        verdict=verdict,
        finals={contracts.get(i, str(i)): v for i, v in verdicts.items()},
        scores=scores,
        score_history=history,
        trained=[
            TrainedAdapter(
                lineage=t.lineage, generation=t.number, specialist=t.specialist, adapter_id=t.adapter_id
            )
            for t in trained
        ],
        conversation_id=conversation,
        conversation_previous=previous,
        conversation_next=following,
        tools=offered_tools(row.tools),
    )


def _contract_label(session: Session, contract_id: int) -> str | None:

    c = session.get(ContractVersion, contract_id)
    return f"{c.name} {c.version}" if c else None
