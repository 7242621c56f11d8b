"""The chat route's answers: ``chat.completion`` bodies and ``chat.completion.chunk`` streams for one request's
choices.

- ``n`` choices, each with its ``index``; usage counts the prompt once and every choice's completion.
- ``logprobs``: ``choices[i].logprobs = {"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}``
  (a streamed choice carries them on its last chunk).
- ``return_token_ids`` (vLLM's): top-level ``prompt_token_ids`` and per choice ``token_ids`` (streamed: on
  the choice's last chunk), exactly the ids stored with the turn (``Experience.served_tokens``).
- Tool calls stream in OpenAI's delta shape once the reply is whole (a call is only known then): per call a
  chunk ``{"tool_calls": [{index, id, type: "function", function: {name, arguments: ""}}]}`` and one with its
  ``arguments``; the choice ends with ``finish_reason`` ``tool_calls``. Text streams as it is decoded unless
  tools were offered (then it comes whole, at the end).
- ``metadata`` (on the body and the first chunk): ``specialist``, ``generation``, ``route_reason``, all
  strings (OpenAI's type).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import Any

from pipeline.serving.engines import EngineResult
from pipeline.serving.protocol import sse, usage_of
from pipeline.serving.traces import ChatTurn
from pipeline.serving.turns import ServerState

Reply = tuple[dict, str, EngineResult]  # (message, finish_reason, result) of one choice


def response_meta(turn: ChatTurn) -> dict[str, str]:
    """The response's ``metadata``: who served the turn and why, every value a string."""
    return {
        "specialist": turn.decision.specialist,
        "generation": str(turn.served.number),
        "route_reason": turn.decision.reason,
    }


def response_headers(turn: ChatTurn) -> dict[str, str]:
    return {"X-Ratchet-Specialist": turn.decision.specialist, "X-Ratchet-Generation": str(turn.served.number)}


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else -9999.0  # OpenAI's floor; JSON has no -inf


def logprobs_body(result: EngineResult) -> dict[str, Any] | None:
    """OpenAI's ``choices[i].logprobs`` of a result (None when none were asked for)."""
    if result.logprobs is None:
        return None
    content = [
        {
            "token": lp.token,
            "logprob": _logprob(lp.logprob),
            "bytes": list(lp.bytes),
            "top_logprobs": [
                {"token": token, "logprob": _logprob(value), "bytes": list(raw)}
                for token, value, raw in lp.top
            ],
        }
        for lp in result.logprobs
    ]
    return {"content": content, "refusal": None}


def _ids(turn: ChatTurn, result: EngineResult) -> dict[str, Any]:
    if not turn.req.return_token_ids:
        return {}
    return {"token_ids": list(result.completion_ids) if result.completion_ids is not None else None}


def _prompt_ids(turn: ChatTurn, result: EngineResult) -> dict[str, Any]:
    if not turn.req.return_token_ids:
        return {}
    return {"prompt_token_ids": list(result.prompt_ids) if result.prompt_ids is not None else None}


def _usage(replies: list[Reply]) -> dict[str, int]:
    return usage_of(replies[0][2].prompt_tokens, sum(result.completion_tokens for _m, _f, result in replies))


def completion_response(turns: list[ChatTurn], replies: list[Reply]) -> dict[str, Any]:
    """The ``chat.completion`` body of a request's choices (``turns[i]`` answered by ``replies[i]``)."""
    first = turns[0]
    choices = [
        {
            "index": turn.choice,
            "message": message,
            "finish_reason": finish,
            "logprobs": logprobs_body(result),
            **_ids(turn, result),
        }
        for turn, (message, finish, result) in zip(turns, replies, strict=True)
    ]
    return {
        "id": first.cid,
        "object": "chat.completion",
        "created": first.created,
        "model": first.req.model,
        "choices": choices,
        "usage": _usage(replies),
        "metadata": response_meta(first),
        **_prompt_ids(first, replies[0][2]),
    }


