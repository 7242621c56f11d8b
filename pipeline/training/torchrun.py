"""Launching a training job under ``torchrun``: the train step's way to train across processes.

``launch`` writes the job's arguments as a ``Job`` (JSON), then runs
``python -m torch.distributed.run --standalone --nproc-per-node N -m pipeline.training.torchrun job.json``;
every process (``main``) joins the process group (NCCL on CUDA, one GPU per process by its local rank;
gloo on the CPU) and calls the same job function (``train_lora``, ``train_dpo``) with the same arguments;
rank 0 alone gets the MLflow tracker (rebuilt from its tracking URI and experiment) and writes the job's
result, which ``launch`` reads back as the ``TrainResult`` the step records. The optimizer state is not
sharded (every process holds the whole LoRA and its AdamW state, as DDP does): the base must fit one
device. (FSDP2's ``fully_shard`` runs a peft LoRA model under gloo on the CPU in torch 2.13, but its
collectives in every forward need the same number of micro-batches in every process, and its checkpoints
sharded state: not wired here.)
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.errors import RatchetError
from pipeline.modeling.placement import Placement, placement
from pipeline.registry.tracking import MLflowTracker, TrackingUnavailable
from pipeline.specs.modelspec import DpoSettings, LoraConfig
from pipeline.training import distributed
from pipeline.training.artifacts import ArtifactStoreError
from pipeline.training.distributed import World, is_main, world
from pipeline.training.dpo import train_dpo
from pipeline.training.job import TrainConfig, TrainResult, train_lora

__all__ = ["Job", "Tracking", "launch", "main"]

log = logging.getLogger(__name__)


PROGRESS = "ratchet-progress"  # rank 0's progress lines on its stdout: "<PROGRESS> <step> <total> <loss>"
METHODS = ("sft", "dpo")


class Tracking(BaseModel):
    """The MLflow store rank 0 records the job's run in (``tracking.MLflowTracker`` rebuilt in the child)."""

    model_config = ConfigDict(extra="forbid")

    tracking_uri: str = Field(description="The MLflow tracking URI of the step's tracker.")
    experiment: str = Field(description="The name of the tracker's MLflow experiment (it exists already).")


