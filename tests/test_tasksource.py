"""Task sources: task files, the demo generator, third-party generators by entry point, and their splits."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from pipeline.errors import RatchetError
from pipeline.specs.tasksource import FileTasks, draw, generator_source, parse_items

ROOT = Path(__file__).resolve().parents[1]


def items(n: int) -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": f"question {i}"}], "metadata": {"expected": str(i)}}
        for i in range(n)
    ]


def test_file_tasks_split_by_prompt_hash():
    source = FileTasks(items(200), validation_share=0.1)
    train, validation = source.splits["train"], source.splits["validation"]
    assert len(train) + len(validation) == 200 and 8 <= len(validation) <= 35
    prompts = lambda rows: {r["messages"][0]["content"] for r in rows}  # noqa: E731
    assert not prompts(train) & prompts(validation)
    assert prompts(
        FileTasks(list(reversed(items(200))), validation_share=0.1).splits["validation"]
    ) == prompts(validation)  # a function of the item, not of its position
    drawn = source.items("train", 500, seed=3)
    assert len(drawn) == 500 and prompts(drawn) == prompts(train)  # every train item, in passes
    assert source.items("train", 500, seed=3) == drawn and source.items("train", 500, seed=4) != drawn
    val = source.items("validation", 1000, seed=0)
    assert len(val) == len(validation) and all(v["metadata"]["split"] == "validation" for v in val)
    with pytest.raises(ValueError, match="not 'heldout'"):
        source.items("heldout", 3, seed=0)


def test_parse_items_names_every_bad_line():
    text = "\n".join(
        [
            json.dumps(items(1)[0]),
            "{not json",
            json.dumps({"messages": []}),
            json.dumps({"messages": [{"role": "system", "content": "x"}]}),
            json.dumps(
                {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
            ),
            json.dumps({"messages": [{"role": "user", "content": "q"}], "metadata": {"split": "heldout"}}),
        ]
    )
    with pytest.raises(RatchetError) as info:
        parse_items(text, where="tasks.jsonl")
    message = str(info.value)
    assert "tasks.jsonl:2: not JSON" in message and "tasks.jsonl:3: expected an object" in message
    assert "tasks.jsonl:4: the conversation has no user message" in message
    assert "tasks.jsonl:5: a task item ends before the assistant's answer" in message
    assert "tasks.jsonl:6: marked held-out" in message
    with pytest.raises(RatchetError, match="no task items"):
        parse_items("\n", where="empty.jsonl")


def test_demo_generator_splits_are_disjoint():
    source = generator_source("demo", specialist="chat")
    train = {i["metadata"]["task_id"] for i in source.items("train", 2000, 0)}
    validation = {i["metadata"]["task_id"] for i in source.items("validation", 500, 0)}
    heldout = {i["metadata"]["task_id"] for i in source.items("heldout", 300, 0)}
    assert train and validation and heldout
    assert not train & validation and not train & heldout and not validation & heldout
    other = generator_source("demo", specialist="helper", options={"family": "agent"})
    assert other.items("train", 1, 0)[0]["metadata"]["task"] == "agent"
    with pytest.raises(RatchetError, match="tasks generator demo has no family 'helper'"):
        generator_source("demo", specialist="helper")
    with pytest.raises(RatchetError, match="unknown task generator 'nope'.*ratchet.tasks"):
        generator_source("nope", specialist="chat")
    with pytest.raises(RatchetError, match="bad options"):
        generator_source("demo", specialist="chat", options={"colour": "red"})


def test_third_party_generator_by_entry_point(tmp_path, monkeypatch):
    """A package that registers ``ratchet.tasks = mytasks`` is found and used like the built-in one."""
    pkg = tmp_path / "mytasks_pkg.py"
    pkg.write_text(
        "class Tasks:\n"
        "    def __init__(self, word):\n        self.word = word\n"
        "    def items(self, split, n, seed):\n"
        "        return [{'messages': [{'role': 'user', 'content': f'{self.word} {split} {seed} {i}'}],\n"
        "                 'metadata': {'expected': self.word}} for i in range(n)]\n"
        "def make(*, specialist, word='hello'):\n    return Tasks(word)\n"
    )
    dist = tmp_path / "mytasks_pkg-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mytasks-pkg\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[ratchet.tasks]\nmytasks = mytasks_pkg:make\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    source = generator_source("mytasks", specialist="support", options={"word": "hi"})
    got, left_out = draw(source, "heldout", 2, 7)
    assert left_out == 0 and [g["messages"][0]["content"] for g in got] == [
        "hi heldout 7 0",
        "hi heldout 7 1",
    ]
    assert all(g["metadata"]["split"] == "heldout" for g in got)  # whatever the generator says
    sys.modules.pop("mytasks_pkg", None)


def test_draw_leaves_out_what_the_heldout_predicate_matches():
    from pipeline.specs.heldout import HeldoutIndex

    index = HeldoutIndex.build([("suite #0", "question 3")], ngram=8, threshold=0.5)
    got, left_out = draw(FileTasks(items(10), validation_share=0.01), "train", 10, 0, heldout=index)
    assert left_out >= 1 and all(g["messages"][0]["content"] != "question 3" for g in got)


def test_init_refuses_task_files_with_heldout_prompts(tmp_path, monkeypatch):
    """A task item that contains a held-out prompt would be practised on: registration stops, named."""
    from pipeline.loop.founding import require_clean_tasks

    suite = tmp_path / "heldout.jsonl"
    suite.write_text(
        json.dumps({"messages": [{"role": "user", "content": "what is the capital of spain"}]}) + "\n"
    )
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": c}], "metadata": {"expected": "x"}}) + "\n"
            # the held-out prompt hides after 300 harmless items: a sampled check would miss it
            for c in [
                *(f"capital of country {i}?" for i in range(300)),
                "Tell me: WHAT is the capital of  Spain",
            ]
        )
    )
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    contract = tmp_path / "c.yaml"
    contract.write_text(
        f"""name: t
