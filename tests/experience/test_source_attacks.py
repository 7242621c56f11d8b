"""Hostile files and stores for ``ratchet ingest`` and its importers (issue 25): a record of the wrong type where
a list is expected, a lone surrogate beside a 19-digit number, a span tree with a cycle, a principal name with a
trailing newline. Each is a quarantined record or a one-line refusal, never a traceback or a hang."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import run_cli

from experience.support import quarantined, stored_rows
from pipeline.experience.sources.mlflowtraces import trace_turns

GENERATION = {
    "id": "obs-1",
    "type": "GENERATION",
    "input": [{"role": "user", "content": "12+35=?"}],
    "output": {"role": "assistant", "content": "47"},
}


@pytest.mark.parametrize("scores", [5, True, 1.5])
def test_langfuse_scores_of_the_wrong_type_are_quarantined_not_a_crash(tmp_path, capsys, scores):
    path = tmp_path / "export.json"
    good = {"id": "t-ok", "observations": [GENERATION], "scores": []}
    bad = {"id": "t-bad", "observations": [{**GENERATION, "id": "obs-2"}], "scores": scores}
    path.write_text(json.dumps([good, bad]))
    assert run_cli(["ingest", "--from", "langfuse", str(path)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "2 turns: 1 stored" in out and "1 quarantined" in out, out
    assert any("scores" in q.reason for q in quarantined())


@pytest.mark.parametrize("events", [7, True])
def test_otlp_events_of_the_wrong_type_are_quarantined_not_a_crash(tmp_path, capsys, events):
    def span(span_id: str, **extra) -> dict:
        attrs = [
            {"key": "gen_ai.input.messages", "value": {"stringValue": json.dumps(
                [{"role": "user", "parts": [{"type": "text", "content": "hi"}]}])}},
            {"key": "gen_ai.output.messages", "value": {"stringValue": json.dumps(
                [{"role": "assistant", "parts": [{"type": "text", "content": "hello"}]}])}},
        ]  # fmt: skip
        return {"traceId": "ab" * 16, "spanId": span_id, "name": "chat", "attributes": attrs, **extra}

    request = {
        "resourceSpans": [{"scopeSpans": [{"spans": [span("cd" * 8), span("ef" * 8, events=events)]}]}]
    }
    path = tmp_path / "spans.jsonl"
    path.write_text(json.dumps(request) + "\n")
    assert run_cli(["ingest", "--from", "otel", str(path)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "2 turns: 1 stored" in out and "1 quarantined" in out, out


def test_a_lone_surrogate_beside_a_long_number_is_quarantined(tmp_path, capsys):
    """The standard parser (which reads a line with a 19-digit integer again) takes ``"\\ud800"``; orjson
    refuses it first, so the line is quarantined (held: checked, nothing to fix)."""
    path = tmp_path / "traces.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]},
        '{"messages": [{"role": "user", "content": "\\ud800"}, {"role": "assistant", "content": "x"}], '
        '"metadata": {"n": 1234567890123456789012}}',
    ]
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    assert run_cli(["ingest", str(path)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "2 lines: 1 stored, 0 duplicate, 1 quarantined" in out, out
    assert len(stored_rows()) == 1


def test_an_mlflow_span_tree_with_a_cycle_is_read_not_a_hang():
    """Span parents come from whoever logged the trace: a cycle above a chat span must end the walk."""

    def span(span_id: str, parent: str | None, kind: str) -> SimpleNamespace:
        return SimpleNamespace(
            span_id=span_id,
            parent_id=parent,
            span_type=kind,
            inputs={"messages": [{"role": "user", "content": "hi"}]},
            outputs={"role": "assistant", "content": "hello"},
            get_attribute=lambda _key: None,
        )

    trace = SimpleNamespace(
        info=SimpleNamespace(trace_id="tr-1", assessments=[], trace_metadata={}),
        data=SimpleNamespace(
            spans=[span("c", "a", "CHAT_MODEL"), span("a", "b", "AGENT"), span("b", "a", "AGENT")]
        ),
    )
    out: list = []
    worker = threading.Thread(target=lambda: out.extend(trace_turns(trace, 1, "0")), daemon=True)
    worker.start()
    worker.join(5)
    assert not worker.is_alive(), "trace_turns never ended on a cyclic span tree"
    assert len(out) == 1 and out[0].problem is None


@pytest.mark.parametrize("source", ["jsonl", "otel"])
def test_a_principal_with_a_trailing_newline_is_refused(tmp_path, capsys, source):
    path = tmp_path / "traces.jsonl"
    if source == "jsonl":
        line = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}
    else:
        attrs = [
            {"key": "gen_ai.prompt", "value": {"stringValue": "hi"}},
            {"key": "gen_ai.completion", "value": {"stringValue": "ok"}},
        ]
        line = {"resourceSpans": [{"scopeSpans": [{"spans": [{"spanId": "ab" * 8, "attributes": attrs}]}]}]}
    path.write_text(json.dumps(line) + "\n")
    assert run_cli(["ingest", "--from", source, "--principal", "ratchet\n", str(path)]) == 1
    assert "principal 'ratchet\\n'" in capsys.readouterr().err
    assert stored_rows() == []
    assert run_cli(["ingest", "--from", source, "--principal", "ratchet2", str(path)]) == 0
    assert [r.principal for r in stored_rows()] == ["ratchet2"]


def test_an_otlp_int_of_a_million_digits_is_read_quickly(tmp_path, capsys):
    attrs = [
        {"key": "gen_ai.prompt", "value": {"stringValue": "hi"}},
        {"key": "gen_ai.completion", "value": {"stringValue": "hello"}},
        {"key": "gen_ai.usage.input_tokens", "value": {"intValue": "9" * 1_000_000}},
    ]
    request = {"resourceSpans": [{"scopeSpans": [{"spans": [{"spanId": "ab" * 8, "attributes": attrs}]}]}]}
    path = Path(tmp_path / "spans.jsonl")
    path.write_text(json.dumps(request) + "\n")
    assert run_cli(["ingest", "--from", "otel", str(path)]) == 0, capsys.readouterr().err
    assert "1 turns: 1 stored" in capsys.readouterr().out


@pytest.mark.parametrize(
    "filter_string",
    [
        "trace.timestamp_ms > 0 OR 1=1",
        "trace.timestamp_ms > 0; DROP TABLE experiments",
        "' OR ''='",
        "trace.timestamp_ms > 99999999999999999999999999",
    ],
)
def test_an_mlflow_filter_injection_is_one_line(tmp_path, capsys, filter_string):
    """``--filter`` goes to MLflow's own parser (held: every one is MLflow's refusal, one line, nothing run)."""
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("probe")
    args = ["ingest", "--from", "mlflow", "--experiment", "probe", "--tracking-uri", uri]
    assert run_cli([*args, "--filter", filter_string]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "--filter" in errors[0], errors
    assert run_cli(args) == 0  # the store is intact
