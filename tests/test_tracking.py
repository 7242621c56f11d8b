"""The MLflow tracker against a real local SQLite MLflow store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pipeline.loop.candidate import AdvanceConfig
from pipeline.registry.tracking import MLflowTracker, Tracker


@pytest.fixture
def tracker(tmp_path):
    return MLflowTracker(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_root=tmp_path / "art")


def test_runs_params_metrics_artifacts_and_registry(tracker, tmp_path):
    assert isinstance(tracker, Tracker)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    with tracker.start_run("gen-1", {"kind": "lora"}) as run_id:
        tracker.log_params({"rank": 16, "lr": 5e-4})
        for step, loss in enumerate([3.0, 2.5, 2.0], start=1):
            tracker.log_metric("train_loss", loss, step=step)
        tracker.log_artifact(adapter, artifact_path="adapter")
    run = tracker.client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"rank": "16", "lr": "0.0005"} and run.data.tags["kind"] == "lora"
    history = tracker.client.get_metric_history(run_id, "train_loss")
    assert [(m.step, m.value) for m in history] == [(1, 3.0), (2, 2.5), (3, 2.0)]
    assert {f.path for f in tracker.client.list_artifacts(run_id, "adapter")} == {
        "adapter/adapter_config.json", "adapter/adapter_model.safetensors"}  # fmt: skip
    assert run.info.artifact_uri.startswith((tmp_path / "art").resolve().as_uri())

    v1 = tracker.register_adapter("chat", run_id, "adapter")
    with tracker.start_run("gen-2", {"kind": "lora"}) as run_2:
        tracker.log_artifact(adapter, artifact_path="adapter")
    v2 = tracker.register_adapter("chat", run_2, "adapter")
    # a training step that failed after registering and runs again gets the same version, not a second one
    again = tracker.register_adapter("chat", run_id, "adapter")
    assert (v1, v2, again) == ("1", "2", "1")
    tracker.set_alias("chat", "champion", v1)
    assert tracker.alias_version("chat", "champion") == "1"
    tracker.set_alias("chat", "champion", v2)
    assert tracker.alias_version("chat", "champion") == "2"


def test_failed_run_is_marked_failed_and_reopening_the_store_works(tracker, tmp_path):
    with pytest.raises(RuntimeError), tracker.start_run("boom") as run_id:
        raise RuntimeError("bug")
    assert tracker.client.get_run(run_id).info.status == "FAILED"
    again = MLflowTracker(tracking_uri=tracker.tracking_uri, artifact_root=tmp_path / "art")
    assert again.experiment_id == tracker.experiment_id
    with pytest.raises(RuntimeError, match="no active run"):
        again.log_metric("x", 1.0)


# ---- a decided generation, as a user finds it in MLflow --------------------------------------------------------
# generation 1 of the lineage fixture, learning from its ingested corrections (no collection: cheap)
CONFIG = AdvanceConfig(prompts_per_specialist=24, samples_per_prompt=2, min_examples=2, validation_items=6,
                       seed=1, collect=False)  # fmt: skip
SCORES = ("heldout/candidate/overall", "heldout/champion/overall")


def _decided_generation() -> tuple[dict, MLflowTracker, dict, list]:
    """Advance generation 1 with MLflow; its outcome, the tracker, its evaluation and its trained adapters."""
    from sqlalchemy import select

    from pipeline.loop.advance import advance_once
    from pipeline.registry import Generation, get_engine, session_scope

    tracker = MLflowTracker.from_settings()
    outcome = advance_once(config=CONFIG, tracker=tracker)
    with session_scope(get_engine()) as s:
        gen = s.scalar(select(Generation).where(Generation.number == 1))
        adapters = [slot.adapter for slot in gen.adapters if slot.adapter and slot.adapter.mlflow_run_id]
        evaluation = dict(gen.evaluation)
        s.expunge_all()
    assert adapters, outcome
    return outcome, tracker, evaluation, adapters


def _training_datasets() -> dict[str, str]:
    from sqlalchemy import select

    from pipeline.registry import TrainingDataset, get_engine, session_scope

    with session_scope(get_engine()) as s:
        return {d.specialist: d.sha256 for d in s.scalars(select(TrainingDataset))}


def test_a_decided_generation_shows_its_scores_decision_and_lineage_in_mlflow(lineage, tmp_path):
    from huggingface_hub import ModelCard

    outcome, tracker, ev, adapters = _decided_generation()
    client, decision = tracker.client, outcome["status"]
    generation = client.get_run(tracker.generation_run("main", 1)).data
    assert generation.tags["decision"] == decision and generation.tags["status"] == decision
    assert generation.metrics["heldout/candidate/overall"] == ev["overall"]
    assert generation.metrics["heldout/champion/overall"] == ev["parent_overall"]
    for s in ("chat", "agent", "coding", "genui"):
        assert generation.metrics[f"heldout/candidate/{s}"] == ev["scores"][s]
        assert generation.metrics[f"heldout/champion/{s}"] == ev["parent_scores"][s]
    assert ev["retention"] and {f"retention/{side}/{name}" for side in ("candidate", "champion")
                                for name in [*ev["retention"], "overall"]} <= set(generation.metrics)  # fmt: skip
    datasets = _training_datasets()
    for adapter in adapters:
        s = adapter.specialist
        identity = {"lineage": "main", "generation": "1", "specialist": s, "method": "sft"}
        run = client.get_run(adapter.mlflow_run_id)
        assert identity.items() <= run.data.tags.items()
        assert run.data.tags["decision"] == decision and run.data.tags["status"] == decision
        assert run.data.metrics[f"heldout/candidate/{s}"] == ev["scores"][s]
        assert run.data.metrics[f"heldout/champion/{s}"] == ev["parent_scores"][s]
        assert set(SCORES) <= set(run.data.metrics)
        version = client.get_model_version(f"ratchet-main-{s}", adapter.mlflow_model_version)
        assert identity.items() <= version.tags.items()
        assert version.tags["decision"] == decision and version.tags["status"] == decision
        assert version.description.startswith(f"main generation 1, {s}: {decision.upper()}")
        # one dataset hash: the registry's, the adapter row's, the run's parameter and lineage.json's
        record = json.loads((Path(adapter.artifact_uri) / "lineage.json").read_text())
        assert datasets[s] == adapter.dataset_sha256 == record["dataset_sha256"]
        assert run.data.params["dataset_sha256"] == datasets[s]
        # the model card, rewritten with the scores and the decision, locally and in the version's source
        card = ModelCard.load(Path(adapter.artifact_uri) / "README.md")
        assert card.data.base_model == record["base_model"] and card.data.library_name == "peft"
        assert f"**Decision: {decision}**" in card.text
        assert f"| held-out: {s} | {ev['parent_scores'][s]:.4f} | {ev['scores'][s]:.4f} |" in card.text
        uploaded = client.download_artifacts(adapter.mlflow_run_id, "adapter/README.md", str(tmp_path / s))
        assert Path(uploaded).read_text() == (Path(adapter.artifact_uri) / "README.md").read_text()


def test_status_follows_the_registry_and_the_decision_stays(lineage):
    """Published again after the champion moved, a generation's runs and versions keep the decision the gates
    made and show the registry's status now; the parent's generation run shows it was retired."""
    from conftest import run_cli

    from pipeline.loop.publication import publish_decision

    outcome, tracker, _, adapters = _decided_generation()
    if outcome["status"] == "rejected":  # (seed 1 is rejected) promoted by hand, as an operator may
        assert run_cli(["promote", "1", "--reason", "checked by hand"]) == 0
    publish_decision(lineage="main", generation_id=_generation_id(1), tracker=tracker)
    for adapter in adapters:
        version = tracker.client.get_model_version(
            f"ratchet-main-{adapter.specialist}", adapter.mlflow_model_version
        )
        assert version.tags["decision"] == outcome["status"] and version.tags["status"] == "promoted"
    parent = tracker.client.get_run(tracker.generation_run("main", 0)).data
    assert parent.tags["status"] == "retired"


def _generation_id(number: int) -> int:
    from sqlalchemy import select

    from pipeline.registry import Generation, get_engine, session_scope

    with session_scope(get_engine()) as s:
        return s.scalar(select(Generation.id).where(Generation.number == number))


def test_a_rejected_version_says_so_in_mlflow(small_base, tmp_path):
    from conftest import init_with_corrections, write_specs

    specs = write_specs(tmp_path, small_base)
    contract = yaml.safe_load(specs["contract"].read_text())
    contract["promotion"]["min_improvement"] = 1.0  # no candidate can gain more than the whole scale
    specs["contract"].write_text(yaml.safe_dump(contract))
    init_with_corrections(specs, tmp_path)
    outcome, tracker, _, adapters = _decided_generation()
    assert outcome["status"] == "rejected"
    for adapter in adapters:
        name = f"ratchet-main-{adapter.specialist}"
        version = tracker.client.get_model_version(name, adapter.mlflow_model_version)
        assert version.tags["decision"] == "rejected" and version.tags["status"] == "rejected"
        assert "REJECTED: it was not promoted" in version.description
        assert "the improvement is not significant" in version.description
        assert tracker.client.get_run(adapter.mlflow_run_id).data.tags["decision"] == "rejected"
    # the champion is still generation 0: no version of generation 1 has the alias
    assert not tracker.client.search_model_versions("tags.decision = 'promoted'")