class Job(BaseModel):
    """One training job as every process of a ``torchrun`` launch reads it (``job.json``): the job
    function's keyword arguments, the ones that are no JSON (the tracker, the placement) by what rebuilds
    them."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["sft", "dpo"] = Field(description="The job function: sft `train_lora`, dpo `train_dpo`.")
    base_model_dir: Path = Field(description="The base model's directory.")
    dataset_dir: Path = Field(description="The job's dataset (`save_to_disk`).")
    output_dir: Path = Field(description="Where the job writes its checkpoints and adapter (rank 0).")
    parent_adapter_dir: Path | None = Field(default=None, description="The adapter the job continues.")
    tokenizer_dir: Path | None = Field(default=None, description="The tokenizer; null: the base's.")
    device: str = Field(description="`cpu` (gloo), or `cuda` (NCCL, each process on GPU `LOCAL_RANK`).")
    dtype: str = Field(description="The base's torch dtype name (`placement.Placement.dtype`).")
    lineage: dict[str, Any] | None = Field(default=None, description="Written in the adapter's lineage.json.")
    keep_checkpoints: bool = Field(default=False, description="Keep checkpoints with the result (the step).")
    stop_after_steps: int | None = Field(default=None, description="Stop after that many steps (tests).")
    options: dict[str, Any] = Field(
        description="The method's own keyword arguments as JSON: sft `config` (`TrainConfig`'s fields); dpo "
        "`lora` (`LoraConfig`), `settings` (`DpoSettings`), `seed`, `tool_call_format`, `max_seq_len`, ..."
    )
    tracking: Tracking | None = Field(default=None, description="Where rank 0 logs the run; null: nowhere.")
    result: Path = Field(description="Where rank 0 writes the finished job's `TrainResult` (JSON).")
    errors: Path = Field(description="A directory where a failing process writes its error (`rank<N>.json`).")


def launch(
    *,
    method: str,
    processes: int,
    tracker: Any = None,
    progress: Callable[[int, int, float], None] | None = None,
    where: Placement | None = None,
    **arguments: Any,
) -> TrainResult:
    """Run the ``method``'s job function in ``processes`` processes under ``torchrun`` (the train step, when
    the model spec's ``training.processes`` > 1) and return rank 0's result. ``arguments``: the job
    function's other keyword arguments (paths, ``config`` or ``lora``/``settings``, ...). ``progress`` gets
    rank 0's steps as they happen. A process's ``RatchetError`` (``ArtifactStoreError`` and
    ``TrackingUnavailable`` by their kind) is raised here as one line."""
    if method not in METHODS:
        raise RatchetError(f"training.processes > 1 runs methods {', '.join(METHODS)}, not {method!r}")
    where = where or placement()
    if where.device.startswith("cuda"):
        import torch

        if processes > torch.cuda.device_count():
            raise RatchetError(
                f"training.processes is {processes} but torch sees {torch.cuda.device_count()} CUDA GPU(s): "
                "one process per GPU"
            )
    with tempfile.TemporaryDirectory(prefix="ratchet-torchrun-") as tmp:
        job = Job(
            method=method,  # type: ignore[arg-type]
            device=where.device.split(":")[0],
            dtype=where.dtype,
            tracking=_tracking_of(tracker),
            result=Path(tmp) / "result.json",
            errors=Path(tmp),
            **{k: arguments.pop(k) for k in list(arguments) if k in Job.model_fields},
            options=_options_json(method, arguments),
        )
        (Path(tmp) / "job.json").write_text(job.model_dump_json())
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={processes}", "-m", __name__, str(Path(tmp) / "job.json")]  # fmt: skip
        # -m of a module its package has imported already: runpy warns; nothing is wrong
        env = {**os.environ, "PYTHONWARNINGS": "ignore::RuntimeWarning:runpy"}
        log.info("training %s across %d processes: %s", job.output_dir.name, processes, " ".join(command))
        tail: deque[str] = deque(maxlen=60)
        # errors="replace": a library's non-UTF-8 output must not end the launch with a UnicodeDecodeError
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              errors="replace", env=env) as proc:  # fmt: skip
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith(PROGRESS) and progress is not None:
                    step, total, loss = line.split()[1:4]
                    progress(int(step), int(total), float(loss))
                elif not line.startswith(PROGRESS):
                    tail.append(line.rstrip())
                    log.debug("torchrun: %s", line.rstrip())
        if proc.returncode != 0 or not job.result.is_file():
            raise _failure(job, processes, proc.returncode, list(tail))
        done = json.loads(job.result.read_text())
    shares = done.pop("micro_batches_by_rank")
    log.info("%s: micro-batches run by each of %d processes: %s", job.output_dir.name, processes, shares)
    return TrainResult(**{**done, "adapter_dir": Path(done["adapter_dir"]),
                          "loss_curve": tuple(tuple(p) for p in done["loss_curve"])})  # fmt: skip


def _tracking_of(tracker: Any) -> Tracking | None:
    if tracker is None:
        return None
    uri, experiment_id = getattr(tracker, "tracking_uri", None), getattr(tracker, "experiment_id", None)
    if uri is None or experiment_id is None:
        raise RatchetError(
            f"training across processes records its run through an MLflow tracker, not {type(tracker).__name__}"
        )
    return Tracking(tracking_uri=uri, experiment=tracker.client.get_experiment(experiment_id).name)


def _options_json(method: str, options: dict[str, Any]) -> dict[str, Any]:
    """The method's own arguments as JSON (``_options_of`` reads them back)."""
    out = dict(options)
    if method == "sft":
        out["config"] = asdict(out["config"])
    for key in ("lora", "settings"):
        if key in out and hasattr(out[key], "model_dump"):
            out[key] = out[key].model_dump(mode="json")
    return out


def _options_of(method: str, options: dict[str, Any]) -> dict[str, Any]:
    """The job function's own keyword arguments from their JSON (``_options_json``)."""
    out = dict(options)
    if method == "sft":
        config = out["config"]
        out["config"] = TrainConfig(**{**config, "target_modules": tuple(config["target_modules"])})
    else:
        out["lora"], out["settings"] = LoraConfig(**out["lora"]), DpoSettings(**out["settings"])
    return out


SIGNALLED = ("SignalException", "KeyboardInterrupt", "SystemExit")
"""How a process that torchrun stopped (because another failed) ends: not the job's error."""


