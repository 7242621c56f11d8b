"""Property-based tests of the parsers of untrusted input: contracts, harnesses and model specs (YAML), and the
ingest line parser (JSONL). Generated inputs range from near-valid documents (the shipped specs and a valid
trace with a few random edits) to random YAML, JSON and bytes. Whatever the input, a parser either accepts
it, and what it accepted round-trips, or refuses it with a clean one-line error; nothing else escapes.

Reproducible: every test is derandomized and writes no example database."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from pipeline.errors import RatchetError
from pipeline.experience.ingest import TraceError, ingest_file, parse_line, trace_row
from pipeline.registry import Experience, Quarantine, session_scope
from pipeline.registry.models import load_json
from pipeline.specs.contract import ContractSpec
from pipeline.specs.harness import HarnessSpec
from pipeline.specs.loading import content_hash, validate_spec_text
from pipeline.specs.modelspec import ModelSpec

ROOT = Path(__file__).resolve().parent.parent


def _settings(n: int, **kw):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None, **kw)


# ---------------------------------------------------------------------------------------- value strategies
def _schema_words(model: Any) -> list[str]:
    """Every field name and enumerated value in a model's JSON schema: keys that reach deep validation."""
    words: set[str] = set()
    stack = [model.model_json_schema()]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            words.update(k for k in node.get("properties", {}) if isinstance(k, str))
            words.update(v for v in node.get("enum", []) if isinstance(v, str))
            if isinstance(node.get("const"), str):
                words.add(node["const"])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return sorted(words)


WORDS = sorted(
    {*_schema_words(ContractSpec), *_schema_words(HarnessSpec), *_schema_words(ModelSpec), "chat", "agent"}
)
KEYS = st.one_of(st.sampled_from(WORDS), st.text(max_size=8))
# YAML keys need not be text (``1:``, ``true:``, ``null:``); the loader reads every key as the text written
ANY_KEYS = st.one_of(KEYS, st.integers(-3, 3), st.booleans(), st.none())
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([0, -1, 2**63, 2**64, -(2**63) - 1, 10**30, 7 * 10**300]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(WORDS),
    st.sampled_from(["", "\x00", "a\nb", "{slot}", "{", "(?P<", "^[a-z]+$", "0" * 64, "2024-01-01", "~"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(KEYS, inner, max_size=4)),
    max_leaves=12,
)


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _resolve(doc: Any, path: tuple) -> tuple[Any, Any] | None:
    """(parent container, key) of ``path`` in ``doc``, or None when an earlier edit removed it."""
    parent: Any = None
    node, key = doc, None
    for part in path:
        if (
            isinstance(node, dict)
            and part in node
            or isinstance(node, list)
            and isinstance(part, int)
            and part < len(node)
        ):
            parent, key, node = node, part, node[part]
        else:
            return None
    return parent, key


@st.composite
def near_valid(draw, base: Any) -> Any:
    """``base`` (a valid document) with 0 to 3 random edits: a value replaced, a key removed or added, a list
    item repeated, a value wrapped in a list or turned into text."""
    doc = json.loads(json.dumps(base))
    paths = _paths(doc)[1:]
    for _ in range(draw(st.integers(0, 3))):
        where = _resolve(doc, draw(st.sampled_from(paths)))
        if where is None:
            continue
        parent, key = where
        edit = draw(st.sampled_from(["replace", "remove", "add", "repeat", "wrap", "text"]))
        if edit == "replace":
            parent[key] = draw(VALUES)
        elif edit == "remove":
            del parent[key]
        elif edit == "add" and isinstance(parent[key], dict):
            parent[key][draw(ANY_KEYS)] = draw(VALUES)
        elif edit == "repeat" and isinstance(parent[key], list) and parent[key]:
            parent[key].append(parent[key][0])
        elif edit == "wrap":
            parent[key] = [parent[key]]
        elif edit == "text":
            parent[key] = str(parent[key])
    return doc


# ------------------------------------------------------------------------------------------- spec parsers
SPECS = {
    "contract": (ContractSpec, ROOT / "contracts" / "demo.yaml"),
    "harness": (HarnessSpec, ROOT / "harnesses" / "demo.yaml"),
    "model": (ModelSpec, ROOT / "models" / "tiny.yaml"),
}
BASES = {kind: yaml.safe_load(path.read_text()) for kind, (_, path) in SPECS.items()}


def check_spec_text(text: str, model: Any) -> Any:
    """The property: accepted and round-tripping, or one clean located error line."""
    try:
        spec = validate_spec_text(text, model, file="gen.yaml")
    except RatchetError as exc:
        message = str(exc)
        assert message.startswith("gen.yaml") and "\n" not in message, message
        return None
    again = validate_spec_text(yaml.safe_dump(spec.model_dump(mode="json")), model, file="again.yaml")
    assert again == spec and content_hash(again) == content_hash(spec)
    return spec


@pytest.mark.parametrize("kind, examples", [("contract", 250), ("harness", 200), ("model", 300)])
def test_near_valid_specs(kind, examples):
    model = SPECS[kind][0]
    accepted = []

    @_settings(examples)
    @given(doc=near_valid(BASES[kind]), flow=st.booleans())
    def run(doc, flow):
        text = json.dumps(doc) if flow else yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)
        accepted.append(check_spec_text(text, model) is not None)

    run()
    assert 0 < sum(accepted) < len(accepted)  # both sides of the property were exercised


