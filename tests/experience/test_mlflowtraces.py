"""``ratchet ingest --from mlflow``: traces ``mlflow.openai.autolog()`` wrote around the ``openai`` client
talking to a real ``ratchet serve`` process (``conftest.served``), imported into another registry (this
test's home): messages, tools, conversations, assessments under the principal's scopes; twice adds nothing."""

from __future__ import annotations

import pytest
from conftest import run_cli

from experience.support import TOOLS, by_origin, quarantined, stored_rows
from pipeline.registry import get_engine, session_scope


def ingest_args(served, experiment: str = "agent-traffic") -> list[str]:
    """``ratchet ingest`` of ``experiment`` in the served tracking server."""
    return ["ingest", "--from", "mlflow", "--experiment", experiment, "--tracking-uri", served["tracking"]]


def test_mlflow_traces_of_a_served_agent_import_into_another_registry(served, capsys):
    args = ingest_args(served)
    assert run_cli(args) == 0
    assert "5 turns: 5 stored, 0 duplicate, 0 quarantined" in capsys.readouterr().out
    rows = stored_rows()
    plain_trace, episode = served["traces"]
    traces = by_origin(rows)
    (plain,) = traces[plain_trace]
    assert [m["role"] for m in plain.messages] == ["system", "user", "assistant"]
    assert plain.messages[-1]["content"] == served["plain"].choices[0].message.content
    assert plain.tools is None and plain.conversation_id is None and plain.feedback is None
    assert plain.principal == "operator" and plain.source == "import"
    first, second = traces[episode]
    call = served["call"].choices[0].message.tool_calls[0]
    assert first.messages[-1]["tool_calls"] == [
        {
            "id": call.id,
            "type": "function",
            "function": {"name": "set_timer", "arguments": call.function.arguments},
        }
    ]
    assert second.messages[:-1] == served["convo"] and second.messages[2]["tool_call_id"] == call.id
    assert second.messages[-1]["content"] == served["follow"].choices[0].message.content
    assert first.tools == second.tools == TOOLS
    assert first.conversation_id == second.conversation_id == "conv-1"
    # trace-level assessments belong to the episode's last turn; the operator may make all of them count
    assert first.feedback is None and "expected" not in first.meta
    assert second.feedback == {
        "rating": 1.0,
        "rating_by": "operator",
        "correction": "Your timer runs for 7 minutes.",
        "correction_by": "operator",
    }
    assert second.meta["expected"] == "timer set for 7 minutes"
    assert run_cli(args) == 0  # twice: nothing more
    assert "5 turns: 0 stored, 5 duplicate, 0 quarantined" in capsys.readouterr().out
    assert len(stored_rows()) == 5


def test_mlflow_responses_api_spans_become_chat_turns(served):
    args = ingest_args(served)
    assert run_cli(args) == 0
    traces = by_origin(stored_rows())
    (answered_trace, answered), (continued_trace, continued) = served["responses"].items()
    (plain,) = traces[answered_trace]
    assert plain.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "12+35=?"},
        {"role": "assistant", "content": answered.output_text},
    ]
    (tool,) = traces[continued_trace]
    call = {
        "id": "call_r1",
        "type": "function",
        "function": {"name": "set_timer", "arguments": '{"minutes":7}'},
    }
    assert tool.messages[:3] == [
        {"role": "user", "content": "timer 3+4"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_r1", "content": "started"},
    ]
    assert (
        tool.messages[3]["role"] == "assistant" and tool.messages[3].get("content") == continued.output_text
    )
    assert tool.tools == TOOLS


@pytest.mark.parametrize(
    ("principal", "scopes", "counted"),
    [
        ("partner", None, set()),
        ("rater", "chat,rate", {"rating"}),
        ("checker", "certify,correct", {"correction", "expected"}),
    ],
)
def test_mlflow_assessments_count_only_as_the_principal_may(served, principal, scopes, counted):
    from pipeline.experience.principals import OPERATOR, parse_scopes
    from pipeline.registry import create_api_key

    if scopes:
        with session_scope(get_engine()) as s:
            create_api_key(session=s, name=principal, scopes=parse_scopes(scopes), actor=OPERATOR)
    args = ingest_args(served)
    assert run_cli([*args, "--principal", principal]) == 0
    rows = stored_rows()
    assert {r.principal for r in rows} == {principal}
    last = by_origin(rows)[served["traces"][1]][-1]
    feedback, meta = last.feedback or {}, last.meta
    assert ("rating" in feedback) == ("rating" in counted)
    assert ("correction" in feedback) == ("correction" in counted)
    assert ("expected" in meta) == ("expected" in counted)
    claimed = {**feedback.get("claimed", {}), **meta.get("claimed", {})}
    assert {k for k in ("rating", "correction", "expected") if k in claimed} == {
        "rating",
        "correction",
        "expected",
    } - counted


def test_mlflow_mistakes_are_one_line(served, capsys):
    base = ["ingest", "--from", "mlflow", "--tracking-uri", served["tracking"]]
    assert run_cli([*base, "--experiment", "no-such-experiment"]) == 1
    assert "no MLflow experiment named or numbered 'no-such-experiment'" in capsys.readouterr().err
    assert run_cli([*base, "--experiment", "agent-traffic", "--filter", "trace.nonsense >> 3"]) == 1
    assert "--filter" in capsys.readouterr().err
    assert run_cli(["ingest", "--from", "mlflow"]) == 1
    assert "needs --experiment" in capsys.readouterr().err
    assert run_cli(["ingest", "--from", "zipkin", "x"]) == 1
    assert "--from 'zipkin'" in capsys.readouterr().err


def test_mlflow_filter_and_the_default_tracking_uri(served, monkeypatch):
    from pipeline.settings import get_settings

    monkeypatch.setenv("MLFLOW_TRACKING_URI", served["tracking"])
    get_settings.cache_clear()
    _plain, episode = served["traces"]
    args = ["ingest", "--from", "mlflow", "--experiment", "agent-traffic"]
    assert run_cli([*args, "--filter", f"trace.request_id = '{episode}'"]) == 0
    assert {r.meta["origin"]["trace"] for r in stored_rows()} == {episode}


def test_an_mlflow_trace_without_a_chat_span_is_quarantined_once(served, capsys, monkeypatch):
    import mlflow

    experiment = mlflow.MlflowClient(served["tracking"]).create_experiment("other-traffic")
    for key, value in (("TRACKING_URI", served["tracking"]), ("EXPERIMENT_ID", experiment)):
        monkeypatch.setenv(f"MLFLOW_{key}", value)
    monkeypatch.setenv("MLFLOW_ENABLE_ASYNC_TRACE_LOGGING", "false")
    mlflow.tracing.reset()
    try:
        with mlflow.start_span("retrieve", span_type="RETRIEVER") as span:
            span.set_inputs({"query": "x"})
    finally:
        mlflow.tracing.reset()
    args = ingest_args(served, "other-traffic")
    for _ in range(2):
        assert run_cli(args) == 0
        assert "1 turns: 0 stored, 0 duplicate, 1 quarantined (no chat span: 1)" in capsys.readouterr().out
    (bad,) = quarantined()
    assert bad.source_file == "mlflow:other-traffic" and "no chat span" in bad.reason
