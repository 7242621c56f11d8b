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
each turn; that is serving's ``build_view``, which applies the same policy with a real token counter.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pipeline.errors import RatchetError
from pipeline.harness import DecodingParams, HarnessSpec, SpecialistHarness
from pipeline.toolcalls import call_text

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
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    calls = [
        call_text(str(fn.get("name", "")), _arguments(fn.get("arguments")), fmt)
        for fn in ((tc or {}).get("function") or {} for tc in message.get("tool_calls") or [])
    ]
    return len(content or "") + len("\n".join(calls)) + MESSAGE_OVERHEAD_CHARS


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
                    last_id = f"call_ex{i}_{j}_{k}"
                    args = json.dumps(c.arguments, separators=(",", ":"))
                    msg["tool_calls"].append(
                        {"id": last_id, "type": "function", "function": {"name": c.name, "arguments": args}}
                    )
            if m.role == "tool" and last_id is not None:
                msg["tool_call_id"] = last_id
            msgs.append(msg)
        out.append(msgs)
    return out


def _flat(message: dict[str, Any]) -> dict[str, Any]:
    """A copy of the message with OpenAI content parts joined into its text (what a chat template takes)."""
    out = dict(message)
    if isinstance(out.get("content"), list):
        out["content"] = "".join(str(p.get("text", "")) for p in out["content"] if isinstance(p, dict))
    return out


def _turns(messages: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    turns: list[list[dict[str, Any]]] = []
    for m in messages:
        if m.get("role") == "user" or not turns:
            turns.append([])
        turns[-1].append(m)
    return turns


def render_messages(
    harness: HarnessSpec,
    specialist: str,
    conversation: Sequence[dict[str, Any]],
    *,
    chars_per_token: float = 4.0,
) -> list[dict[str, Any]]:
    """The messages ``specialist``'s model is given for ``conversation`` (see the module docstring).

    ``chars_per_token`` (the contract's ``context_budget.chars_per_token``) converts the token window
    into characters when the harness sets no ``max_context_chars``.
    """
    sp = specialist_harness(harness, specialist)
    ctx = harness.context
    fmt = harness.tool_call_format
    head: list[dict[str, Any]] = []
    if ctx.include_system_prompt:
        client = [
            str(m.get("content") or "") for m in conversation if m.get("role") in ("system", "developer")
        ]
        system = "\n\n".join(s for s in [sp.render_system_prompt(), *client] if s)
        head = [{"role": "system", "content": system}] if system else []
    turns = _turns([_flat(m) for m in conversation if m.get("role") not in ("system", "developer")])
    current = turns[-1] if turns else []
    past = turns[:-1][-ctx.keep_turns :] if ctx.keep_turns else []
    exemplars = exemplar_messages(harness, specialist)
    budget = prompt_budget_chars(harness, specialist, chars_per_token=chars_per_token)

    def size(parts: list[list[dict[str, Any]]]) -> int:
        return sum(message_chars(m, fmt) for part in parts for m in part)

    fixed = prompt_chars(head + current, fmt)
    while past and fixed + size(exemplars) + size(past) > budget:
        past = past[1:]
    while exemplars and fixed + size(exemplars) > budget:
        exemplars = exemplars[:-1]
    return head + [m for ex in exemplars for m in ex] + [m for t in past for m in t] + current
