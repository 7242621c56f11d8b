"""What a specialist's model is actually given: the harness rendered around a conversation.

``render_messages(harness, specialist, conversation)`` returns OpenAI chat messages, in order:

1. the specialist's system prompt (slots filled, client system messages appended) when the context policy
   has ``include_system_prompt`` (a model that never saw system prompts gets no system message at all,
   client ones included);
2. its few-shot exemplars as prior user/assistant turns (tool calls in OpenAI form with stable ids);
3. the conversation: past turns (a turn starts at a user message) limited to ``keep_turns``, then the
   current turn (from the newest user message on), which is always kept.

Everything is measured in characters (``prompt_chars``): message content, tool calls as the model writes
them (``tool_call_format``) and ``MESSAGE_OVERHEAD_CHARS`` per message. The prompt budget is
``max_context_chars - max_new_tokens`` when the harness sets a character budget (character-level models:
one token per character), else ``(max_context_tokens - max_new_tokens) * chars_per_token``. Over budget,
the oldest past turns go first, then the exemplars from the last one; the system prompt and the current
turn are never dropped (when they alone overflow, the caller decides: serving rejects, the tiny model's
generation keeps the newest positions). Pure functions: no torch, no tokenizer.

Multi-specialist views (other specialists' turns shown as summaries or hidden) need to know who wrote
each turn (a ``Writer``): serving's ``build_view`` knows from its memory and trims with a real token counter;
curation knows from a served trace's recorded routes and summaries. Both build the view with ``view_parts``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.errors import RatchetError
from pipeline.experience.texts import message_text
from pipeline.experience.toolcalls import call_id, call_text
from pipeline.specs.harness import DecodingParams, HarnessSpec, SpecialistHarness

# Per message: a role marker and an end marker (the tiny model's template uses one token for each).
MESSAGE_OVERHEAD_CHARS = 2
# Per prompt: the begin-of-sequence token and the assistant header of the generation prompt.
PROMPT_OVERHEAD_CHARS = 2

__all__ = [
    "MESSAGE_OVERHEAD_CHARS",
    "PROMPT_OVERHEAD_CHARS",
    "call_text",
    "decoding_for",
    "exemplar_messages",
    "message_chars",
    "prompt_budget_chars",
    "prompt_chars",
    "render_messages",
    "specialist_harness",
    "TurnRecord",
    "ViewParts",
    "Writer",
    "view_parts",
]


def specialist_harness(harness: HarnessSpec, specialist: str) -> SpecialistHarness:
    """The specialist's entry; ``RatchetError`` naming the declared ones when it has none."""
    sp = harness.specialists.get(specialist)
    if sp is None:
        raise RatchetError(
            f"harness {harness.name} {harness.version} has no specialist {specialist!r} "
            f"(declared: {', '.join(harness.specialists)})"
        )
    return sp


def decoding_for(harness: HarnessSpec, specialist: str) -> DecodingParams:
    """The specialist's decoding parameters (a copy: callers may adjust it)."""
    return specialist_harness(harness, specialist).decoding.model_copy(deep=True)


def _arguments(raw: Any) -> dict[str, Any]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            return {"_raw": raw}
    return raw if isinstance(raw, dict) else {"_raw": raw}


def message_chars(message: dict[str, Any], fmt: str = "openai") -> int:
    """Characters a message costs in the prompt (content, tool calls as written in ``fmt``, overhead)."""
    content = message_text(message)
    calls = [
        call_text(str(fn.get("name", "")), _arguments(fn.get("arguments")), fmt)
        for fn in ((tc or {}).get("function") or {} for tc in message.get("tool_calls") or [])
    ]
    return len(content) + len("\n".join(calls)) + MESSAGE_OVERHEAD_CHARS


def prompt_chars(messages: Sequence[dict[str, Any]], fmt: str = "openai") -> int:
    """Characters of a whole rendered prompt (``PROMPT_OVERHEAD_CHARS`` included)."""
    return PROMPT_OVERHEAD_CHARS + sum(message_chars(m, fmt) for m in messages)


def prompt_budget_chars(harness: HarnessSpec, specialist: str, *, chars_per_token: float = 4.0) -> int:
    """Characters available to the prompt once the specialist's ``max_new_tokens`` are reserved."""
    new = specialist_harness(harness, specialist).decoding.max_new_tokens
    ctx = harness.context
    if ctx.max_context_chars is not None:
        return ctx.max_context_chars - new
    return int((ctx.max_context_tokens - new) * chars_per_token)


def exemplar_messages(harness: HarnessSpec, specialist: str) -> list[list[dict[str, Any]]]:
    """The specialist's exemplars as OpenAI messages, one list per exemplar (tool results get the id of
    the exemplar's latest tool call)."""
    out = []
    for i, ex in enumerate(specialist_harness(harness, specialist).exemplars):
        msgs: list[dict[str, Any]] = []
        last_id = None
        for j, m in enumerate(ex.messages):
            msg: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.tool_calls:
                msg["tool_calls"] = []
                for k, c in enumerate(m.tool_calls):
                    last_id = call_id(f"exemplar:{i}:{j}:{k}")
                    args = json.dumps(c.arguments, separators=(",", ":"))
                    msg["tool_calls"].append(
                        {"id": last_id, "type": "function", "function": {"name": c.name, "arguments": args}}
                    )
            if m.role == "tool" and last_id is not None:
                msg["tool_call_id"] = last_id
            msgs.append(msg)
        out.append(msgs)
    return out


@dataclass(frozen=True)
class TurnRecord:
    """Who wrote an assistant message, and its summary (what other specialists may be shown instead)."""

    specialist: str
    summary: str