def _failure(job: Job, processes: int, code: int | None, tail: list[str]) -> Exception:
    """The error a failed launch raises: the first failing process's own error (by its kind) when it wrote
    one, else torchrun's exit code and the end of its output."""
    errors = [(path, error) for path in job.errors.glob("rank*.json") if (error := _error_in(path))]
    # the root cause first: the earliest error, and never the stop torchrun then sent the others (SIGTERM)
    errors.sort(key=lambda e: (e[1]["kind"] in SIGNALLED, e[0].stat().st_mtime_ns))
    for path, error in errors:
        kinds = {"ArtifactStoreError": ArtifactStoreError, "TrackingUnavailable": TrackingUnavailable}
        if error["kind"] in kinds:
            return kinds[error["kind"]](error["message"])
        if error["ratchet"]:
            return RatchetError(error["message"])
        return RuntimeError(
            f"training {job.output_dir.name} across {processes} processes: {path.stem} failed with "
            f"{error['kind']}: {error['message']}\n" + "\n".join(tail)
        )
    return RuntimeError(
        f"training {job.output_dir.name} across {processes} processes: torchrun exited {code}\n"
        + "\n".join(tail)
    )


def _error_in(path: Path) -> dict[str, Any] | None:
    """A process's error file, or None when it cannot be read (cut short: torchrun stopped the process)."""
    try:
        error = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        log.warning("%s: unreadable error file, skipped", path.name)
        return None
    keys = {"kind": str, "ratchet": bool, "message": str}
    ok = isinstance(error, dict) and all(isinstance(error.get(k), t) for k, t in keys.items())
    return error if ok else None


def main(argv: Sequence[str] | None = None) -> int:
    """One process of a launched job (``launch``): join the group, run the job function, rank 0 writes the
    result; a process that fails writes its error for ``launch`` to raise."""
    import torch
    import torch.distributed as dist

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    job = Job.model_validate_json(Path((argv if argv is not None else sys.argv[1:])[0]).read_text())
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = job.device
    if device == "cuda":
        device = f"cuda:{local}"
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    here = world()
    try:
        result = _run(job, here, Placement(device=device, dtype=job.dtype))
        shares: list[Any] = [None] * here.size
        dist.all_gather_object(shares, distributed.RAN[0])
        if is_main(here):
            record = {
                **asdict(result),
                "adapter_dir": str(result.adapter_dir),
                "micro_batches_by_rank": shares,
            }
            partial = job.result.with_suffix(".partial")
            partial.write_text(json.dumps(record))
            os.replace(partial, job.result)
    except BaseException as exc:
        error = {"kind": type(exc).__name__, "ratchet": isinstance(exc, RatchetError), "message": str(exc)}
        partial = job.errors / f"rank{here.rank}.partial"  # whole or absent: torchrun may stop us mid-write
        partial.write_text(json.dumps(error))
        os.replace(partial, job.errors / f"rank{here.rank}.json")
        raise
    finally:
        dist.destroy_process_group()
    return 0


def _run(job: Job, here: World, where: Placement) -> TrainResult:
    """The job function of ``job.method`` in this process: rank 0 with the tracker and progress lines."""
    tracker = None
    if job.tracking is not None and is_main(here):
        tracker = MLflowTracker(tracking_uri=job.tracking.tracking_uri, experiment=job.tracking.experiment)

    def progress(step: int, total: int, loss: float) -> None:
        sys.stdout.write(f"{PROGRESS} {step} {total} {loss!r}\n")  # read by ``launch``, not a log line
        sys.stdout.flush()

    fn = train_lora if job.method == "sft" else train_dpo
    return fn(
        base_model_dir=job.base_model_dir,
        dataset_dir=job.dataset_dir,
        output_dir=job.output_dir,
        parent_adapter_dir=job.parent_adapter_dir,
        tokenizer_dir=job.tokenizer_dir,
        lineage=job.lineage,
        keep_checkpoints=job.keep_checkpoints,
        stop_after_steps=job.stop_after_steps,
        tracker=tracker,
        progress=progress if is_main(here) else None,
        where=where,
        **_options_of(job.method, job.options),
    )


if __name__ == "__main__":
    # under torchrun: main of the package's own module object (``-m`` runs a second copy as __main__)
    from pipeline.training.torchrun import main as _main

    raise SystemExit(_main())
