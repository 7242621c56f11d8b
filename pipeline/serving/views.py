"""Per-specialist views of a conversation, and the server-side memory of who served which turn.

The view itself is ``pipeline.modeling.prompting.view_parts`` -- the same function curation builds training
examples with, from a served trace's recorded routes and summaries -- so a served prompt looks like the
prompts the specialist was trained and evaluated on; on top of that, a real token counter checks the model's
window.

The client sends the whole conversation on every request (OpenAI's API is stateless), so the server
remembers, for each assistant message it produced, the specialist that wrote it and a short summary
(``TurnMemory``, keyed by the message's text or its tool-call ids). ``build_view`` then gives the
chosen specialist its own view: its system prompt and exemplars, its own past turns verbatim, and
other specialists' turns as the harness's context policy says (``full``: verbatim, ``summary``: their
summaries, ``hide``: left out), trimmed to ``keep_turns`` past turns and to the token budget.

Summaries are kept server-side only: in this memory and in the trace metadata (``summaries``); they are
never returned to the client. Assistant messages the server does not know (written by the client, or
from before a restart) are shown verbatim to every specialist.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pipeline.errors import RatchetError
from pipeline.experience.texts import message_text
from pipeline.experience.toolcalls import from_openai, render_tool_calls
from pipeline.modeling.prompting import TurnRecord, Writer, prompt_chars, view_parts
from pipeline.specs.harness import HarnessSpec

SUMMARY_INSTRUCTION = "Summarize your last reply in one short sentence."
SUMMARY_CHARS = 160


class ContextOverflowError(RatchetError):
    """The newest turn alone does not fit the context window."""


def _content_key(text: str) -> str:
    return "c:" + hashlib.sha256(text.strip().encode()).hexdigest()


def message_keys(message: Mapping[str, Any]) -> list[str]:
    """Memory keys of an assistant message: its tool-call ids, or a hash of its text."""
    calls = message.get("tool_calls") or []
    if calls:
        return ["t:" + str(tc.get("id")) for tc in calls]
    return [_content_key(message_text(message))]


class TurnMemory:
    """Thread-safe, bounded (LRU) memory of served assistant messages."""

    def __init__(self, capacity: int = 100_000):
        self.capacity = capacity
        self._data: OrderedDict[str, TurnRecord] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, message: Mapping[str, Any], record: TurnRecord) -> None:
        with self._lock:
            for key in message_keys(message):
                self._data[key] = record
                self._data.move_to_end(key)
            while len(self._data) > self.capacity:
                self._data.popitem(last=False)

    def lookup(self, message: Mapping[str, Any]) -> TurnRecord | None:
        with self._lock:
            for key in message_keys(message):
                if key in self._data:
                    self._data.move_to_end(key)
                    return self._data[key]
        return None

    def issuers(self, messages: Sequence[Mapping[str, Any]]) -> dict[str, str]:
        """Tool-call id -> issuing specialist, for the calls in ``messages`` this server made."""
        out = {}
        with self._lock:
            for m in messages:
                for tc in m.get("tool_calls") or []:
                    rec = self._data.get("t:" + str(tc.get("id")))
                    if rec is not None:
                        out[str(tc.get("id"))] = rec.specialist
        return out


def extract_summary(message: Mapping[str, Any]) -> str:
    """A deterministic summary: the tool calls made (``name(k=v)``), or the text (truncated)."""
    if message.get("tool_calls"):
        return "called " + render_tool_calls(from_openai(message["tool_calls"]), "compact").replace(
            "\n", "; "
        )
    text = " ".join(message_text(message).split())
    return text if len(text) <= SUMMARY_CHARS else text[: SUMMARY_CHARS - 1] + "…"


def summary_messages(view: list[dict[str, Any]], answer: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The prompt with which a specialist summarises its own answer."""
    return [*view, dict(answer), {"role": "user", "content": SUMMARY_INSTRUCTION}]


def recorded_writer(routes: Any, metadata: Mapping[str, Any]) -> Writer:
    """Who wrote each assistant message of a stored trace, from its recorded ``routes`` (``{"turn",
    "specialist"}``) and the summaries the server kept (``metadata.summaries``): the ``Writer`` curation
    rebuilds a served turn's view with, as the server built it. Entries of an odd shape are ignored."""
    summaries = metadata.get("summaries") if isinstance(metadata.get("summaries"), Mapping) else {}
    records: dict[int, TurnRecord] = {}
    for route in routes if isinstance(routes, list) else []:
        if (
            isinstance(route, Mapping)
            and isinstance(route.get("turn"), int)
            and isinstance(route.get("specialist"), str)
        ):
            summary = summaries.get(str(route["turn"]))
            records[route["turn"]] = TurnRecord(
                route["specialist"], summary if isinstance(summary, str) else ""
            )
    return lambda i, _m: records.get(i)


def build_view(
    messages: Sequence[Mapping[str, Any]],
    specialist: str,
    *,
    harness: HarnessSpec,
    memory: TurnMemory,
    count_tokens: Callable[[list[dict[str, Any]]], int],
    max_new_tokens: int,
    context_limit: int | None = None,
) -> list[dict[str, Any]]:
    """The messages ``specialist`` answers from (see the module docstring).

    The budget is ``min(harness.context.max_context_tokens, context_limit) - max_new_tokens`` tokens:
    the oldest past turns go first, then the exemplars; ``ContextOverflowError`` when the system prompt
    and the current turn alone do not fit.
    """
    parts = view_parts(harness, specialist, messages, writer=lambda _i, m: memory.lookup(m))
    window = harness.context.max_context_tokens
    if context_limit is not None:
        window = min(window, context_limit)
    budget = window - max_new_tokens
    chars = harness.context.max_context_chars
    fmt = harness.tool_call_format

    def fits(view: list[dict[str, Any]]) -> bool:
        if chars is not None and prompt_chars(view, fmt) > chars - max_new_tokens:
            return False
        return count_tokens(view) <= budget

    view = parts.assemble()
    while not fits(view) and parts.past:
        parts.past = parts.past[1:]
        view = parts.assemble()
    while not fits(view) and parts.exemplars:
        parts.exemplars = parts.exemplars[:-1]
        view = parts.assemble()
    if not fits(view):
        used = count_tokens(view)
        if chars is not None:
            window = min(window, chars)
            used = max(used, prompt_chars(view, fmt))
        raise ContextOverflowError(
            f"the conversation needs {used} prompt tokens plus max_tokens {max_new_tokens}, over the "
            f"context window of {window} tokens: shorten the last message or lower max_tokens"
        )
    return view
