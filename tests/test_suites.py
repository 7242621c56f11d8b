"""What a suite counts (``pipeline.gates.suites``): repeated held-out items are refused with their lines named,
correlated items carry their group into the evaluation, and every trained specialist is judged by a
held-out suite or says ``ungated: true`` (and the dashboard shows it)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import yaml
from conftest import run_cli, write_specs

from pipeline.errors import RatchetError

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "harnesses" / "demo.yaml"
UNGATED_GENUI = (
    "specialists.genui: no held-out suite judges it: add one under `heldout`, or say `ungated: true` (it is "
    "then trained and promoted with no gate of its own)"
)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_jsonl(path: Path, rows: list[dict | None]) -> None:
    """One JSON object a line; None: a blank line (which a suite file may have, and which shifts the lines)."""
    path.write_text("".join("\n" if r is None else json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def chat_item(prompt: str, *, group: object = None) -> dict:
    meta: dict = {"expected": "1"}
    if group is not None:
        meta["group"] = group
    return {"messages": [{"role": "user", "content": prompt}], "metadata": meta}


def chat_contract(tmp_path: Path, suite: Path) -> Path:
    """One specialist practising on the demo generator (so the demo's canonical form reads its suite)."""
    path = tmp_path / "c.yaml"
    path.write_text(
        f"""name: t
version: "1"
protocol: {{context_budget: {{max_tokens: 512}}}}
default_specialist: chat
specialists:
  chat:
    tasks: {{generator: demo}}
    scorers: [{{kind: exact_match}}]
heldout:
  - {{specialist: chat, path: {suite.name}, sha256: "{sha(suite)}"}}
"""
    )
    return path


def heldout_operands(n: int) -> list[tuple[int, int]]:
    from pipeline.environment import heldout_suite

    return [
        tuple(int(x) for x in i["metadata"]["task_id"].rsplit(":", 1)[1].split("+"))
        for i in heldout_suite("chat", n, seed=5)
    ]


def demo_with_chat_suite(tmp_path: Path, suite: Path, *, keep: Path | None = None) -> dict[str, Path]:
    """The demo specs (no model needed: init refuses before it reads one) with chat judged by ``suite``, and
    ``keep`` as a second retention suite of chat."""
    specs = write_specs(tmp_path, tmp_path / "no-model-needed")
    contract = yaml.safe_load(specs["contract"].read_text())
    contract["heldout"] = [h for h in contract["heldout"] if h["specialist"] != "chat"]
    contract["heldout"].append({"specialist": "chat", "path": suite.name, "sha256": sha(suite)})
    if keep is not None:
        contract["retention"].append(
            {"name": "keep", "specialist": "chat", "path": keep.name, "sha256": sha(keep)}
        )
    specs["contract"].write_text(yaml.safe_dump(contract))
    return specs


# ------------------------------------------------------------------------------------------------ repeats
def test_lint_refuses_a_file_suite_that_repeats_an_item_naming_its_lines(tmp_path, capsys):
    (a, b), (c, d), (e, f) = heldout_operands(3)
    suite = tmp_path / "suite.jsonl"
    write_jsonl(
        suite,
        [
            chat_item(f"{a}+{b}=?"),  # line 1
            chat_item(f"{c}+{d}=?"),  # line 2
            None,  # line 3: blank
            chat_item(f"{b}+{a}=?"),  # line 4: the problem of line 1, operands swapped
            chat_item(f"  {c}+{d}  "),  # line 5: the prompt of line 2, trimmed and normalised
            chat_item(f"{e}+{f}=?"),  # line 6: a problem of its own
        ],
    )
    contract = chat_contract(tmp_path, suite)
    assert run_cli(["contract", "lint", str(contract)]) == 1
    out = capsys.readouterr().out.splitlines()
    where = f"{contract}: heldout[0] (chat), suite.jsonl:"
    assert out[:2] == [
        f"{where} line 4 repeats line 1 (the same problem: '{a}+{b}=?' / '{b}+{a}=?'); remove one",
        f"{where} line 5 repeats line 2 (the same prompt: '{c}+{d}=?' / '{c}+{d}'); remove one",
    ]
    assert not any(line.startswith("ok ") for line in out)


def test_a_specialists_suites_are_one_list_and_a_retention_suite_its_own(tmp_path):
    """Two held-out suites of one specialist are evaluated as one list: an item in both is a repeat."""
    from pipeline.gates.suites import suite_problems
    from pipeline.specs.contract import load_contract

    (a, b), (c, d) = heldout_operands(2)
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    write_jsonl(first, [chat_item(f"{a}+{b}=?"), chat_item(f"{c}+{d}=?")])
    write_jsonl(second, [chat_item(f"what is {b} plus {a}?")])
    path = chat_contract(tmp_path, first)
    spec = yaml.safe_load(path.read_text())
    spec["heldout"].append({"specialist": "chat", "path": second.name, "sha256": sha(second)})
    path.write_text(yaml.safe_dump(spec))
    assert suite_problems(load_contract(path), contract_path=path) == [
        f"heldout[1] (chat), second.jsonl: line 1 repeats heldout[0] (chat), first.jsonl: line 1 (the same "
        f"problem: '{a}+{b}=?' / 'what is {b} plus {a}?'); remove one"
    ]


# A third-party generator (entry point ``repeats``) whose held-out split repeats a prompt and a problem.
REPEATS = (
    "class Repeats:\n"
    "    def items(self, split, n, seed):\n"
    "        qs = ['capital of spain?', 'capital of peru?', 'Capital of SPAIN', 'which city governs peru?',\n"
    "              'capital of chad?']\n"
    "        return [{'messages': [{'role': 'user', 'content': q}], 'metadata': {'expected': 'x'}} for q in qs[:n]]\n"
    "    def canonical(self, messages):\n"
    "        words = [w.strip('?!.,') for m in messages for w in str(m.get('content') or '').lower().split()]\n"
    "        return {('capital', w) for w in words if w in ('spain', 'peru', 'chad')} or None\n"
    "def make(*, specialist):\n    return Repeats()\n"
    "class Nothing(Repeats):\n"
    "    def items(self, split, n, seed):\n        return []\n"
    "def make_nothing(*, specialist):\n    return Nothing()\n"
)


@pytest.fixture
def repeats_generator(tmp_path, monkeypatch):
    (tmp_path / "repeats_pkg.py").write_text(REPEATS)
    dist = tmp_path / "repeats_pkg-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: repeats-pkg\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[ratchet.tasks]\nrepeats = repeats_pkg:make\nnothing = repeats_pkg:make_nothing\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "repeats_pkg", raising=False)


GEO = """name: t
version: "1"
protocol: {context_budget: {max_tokens: 512}}
default_specialist: geo
specialists:
  geo:
    scorers: [{kind: exact_match}]
"""


def test_lint_refuses_a_generated_suite_that_repeats_naming_positions_and_generator(
    tmp_path, capsys, repeats_generator
):
    path = tmp_path / "geo.yaml"
    path.write_text(GEO + "heldout:\n  - {specialist: geo, generator: repeats, seed: 0, size: 5}\n")
    assert run_cli(["contract", "lint", str(path)]) == 1
    where = f"{path}: heldout[0] (geo), generator repeats (seed 0, size 5):"
    assert capsys.readouterr().out.splitlines() == [
        f"{where} item 3 repeats item 1 (the same prompt: 'capital of spain?' / 'Capital of SPAIN'); its generator "
        "must draw distinct problems",
        f"{where} item 4 repeats item 2 (the same problem: 'capital of peru?' / 'which city governs peru?'); its "
        "generator must draw distinct problems",
    ]


def test_a_retention_suite_that_repeats_is_refused_too(tmp_path, repeats_generator):
    from pipeline.gates.suites import suite_problems
    from pipeline.specs.contract import load_contract

    path = tmp_path / "geo.yaml"
    path.write_text(GEO + "    ungated: true\nretention:\n  - {name: keep, specialist: geo, generator: repeats, "
                    "seed: 0, size: 4}\n")  # fmt: skip
    problems = suite_problems(load_contract(path), contract_path=path)
    assert [p.split(" (the same")[0] for p in problems] == [
        "retention[0] (keep), generator repeats (seed 0, size 4): item 3 repeats item 1",
        "retention[0] (keep), generator repeats (seed 0, size 4): item 4 repeats item 2",
    ]


def test_an_empty_suite_is_refused(tmp_path, capsys, repeats_generator):
    """A held-out file with no items, or a generator that draws none, judges nothing: refused at lint and init
    (and adopt: the same ``require_counted``), not counted as the specialist's gate."""
    from pipeline.gates.suites import suite_problems
    from pipeline.loop.founding import init_lineage
    from pipeline.specs.contract import load_contract

    suite = tmp_path / "suite.jsonl"
    write_jsonl(suite, [None])  # an export that wrote nothing
    specs = demo_with_chat_suite(tmp_path, suite)
    line = (
        f"{specs['contract']}: heldout[3] (chat), suite.jsonl: no items: an empty suite judges nothing (a suite "
        "needs at least one item)"
    )
    assert run_cli(["contract", "lint", str(specs["contract"])]) == 1
    assert capsys.readouterr().out.splitlines() == [line]
    with pytest.raises(RatchetError) as refused:
        init_lineage(contract_path=specs["contract"], harness_path=HARNESS, model_path=specs["model"])
    assert str(refused.value) == line

    path = tmp_path / "geo.yaml"
    path.write_text(GEO + "    ungated: true\nretention:\n  - {name: keep, specialist: geo, generator: nothing, "
                    "seed: 0, size: 3}\n")  # fmt: skip
    assert suite_problems(load_contract(path), contract_path=path) == [
        "retention[0] (keep), generator nothing (seed 0, size 3): no items: an empty suite judges nothing (a "
        "suite needs at least one item)"
    ]


def test_the_demo_suites_hold_distinct_problems():
    """The demo generator draws each held-out problem once (``a+b`` and ``b+a`` are one), at every size."""
    from pipeline.environment import heldout_suite
    from pipeline.environment.problems import problem_keys
    from pipeline.gates.suites import suite_problems
    from pipeline.specs.contract import load_contract

    demo = ROOT / "contracts" / "demo.yaml"
    assert suite_problems(load_contract(demo), contract_path=demo) == []
    everything = heldout_suite("agent", 5000, seed=3)
    assert len({problem_keys(i["messages"]) for i in everything}) == len(everything) > 800


# ------------------------------------------------------------------------------------------------- groups
def test_item_groups_are_read_and_aligned_with_the_compared_items(tmp_path, capsys):
    from pipeline.gates.suites import compared_groups, item_groups

    items = [
        chat_item("a", group="d1"),
        chat_item("b", group="d1"),
        chat_item("c"),
        chat_item("d", group="d2"),
    ]
    assert item_groups(items) == ["d1", "d1", None, "d2"]
    assert compared_groups(items, left_out=[1]) == {"groups": ["d1", None, "d2"]}  # item 1 was not compared
    assert (
        compared_groups([chat_item("a"), chat_item("b")], left_out=[]) == {}
    )  # no groups: every item a unit
    (a, b), (c, d) = heldout_operands(2)
    suite = tmp_path / "suite.jsonl"
    write_jsonl(suite, [chat_item(f"{a}+{b}=?", group="one"), chat_item(f"{c}+{d}=?", group=7)])
    contract = chat_contract(tmp_path, suite)
    assert run_cli(["contract", "lint", str(contract)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"{contract}: heldout[0] (chat), suite.jsonl: line 2: metadata.group must be a non-empty string naming "
        "the item's group of correlated items (got 7)"
    ]


def test_lint_and_init_refuse_a_group_the_gates_would_not_read(tmp_path, capsys):
    """A top-level ``group`` (read by no gate) or a non-string ``metadata.group``, in a held-out or a retention
    suite, is refused with the item's line: a group silently dropped would count a dialogue's turns as
    independent items."""
    from pipeline.loop.founding import init_lineage

    (a, b), (c, d), (e, f) = heldout_operands(3)
    suite, keep = tmp_path / "suite.jsonl", tmp_path / "keep.jsonl"
    top = {**chat_item(f"{c}+{d}=?"), "group": "d1"}
    write_jsonl(suite, [chat_item(f"{a}+{b}=?", group="d1"), top])
    write_jsonl(keep, [chat_item(f"{e}+{f}=?", group=3)])
    specs = demo_with_chat_suite(tmp_path, suite, keep=keep)
    contract = specs["contract"]
    expected = [
        f"{contract}: heldout[3] (chat), suite.jsonl: line 2: a top-level `group` is read by no gate: put it "
        "under metadata.group",
        f"{contract}: retention[1] (keep), keep.jsonl: line 1: metadata.group must be a non-empty string naming "
        "the item's group of correlated items (got 3)",
    ]
    assert run_cli(["contract", "lint", str(contract)]) == 1
    assert capsys.readouterr().out.splitlines() == expected
    with pytest.raises(RatchetError) as refused:
        init_lineage(contract_path=contract, harness_path=HARNESS, model_path=specs["model"])
    assert str(refused.value).splitlines() == expected


def test_retention_reads_groups_as_the_heldout_suites_do(small_base):
    """One reader of groups (``item_groups``): a retention suite's record carries the groups the held-out
    evaluation would read from the same items -- a top-level or integer group is no group."""
    from pipeline.gates.retention import evaluate_suite
    from pipeline.gates.suites import compared_groups
    from pipeline.modeling.pair import PairSpec
    from pipeline.modeling.placement import spec_placement
    from pipeline.specs.contract import ContractSpec, RetentionSuite
    from pipeline.specs.harness import load_harness

    contract = ContractSpec.model_validate(
        {
            "name": "t",
            "version": "1",
            "protocol": {"context_budget": {"max_tokens": 512}},
            "default_specialist": "chat",
            "specialists": {"chat": {"scorers": [{"kind": "exact_match"}], "ungated": True}},
        }  # fmt: skip
    )
    suite = RetentionSuite(name="keep", specialist="chat", generator="demo", seed=1, size=4)
    items = [
        chat_item("1+2=?", group="d1"),
        chat_item("3+4=?", group="d1"),
        {**chat_item("5+6=?"), "group": "x"},
        chat_item("7+8=?", group=7),
    ]
    pair = PairSpec(small_base, {"chat": None}, load_harness(HARNESS), spec_placement(), small_base)
    record = evaluate_suite(contract, suite, items, pair, pair)
    assert len(record["parent"]) == 4
    assert record["groups"] == ["d1", "d1", None, None] == compared_groups(items, [])["groups"]


def test_evaluation_stores_each_compared_items_group(small_base, tmp_path):
    """A chat-only lineage on a file suite whose items come in dialogues of two: the evaluation keeps each
    compared item's group beside its scores, in suite order."""
    from pipeline.environment import heldout_suite
    from pipeline.loop.advance import begin_candidate
    from pipeline.loop.candidate import AdvanceConfig, load_generation, mark_step
    from pipeline.loop.evaluation import evaluate_step
    from pipeline.loop.founding import init_lineage
    from pipeline.registry import get_engine, session_scope

    specs = write_specs(tmp_path, small_base)
    model = yaml.safe_load(specs["model"].read_text())
    model["specialists"] = {"chat": model["specialists"]["chat"]}  # the lineage trains chat alone
    specs["model"].write_text(yaml.safe_dump(model))
    items = heldout_suite("chat", 20, seed=9)
    for i, item in enumerate(items):
        item["metadata"]["group"] = f"dialogue-{i // 2}"
    suite = tmp_path / "chat.jsonl"
    write_jsonl(suite, items)
    contract = yaml.safe_load(specs["contract"].read_text())  # only chat needs a suite: only chat is trained
    contract["heldout"] = [{"specialist": "chat", "path": suite.name, "sha256": sha(suite)}]
    specs["contract"].write_text(yaml.safe_dump(contract))
    init_lineage(contract_path=specs["contract"], harness_path=HARNESS, model_path=specs["model"])
    config = AdvanceConfig(seed=1)
    gen_id = begin_candidate(config=config, owner="test")  # the champion's adapters: the same pair
    with session_scope(get_engine()) as s:
        gen = load_generation(s, gen_id)
        for step in ("collect", "score", "curate", "train", "codesign"):
            mark_step(s, gen, step, {"skipped": "the candidate is the champion's pair"})
    evaluation = evaluate_step(generation_id=gen_id, config=config)
    chat = evaluation["items"]["chat"]
    assert len(chat["parent"]) == len(chat["candidate"]) == 20
    assert chat["groups"] == [f"dialogue-{i // 2}" for i in range(20)]


# ------------------------------------------------------------------------------------------------ ungated
def demo_without_genui_suite(tmp_path: Path, base: Path, *, ungated: bool) -> dict[str, Path]:
    specs = write_specs(tmp_path, base)
    contract = yaml.safe_load(specs["contract"].read_text())
    contract["heldout"] = [s for s in contract["heldout"] if s["specialist"] != "genui"]
    if ungated:
        contract["specialists"]["genui"]["ungated"] = True
    specs["contract"].write_text(yaml.safe_dump(contract))
    return specs


def test_init_and_lint_refuse_a_specialist_without_a_suite_unless_it_says_ungated(tmp_path, capsys):
    from pipeline.loop.founding import init_lineage

    specs = demo_without_genui_suite(tmp_path, tmp_path / "no-model-needed", ungated=False)
    with pytest.raises(RatchetError) as refused:
        init_lineage(contract_path=specs["contract"], harness_path=HARNESS, model_path=specs["model"])
    assert str(refused.value) == f"{specs['contract']}: {UNGATED_GENUI}"
    assert run_cli(["contract", "lint", str(specs["contract"])]) == 1
    assert capsys.readouterr().out.splitlines() == [f"{specs['contract']}: {UNGATED_GENUI}"]

    # a lineage that does not train genui needs no suite for it
    model = yaml.safe_load(specs["model"].read_text())
    del model["specialists"]["genui"]
    specs["model"].write_text(yaml.safe_dump(model))
    with pytest.raises(RatchetError, match="is not a Hugging Face model directory"):  # past the check
        init_lineage(contract_path=specs["contract"], harness_path=HARNESS, model_path=specs["model"])

    (tmp_path / "said").mkdir()
    said = demo_without_genui_suite(tmp_path / "said", tmp_path / "no-model-needed", ungated=True)
    assert run_cli(["contract", "lint", str(said["contract"])]) == 0
    assert capsys.readouterr().out.startswith(f"ok {said['contract']} (demo test ")


def test_advance_refuses_a_lineage_whose_contract_leaves_a_specialist_ungated_unsaid(tmp_path):
    """A lineage registered before the rule (its stored contract gives genui no suite and does not say
    ``ungated: true``) builds no candidate: genui would be trained and promoted with no gate, silently."""
    from pipeline.loop.advance import advance_once
    from pipeline.loop.candidate import AdvanceConfig
    from pipeline.registry import (
        create_generation,
        get_engine,
        list_generations,
        promote_generation,
        register_base_model,
        register_contract,
        register_harness,
        session_scope,
    )
    from pipeline.specs.contract import load_contract
    from pipeline.specs.harness import load_harness
    from pipeline.specs.modelspec import load_model_spec

    specs = demo_without_genui_suite(tmp_path, tmp_path / "base", ungated=False)
    contract, harness = load_contract(specs["contract"]), load_harness(HARNESS)
    model = load_model_spec(specs["model"])
    with session_scope(get_engine()) as s:  # what `ratchet init` registered before it checked suites
        base = register_base_model(session=s, name=model.name, path=str(tmp_path / "base"),
                                   spec=model.model_dump(mode="json"))  # fmt: skip
        hv = register_harness(session=s, name=harness.name, version=harness.version,
                              spec=harness.model_dump(mode="json"))  # fmt: skip
        cv = register_contract(session=s, name=contract.name, version=contract.version,
                               spec=contract.model_dump(mode="json"))  # fmt: skip
        gen = create_generation(session=s, lineage="main", base_model_id=base.id, harness_version_id=hv.id,
                                contract_version_id=cv.id, specialists=sorted(model.specialists))  # fmt: skip
        promote_generation(session=s, generation=gen, reason="generation 0")
    with pytest.raises(RatchetError) as refused:
        advance_once(config=AdvanceConfig(seed=1))
    lines = str(refused.value).splitlines()
    assert lines[0] == f"lineage 'main', contract demo test: {UNGATED_GENUI}"
    assert (
        lines[1].startswith("lineage 'main': no candidate is built") and "ratchet contract adopt" in lines[1]
    )
    with session_scope(get_engine()) as s:
        assert len(list_generations(session=s, lineage="main")) == 1  # no candidate was created


def test_an_ungated_specialist_is_accepted_when_said_and_shown_on_the_dashboard(small_base, tmp_path):
    from fastapi.testclient import TestClient

    from pipeline.dashboard import create_app
    from pipeline.loop.founding import init_lineage
    from pipeline.settings import get_settings

    specs = demo_without_genui_suite(tmp_path, small_base, ungated=True)
    init_lineage(contract_path=specs["contract"], harness_path=HARNESS, model_path=specs["model"])
    with TestClient(create_app(get_settings(), allowed_hosts=["testserver"])) as client:
        data = client.get("/api/generations/0").json()
        page = client.get("/generations/0")
    assert data["heldout"]["ungated"] == ["genui"]
    assert {a["specialist"]: a["ungated"] for a in data["adapters"]} == {
        "chat": False, "agent": False, "coding": False, "genui": True
    }  # fmt: skip
    assert page.status_code == 200
    assert '<p class="bad" id="ungated">Ungated: genui. No held-out suite judges it' in page.text
    assert 'genui <span class="bad" title="no held-out suite: no gate of its own">ungated</span>' in page.text
    assert page.text.count(">ungated</span>") == 1
