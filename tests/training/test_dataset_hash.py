"""One dataset hash: curation records the hash of the dataset as stored, which is what its training job
computes from the dataset it loads (Arrow gives every message every field: ``tool_calls: None``)."""

from __future__ import annotations

import json

from datasets import load_from_disk

from pipeline.loop.curation import save_dataset
from pipeline.training import dataset_sha256

CALL = {"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}


def _example(i: int, *, rejected: bool = False) -> dict:
    messages = [
        {"role": "user", "content": f"what is {i} + 2?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},  # only this message has tool calls
        {"role": "tool", "content": str(i + 2)},
        {"role": "assistant", "content": f"{i + 2}"},
    ]
    example = {"messages": messages, "score": 1.0, "experience_id": i}
    if rejected:
        example |= {
            "rejected": [messages[0], {"role": "assistant", "content": "no idea"}],
            "rejected_score": 0.0,
            "rejected_experience_id": 100 + i,
        }
    return example


def test_curation_records_the_hash_its_training_job_computes(tmp_path):
    digest, rows = save_dataset([_example(i) for i in range(3)], tmp_path / "sft")
    loaded = load_from_disk(str(tmp_path / "sft")).to_list()
    assert loaded[0]["messages"][0]["tool_calls"] is None  # Arrow filled it in: what training reads
    # train_lora hashes the rows it loaded this way (and logs it to MLflow and lineage.json)
    assert rows == 3 and digest == dataset_sha256(loaded)


def test_a_preference_set_is_hashed_as_stored_too(tmp_path):
    from pipeline.training.artifacts import stored_dataset_sha256

    digest, rows = save_dataset([_example(i, rejected=True) for i in range(3)], tmp_path / "dpo")
    table = load_from_disk(str(tmp_path / "dpo"))
    assert rows == 3 and digest == stored_dataset_sha256(table) == stored_dataset_sha256(tmp_path / "dpo")
    # both conversations count: the same chosen answers with other rejected ones are another dataset
    other = [_example(i, rejected=True) | {"rejected": [_example(i)["messages"][0]]} for i in range(3)]
    assert save_dataset(other, tmp_path / "dpo-2")[0] != digest


def test_the_adapter_logs_the_hash_the_registry_records(small_base, tmp_path):
    """The registry keeps ``save_dataset``'s hash; the job trained on that dataset logs the same one with
    its adapter: MLflow parameter and ``lineage.json``."""
    from pipeline.registry.tracking import MLflowTracker
    from pipeline.training import TrainConfig, train_lora

    digest, _ = save_dataset([_example(i) for i in range(4)], tmp_path / "sft")
    tracker = MLflowTracker(
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_root=tmp_path / "art"
    )
    config = TrainConfig(rank=2, alpha=4, max_steps=2, batch_size=2, lr=1e-3, warmup_steps=1)
    result = train_lora(base_model_dir=small_base, dataset_dir=tmp_path / "sft", output_dir=tmp_path / "job",
                        config=config, lineage={"dataset_sha256": digest}, tracker=tracker)  # fmt: skip
    record = json.loads((result.adapter_dir / "lineage.json").read_text())
    assert record["dataset_sha256"] == digest
    assert tracker.client.get_run(result.run_id).data.params["dataset_sha256"] == digest
