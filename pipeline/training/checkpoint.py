"""Training checkpoints without pickle: tensors in safetensors, everything else in JSON.

A checkpoint is a directory ``step-NNNNNNN`` under a job's ``checkpoint/``:

- ``adapter.safetensors``: the LoRA weights;
- ``state.safetensors``: every tensor of the optimizer's state and the RNG states;
- ``state.json``: the step, the job key, the rest of the optimizer's and the scheduler's state and
  Python's RNG (tensors replaced by references into ``state.safetensors``), the sha256 of both tensor
  files, and the sha256 of its own body.

It is written through ``artifacts.atomic_directory`` (a reader never sees half of one), and the newest
``KEEP`` are kept, so that a checkpoint torn by a crash or damaged on disk has an older one to fall back
to. Loading reads nothing but safetensors and JSON -- a pickle planted in the directory is never opened --
and resumes from the newest checkpoint that is intact and belongs to the job; each one passed over
(truncated, corrupt, incomplete, of another format or another job) is named in one warning line.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

from pipeline.errors import RatchetError
from pipeline.specs.loading import content_hash, file_sha256
from pipeline.training.artifacts import atomic_directory

log = logging.getLogger(__name__)

FORMAT = "ratchet-checkpoint/1"
KEEP = 2
ADAPTER, TENSORS, STATE = "adapter.safetensors", "state.safetensors", "state.json"
# How values JSON cannot hold are written: a tensor, a tuple (Python's RNG state must be one), and a
# dict whose keys are not strings (the optimizer's state is keyed by parameter index).
TENSOR, TUPLE, ITEMS = "__tensor__", "__tuple__", "__items__"


def encode(value: Any, tensors: dict[str, Any]) -> Any:
    """``value`` as JSON data, its tensors moved into ``tensors`` (copied to the CPU)."""
    import torch

    if isinstance(value, torch.Tensor):
        key = str(len(tensors))
        tensors[key] = value.detach().to("cpu", copy=True).contiguous()
        return {TENSOR: key}
    if isinstance(value, tuple):
        return {TUPLE: [encode(v, tensors) for v in value]}
    if isinstance(value, list):
        return [encode(v, tensors) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: encode(v, tensors) for k, v in value.items()}
        return {ITEMS: [[encode(k, tensors), encode(v, tensors)] for k, v in value.items()]}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"a checkpoint cannot hold a {type(value).__name__}")


def decode(value: Any, tensors: dict[str, Any]) -> Any:
    """The inverse of ``encode``."""
    if isinstance(value, list):
        return [decode(v, tensors) for v in value]
    if isinstance(value, dict):
        if set(value) == {TENSOR}:
            return tensors[value[TENSOR]]
        if set(value) == {TUPLE}:
            return tuple(decode(v, tensors) for v in value[TUPLE])
        if set(value) == {ITEMS}:
            return {decode(k, tensors): decode(v, tensors) for k, v in value[ITEMS]}
        return {k: decode(v, tensors) for k, v in value.items()}
    return value


def save_checkpoint(
    root: Path, *, job_key: str, step: int, model: Any, optim: Any, sched: Any, get_state: Any
) -> Path:
    """Write ``root/step-NNNNNNN`` (see the module doc), then drop all but the newest ``KEEP``."""
    import torch
    from safetensors.torch import save_file

    final = root / f"step-{step:07d}"
    with atomic_directory(final, what="checkpoint") as tmp:
        save_file({k: v.detach().contiguous() for k, v in get_state(model).items()}, str(tmp / ADAPTER))
        tensors: dict[str, Any] = {}
        state = {
            "optimizer": optim.state_dict(),
            "scheduler": sched.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
            "python_rng": random.getstate(),
        }
        body = {"format": FORMAT, "step": step, "job_key": job_key, "state": encode(state, tensors)}
        save_file(tensors, str(tmp / TENSORS))
        body["files"] = {name: file_sha256(tmp / name) for name in (ADAPTER, TENSORS)}
        (tmp / STATE).write_text(json.dumps({"sha256": content_hash(body), "body": body}) + "\n")
    for old in sorted(root.glob("step-*"))[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def inspect_checkpoint(ckpt: Path) -> tuple[dict[str, Any] | None, str]:
    """(the body of ``state.json``, "") when ``ckpt`` is complete and undamaged, else (None, what is wrong)."""
    if not (ckpt / STATE).is_file():
        return None, f"has no {STATE} (an unfinished write, or not a checkpoint of this format)"
    try:
        record = json.loads((ckpt / STATE).read_text())
        body = record["body"]
        intact = record["sha256"] == content_hash(body)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        return None, f"{STATE} is unreadable ({type(exc).__name__}: truncated or corrupt)"
    if not intact:
        return None, f"{STATE} does not match its recorded sha256 (corrupt)"
    if body.get("format") != FORMAT:
        return None, f"is not a {FORMAT} checkpoint"
    files = body.get("files") or {}
    if set(files) != {ADAPTER, TENSORS}:
        return None, f"{STATE} does not list {ADAPTER} and {TENSORS}"
    for name, digest in files.items():
        if not (ckpt / name).is_file():
            return None, f"{name} is missing"
        if file_sha256(ckpt / name) != digest:
            return None, f"{name} does not match its recorded sha256 (truncated or corrupt)"
    return body, ""


def load_checkpoint(root: Path, *, job_key: str, model: Any, optim: Any, sched: Any, set_state: Any) -> int:
    """Restore the newest intact checkpoint of this job under ``root``; return its step (0: none).

    Raises ``RatchetError`` when intact checkpoints exist but every one belongs to another job (its config,
    data or parent differ): resuming would be wrong and deleting them is the user's call.
    """
    import torch
    from safetensors.torch import load_file

    skipped: list[tuple[Path, str]] = []
    foreign: Path | None = None
    chosen: tuple[Path, dict[str, Any]] | None = None
    for ckpt in sorted(root.glob("step-*"), reverse=True) if root.is_dir() else []:
        body, problem = inspect_checkpoint(ckpt)
        if body is not None and body.get("job_key") != job_key:
            foreign = foreign or ckpt
            body, problem = None, "belongs to a different job (config, data or parent changed)"
        if body is None:
            skipped.append((ckpt, problem))
            continue
        chosen = (ckpt, body)
        break
    if chosen is None and foreign is not None:
        raise RatchetError(
            f"{foreign}: checkpoint belongs to a different job (config, data or parent changed); "
            "delete it or use a new output_dir"
        )
    then = f"resuming from {chosen[0].name}" if chosen else "starting from step 0"
    for ckpt, problem in skipped:
        log.warning("checkpoint %s %s: skipped, %s", ckpt, problem, then)
    if chosen is None:
        return 0
    ckpt, body = chosen
    set_state(model, load_file(str(ckpt / ADAPTER)))
    state = decode(body["state"], load_file(str(ckpt / TENSORS)))
    optim.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] is not None and torch.cuda.is_available():
        if len(state["cuda_rng"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
    random.setstate(state["python_rng"])
    return int(body["step"])


def resume(root: Path, *, job_key: str, model: Any, optim: Any, sched: Any, total: int) -> int:
    """``load_checkpoint`` for a peft job (its LoRA weights), saying where it resumes; the step (0: none)."""
    from peft import set_peft_model_state_dict

    start = load_checkpoint(root, job_key=job_key, model=model, optim=optim, sched=sched,
                            set_state=set_peft_model_state_dict)  # fmt: skip
    if start:
        log.info("resuming %s from checkpoint step %d of %d", root.parent, start, total)
    return start


FINISHED = "finished.json"


def record_finished(root: Path, *, job_key: str, result: dict[str, Any]) -> None:
    """Write ``root/finished.json``: what the finished job produced (its adapter and sha256, MLflow run,
    figures), beside its checkpoints, which stay until the training step has the adapter in the registry
    (``discard``). A step that failed after the job finished -- the registry write refused, the process
    killed -- and runs again reuses it (``finished_result``) instead of training from step 0 into a second run."""
    root.mkdir(parents=True, exist_ok=True)
    body = {"format": FORMAT, "job_key": job_key, "result": result}
    tmp = root / f".{FINISHED}.tmp"
    with open(tmp, "w") as fh:
        fh.write(json.dumps({"sha256": content_hash(body), "body": body}) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, root / FINISHED)


def finished_result(root: Path, *, job_key: str) -> dict[str, Any] | None:
    """What this job recorded when it finished (``record_finished``), when the record is intact, is this job's
    (same config, data and parent) and its adapter is still the one it saved; else None (the job resumes from
    its newest checkpoint as usual)."""
    path = root / FINISHED
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        body = record["body"]
        intact = record["sha256"] == content_hash(body) and body.get("format") == FORMAT
        result = body["result"]
        weights = Path(result["adapter_dir"]) / "adapter_model.safetensors"
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        log.warning("%s is unreadable (%s): resuming from the checkpoints", path, type(exc).__name__)
        return None
    if not intact or body.get("job_key") != job_key:
        log.warning("%s is damaged or belongs to another job: resuming from the checkpoints", path)
        return None
    if not weights.is_file() or file_sha256(weights) != result.get("adapter_sha256"):
        log.warning("%s: the adapter it names changed or is gone: resuming from the checkpoints", path)
        return None
    log.info(
        "%s finished before (MLflow run %s): its adapter is used as it is", root.parent, result.get("run_id")
    )
    return result


def discard(root: Path) -> None:
    """Delete a job's checkpoints (and its finished record): the registry has its adapter now."""
    shutil.rmtree(root, ignore_errors=True)