version: "1"
protocol: {{context_budget: {{max_tokens: 512}}}}
default_specialist: answer
specialists:
  answer:
    tasks: {{path: tasks.jsonl, sha256: "{digest(tasks)}"}}
    scorers: [{{kind: exact_match}}]
heldout:
  - {{specialist: answer, path: heldout.jsonl, sha256: "{digest(suite)}"}}
"""
    )
    from pipeline.specs.contract import load_contract

    with pytest.raises(
        RatchetError, match=r"specialists.answer.tasks: train item \d+ contains held-out prompt"
    ):
        require_clean_tasks(load_contract(contract), contract_path=contract)


def test_the_demo_substrate_executes_calls_and_answers_mistakes_as_tool_results():
    from pipeline.specs.tasksource import DemoTasks

    source = DemoTasks(specialist="agent")
    state = source.reset({})
    state, result = source.act(state, {"name": "add_item", "arguments": {"name": "egg", "qty": 3}})
    state, result = source.act(state, {"name": "add_item", "arguments": {"name": "egg", "qty": 2}})
    assert result == state == {"timer_minutes": None, "cart": {"egg": 5}}  # stateful: the cart adds up
    for bad in ({"name": "rm_rf", "arguments": {}}, {"name": "set_timer", "arguments": {"minutes": "x"}}):
        after, answer = source.act(state, bad)
        assert after == state and "error" in answer  # a mistake is an answer, the state unchanged


def test_init_refuses_grpo_for_a_specialist_without_a_task_source(tmp_path):
    """GRPO practises on a task source's prompts: a specialist with none is refused at registration."""
    import yaml

    from pipeline.loop.founding import init_lineage

    contract = yaml.safe_load((ROOT / "contracts" / "demo.yaml").read_text())
    contract["version"] = "no-tasks"
    del contract["specialists"]["agent"]["tasks"]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(contract))
    model = yaml.safe_load((ROOT / "models" / "tiny.yaml").read_text())
    model["specialists"]["agent"]["method"] = "grpo"
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(model))
    with pytest.raises(RatchetError, match=r"specialists \['agent'\] train with method grpo.*no task source"):
        init_lineage(contract_path=tmp_path / "c.yaml", harness_path=ROOT / "harnesses" / "demo.yaml",
                     model_path=tmp_path / "m.yaml")  # fmt: skip


# -------------------------------------------------------------------------------------- canonical forms
CAPITALS = (
    "class Capitals:\n"
    "    def __init__(self, failing=False):\n        self.failing = failing\n"
    "    def items(self, split, n, seed):\n"
    "        names = {'heldout': ['spain'], 'train': ['peru'], 'validation': ['chad']}[split]\n"
    "        return [{'messages': [{'role': 'user', 'content': f'capital of {c}?'}],\n"
    "                 'metadata': {'expected': c.upper()}} for c in names[:n]]\n"
    "    def canonical(self, messages):\n"
    "        if self.failing and any('boom' in str(m.get('content')) for m in messages):\n"
    "            raise ValueError('cannot read this')\n"
    "        aliases = {'spain': 'spain', 'espana': 'spain', 'españa': 'spain', 'peru': 'peru', 'chad': 'chad'}\n"
    "        words = [w.strip('?!.,') for m in messages for w in str(m.get('content') or '').lower().split()]\n"
    "        return {('capital', aliases[w]) for w in words if w in aliases} or None\n"
    "def make(*, specialist, failing=False):\n    return Capitals(failing)\n"
)


