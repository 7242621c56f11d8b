"""The Responses API's answers: the Response object (plain, or the last event of a stream) and its stream events.

``response_object`` builds the Response for a served reply, from the request as kept in ``ResponseRecord``;
output item ids derive from the response id (``msg_<hex>``, ``fc_<hex>_<i>``), so the reply rebuilt from the
stored turn (``GET``) is the same object. A reply cut at ``max_output_tokens`` is ``incomplete``; one stopped
at the request timeout ``failed``; one whose client left ``cancelled``.
``ResponseEvents`` numbers the stream's events (``sequence_number``) and writes them as SSE.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.serving.responseitems import STATUS, ResponseRecord, flat_tools

_M = ConfigDict(extra="forbid")


class TopLogprob(BaseModel):
    model_config = _M
    token: str = Field(description="An alternative token.")
    bytes: list[int] = Field(description="Its UTF-8 bytes.")
    logprob: float = Field(description="Its log probability.")


class Logprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(description="The most likely alternatives.")


class OutputText(BaseModel):
    model_config = _M
    type: Literal["output_text"] = Field(default="output_text", description="Always `output_text`.")
    text: str = Field(description="The text.")
    annotations: list[dict[str, Any]] = Field(default_factory=list, description="Always empty.")
    logprobs: list[Logprob] | None = Field(default=None, description="With `include` logprobs.")


class OutputMessage(BaseModel):
    model_config = _M
    type: Literal["message"] = Field(default="message", description="Always `message`.")
    id: str = Field(description="`msg_` and the response id's hex.")
    role: Literal["assistant"] = Field(default="assistant", description="Always `assistant`.")
    status: Literal["in_progress", "completed", "incomplete"] = Field(description="The item's status.")
    content: list[OutputText] = Field(description="The text, one part.")


class FunctionCall(BaseModel):
    model_config = _M
    type: Literal["function_call"] = Field(default="function_call", description="Always `function_call`.")
    id: str = Field(description="`fc_`, the response id's hex and the call's index.")
    call_id: str = Field(description="The id the tool's output answers (`function_call_output.call_id`).")
    name: str = Field(description="The function called.")
    arguments: str = Field(description="Its arguments, JSON text.")
    status: Literal["in_progress", "completed", "incomplete"] = Field(description="The item's status.")


class TokenDetails(BaseModel):
    model_config = _M
    cached_tokens: int = Field(default=0, description="Always 0.")
    cache_write_tokens: int = Field(default=0, description="Always 0.")


class OutputDetails(BaseModel):
    model_config = _M
    reasoning_tokens: int = Field(default=0, description="Always 0.")


class Usage(BaseModel):
    model_config = _M
    input_tokens: int = Field(description="Tokens of the prompt the specialist was given.")
    input_tokens_details: TokenDetails = Field(default_factory=TokenDetails, description="Cache use (none).")
    output_tokens: int = Field(description="Tokens decoded.")
    output_tokens_details: OutputDetails = Field(default_factory=OutputDetails, description="No reasoning.")
    total_tokens: int = Field(description="Both.")


class ResponseError(BaseModel):
    model_config = _M
    code: str = Field(description="`server_error`.")
    message: str = Field(description="What happened.")


class ResponseObject(BaseModel):
    """OpenAI's Response object (``object: response``)."""

    model_config = _M
    id: str = Field(description="`resp_` and 32 hex digits; the trace's completion id.")
    object: Literal["response"] = Field(default="response", description="Always `response`.")
    created_at: int = Field(description="Unix seconds.")
    status: Literal["in_progress", "completed", "incomplete", "failed", "cancelled"] = Field(
        description="completed; incomplete (max_output_tokens); failed (timeout); cancelled (client left)."
    )
    error: ResponseError | None = Field(default=None, description="Why it failed.")
    incomplete_details: dict[str, str] | None = Field(default=None, description="`{reason}` when incomplete.")
    model: str = Field(description="The served model's name.")
    output: list[OutputMessage | FunctionCall] = Field(
        description="The reply: a message and/or function calls."
    )
    instructions: str | None = Field(description="As sent (not carried to a continuation).")
    tools: list[dict[str, Any]] = Field(description="The function tools offered (flat shape).")
    tool_choice: str | dict[str, Any] = Field(description="As sent.")
    parallel_tool_calls: bool = Field(description="As sent (default true).")
    text: dict[str, Any] = Field(description="The text config (`{format}`).")
    temperature: float | None = Field(description="As sent.")
    top_p: float | None = Field(description="As sent.")
    max_output_tokens: int | None = Field(description="As sent.")
    top_logprobs: int | None = Field(description="As sent.")
    previous_response_id: str | None = Field(description="The response this one continued.")
    conversation: dict[str, str] | None = Field(description="`{id}` when the client named a conversation.")
    store: bool = Field(description="false: not retrievable nor continued (still experience).")
    truncation: Literal["disabled"] = Field(default="disabled", description="Always `disabled`.")
    reasoning: None = Field(default=None, description="Always null.")
    user: str | None = Field(description="As sent.")
    metadata: dict[str, str] = Field(
        description="The client's, plus `specialist`, `generation`, `route_reason`."
    )
    usage: Usage | None = Field(description="Token counts (null until completed).")
    prompt_token_ids: list[int] | None = Field(
        default=None, description="With `return_token_ids`: exactly the ids the model was given (vLLM's)."
    )
    token_ids: list[int] | None = Field(
        default=None, description="With `return_token_ids`: exactly the ids it decoded, end token included."
    )


