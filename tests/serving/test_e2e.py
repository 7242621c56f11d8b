"""End to end over HTTP with the official ``openai`` client: plain, streaming, a tool call continued on
the agent adapter, experience with routes in the registry, feedback, a live promotion, a graceful
shutdown that flushes, and the same router in front of an external OpenAI-compatible engine."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pipeline.serving.served import ServeConfig
from pipeline.serving.server import create_app
from serving.support import HARNESS, ServerThread, experience_rows, register_generation

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "set_timer",
            "description": "Start a timer.",
            "parameters": {"type": "object", "properties": {"minutes": {"type": "integer"}}},
        },
    }
]


def config(url, **over):
    return ServeConfig(
        **{"registry_url": url, "device": "cpu", "poll_seconds": 0, "flush_seconds": 0.05, **over}
    )


def test_openai_client_plain_stream_tools_experience_feedback(registry):
    with ServerThread(create_app(config(registry))) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == ["ratchet"]

        plain = client.chat.completions.create(
            model="ratchet", messages=[{"role": "user", "content": "12+35=?"}], max_tokens=6, temperature=0
        )
        assert plain.choices[0].message.content is not None and plain.usage.completion_tokens <= 6
        assert plain.metadata["specialist"] == "chat"
        raw = client.chat.completions.with_raw_response.create(
            model="ratchet", messages=[{"role": "user", "content": "counter 1+2"}], max_tokens=4
        )
        assert raw.headers["x-ratchet-specialist"] == "genui"

        chunks = list(
            client.chat.completions.create(
                model="ratchet",
                messages=[{"role": "user", "content": "f adds 1 2"}],
                max_tokens=6,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].usage.completion_tokens >= len(text) > 0  # char-level tokenizer
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")

        convo = [{"role": "user", "content": "timer 3+4"}]
        call = client.chat.completions.create(model="ratchet", messages=convo, tools=TOOLS, max_tokens=30)
        choice = call.choices[0]
        assert choice.finish_reason == "tool_calls" and call.metadata["specialist"] == "agent"
        tc = choice.message.tool_calls[0]
        assert tc.function.name == "set_timer" and json.loads(tc.function.arguments) == {"minutes": 7}
        streamed = list(
            client.chat.completions.create(
                model="ratchet", messages=convo, tools=TOOLS, max_tokens=30, stream=True
            )
        )
        deltas = [c.choices[0].delta for c in streamed if c.choices and c.choices[0].delta.tool_calls]
        assert deltas[0].tool_calls[0].function.name == "set_timer"

        convo += [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": tc.id, "content": "timer started"},
        ]
        follow = client.chat.completions.create(model="ratchet", messages=convo, tools=TOOLS, max_tokens=5)
        assert follow.metadata["specialist"] == "agent"
        assert follow.metadata["route_reason"] == "tool result continues on agent"

        r = httpx.post(srv.url + "/v1/feedback", json={"completion_id": plain.id, "rating": 0.5})
        assert r.status_code == 200
    rows = {e.completion_id: e for e in experience_rows(registry)}
    assert len(rows) == 6 and all(e.source == "deployment" for e in rows.values())
    first = rows[plain.id]
    # no key: the rating is kept and shown, never counted (tests/serving/test_access.py has the scoped keys)
    assert (
        first.feedback == {"claimed": {"rating": 0.5, "rating_by": "anonymous"}}
        and first.specialist == "chat"
    )
    assert first.principal == "anonymous"
    assert first.generation_id is not None and first.harness_version_id is not None
    assert first.routes[0]["turn"] == 1 and first.routes[0]["specialist"] == "chat"
    assert first.messages[-1]["role"] == "assistant"
    for key in (
        "latency_ms",
        "prompt_tokens",
        "completion_tokens",
        "route_reason",
        "route_scores",
        "summaries",
    ):
        assert key in first.meta
    last = rows[follow.id]
    assert [r["specialist"] for r in last.routes] == ["agent", "agent"]
    assert [r["turn"] for r in last.routes] == [1, 3] and last.messages[1]["tool_calls"][0]["id"] == tc.id
    assert last.meta["summaries"]["1"].startswith("called set_timer")


def test_promotion_is_picked_up_live_and_shutdown_flushes(registry, tiny_artifacts):
    harness = {**HARNESS, "routing": {**HARNESS["routing"], "entry": "genui", "default": "genui"}}
    cfg = config(registry, poll_seconds=0.2, flush_seconds=60, api_key="operator-key", allow_anonymous=True)
    with ServerThread(create_app(cfg)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
        msg = [{"role": "user", "content": "hello"}]
        before = client.chat.completions.create(model="ratchet", messages=msg, max_tokens=3)
        assert before.metadata == {**before.metadata, "generation": "0", "specialist": "chat"}
        from pipeline.registry import get_engine, get_generation, session_scope, set_generation_status

        number = register_generation(
            registry, tiny_artifacts, harness=harness, promote=False, harness_version="2"
        )
        import time
        from concurrent.futures import ThreadPoolExecutor

        def ask(_i):
            return client.chat.completions.create(model="ratchet", messages=msg, max_tokens=20).metadata

        with ThreadPoolExecutor(8) as pool:  # requests in flight while the champion changes
            inflight = [pool.submit(ask, i) for i in range(24)]
            with session_scope(get_engine(registry)) as s:
                gen = get_generation(session=s, number=number)
                set_generation_status(session=s, generation=gen, status="promoted")
            seen = {f.result()["generation"] for f in inflight}  # every one answered, none dropped
        assert seen <= {"0", "1"}
        deadline = time.monotonic() + 30
        while (
            client.chat.completions.create(model="ratchet", messages=msg, max_tokens=3).metadata["generation"]
            != "1"
        ):
            assert time.monotonic() < deadline, "promotion not picked up"
            time.sleep(0.1)
        after = client.chat.completions.create(model="ratchet", messages=msg, max_tokens=3)
        assert after.metadata["specialist"] == "genui"  # the new harness's routing
        # a burst right before shutdown: everything served is recorded
        ids = [
            client.chat.completions.create(model="ratchet", messages=msg, max_tokens=2).id for _ in range(5)
        ]
        admin = {"Authorization": "Bearer operator-key"}
        assert httpx.post(srv.url + "/admin/reload", headers=admin).json()["generation"] == 1
    rows = {e.completion_id: e for e in experience_rows(registry)}
    assert set(ids) <= set(rows) and rows[after.id].harness_version_id != rows[before.id].harness_version_id


def test_external_engine_path_matches_embedded(registry, tiny_artifacts):
    from pipeline.registry import get_engine
    from pipeline.serving.adapter_app import create_adapter_app
    from pipeline.serving.engines import EmbeddedEngine
    from pipeline.serving.scheduler import MicroBatchScheduler
    from pipeline.serving.served import load_served, plan_generation

    plan = plan_generation(get_engine(registry), "main", "champion")
    served = load_served(plan, config(registry), MicroBatchScheduler())
    assert isinstance(served.engine, EmbeddedEngine)
    requests = [[{"role": "user", "content": t}] for t in ("12+35=?", "f adds 3 4", "counter 5+6")]
    with ServerThread(create_adapter_app(served.engine)) as engine_srv:
        raw = openai.OpenAI(base_url=engine_srv.url + "/v1", api_key="unused")
        assert {m.id for m in raw.models.list().data} == {"chat", "agent", "coding", "genui"}
        with (
            ServerThread(create_app(config(registry))) as embedded,
            ServerThread(
                create_app(config(registry, engine="external", engine_url=engine_srv.url))
            ) as external,
        ):
            answers = {}
            for name, srv in (("embedded", embedded), ("external", external)):
                client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
                answers[name] = [
                    client.chat.completions.create(model="ratchet", messages=m, max_tokens=6)
                    for m in requests
                ]
                call = client.chat.completions.create(
                    model="ratchet",
                    messages=[{"role": "user", "content": "timer 3+4"}],
                    tools=TOOLS,
                    max_tokens=30,
                )
                assert call.choices[0].message.tool_calls[0].function.name == "set_timer"
                streamed = client.chat.completions.create(
                    model="ratchet", messages=requests[0], max_tokens=6, stream=True
                )
                text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
                assert text == answers[name][0].choices[0].message.content
            for a, b in zip(answers["embedded"], answers["external"], strict=True):
                assert a.choices[0].message.content == b.choices[0].message.content
                assert a.metadata["specialist"] == b.metadata["specialist"]
                assert a.usage.completion_tokens == b.usage.completion_tokens
    engines = [e.meta["engine"] for e in experience_rows(registry)]
    assert engines.count("external") == 5 and engines.count("embedded") == 5


@pytest.mark.parametrize("bad", ["chat", "coding"])
def test_unknown_model_via_openai_client_is_404(registry, bad):
    with ServerThread(create_app(config(registry))) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model=bad, messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="ratchet", messages=[])


def test_a_client_leaving_mid_stream_still_leaves_its_turn_in_experience(registry):
    import time

    with ServerThread(create_app(config(registry))) as srv:
        body = {
            "model": "ratchet",
            "stream": True,
            "max_tokens": 60,
            "messages": [{"role": "user", "content": "hello"}],
        }
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body) as r:
            first = next(r.iter_lines())
        cid = json.loads(first.removeprefix("data: "))["id"]
        deadline = time.monotonic() + 20
        while cid not in {e.completion_id for e in experience_rows(registry)}:
            assert time.monotonic() < deadline, "abandoned stream not recorded"
            time.sleep(0.1)