def _capitals_package(tmp_path, monkeypatch) -> None:
    """A third-party generator (entry point ``capitals``) whose ``canonical`` names the country asked about."""
    (tmp_path / "capitals_pkg.py").write_text(CAPITALS)
    dist = tmp_path / "capitals_pkg-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: capitals-pkg\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[ratchet.tasks]\ncapitals = capitals_pkg:make\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "capitals_pkg", raising=False)


def _contract(tmp_path, suite: str, options: str = "{}"):
    from pipeline.specs.contract import load_contract

    path = tmp_path / "c.yaml"
    path.write_text(
        f"""name: t
version: "1"
protocol: {{context_budget: {{max_tokens: 512}}}}
default_specialist: geo
specialists:
  geo:
    tasks: {{generator: capitals, options: {options}}}
    scorers: [{{kind: exact_match}}]
heldout:
  - {suite}
"""
    )
    return load_contract(path), path


def test_a_generators_canonical_form_keeps_its_held_out_problems_out_however_worded(tmp_path, monkeypatch):
    from pipeline.specs.heldout import heldout_index

    _capitals_package(tmp_path, monkeypatch)
    contract, _ = _contract(tmp_path, "{specialist: geo, generator: capitals, seed: 0, size: 5}")
    index = heldout_index(contract)
    said = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    assert index.exclusion(messages=said("capital of spain?")) == "contains held-out prompt geo #0"
    reworded = index.exclusion(messages=said("Which city governs Spain!"))
    assert reworded == "poses the problem of held-out item geo #0"  # what only the source can recognise
    in_a_reply = [*said("tell me something"), {"role": "assistant", "content": "spain's is madrid"}]
    assert index.exclusion(messages=in_a_reply) is None  # "spain's" is not a word the source knows
    assert index.exclusion(messages=[*said("x"), {"role": "tool", "content": "spain"}]) is not None
    assert index.exclusion(messages=said("Which city governs Peru")) is None  # a training problem
    got, left_out = draw(generator_source("capitals", specialist="geo"), "train", 1, 0, heldout=index)
    assert left_out == 0 and got[0]["messages"][0]["content"] == "capital of peru?"


def test_a_file_suite_is_read_in_its_specialists_generator_form(tmp_path, monkeypatch):
    from pipeline.specs.heldout import heldout_index

    _capitals_package(tmp_path, monkeypatch)
    suite = tmp_path / "suite.jsonl"
    suite.write_text(
        json.dumps({"messages": [{"role": "user", "content": "and the capital of españa?"}]}) + "\n"
    )
    digest = hashlib.sha256(suite.read_bytes()).hexdigest()
    contract, path = _contract(tmp_path, f'{{specialist: geo, path: suite.jsonl, sha256: "{digest}"}}')
    index = heldout_index(contract, contract_path=path)
    assert index.exclusion(messages=[{"role": "user", "content": "ESPANA?"}]) == (
        "poses the problem of held-out item geo #0"
    )


def test_a_canonical_form_that_fails_is_named_at_build_and_refuses_at_use(tmp_path, monkeypatch):
    from pipeline.specs.heldout import HeldoutIndex

    _capitals_package(tmp_path, monkeypatch)
    source = generator_source("capitals", specialist="geo", options={"failing": True})
    boom = [{"role": "user", "content": "boom"}]
    with pytest.raises(RatchetError, match=r"held-out item geo #0: its task source's canonical\(\) failed"):
        HeldoutIndex.build([], ngram=8, threshold=0.5, problems=[("geo #0", source.canonical, boom)])
    index = HeldoutIndex.build(
        [],
        ngram=8,
        threshold=0.5,
        problems=[("geo #0", source.canonical, source.items("heldout", 1, 0)[0]["messages"])],
    )
    assert index.exclusion(messages=[{"role": "user", "content": "peru"}]) is None
    reason = index.exclusion(messages=[{"role": "user", "content": "boom"}])  # untrusted text broke it
    assert reason == "its task source's canonical() failed on it (ValueError: cannot read this)"


def test_the_demo_source_gives_the_unordered_pair_in_any_family():
    from pipeline.specs.tasksource import DemoTasks, canonical_of

    keys = {
        frozenset(canonical_of(DemoTasks(specialist=family))(item["messages"]))
        for family in ("chat", "agent", "coding", "genui")
        for item in DemoTasks(specialist=family).items("heldout", 1, 5)
    }
    assert all(len(k) == 1 and next(iter(k))[0] == "add" for k in keys)
    assert canonical_of(DemoTasks(specialist="chat")) is canonical_of(DemoTasks(specialist="coding"))
    assert canonical_of(FileTasks(items(3), validation_share=0.1)) is None