def output_items(rid: str, message: dict[str, Any], *, status: str, logprobs: list[Logprob] | None) -> list:
    """The reply as output items: a message when it has text, then one function call per tool call."""
    hexid = rid.removeprefix("resp_")
    item_status = "incomplete" if status == "incomplete" else "completed"
    items: list[OutputMessage | FunctionCall] = []
    if message.get("content") or not message.get("tool_calls"):
        text = OutputText(text=message.get("content") or "", logprobs=logprobs)
        items.append(OutputMessage(id=f"msg_{hexid}", status=item_status, content=[text]))
    for i, call in enumerate(message.get("tool_calls") or []):
        args = call["function"].get("arguments", "{}")
        items.append(
            FunctionCall(
                id=f"fc_{hexid}_{i}",
                call_id=call["id"],
                name=call["function"]["name"],
                arguments=args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
                status=item_status,
            )
        )
    return items


def _finite(value: float) -> float:
    return value if math.isfinite(value) else -9999.0  # OpenAI's floor; JSON has no -inf


def logprobs_of(tokens: list[Any] | None) -> list[Logprob] | None:
    """The engine's ``decoder.TokenLogprob`` list in the Responses shape."""
    if tokens is None:
        return None
    return [
        Logprob(
            token=t.token,
            bytes=list(t.bytes),
            logprob=_finite(t.logprob),
            top_logprobs=[TopLogprob(token=s, logprob=_finite(lp), bytes=list(b)) for s, lp, b in t.top],
        )
        for t in tokens
    ]