# Who wrote the assistant message at this index of the conversation: serving's memory of its own turns, or a
# served trace's recorded routes and summaries; None for a message nobody knows (shown verbatim to all).
Writer = Callable[[int, Mapping[str, Any]], TurnRecord | None]


@dataclass
class ViewParts:
    """A specialist's view of a conversation before any budget: its system message, its exemplars, the past
    turns ``keep_turns`` keeps and the current turn (from the newest user message on)."""

    head: list[dict[str, Any]]
    exemplars: list[list[dict[str, Any]]]
    past: list[list[dict[str, Any]]]
    current: list[dict[str, Any]]

    def assemble(self) -> list[dict[str, Any]]:
        """The messages in the order the model is given them."""
        return (
            self.head
            + [m for ex in self.exemplars for m in ex]
            + [m for t in self.past for m in t]
            + self.current
        )


def _clean(message: Mapping[str, Any]) -> dict[str, Any]:
    """What a chat template takes of a message: its role, its text (content parts read by the one reader),
    and its tool calls, tool-call id and name."""
    content = message.get("content")
    out: dict[str, Any] = {"role": message["role"], "content": content}
    if not isinstance(content, (str, type(None))):
        out["content"] = message_text(message)
    for key in ("tool_calls", "tool_call_id", "name"):
        if message.get(key):
            out[key] = message[key]
    return out


def _turns(messages: list[tuple[int, Mapping[str, Any]]]) -> list[list[tuple[int, Mapping[str, Any]]]]:
    """Split (index, message) pairs into turns, each starting at a user message."""
    turns: list[list[tuple[int, Mapping[str, Any]]]] = []
    for i, m in messages:
        if m.get("role") == "user" or not turns:
            turns.append([])
        turns[-1].append((i, m))
    return turns


def _apply_policy(
    turn: list[tuple[int, Mapping[str, Any]]], specialist: str, mode: str, writer: Writer | None
) -> list[dict[str, Any]]:
    """A turn as ``specialist`` sees it: another specialist's assistant message verbatim (``full``), as its
    summary (``summary``) or left out (``hide``) with the tool results of its calls; its own and unknown ones
    verbatim."""
    out, dropped_calls = [], set()
    for i, m in turn:
        if m.get("role") == "tool" and m.get("tool_call_id") in dropped_calls:
            continue
        if m.get("role") == "assistant" and writer is not None:
            rec = writer(i, m)
            if rec is not None and rec.specialist != specialist and mode != "full":
                dropped_calls.update(str(tc.get("id")) for tc in m.get("tool_calls") or [])
                if mode == "summary":
                    out.append({"role": "assistant", "content": f"[{rec.specialist}] {rec.summary}"})
                continue
        out.append(_clean(m))
    return out


def view_parts(
    harness: HarnessSpec,
    specialist: str,
    conversation: Sequence[Mapping[str, Any]],
    *,
    writer: Writer | None = None,
) -> ViewParts:
    """The one view of a conversation a specialist is given, in serving (``serving.views.build_view``, with
    its memory of who wrote each turn) and in training (``curation``, with a served trace's recorded routes
    and summaries): the harness's system prompt with the client's system and developer messages appended (when
    ``context.include_system_prompt``; a model never taught system prompts gets none at all), the exemplars,
    other specialists' turns as ``context.other_specialists`` says (``writer`` tells who wrote each assistant
    message), and the past turns ``keep_turns`` keeps. A specialist the harness lacks gets no system prompt and
    no exemplars."""
    sp = harness.specialists.get(specialist)
    ctx = harness.context
    head: list[dict[str, Any]] = []
    if ctx.include_system_prompt:
        client = [message_text(m) for m in conversation if m.get("role") in ("system", "developer")]
        system = "\n\n".join(s for s in [sp.render_system_prompt() if sp else "", *client] if s)
        head = [{"role": "system", "content": system}] if system else []
    exemplars = exemplar_messages(harness, specialist) if sp is not None else []
    rest = [(i, m) for i, m in enumerate(conversation) if m.get("role") not in ("system", "developer")]
    shown = [_apply_policy(t, specialist, ctx.other_specialists, writer) for t in _turns(rest)]
    current, past = (shown[-1], shown[:-1]) if shown else ([], [])
    past = past[len(past) - ctx.keep_turns :] if ctx.keep_turns else []
    return ViewParts(head, exemplars, past, current)


def render_messages(
    harness: HarnessSpec,
    specialist: str,
    conversation: Sequence[Mapping[str, Any]],
    *,
    chars_per_token: float = 4.0,
    writer: Writer | None = None,
) -> list[dict[str, Any]]:
    """The messages ``specialist``'s model is given for ``conversation`` (``view_parts``, see the module
    docstring for the budget).

    ``chars_per_token`` (the contract's ``context_budget.chars_per_token``) converts the token window
    into characters when the harness sets no ``max_context_chars``.
    """
    specialist_harness(harness, specialist)  # a specialist the harness lacks is a mistake here
    parts = view_parts(harness, specialist, conversation, writer=writer)
    fmt = harness.tool_call_format
    budget = prompt_budget_chars(harness, specialist, chars_per_token=chars_per_token)

    def size(groups: list[list[dict[str, Any]]]) -> int:
        return sum(message_chars(m, fmt) for group in groups for m in group)

    fixed = prompt_chars(parts.head + parts.current, fmt)
    while parts.past and fixed + size(parts.exemplars) + size(parts.past) > budget:
        parts.past = parts.past[1:]
    while parts.exemplars and fixed + size(parts.exemplars) > budget:
        parts.exemplars = parts.exemplars[:-1]
    return parts.assemble()
