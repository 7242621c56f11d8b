"""The OpenAI chat-completions wire format: request validation, error objects, responses and SSE chunks.

Every client mistake becomes an ``ApiError`` (4xx) rendered as OpenAI's error object
``{"error": {"message", "type", "param", "code"}}``; the server never answers 500 for bad input.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from pipeline.experience.toolcalls import tools_problem

ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """A request the server refuses, with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _no_str_or_bool(value: Any) -> Any:
    if isinstance(value, (str, bool)):
        raise ValueError("must be a number")
    return value


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _shape(self) -> Message:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        if self.role == "assistant" and self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        if self.role in ("system", "developer", "user") and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        return self


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=64)
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=dict)


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


MAX_METADATA_BYTES = 64 << 10


class ChatRequest(BaseModel):
    """``POST /v1/chat/completions`` body (unknown OpenAI parameters are accepted and ignored)."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    n: StrictInt = Field(default=1, ge=1, le=1)
    seed: StrictInt | None = None
    metadata: dict[str, Any] | None = None  # stored with the trace: what the deployment knows (`expected`...)

    _numbers = field_validator("temperature", "top_p", mode="before")(_no_str_or_bool)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 4:
            raise ValueError("at most 4 stop sequences")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and len(json.dumps(value, default=str)) > MAX_METADATA_BYTES:
            raise ValueError(f"metadata is larger than {MAX_METADATA_BYTES} bytes")
        if value is not None and (problem := tools_problem(value.get("tools"))):  # what training is given
            raise ValueError(f"tools{'' if problem.startswith('[') else ': '}{problem}")
        return value

    @field_validator("messages")
    @classmethod
    def _last(cls, value: list[Message]) -> list[Message]:
        if value and value[-1].role not in ("user", "tool"):
            raise ValueError("the last message must be a user message or a tool result")
        if value and not any(m.role == "user" for m in value):
            raise ValueError("messages need at least one user message")
        return value

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def tool_names(self) -> list[str]:
        if not self.tools or self.tool_choice == "none":
            return []
        return [t.function.name for t in self.tools]

    def plain_messages(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True) for m in self.messages]


MAX_INT_DIGITS = 4300  # Python's own limit for int(str) (sys.get_int_max_str_digits): beyond it int() raises
MAX_JSON_DEPTH = 64  # arrays and objects nested in a request body; a chat request needs a handful


class _TooManyDigits(ValueError):
    pass


def _int(text: str) -> int:
    if len(text) > MAX_INT_DIGITS:  # checked before int() does the quadratic conversion
        raise _TooManyDigits(text)
    return int(text)


def json_depth(data: Any) -> int:
    """How deep arrays and objects nest in ``data`` (iteratively: any depth is safe to measure)."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def too_deep() -> ApiError:
    return ApiError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """Decode and validate a JSON body, raising ``ApiError`` (400) with the first problem: hostile JSON
    (an integer of more than ``MAX_INT_DIGITS`` digits, nesting deeper than ``MAX_JSON_DEPTH``) is one more
    problem, never a 500."""
    try:
        data = json.loads(raw, parse_int=_int)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except _TooManyDigits:
        raise ApiError(
            400, f"request body has an integer of more than {MAX_INT_DIGITS} digits", code="invalid_json"
        ) from None
    except RecursionError:  # the decoder's own recursion bound, far beyond MAX_JSON_DEPTH
        raise too_deep() from None
    if json_depth(data) > MAX_JSON_DEPTH:
        raise too_deep()
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    try:  # a lone surrogate (`"\ud800"`) decodes, but no stored trace or spool record can hold it
        json.dumps(data, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise ApiError(400, "request body has a lone UTF-16 surrogate escape", code="invalid_json") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        msg = err["msg"].removeprefix("Value error, ")
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise ApiError(400, f"{param}: {msg}{more}" if param else msg + more, param=param) from None


def new_completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex


def completion_body(
    *,
    cid: str,
    model: str,
    message: dict[str, Any],
    finish_reason: str,
    usage: dict[str, int],
    metadata: dict[str, Any],
    created: int | None = None,
) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "chat.completion",
        "created": created or int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
        "usage": usage,
        "metadata": metadata,
    }


def chunk(
    cid: str, model: str, created: int, delta: dict[str, Any], finish_reason: str | None = None, **extra: Any
) -> str:
    body = {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
        **extra,
    }
    return sse(body)


def sse(body: Any) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage_of(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
