"""The HCP contract spec: loading, located errors, cross-field checks, held-out suites."""

from __future__ import annotations

import hashlib
import textwrap
from pathlib import Path

import pytest
from conftest import run_cli

from pipeline.errors import NotFoundError, RatchetError
from pipeline.specs.contract import ContractSpec, contract_hash, load_contract, verify_files
from pipeline.specs.loading import SpecError, content_hash

ROOT = Path(__file__).resolve().parents[1]

MINIMAL = """\
name: t
version: "1"
protocol:
  required_slots: [persona]
  context_budget:
    max_tokens: 512
default_specialist: chat
specialists:
  chat:
    scorers:
      - kind: exact_match
      - kind: length
        max_chars: 100
        weight: 0.5
"""


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def load_error(tmp_path: Path, text: str) -> SpecError:
    with pytest.raises(SpecError) as info:
        load_contract(write(tmp_path, text))
    return info.value


def test_minimal_contract_loads_with_defaults(tmp_path):
    spec = load_contract(write(tmp_path, MINIMAL))
    assert spec.name == "t" and spec.version == "1"
    assert [s.key for s in spec.scorers_for("chat")] == ["exact_match", "length"]
    assert spec.protocol.roles == ["system", "user", "assistant", "tool"]
    assert spec.selection.min_score == 0.8
    assert spec.promotion.tolerance("chat") == spec.promotion.max_regression
    assert spec.scorers_for("unknown")[0].kind == "exact_match"  # falls back to the default specialist
    assert spec.required_slots_for("chat") == ["persona"]


def test_numeric_version_becomes_text(tmp_path):
    spec = load_contract(write(tmp_path, MINIMAL.replace('version: "1"', "version: 2")))
    assert spec.version == "2"


def test_hash_is_stable_and_content_addressed(tmp_path):
    a = load_contract(write(tmp_path, MINIMAL, "a.yaml"))
    b = load_contract(write(tmp_path, "# a comment only\n" + MINIMAL, "b.yaml"))
    assert contract_hash(a) == contract_hash(b) == content_hash(a)
    c = load_contract(write(tmp_path, MINIMAL.replace("max_chars: 100", "max_chars: 101"), "c.yaml"))
    assert contract_hash(c) != contract_hash(a)
    # the stored form (model_dump) round-trips, including the `schema` alias
    assert ContractSpec.model_validate(a.model_dump(mode="json")) == a


def test_unknown_scorer_kind_lists_known_kinds(tmp_path):
    err = load_error(tmp_path, MINIMAL.replace("kind: exact_match", "kind: exactly"))
    (issue,) = err.issues
    assert issue.line == 11 and issue.path == "specialists.chat.scorers[0]"
    assert "unknown scorer kind 'exactly'" in issue.message
    assert "exact_match, regex, json_schema, python_tests, tool_call" in issue.message
    assert str(issue).startswith(f"{tmp_path / 'c.yaml'}:11: specialists.chat.scorers[0]:")


def test_missing_kind(tmp_path):
    err = load_error(tmp_path, MINIMAL.replace("- kind: exact_match", "- weight: 1"))
    assert "missing `kind`" in err.issues[0].message


def test_wrong_type_has_line_and_path(tmp_path):
    err = load_error(tmp_path, MINIMAL.replace("weight: 0.5", "weight: heavy"))
    (issue,) = err.issues
    assert (issue.line, issue.path) == (14, "specialists.chat.scorers[1].weight")
    assert "heavy" in issue.message


def test_missing_field(tmp_path):
    err = load_error(tmp_path, MINIMAL.replace("default_specialist: chat\n", ""))
    (issue,) = err.issues
    assert issue.path == "default_specialist" and issue.message == "missing required field"


def test_unknown_field(tmp_path):
    err = load_error(tmp_path, MINIMAL.replace("max_chars: 100", "max_chars: 100\n        maxchars: 3"))
    assert err.issues[0].path == "specialists.chat.scorers[1].maxchars"
    assert "unknown field" in err.issues[0].message


def test_bad_yaml(tmp_path):
    err = load_error(tmp_path, MINIMAL.replace("      - kind: exact_match", "      - kind: [exact_match"))
    assert err.issues[0].message.startswith("bad YAML")
    assert err.issues[0].line > 0


