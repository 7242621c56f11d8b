"""Generation advancement end to end on a small tiny model: steps, resume, races, gates, commands."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from sqlalchemy import func, select

from pipeline.errors import ConflictError
from pipeline.loop.advance import advance_once, begin_candidate, release_candidate
from pipeline.loop.candidate import STEPS, AdvanceConfig, done_steps
from pipeline.registry import (
    Adapter,
    Experience,
    Generation,
    TrainingDataset,
    get_champion,
    get_engine,
    list_generations,
    session_scope,
)
from pipeline.training import git_describe

FAST = AdvanceConfig(prompts_per_specialist=24, samples_per_prompt=2, min_examples=2,
                     validation_items=6, seed=1)  # fmt: skip


def _count(model, *where):
    with session_scope(get_engine()) as s:
        return s.scalar(select(func.count()).select_from(model).where(*where))


def test_one_generation_end_to_end(lineage):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from pipeline.cli.advance import lineage_rows, make_tracker
    from pipeline.specs.loading import file_sha256

    tracker = make_tracker()
    outcome = advance_once(config=FAST, tracker=tracker)
    assert outcome["generation"] == 1 and outcome["status"] in ("promoted", "rejected")
    assert outcome["decision"].startswith(("promote:", "reject:"))
    steps = done_steps(_generation_id(1))
    assert set(steps) == set(STEPS)
    assert steps["collect"]["attempts"] == 4 * 24 * 2  # every attempt of every specialist
    assert _count(Experience, Experience.source == "simulation") == steps["collect"]["stored"] > 0
    with session_scope(get_engine()) as s:
        gen = s.scalar(select(Generation).where(Generation.number == 1))
        assert gen.lease_owner is None and gen.evaluation["comparison"]["specialists"]
        datasets = s.scalars(select(TrainingDataset).where(TrainingDataset.generation_id == gen.id)).all()
        adapters = s.scalars(select(Adapter)).all()
        trained = {a.specialist: a for a in adapters}
    assert datasets, steps["curate"]
    assert all(len(d.sha256) == 64 and d.num_rows >= FAST.min_examples for d in datasets)
    assert set(trained) == {d.specialist for d in datasets}
    for adapter in adapters:  # self-describing artifacts, sha256 in the registry, plain peft loading
        path = Path(adapter.artifact_uri)
        assert file_sha256(path / "adapter_model.safetensors") == adapter.sha256
        record = json.loads((path / "lineage.json").read_text())
        assert record["parent_generation"] == 0 and record["contract_sha256"] and record["dataset_sha256"]
        assert record["code_version"] == git_describe()  # the commit that trained it, not a package version
        assert adapter.mlflow_run_id and adapter.mlflow_model_version
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(lineage_base(lineage)), path)
    client = tracker.client
    for adapter in adapters:
        history = client.get_metric_history(adapter.mlflow_run_id, "train_loss")
        assert len(history) == adapter.metrics["steps"]
        if outcome["status"] == "promoted":
            name = f"ratchet-main-{adapter.specialist}"
            assert client.get_model_version_by_alias(name, "champion").version == adapter.mlflow_model_version
    rows = lineage_rows("main")
    assert [r["number"] for r in rows] == [0, 1]
    assert set(rows[0]["scores"]) == {"chat", "agent", "coding", "genui"} and rows[1]["overall"] is not None
    assert rows[1]["status"] == outcome["status"]
    # measured on the contract's routing suite (paraphrases the signals were not written for), both harnesses
    assert 0.5 < rows[1]["router_accuracy"] < 1.0
    with session_scope(get_engine()) as s:
        gen = s.scalar(select(Generation).where(Generation.number == 1))
        ev = gen.evaluation
    assert ev["router"]["accuracy"] == ev["parent_router"]["accuracy"]  # co-design leaves routing alone
    assert ev["attempt"] == 1 and set(ev["items"]) == {"chat", "agent", "coding", "genui"}
    assert all(len(v["parent"]) == len(v["candidate"]) == 20 for v in ev["items"].values())
    # every turn curation left out is counted per specialist and reason
    dropped = steps["curate"]["dropped"]
    assert set(dropped) <= {"chat", "agent", "coding", "genui"} and "below threshold" in dropped["chat"]


def lineage_base(specs):
    return yaml.safe_load(specs["model"].read_text())["base"]["path"]


def _generation_id(number):
    with session_scope(get_engine()) as s:
        return s.scalar(select(Generation.id).where(Generation.number == number))


def test_crash_then_resume_continues_the_same_candidate(lineage, monkeypatch):
    import pipeline.codesign as successor

    real = successor.codesign_step
    calls = {"n": 0}

    def crashing(**kwargs):
        calls["n"] += 1
        raise RuntimeError("simulated crash during co-design")

    monkeypatch.setattr(successor, "codesign_step", crashing)
    with pytest.raises(RuntimeError, match="simulated crash"):
        advance_once(config=FAST)
    first = done_steps(_generation_id(1))
    assert set(first) == {"discover", "collect", "score", "curate", "train"}
    experience_before = _count(Experience)
    monkeypatch.setattr(successor, "codesign_step", real)
    outcome = advance_once(config=FAST)
    assert outcome["generation"] == 1  # the same candidate, not a new number
    steps = done_steps(_generation_id(1))
    assert steps["collect"] == first["collect"] and steps["train"] == first["train"]
    assert _count(Experience) == experience_before  # collection was not redone
    with session_scope(get_engine()) as s:
        assert [g.number for g in list_generations(session=s)] == [0, 1]


def test_racing_advances_build_one_candidate(lineage):
    first = begin_candidate(config=FAST, owner="host-a:1")
    with pytest.raises(ConflictError, match="is being advanced by host-a:1"):
        begin_candidate(config=FAST, owner="host-b:2")
    release_candidate(generation_id=first, owner="host-a:1")
    assert begin_candidate(config=FAST, owner="host-b:2") == first  # free again: the same candidate
    with session_scope(get_engine()) as s:
        assert s.scalar(select(func.count()).select_from(Generation)) == 2


def test_degraded_candidate_is_never_promoted(lineage, tmp_path):
    """A candidate whose adapters were wrecked on purpose is rejected by the gates, with the reason."""
    import torch
    from safetensors.torch import load_file, save_file

    from pipeline.loop.candidate import load_generation, mark_step
    from pipeline.loop.evaluation import evaluate_step
    from pipeline.loop.promotion import decide_step
    from pipeline.registry import create_adapter, set_generation_adapter
    from pipeline.settings import get_settings
    from pipeline.specs.loading import file_sha256

    advance_once(config=FAST)  # generation 1, with trained adapters to wreck
    with session_scope(get_engine()) as s:
        source = {a.specialist: a for a in s.scalars(select(Adapter))}
    gen_id = begin_candidate(config=FAST, owner="test")
    with session_scope(get_engine()) as s:
        gen = load_generation(s, gen_id)
        for specialist, adapter in source.items():
            # adapters are registered from the artifact store only
            bad_dir = get_settings().artifacts_dir / f"wrecked-{specialist}"
            bad_dir.mkdir(parents=True)
            weights = load_file(str(Path(adapter.artifact_uri) / "adapter_model.safetensors"))
            torch.manual_seed(0)
            save_file(
                {k: v + torch.randn_like(v) * 2.0 for k, v in weights.items()},
                str(bad_dir / "adapter_model.safetensors"),
            )
            (bad_dir / "adapter_config.json").write_text(
                (Path(adapter.artifact_uri) / "adapter_config.json").read_text()
            )
            row = create_adapter(
                session=s,
                specialist=specialist,
                base_model_id=gen.base_model_id,
                rank=4,
                alpha=8,
                target_modules=adapter.target_modules,
                artifact_uri=str(bad_dir),
                sha256=file_sha256(bad_dir / "adapter_model.safetensors"),
            )
            set_generation_adapter(session=s, generation=gen, specialist=specialist, adapter_id=row.id)
        for step in ("collect", "score", "curate", "train", "codesign"):
            mark_step(s, gen, step, {"skipped": "test builds the candidate by hand"})
    evaluation = evaluate_step(generation_id=gen_id, config=FAST)
    assert evaluation["comparison"]["delta"] < 0
    outcome = decide_step(generation_id=gen_id, config=FAST)
    assert outcome["status"] == "rejected"
    assert "regressed" in outcome["decision"] and "not significant" in outcome["decision"]
    with session_scope(get_engine()) as s:
        champion = get_champion(session=s)
        assert champion.number != outcome["generation"]


def test_promote_and_rollback_commands(lineage, capsys):
    from pipeline.cli import main
    from pipeline.cli.advance import make_tracker

    advance_once(config=FAST, tracker=make_tracker())
    with pytest.raises(SystemExit) as exc:
        main(["promote", "7"])
    assert exc.value.code == 1 and "no generation 7" in capsys.readouterr().err
    with session_scope(get_engine()) as s:
        champion = get_champion(session=s).number
    if champion == 0:
        main(["promote", "1", "--reason", "test"])
        assert "generation 1 is now the champion" in capsys.readouterr().out
    else:
        with pytest.raises(SystemExit):
            main(["promote", "1"])
        assert "already the champion" in capsys.readouterr().err
    client = make_tracker().client
    assert client.get_model_version_by_alias(
        "ratchet-main-chat", "champion"
    ).version  # moved with the champion
    main(["rollback"])
    assert "generation 0 is the champion" in capsys.readouterr().out
    from mlflow.exceptions import MlflowException

    with pytest.raises(MlflowException):  # generation 0 has no adapters: the alias is gone
        client.get_model_version_by_alias("ratchet-main-chat", "champion")
    with pytest.raises(SystemExit):
        main(["rollback"])
    assert "nothing to roll back to" in capsys.readouterr().err
    main(["lineage", "--json"])
    rows = json.loads(capsys.readouterr().out)["generations"]  # pipeline.registry.summaries.LineageSummary
    assert {"number", "parent", "status", "scores", "overall", "decision"} <= set(rows[0])


def test_no_collect_learns_from_ingested_experience_only(lineage):
    from dataclasses import replace

    outcome = advance_once(config=replace(FAST, collect=False))
    steps = done_steps(_generation_id(1))
    assert steps["collect"]["attempts"] == 0 and "off" in steps["collect"]["skipped"]
    assert _count(Experience, Experience.source == "simulation") == 0
    with session_scope(get_engine()) as s:
        datasets = s.scalars(select(TrainingDataset)).all()
    assert datasets and outcome["status"] in ("promoted", "rejected")  # the ingested corrections were learned
    assert (
        sum(d["rows"] for d in steps["curate"]["datasets"].values()) == sum(d.num_rows for d in datasets) > 0
    )


def test_a_file_suite_is_stored_at_registration_and_needs_no_file_afterwards(specs, tmp_path):
    """A held-out suite given as {path, sha256}: registration keeps its bytes in the registry; advance
    curates and evaluates on it after the file is gone."""
    from pipeline.environment import heldout_suite
    from pipeline.loop.founding import init_lineage
    from pipeline.registry import StoredFile
    from pipeline.specs.loading import file_sha256

    suite = tmp_path / "suites" / "chat.jsonl"
    suite.parent.mkdir()
    items = heldout_suite("chat", 15, seed=7)
    suite.write_text("".join(json.dumps(item) + "\n" for item in items))
    contract = yaml.safe_load(specs["contract"].read_text())
    contract["heldout"] = [s for s in contract["heldout"] if s["specialist"] != "chat"]
    contract["heldout"].append(
        {"specialist": "chat", "path": "suites/chat.jsonl", "sha256": file_sha256(suite)}
    )
    path = tmp_path / "file-suite.yaml"
    path.write_text(yaml.safe_dump(contract))
    root = Path(__file__).resolve().parent.parent
    init_lineage(contract_path=path, harness_path=root / "harnesses" / "demo.yaml", model_path=specs["model"])
    assert _count(StoredFile, StoredFile.sha256 == file_sha256(suite)) == 1
    suite.unlink()
    # the attack: the file's held-out items arrive as deployment traces with the right, verifiable answer
    from pipeline.environment import reference_answer
    from pipeline.experience.ingest import ingest_file

    leaked = tmp_path / "leak.jsonl"
    with open(leaked, "w") as fh:
        for item in items:
            answer = {"role": "assistant", "content": reference_answer(item)}
            metadata = {**item["metadata"], "split": "train"}
            fh.write(
                json.dumps({**item, "messages": [*item["messages"], answer], "metadata": metadata}) + "\n"
            )
    ingested = ingest_file(leaked, session_factory=lambda: session_scope(get_engine()), source="deployment")
    assert ingested.stored == 15
    outcome = advance_once(config=FAST)
    with session_scope(get_engine()) as s:
        ev = s.scalar(select(Generation).where(Generation.number == 1)).evaluation
        dataset_paths = [d.path for d in s.scalars(select(TrainingDataset))]
    assert outcome["status"] in ("promoted", "rejected")
    assert len(ev["items"]["chat"]["candidate"]) == 15 and len(ev["items"]["agent"]["candidate"]) == 20
    # ... and not one of them was learned: the exclusion predicate read the suite from the registry too
    from datasets import load_from_disk

    prompts = {item["messages"][0]["content"] for item in items}
    rows = [r for path in dataset_paths for r in load_from_disk(path).to_list()]
    assert not [m for r in rows for m in r["messages"] if m["content"] in prompts]
    assert done_steps(_generation_id(1))["curate"]["dropped"]["chat"].get("held-out", 0) >= 15


def test_each_method_trains_evaluates_and_is_gated_end_to_end(methods_lineage):
    """chat on dpo (pairs from corrections and ranked attempts), agent on multi-turn grpo, genui on grpo,
    coding on sft: one generation builds all four adapters, each says how it was built, and the candidate goes
    through the same evaluation and gates."""
    from pipeline.cli.advance import lineage_rows, make_tracker

    tracker = make_tracker()
    outcome = advance_once(config=FAST, tracker=tracker)
    assert outcome["decision"].startswith(("promote:", "reject:"))
    steps = done_steps(_generation_id(1))
    curated = steps["curate"]["datasets"]
    assert curated["chat"]["method"] == "dpo" and curated["chat"]["rows"] >= 12  # the 12 corrections at least
    assert curated["agent"] == {"method": "grpo", "rows": 0, "skipped": "practises online (grpo)"}
    with session_scope(get_engine()) as s:
        adapters = {a.specialist: a for a in s.scalars(select(Adapter))}
        ds = s.scalar(select(TrainingDataset).where(TrainingDataset.specialist == "chat"))
        pairs = datasets_rows(ds.path)
    assert {s: a.method for s, a in adapters.items()} == {
        "chat": "dpo", "agent": "grpo", "genui": "grpo", "coding": "sft"
    }  # fmt: skip
    assert all(len(r["rejected"]) == len(r["messages"]) for r in pairs)  # same context, two replies
    metrics = {"dpo": "reward_margin", "grpo": "reward", "sft": "train_loss"}
    for specialist, adapter in adapters.items():
        record = json.loads((Path(adapter.artifact_uri) / "lineage.json").read_text())
        assert record["method"] == adapter.method and record["specialist"] == specialist
        run = tracker.client.get_run(adapter.mlflow_run_id)
        assert tracker.client.get_metric_history(run.info.run_id, metrics[adapter.method]), specialist
    grpo = tracker.client.get_metric_history(adapters["agent"].mlflow_run_id, "assistant_turns")
    assert len(grpo) == 3 and all(1 <= p.value <= 2 for p in grpo)  # multi-turn: at most max_turns replies
    row = lineage_rows("main")[1]
    assert row["methods"] == {"chat": "dpo", "agent": "grpo", "genui": "grpo", "coding": "sft"}
    ev = row["scores"]
    assert set(ev) == {"chat", "agent", "coding", "genui"} and row["status"] == outcome["status"]


def datasets_rows(path):
    from datasets import load_from_disk

    return load_from_disk(path).to_list()
