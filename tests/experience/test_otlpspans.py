"""``ratchet ingest --from otel``: an OTLP JSON file written by the OpenTelemetry SDK's file exporter, with
the GenAI semantic conventions (attributes and the older events), plus hostile lines quarantined."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_cli

from experience.support import TOOLS, quarantined, stored_rows


def _otlp_file(path: Path) -> None:
    """Spans as an instrumented app writes them with the OpenTelemetry SDK's OTLP JSON file exporter."""
    from opentelemetry.exporter.otlp.json.file import FileSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as ga

    provider = TracerProvider()
    exporter = FileSpanExporter(path)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("agent")
    call = {"type": "tool_call", "id": "call_1", "name": "set_timer", "arguments": {"minutes": 7}}
    common = {
        ga.GEN_AI_OPERATION_NAME: "chat",
        ga.GEN_AI_REQUEST_MODEL: "ratchet",
        ga.GEN_AI_CONVERSATION_ID: "otel-conv",
        ga.GEN_AI_TOOL_DEFINITIONS: json.dumps(
            [
                {
                    "type": "function",
                    "name": "set_timer",
                    "description": "Start a timer.",
                    "parameters": TOOLS[0]["function"]["parameters"],
                }
            ]  # fmt: skip
        ),
        ga.GEN_AI_SYSTEM_INSTRUCTIONS: json.dumps([{"type": "text", "content": "agent"}]),
    }
    user = {"role": "user", "parts": [{"type": "text", "content": "timer 3+4"}]}
    with tracer.start_as_current_span("invoke_agent"):
        with tracer.start_as_current_span("chat ratchet") as span:
            span.set_attributes(common)
            span.set_attribute(ga.GEN_AI_INPUT_MESSAGES, json.dumps([user]))
            span.set_attribute(
                ga.GEN_AI_OUTPUT_MESSAGES,
                json.dumps([{"role": "assistant", "parts": [call], "finish_reason": "tool_call"}]),
            )
        with tracer.start_as_current_span("execute_tool set_timer"):
            pass
        with tracer.start_as_current_span("chat ratchet") as span:
            span.set_attributes(common)
            given = [
                user,
                {"role": "assistant", "parts": [call]},
                {
                    "role": "tool",
                    "parts": [{"type": "tool_call_response", "id": "call_1", "response": "started"}],
                },
            ]
            span.set_attribute(ga.GEN_AI_INPUT_MESSAGES, json.dumps(given))
            span.set_attribute(
                ga.GEN_AI_OUTPUT_MESSAGES,
                json.dumps(
                    [
                        {
                            "role": "assistant",
                            "parts": [{"type": "text", "content": "7 minutes."}],
                            "finish_reason": "stop",
                        }
                    ]
                ),  # fmt: skip
            )
            span.add_event(
                "gen_ai.evaluation.result",
                {"gen_ai.evaluation.name": "helpful", "gen_ai.evaluation.score.value": 0.75},
            )
    with tracer.start_as_current_span("chat legacy-events") as span:  # the older event conventions
        span.set_attribute(ga.GEN_AI_OPERATION_NAME, "chat")
        span.add_event("gen_ai.system.message", {"content": "chat"})
        span.add_event("gen_ai.user.message", {"content": "12+35=?"})
        span.add_event(
            "gen_ai.choice", {"index": 0, "finish_reason": "stop", "message": json.dumps({"content": "47"})}
        )
    with tracer.start_as_current_span("chat legacy-attributes") as span:
        span.set_attribute(ga.GEN_AI_PROMPT, json.dumps([{"role": "user", "content": "hello"}]))
        span.set_attribute(ga.GEN_AI_COMPLETION, json.dumps([{"role": "assistant", "content": "hi"}]))
    with tracer.start_as_current_span("GET /health"):
        pass  # not a GenAI span: skipped
    with tracer.start_as_current_span("chat broken") as span:
        span.set_attribute(ga.GEN_AI_INPUT_MESSAGES, "[{not json")
    with tracer.start_as_current_span("chat unanswered") as span:  # a call that failed: no answer
        span.set_attribute(ga.GEN_AI_INPUT_MESSAGES, json.dumps([{"role": "user", "parts": []}]))
    with tracer.start_as_current_span("chat nested") as span:  # a nesting bomb
        span.set_attribute(ga.GEN_AI_INPUT_MESSAGES, "[" * 5000 + "]" * 5000)
    provider.shutdown()


def test_otlp_genai_spans_from_the_sdk_file_exporter(tmp_path, capsys):
    path = tmp_path / "spans.jsonl"
    _otlp_file(path)
    with path.open("a") as fh:
        fh.write('{"resourceSpans": "no"}\n\x00\n')
    assert run_cli(["ingest", "--from", "otel", str(path)]) == 0
    out = capsys.readouterr().out
    assert "9 turns: 4 stored, 0 duplicate, 5 quarantined (bad JSON: 1, wrong shape: 4)" in out, out
    rows = stored_rows()
    by_model = {tuple(m["content"] for m in r.messages if m["role"] == "user"): r for r in rows}
    first, second = [r for r in rows if r.conversation_id == "otel-conv"]
    assert first.messages == [
        {"role": "system", "content": "agent"},
        {"role": "user", "content": "timer 3+4"},
        {"role": "assistant", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "set_timer", "arguments": '{"minutes":7}'}}]},
    ]  # fmt: skip
    assert second.messages[3] == {"role": "tool", "tool_call_id": "call_1", "content": "started"}
    assert second.messages[-1] == {"role": "assistant", "content": "7 minutes."}
    assert first.tools == second.tools == TOOLS
    assert first.feedback is None and second.feedback == {"rating": 0.75, "rating_by": "operator"}
    assert [m["content"] for m in by_model[("12+35=?",)].messages] == ["chat", "12+35=?", "47"]
    assert by_model[("hello",)].messages[-1] == {"role": "assistant", "content": "hi"}
    reasons = [q.reason for q in quarantined()]
    assert any("gen_ai.input.messages: bad JSON" in r for r in reasons), reasons
    assert any("gen_ai.input.messages: bad JSON: depth limit exceeded" in r for r in reasons), reasons
    assert any(r.startswith("wrong shape: no answer") for r in reasons), reasons
    assert any("resourceSpans" in r for r in reasons) and any("NUL" in r for r in reasons), reasons
    assert run_cli(["ingest", "--from", "otel", str(path)]) == 0
    assert "0 stored, 4 duplicate, 5 quarantined" in capsys.readouterr().out
    assert len(stored_rows()) == 4 and len(quarantined()) == 5
    bad = tmp_path / "bad.json"
    bad.write_text("<html>not otlp</html>\n")
    assert run_cli(["ingest", "--from", "otel", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not an OTLP JSON file" in err