def test_duplicate_key(tmp_path):
    err = load_error(
        tmp_path, MINIMAL.replace("default_specialist: chat", "default_specialist: chat\nname: again")
    )
    (issue,) = err.issues
    assert (issue.line, issue.path, issue.message) == (8, "name", "duplicate key")


def test_several_errors_reported_at_once(tmp_path):
    text = (
        MINIMAL.replace("kind: exact_match", "kind: nope")
        .replace("weight: 0.5", "weight: heavy")
        .replace("max_tokens: 512", "max_tokens: lots")
        .replace('version: "1"\n', "")
    )
    err = load_error(tmp_path, text)
    paths = {i.path for i in err.issues}
    assert {
        "version",
        "protocol.context_budget.max_tokens",
        "specialists.chat.scorers[0]",
        "specialists.chat.scorers[1].weight",
    } <= paths
    assert "(and 3 more)" in str(err)


def test_invalid_regex_and_schema_are_located(tmp_path):
    text = MINIMAL.replace(
        "      - kind: exact_match\n",
        "      - kind: regex\n        pattern: '(unclosed'\n"
        "      - kind: json_schema\n        schema: {type: objekt}\n",
    )
    err = load_error(tmp_path, text)
    by_path = {i.path: i for i in err.issues}
    assert "invalid regular expression" in by_path["specialists.chat.scorers[0].pattern"].message
    assert by_path["specialists.chat.scorers[0].pattern"].line == 12
    assert "not a valid JSON Schema" in by_path["specialists.chat.scorers[1].schema"].message


def test_cross_field_checks(tmp_path):
    err = load_error(tmp_path, MINIMAL.replace("default_specialist: chat", "default_specialist: coding"))
    assert "default_specialist 'coding' is not a declared specialist" in err.issues[0].message
    text = MINIMAL + "promotion:\n  max_regression_per_specialist: {agent: 0.1}\n"
    err = load_error(tmp_path, text)
    assert "promotion.max_regression_per_specialist: 'agent'" in err.issues[0].message
    dup = MINIMAL.replace(
        "      - kind: length", "      - kind: exact_match\n        field: answer\n      - kind: length"
    )
    err = load_error(tmp_path, dup)
    assert "repeated: exact_match" in err.issues[0].message
    zero = MINIMAL.replace(
        "      - kind: exact_match\n", "      - kind: exact_match\n        weight: 0\n"
    ).replace("weight: 0.5", "weight: 0")
    assert "weight 0" in load_error(tmp_path, zero).issues[0].message
    reserved = MINIMAL.replace(
        "      - kind: exact_match\n", "      - kind: exact_match\n        name: total\n"
    )
    assert "reserved" in load_error(tmp_path, reserved).issues[0].message


def test_scorer_ranges(tmp_path):
    text = MINIMAL.replace("max_chars: 100", "min_chars: 50\n        max_chars: 10")
    assert "below min_chars" in load_error(tmp_path, text).issues[0].message


def heldout_contract(tmp_path: Path, entries: str) -> Path:
    return write(tmp_path, MINIMAL + "heldout:\n" + entries)


def test_heldout_file_suite_verifies(tmp_path):
    suite = tmp_path / "suites" / "chat.jsonl"
    suite.parent.mkdir()
    suite.write_text('{"messages": []}\n')
    digest = hashlib.sha256(suite.read_bytes()).hexdigest()
    path = heldout_contract(
        tmp_path,
        f"  - {{specialist: chat, path: suites/chat.jsonl, sha256: {digest}}}\n"
        "  - {specialist: chat, generator: arithmetic, seed: 3, size: 10}\n",
    )
    spec = load_contract(path)
    assert verify_files(spec, path) == {digest: suite.resolve()}
    # an absolute path works too
    spec.heldout[0].path = str(suite)
    assert verify_files(spec, path) == {digest: suite}
    suite.write_text("changed\n")
    with pytest.raises(
        RatchetError, match=r"heldout\[0\] \(chat\): sha256 of .* is [0-9a-f]{64}, the contract"
    ):
        verify_files(spec, path)
    suite.unlink()
    with pytest.raises(NotFoundError, match=r"heldout\[0\] \(chat\): file .* not found"):
        verify_files(spec, path)


