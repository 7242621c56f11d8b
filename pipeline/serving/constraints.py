"""What a chat request constrains its decoding to: a grammar (``response_format``, ``tool_choice``), token
logprobs, and the raw parameters an external engine enforces itself.

- ``response_format`` ``json_schema`` / ``json_object``: the reply is JSON valid under the schema / a JSON
  object (``pipeline.modeling.grammar``); ``text`` or none: free text.
- ``tool_choice`` ``required`` (a call of any offered tool) or named (a call of that tool): the reply is
  exactly the call text the harness's ``tool_call_format`` renders, so the server's parser reads it back;
  ``parallel_tool_calls: false`` allows one call. This wins over ``response_format`` (a forced call has no
  text answer); with tools under ``tool_choice`` ``auto`` and a ``response_format`` the reply is calls or
  JSON in the format (one grammar, their union: what openai-agents sends for an Agent with an ``output_type``).
- ``--engine external``: no grammar is compiled here; the client's parameters are passed through unchanged
  (``EngineRequest.passthrough``) for the engine (vLLM, SGLang) to enforce.

A schema the grammar library cannot compile is the client's 400 naming the parameter, never a 500; every
compile slot taken (``grammar.MAX_COMPILING``) is a 503 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pipeline.modeling.grammar import (
    GrammarBusy,
    GrammarError,
    GrammarSpec,
    json_object_grammar,
    json_schema_grammar,
    tool_call_grammar,
)
from pipeline.serving.protocol import ApiError, ChatRequest


def request_grammar(req: ChatRequest, *, fmt: str) -> GrammarSpec | None:
    """The grammar ``req`` asks for (None: unconstrained); ``fmt`` is the harness's ``tool_call_format``.
    Raises ``GrammarError`` for a schema over the library's limits."""
    forced = req.forced_tools()
    parallel = req.parallel_tool_calls is not False
    if forced:
        tools = [{"name": t.function.name, "parameters": t.function.parameters} for t in forced]
        return tool_call_grammar(tools, fmt=fmt, parallel=parallel)
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    if req.tool_names():  # tools under auto: calls, or the format's JSON
        tools = [{"name": t.function.name, "parameters": t.function.parameters} for t in req.tools or []]
        if rf.type == "json_object":
            return tool_call_grammar(tools, fmt=fmt, parallel=parallel, or_object=True)
        assert rf.json_schema is not None
        return tool_call_grammar(tools, fmt=fmt, parallel=parallel, or_schema=rf.json_schema.schema_)
    if rf.type == "json_object":
        return json_object_grammar()
    assert rf.json_schema is not None  # ResponseFormat's validator
    return json_schema_grammar(rf.json_schema.schema_)


async def checked_grammar(req: ChatRequest, engine: Any, *, fmt: str) -> GrammarSpec | None:
    """``request_grammar``, compiled for ``engine`` (cached by the engine) off the event loop; a schema the
    library refuses is the client's 400 naming its parameter (``tools`` for a forced call's, else
    ``response_format``; for the union of both, the one whose schema is refused alone)."""
    param = "tools" if req.forced_tools() else "response_format"
    check = getattr(engine, "check_grammar", None)
    try:
        spec = request_grammar(req, fmt=fmt)
        if spec is not None and check is not None:
            await _compile(check, spec)
    except GrammarBusy as exc:  # the server's load, not the client's mistake
        raise ApiError(
            503, str(exc), type="server_error", code="service_unavailable", headers={"Retry-After": "1"}
        ) from None
    except GrammarError as exc:
        if not req.forced_tools() and req.tool_names() and await _format_compiles(req, check):
            param = "tools"  # the union was refused, the response format alone is fine: the tools' schemas
        said = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ApiError(400, f"{param}: {said}", param=param) from None
    return spec


async def _compile(check: Any, spec: GrammarSpec) -> None:
    """``engine.check_grammar`` (synchronous on every engine: up to ``grammar.COMPILE_SECONDS`` on a hostile
    schema) off the event loop."""
    await asyncio.to_thread(check, spec)


async def _format_compiles(req: ChatRequest, check: Any) -> bool:
    """Whether the request's response format alone is a usable grammar (which part of a refused union is
    the client's mistake)."""
    rf = req.response_format
    try:
        if rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
            spec = json_schema_grammar(rf.json_schema.schema_)
            if check is not None:
                await _compile(check, spec)
    except GrammarError:
        return False
    return True


def logprobs_wanted(req: ChatRequest) -> int | None:
    """``EngineRequest.logprobs``: None (none), 0 (the chosen token's) or k (and the top k)."""
    return (req.top_logprobs or 0) if req.logprobs else None
