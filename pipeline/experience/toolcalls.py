"""Tool calls as model text and as OpenAI ``tool_calls``: the formats every part of the loop shares.

A format is a pair of functions: ``parse(text) -> [{"name", "arguments"}] | None`` and
``render(calls) -> text``. Built in:

- ``json`` (the harness's ``openai`` and ``json`` formats): one JSON object ``{"name": ..., "arguments":
  {...}}`` or a JSON list of them, optionally inside ``<tool_call>`` tags;
- ``compact``: ``name(key=value,...)``, one call per line, for tiny models that cannot write JSON reliably:
  ``name`` is a Python-style identifier; a value made only of digits (with an optional leading ``-``) is
  an integer, anything else a string; values never contain ``,`` ``=`` ``(`` ``)`` or a newline, and there
  are no spaces around ``=`` or ``,``. Arguments are written in the order given (a caller that wants a
  tool schema's property order passes it as ``order``).

``parse_tool_calls`` tries the harness's format first, then the others, and accepts a call only when its
name is one of the offered tools, so plain prose is never mistaken for a call. ``assistant_message`` is the
one reader of a model's reply that the loop and the server share: the OpenAI assistant message of a
completion (prose before ``<tool_call>`` blocks is kept as its content). ``register_format`` adds a
format. ``to_openai`` / ``from_openai`` convert to and from OpenAI's shape. Pure functions, no torch.

Tool-call ids are 9 letters and digits (``call_id``): the one shape every chat-template family accepts
(Mistral's templates refuse any other); ``template_call_id`` maps an id of any other shape (an ingested
OpenAI ``call_...``) to one, the same way every time, so a call and its result keep matching ids.
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from collections.abc import Callable, Iterable, Sequence
from typing import Any

Call = dict[str, Any]
Parser = Callable[[str], list[Call] | None]
Renderer = Callable[[Sequence[Call]], str]

# ------------------------------------------------------------------------------------------- compact
_CALL = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\((.*)\)\s*$", re.DOTALL)
_INT = re.compile(r"^-?\d+$")
_RESERVED = re.compile(r"[()=]")  # characters a compact argument value may not contain
COMPACT_FORBIDDEN = ",=()\n"  # ... nor these, when a value is written


def compact_value_ok(value: Any) -> bool:
    """Whether a call argument survives the compact format: an int, or a string that is not all digits
    (it would read back as an int) and has none of ``,`` ``=`` ``(`` ``)`` or a newline."""
    if isinstance(value, int) and not isinstance(value, bool):
        return True
    return (
        isinstance(value, str)
        and bool(value)
        and not value.lstrip("-").isdigit()
        and not any(c in value for c in COMPACT_FORBIDDEN)
    )


def format_compact_call(name: str, arguments: dict[str, Any], order: Sequence[str] = ()) -> str:
    """``name(key=value,...)``: the keys in ``order`` first (e.g. a tool schema's properties), then the rest."""
    keys = [k for k in order if k in arguments] + [k for k in arguments if k not in order]
    return f"{name}(" + ",".join(f"{k}={arguments[k]}" for k in keys) + ")"


def parse_compact_call(text: str) -> Call | None:
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
            if _INT.match(value):
                try:
                    value = int(value)
                except ValueError:  # more digits than Python converts (4,300): not a call, never a crash
                    return None
            arguments[key] = value
    return {"name": name, "arguments": arguments}


def parse_compact_calls(text: str) -> list[Call] | None:
    """The calls of a text made only of compact calls, one per line; ``None`` otherwise."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    calls = [parse_compact_call(line) for line in lines]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


def _render_compact(calls: Sequence[Call]) -> str:
    return "\n".join(format_compact_call(c["name"], c["arguments"]) for c in calls)


# ---------------------------------------------------------------------------------------------- json
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
    except ValueError:  # not JSON, or an integer longer than Python converts: not a call
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
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        calls.append({"name": item["name"], "arguments": args})
    return calls or None


def _render_json(calls: Sequence[Call]) -> str:
    items = [{"name": c["name"], "arguments": c["arguments"]} for c in calls]
    return json.dumps(items[0] if len(items) == 1 else items, separators=(",", ":"))


# ------------------------------------------------------------------------------------------- formats
FORMATS: dict[str, tuple[Parser, Renderer]] = {
    "json": (_parse_json, _render_json),
    "compact": (parse_compact_calls, _render_compact),
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


_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def split_tool_calls(
    text: str, tool_names: Iterable[str], fmt: str = "json"
) -> tuple[str | None, list[Call] | None]:
    """``(content, calls)`` of a completion: ``<tool_call>`` blocks (several, after optional prose) or a text
    that is only calls in a known format; ``(text, None)`` when it calls no offered tool."""
    names = set(tool_names)
    blocks = list(_TAGGED.finditer(text))
    if names and blocks and not _TAGGED.sub("", text[blocks[0].start() :]).strip():
        calls = []
        for block in blocks:
            parsed = _parse_json(block.group(1))
            if not parsed or not all(c["name"] in names for c in parsed):
                return text, None
            calls += parsed
        prose = text[: blocks[0].start()].strip()
        return prose or None, calls
    calls = parse_tool_calls(text, names, fmt)
    return (None, calls) if calls else (text, None)


def assistant_message(
    text: str, tool_names: Iterable[str], fmt: str = "json", *, seed_text: str = ""
) -> dict[str, Any]:
    """The OpenAI assistant message of a completion: ``tool_calls`` (stable ids from ``seed_text``) when it
    calls offered tools, else its text as content."""
    content, calls = split_tool_calls(text, tool_names, fmt)
    if calls:
        return {"role": "assistant", "content": content, "tool_calls": to_openai(calls, seed_text=seed_text)}
    return {"role": "assistant", "content": text}


def answered_trace(
    item: dict[str, Any],
    text: str,
    *,
    fmt: str,
    tools: Iterable[dict[str, Any]] | None = None,
    seed_text: str = "",
) -> dict[str, Any]:
    """The trace of a task item (a conversation without its answer) answered with a completion's ``text``:
    its messages plus ``assistant_message`` (tools: the item's ``metadata.tools``, else ``tools``)."""
    meta = dict(item.get("metadata") or {})
    offered = meta.get("tools") or list(tools or [])
    seed = seed_text or str(meta.get("task_id", ""))
    return {
        "messages": [*item["messages"], assistant_message(text, tool_names(offered), fmt, seed_text=seed)],
        "metadata": meta,
        "feedback": None,
    }


def tool_names(tools: Iterable[dict[str, Any]] | None) -> list[str]:
    """Names of OpenAI function tools (``{"type": "function", "function": {"name": ...}}``)."""
    return [str((t.get("function") or {}).get("name", "")) for t in tools or [] if isinstance(t, dict)]


def render_tool_calls(calls: Sequence[Call], fmt: str = "json") -> str:
    """The text a model in format ``fmt`` writes for ``calls``."""
    return FORMATS[_resolve(fmt)][1](calls)


def call_text(name: str, arguments: dict[str, Any], fmt: str) -> str:
    """One call as the model writes it in format ``fmt``."""
    return render_tool_calls([{"name": name, "arguments": arguments}], fmt)


# -------------------------------------------------------------------------------------------- openai
CALL_ID_LENGTH = 9
_ALNUM = string.digits + string.ascii_letters
_CALL_ID = re.compile(rf"[A-Za-z0-9]{{{CALL_ID_LENGTH}}}")


def call_id(seed: str) -> str:
    """A tool-call id: 9 letters and digits from the sha256 of ``seed`` (the same seed, the same id)."""
    number = int.from_bytes(hashlib.sha256(seed.encode("utf-8", "surrogatepass")).digest(), "big")
    out = []
    for _ in range(CALL_ID_LENGTH):
        number, digit = divmod(number, len(_ALNUM))
        out.append(_ALNUM[digit])
    return "".join(out)


def template_call_id(raw: Any) -> str:
    """The id a chat template is given for a tool call's id ``raw``: unchanged when it is already 9 letters
    and digits, else ``call_id`` of it (deterministic: a call and its tool result still match)."""
    text = raw if isinstance(raw, str) else json.dumps(raw)
    return text if _CALL_ID.fullmatch(text) else call_id(f"template:{text}")


def openai_tool_call(call: Call, *, seed_text: str = "") -> dict[str, Any]:
    """Wrap ``{"name", "arguments"}`` as an OpenAI ``tool_calls`` entry with a stable id (``call_id``)."""
    return {
        "id": call_id(seed_text + json.dumps(call, sort_keys=True)),
        "type": "function",
        "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], separators=(",", ":"))},
    }


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
                args = json.loads(args) if args.strip() else {}
            except ValueError:  # not JSON, or an integer longer than Python converts
                args = {"_raw": args}
        out.append(
            {"name": fn.get("name", ""), "arguments": args if isinstance(args, dict) else {"_raw": args}}
        )
    return out


def compact_from_openai(tool_calls: Sequence[dict[str, Any]]) -> str:
    """The compact text of an assistant message's OpenAI ``tool_calls`` (one call per line)."""
    return _render_compact(from_openai(tool_calls))


# ------------------------------------------------------------------------------------ stored shapes
def arguments_text(arguments: Any) -> str:
    """A tool call's ``arguments`` as OpenAI sends them, JSON text: text stays as it is (whatever it holds);
    anything else a client sent (an object, a number) becomes its compact JSON."""
    if isinstance(arguments, str):
        return arguments
    return json.dumps({} if arguments is None else arguments, ensure_ascii=False, separators=(",", ":"))


def normalize_tool_calls(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with every assistant tool call's ``function.arguments`` as JSON text (``arguments_text``),
    the shape a trace is stored in: one type per field, so every stored conversation fits one dataset column
    (an object beside the server's strings made Arrow refuse the whole dataset). Other messages are as
    given; the input is not changed."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if isinstance(calls, list) and any(_needs_text(c) for c in calls):
            m = {**m, "tool_calls": [_call_as_text(c) for c in calls]}
        out.append(m)
    return out


def _needs_text(call: Any) -> bool:
    fn = call.get("function") if isinstance(call, dict) else None
    return isinstance(fn, dict) and "arguments" in fn and not isinstance(fn["arguments"], str)


def _call_as_text(call: Any) -> Any:
    if not _needs_text(call):
        return call
    fn = call["function"]
    return {**call, "function": {**fn, "arguments": arguments_text(fn["arguments"])}}


def tools_problem(tools: Any) -> str | None:
    """Why ``tools`` (a trace's ``metadata.tools``: the schemas a chat template is given, and the calls a
    parser accepts) is not a list of OpenAI function tools -- ``{"type": "function", "function": {"name":
    text, "parameters": {...}}}`` -- or None when it is (None and an empty list are: no tools)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        return f"expected a list of tools, got {type(tools).__name__}"
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function":
            return f"[{i}]: expected {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}"
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            return f"[{i}].function.name: expected a non-empty string"
        if not isinstance(fn.get("description", ""), str):
            return f"[{i}].function.description: expected a string"
        if not isinstance(fn.get("parameters", {}), dict):
            return f"[{i}].function.parameters: expected a JSON schema object"
    return None
