"""Hostile and oversized input: JSONL ingest on SQLite and PostgreSQL, and the YAML spec loader."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from sqlalchemy import select

from pipeline.experience.ingest import ingest_file
from pipeline.registry import Experience, Quarantine, session_scope
from pipeline.specs.loading import MAX_ALIAS_NODES, MAX_DEPTH, MAX_SPEC_BYTES, SpecError, parse_yaml
from pipeline.specs.modelspec import load_model_spec

ROOT = Path(__file__).resolve().parent.parent


def _trace(i: int, **metadata) -> dict:
    return {
        "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}],
        "metadata": {"specialist": "chat", **metadata},
    }


def _line(obj) -> bytes:
    return json.dumps(obj).encode()


def _ingest(engine, path):
    return ingest_file(path, session_factory=lambda: session_scope(engine), batch_size=4)


def _rows(engine, model):
    with session_scope(engine) as s:
        rows = s.scalars(select(model).order_by(model.id)).all()
        s.expunge_all()
        return rows


def _write(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


# ---------------------------------------------------------------------------------------------- NUL bytes
def test_nul_bytes(engine, tmp_path):
    """A raw NUL is quarantined (its raw text keeps the NUL as \\u0000, which makes the line the valid JSON it
    meant); an escaped \\u0000 is stored and read back exactly; the rest of the batch is stored."""
    meant = _trace(1, note="x\x00y")
    raw_nul = _line(meant).replace(b"\\u0000", b"\x00")
    assert b"\x00" in raw_nul
    lines = [
        _line(_trace(0)),
        raw_nul,
        _line(meant),
        _line(_trace(2, specialist="ch\x00at")),
        _line(_trace(3)),
    ]
    path = _write(tmp_path / "nul.jsonl", lines)
    result = _ingest(engine, path)
    assert (result.stored, result.quarantined) == (3, 2), result
    stored = {r.messages[0]["content"]: r for r in _rows(engine, Experience)}
    assert stored["q1"].meta == meant["metadata"] and stored["q1"].meta["note"] == "x\x00y"
    q = _rows(engine, Quarantine)
    assert [r.line_number for r in q] == [2, 4]
    assert "raw NUL byte at byte" in q[0].reason and "\x00" not in q[0].raw
    assert orjson.loads(q[0].raw) == meant  # the quarantined text is the line it meant
    assert "metadata.specialist" in q[1].reason and "printable characters" in q[1].reason
    again = _ingest(engine, path)
    assert (again.stored, again.duplicate, again.quarantined) == (0, 3, 2)
    assert len(_rows(engine, Experience)) == 3 and len(_rows(engine, Quarantine)) == 2


# ------------------------------------------------------------------------------------------- huge numbers
def test_huge_integers_keep_their_precision(engine, tmp_path):
    big = 10**30
    traces = [
        _trace(0, score=big),
        {**_trace(1, score=-big, id=2**64), "feedback": {"rating": big}},
        _trace(2, nested={"deep": [[big + 1]]}, small=12345678901234567890),
        _trace(3, text="12345678901234567890123 is only text", huge=7 * 10**300),
    ]
    too_big = b'{"messages": [], "n": 1' + b"0" * 5000 + b"}"  # beyond a double: orjson refuses it
    path = _write(tmp_path / "big.jsonl", [_line(t) for t in traces] + [too_big])
    result = _ingest(engine, path)
    assert (result.stored, result.quarantined) == (4, 1), result
    rows = {r.messages[0]["content"]: r for r in _rows(engine, Experience)}
    for i, trace in enumerate(traces):
        assert rows[f"q{i}"].meta == trace["metadata"], rows[f"q{i}"].meta
    assert rows["q0"].meta["score"] == big and type(rows["q0"].meta["score"]) is int
    assert rows["q1"].feedback == {"rating": big} and rows["q1"].meta["id"] == 2**64
    assert rows["q2"].meta["nested"]["deep"][0][0] == big + 1
    assert _rows(engine, Quarantine)[0].reason.startswith("bad JSON: number is infinity")
    assert (_ingest(engine, path).stored, len(_rows(engine, Experience))) == (0, 4)


# ---------------------------------------------------------------------------------------------- wrong types
WRONG_TYPES = [
    (_trace(0, specialist=5), "metadata.specialist"),
    (_trace(1, specialist=["chat"]), "metadata.specialist"),
    (_trace(2, specialist={"name": "chat"}), "metadata.specialist"),
    (_trace(3, specialist=True), "metadata.specialist"),
    (_trace(4, specialist=""), "metadata.specialist"),
    (_trace(5, specialist="c" * 101), "metadata.specialist"),
    (_trace(6, summaries="not a dict"), "metadata.summaries"),
    (_trace(7, summaries={"1": 5}), "metadata.summaries"),
    (_trace(8, route_scores=[1, 2]), "metadata.route_scores"),
    ({**_trace(9), "routes": {"turn": 1}}, "routes: expected a list"),
    ({**_trace(10), "routes": [{"turn": "1", "specialist": "chat"}]}, "routes[0].turn"),
    ({**_trace(11), "routes": [{"turn": 7, "specialist": "chat"}]}, "routes[0].turn"),
    ({**_trace(12), "routes": [{"turn": True, "specialist": "chat"}]}, "routes[0].turn"),
    ({**_trace(13), "routes": [{"turn": 1, "specialist": 3}]}, "routes[0].specialist"),
    ({**_trace(14), "routes": [{"turn": 1, "specialist": "chat", "reason": {"r": 1}}]}, "routes[0].reason"),
    ({**_trace(15), "routes": [{"turn": 1, "specialist": "chat", "scores": [1]}]}, "routes[0].scores"),
    ({**_trace(16), "routes": [{"turn": 1, "specialist": "chat", "scores": {"a": {"b": "x"}}}]}, "scores"),
    ({**_trace(17), "feedback": {"rating": "5"}}, "feedback.rating"),
]
GOOD_TYPES = [
    _trace(20, specialist=None),
    {
        **_trace(21),
        "routes": [{"turn": 1, "specialist": "agent", "reason": "r", "scores": {"agent": {"s": 1.5}}}],
    },
    _trace(22, summaries={"1": "said hi"}, route_scores={"chat": {"x": 2}}),
]


def test_wrong_types_are_quarantined_not_coerced(engine, tmp_path):
    lines = [_line(t) for t, _ in WRONG_TYPES] + [_line(t) for t in GOOD_TYPES]
    result = _ingest(engine, _write(tmp_path / "types.jsonl", lines))
    assert (result.stored, result.quarantined) == (len(GOOD_TYPES), len(WRONG_TYPES)), result
    for row, (_, field) in zip(_rows(engine, Quarantine), WRONG_TYPES, strict=True):
        assert row.reason.startswith("wrong shape: ") and field in row.reason, (row.reason, field)
    assert sorted(r.specialist or "-" for r in _rows(engine, Experience)) == ["-", "agent", "chat"]


def test_nesting_long_reasons_and_odd_file_names(engine, tmp_path):
    deep, shallow = "x", "x"
    for _ in range(300):
        deep = [deep]
    for _ in range(200):
        shallow = [shallow]
    lines = [
        _line(_trace(0, deep=deep)),
        _line(_trace(1, shallow=shallow, big=10**25)),
        _line({**_trace(2), "k" * 100_000: 1}),
    ]
    name = os.fsdecode(b"odd-\xff-name.jsonl")  # not UTF-8: Linux allows any bytes in a name
    result = _ingest(engine, _write(tmp_path / name, lines))
    assert (result.stored, result.quarantined) == (1, 2), result
    assert _rows(engine, Experience)[0].meta["big"] == 10**25
    q = _rows(engine, Quarantine)
    assert "too deeply nested" in q[0].reason and len(q[1].reason) <= 500 and "unknown field" in q[1].reason
    assert q[0].source_file.endswith("odd-\\xff-name.jsonl")
    assert _ingest(engine, tmp_path / name).quarantined == 2 and len(_rows(engine, Quarantine)) == 2


# -------------------------------------------------------------------------------------------------- YAML
def billion_laughs(path: Path) -> Path:
    """The classic alias bomb (9 levels of 9 aliases: 387 million strings once expanded) as a model spec."""
    lines = ["name: bomb", "base: {tiny: {}}", "lol: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    lines.append("specialists: {chat: {lora: {target_modules: *i}}}")
    path.write_text("\n".join(lines) + "\n")
    return path


MEASURE = """
import sys, time
from pipeline.specs.modelspec import load_model_spec
start = time.perf_counter()  # the load alone: the imports take seconds on a loaded machine
try:
    load_model_spec(sys.argv[1])
