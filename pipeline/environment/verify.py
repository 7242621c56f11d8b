"""Per-family verifiers, independent of the contract scorers (tests cross-check the two).

``verify(item, completion_text) -> (ok, details)``. Code from the ``coding`` family is only executed
when its syntax tree uses a small whitelist (a function of arithmetic on names and constants), so a
sampled completion can never loop, import or touch the file system.
"""

from __future__ import annotations

import ast
import json
from typing import Any

import jsonschema

from pipeline.environment.toolbox import TOOL_SCHEMAS, apply_call, initial_state, parse_compact_call

_SAFE_NODES = (
    ast.Module,
    ast.FunctionDef,
    ast.arguments,
    ast.arg,
    ast.Return,
    ast.BinOp,
    ast.UnaryOp,
    ast.Name,
    ast.Load,
    ast.Constant,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.USub,
    ast.UAdd,
    ast.Expr,
)
_TEST_NODES = (*_SAFE_NODES, ast.Assert, ast.Compare, ast.Eq, ast.Call)


def _check_tree(source: str, allowed: tuple[type, ...], what: str) -> ast.Module:
    tree = ast.parse(source, mode="exec")
    for node in ast.walk(tree):
        if not isinstance(node, allowed):
            raise ValueError(f"{what} uses {type(node).__name__}, outside the sandbox whitelist")
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and abs(node.value) > 10**6:
            raise ValueError(f"{what} uses a constant too large")
    return tree


def _verify_chat(item: dict[str, Any], text: str) -> tuple[bool, dict[str, Any]]:
    expected = item["metadata"]["expected"]
    got = text.strip()
    return got == expected, {"expected": expected, "got": got}


def _verify_agent(item: dict[str, Any], text: str) -> tuple[bool, dict[str, Any]]:
    call = parse_compact_call(text)
    if call is None:
        return False, {"error": "not a compact tool call", "got": text}
    schema = TOOL_SCHEMAS.get(call["name"])
    if schema is None:
        return False, {"error": f"unknown tool {call['name']!r}", "got": text}
    try:
        jsonschema.validate(call["arguments"], schema)
    except jsonschema.ValidationError as exc:
        return False, {"error": f"arguments: {exc.message}", "got": text}
    expected = item["metadata"]["expected_call"]
    state = apply_call(initial_state(), call)
    want = apply_call(initial_state(), expected)
    return state == want, {"call": call, "state": state, "expected_state": want}


def _verify_coding(item: dict[str, Any], text: str) -> tuple[bool, dict[str, Any]]:
    try:
        tree = _check_tree(text, _SAFE_NODES, "code")
        tests = _check_tree(item["metadata"]["tests"], _TEST_NODES, "tests")
    except (SyntaxError, ValueError) as exc:
        return False, {"error": str(exc), "got": text}
    namespace: dict[str, Any] = {"__builtins__": {}}
    try:
        exec(compile(tree, "<completion>", "exec"), namespace)  # noqa: S102 - whitelisted AST only
        exec(compile(tests, "<tests>", "exec"), namespace)  # noqa: S102
    except Exception as exc:  # a failing test or a wrong signature is the model's mistake, not ours
        return False, {"error": f"{type(exc).__name__}: {exc}", "got": text}
    return True, {"got": text}


def _verify_genui(item: dict[str, Any], text: str) -> tuple[bool, dict[str, Any]]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return False, {"error": f"not JSON: {exc.msg}", "got": text}
    try:
        jsonschema.validate(value, item["metadata"]["schema"])
    except jsonschema.ValidationError as exc:
        return False, {"error": f"schema: {exc.message}", "got": text}
    return True, {"got": value}


_VERIFIERS = {"chat": _verify_chat, "agent": _verify_agent, "coding": _verify_coding, "genui": _verify_genui}


def verify(item: dict[str, Any], completion_text: str) -> tuple[bool, dict[str, Any]]:
    """Check a completion against its item: ``(ok, details)`` (details say what was wrong)."""
    family = item["metadata"]["task"]
    if family not in _VERIFIERS:
        raise ValueError(f"no verifier for task family {family!r}")
    return _VERIFIERS[family](item, completion_text)
