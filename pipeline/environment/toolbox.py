"""The demo's tools and the stateful action substrate the ``agent`` family acts on.

The tiny model writes calls in the compact text form of ``pipeline.experience.toolcalls`` (``set_timer(minutes=47)``,
``add_item(name=egg,qty=47)``); here the arguments follow the order of each tool's JSON-schema properties.
"""

from __future__ import annotations

import copy
from typing import Any

from pipeline.experience.toolcalls import compact_from_openai, openai_tool_call, parse_compact_call
from pipeline.experience.toolcalls import format_compact_call as _format

__all__ = [
    "TOOLS",
    "TOOL_SCHEMAS",
    "apply_call",
    "compact_from_openai",
    "execute_call",
    "format_compact_call",
    "initial_state",
    "openai_tool_call",
    "parse_compact_call",
]

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
    """A demo tool call in the compact text form, arguments in the tool schema's property order."""
    return _format(name, arguments, list(TOOL_SCHEMAS.get(name, {}).get("properties", {})))


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


def execute_call(state: dict[str, Any], call: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """One call of an episode against the substrate: ``(new state, result)``. The result is the new state;
    an unknown tool or arguments its schema refuses give ``{"error": ...}`` and leave the state unchanged
    (what a model's mistake looks like to it: a tool answer, never an exception)."""
    import jsonschema

    schema = TOOL_SCHEMAS.get(str(call.get("name")))
    if schema is None:
        return state, {"error": f"unknown tool {call.get('name')!r}"}
    try:
        jsonschema.validate(call.get("arguments"), schema)
    except jsonschema.ValidationError as exc:
        return state, {"error": f"{call['name']}: {exc.message}"}
    new = apply_call(state, call)
    return new, copy.deepcopy(new)
