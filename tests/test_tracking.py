"""The MLflow tracker against a real local SQLite MLflow store."""

from __future__ import annotations

import pytest

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
