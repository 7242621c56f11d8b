"""Regular expressions from traces and contracts run on RE2 (``pipeline.scoring.patterns``), and a re-scoring
that takes too long is stored as not verified (issue 22): each failed on main, where Python's backtracking
``re`` ran them and ``ratchet score`` hung on one trace."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.scoring.context import fenced_blocks
from pipeline.scoring.scorers import TurnContext, run_scorer
from pipeline.specs.contract import load_contract
from pipeline.specs.scorers import JsonSchemaScorer, RegexScorer

EVIL = "^(a+)+$"
DEMO = Path(__file__).resolve().parents[1] / "contracts" / "demo.yaml"


def ctx(text: str, **metadata) -> TurnContext:
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]
    return TurnContext(
        messages=messages, index=1, specialist="chat", metadata=metadata, principal="ratchet", is_final=True
    )


def test_a_catastrophic_regex_scorer_finishes_at_once():
    cfg = RegexScorer(kind="regex", pattern=EVIL, full_match=True)
    t0 = time.perf_counter()
    out = run_scorer(cfg, ctx("a" * 26 + "!"))  # Python's re: seconds (doubling with each a)
    assert time.perf_counter() - t0 < 0.5 and out.value == 0.0
    assert run_scorer(cfg, ctx("a" * 10_000)).value == 1.0
    flagged = RegexScorer(kind="regex", pattern="^answer: \\d+$", flags=["IGNORECASE", "MULTILINE"])
    assert run_scorer(flagged, ctx("why\nANSWER: 42\n")).value == 1.0


def test_a_catastrophic_schema_pattern_finishes_at_once():
    cfg = JsonSchemaScorer(kind="json_schema")
    schemas = [
        {"type": "string", "pattern": EVIL},
        {"type": "object", "patternProperties": {EVIL: {"type": "integer"}}},
        {"type": "object", "patternProperties": {EVIL: {}}, "additionalProperties": False},
    ]
    t0 = time.perf_counter()
    outs = [
        run_scorer(cfg, ctx(json.dumps("a" * 26 + "!"), schema=schemas[0])),
        run_scorer(cfg, ctx(json.dumps({"a" * 26 + "!": "x"}), schema=schemas[1])),
        run_scorer(cfg, ctx(json.dumps({"a" * 26 + "!": 1}), schema=schemas[2])),
    ]
    assert time.perf_counter() - t0 < 0.5
    assert [o.value for o in outs] == [0.0, 1.0, 0.0] and all(o.verified for o in outs)
    assert "Additional properties" in outs[2].error
    good = run_scorer(
        cfg, ctx(json.dumps({"aaa": 1, "b": 2}), schema={**schemas[1], "properties": {"b": {}}})
    )
    assert good.value == 1.0 and good.verified


def test_many_unclosed_fences_are_read_at_once():
    """The fence regex of main read on to the end of the text from every ```: 20,000 unclosed fences in an
    answer took it ~20 s of the GIL (the JSON and code scorers look for fences)."""
    text = "```x" * 20_000
    t0 = time.perf_counter()
    out = run_scorer(JsonSchemaScorer(kind="json_schema"), ctx(text, schema={"type": "object"}))
    assert time.perf_counter() - t0 < 0.5 and out.value == 0.0
    assert fenced_blocks("a ```json\n{}\n``` b ```py\nx\n``` ```\nc\n``` ```\nopen", ("json",)) == [
        "{}\n",
        "c\n",
    ]


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "pattern": "^(?=a)a$"},  # look-ahead: RE2 has none
        {"type": "object", "patternProperties": {"(x)\\1": {}}},  # a back-reference
        {"$schema": "http://json-schema.org/draft-04/schema#", "patternProperties": {"(?!x)": {}}},
        {"type": "object", "patternProperties": {"^a": {}}, "unevaluatedProperties": False},
    ],
    ids=["lookahead", "backreference", "draft4-key", "unevaluated"],
)
def test_a_pattern_re2_cannot_run_verifies_nothing(schema):
    """Never run on Python's re instead: not verified, with the reason."""
    out = run_scorer(JsonSchemaScorer(kind="json_schema"), ctx(json.dumps({"a": 1}), schema=schema))
    assert out.value is None and not out.verified
    assert "RE2" in out.error or "unevaluatedProperties" in out.error, out.error


