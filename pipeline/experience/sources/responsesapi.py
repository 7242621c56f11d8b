"""OpenAI Responses API calls as a trace store logs them -> chat messages.

A Responses call (``client.responses.create``: what the openai-agents SDK sends by default) is logged with its
request (``input``: text or a list of items; ``instructions``; flat function ``tools``) and its ``Response``
(``output`` items). ``instructions`` become a system message in front; ``message`` items (``input_text`` /
``output_text`` parts joined) chat messages; consecutive ``function_call`` items one assistant message's
``tool_calls``; ``function_call_output`` items tool messages. Reasoning and other items are not kept.
"""

from __future__ import annotations

from typing import Any

from pipeline.experience.ingest import TraceError
from pipeline.experience.sources.intake import chat_message

TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"]
            for p in content
            if isinstance(p, dict) and p.get("type") in TEXT_PARTS and isinstance(p.get("text"), str)
        )
    raise TraceError(f"{where}.content: expected text or a list of text parts")


def item_messages(items: Any, where: str) -> list[dict[str, Any]]:
    """Responses items (or a user's text) as OpenAI chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise TraceError(f"{where}: expected text or a list of items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise TraceError(f"{where}[{i}]: expected an item object")
        kind = item.get("type", "message")
        if kind == "message" and isinstance(item.get("role"), str):
            out.append(
                chat_message({"role": item["role"], "content": _text(item.get("content"), f"{where}[{i}]")})
            )
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            last = out[-1] if out else None
            if last is not None and last.get("role") == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(
                    chat_message({"role": "assistant", "tool_calls": [call]})["tool_calls"][0]
                )
            else:
                out.append(chat_message({"role": "assistant", "content": None, "tool_calls": [call]}))
        elif kind == "function_call_output":
            output = item.get("output")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": _text(output, f"{where}[{i}]"),
                }
            )
    return out


def responses_messages(request: dict[str, Any], response: Any) -> list[dict[str, Any]]:
    """The conversation of one Responses call: instructions, input items, then the output items."""
    messages = []
    if isinstance(request.get("instructions"), str) and request["instructions"]:
        messages.append({"role": "system", "content": request["instructions"]})
    messages += item_messages(request.get("input"), "input")
    output = response.get("output") if isinstance(response, dict) else None
    answer = item_messages(output, "output") if isinstance(output, list) else []
    if not answer or any(m["role"] != "assistant" for m in answer):
        raise TraceError("output: expected the response's assistant message or function calls")
    if len(answer) > 1:  # prose, then calls: one assistant message
        calls = [c for m in answer for c in m.get("tool_calls", [])]
        text = "".join(m.get("content") or "" for m in answer if isinstance(m.get("content"), str))
        answer = [chat_message({"role": "assistant", "content": text or None, "tool_calls": calls})]
    return messages + answer
