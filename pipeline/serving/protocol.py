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


def unknown_model(model: str, names: Any) -> ApiError:
    """The 404 of a ``model`` an adapter server (``--expose-adapters``) does not serve, naming those it does."""
    return ApiError(
        404, f"model {model!r} does not exist: adapters are {', '.join(names)}", param="model",
        code="model_not_found",
    )  # fmt: skip


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


# Tool calls one assistant message may hold: a message cannot be cut to fit the context, so its calls are
# rendered through the chat template whole, in pure Python, while the view is fitted (20,000 calls held the
# other requests' GIL share for seconds); the grammar writes at most 8 per reply.
MAX_TOOL_CALLS = 128


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=MAX_TOOL_CALLS)
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


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None


def _nested(model: type[BaseModel], value: Any) -> Any:
    """``value`` validated as ``model``, its first problem raised as one line about the parameter itself (so the
    400 names the parameter, e.g. ``response_format``, not a path inside it)."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise ValueError(
            f"{where + ': ' if where else ''}{err['msg'].removeprefix('Value error, ')}"
        ) from None


class ResponseFormat(BaseModel):
    """``response_format``: free text, any JSON object, or JSON valid under a schema (enforced while decoding)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs json_schema: {name, schema}")
        return self


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


MAX_METADATA_BYTES = 64 << 10
MAX_N = 8  # choices per request: each is a row of the batch
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
# Parameters accepted and not acted on (nothing a client relies on changes): who the end user is, caching and
# storage hints (every turn is stored as experience anyway), the service tier, and how much to reason or say
# (hints agent SDKs send with their default model settings; the specialist decodes as its harness says).
ACCEPTED = (
    "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "store", "service_tier",
    "reasoning_effort", "verbosity",
)  # fmt: skip
# Parameters refused unless absent, null or their neutral value (a 400 naming them, never a silent 200).
REFUSED = (
    "frequency_penalty", "presence_penalty", "logit_bias", "functions", "function_call", "audio", "modalities",
    "prediction", "web_search_options",
)  # fmt: skip


def _neutral(name: str, value: Any) -> bool:
    """Whether a ``REFUSED`` parameter's value asks for nothing (``0`` penalties, ``{}`` bias, text only)."""
    if value is None:
        return True
    if name in ("frequency_penalty", "presence_penalty"):
        return not isinstance(value, bool) and isinstance(value, (int, float)) and value == 0
    if name == "logit_bias":
        return value == {}
    if name == "modalities":
        return value == ["text"]
    return False


class ChatRequest(BaseModel):
    """``POST /v1/chat/completions`` body. ``unsupported()`` names a parameter the server does not honour
    (the chat route refuses it with a 400); the model itself keeps unknown fields so that the
    ``--expose-adapters`` engine stays as lenient as vLLM."""

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
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: ResponseFormat | None = None
    n: StrictInt | None = Field(default=None, ge=1, le=MAX_N)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    return_token_ids: StrictBool | None = None  # vLLM's: prompt_token_ids and each choice's token_ids
    # torch's generators take 64-bit seeds: a larger one crashed the whole decoding batch
    seed: StrictInt | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    metadata: dict[str, Any] | None = None  # stored with the trace: what the deployment knows (`expected`...)

    _numbers = field_validator("temperature", "top_p", mode="before")(_no_str_or_bool)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        if value is None or value in ("none", "auto", "required"):
            return value
        if not isinstance(value, dict):
            raise ValueError("must be none, auto, required or {type: function, function: {name}}")
        return _nested(NamedToolChoice, value)

    @field_validator("response_format", mode="before")
    @classmethod
    def _response_format(cls, value: Any) -> Any:
        return None if value is None else _nested(ResponseFormat, value)

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

    def unsupported(self) -> ApiError | None:
        """The 400 for the first parameter this server does not honour, or None."""
        for name, value in (self.model_extra or {}).items():
            if name in ACCEPTED:
                continue
            if name in REFUSED:
                if _neutral(name, value):
                    continue
                return ApiError(400, f"{name} is not supported by this server", param=name)
            return ApiError(400, f"{name} is not a parameter this server knows", param=name)
        if self.top_logprobs is not None and not self.logprobs:
            return ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if isinstance(self.tool_choice, NamedToolChoice):
            if self.tool_choice.function.name not in [t.function.name for t in self.tools or []]:
                name = self.tool_choice.function.name
                return ApiError(
                    400, f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
                )
        elif self.tool_choice == "required" and not self.tools:
            return ApiError(400, "tool_choice required needs tools", param="tool_choice")
        return None

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def choices(self) -> int:
        return self.n or 1

    def forced_tools(self) -> list[Tool] | None:
        """The tools a call must pick from when ``tool_choice`` forces one (``required``: any offered, named:
        that one); None when the model may answer in text."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t for t in self.tools or [] if t.function.name == self.tool_choice.function.name][:1]
        return list(self.tools or []) if self.tool_choice == "required" else None

    def tool_names(self) -> list[str]:
        if not self.tools or self.tool_choice == "none":
            return []
        return [t.function.name for t in self.tools]

    def plain_messages(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True) for m in self.messages]

    def passthrough(self) -> dict[str, Any]:
        """The OpenAI parameters an external engine enforces itself, as the client sent them."""
        out: dict[str, Any] = {}
        if self.response_format is not None:
            out["response_format"] = self.response_format.model_dump(by_alias=True, exclude_none=True)
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        if self.top_logprobs is not None:
            out["top_logprobs"] = self.top_logprobs
        if self.tool_names():  # tools are sent: how to call them too
            if self.tool_choice is not None:
                tc = self.tool_choice
                out["tool_choice"] = tc.model_dump() if isinstance(tc, NamedToolChoice) else tc
            if self.parallel_tool_calls is not None:
                out["parallel_tool_calls"] = self.parallel_tool_calls
        return out


MAX_INT_DIGITS = 4300  # Python's own limit for int(str) (sys.get_int_max_str_digits): beyond it int() raises
MAX_JSON_DEPTH = 64  # arrays and objects nested in a request body; a chat request needs a handful


class _TooManyDigits(ValueError):
    pass


def _int(text: str) -> int:
    if len(text) > MAX_INT_DIGITS:  # checked before int() does the quadratic conversion
        raise _TooManyDigits(text)
    return int(text)


class _NotANumber(ValueError):
    pass


def _constant(name: str) -> float:
    raise _NotANumber(name)  # NaN / Infinity: not JSON; a stored trace or rating must never hold one


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
    (an integer of more than ``MAX_INT_DIGITS`` digits, nesting deeper than ``MAX_JSON_DEPTH``, ``NaN`` or
    ``Infinity``, which Python's parser takes) is one more problem, never a 500."""
    try:
        data = json.loads(raw, parse_int=_int, parse_constant=_constant)
    except _NotANumber as exc:
        raise ApiError(
            400, f"request body has {exc}, which is not JSON (numbers are finite)", code="invalid_json"
        ) from None
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
