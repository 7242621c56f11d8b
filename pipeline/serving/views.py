"""Per-specialist views of a conversation, and the server-side memory of who served which turn.

Single-specialist rendering follows ``pipeline.prompting.render_messages`` (system prompt only when
``context.include_system_prompt``, client system messages appended to it, exemplars, ``keep_turns``,
the ``max_context_chars`` budget), so a served prompt looks like the prompts the specialist was trained
and evaluated on; on top of that, a real token counter checks the model's window.

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
from dataclasses import dataclass
from typing import Any

from pipeline.errors import RatchetError
from pipeline.harness import HarnessSpec
from pipeline.prompting import exemplar_messages, prompt_chars
from pipeline.serving.router import message_text
from pipeline.toolcalls import from_openai, render_tool_calls

SUMMARY_INSTRUCTION = "Summarize your last reply in one short sentence."
SUMMARY_CHARS = 160


class ContextOverflowError(RatchetError):
    """The newest turn alone does not fit the context window."""


@dataclass(frozen=True)
class TurnRecord:
    """Who wrote an assistant message and its server-side summary."""

    specialist: str
    summary: str


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


def _turns(history: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Split non-system messages into turns, each starting at a user message."""
    turns: list[list[dict[str, Any]]] = []
    for m in history:
        if m.get("role") == "user" or not turns:
            turns.append([])
        turns[-1].append(m)
    return turns


def _clean(message: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message["role"], "content": message.get("content")}
    if not isinstance(out["content"], (str, type(None))):
        out["content"] = message_text(message)
    for key in ("tool_calls", "tool_call_id", "name"):
        if message.get(key):
            out[key] = message[key]
    return out


def _apply_policy(turn: list[dict[str, Any]], specialist: str, mode: str, memory: TurnMemory) -> list[dict]:
    out, dropped_calls = [], set()
    for m in turn:
        if m.get("role") == "tool" and m.get("tool_call_id") in dropped_calls:
            continue
        if m.get("role") == "assistant":
            rec = memory.lookup(m)
            if rec is not None and rec.specialist != specialist and mode != "full":
                dropped_calls.update(str(tc.get("id")) for tc in m.get("tool_calls") or [])
                if mode == "summary":
                    out.append({"role": "assistant", "content": f"[{rec.specialist}] {rec.summary}"})
                continue
        out.append(_clean(m))
    return out


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
    sp = harness.specialists.get(specialist)
    head: list[dict[str, Any]] = []
    if harness.context.include_system_prompt:  # a model never taught system prompts gets none at all
        system = sp.render_system_prompt() if sp is not None else ""
        client_system = [message_text(m) for m in messages if m.get("role") in ("system", "developer")]
        system = "\n\n".join(s for s in [system, *client_system] if s)
        head = [{"role": "system", "content": system}] if system else []
    exemplars = exemplar_messages(harness, specialist) if sp is not None else []
    mode = harness.context.other_specialists
    turns = _turns([dict(m) for m in messages if m.get("role") not in ("system", "developer")])
    shown = [_apply_policy(t, specialist, mode, memory) for t in turns]
    current, past = shown[-1] if shown else [], shown[:-1]
    past = past[len(past) - harness.context.keep_turns :] if harness.context.keep_turns else []
    window = harness.context.max_context_tokens
    if context_limit is not None:
        window = min(window, context_limit)
    budget = window - max_new_tokens
    chars = harness.context.max_context_chars
    fmt = harness.tool_call_format

    def assemble() -> list[dict[str, Any]]:
        return head + [m for ex in exemplars for m in ex] + [m for t in past for m in t] + current

    def fits(view: list[dict[str, Any]]) -> bool:
        if chars is not None and prompt_chars(view, fmt) > chars - max_new_tokens:
            return False
        return count_tokens(view) <= budget

    view = assemble()
    while not fits(view) and past:
        past = past[1:]
        view = assemble()
    while not fits(view) and exemplars:
        exemplars = exemplars[:-1]
        view = assemble()
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
