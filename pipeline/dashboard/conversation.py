"""What the dashboard shows of a conversation: the traces that share a ``conversation_id`` (a Responses
``previous_response_id`` chain, or the conversation or session id a client or an imported trace gave), turn by
turn in the order they were recorded; and what a trace's client offered and was served (its tools, its token
ids' counts).

Each trace of a conversation stores the whole conversation up to its answer, so a turn is shown as what it
added: the messages after the longest prefix it shares with the turn before (compared by role, text, tool
calls and the call a tool message answers, not by how the client spelled them). A client that rewrote or
trimmed its history shares less than the turn before held: ``dropped`` says how many of those messages it did
not repeat. Pages are keyset pages over the conversation's index (``after``/``before`` a trace id), each turn
showing at most ``MESSAGES_PER_TURN`` added messages; its trace page has the rest.

Everything here is untrusted client text (the id, the messages, the tools' names and descriptions): the pages
escape it, and a tools list or token record of an unexpected shape is shown as far as it reads.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from pydantic import Field, JsonValue
from sqlalchemy import func, select

from pipeline.dashboard.experience import NOT_SCORED, champion_contract, failed_checks, final_status
from pipeline.dashboard.replies import OfferedTool, Reply, ServedTokenCounts, Status
from pipeline.errors import NotFoundError
from pipeline.experience.texts import message_text
from pipeline.registry import Experience, Generation, Score
from pipeline.scoring.trace import FINAL

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

__all__ = [
    "ConversationDetail",
    "conversation_detail",
    "neighbour_turns",
    "offered_tools",
    "served_token_counts",
]

TURNS_PER_PAGE, MAX_TURNS_PER_PAGE = 20, 100
MESSAGES_PER_TURN = 40  # added messages shown per turn; the trace page has them all
MAX_TOOLS = 200  # tools shown of one turn's list


class ConversationMessage(Reply):
    index: int = Field(description="Its index in the trace's messages.")
    role: str = Field(description="user, assistant, tool, system.")
    text: str = Field(description="Its text (untrusted).")
    tool_calls: list[JsonValue] = Field(description="Its tool calls as stored.")
    tool_call_id: JsonValue = Field(description="The tool call a tool message answers.")


class ConversationTurn(Reply):
    id: int = Field(description="The turn's trace id.")
    created_at: str = Field(description="When it was recorded (ISO 8601).")
    source: str = Field(description="deployment, simulation, import, ...")
    specialist: str | None = Field(description="The specialist that served it.")
    generation: int | None = Field(description="The generation that served it.")
    generation_lineage: str | None = Field(description="That generation's lineage.")
    principal: str | None = Field(description="Who sent it (null: served before principals were recorded).")
    messages: int = Field(description="Messages its trace holds (the conversation up to its answer).")
    shared: int = Field(description="Leading messages it shares with the turn before (0 for the first).")
    dropped: int = Field(
        description="Messages of the turn before that it does not repeat (its client rewrote or trimmed them)."
    )
    added: list[ConversationMessage] = Field(
        description=f"What it added after the shared messages (at most {MESSAGES_PER_TURN})."
    )
    more_added: int = Field(description="Added messages not shown here (its trace page has them).")
    score: float | None = Field(
        description="Its final turn's score under the champion's contract: read `status`."
    )
    status: Status = Field(description="Its final turn's verdict under the champion's contract.")
    failed: list[str] = Field(description="The verifying checks that failed on its final turn.")


class ConversationDetail(Reply):
    conversation_id: str = Field(description="The conversation's id (untrusted client text).")
    lineage: str = Field(description="The lineage whose champion's contract gives the verdicts.")
    contract_version_id: int | None = Field(description="The champion's contract version of the verdicts.")
    turns: list[ConversationTurn] = Field(description="This page's turns, oldest first.")
    first_id: int = Field(description="The conversation's first trace id.")
    last_id: int = Field(description="Its latest trace id.")
    previous: int | None = Field(description="`before` of the earlier page; null on the first.")
    next: int | None = Field(description="`after` of the later page; null on the last.")


def _arguments(value: object) -> object:
    """Tool-call arguments in one spelling: JSON text parsed (a client re-serialises what the server wrote)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _key(message: dict[str, JsonValue]) -> str:
    """What a message says, whatever its spelling: role, text, tool calls, the call a tool message answers."""
    calls = message.get("tool_calls") if isinstance(message.get("tool_calls"), list) else []
    said = [
        [(c.get("function") or {}).get("name"), _arguments((c.get("function") or {}).get("arguments"))]
        if isinstance(c, dict) and isinstance(c.get("function"), dict)
        else c
        for c in calls  # type: ignore[union-attr]
    ]
    parts = [message.get("role"), message_text(message), said, message.get("tool_call_id")]
    return json.dumps(parts, sort_keys=True, default=str)


