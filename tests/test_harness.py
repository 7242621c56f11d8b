"""The harness spec, its validators, and the harness-vs-contract check."""

from __future__ import annotations

import copy
import textwrap
from pathlib import Path

import pytest
import yaml

from pipeline.errors import RatchetError
from pipeline.specs.compatibility import check_harness, require_compatible
from pipeline.specs.contract import ContractSpec, load_contract
from pipeline.specs.harness import HarnessSpec, load_harness, template_slots
from pipeline.specs.loading import SpecError

ROOT = Path(__file__).resolve().parents[1]
DEMO_CONTRACT = load_contract(ROOT / "contracts" / "demo.yaml")
DEMO_TEXT = (ROOT / "harnesses" / "demo.yaml").read_text()
DEMO = yaml.safe_load(DEMO_TEXT)

SMALL = """\
name: h
version: v1
specialists:
  chat:
    system_prompt: "{persona} Be brief."
    slots: {persona: You help.}
  coding:
    system_prompt: "{persona}"
    slots: {persona: You code.}
tools:
  - type: function
    function:
      name: set_timer
      parameters: {type: object, properties: {minutes: {type: integer}}, required: [minutes]}
context: {max_context_tokens: 512}
routing:
  default: chat
  entry: chat
  signals:
    coding:
      strong: ['\\bdef\\b']
      positive: [{pattern: python, weight: 2}]
  guardrails:
    - {pattern: '```', route: coding}
"""


def load_text(tmp_path: Path, text: str) -> HarnessSpec:
    path = tmp_path / "h.yaml"
    path.write_text(textwrap.dedent(text))
    return load_harness(path)


def errors(tmp_path: Path, text: str) -> list:
    with pytest.raises(SpecError) as info:
        load_text(tmp_path, text)
    return info.value.issues


def test_small_harness_loads(tmp_path):
    h = load_text(tmp_path, SMALL)
    assert h.specialists["chat"].render_system_prompt() == "You help. Be brief."
    assert h.routing.mode == "signals" and h.context.keep_turns == 8
    assert [t.function.name for t in h.tools_for("chat")] == ["set_timer"]
    assert h.tool("set_timer") is not None and h.tool("nope") is None


def test_template_slots():
    assert template_slots("{a} and {b} and {a} {{literal}}") == ["a", "b"]
    with pytest.raises(ValueError, match="not a plain name"):
        template_slots("{0}")
    with pytest.raises(ValueError):
        template_slots("{unclosed")


def test_slot_without_value(tmp_path):
    (issue,) = errors(tmp_path, SMALL.replace("{persona} Be brief.", "{persona} {tone}"))
    assert issue.path == "specialists.chat" and "slots with no value in `slots`: tone" in issue.message
    (issue,) = errors(tmp_path, SMALL.replace("{persona} Be brief.", "{persona} {"))
    assert issue.path == "specialists.chat" and issue.line == 5
    assert issue.message.startswith("not a valid template (Single '{' encountered")


def test_bad_regex_is_reported_with_its_path(tmp_path):
    issues = errors(
        tmp_path, SMALL.replace("['\\bdef\\b']", "['ok', '(bad']").replace("pattern: '```'", "pattern: '[x'")
    )
    by_path = {i.path: i for i in issues}
    assert "invalid regular expression '(bad'" in by_path["routing.signals.coding.strong[1]"].message
    assert by_path["routing.signals.coding.strong[1]"].line == 21
    assert "routing.guardrails[0].pattern" in by_path


def test_routing_names_only_declared_specialists(tmp_path):
    text = (
        SMALL.replace("default: chat", "default: poet")
        .replace("route: coding", "route: genui")
        .replace("    coding:\n      strong", "    agent:\n      strong")
    )
    (issue,) = errors(tmp_path, text)
    assert issue.path == "" or issue.line == 1
    for part in (
        "routing.default: 'poet'",
        "routing.guardrails[0].route: 'genui'",
        "routing.signals: 'agent'",
    ):
        assert part in issue.message
    assert "(specialists: chat, coding)" in issue.message


def test_tools_are_checked(tmp_path):
    bad_schema = SMALL.replace("minutes: {type: integer}", "minutes: {type: int}")
    (issue,) = errors(tmp_path, bad_schema)
    assert issue.path == "tools[0].function.parameters" and "not a valid JSON Schema" in issue.message
    unknown = SMALL.replace("slots: {persona: You code.}", "slots: {persona: You code.}\n    tools: [launch]")
    assert "specialists.coding.tools: 'launch' is not a defined tool" in errors(tmp_path, unknown)[0].message
    twice = SMALL.replace("context:", "  - {type: function, function: {name: set_timer}}\ncontext:")
    assert "tool 'set_timer' is defined twice" in errors(tmp_path, twice)[0].message


def test_exemplars(tmp_path):
    text = SMALL.replace(
        "slots: {persona: You help.}",
        "slots: {persona: You help.}\n    exemplars:\n      - messages: [{role: user, content: hi}]",
    )
    (issue,) = errors(tmp_path, text)
    assert "at least 2 items" in issue.message and issue.path == "specialists.chat.exemplars[0].messages"
    text = SMALL.replace(
        "slots: {persona: You help.}",
        "slots: {persona: You help.}\n    exemplars:\n"
        "      - messages: [{role: user, content: hi}, {role: user, content: again}]",
    )
    assert "must end with an assistant message" in errors(tmp_path, text)[0].message