YAML_TOKENS = [
    "name", "version", "specialists", "chat", "base", "tiny", "lora", ":", ": ", " ", "  ", "\n", "- ", "-",
    "&a ", "*a", "&b ", "*b", "!!python/object:os.system ", "!t ", "!!str ", "!!int ", "!!binary ", "[", "]",
    "{", "}", ",", "<<: ", "? ", "'", '"', "#", "|", ">", "---", "...", "%YAML 1.1\n", "\t", "\x00", "\\",
    "1e400", "0x1F", "~", "on", "2024-01-01", "1" * 30, ".nan", "=",
]  # fmt: skip
YAML_SOUP = st.lists(st.sampled_from(YAML_TOKENS), max_size=40).map("".join)


@_settings(1500)
@given(text=st.one_of(YAML_SOUP, st.text(max_size=60)), kind=st.sampled_from(sorted(SPECS)))
def test_random_yaml_text(text, kind):
    check_spec_text(text, SPECS[kind][0])


@_settings(300)
@given(
    doc=st.dictionaries(KEYS, VALUES, max_size=6), kind=st.sampled_from(sorted(SPECS)), anchors=st.booleans()
)
def test_random_yaml_documents(doc, kind, anchors):
    """Random mappings of the schemas' words, dumped plainly or with anchors and aliases for repeats."""
    dumper = yaml.SafeDumper
    if not anchors:
        dumper = type("NoAliases", (yaml.SafeDumper,), {"ignore_aliases": lambda self, data: True})
    doc = {**doc, "twice": [doc.get("specialists"), doc.get("specialists")]} if anchors else doc
    check_spec_text(yaml.dump(doc, Dumper=dumper, sort_keys=False, allow_unicode=True), SPECS[kind][0])


# --------------------------------------------------------------------------------------- ingest line parser
VALID_TRACE = {
    "messages": [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "set a timer"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "t", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "ok"}]},
        {"role": "assistant", "content": "done"},
    ],
    "metadata": {
        "specialist": "agent",
        "expected": "done",
        "summaries": {"2": "called t()"},
        "route_scores": {"agent": {"timer": 1.0}},
        "split": "train",
    },
    "feedback": {"rating": 5, "correction": None},
    "routes": [{"turn": 2, "specialist": "agent", "reason": "signal", "scores": {"agent": {"timer": 2}}}],
}


def check_line(raw: bytes) -> dict[str, Any] | None:
    """The property: a line is a validated trace that round-trips exactly, or a ``TraceError`` (its reason)."""
    try:
        trace = parse_line(raw)
    except TraceError as exc:
        assert str(exc) and "\x00" not in str(exc)
        return None
    row = trace_row(trace, source="import")
    assert load_json(row.messages) == trace["messages"] and load_json(row.metadata) == trace["metadata"]
    assert load_json(row.routes) == trace["routes"]
    assert (None if row.feedback is None else load_json(row.feedback)) == trace["feedback"]
    assert row.specialist is None or (isinstance(row.specialist, str) and "\x00" not in row.specialist)
    # the canonical form is stable: written out again and re-read, the trace has the same content hash
    assert trace_row(parse_line(row_line(row)), source="import").content_hash == row.content_hash
    return trace