@pytest.mark.parametrize(
    "entry, message",
    [
        ("{specialist: chat, path: x.jsonl}", "needs both `path` and `sha256`"),
        ("{specialist: chat, generator: g, seed: 1}", "needs `generator`, `seed` and `size`"),
        ("{specialist: chat}", "give either"),
        ("{specialist: chat, path: x, sha256: " + "a" * 64 + ", generator: g}", "give either"),
        ("{specialist: chat, path: x, sha256: " + "1" * 64 + "}", "put it in quotes"),
        ("{specialist: agent, generator: g, seed: 1, size: 2}", "heldout[0].specialist 'agent'"),
    ],
)
def test_heldout_entry_errors(tmp_path, entry, message):
    err = load_error(tmp_path, MINIMAL + f"heldout:\n  - {entry}\n")
    assert message in err.issues[0].message


def test_demo_contract_covers_the_four_specialists():
    spec = load_contract(ROOT / "contracts" / "demo.yaml")
    assert set(spec.specialists) == {"chat", "agent", "coding", "genui"}
    kinds = {name: {s.kind for s in entry.scorers} for name, entry in spec.specialists.items()}
    assert "exact_match" in kinds["chat"] and "tool_call" in kinds["agent"]
    assert "python_tests" in kinds["coding"] and "json_schema" in kinds["genui"]
    assert verify_files(spec, ROOT / "contracts" / "demo.yaml") == {}
    assert all(entry.tasks and entry.tasks.generator == "demo" for entry in spec.specialists.values())


def test_task_source_entries(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"messages": [{"role": "user", "content": "hi"}], "metadata": {"expected": "hello"}}\n')
    digest = hashlib.sha256(tasks.read_bytes()).hexdigest()
    path = tmp_path / "c.yaml"
    path.write_text(
        MINIMAL.replace("  chat:\n", f"  chat:\n    tasks: {{path: tasks.jsonl, sha256: '{digest}'}}\n", 1)
    )
    spec = load_contract(path)
    assert spec.specialists["chat"].tasks.path == "tasks.jsonl"
    assert verify_files(spec, path) == {digest: tasks.resolve()}
    tasks.write_text("changed\n")
    with pytest.raises(RatchetError, match=r"specialists.chat.tasks: sha256 of .* the contract declares"):
        verify_files(spec, path)


@pytest.mark.parametrize(
    "entry, message",
    [
        ("{path: x.jsonl}", "needs both `path` and `sha256`"),
        ("{}", "give either"),
        ("{generator: demo, path: x.jsonl}", "give either"),
        ("{path: x, sha256: '" + "a" * 64 + "', options: {a: 1}}", "`options` are for a generator"),
        ("{generator: demo, validation_share: 1.5}", "less than 1"),
    ],
)
def test_task_source_errors(tmp_path, entry, message):
    err = load_error(tmp_path, MINIMAL.replace("  chat:\n", f"  chat:\n    tasks: {entry}\n", 1))
    assert message in " ".join(i.message for i in err.issues)


# ------------------------------------------------------------------------------------------------- CLI


def test_cli_lint_ok(capsys):
    files = [
        ROOT / "contracts" / "demo.yaml",
        ROOT / "harnesses" / "demo.yaml",
        ROOT / "models" / "tiny.yaml",
    ]
    code = run_cli(["contract", "lint", *map(str, files), "--contract", str(files[0])])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    spec = load_contract(files[0])
    assert out[0] == f"ok {files[0]} (demo {spec.version} {contract_hash(spec)[:12]})"
    assert out[1].startswith(f"ok {files[1]} (demo v1 ") and out[2].startswith(f"ok {files[2]} (tiny-demo ")


