"""The compact tool-call text form a tiny model emits, and the stateful action substrate it acts on.

A tiny char-level model cannot reliably write OpenAI's JSON tool calls, so the ``agent`` task family
uses a compact text form that the environment (and the harness) converts to and from OpenAI's shape::

    name(key=value,key=value)        e.g.  set_timer(minutes=47)   add_item(name=egg,qty=47)

- ``name`` is a Python-style identifier; arguments follow the order of the tool's JSON-schema properties;
- a value made only of digits (with an optional leading ``-``) is an integer, anything else a string;
- values cannot contain ``,``, ``=``, ``(`` or ``)``; no spaces around ``=`` or ``,``.

``parse_compact_call`` returns ``{"name": ..., "arguments": {...}}`` (the shape of
``metadata.expected_call``) or ``None``; ``openai_tool_call`` wraps it as an OpenAI ``tool_calls`` entry.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from typing import Any

_CALL = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\((.*)\)\s*$", re.DOTALL)
_INT = re.compile(r"^-?\d+$")
_RESERVED = re.compile(r"[()=]")  # characters a compact argument value may not contain

# OpenAI-style tool definitions served to the agent specialist.
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "set_timer",
            "description": "Start a kitchen timer.",
            "parameters": {
                "type": "object",
                "properties": {"minutes": {"type": "integer", "minimum": 1, "maximum": 999}},
                "required": ["minutes"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add_item",
            "description": "Add a quantity of an item to the shopping cart.",
            "parameters": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 1, "maxLength": 16},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 999},
                },
                "required": ["name", "qty"],
                "additionalProperties": False,
            },
        },
    },
]
TOOL_SCHEMAS: dict[str, dict[str, Any]] = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def format_compact_call(name: str, arguments: dict[str, Any]) -> str:
    """Render a call in the compact text form (arguments in the tool schema's property order)."""
    order = list(TOOL_SCHEMAS.get(name, {}).get("properties", {})) or list(arguments)
    keys = [k for k in order if k in arguments] + [k for k in arguments if k not in order]
    return f"{name}(" + ",".join(f"{k}={arguments[k]}" for k in keys) + ")"


def parse_compact_call(text: str) -> dict[str, Any] | None:
    """Parse ``name(k=v,...)``; ``None`` when the text is not a single well-formed compact call."""
    match = _CALL.match(text)
    if not match:
        return None
    name, body = match.group(1), match.group(2)
    arguments: dict[str, Any] = {}
    if body.strip():
        for part in body.split(","):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or not key.isidentifier() or key in arguments or _RESERVED.search(value):
                return None
            arguments[key] = int(value) if _INT.match(value) else value
    return {"name": name, "arguments": arguments}


def openai_tool_call(call: dict[str, Any], *, seed_text: str = "") -> dict[str, Any]:
    """Wrap ``{"name", "arguments"}`` as an OpenAI ``tool_calls`` entry with a stable id."""
    digest = hashlib.sha256((seed_text + json.dumps(call, sort_keys=True)).encode()).hexdigest()[:12]
    return {
        "id": f"call_{digest}",
        "type": "function",
        "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], separators=(",", ":"))},
    }


def compact_from_openai(tool_calls: list[dict[str, Any]]) -> str:
    """The compact text of an assistant message's OpenAI ``tool_calls`` (one call per line)."""
    lines = []
    for tc in tool_calls:
        fn = tc["function"]
        args = fn.get("arguments") or "{}"
        lines.append(format_compact_call(fn["name"], json.loads(args) if isinstance(args, str) else args))
    return "\n".join(lines)


def initial_state() -> dict[str, Any]:
    """The action substrate before the agent acts: no timer, an empty cart."""
    return {"timer_minutes": None, "cart": {}}


def apply_call(state: dict[str, Any], call: dict[str, Any]) -> dict[str, Any]:
    """Apply a (schema-valid) call to a copy of ``state``; raise ``ValueError`` for an unknown tool."""
    new = copy.deepcopy(state)
    args = call["arguments"]
    if call["name"] == "set_timer":
        new["timer_minutes"] = args["minutes"]
    elif call["name"] == "add_item":
        new["cart"][args["name"]] = new["cart"].get(args["name"], 0) + args["qty"]
    else:
        raise ValueError(f"unknown tool {call['name']!r}")
    return new