def row_line(row: Any) -> bytes:
    feedback = "null" if row.feedback is None else row.feedback
    text = (
        f'{{"messages":{row.messages},"metadata":{row.metadata},"feedback":{feedback},"routes":{row.routes}}}'
    )
    return text.encode()


@st.composite
def hostile_bytes(draw, line: bytes) -> bytes:
    """``line`` with a raw NUL, a stray byte or a cut somewhere (or left alone)."""
    at = draw(st.integers(0, len(line)))
    edit = draw(st.sampled_from(["none", "nul", "byte", "cut"]))
    if edit == "nul":
        return line[:at] + b"\x00" + line[at:]
    if edit == "byte":
        return line[:at] + bytes([draw(st.integers(0, 255))]) + line[at:]
    return line[:at] if edit == "cut" else line


TRACE_LINES = near_valid(VALID_TRACE).flatmap(
    lambda doc: st.booleans().map(lambda ascii: json.dumps(doc, ensure_ascii=ascii).encode())
)


@_settings(1200)
@given(raw=TRACE_LINES.flatmap(hostile_bytes))
def test_near_valid_trace_lines(raw):
    check_line(raw)


@_settings(800)
@given(raw=st.one_of(st.binary(max_size=80), VALUES.map(lambda v: json.dumps(v).encode())))
def test_random_lines(raw):
    check_line(raw)


def test_the_valid_trace_is_accepted():
    assert check_line(json.dumps(VALID_TRACE).encode()) == VALID_TRACE


_files = itertools.count()


@pytest.mark.parametrize("examples", [40])
def test_ingest_of_generated_files(engine, tmp_path, examples):
    """Generated files ingested for real (SQLite and PostgreSQL): every line counted once, every accepted
    line stored exactly, every refused one quarantined once, and a rerun changes nothing."""
    factory = lambda: session_scope(engine)  # noqa: E731

    @_settings(examples, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(lines=st.lists(st.one_of(TRACE_LINES.flatmap(hostile_bytes), st.binary(max_size=30)), max_size=12))
    def run(lines):
        lines = [
            line.replace(b"\n", b" ").replace(b"\r", b" ") for line in lines if line.strip(b" \t\r\n\x0b\x0c")
        ]
        path = tmp_path / f"gen-{next(_files)}.jsonl"
        path.write_bytes(b"".join(line + b"\n" for line in lines))
        traces = [check_line(line) for line in lines]
        result = ingest_file(path, session_factory=factory, batch_size=3)
        good = [t for t in traces if t is not None]
        assert result.lines == len(lines) == result.stored + result.duplicate + result.quarantined
        assert result.quarantined == len(lines) - len(good)
        hashes = {trace_row(t, source="import").content_hash: t for t in good}
        with session_scope(engine) as s:
            stored = s.scalars(select(Experience).where(Experience.content_hash.in_(list(hashes)))).all()
            assert {r.content_hash: {"messages": r.messages, "metadata": r.meta} for r in stored} == {
                h: {"messages": t["messages"], "metadata": t["metadata"]} for h, t in hashes.items()
            }
            quarantined = s.scalars(select(Quarantine.line_number).where(Quarantine.source_file == str(path)))
            assert sorted(quarantined) == [i + 1 for i, t in enumerate(traces) if t is None]
        again = ingest_file(path, session_factory=factory, batch_size=5)
        assert (again.stored, again.quarantined) == (0, result.quarantined)
        with session_scope(engine) as s:
            count = s.scalars(select(Quarantine.id).where(Quarantine.source_file == str(path))).all()
        assert len(count) == result.quarantined

    run()


def test_orjson_and_the_standard_parser_agree_on_what_is_kept():
    """The exact path (an integer of 19+ digits) and the fast one store the same canonical text."""
    trace = {**VALID_TRACE, "metadata": {**VALID_TRACE["metadata"], "n": 12345678901234567890123}}
    row = trace_row(parse_line(json.dumps(trace).encode()), source="import")
    assert load_json(row.metadata)["n"] == 12345678901234567890123
    plain = trace_row(parse_line(json.dumps(VALID_TRACE).encode()), source="import")
    assert orjson.loads(plain.messages) == load_json(row.messages)
