"""``POST /v1/responses`` and ``GET /v1/responses/{id}`` against a real uvicorn server on the tiny model, driven by
the unchanged ``openai`` SDK (and the openai-agents SDK's default model): plain, instructions, a function tool
and its output, ``text.format`` json_schema, streamed events the SDK assembles, ``previous_response_id`` kept
server-side, retrieval, a stranger's key that can neither read nor continue someone else's response, 400s
naming the parameter, and the experience row (completion id = the response id, the chain's conversation)."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from pipeline.serving.served import ServeConfig
from pipeline.serving.server import create_app
from serving.support import ServerThread, api_keys, champion_registry, rows_by_id


class Verdict(pydantic.BaseModel):
    answer: Literal["yes", "no"]


TIMER_TOOL = {
    "type": "function",
    "name": "set_timer",
    "description": "Start a timer.",
    "parameters": {"type": "object", "properties": {"minutes": {"type": "integer"}}},
}
OPERATOR_KEY = "operator-key"


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_artifacts):
    url = champion_registry(tmp_path_factory.mktemp("responses"), tiny_artifacts)
    keys = api_keys(url, alice="chat", bob="chat")
    config = ServeConfig(
        registry_url=url, device="cpu", poll_seconds=0, flush_seconds=0.05, api_key=OPERATOR_KEY
    )
    with ServerThread(create_app(config)) as srv:
        yield {"url": url, "base": srv.url, "keys": {k: v["Authorization"][7:] for k, v in keys.items()}}


def sdk(served, who: str = "alice") -> openai.OpenAI:
    key = OPERATOR_KEY if who == "operator" else served["keys"][who]
    return openai.OpenAI(base_url=served["base"] + "/v1", api_key=key, max_retries=0)


def test_plain_and_with_instructions(served):
    client = sdk(served)
    plain = client.responses.create(model="ratchet", input="12+35=?", max_output_tokens=6, temperature=0)
    assert plain.id.startswith("resp_") and plain.object == "response"
    assert plain.status in ("completed", "incomplete") and plain.model == "ratchet"
    assert [o.type for o in plain.output] == ["message"]
    assert plain.output[0].content[0].type == "output_text" and plain.output_text
    usage = plain.usage
    assert 0 < usage.output_tokens <= 6 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert all(isinstance(v, str) for v in plain.metadata.values()) and plain.metadata["specialist"] == "chat"
    assert plain.instructions is None and plain.previous_response_id is None and plain.tools == []

    told = client.responses.create(
        model="ratchet",
        instructions="Answer in one word.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "hello"}]}],
        max_output_tokens=4,
        metadata={"session": "s-1"},
    )
    assert told.instructions == "Answer in one word." and told.metadata["session"] == "s-1"
    rows = rows_by_id(served["url"], told.id, plain.id)
    row = rows[told.id]  # the trace's completion id is the response id; the model saw the instructions
    assert row.messages[0] == {"role": "system", "content": "Answer in one word."}
    assert row.messages[1] == {"role": "user", "content": "hello"}
    assert row.messages[-1]["role"] == "assistant" and row.messages[-1]["content"] == told.output_text
    assert row.principal == "alice" and row.source == "deployment"
    assert rows[plain.id].messages[0] == {"role": "user", "content": "12+35=?"}
    assert row.conversation_id == told.id  # a chain's first response names its conversation


def test_function_tool_round_trip_and_previous_response_id(served):
    client = sdk(served)
    call = client.responses.create(
        model="ratchet", input="timer 3+4", tools=[TIMER_TOOL], max_output_tokens=30
    )
    calls = [o for o in call.output if o.type == "function_call"]
    assert calls and calls[0].name == "set_timer" and json.loads(calls[0].arguments) == {"minutes": 7}
    assert call.metadata["specialist"] == "agent" and call.tools[0].name == "set_timer"
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "timer started"}

    # the client keeps the conversation: its input, the output items as they came, and the tool's output
    items = [
        {"role": "user", "content": "timer 3+4"},
        *[o.model_dump(exclude_none=True) for o in call.output],
    ]
    follow = client.responses.create(
        model="ratchet", input=[*items, result], tools=[TIMER_TOOL], max_output_tokens=5
    )
    assert follow.metadata["route_reason"] == "tool result continues on agent"

    # the server keeps it: only the tool's output is sent
    kept = client.responses.create(
        model="ratchet", previous_response_id=call.id, input=[result], tools=[TIMER_TOOL], max_output_tokens=5
    )
    assert kept.previous_response_id == call.id
    assert kept.metadata["route_reason"] == "tool result continues on agent"
    rows = rows_by_id(served["url"], call.id, follow.id, kept.id)
    for rid in (follow.id, kept.id):
        msgs = rows[rid].messages
        assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant"]
        assert (
            msgs[1]["tool_calls"][0]["id"] == calls[0].call_id and msgs[2]["tool_call_id"] == calls[0].call_id
        )
    assert rows[kept.id].conversation_id == call.id == rows[call.id].conversation_id
    assert rows[follow.id].conversation_id == follow.id  # sent whole: a conversation of its own
    assert rows[call.id].tools == [
        {
            "type": "function",
            "function": {k: v for k, v in TIMER_TOOL.items() if k != "type"},
        }
    ]


def test_previous_response_id_keeps_the_conversation_not_the_instructions(served):
    client = sdk(served)
    first = client.responses.create(model="ratchet", instructions="I1", input="hello", max_output_tokens=4)
    second = client.responses.create(
        model="ratchet",
        instructions="I2",
        input="12+35=?",
        previous_response_id=first.id,
        max_output_tokens=4,
    )
    third = client.responses.create(
        model="ratchet", input="and 1+1?", previous_response_id=second.id, max_output_tokens=4
    )
    rows = rows_by_id(served["url"], first.id, second.id, third.id)
    assert rows[second.id].messages == [
        {"role": "system", "content": "I2"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "12+35=?"},
        {"role": "assistant", "content": second.output_text},
    ]
    assert [m["content"] for m in rows[third.id].messages] == [
        "hello", first.output_text, "12+35=?", second.output_text, "and 1+1?", third.output_text,
    ]  # fmt: skip
    assert {rows[r.id].conversation_id for r in (first, second, third)} == {first.id}
    assert third.previous_response_id == second.id and third.instructions is None


def test_text_format_json_schema_gives_schema_valid_json(served):
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
        "required": ["answer", "sure"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}
    resp = sdk(served).responses.create(
        model="ratchet", input="is 12+35=47?", text={"format": fmt}, max_output_tokens=60
    )
    jsonschema.validate(json.loads(resp.output_text), schema)  # a random model, constrained decoding
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "verdict"

    parsed = sdk(served).responses.parse(
        model="ratchet", input="is 12+35=47?", text_format=Verdict, max_output_tokens=60
    )
    assert isinstance(parsed.output_parsed, Verdict)


def test_named_tool_choice_and_logprobs(served):
    client = sdk(served)
    forced = client.responses.create(
        model="ratchet",
        input="hello",
        tools=[TIMER_TOOL],
        tool_choice={"type": "function", "name": "set_timer"},
        parallel_tool_calls=False,
        max_output_tokens=100,  # a char-level tokenizer: the call's text is ~65 tokens
    )
    [call] = [
        o for o in forced.output if o.type == "function_call"
    ]  # constrained: a call, whatever the model
    assert call.name == "set_timer" and isinstance(json.loads(call.arguments), dict)
    assert forced.tool_choice.name == "set_timer" and forced.parallel_tool_calls is False

    scored = client.responses.create(
        model="ratchet",
        input="12+35=?",
        include=["message.output_text.logprobs"],
        top_logprobs=2,
        max_output_tokens=5,
    )
    logprobs = scored.output[0].content[0].logprobs
    assert len(logprobs) == scored.usage.output_tokens and all(len(t.top_logprobs) == 2 for t in logprobs)
    assert "".join(t.token for t in logprobs) == scored.output_text and scored.top_logprobs == 2


def test_stream_events_are_assembled_by_the_sdk(served):
    client = sdk(served)
    with client.responses.stream(model="ratchet", input="f adds 1 2", max_output_tokens=6) as stream:
        events = list(stream)  # the SDK checks each event against the response it assembles
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    # a random model runs into max_output_tokens: OpenAI's terminal event for that is response.incomplete
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    final = events[-1].response
    assert deltas and deltas[-1].snapshot == final.output_text == "".join(e.delta for e in deltas)
    assert final.usage.output_tokens <= 6 and final.id == events[0].response.id
    assert final.status == kinds[-1].removeprefix("response.")
    stored = rows_by_id(served["url"], final.id)[final.id]
    assert stored.messages[-1]["content"] == final.output_text
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()

    raw = list(
        client.responses.create(
            model="ratchet", input="timer 3+4", tools=[TIMER_TOOL], max_output_tokens=30, stream=True
        )
    )
    done = [e for e in raw if e.type == "response.function_call_arguments.done"]
    assert done and json.loads(done[0].arguments) == {"minutes": 7}
    assert raw[-1].type == "response.completed"
    completed = raw[-1].response
    assert completed.output[-1].type == "function_call" and completed.output[-1].name == "set_timer"


def test_return_token_ids_are_the_ids_stored_with_the_turn(served):
    """vLLM's ``return_token_ids`` on the Responses endpoint, plain and streamed: ``prompt_token_ids`` /
    ``token_ids`` are exactly the ``served_tokens`` the turn is stored with (what training learns)."""
    client = sdk(served)
    plain = client.responses.create(
        model="ratchet", input="12+35=?", max_output_tokens=5, extra_body={"return_token_ids": True}
    )
    events = list(
        client.responses.create(
            model="ratchet",
            input="hello",
            max_output_tokens=5,
            stream=True,
            extra_body={"return_token_ids": True},
        )
    )
    streamed = events[-1].response
    rows = rows_by_id(served["url"], plain.id, streamed.id)
    for response in (plain, streamed):
        extra = response.model_extra or {}
        row = rows[response.id]
        stored = row.served_tokens[str(len(row.messages) - 1)]
        assert extra["prompt_token_ids"] == stored["prompt_ids"] and extra["prompt_token_ids"]
        assert extra["token_ids"] == stored["completion_ids"] and extra["token_ids"]
    without = client.responses.create(model="ratchet", input="hi", max_output_tokens=3)
    assert (without.model_extra or {}).get("token_ids") is None


def test_retrieve_rebuilds_the_response(served):
    client = sdk(served)
    made = client.responses.create(
        model="ratchet",
        instructions="be brief",
        input="timer 3+4",
        tools=[TIMER_TOOL],
        tool_choice="auto",
        metadata={"k": "v"},
        max_output_tokens=30,
    )
    got = client.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump()
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_" + "0" * 32)


def test_a_stranger_can_neither_read_nor_continue_a_response(served):
    mine = sdk(served, "alice").responses.create(model="ratchet", input="hello", max_output_tokens=3)
    stranger = sdk(served, "bob")
    with pytest.raises(openai.NotFoundError) as read:
        stranger.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError) as cont:
        stranger.responses.create(model="ratchet", input="more", previous_response_id=mine.id)
    assert cont.value.body["param"] == "previous_response_id"
    unknown = "resp_" + "f" * 32  # the same answer as for an id that does not exist
    with pytest.raises(openai.NotFoundError) as missing:
        stranger.responses.retrieve(unknown)
    assert read.value.body["message"].replace(mine.id, unknown) == missing.value.body["message"]
    assert sdk(served, "operator").responses.retrieve(mine.id).id == mine.id  # an admin key may


def test_store_false_is_recorded_but_not_retrievable(served):
    client = sdk(served)
    gone = client.responses.create(model="ratchet", input="hello", store=False, max_output_tokens=3)
    assert gone.id in rows_by_id(served["url"], gone.id)  # still experience
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="ratchet", input="more", previous_response_id=gone.id)


OK = {"model": "ratchet", "input": "hello", "max_output_tokens": 3}


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({**OK, "frequency_penalty": 1}, 400, "frequency_penalty"),
        ({**OK, "background": True}, 400, "background"),
        ({**OK, "tools": [{"type": "web_search"}]}, 400, "tools"),
        ({**OK, "tools": [{"type": "function"}]}, 400, "tools"),
        ({**OK, "text": {"format": {"type": "json_schema", "schema": {}}}}, 400, "text.format"),
        ({**OK, "text": {"format": {"type": "yaml"}}}, 400, "text.format"),
        ({**OK, "text": {"format": {"type": "json_schema", "name": "x", "schema": 5}}}, 400, "text.format"),
        ({**OK, "reasoning": {"effort": "high"}}, 400, "reasoning"),
        ({**OK, "truncation": "auto"}, 400, "truncation"),
        ({**OK, "include": ["file_search_call.results"]}, 400, "include"),
        ({**OK, "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice"),
        ({**OK, "metadata": {"n": 1}}, 400, "metadata"),
        ({**OK, "temperature": 5}, 400, "temperature"),
        ({**OK, "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({**OK, "input": []}, 400, "input"),
        (
            {**OK, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            400,
            "input",
        ),
        ({**OK, "input": [{"type": "reasoning", "summary": []}]}, 400, "input"),
        ({**OK, "input": [{"role": "assistant", "content": "hi"}]}, 400, "input"),
        ({**OK, "previous_response_id": "resp_x", "conversation": "c"}, 400, "conversation"),
        ({**OK, "previous_response_id": "resp_nothing"}, 404, "previous_response_id"),
        ({**OK, "model": "gpt-4o"}, 404, "model"),
        ({**OK, "stream": "yes"}, 400, "stream"),
    ],
)
def test_unsupported_or_wrong_parameters_are_4xx_naming_them(served, body, status, param):
    auth = {"Authorization": f"Bearer {served['keys']['alice']}"}
    r = httpx.post(served["base"] + "/v1/responses", json=body, headers=auth, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err
    assert httpx.post(served["base"] + "/v1/responses", json=OK, headers=auth, timeout=60).status_code == 200


def test_conversation_id_links_and_continues(served):
    client = sdk(served)
    one = client.responses.create(model="ratchet", input="hello", conversation="conv-7", max_output_tokens=3)
    two = client.responses.create(
        model="ratchet", input="12+35=?", conversation={"id": "conv-7"}, max_output_tokens=3
    )
    assert two.conversation.id == "conv-7"
    rows = rows_by_id(served["url"], one.id, two.id)
    assert rows[one.id].conversation_id == rows[two.id].conversation_id == "conv-7"
    assert [m["content"] for m in rows[two.id].messages] == [
        "hello", one.output_text, "12+35=?", two.output_text,
    ]  # fmt: skip
    # another principal's conversation of the same name is not theirs to continue
    other = sdk(served, "bob").responses.create(
        model="ratchet", input="hi", conversation="conv-7", max_output_tokens=3
    )
    assert [m["role"] for m in rows_by_id(served["url"], other.id)[other.id].messages] == [
        "user",
        "assistant",
    ]


def test_openai_agents_default_model_runs_a_tool(served):
    """The openai-agents SDK's default model (``OpenAIResponsesModel``) as an agent uses it: what it sends is
    accepted, and the function call it reads runs the tool."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    started: list[int] = []

    @agents.function_tool
    def set_timer(minutes: int) -> str:
        """Start a timer."""
        started.append(minutes)
        return "timer started"

    client = openai.AsyncOpenAI(
        base_url=served["base"] + "/v1", api_key=served["keys"]["alice"], max_retries=0
    )
    agent = agents.Agent(
        name="timer",
        tools=[set_timer],
        model=agents.OpenAIResponsesModel(model="ratchet", openai_client=client),
        model_settings=agents.ModelSettings(max_tokens=30, tool_choice="auto", metadata={"run": "r1"}),
        tool_use_behavior="stop_on_first_tool",  # a random model's text after the tool would hit max_tokens
    )

    typed = agents.Agent(
        name="verdict",
        instructions="Say whether it holds.",
        output_type=Verdict,
        model=agents.OpenAIResponsesModel(model="ratchet", openai_client=client),
        model_settings=agents.ModelSettings(max_tokens=60),
    )

    async def runs():  # one event loop: the client's connections belong to it
        tool = await agents.Runner.run(agent, "timer 3+4", max_turns=2)
        verdict = await agents.Runner.run(typed, "is 12+35=47?")
        streamed = agents.Runner.run_streamed(typed, "is 1+1=2?")
        kinds = [e.type async for e in streamed.stream_events()]
        return tool, verdict, streamed, kinds

    result, verdict, streamed, kinds = asyncio.run(runs())
    assert started == [7] and result.final_output == "timer started"
    assert result.raw_responses[0].response_id.startswith("resp_")
    assert isinstance(verdict.final_output, Verdict)  # its text.format json_schema, enforced while decoding
    assert isinstance(streamed.final_output, Verdict) and "raw_response_event" in kinds