def _messages(raw: JsonValue) -> list[dict[str, JsonValue]]:
    return [m for m in raw if isinstance(m, dict)] if isinstance(raw, list) else []


def _shared(before: list[str], now: list[str]) -> int:
    n = 0
    for a, b in zip(before, now, strict=False):
        if a != b:
            break
        n += 1
    return n


def _shown(index: int, m: dict[str, JsonValue]) -> ConversationMessage:
    calls = m.get("tool_calls")
    return ConversationMessage(
        index=index,
        role=str(m.get("role", "?")),
        text=message_text(m) if not calls else str(m.get("content") or ""),
        tool_calls=calls if isinstance(calls, list) else [],
        tool_call_id=m.get("tool_call_id"),
    )


def conversation_detail(
    *,
    session: Session,
    conversation_id: str,
    lineage: str,
    after: int | None = None,
    before: int | None = None,
    limit: int = TURNS_PER_PAGE,
) -> ConversationDetail:
    """One page of a conversation's turns, oldest first: from its start, ``after`` a trace id (the next page)
    or ``before`` one (the previous page). Each turn shows what it added to the turn before, who sent it,
    what served it and its final turn's verdict under the champion's contract of ``lineage``."""
    e = Experience
    mine = e.conversation_id == conversation_id
    first_id = session.scalar(select(func.min(e.id)).where(mine))
    if first_id is None:
        raise NotFoundError(f"no conversation {conversation_id!r}")
    last_id = session.scalar(select(func.max(e.id)).where(mine))
    limit = max(1, min(limit, MAX_TURNS_PER_PAGE))
    cols = select(e.id, e.created_at, e.source, e.specialist, e.principal, e.generation_id, e.messages)
    backwards = before is not None and after is None
    if backwards:
        rows = list(session.execute(cols.where(mine, e.id < before).order_by(e.id.desc()).limit(limit)))
        rows.reverse()
    else:
        start = e.id > after if after is not None else e.id >= first_id
        rows = list(session.execute(cols.where(mine, start).order_by(e.id).limit(limit)))
    earlier = None
    if rows:
        earlier = session.scalar(
            select(e.messages).where(mine, e.id < rows[0].id).order_by(e.id.desc()).limit(1)
        )
    ids = [r.id for r in rows]
    numbers = {
        g.id: (g.number, g.lineage)
        for g in session.execute(
            select(Generation.id, Generation.number, Generation.lineage).where(
                Generation.id.in_({r.generation_id for r in rows if r.generation_id is not None})
            )
        )
    }
    contract_id = champion_contract(session, lineage)
    finals = {
        s.experience_id: s
        for s in session.execute(
            select(Score.experience_id, Score.value, Score.verified, Score.details).where(
                Score.experience_id.in_(ids), Score.contract_version_id == contract_id, Score.scorer == FINAL
            )
        )
    }
    keys = [_key(m) for m in _messages(earlier)] if earlier is not None else None
    turns = []
    for r in rows:
        messages = _messages(r.messages)
        now = [_key(m) for m in messages]
        shared = _shared(keys, now) if keys is not None else 0
        added = list(enumerate(messages))[shared:]
        final = finals.get(r.id)
        details = final.details if final is not None and isinstance(final.details, dict) else {}
        failed = failed_checks(details.get("failed")) if final is not None else []
        status = final_status(
            scored=final is not None, verified=final.verified if final else None, failed=failed
        )
        generation = numbers.get(r.generation_id)
        turns.append(
            ConversationTurn(
                id=r.id,
                created_at=r.created_at.isoformat(),
                source=r.source,
                specialist=r.specialist,
                generation=generation[0] if generation else None,
                generation_lineage=generation[1] if generation else None,
                principal=r.principal,
                messages=len(messages),
                shared=shared,
                dropped=len(keys) - shared if keys is not None else 0,
                added=[_shown(i, m) for i, m in added[:MESSAGES_PER_TURN]],
                more_added=max(0, len(added) - MESSAGES_PER_TURN),
                score=final.value if final is not None and status != NOT_SCORED else None,
                status=status,
                failed=failed,
            )
        )
        keys = now
    return ConversationDetail(
        conversation_id=conversation_id,
        lineage=lineage,
        contract_version_id=contract_id,
        turns=turns,
        first_id=first_id,
        last_id=last_id,
        previous=ids[0] if ids and ids[0] > first_id else None,
        next=ids[-1] if ids and ids[-1] < last_id else None,
    )


