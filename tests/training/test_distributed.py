"""Training across processes, through the real launch: ``torchrun.launch`` runs the job under
``torchrun`` (gloo on the CPU, 2 processes) and gives the same loss curve and adapter as one process on the
same data, for sft and dpo; each process ran part of every step, rank 0 alone records the MLflow run; an
interrupted 2-process job resumes to the same adapter; a process's error comes back as one line. The train
step launches sft and dpo this way when the spec asks for processes, and prefect.yaml's Kubernetes pool
template gives a pod its GPUs. The model is a small random-weight Qwen3 (``tests/realmodel.py``).

Tolerance: 2 processes add the same per-micro-batch gradients in another order (one all-reduce of two
partial sums instead of one running sum), so equality is to float32 rounding: relative 1e-4 on the loss
curve and 1e-4 relative / 1e-6 absolute on every adapter tensor after the steps run (measured: the curves
equal to 5 decimals, the adapters within 4.8e-6 absolute). LoRA dropout is 0: each process draws its own
dropout masks, so with dropout the two runs are equally valid but not equal.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest

from pipeline.errors import RatchetError
from pipeline.training import TrainConfig, train_lora, write_dataset
from pipeline.training.distributed import World, split
from pipeline.training.torchrun import launch

# micro_batch_tokens small enough that a step's batch is several micro-batches (each process gets some)
CONFIG = TrainConfig(rank=4, alpha=8, dropout=0.0, max_steps=4, batch_size=8, checkpoint_every=2, lr=1e-2,
                     warmup_steps=1, micro_batch_tokens=120)  # fmt: skip


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from realmodel import build_real_model

    return build_real_model(tmp_path_factory.mktemp("qwen") / "base", sharpness=1.0)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "ds"
    words = ["café", "déjà vu", "fox", "lazy dog", "Köln", "señor", "½ €", "tabs"]
    rows = [
        {"messages": [{"role": "user", "content": f"say {words[i % 8]} {i}"},
                      {"role": "assistant", "content": " ".join(words[: 1 + i % 8]) + f" {i}"}]}
        for i in range(24)
    ]  # fmt: skip
    write_dataset(rows, path)
    return path


def _tensors(adapter_dir):
    from safetensors.torch import load_file

    return load_file(str(adapter_dir / "adapter_model.safetensors"))


def _assert_same(one, two):
    import torch

    assert [s for s, _ in two.loss_curve] == [s for s, _ in one.loss_curve]
    for (_, a), (_, b) in zip(one.loss_curve, two.loss_curve, strict=True):
        assert b == pytest.approx(a, rel=1e-4)
    first, second = _tensors(one.adapter_dir), _tensors(two.adapter_dir)
    assert first.keys() == second.keys()
    for name, tensor in first.items():
        torch.testing.assert_close(second[name], tensor, rtol=1e-4, atol=1e-6, msg=name)


def _ran_a_part_each(caplog) -> bool:
    """Whether each of the 2 processes ran some of the micro-batches (not each the whole batch)."""
    shares = next(r.args[2] for r in caplog.records if "micro-batches run by each" in r.getMessage())
    return len(shares) == 2 and min(shares) > 0


def test_two_processes_train_the_same_adapter_as_one(base, data, tmp_path, caplog):
    """The loss curve and adapter of one process, from 2; rank 0's progress as it goes, and rank 0 alone
    recording the run in MLflow (one value per step, not one per process)."""
    from pipeline.registry.tracking import MLflowTracker

    one = train_lora(base_model_dir=base, dataset_dir=data, output_dir=tmp_path / "one", config=CONFIG)
    seen, tracker = [], MLflowTracker.from_settings()
    with caplog.at_level(logging.INFO, logger="pipeline.training.torchrun"):
        two = launch(method="sft", processes=2, base_model_dir=base, dataset_dir=data,
                     output_dir=tmp_path / "two", config=CONFIG, tracker=tracker,
                     progress=lambda step, total, loss: seen.append((step, total)))  # fmt: skip
    assert two.completed and two.steps == CONFIG.max_steps and two.adapter_sha256
    _assert_same(one, two)
    assert seen == [(s, CONFIG.max_steps) for s in range(1, CONFIG.max_steps + 1)]  # rank 0's progress, live
    assert _ran_a_part_each(caplog)
    history = tracker.client.get_metric_history(two.run_id, "train_loss")
    assert sorted((m.step, round(m.value, 5)) for m in history) == list(two.loss_curve)
    assert tracker.client.get_run(two.run_id).info.status == "FINISHED"


def test_an_interrupted_two_process_job_resumes_to_the_same_adapter(base, data, tmp_path):
    whole = train_lora(base_model_dir=base, dataset_dir=data, output_dir=tmp_path / "whole", config=CONFIG)
    common = {"method": "sft", "processes": 2, "base_model_dir": base, "dataset_dir": data,
              "output_dir": tmp_path / "cut", "config": CONFIG}  # fmt: skip
    first = launch(**common, stop_after_steps=2)
    assert not first.completed and first.steps == 2
    second = launch(**common)
    assert second.completed and second.resumed_from_step == 2
    assert second.loss_curve == tuple(p for p in second.loss_curve if p[0] > 2)
    _assert_same(dataclasses.replace(whole, loss_curve=whole.loss_curve[2:]), second)


def test_dpo_across_two_processes_trains_the_same_adapter_as_one(base, tmp_path, caplog):
    from pipeline.loop.curation import save_dataset
    from pipeline.specs.modelspec import DpoSettings, LoraConfig
    from pipeline.training.dpo import train_dpo

    rows = [
        {"messages": [{"role": "user", "content": f"pick {i}"}, {"role": "assistant", "content": f"café {i}"}],
         "rejected": [{"role": "user", "content": f"pick {i}"}, {"role": "assistant", "content": f"fox {i + 1}"}],
         "score": 1.0, "rejected_score": 0.0, "experience_id": i, "rejected_experience_id": 100 + i}
        for i in range(16)
    ]  # fmt: skip
    save_dataset(rows, tmp_path / "pairs")
    job = {"base_model_dir": base, "dataset_dir": tmp_path / "pairs", "lora": LoraConfig(rank=4, alpha=8, dropout=0.0),
           "settings": DpoSettings(beta=0.5, lr=1e-2, batch_size=8, max_steps=3, sft_weight=0.5),
           "micro_batch_tokens": 60}  # fmt: skip
    one = train_dpo(**job, output_dir=tmp_path / "one")
    with caplog.at_level(logging.INFO, logger="pipeline.training.torchrun"):
        two = launch(method="dpo", processes=2, **job, output_dir=tmp_path / "two")
    assert two.completed and two.steps == 3 and _ran_a_part_each(caplog)
    _assert_same(one, two)


def test_a_process_error_comes_back_as_one_line(base, tmp_path):
    with pytest.raises(RatchetError, match="not a dataset saved with save_to_disk"):
        launch(method="sft", processes=2, base_model_dir=base, dataset_dir=tmp_path,
               output_dir=tmp_path / "o", config=CONFIG)  # fmt: skip


def test_every_process_gets_micro_batches_when_the_budget_would_give_one():
    lengths = [30, 50, 20, 40]
    assert split(lengths, None, World()) == [[0, 1, 2, 3]]
    groups = split(lengths, None, World(rank=0, size=2))
    assert len(groups) >= 2 and sorted(i for g in groups for i in g) == [0, 1, 2, 3]
    assert split(lengths, 60, World(rank=0, size=2)) == split(lengths, 60, World())


def test_the_train_step_launches_sft_and_dpo_across_the_specs_processes(caplog):
    from pipeline.specs.modelspec import ModelSpec
    from pipeline.training.dpo import train_dpo
    from pipeline.training.grpo import train_grpo
    from pipeline.training.step import job_for

    def spec(processes):
        training = {"processes": processes, "micro_batch_tokens": 512}
        return ModelSpec.model_validate({"name": "m", "base": {"path": "/models/x"}, "quantization": "nf4",
                                         "specialists": {"chat": {"training": training}}})  # fmt: skip

    dataset = ("/data", "0" * 64, 3)
    for method, fn in (("sft", train_lora), ("dpo", train_dpo)):
        alone, kwargs = job_for(method, spec(1), "chat", seed=5, fmt="openai", dataset=dataset)
        assert alone is fn and "processes" not in kwargs and kwargs["quantization"] == "nf4"
        across, kwargs2 = job_for(method, spec(2), "chat", seed=5, fmt="openai", dataset=dataset)
        assert across is launch and kwargs2.pop("method") == method and kwargs2.pop("processes") == 2
        assert kwargs2.keys() == kwargs.keys()
    _, kwargs = job_for("dpo", spec(1), "chat", seed=5, fmt="openai", dataset=dataset)
    assert kwargs["micro_batch_tokens"] == 512
    with caplog.at_level(logging.WARNING):
        fn, _ = job_for("grpo", spec(2), "chat", seed=5, fmt="openai", dataset=None)
    assert fn is train_grpo and "grpo trains in one process" in caplog.text


def test_the_kubernetes_gpu_pool_template_gives_the_pod_its_gpus():
    """prefect.yaml's base job template for a Kubernetes ratchet-gpu pool passes Prefect's own check of a
    work pool (every placeholder a variable) and renders a pod with ``gpus`` GPUs and a memory /dev/shm."""
    from pathlib import Path

    import jsonschema
    import yaml
    from prefect.server.schemas.actions import WorkPoolCreate
    from prefect.utilities.templating import apply_values

    spec = yaml.safe_load((Path(__file__).resolve().parents[2] / "prefect.yaml").read_text())
    template = spec["definitions"]["kubernetes_gpu_pool"]
    WorkPoolCreate(name="ratchet-gpu", type="kubernetes", base_job_template=template)
    values = {"image": "registry.example/ratchet:gpu", "gpus": 8}
    jsonschema.validate(values, template["variables"])
    defaults = {k: v["default"] for k, v in template["variables"]["properties"].items() if "default" in v}
    job = apply_values(template["job_configuration"], {**defaults, **values})
    pod = job["job_manifest"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8 and container["image"] == values["image"]
    assert job["env"] == {"RATCHET_DEVICE": "cuda"}
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert (
        shm["emptyDir"]["medium"] == "Memory"
        and {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    )
    assert [d["name"] for d in spec["deployments"]] == [
        "advance-generation",
        "train-candidate",
        "score-experience",
    ]