except Exception as exc:
    print(type(exc).__name__, exc)
seconds = time.perf_counter() - start
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the forked parent (a big pytest process)
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(seconds, hwm // 1024)
"""


def test_alias_bomb_fails_fast_in_bounded_memory(tmp_path):
    path = billion_laughs(tmp_path / "bomb.yaml")
    assert path.stat().st_size < 500

    def cap():  # the unbounded loader would take many GB: fail it at 2 GB instead of the machine
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=cap,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    error, figures = proc.stdout.strip().splitlines()
    seconds, peak_mib = float(figures.split()[0]), int(figures.split()[1])
    assert error.startswith("SpecError ") and f"more than {MAX_ALIAS_NODES} nodes" in error, error
    assert f"{path}:" in error and "\n" not in error
    assert seconds < 5 and peak_mib < 300, (seconds, peak_mib)


def _error(text: str) -> SpecError:
    with pytest.raises(SpecError) as info:
        parse_yaml(text, file="s.yaml")
    return info.value


@pytest.mark.parametrize(
    "text, line, message",
    [
        ("a: &x [1, *x]\n", 1, "recursive alias"),
        ("a: &x\n  b: 1\n  c: *x\n", 1, "recursive alias"),  # the anchor's line; the path names the alias
        ("a: &x {<<: *x}\n", 1, "recursive alias"),
        (
            "a: 1\nb: !!python/object/apply:os.system ['touch pwned']\n",
            2,
            "unsupported YAML tag !!python/object",
        ),
        ("a: !!python/name:os.system\n", 1, "unsupported YAML tag !!python/name:os.system"),
        ("a: !custom {x: 1}\n", 1, "unsupported YAML tag !custom"),
        ("a:\n  - !custom [1]\n", 2, "unsupported YAML tag !custom"),
        ("!k key: 1\n", 1, "unsupported YAML tag !k"),
        ("a: !!binary aGk=\n", 1, "unsupported YAML tag !!binary"),
        ("a: !!set {x}\n", 1, "unsupported YAML tag !!set"),
        ("a: !!int nope\n", 1, "cannot read 'nope' as int"),
        ("a: !!bool maybe\n", 1, "cannot read 'maybe' as bool"),
        ("a:\n  b: 1" + "0" * 5000 + "\n", 2, "cannot read"),
        ("? [a, b]\n: 1\n", 1, "a mapping key must be plain text"),
        ("a: 1\nb: [" * 1 + "[" * 5000 + "]" * 5001 + "\n", 2, f"nested deeper than {MAX_DEPTH} levels"),
        ("a: &x " + "[" * 40 + "]" * 40 + "\nb: " + "[" * 40 + "*x" + "]" * 40 + "\n", 1, "through aliases"),
        ("a: 1\nb: x\x00y\n", 2, "character U+0000 is not allowed"),
        ("a: 1\n---\nb: 2\n", 2, "bad YAML"),
        ("a: *nope\n", 1, "undefined alias"),
        ("a: &x 1\nb: &x 2\n", 2, "duplicate anchor"),
        ("a: 1\nb:\n  <<: [1, 2]\n", 3, "`<<` merges a mapping"),
    ],
)
def test_hostile_yaml_gets_one_clear_error(tmp_path, text, line, message):
    err = _error(text)
    assert message in str(err) and err.issues[0].line == line, (str(err), err.issues)
    assert str(err).startswith("s.yaml:") and "\n" not in str(err)
    assert not (tmp_path / "pwned").exists()


def test_every_problem_is_reported_at_once():
    err = _error("a: !x 1\nb:\n  c: 1\n  c: 2\nd: [!y 1, 2]\ne: !!float nan-ish\n")
    assert [(i.line, i.path) for i in err.issues] == [(1, "a"), (4, "b.c"), (5, "d[0]"), (6, "e")]
    assert "duplicate key" in err.issues[1].message and str(err).endswith("(and 3 more)")


def test_oversized_and_non_utf8_files(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_bytes(b"name: x\n" + b"# padding\n" * (MAX_SPEC_BYTES // 10 + 1))
    start = time.perf_counter()
    with pytest.raises(SpecError, match=rf"big.yaml: too large \(over {MAX_SPEC_BYTES} bytes"):
        load_model_spec(big)
    assert time.perf_counter() - start < 1
    with pytest.raises(SpecError, match="too large"):
        parse_yaml("a: 1\n" * (MAX_SPEC_BYTES // 5 + 1), file="t.yaml")
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"name: x\ndescription: caf\xe9\n")
    with pytest.raises(SpecError, match=r"latin.yaml:2: not UTF-8 text"):
        load_model_spec(latin)


def test_plain_yaml_features_still_work(tmp_path):
    """Anchors reused a few times (as models/tiny.yaml does), merge keys (the first source wins, explicit keys
    win over all), and keys and dates kept as the text written."""
    spec = tmp_path / "m.yaml"
    spec.write_text(
        "name: m\nbase: {tiny: {}}\nspecialists:\n"
        "  chat: &d {lora: {rank: 4, alpha: 8}, training: {epochs: 1}}\n"
        "  coding: *d\n"
        "  agent:\n    <<: *d\n    training: {epochs: 3}\n"
        "  genui:\n    <<: [{lora: {rank: 2}}, *d]\n"
    )
    model = load_model_spec(spec)
    assert model.specialists["coding"] == model.specialists["chat"]
    assert (model.specialists["agent"].lora.rank, model.specialists["agent"].training.epochs) == (4, 3)
    assert (model.specialists["genui"].lora.rank, model.specialists["genui"].training.epochs) == (2, 1)
    _, lines = parse_yaml(spec.read_text(), file="m.yaml")
    assert lines[("specialists", "agent", "training")] == 8
    spec.write_text(spec.read_text().replace("training: {epochs: 3}", "training: {epochs: -3}"))
    with pytest.raises(SpecError) as info:
        load_model_spec(spec)
    assert [(i.line, i.path) for i in info.value.issues] == [(8, "specialists.agent.training.epochs")]
    data, _ = parse_yaml("1: a\non: 2024-01-01\nnull: ~\n", file="k.yaml")
    assert data == {"1": "a", "on": "2024-01-01", "null": None}
    assert load_model_spec(ROOT / "models" / "tiny.yaml").specialists["genui"].lora.rank > 0


def test_cli_lint_prints_one_line_for_a_bomb(tmp_path, capsys):
    from pipeline.cli import main

    path = billion_laughs(tmp_path / "bomb.yaml")
    with pytest.raises(SystemExit) as exc:
        main(["contract", "lint", "--kind", "model", str(path)])
    assert exc.value.code == 1
    captured = capsys.readouterr()
    assert f"{path}:" in captured.out and "alias bomb" in captured.out and "Traceback" not in captured.err