def test_the_regex_scorer_refuses_what_re2_cannot_run():
    with pytest.raises(ValueError, match="RE2"):
        RegexScorer(kind="regex", pattern="(a)\\1")
    with pytest.raises(ValueError, match="RE2"):
        JsonSchemaScorer(kind="json_schema", schema={"type": "string", "pattern": "(?<=a)b"})


def _registry_with(url: str, trace: dict, tmp_path: Path, scorers: list[dict]) -> tuple[int, int]:
    """Ingest ``trace`` as the operator's and register the demo contract with chat scored by ``scorers``;
    returns (experience id, contract version id)."""
    from sqlalchemy import select

    from pipeline.experience.ingest import ingest_file
    from pipeline.registry import Experience, get_engine, register_contract, session_scope

    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(trace) + "\n")
    engine = get_engine(url)
    assert ingest_file(path, session_factory=lambda: session_scope(engine)).stored == 1
    spec = load_contract(DEMO).model_dump(mode="json")
    spec["version"] = "hostile"
    spec["specialists"]["chat"]["scorers"] = scorers
    with session_scope(engine) as s:
        cv = register_contract(session=s, name=spec["name"], version="hostile", spec=spec).id
        return s.scalar(select(Experience.id)), cv


def _final(url: str, exp_id: int, cv: int, scorer: str = "final"):
    from sqlalchemy import select

    from pipeline.registry import Score, get_engine, session_scope

    with session_scope(get_engine(url)) as s:
        row = s.scalar(
            select(Score).where(
                Score.experience_id == exp_id, Score.scorer == scorer, Score.contract_version_id == cv
            )
        )
        return row.verified, row.value, dict(row.details)


def test_ratchet_score_on_the_catastrophic_trace_finishes(tmp_path):
    """On main `ratchet score` hung on this trace (2^30 steps of re for the answer, as many for the
    correction); now it finishes, the answer and the correction checked by RE2 and failed."""
    from pipeline.registry import upgrade_db

    url = f"sqlite:///{tmp_path / 'registry.db'}"
    upgrade_db(url)
    answer = json.dumps("a" * 30 + "!")
    trace = {
        "messages": [{"role": "user", "content": "a's"}, {"role": "assistant", "content": answer}],
        "metadata": {"specialist": "chat", "schema": {"type": "string", "pattern": EVIL}},
        "feedback": {"correction": answer},
    }
    exp_id, cv = _registry_with(url, trace, tmp_path, [{"kind": "json_schema"}])
    env = {**os.environ, "RATCHET_DATABASE_URL": url, "RATCHET_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, "-c", "from pipeline.cli import main; main()", "score", "--contract", "demo"]
    cmd += ["--version", "hostile"]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("ratchet score did not finish in 60 s")
    assert done.returncode == 0 and "1 traces" in done.stdout, done.stdout + done.stderr
    verified, value, details = _final(url, exp_id, cv)
    assert value == 0.0 and details["failed"] == ["json_schema"]  # checked, and not a pass
    assert details["correction"]["failed"] == ["json_schema"]


def test_a_rescoring_past_its_deadline_is_stored_not_verified(tmp_path):
    """A scorer that does not come back (a judge whose endpoint never answers) leaves the turn not verified,
    with the reason, once ``timeout_s`` passed: the caller (the server's feedback) never hangs on it."""
    from pipeline.registry import get_engine, session_scope, upgrade_db
    from pipeline.scoring import rescore_experience

    url = f"sqlite:///{tmp_path / 'registry.db'}"
    upgrade_db(url)
    silent = socket.socket()  # accepts connections (the backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    judge = {
        "kind": "judge",
        "base_url": f"http://127.0.0.1:{silent.getsockname()[1]}/v1",
        "model": "j",
        "model_version": "1",
        "rubric": "right?",
        "timeout_s": 30,
    }
    trace = {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        "metadata": {"specialist": "chat"},
    }
    exp_id, cv = _registry_with(url, trace, tmp_path, [judge])
    t0 = time.perf_counter()
    with session_scope(get_engine(url)) as s:
        done = rescore_experience(
            session=s, experience_ids=[exp_id], reason="t", also_under=cv, timeout_s=0.5
        )
    assert time.perf_counter() - t0 < 5 and len(done) == 1
    verified, value, _ = _final(url, exp_id, cv)
    assert not verified and value is None
    errors = _final(url, exp_id, cv, "total")[2]["errors"]
    assert errors == {"1": {"timeout": "scoring did not finish within 0.5 s: not verified"}}, errors
    silent.close()