def test_demo_harness_satisfies_demo_contract():
    h = load_harness(ROOT / "harnesses" / "demo.yaml")
    assert set(h.specialists) == {"chat", "agent", "coding", "genui"}
    assert check_harness(h, DEMO_CONTRACT) == []
    require_compatible(h, DEMO_CONTRACT)


def mutated(change) -> HarnessSpec:
    data = copy.deepcopy(DEMO)
    change(data)
    return HarnessSpec.model_validate(data)


def contract_with(change) -> ContractSpec:
    data = DEMO_CONTRACT.model_dump(mode="json")
    change(data)
    return ContractSpec.model_validate(data)


def test_check_harness_reports_every_violation():
    def break_it(d):
        d["tool_call_format"] = "json"
        d["context"]["max_context_tokens"] = 100_000
        d["specialists"]["agent"]["system_prompt"] = "{persona}"  # drops {tool_policy}
        d["specialists"]["chat"]["slots"]["persona"] = "  "
        d["specialists"]["poet"] = {"system_prompt": "{persona}", "slots": {"persona": "p"}}
        del d["specialists"]["genui"]
        del d["routing"]["signals"]["genui"]
        d["routing"]["learned"]["labels"] = ["chat", "agent", "coding"]
        d["specialists"]["coding"]["exemplars"] = [
            {"messages": [{"role": "developer", "content": "x"}, {"role": "assistant", "content": "y"}]},
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "tool_calls": [{"name": "add_item"}]},
                ]
            },
        ]
        d["specialists"]["coding"]["tools"] = ["set_timer"]

    problems = check_harness(mutated(break_it), DEMO_CONTRACT)
    text = "\n".join(problems)
    assert "tool_call_format is 'json', the contract requires 'compact'" in text
    assert "context.max_context_tokens 100000 exceeds the contract's context budget of 2048" in text
    assert "specialists.agent.system_prompt: required slot {tool_policy} is not used" in text
    assert "specialists.chat.slots.persona: required slot is empty" in text
    assert "specialists.poet: specialist not covered by the contract" in text
    assert "specialist 'genui' of the contract has no entry in the harness" in text
    assert "specialists.coding.exemplars[0].messages[0].role: 'developer' is not allowed" in text
    assert "specialists.coding.exemplars[1].messages[1]: calls unknown tool 'add_item'" in text
    assert len(problems) == 8
    with pytest.raises(RatchetError, match=r"violates contract demo 4: .* \(and 7 more\)"):
        require_compatible(mutated(break_it), DEMO_CONTRACT)


def test_check_harness_context_budget():
    def long_persona(d, *, shown):
        d["specialists"]["chat"]["slots"]["persona"] = "x" * 5000
        d["context"]["include_system_prompt"] = shown
        d["context"]["max_context_chars"] = None

    # A system prompt the model is not given costs nothing.
    assert check_harness(mutated(lambda d: long_persona(d, shown=False)), DEMO_CONTRACT) == []
    problems = check_harness(mutated(lambda d: long_persona(d, shown=True)), DEMO_CONTRACT)
    assert any("over the contract's max_system_chars 2000" in p for p in problems)
    assert any("exceed the context window of 128 tokens" in p for p in problems)

    def tight(c):
        c["protocol"]["context_budget"] = {"max_tokens": 24, "chars_per_token": 1.0}

    problems = check_harness(load_harness(ROOT / "harnesses" / "demo.yaml"), contract_with(tight))
    assert any(
        "context.max_context_tokens 128 exceeds the contract's context budget of 24" in p for p in problems
    )
    assert any(p.startswith("specialists.genui:") and "max_new_tokens 40" in p for p in problems)
    assert any(
        "context.max_context_chars 128 exceeds the contract's context budget of 24 tokens" in p
        for p in problems
    )


def test_check_harness_character_budget():
    def big_exemplar(d):
        d["specialists"]["genui"]["exemplars"] = [
            {
                "messages": [
                    {"role": "user", "content": "counter 1+2"},
                    {"role": "assistant", "content": "x" * 90},
                ]
            }
        ]

    (problem,) = check_harness(mutated(big_exemplar), DEMO_CONTRACT)
    assert problem.startswith(
        "specialists.genui: system prompt + exemplars (105 chars) plus max_new_tokens 40"
    )
    assert "leave no room for the conversation in context.max_context_chars 128" in problem


def test_contract_without_system_role():
    def no_system(c):
        c["protocol"]["roles"] = ["user", "assistant", "tool"]

    demo = load_harness(ROOT / "harnesses" / "demo.yaml")
    assert check_harness(demo, contract_with(no_system)) == []  # the demo shows no system prompt
    shown = mutated(lambda d: d["context"].update(include_system_prompt=True))
    problems = check_harness(shown, contract_with(no_system))
    assert sum("does not allow the `system` role" in p for p in problems) == 4