def response_object(
    rid: str,
    record: ResponseRecord,
    *,
    model: str,
    tools: list[dict[str, Any]] | None,
    meta: dict[str, Any],
    message: dict[str, Any] | None = None,
    finish_reason: str | None = None,
    tokens: tuple[int, int] | None = None,
    logprobs: list[Logprob] | None = None,
    token_ids: tuple[list[int] | None, list[int] | None] = (None, None),
) -> ResponseObject:
    """The Response for ``message`` (None: still in progress); ``meta``: the turn's specialist, generation and
    route reason; ``tokens``: (input, output); ``token_ids``: (prompt, completion) ids when asked for."""
    status = "in_progress" if message is None else STATUS.get(finish_reason or "", "completed")
    error = None
    if status == "failed":
        why = "constrained decoding failed" if finish_reason == "error" else "stopped at the request timeout"
        error = ResponseError(code="server_error", message=why)
    return ResponseObject(
        id=rid,
        created_at=record.created_at,
        status=status,  # type: ignore[arg-type]
        error=error,
        incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
        model=model,
        output=[] if message is None else output_items(rid, message, status=status, logprobs=logprobs),
        instructions=record.instructions,
        tools=flat_tools(tools),
        tool_choice=record.tool_choice,
        parallel_tool_calls=record.parallel_tool_calls,
        text=record.text,
        temperature=record.temperature,
        top_p=record.top_p,
        max_output_tokens=record.max_output_tokens,
        top_logprobs=record.top_logprobs,
        previous_response_id=record.previous_response_id,
        conversation={"id": record.conversation} if record.conversation else None,
        store=record.store,
        user=record.user,
        metadata={
            **record.metadata,
            **{k: str(meta[k]) for k in ("specialist", "generation", "route_reason")},
        },
        usage=None
        if tokens is None
        else Usage(input_tokens=tokens[0], output_tokens=tokens[1], total_tokens=sum(tokens)),
        prompt_token_ids=token_ids[0],
        token_ids=token_ids[1],
    )


class ResponseEvents:
    """The stream's events as SSE lines, numbered from 0 (``sequence_number``)."""

    def __init__(self) -> None:
        self.number = 0

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        data = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n"

    def lifecycle(self, kind: str, response: ResponseObject) -> str:
        return self.event(f"response.{kind}", response=response.model_dump(mode="json"))

    def items(self, response: ResponseObject, *, opened: bool = False) -> list[str]:
        """The events that stream ``response``'s output once it is complete (added, the text or arguments,
        done), item by item; ``opened``: the first item's text was streamed already (``open_text``, ``delta``)."""
        out = []
        for index, item in enumerate(response.output):
            if isinstance(item, OutputMessage):
                streamed = opened and index == 0
                deltas = [] if streamed else [item.content[0].text]
                out.extend(self.text(item, index, deltas=deltas, opened=streamed))
            else:
                added = item.model_copy(update={"status": "in_progress", "arguments": ""})
                where = {"item_id": item.id, "output_index": index}
                out += [
                    self.event("response.output_item.added", output_index=index, item=added.model_dump()),
                    self.event("response.function_call_arguments.delta", **where, delta=item.arguments),
                    self.event("response.function_call_arguments.done", **where, arguments=item.arguments),
                ]
            out.append(self.event("response.output_item.done", output_index=index, item=item.model_dump()))
        return out

    def open_text(self, item_id: str, index: int) -> list[str]:
        """A message item's first events, before its text is known."""
        item = OutputMessage(id=item_id, status="in_progress", content=[])
        part = OutputText(text="").model_dump(mode="json", exclude_none=True)
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        return [
            self.event("response.output_item.added", output_index=index, item=item.model_dump(mode="json")),
            self.event("response.content_part.added", **where, part=part),
        ]

    def delta(self, item_id: str, index: int, text: str) -> str:
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        return self.event("response.output_text.delta", **where, delta=text, logprobs=[])

    def text(self, item: OutputMessage, index: int, *, deltas: list[str], opened: bool) -> list[str]:
        """A message item's text events (``opened``: its added events were sent already), up to its part's done."""
        out = [] if opened else self.open_text(item.id, index)
        out.extend(self.delta(item.id, index, d) for d in deltas if d)
        part = item.content[0]
        where = {"item_id": item.id, "output_index": index, "content_index": 0}
        logprobs = [
            {
                "token": lp.token,
                "logprob": lp.logprob,
                "top_logprobs": [t.model_dump() for t in lp.top_logprobs],
            }
            for lp in part.logprobs or []
        ]
        out.append(self.event("response.output_text.done", **where, text=part.text, logprobs=logprobs))
        out.append(self.event("response.content_part.done", **where, part=part.model_dump(mode="json")))
        return out
