"""The tool_call scorer: the assistant's call names a harness tool, with arguments valid for it."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from pipeline.experience.toolcalls import parse_compact_calls
from pipeline.scoring.context import (
    NOT_APPLICABLE,
    ScorerOutcome,
    TurnContext,
    parse_json_content,
    schema_validator,
)
from pipeline.specs.scorers import ToolCallScorer


def extract_calls(
    message: dict[str, Any], *, accept_content_json: bool, accept_content_compact: bool = False
) -> list[dict[str, Any]]:
    """The calls of an assistant message as ``[{"name", "arguments"}]``; arguments stay raw (str or dict).

    Reads OpenAI ``tool_calls``; otherwise (when allowed) a JSON content ``{"name", "arguments"}`` or a
    list of those, or a content made only of compact calls ``name(key=value,...)``.
    """
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        calls.append({"name": fn.get("name"), "arguments": fn.get("arguments", "{}")})
    content = message.get("content")
    if calls or not isinstance(content, str):
        return calls
    if accept_content_compact and "(" in content:
        compact = parse_compact_calls(content)
        if compact:
            return compact
    if not accept_content_json or "{" not in content:
        return []
    try:
        data = parse_json_content(content)
    except ValueError:
        return []
    items = data if isinstance(data, list) else [data]
    for item in items:
        if isinstance(item, dict) and isinstance(item.get("name"), str):
            calls.append(
                {"name": item["name"], "arguments": item.get("arguments", item.get("parameters", {}))}
            )
    return calls


def called_tool(
    message: dict[str, Any], *, accept_content_json: bool = True, accept_content_compact: bool = True
) -> bool:
    """Whether an assistant message contains at least one tool call."""
    return bool(
        extract_calls(
            message, accept_content_json=accept_content_json, accept_content_compact=accept_content_compact
        )
    )


def _arguments(raw: Any) -> dict[str, Any]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"arguments are not JSON ({exc.msg})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"arguments must be a JSON object, got {type(raw).__name__}")
    return raw


def _check_call(call: dict[str, Any], ctx: TurnContext) -> tuple[dict[str, Any], str | None]:
    args = _arguments(call["arguments"])
    if ctx.harness is None:
        return args, None
    tools = {t.function.name: t for t in ctx.harness.tools_for(ctx.specialist)}
    tool = tools.get(call["name"])
    if tool is None:
        return args, f"unknown tool {call['name']!r} (harness tools: {', '.join(sorted(tools)) or 'none'})"
    try:  # a pattern RE2 cannot run (``patterns``) leaves the arguments unchecked, and says so
        errors = list(schema_validator(tool.function.parameters).iter_errors(args))
    except jsonschema.SchemaError as exc:
        return args, f"{call['name']}: arguments not checked: invalid parameters schema: {exc.message}"
    if errors:
        where = "/".join(str(p) for p in errors[0].absolute_path) or "<root>"
        return args, f"{call['name']}: arguments invalid at {where}: {errors[0].message}"
    return args, None


def _earlier_calls(ctx: TurnContext, cfg: ToolCallScorer) -> list[dict[str, Any]]:
    """The calls the conversation's assistant turns made since the last user message, before this turn:
    the earlier actions of the same request (a multi-turn tool episode)."""
    start = max((i for i, m in enumerate(ctx.messages[: ctx.index]) if m.get("role") == "user"), default=-1)
    calls = []
    for message in ctx.messages[start + 1 : ctx.index]:
        if message.get("role") != "assistant":
            continue
        for call in extract_calls(
            message,
            accept_content_json=cfg.accept_content_json,
            accept_content_compact=cfg.accept_content_compact,
        ):
            try:
                calls.append({"name": call["name"], "arguments": _arguments(call["arguments"])})
            except ValueError:
                calls.append({"name": call["name"], "arguments": {"_unreadable": True}})
    return calls


def _want(expected: dict[str, Any]) -> dict[str, Any]:
    args = expected.get("arguments") or {}
    return {"name": expected["name"], "arguments": _arguments(args) if isinstance(args, str) else args}


def score_tool_call(cfg: ToolCallScorer, ctx: TurnContext) -> ScorerOutcome:
    """1 when every call is valid against the harness tools and (if given) the request's actions are exactly
    the expected call.

    The actions of a request are every call its assistant turns made since the user's message: a call
    beside the right one, or the right one made twice, changes the state of the world, so it fails (a
    policy cannot buy a pass by trying several). The verdict belongs to the turn that made the calls: a text
    turn after them is not checked by this scorer (only a scorer of its own content can verify what it
    says). Verified only against an expected call the trace's certifier vouched for: a call that merely fits
    some tool's schema says nothing about whether it was the right action."""
    expected = ctx.certified(cfg, cfg.expected_field)
    checked = cfg.match_expected and isinstance(expected, dict) and "name" in expected
    calls = extract_calls(
        ctx.message,
        accept_content_json=cfg.accept_content_json,
        accept_content_compact=cfg.accept_content_compact,
    )
    earlier = _earlier_calls(ctx, cfg) if checked else []
    if not calls:
        if cfg.require_call and ctx.is_final and not ctx.specialist_called_tool:
            return ScorerOutcome(0.0, "no tool call", verified=checked)
        return NOT_APPLICABLE
    parsed = []
    for call in calls:
        if not isinstance(call["name"], str):
            return ScorerOutcome(0.0, "tool call without a function name", verified=checked)
        try:
            args, problem = _check_call(call, ctx)
        except ValueError as exc:
            return ScorerOutcome(0.0, f"{call['name']}: {exc}", verified=checked)
        if problem:
            return ScorerOutcome(0.0, problem, verified=checked)
        parsed.append({"name": call["name"], "arguments": args})
    info: dict[str, Any] = {"calls": parsed}
    if ctx.harness is None:
        info["note"] = "no harness: tool names and argument schemas not checked"
    if checked:
        return _match(expected, [*earlier, *parsed], info)
    return ScorerOutcome(1.0, None, info, verified=checked)


def _match(expected: dict[str, Any], actions: list[dict[str, Any]], info: dict[str, Any]) -> ScorerOutcome:
    try:
        want = _want(expected)
    except ValueError as exc:
        return ScorerOutcome(None, f"metadata {exc}")
    if actions != [want]:
        got = "; ".join(json.dumps(a, sort_keys=True) for a in actions)
        return ScorerOutcome(
            0.0, f"expected call {json.dumps(want, sort_keys=True)} alone; the request made: {got}", info,
            verified=True,
        )  # fmt: skip
    return ScorerOutcome(1.0, None, info, verified=True)