def neighbour_turns(
    session: Session, *, conversation_id: str, experience_id: int
) -> tuple[int | None, int | None]:
    """The trace ids of the conversation's turns just before and just after ``experience_id``."""
    e, mine = Experience, Experience.conversation_id == conversation_id
    previous = session.scalar(select(func.max(e.id)).where(mine, e.id < experience_id))
    following = session.scalar(select(func.min(e.id)).where(mine, e.id > experience_id))
    return previous, following


def _text(value: object) -> str:
    return "" if value is None else value if isinstance(value, str) else json.dumps(value, default=str)


def offered_tools(raw: JsonValue) -> list[OfferedTool] | None:
    """The tools a client offered on a turn (OpenAI chat shape ``{"type": "function", "function": {...}}``,
    or the Responses API's flat one), at most ``MAX_TOOLS``; None when none were recorded. Entries of
    another shape are kept, their name being what they are."""
    if raw is None:
        return None
    entries = raw if isinstance(raw, list) else [raw]
    out = []
    for t in entries[:MAX_TOOLS]:
        if not isinstance(t, dict):
            out.append(OfferedTool(type="?", name=_text(t), description="", parameters=None))
            continue
        fn = t.get("function") if isinstance(t.get("function"), dict) else t
        out.append(
            OfferedTool(
                type=_text(t.get("type", "function")),
                name=_text(fn.get("name", t.get("type", "?"))),  # type: ignore[union-attr]
                description=_text(fn.get("description")),  # type: ignore[union-attr]
                parameters=fn.get("parameters"),  # type: ignore[union-attr]
            )
        )
    return out


def _ids(value: JsonValue) -> list[int]:
    return (
        [i for i in value if isinstance(i, int) and not isinstance(i, bool)]
        if isinstance(value, list)
        else []
    )


def served_token_counts(raw: JsonValue, *, ids: bool = False) -> dict[int, ServedTokenCounts]:
    """The token ids served per assistant message index (``Experience.served_tokens``): their counts and the
    tokenizer's fingerprint; the id lists themselves only with ``ids``. Entries of another shape are left
    out."""
    out: dict[int, ServedTokenCounts] = {}
    for index, entry in (raw if isinstance(raw, dict) else {}).items():
        if not (isinstance(index, str) and index.isdigit() and isinstance(entry, dict)):
            continue
        prompt, completion = _ids(entry.get("prompt_ids")), _ids(entry.get("completion_ids"))
        out[int(index)] = ServedTokenCounts(
            tokenizer=_text(entry.get("tokenizer")),
            prompt_tokens=len(prompt),
            completion_tokens=len(completion),
            prompt_ids=prompt if ids else None,
            completion_ids=completion if ids else None,
        )
    return out
