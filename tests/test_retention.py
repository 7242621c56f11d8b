"""No forgetting: retention suites gated for every candidate, KL to the base recorded and budgeted, and the
accuracy matrix with backward transfer (``pipeline.gates.retention``, ``pipeline.gates.divergence``, ``pipeline.gates.transfer``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from pipeline.gates.transfer import accuracy_matrix, generation_metrics

ROOT = Path(__file__).resolve().parent.parent
FAST = dict(prompts_per_specialist=24, samples_per_prompt=2, min_examples=2, validation_items=6, seed=1)


def _base_answers(base: Path, items: list[dict]) -> list[str]:
    """The bare base's greedy answers to ``items`` as the chat specialist (the demo harness)."""
    from pipeline.modeling.pair import PairSpec, answer_items
    from pipeline.modeling.placement import spec_placement
    from pipeline.specs.harness import load_harness

    pair = PairSpec(
        base, {"chat": None}, load_harness(ROOT / "harnesses" / "demo.yaml"), spec_placement(), base
    )
    traces = answer_items(pair, {"chat": items}, temperature=0.0)["chat"]
    return [t["messages"][-1].get("content") or "" for (t,) in traces]


def _keeps_the_base_suite(tmp: Path, base: Path) -> tuple[str, str]:
    """A retention file: held-out sums the chat specialist answers, each item's reference answer what the bare
    base answers (mostly a wrong sum: the small base rarely gets one right) -- generation 0 scores 1 on every
    item by construction, and a chat adapter trained on right sums answers many of them otherwise.
    ``(path, sha256)``."""
    from pipeline.environment.tasks import heldout_suite

    items = heldout_suite("chat", 40, seed=7)
    answers = _base_answers(base, items)
    kept = [
        {"messages": it["messages"], "metadata": {"expected": a.strip()}}
        for it, a in zip(items, answers, strict=True)
        if a.strip()
    ]
    assert len(kept) >= 20, answers
    text = "".join(json.dumps(k) + "\n" for k in kept)
    (tmp / "keep.jsonl").write_text(text)
    return "keep.jsonl", hashlib.sha256(text.encode()).hexdigest()


def test_a_candidate_that_forgets_its_retention_suite_is_rejected_with_the_reason(
    small_base, tmp_path, capsys
):
    """Through the real evaluate and decide steps: the base's own answers to held-out sums as a retention
    suite of the chat specialist (generation 0 scores 1.000); the trained candidate answers many of them
    otherwise, beyond the 0.05 tolerance, and is rejected for it, with the suite's name and numbers; its KL to
    the base is recorded, and a KL budget below it blocks too; the accuracy matrix and backward transfer are
    in ``ratchet lineage --json``."""
    from conftest import init_with_corrections, write_specs

    from pipeline.cli import main
    from pipeline.cli.advance import make_tracker
    from pipeline.loop.advance import advance_once
    from pipeline.loop.candidate import AdvanceConfig
    from pipeline.registry import Generation, get_engine, session_scope

    # chat trained hard (many passes, a high rate) on sums: it moves far from the base on sum prompts
    specs = write_specs(tmp_path, small_base, methods={"chat": {"training": {"epochs": 20, "batch_size": 4,
                                                                              "lr": 5e-3}}})  # fmt: skip
    path, sha = _keeps_the_base_suite(tmp_path, small_base)
    contract = yaml.safe_load(specs["contract"].read_text())
    contract["retention"] = [{"name": "keeps-base", "specialist": "chat", "path": path, "sha256": sha,
                              "max_regression": 0.05, "error_rate": 0.05}]  # fmt: skip
    contract["promotion"]["max_kl_to_base"] = 1e-6
    specs["contract"].write_text(yaml.safe_dump(contract))
    init_with_corrections(specs, tmp_path)

    tracker = make_tracker()
    outcome = advance_once(config=AdvanceConfig(**FAST), tracker=tracker)
    with session_scope(get_engine()) as s:
        ev = s.query(Generation).filter(Generation.number == 1).one().evaluation
    kept = ev["retention"]["keeps-base"]
    assert kept["specialist"] == kept["scored_as"] == "chat" and len(kept["sha256"]) == 64
    assert set(kept["parent"]) == {1.0}  # the base's own answers: by construction
    lost = 1.0 - sum(kept["candidate"]) / len(kept["candidate"])
    assert lost > 0.15, (kept["candidate"], ev["divergence"])  # forgotten well beyond the tolerance
    assert ev["attempts"]["retention"] == {"keeps-base": 1}
    chat = ev["divergence"]["chat"]
    assert chat["kl_to_base"] > 1e-6 and chat["tokens"] > 0 and chat["kl_to_parent"] == chat["kl_to_base"]
    assert set(ev["divergence"]) == {"chat", "agent", "coding", "genui"}

    assert outcome["status"] == "rejected"
    decision = outcome["decision"]
    assert "keeps-base" in decision and "retention" in decision
    assert f"{1 - lost:.3f}" in decision  # the candidate's mean on the suite, in numbers
    assert "KL" in decision and "max_kl_to_base" in decision

    main(["lineage", "--json"])
    rows = json.loads(capsys.readouterr().out)["generations"]
    assert rows[0]["accuracy"]["retention:keeps-base"] == 1.0
    assert rows[1]["accuracy"]["retention:keeps-base"] == pytest.approx(1 - lost, abs=1e-4)
    assert rows[1]["backward_transfer"]["retention:keeps-base"] == pytest.approx(-lost, abs=1e-4)
    assert set(rows[1]["accuracy"]) == {"heldout:agent", "heldout:chat", "heldout:coding", "heldout:genui",
                                        "retention:keeps-base"}  # fmt: skip
    assert rows[1]["divergence"]["chat"]["kl_to_base"] == chat["kl_to_base"]

    def metrics(number: int) -> dict[str, float]:  # of the generation's own MLflow run
        (run,) = tracker.client.search_runs(
            [tracker.experiment_id], f"tags.kind = 'generation' and tags.generation = '{number}'"
        )
        return run.data.metrics

    assert metrics(0)["accuracy/retention.keeps-base"] == 1.0
    logged = metrics(1)
    assert logged["accuracy/retention.keeps-base"] == pytest.approx(1 - lost, abs=1e-4)
    assert logged["backward_transfer/retention.keeps-base"] == pytest.approx(-lost, abs=1e-4)
    assert logged["kl_to_base/chat"] == chat["kl_to_base"] and "accuracy/heldout.chat" in logged


