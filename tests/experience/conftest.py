"""The traffic a team logged: the ``openai`` client against a real ``ratchet serve`` process on the tiny
model, traced by ``mlflow.openai.autolog()`` (built once per session; the MLflow and OpenAI importers read it)."""

from __future__ import annotations

import os
import signal

import openai
import pytest
from serving.support import build_artifacts, champion_registry, serve_process, wait_healthy

from experience.support import TOOLS


@pytest.fixture(scope="session")
def served(tmp_path_factory):
    """Traffic a team logged: the openai client against a real `ratchet serve` process, traced by
    ``mlflow.openai.autolog()``, with a feedback, a correction and an expectation on the tool episode."""
    import mlflow

    root = tmp_path_factory.mktemp("served")
    url = champion_registry(root, build_artifacts(root))
    proc, port = serve_process(url, root / "home", api_key="k")
    tracking = f"sqlite:///{root / 'mlflow.db'}"
    experiment = mlflow.MlflowClient(tracking).create_experiment("agent-traffic")
    # MLflow's settings for this traffic only, as environment (set_tracking_uri / set_experiment would stay
    # set for every later test of the session): traces stored when the call returns, no cost-map download
    settings = {
        "MLFLOW_TRACKING_URI": tracking,
        "MLFLOW_EXPERIMENT_ID": experiment,
        "MLFLOW_ENABLE_ASYNC_TRACE_LOGGING": "false",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }
    before = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    mlflow.tracing.reset()  # the tracer exports where the environment now says
    try:
        wait_healthy(proc, port)
        mlflow.openai.autolog()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k")
        plain = client.chat.completions.create(
            model="ratchet",
            messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "12+35=?"}],
            max_tokens=6,
        )
        plain_trace = mlflow.get_last_active_trace_id()
        convo = [{"role": "user", "content": "timer 3+4"}]
        with mlflow.start_span("agent"):
            mlflow.update_current_trace(session_id="conv-1")
            call = client.chat.completions.create(model="ratchet", messages=convo, tools=TOOLS, max_tokens=30)
            tc = call.choices[0].message.tool_calls[0]
            convo += [
                call.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": tc.id, "content": "timer started"},
            ]
            follow = client.chat.completions.create(
                model="ratchet", messages=convo, tools=TOOLS, max_tokens=5
            )
        episode = mlflow.get_last_active_trace_id()
        # the Responses API (the openai-agents SDK's default): plain, and a tool result sent back
        answered = client.responses.create(
            model="ratchet", input="12+35=?", instructions="be brief", max_output_tokens=6
        )
        answered_trace = mlflow.get_last_active_trace_id()
        items = [
            {"role": "user", "content": "timer 3+4"},
            {
                "type": "function_call",
                "call_id": "call_r1",
                "name": "set_timer",
                "arguments": '{"minutes":7}',
            },
            {"type": "function_call_output", "call_id": "call_r1", "output": "started"},
        ]
        flat = [{"type": "function", **TOOLS[0]["function"]}]
        continued = client.responses.create(model="ratchet", input=items, tools=flat, max_output_tokens=5)
        continued_trace = mlflow.get_last_active_trace_id()
        mlflow.log_feedback(trace_id=episode, name="user_rating", value=True)
        mlflow.log_feedback(trace_id=episode, name="correction", value="Your timer runs for 7 minutes.")
        mlflow.log_expectation(trace_id=episode, name="expected_response", value="timer set for 7 minutes")
    finally:
        mlflow.openai.autolog(disable=True)
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        mlflow.tracing.reset()
        proc.send_signal(signal.SIGTERM)
        log = proc.communicate(timeout=60)[0]
    assert proc.returncode in (0, -signal.SIGTERM), log
    return {
        "tracking": tracking,
        "plain": plain,
        "call": call,
        "follow": follow,
        "convo": convo,
        "traces": (plain_trace, episode),
        "responses": {answered_trace: answered, continued_trace: continued},
    }