def test_cli_lint_reports_every_issue_of_every_file(tmp_path, capsys):
    bad = write(
        tmp_path, MINIMAL.replace("kind: exact_match", "kind: nope").replace("weight: 0.5", "weight: x")
    )
    dup = write(
        tmp_path, MINIMAL.replace("default_specialist: chat", "default_specialist: chat\nname: b"), "dup.yaml"
    )
    unknown = write(tmp_path, "hello: world\n", "what.yaml")
    # no held-out suite: lint passes it as a lineage contract only when it says so
    good = write(tmp_path, MINIMAL.replace("  chat:\n", "  chat:\n    ungated: true\n"), "good.yaml")
    code = run_cli(
        ["contract", "lint", str(bad), str(dup), str(unknown), str(good), str(tmp_path / "missing.yaml")]
    )
    out = capsys.readouterr().out
    assert code == 1
    assert f"{bad}:11: specialists.chat.scorers[0]: unknown scorer kind 'nope'" in out
    assert f"{bad}:14: specialists.chat.scorers[1].weight: Input should be a valid number" in out
    assert f"{dup}:8: name: duplicate key" in out
    assert f"{unknown}:1: cannot tell the spec kind" in out
    assert f"ok {good} (t 1 " in out
    assert f"{tmp_path / 'missing.yaml'}: file not found" in out


def test_cli_lint_harness_against_contract(tmp_path, capsys):
    text = (
        (ROOT / "harnesses" / "demo.yaml")
        .read_text()
        .replace("tool_call_format: compact", "tool_call_format: json")
    )
    harness = write(tmp_path, text, "h.yaml")
    code = run_cli(["contract", "lint", str(harness), "--contract", str(ROOT / "contracts" / "demo.yaml")])
    assert code == 1
    assert f"{harness}: tool_call_format is 'json'" in capsys.readouterr().out
    assert run_cli(["contract", "lint", str(harness)]) == 0  # without a contract only the spec is checked


def test_cli_lint_bad_kind_is_one_line(capsys):
    assert run_cli(["contract", "lint", "x.yaml", "--kind", "poem"]) == 1
    assert (
        capsys.readouterr().err
        == "error: --kind must be one of contract, harness, model, auto (got 'poem')\n"
    )


@pytest.mark.parametrize(
    "kind, title", [("contract", "ContractSpec"), ("harness", "HarnessSpec"), ("model", "ModelSpec")]
)
def test_cli_schema(kind, title, capsys):
    import json

    assert run_cli(["contract", "schema", "--kind", kind]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["title"] == title and schema["additionalProperties"] is False
    if kind == "contract":
        scorer_defs = schema["$defs"]["JsonSchemaScorer"]["properties"]
        assert "schema" in scorer_defs and scorer_defs["schema"]["description"]


def test_every_spec_field_is_documented():
    from pydantic import BaseModel

    import pipeline.specs.contract
    import pipeline.specs.harness
    import pipeline.specs.modelspec
    import pipeline.specs.scorers

    missing = []
    for module in (
        pipeline.specs.contract,
        pipeline.specs.harness,
        pipeline.specs.modelspec,
        pipeline.specs.scorers,
    ):
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, BaseModel) and obj.__module__ == module.__name__:
                missing += [f"{obj.__name__}.{n}" for n, f in obj.model_fields.items() if not f.description]
    assert missing == []


def test_selection_sources_are_the_registry_sources():
    from pipeline.registry.experience import SOURCES
    from pipeline.specs.contract import SelectionRules

    trainable = [s for s in SOURCES if s != "evaluation"]
    assert SelectionRules(sources=trainable).sources == trainable
    for bad in ("evaluation", "serve"):
        with pytest.raises(ValueError, match="deployment"):
            SelectionRules(sources=[bad])


def test_trusted_principals_apply_only_to_scorers_that_read_a_principals_material():
    import yaml

    from pipeline.specs.contract import ContractSpec

    spec = yaml.safe_load((ROOT / "contracts" / "demo.yaml").read_text())
    spec["specialists"]["chat"]["scorers"][2]["trusted"] = ["raters"]  # feedback: whose ratings count
    assert ContractSpec.model_validate(spec).specialists["chat"].scorers[2].trusts("raters")
    spec["specialists"]["chat"]["scorers"][1]["trusted"] = ["raters"]  # length reads no one's material
    with pytest.raises(ValueError, match="`trusted` does not apply to length"):
        ContractSpec.model_validate(spec)
    for reserved in ("total", "final"):
        bad = yaml.safe_load((ROOT / "contracts" / "demo.yaml").read_text())
        bad["specialists"]["chat"]["scorers"][1]["name"] = reserved
        with pytest.raises(ValueError, match=f"`{reserved}` is reserved"):
            ContractSpec.model_validate(bad)