def _gen(n, parent, held, kept, held_parent=None, kept_parent=None):
    ev = {"items": {"chat": {"candidate": held, "parent": held_parent or held}},
          "retention": {"r": {"specialist": "chat", "candidate": kept, "parent": kept_parent or kept}}}  # fmt: skip
    return {"generation": n, "parent": parent, "evaluation": ev if n else {}}


def test_backward_transfer_is_measured_along_the_line_of_descent():
    """Generation 0 is measured only as its children's parent; a rejected sibling does not count for the
    champion's line; backward transfer = the score minus that of the line's first measurement."""
    gens = [
        _gen(0, None, [], []),
        _gen(1, 0, [1, 1, 0, 0], [1, 0, 0, 0], held_parent=[0, 0, 0, 1], kept_parent=[1, 1, 0, 0]),
        _gen(2, 1, [1, 1, 1, 0], [0, 0, 0, 0], held_parent=[1, 1, 0, 0], kept_parent=[1, 0, 0, 0]),
        _gen(3, 1, [1, 1, 1, 1], [1, 1, 1, 1], held_parent=[1, 1, 0, 0], kept_parent=[1, 0, 0, 0]),
    ]
    m = accuracy_matrix(gens)
    assert m["suites"] == ["heldout:chat", "retention:r"]
    assert m["rows"][0] == {"heldout:chat": 0.25, "retention:r": 0.5}  # from generation 1's parent side
    assert m["rows"][2] == {"heldout:chat": 0.75, "retention:r": 0.0}
    assert m["backward_transfer"][2] == {"heldout:chat": 0.5, "retention:r": -0.5}
    assert m["backward_transfer"][3]["retention:r"] == 0.5 and m["first"][3] == {
        "heldout:chat": 0,
        "retention:r": 0,
    }
    metrics = generation_metrics(m, 2, {"divergence": {"chat": {"kl_to_base": 0.3, "kl_to_parent": 0.1}}})
    assert metrics == {"accuracy/heldout.chat": 0.75, "accuracy/retention.r": 0.0,
                       "backward_transfer/heldout.chat": 0.5, "backward_transfer/retention.r": -0.5,
                       "kl_to_base/chat": 0.3, "kl_to_parent/chat": 0.1}  # fmt: skip


def test_the_kl_measurement_is_timed_as_model_compute(small_base):
    """The KL measurement's teacher-forced forwards are model compute (``CLOCK``'s ``forward``):
    ``bench/overhead.py`` counted them as overhead."""
    from pipeline.environment.tasks import heldout_suite
    from pipeline.gates.divergence import measure_divergence
    from pipeline.loop.clock import CLOCK
    from pipeline.modeling.pair import PairSpec
    from pipeline.modeling.placement import spec_placement
    from pipeline.specs.harness import load_harness

    harness = load_harness(ROOT / "harnesses" / "demo.yaml")
    pair = PairSpec(small_base, {"chat": None}, harness, spec_placement(), small_base)
    answers = [{**it, "messages": [*it["messages"], {"role": "assistant", "content": "47"}]}
               for it in heldout_suite("chat", 4, seed=7)]  # fmt: skip
    CLOCK.reset()
    found = measure_divergence(pair, pair, {"chat": answers})
    assert found["chat"]["tokens"] > 0 and found["chat"]["kl_to_base"] == 0.0  # the base against itself
    assert CLOCK.total("forward") > 0
