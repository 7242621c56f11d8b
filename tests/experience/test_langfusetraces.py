"""``ratchet ingest --from langfuse``: a Langfuse trace export in its documented shape (the public API's
traces with observations and scores), scores under the principal's scopes, per-record quarantine."""

from __future__ import annotations

import json

from conftest import run_cli

from experience.support import TOOLS, quarantined, stored_rows

CALL = {"id": "c1", "type": "function", "function": {"name": "set_timer", "arguments": '{"minutes":7}'}}
LANGFUSE = [
    {
        "id": "lf-trace-1",
        "timestamp": "2026-12-01T10:00:00.000Z",
        "name": "agent",
        "sessionId": "lf-session",
        "userId": "u1",
        "input": None,
        "output": None,
        "metadata": {},
        "tags": [],
        "observations": [
            {
                "id": "obs-2",
                "traceId": "lf-trace-1",
                "type": "GENERATION",
                "name": "OpenAI-generation",
                "startTime": "2026-12-01T10:00:02.000Z",
                "model": "ratchet",
                "input": {
                    "messages": [
                        {"role": "user", "content": "timer 3+4"},
                        {"role": "assistant", "content": None, "tool_calls": [CALL]},
                        {"role": "tool", "tool_call_id": "c1", "content": "started"},
                    ],
                    "tools": TOOLS,
                },
                "output": {"role": "assistant", "content": "Timer set."},
            },
            {
                "id": "obs-1",
                "traceId": "lf-trace-1",
                "type": "GENERATION",
                "name": "OpenAI-generation",
                "startTime": "2026-12-01T10:00:01.000Z",
                "model": "ratchet",
                "input": {"messages": [{"role": "user", "content": "timer 3+4"}], "tools": TOOLS},
                "output": {"role": "assistant", "content": None, "tool_calls": [CALL]},
            },
            {
                "id": "span-1",
                "traceId": "lf-trace-1",
                "type": "SPAN",
                "name": "tool",
                "startTime": "2026-12-01T10:00:01.5Z",
            },
        ],
        "scores": [
            {
                "id": "s1",
                "traceId": "lf-trace-1",
                "observationId": "obs-1",
                "name": "helpful",
                "value": 0.0,
                "dataType": "NUMERIC",
                "source": "ANNOTATION",
                "timestamp": "2026-12-01T10:01:00.000Z",
            },
            {
                "id": "s2",
                "traceId": "lf-trace-1",
                "name": "user-feedback",
                "value": 1.0,
                "stringValue": "True",
                "dataType": "BOOLEAN",
                "source": "API",
                "timestamp": "2026-12-01T10:02:00.000Z",
            },
            {
                "id": "s3",
                "traceId": "lf-trace-1",
                "name": "correction",
                "value": 0,
                "stringValue": "Timer set for 7 minutes.",
                "dataType": "CORRECTION",
                "source": "ANNOTATION",
                "timestamp": "2026-12-01T10:03:00.000Z",
            },
            {
                "id": "s4",
                "traceId": "lf-trace-1",
                "name": "tone",
                "value": 0,
                "stringValue": "polite",
                "dataType": "CATEGORICAL",
                "source": "EVAL",
                "timestamp": "2026-12-01T10:04:00.000Z",
            },
        ],
    },  # fmt: skip
    {"id": "lf-trace-2", "observations": [{"id": "e", "type": "EVENT"}], "scores": []},
    {"id": "lf-trace-3", "observations": [{"id": "g", "type": "GENERATION", "input": 42, "output": "x"}]},
]


def test_langfuse_export_with_scores(tmp_path, capsys):
    path = tmp_path / "langfuse.json"
    path.write_text(json.dumps(LANGFUSE, indent=2))
    assert run_cli(["ingest", "--from", "langfuse", str(path), "--principal", "partner"]) == 0
    assert "4 turns: 2 stored, 0 duplicate, 2 quarantined" in capsys.readouterr().out
    first, second = stored_rows()
    assert first.meta["origin"]["span"] == "obs-1" and second.meta["origin"]["span"] == "obs-2"
    assert first.conversation_id == second.conversation_id == "lf-session" and first.tools == TOOLS
    assert first.messages[-1]["tool_calls"][0]["function"]["name"] == "set_timer"
    # partner has no key: every score is kept as claimed, none counts
    assert first.feedback == {"claimed": {"rating": 0.0, "rating_by": "partner"}}
    assert second.feedback == {
        "claimed": {
            "rating": 1.0,
            "rating_by": "partner",
            "correction": "Timer set for 7 minutes.",
            "correction_by": "partner",
        }
    }
    assert second.meta["assessments"] == {"tone": "polite"}
    reasons = sorted(q.reason for q in quarantined())
    assert reasons[0] == "no GENERATION observation in trace lf-trace-2"
    assert reasons[1].startswith("wrong shape: input: expected OpenAI chat messages")
    jsonl = tmp_path / "langfuse.jsonl"
    jsonl.write_text("\n".join(json.dumps(t) for t in LANGFUSE) + "\n")
    assert run_cli(["ingest", "--from", "langfuse", str(jsonl), "--principal", "partner"]) == 0
    assert "0 stored, 2 duplicate, 2 quarantined" in capsys.readouterr().out  # the same traces: nothing more
    big = tmp_path / "big.json"  # one record over the limit: quarantined, the rest read
    huge = {"id": "g", "type": "GENERATION", "input": "hi", "output": "x" * (2 << 20)}
    big.write_text(json.dumps([{"id": "big", "observations": [huge]}, LANGFUSE[0]]))
    assert run_cli(["ingest", "--from", "langfuse", str(big)]) == 0
    assert "1 quarantined (oversized record: 1)" in capsys.readouterr().out
    assert run_cli(["ingest", "--from", "langfuse", str(tmp_path / "missing.json")]) == 1
    bad = tmp_path / "bad.json"
    bad.write_text('{"traces": []}')
    assert run_cli(["ingest", "--from", "langfuse", str(bad)]) == 1
    assert "not a Langfuse trace export" in capsys.readouterr().err
