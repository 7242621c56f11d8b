"""The tool_call scorer: the assistant's call names a harness tool, with arguments valid for it."""

from __future__ import annotations

import json
from typing import Any

from pipeline.scorers.base import (
    NOT_APPLICABLE,
    ScorerOutcome,
    TurnContext,
    parse_json_content,
    schema_validator,
)
from pipeline.scorers.config import ToolCallScorer
from pipeline.toolcalls import parse_compact_calls


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
    errors = list(schema_validator(tool.function.parameters).iter_errors(args))
    if errors:
        where = "/".join(str(p) for p in errors[0].absolute_path) or "<root>"
        return args, f"{call['name']}: arguments invalid at {where}: {errors[0].message}"
    return args, None


def score_tool_call(cfg: ToolCallScorer, ctx: TurnContext) -> ScorerOutcome:
    """1 when every call is valid against the harness tools and (if given) one matches the expected call.

    Verified only against an expected call: a call that merely fits some tool's schema says nothing about
    whether it was the right action."""
    expected = ctx.metadata.get(cfg.expected_field)
    checked = cfg.match_expected and isinstance(expected, dict) and "name" in expected
    calls = extract_calls(
        ctx.message,
        accept_content_json=cfg.accept_content_json,
        accept_content_compact=cfg.accept_content_compact,
    )
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
        want_args = expected.get("arguments") or {}
        if isinstance(want_args, str):
            want_args = _arguments(want_args)
        want = {"name": expected["name"], "arguments": want_args}
        if want not in parsed:
            return ScorerOutcome(
                0.0, f"expected call {json.dumps(want, sort_keys=True)}", info, verified=True
            )
    return ScorerOutcome(1.0, None, info, verified=checked)