def test_a_response_past_the_timeout_is_504_or_failed_and_recorded(registry):
    config = ServeConfig(
        registry_url=registry, device="cpu", poll_seconds=0, flush_seconds=0.05, request_timeout_s=0.3
    )
    app = create_app(config)
    with ServerThread(app) as srv:
        with app.state.ratchet.current.engine.runtime.lock:  # the engine is busy past the timeout
            plain = httpx.post(srv.url + "/v1/responses", json=OK, timeout=30)
            with httpx.stream(
                "POST", srv.url + "/v1/responses", json={**OK, "stream": True}, timeout=30
            ) as s:
                events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert plain.status_code == 504 and plain.json()["error"]["code"] == "timeout"
        assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.failed"]
        failed = events[-1]["response"]
        assert failed["status"] == "failed" and "timeout" in failed["error"]["message"]
        row = rows_by_id(registry, failed["id"])[failed["id"]]
        assert row.meta["finish_reason"] == "timeout"
        got = httpx.get(srv.url + f"/v1/responses/{failed['id']}", timeout=30).json()
        assert got["status"] == "failed" and got["id"] == failed["id"]


def test_every_object_and_event_validates_against_the_sdk_types(served):
    """Not only parsed leniently: each Response and each stream event is valid under the SDK's own models."""
    from openai.types.responses import Response, ResponseStreamEvent

    auth = {"Authorization": f"Bearer {served['keys']['alice']}"}
    events = pydantic.TypeAdapter(ResponseStreamEvent)
    tool = {**OK, "input": "timer 3+4", "tools": [TIMER_TOOL], "max_output_tokens": 30, "instructions": "x"}
    for body in (OK, tool, {**OK, "include": ["message.output_text.logprobs"], "top_logprobs": 1}):
        made = httpx.post(served["base"] + "/v1/responses", json=body, headers=auth, timeout=60).json()
        Response.model_validate(made)
        got = httpx.get(served["base"] + f"/v1/responses/{made['id']}", headers=auth, timeout=60).json()
        for item in made["output"]:  # logprobs are answered, not stored: GET has none
            for part in item.get("content", []):
                part["logprobs"] = None
        assert Response.model_validate(got).output == Response.model_validate(made).output
        with httpx.stream(
            "POST", served["base"] + "/v1/responses", json={**body, "stream": True}, headers=auth, timeout=60
        ) as s:
            lines = list(s.iter_lines())
        names = [line[7:] for line in lines if line.startswith("event: ")]
        data = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
        assert names == [d["type"] for d in data] and len(data) > 4
        for d in data:
            events.validate_python(d)
