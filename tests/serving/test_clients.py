"""Real third-party clients, used as their documentation shows, against a real ``ratchet serve``
process on the tiny model: openai's ``parse`` and Responses API, openai-agents' default (Responses) model
running a function tool and returning an ``output_type``, LangChain's ``with_structured_output`` and
``bind_tools(tool_choice=...)``, and litellm with tools.

The tiny model is random: a parsed object, a tool call with valid arguments or a final output of the
agent's type comes back only because the server constrains decoding to the schema. The schemas bound
their strings and integers (``max_length``, ``ge``/``le``, ``Literal``) as a careful user's do: a random
model left free inside a string never closes it. A pydantic serializer warning from an SDK (a response
field of the wrong type, e.g. a non-string ``metadata`` value) fails the test.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Annotated, Literal

import litellm
import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIProvider,
    RunConfig,
    RunContextWrapper,
    Runner,
    RunResult,
    RunResultStreaming,
    ToolCallOutputItem,
    function_tool,
)
from langchain_core.messages import ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from serving.support import (
    HARNESS,
    SPECIALISTS,
    build_adapter,
    build_base,
    champion_registry,
    serve_process,
    wait_healthy,
)

pytestmark = pytest.mark.filterwarnings("error:Pydantic serializer warnings:UserWarning")

KEY = "clients-key"
POSITIONS = 512  # the tiny architecture with room for an agent's tool round trip and a JSON answer


class Order(BaseModel):
    item: str = Field(max_length=8)
    quantity: int = Field(ge=1, le=20)
    size: Literal["small", "large"]


class Forecast(BaseModel):
    city: str = Field(max_length=8)
    sunny: bool


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    """``ratchet serve`` as a process (one per module) on a registry whose champion is the tiny model;
    yields the OpenAI base URL."""
    root = tmp_path_factory.mktemp("clients")
    base = build_base(root / "base")
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "max_position_embeddings": POSITIONS}))
    adapters = {s: build_adapter(base, root / f"adapter-{s}", seed=10 + i) for i, s in enumerate(SPECIALISTS)}
    harness = {
        **HARNESS,
        "specialists": {
            name: {**sp, "decoding": {"max_new_tokens": 96}} for name, sp in HARNESS["specialists"].items()
        },
        "context": {**HARNESS["context"], "max_context_tokens": POSITIONS},
    }
    url = champion_registry(root, {"base": base, "adapters": adapters, "root": root}, harness=harness)
    log = root / "serve.log"  # the server's own account of a failing test
    proc, port = serve_process(url, root / "home", api_key=KEY, stdout=log.open("w"))
    try:
        wait_healthy(proc, port, seconds=90, output=log.read_text)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_openai_parse_returns_the_pydantic_object(server):
    client = openai.OpenAI(base_url=server, api_key=KEY)
    completion = client.chat.completions.parse(
        model="ratchet",
        messages=[{"role": "user", "content": "One order, please."}],
        response_format=Order,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Order)
    assert Order.model_validate_json(choice.message.content) == choice.message.parsed
    plain = client.chat.completions.create(model="ratchet", messages=[{"role": "user", "content": "Hi."}])
    plain.model_dump()  # what a user logs: every field of OpenAI's type (`metadata` values are strings)


def test_openai_responses_plain_streamed_retrieved_continued_parsed(server):
    client = openai.OpenAI(base_url=server, api_key=KEY)
    response = client.responses.create(model="ratchet", input="Say something.")
    assert response.id.startswith("resp_")
    if response.status != "completed":  # a random model may well run to the token limit
        assert response.status == "incomplete", response.status
        assert response.incomplete_details.reason == "max_output_tokens"
    assert isinstance(response.output_text, str)
    response.model_dump()

    events = list(client.responses.create(model="ratchet", input="Say something.", stream=True))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == f"response.{response.status}", types
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert streamed == final.output_text == response.output_text  # greedy: the same text either way

    assert client.responses.retrieve(response.id).output_text == response.output_text
    follow = client.responses.create(model="ratchet", input="And then?", previous_response_id=response.id)
    assert follow.status in ("completed", "incomplete") and follow.id != response.id

    parsed = client.responses.parse(model="ratchet", input="One order, please.", text_format=Order)
    assert isinstance(parsed.output_parsed, Order)


@dataclass
class Lookups:
    """An agent run's own state (openai-agents' ``context``)."""

    cities: list[str] = field(default_factory=list)


@function_tool(is_enabled=lambda ctx, agent: not ctx.context.cities)  # offered until it has answered
def get_weather(ctx: RunContextWrapper[Lookups], city: Annotated[str, Field(max_length=8)]) -> str:
    """The weather in a city."""
    ctx.context.cities.append(city)
    return f"sunny in {city}"


def test_openai_agents_default_model_runs_a_tool_and_returns_its_output_type(server):
    agent = Agent(
        name="forecaster",
        instructions="Look the weather up, then answer.",
        model="ratchet",
        tools=[get_weather],
        output_type=Forecast,
        model_settings=ModelSettings(tool_choice="required"),  # the first turn only (reset_tool_choice)
    )

    async def runs() -> tuple[RunResult, RunResultStreaming, list[str]]:
        async with openai.AsyncOpenAI(base_url=server, api_key=KEY) as client:
            config = RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)
            result = await Runner.run(agent, "Weather in Oslo?", context=Lookups(), run_config=config)
            streamed = Runner.run_streamed(agent, "Weather in Oslo?", context=Lookups(), run_config=config)
            kinds = [e.data.type async for e in streamed.stream_events() if e.type == "raw_response_event"]
        return result, streamed, kinds

    result, streamed, kinds = asyncio.run(runs())
    assert isinstance(result.final_output, Forecast)
    cities = result.context_wrapper.context.cities
    outputs = [item.output for item in result.new_items if isinstance(item, ToolCallOutputItem)]
    assert cities and outputs == [f"sunny in {cities[0]}"]
    assert all(r.response_id and r.response_id.startswith("resp_") for r in result.raw_responses)  # Responses
    assert streamed.final_output == result.final_output  # greedy: the same run, streamed
    assert "response.function_call_arguments.delta" in kinds and kinds.count("response.completed") == 2


@tool
def set_timer(minutes: Annotated[int, Field(ge=1, le=60)]) -> str:
    """Start a timer."""
    return f"timer set for {minutes} minutes"


@tool
def cancel_timer(which: Literal["all", "last"]) -> str:
    """Cancel timers."""
    return f"cancelled {which}"


def test_langchain_structured_output_and_bound_tools(server):
    llm = ChatOpenAI(model="ratchet", base_url=server, api_key=KEY)
    order = llm.with_structured_output(Order).invoke("One order, please.")
    assert isinstance(order, Order)

    required = llm.bind_tools([set_timer, cancel_timer], tool_choice="required").invoke(
        "A timer for 5 minutes."
    )
    assert required.tool_calls, required
    by_name = {"set_timer": set_timer, "cancel_timer": cancel_timer}
    for call in required.tool_calls:
        assert isinstance(by_name[call["name"]].invoke(call), ToolMessage)  # arguments the tool accepts

    named = llm.bind_tools([set_timer, cancel_timer], tool_choice="cancel_timer").invoke("Stop it.")
    assert [c["name"] for c in named.tool_calls] == ["cancel_timer"]
    assert cancel_timer.invoke(named.tool_calls[0]).content.startswith("cancelled ")


def test_litellm_completion_with_tools(server):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "set_timer",
                "description": "Start a timer.",
                "parameters": {
                    "type": "object",
                    "properties": {"minutes": {"type": "integer", "minimum": 1, "maximum": 60}},
                    "required": ["minutes"],
                },
            },
        }
    ]
    messages = [{"role": "user", "content": "A timer for 5 minutes."}]
    response = litellm.completion(
        model="openai/ratchet",
        api_base=server,
        api_key=KEY,
        messages=messages,
        tools=tools,
        tool_choice="required",
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "set_timer"
    assert 1 <= json.loads(call.function.arguments)["minutes"] <= 60

    messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "started"}]
    follow = litellm.completion(
        model="openai/ratchet", api_base=server, api_key=KEY, messages=messages, tools=tools
    )
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
