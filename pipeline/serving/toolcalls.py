"""Tool calls as model text and as OpenAI ``tool_calls``: pluggable formats shared with the environment.

A format is a pair of functions: ``parse(text, tool_names) -> [{"name", "arguments"}] | None`` and
``render(calls) -> text``. Built in:

- ``json`` (default; the harness's ``openai`` and ``json`` formats): one JSON object
  ``{"name": ..., "arguments": {...}}`` or a JSON list of them, optionally inside ``<tool_call>`` tags;
- ``compact``: the tiny model's ``name(key=value,...)``, one call per line (``pipeline.environment``).

``parse_tool_calls`` tries the harness's format first, then the others, and accepts a call only when
its name is one of the tools the request offered, so plain prose is never mistaken for a call.
``register_format`` adds a format. ``to_openai`` / ``from_openai`` convert to and from OpenAI's shape.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from pipeline.environment.toolcalls import format_compact_call, openai_tool_call, parse_compact_call

Call = dict[str, Any]
Parser = Callable[[str], list[Call] | None]
Renderer = Callable[[Sequence[Call]], str]

_TAGS = re.compile(r"^\s*<tool_call>\s*(.*?)\s*</tool_call>\s*$", re.DOTALL)


def _parse_json(text: str) -> list[Call] | None:
    body = text.strip()
    tagged = _TAGS.match(body)
    if tagged:
        body = tagged.group(1)
    if not body.startswith(("{", "[")):
        return None
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    items = data if isinstance(data, list) else [data]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if not isinstance(args, dict):
            return None
        calls.append({"name": item["name"], "arguments": args})
    return calls or None


def _render_json(calls: Sequence[Call]) -> str:
    items = [{"name": c["name"], "arguments": c["arguments"]} for c in calls]
    return json.dumps(items[0] if len(items) == 1 else items, separators=(",", ":"))


def _parse_compact(text: str) -> list[Call] | None:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    calls = [parse_compact_call(line) for line in lines]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


def _render_compact(calls: Sequence[Call]) -> str:
    return "\n".join(format_compact_call(c["name"], c["arguments"]) for c in calls)


FORMATS: dict[str, tuple[Parser, Renderer]] = {
    "json": (_parse_json, _render_json),
    "compact": (_parse_compact, _render_compact),
}
ALIASES = {"openai": "json"}


def register_format(name: str, parse: Parser, render: Renderer) -> None:
    """Add (or replace) a tool-call text format."""
    FORMATS[name] = (parse, render)


def _resolve(fmt: str) -> str:
    name = ALIASES.get(fmt, fmt)
    if name not in FORMATS:
        raise ValueError(f"unknown tool_call_format {fmt!r}; known: {sorted(FORMATS) + sorted(ALIASES)}")
    return name


def parse_tool_calls(text: str, tool_names: Iterable[str], fmt: str = "json") -> list[Call] | None:
    """The calls in a completion's text, or ``None`` when it is not (only) tool calls to offered tools."""
    names = set(tool_names)
    if not names or not text.strip():
        return None
    first = _resolve(fmt)
    for name in [first] + [n for n in FORMATS if n != first]:
        calls = FORMATS[name][0](text)
        if calls and all(c["name"] in names for c in calls):
            return calls
    return None


def render_tool_calls(calls: Sequence[Call], fmt: str = "json") -> str:
    """The text a model in format ``fmt`` writes for ``calls``."""
    return FORMATS[_resolve(fmt)][1](calls)


def to_openai(calls: Sequence[Call], *, seed_text: str = "") -> list[dict[str, Any]]:
    """OpenAI ``tool_calls`` entries (ids stable for the same seed text and calls)."""
    return [openai_tool_call(c, seed_text=f"{seed_text}#{i}") for i, c in enumerate(calls)]


def from_openai(tool_calls: Sequence[dict[str, Any]]) -> list[Call]:
    """``{"name", "arguments"}`` calls from OpenAI ``tool_calls`` (arguments decoded from JSON)."""
    out = []
    for tc in tool_calls:
        fn = tc.get("function") or {}
        args = fn.get("arguments") or "{}"
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = {"_raw": args}
        out.append({"name": fn.get("name", ""), "arguments": args})
    return out
