"""OpenAI's Responses API requests: the body, its input items as chat messages, and what a turn keeps of it.

``ResponsesRequest`` is the ``POST /v1/responses`` body (anything else is a 400 naming it). ``chat_body``
turns it (plus the conversation kept server-side) into a chat-completions body: ``instructions`` a system
message in front, messages with ``input_text`` / ``output_text`` parts joined to text, ``function_call``
items an assistant message's ``tool_calls``, ``function_call_output`` items tool messages, the flat function
tools in the chat shape, ``text.format`` as ``response_format``. ``ResponseRecord`` is the request as the
turn's trace keeps it (``metadata.response``), for ``GET`` and continuations."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

from pipeline.serving.protocol import MAX_TOP_LOGPROBS, ApiError

LOGPROBS = "message.output_text.logprobs"
# `include` values honoured (logprobs) or with nothing to include (the server writes no reasoning items)
INCLUDABLE = (LOGPROBS, "reasoning.encrypted_content")
STATUS = {
    "length": "incomplete",
    "timeout": "failed",
    "error": "failed",
    "disconnected": "cancelled",
}  # else completed


class ResponsesRequest(BaseModel):
    """``POST /v1/responses`` body."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr = Field(min_length=1, description="The served model's name.")
    input: StrictStr | list[dict[str, Any]] = Field(description="A user message, or a list of input items.")
    instructions: StrictStr | None = Field(default=None, description="A system message put in front.")
    tools: list[dict[str, Any]] | None = Field(default=None, description="Function tools (flat shape).")
    tool_choice: StrictStr | dict[str, Any] | None = Field(
        default=None, description="none/auto/required/named."
    )
    parallel_tool_calls: StrictBool | None = Field(default=None, description="More than one call per turn.")
    text: dict[str, Any] | None = Field(default=None, description="`{format: text|json_object|json_schema}`.")
    previous_response_id: StrictStr | None = Field(default=None, description="The response continued.")
    conversation: StrictStr | dict[str, Any] | None = Field(default=None, description="Conversation id.")
    max_output_tokens: StrictInt | None = Field(default=None, ge=1, description="At most this many tokens.")
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, description="Sampling temperature.")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, description="Nucleus sampling.")
    stream: StrictBool = Field(default=False, description="Answer with Server-Sent Events.")
    store: StrictBool | None = Field(default=None, description="false: not retrievable nor continued.")
    metadata: dict[str, StrictStr] | None = Field(default=None, description="Up to 16 string pairs.")
    include: list[StrictStr] | None = Field(default=None, description=f"Only `{LOGPROBS}`.")
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS, description="Per token.")
    user: StrictStr | None = Field(default=None, description="The end user (kept, not acted on).")
    truncation: Literal["disabled"] | None = Field(default=None, description="Only `disabled`.")
    reasoning: dict[str, Any] | None = Field(default=None, description="Only null (no reasoning models).")
    return_token_ids: StrictBool | None = Field(
        default=None,
        description="vLLM's: the response's `prompt_token_ids` and `token_ids` (the ids stored with the turn; "
        "embedded engine only).",
    )

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _number(cls, value: Any) -> Any:
        if isinstance(value, (str, bool)):
            raise ValueError("must be a number")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and (
            len(value) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in value.items())
        ):
            raise ValueError("at most 16 keys of at most 64 characters, values of at most 512")
        return value

    @field_validator("reasoning")
    @classmethod
    def _reasoning(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value and any(v is not None for v in value.values()):
            raise ValueError("this server serves no reasoning model: reasoning must be null")
        return value

    @field_validator("include")
    @classmethod
    def _include(cls, value: list[str] | None) -> list[str] | None:
        for item in value or []:
            if item not in INCLUDABLE:
                raise ValueError(f"{item!r} cannot be included: only {LOGPROBS!r}")
        return value

    def conversation_id(self) -> str | None:
        """The ``conversation`` given, as its id (a string, or ``{id}``)."""
        conv = self.conversation
        if isinstance(conv, dict):
            conv = conv.get("id")
        if conv is not None and (not isinstance(conv, str) or not 0 < len(conv) <= 100):
            raise ApiError(
                400, "conversation must be an id of 1 to 100 characters, or {id}", param="conversation"
            )
        return conv

    def logprobs(self) -> bool:
        return LOGPROBS in (self.include or []) or self.top_logprobs is not None


class ResponseRecord(BaseModel):
    """What a Responses turn's trace keeps beside its messages (``metadata.response``), so ``GET`` and
    ``previous_response_id`` see the request as it was."""

    model_config = ConfigDict(extra="forbid")
    created_at: int = Field(description="Unix seconds the response was created.")
    instructions: str | None = Field(description="The instructions: the trace's first (system) message.")
    previous_response_id: str | None = Field(description="The response it continued.")
    conversation: str | None = Field(description="The conversation the client named.")
    tool_choice: str | dict[str, Any] = Field(description="As the client sent it (`auto` by default).")
    parallel_tool_calls: bool = Field(description="Whether more than one call per turn was allowed.")
    text: dict[str, Any] = Field(description="The text config (`{format: ...}`).")
    temperature: float | None = Field(description="As sent.")
    top_p: float | None = Field(description="As sent.")
    max_output_tokens: int | None = Field(description="As sent.")
    top_logprobs: int | None = Field(description="As sent.")
    store: bool = Field(description="false: the response is experience, never retrieved nor continued.")
    user: str | None = Field(description="As sent.")
    metadata: dict[str, str] = Field(description="The client's metadata.")


# ------------------------------------------------------------------------------------------ request
def _text(content: Any, where: str, parts: tuple[str, ...]) -> str:
    """A message's content as text: a string, or text parts of the given types joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise ApiError(400, f"{where}.content must be a string or a list of text parts", param="input")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in parts:
            raise ApiError(
                400,
                f"{where}.content[{j}]: type {kind!r} is not supported (only {', '.join(parts)})",
                param="input",
            )
        value = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(value, str):
            raise ApiError(400, f"{where}.content[{j}] needs text", param="input")
        out.append(value)
    return "".join(out)


def _field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{where} needs {key} (a string)", param="input")
    return value


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input items as chat messages (consecutive function calls join the assistant message before them)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise ApiError(400, "input is empty", param="input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ("user", "system", "developer", "assistant"):
            role = item["role"]
            parts = ("output_text", "input_text", "refusal") if role == "assistant" else ("input_text",)
            messages.append({"role": role, "content": _text(item.get("content"), where, parts)})
        elif kind == "function_call":
            arguments = item.get("arguments", "{}")
            if not isinstance(arguments, str):
                raise ApiError(400, f"{where}.arguments must be a JSON string", param="input")
            call = {
                "id": _field(item, "call_id", where),
                "type": "function",
                "function": {"name": _field(item, "name", where), "arguments": arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = _text(item.get("output"), where, ("input_text",))
            messages.append(
                {"role": "tool", "tool_call_id": _field(item, "call_id", where), "content": output}
            )
        else:
            what = f"role {item.get('role')!r}" if kind == "message" else f"type {kind!r}"
            raise ApiError(
                400,
                f"{where}: {what} is not supported (messages of role user/system/developer/assistant, "
                "function_call, function_call_output)",
                param="input",
            )
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Flat function tools (``{type, name, description, parameters, strict}``) in the chat shape."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise ApiError(
                400,
                f"tools[{i}]: type {tool.get('type')!r} is not supported: only function tools",
                param="tools",
            )
        extra = sorted(set(tool) - {"type", "name", "description", "parameters", "strict"})
        if extra:
            raise ApiError(400, f"tools[{i}]: {extra[0]} is not supported", param="tools")
        name, params = tool.get("name"), tool.get("parameters")
        if not isinstance(name, str) or not 0 < len(name) <= 64:
            raise ApiError(400, f"tools[{i}] needs a name (1 to 64 characters)", param="tools")
        if params is not None and not isinstance(params, dict):
            raise ApiError(400, f"tools[{i}].parameters must be a JSON schema object", param="tools")
        function = {k: v for k, v in tool.items() if k != "type" and v is not None}
        out.append({"type": "function", "function": function})
    return out


def flat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Chat-shape tools (as stored with the trace) back in the Responses flat shape."""
    return [
        {"type": "function", "parameters": None, "strict": None, **t["function"]}
        for t in tools or []
        if isinstance(t, dict) and isinstance(t.get("function"), dict)
    ]


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) == {"type", "name"}:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ApiError(
        400, "tool_choice must be none, auto, required or {type: function, name}", param="tool_choice"
    )


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as the chat ``response_format`` (None: plain text)."""
    if not text:
        return None
    extra = sorted(set(text) - {"format", "verbosity"})
    if extra or text.get("verbosity") is not None:
        name = extra[0] if extra else "verbosity"
        raise ApiError(400, f"text.{name} is not supported", param=f"text.{name}")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object") and set(fmt) == {"type"}:
        return None if kind == "text" else {"type": "json_object"}
    if kind == "json_schema" and set(fmt) <= {"type", "name", "schema", "strict", "description"}:
        name, schema = fmt.get("name"), fmt.get("schema")
        if isinstance(name, str) and isinstance(schema, dict) and isinstance(fmt.get("strict", False), bool):
            body = {k: v for k, v in fmt.items() if k != "type" and v is not None}
            return {"type": "json_schema", "json_schema": body}
    raise ApiError(
        400,
        "text.format must be {type: text}, {type: json_object} or {type: json_schema, name, schema, strict}",
        param="text.format",
    )


def chat_body(req: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat-completions body for ``req`` after the kept ``history``; ``instructions`` go in front."""
    front = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    body: dict[str, Any] = {
        "model": req.model,
        "messages": [*front, *history, *input_messages(req.input)],
        "stream": req.stream,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "max_completion_tokens": req.max_output_tokens,
        "tools": chat_tools(req.tools),
        "tool_choice": chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": response_format(req.text),
        "metadata": req.metadata,
        "logprobs": True if req.logprobs() else None,
        "top_logprobs": req.top_logprobs,
        "user": req.user,
        "return_token_ids": req.return_token_ids,
    }
    return {k: v for k, v in body.items() if v is not None}


def record_of(req: ResponsesRequest, created: int, conversation: str | None) -> ResponseRecord:
    return ResponseRecord(
        created_at=created,
        instructions=req.instructions,
        previous_response_id=req.previous_response_id,
        conversation=conversation,
        tool_choice=req.tool_choice if req.tool_choice is not None else "auto",
        parallel_tool_calls=req.parallel_tool_calls is not False,
        text=req.text if req.text and req.text.get("format") else {"format": {"type": "text"}},
        temperature=req.temperature,
        top_p=req.top_p,
        max_output_tokens=req.max_output_tokens,
        top_logprobs=req.top_logprobs,
        store=req.store is not False,
        user=req.user,
        metadata=req.metadata or {},
    )


def history_of(messages: list[dict[str, Any]], record: ResponseRecord | None) -> list[dict[str, Any]]:
    """A stored turn's conversation (its messages and reply) as the next turn continues it: without its
    ``instructions`` (they are not carried over)."""
    return messages[1:] if record is not None and record.instructions is not None else list(messages)
