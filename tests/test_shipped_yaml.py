"""Every YAML file the repo ships validates, says which command uses it, and the shipped harnesses
satisfy the shipped contracts."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.cli.contract import lint_file
from pipeline.specs.compatibility import check_harness
from pipeline.specs.contract import load_contract
from pipeline.specs.harness import load_harness

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"contracts": "contract", "harnesses": "harness", "models": "model"}
SHIPPED = sorted(p for folder in FOLDERS for p in (ROOT / folder).glob("*.y*ml"))


def test_something_is_shipped():
    assert {p.parent.name for p in SHIPPED} == set(FOLDERS)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_yaml_lints(path):
    problems, spec, kind = lint_file(path)
    assert problems == []
    assert kind == FOLDERS[path.parent.name] and spec is not None


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_yaml_starts_with_its_command(path):
    first = path.read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith("# Used by: ratchet "), first


@pytest.mark.parametrize(
    "harness_path, contract_path",
    [
        (h, c)
        for h in sorted((ROOT / "harnesses").glob("*.y*ml"))
        for c in sorted((ROOT / "contracts").glob("*.y*ml"))
    ],
    ids=lambda p: p.name,
)
def test_shipped_harnesses_satisfy_shipped_contracts(harness_path, contract_path):
    assert check_harness(load_harness(harness_path), load_contract(contract_path)) == []


# ------------------------------------------------------------------ the demo files match the environment
DEMO_HARNESS = ROOT / "harnesses" / "demo.yaml"
DEMO_CONTRACT = ROOT / "contracts" / "demo.yaml"


def _items(family: str, n: int = 24) -> list[dict]:
    from pipeline.environment.tasks import heldout_suite, sample_prompts

    return sample_prompts(family, n, seed=11) + heldout_suite(family, n, seed=11)


def _wrong(item: dict) -> str:
    """The reference answer with the sum off by one (right format, wrong outcome)."""
    total = sum(int(x) for x in item["metadata"]["task_id"].rsplit(":", 1)[1].split("+"))
    return item["metadata"]["expected"].replace(str(total), str(total + 1))


def test_demo_harness_tools_are_the_environments():
    from pipeline.environment.toolbox import TOOLS

    assert [t.model_dump(mode="json") for t in load_harness(DEMO_HARNESS).tools] == TOOLS


def test_demo_prompts_route_to_their_specialist():
    from pipeline.environment.tasks import FAMILIES
    from pipeline.serving.router import RouteTurn, route_turn

    routing = load_harness(DEMO_HARNESS).routing
    for family in FAMILIES:
        for item in _items(family):
            text = item["messages"][0]["content"]
            assert route_turn(RouteTurn(text), routing).specialist == family, text


def test_demo_answers_fit_decoding_and_the_tiny_window():
    from pipeline.environment.tasks import FAMILIES, make_item
    from pipeline.modeling.prompting import prompt_chars, render_messages
    from pipeline.specs.modelspec import load_model_spec

    harness = load_harness(DEMO_HARNESS)
    positions = load_model_spec(ROOT / "models" / "tiny.yaml").base.tiny.max_position_embeddings
    assert harness.context.max_context_chars == positions
    for family in FAMILIES:
        new = harness.specialists[family].decoding.max_new_tokens
        for variant in range(12):
            item = make_item(family, 99, 99, variant)  # the longest sums
            assert len(item["metadata"]["expected"]) + 1 <= new, (family, item["metadata"]["expected"])
            msgs = render_messages(harness, family, item["messages"])
            assert msgs == item["messages"]  # no system prompt, no exemplars at v1
            assert prompt_chars(msgs, harness.tool_call_format) + new <= positions


def test_environment_traces_score_under_the_demo_contract():
    """Reference answers score 1.0 in every family; a wrong sum or a malformed answer scores low."""
    from pipeline.environment.tasks import FAMILIES, completion_trace, reference_answer
    from pipeline.scoring import score_trace

    contract, harness = load_contract(DEMO_CONTRACT), load_harness(DEMO_HARNESS)
    for family in FAMILIES:
        for item in _items(family, 3):
            right = score_trace(contract, completion_trace(item, reference_answer(item)), harness=harness)
            assert right.total == 1.0, (family, right.values, [t.errors for t in right.turns])
            wrong = score_trace(contract, completion_trace(item, _wrong(item)), harness=harness)
            assert wrong.total is not None and wrong.total < 0.2, (family, wrong.values)
            junk = score_trace(contract, completion_trace(item, "hello"), harness=harness)
            assert junk.total is not None and junk.total < 0.2, (family, junk.values)
    # Compact text that was never converted to OpenAI tool_calls scores the same.
    item = _items("agent", 1)[0]
    raw = {**item, "messages": [*item["messages"], {"role": "assistant", "content": reference_answer(item)}]}
    assert score_trace(contract, raw, harness=harness).total == 1.0


def test_demo_contract_suites_are_generated_held_out_sets():
    from pipeline.environment.tasks import heldout_suite

    contract = load_contract(DEMO_CONTRACT)
    suites = {s.specialist: s for s in contract.heldout}
    assert set(suites) == set(contract.specialists) and len(contract.heldout) == len(suites)
    for name, suite in suites.items():
        assert (suite.generator, suite.path) == ("demo", None)
        assert suite.size >= contract.promotion.min_heldout_samples
        items = heldout_suite(family=name, n=suite.size, seed=suite.seed)
        assert len(items) == suite.size
        assert all(i["metadata"]["split"] == "heldout" and i["metadata"]["specialist"] == name for i in items)