class ChoiceQueue:
    """What ``ServerState.produce`` writes to for choice ``index``: its items go to the shared queue tagged."""

    def __init__(self, queue: asyncio.Queue, index: int):
        self.queue, self.index = queue, index

    def put_nowait(self, item: Any) -> None:
        self.queue.put_nowait((self.index, item))


def _chunk(turn: ChatTurn, choices: list[dict[str, Any]], **extra: Any) -> str:
    body = {
        "id": turn.cid,
        "object": "chat.completion.chunk",
        "created": turn.created,
        "model": turn.req.model,
        "choices": choices,
        **extra,
    }
    return sse(body)


def _delta(index: int, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None, **extra}


def call_deltas(tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Finished tool calls as stream deltas, OpenAI's way: each call's head (id, name, no arguments), then
    its arguments."""
    out = []
    for k, call in enumerate(tool_calls):
        fn = call["function"]
        head = {
            "index": k,
            "id": call["id"],
            "type": "function",
            "function": {"name": fn["name"], "arguments": ""},
        }
        out += [
            {"tool_calls": [head]},
            {"tool_calls": [{"index": k, "function": {"arguments": fn["arguments"]}}]},
        ]
    return out


def _ending(first: ChatTurn, turn: ChatTurn, reply: Reply, buffered: bool) -> list[str]:
    """The last chunks of one choice: its buffered text or tool calls, then its finish reason (with its
    logprobs and token ids when asked for)."""
    message, finish, result = reply
    out, i = [], turn.choice
    if buffered and message.get("content"):
        out.append(_chunk(first, [_delta(i, {"content": message["content"]})]))
    out += [_chunk(first, [_delta(i, delta)]) for delta in call_deltas(message.get("tool_calls") or [])]
    last = _delta(i, {}, finish, **_ids(turn, result))
    last["logprobs"] = logprobs_body(result)
    out.append(_chunk(first, [last], **_prompt_ids(turn, result)))
    return out


async def completion_stream(
    state: ServerState, turns: list[ChatTurn], queue: asyncio.Queue, watcher: asyncio.Task
) -> AsyncIterator[str]:
    """SSE chunks of a request's choices, read from ``queue`` (``(index, item)`` from ``ServerState.produce``
    through ``ChoiceQueue``); if the client leaves first, its rows are dropped."""
    first = turns[0]
    req = first.req
    buffered = bool(req.tool_names())  # a tool call is only known once the whole text is there
    replies: dict[int, Reply] = {}
    try:
        opening = [
            _delta(t.choice, {"role": "assistant", "content": None if buffered else ""}) for t in turns
        ]
        yield _chunk(first, opening, metadata=response_meta(first))
        while len(replies) < len(turns):
            try:
                index, item = await asyncio.wait_for(queue.get(), state.time_left(first))
            except TimeoutError:
                yield sse(state.timeout_error().body())
                return
            if isinstance(item, Exception):
                yield sse({"error": {"message": "internal server error", "type": "server_error"}})
                return
            if isinstance(item, tuple):
                if item[2].finish_reason == "timeout":
                    yield sse(state.timeout_error().body())
                    return
                if item[2].finish_reason == "error":
                    yield sse(state.decoding_error().body())
                    return
                replies[index] = item
                ending = (  # a choice's logprobs can be large: built and encoded off the event loop
                    await asyncio.to_thread(_ending, first, turns[index], item, buffered)
                    if req.logprobs
                    else _ending(first, turns[index], item, buffered)
                )
                for event in ending:
                    yield event
            elif not buffered:
                yield _chunk(first, [_delta(index, {"content": item})])
        if req.stream_options is not None and req.stream_options.include_usage:
            yield _chunk(first, [], usage=_usage([replies[t.choice] for t in turns]))
        yield "data: [DONE]\n\n"
    finally:  # closed early (the client left) or done: either way nothing more is decoded for it
        watcher.cancel()
        first.abort.set("disconnected")
