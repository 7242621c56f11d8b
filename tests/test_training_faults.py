"""Training under faults: damaged checkpoints fall back to an older one, a pickle is never loaded, and an
artifact store that is full or read-only fails the candidate cleanly (real filesystems, no mocks)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import func, select

from pipeline.environment import training_corpus
from pipeline.environment.tinymodel import TinyModelConfig, ensure_tiny_model
from pipeline.loop.candidate import AdvanceConfig
from pipeline.training import TrainConfig, train_lora, write_dataset

SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                        max_position_embeddings=96, bootstrap_steps=40, bootstrap_batch_size=32,
                        corpus_size=400, seed=2)  # fmt: skip
FAST = TrainConfig(rank=4, alpha=8, max_steps=6, batch_size=16, checkpoint_every=2, lr=1e-3, warmup_steps=1)
ROOT = Path(__file__).resolve().parent.parent
# generation 1 of the lineage fixture learns from its ingested corrections only: no collection to wait for
ADVANCE = AdvanceConfig(prompts_per_specialist=24, samples_per_prompt=2, min_examples=2, validation_items=6,
                        seed=1, collect=False)  # fmt: skip


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return ensure_tiny_model(config=SMALL, cache_dir=tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "ds"
    write_dataset(training_corpus(120, seed=4), path)
    return path


@pytest.fixture(scope="module")
def clean_run(base_dir, dataset_dir, tmp_path_factory):
    """The adapter of an uninterrupted run: what every resumed run must reproduce."""
    return _tensors(
        train_lora(
            base_model_dir=base_dir,
            dataset_dir=dataset_dir,
            output_dir=tmp_path_factory.mktemp("whole"),
            config=FAST,
        ).adapter_dir  # fmt: skip
    )


def _tensors(adapter_dir):
    from safetensors.torch import load_file

    return load_file(str(adapter_dir / "adapter_model.safetensors"))


def _assert_same_adapter(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert (a[key] - b[key]).abs().max() < 1e-5, key


def _interrupted(base_dir, dataset_dir, out):
    """A job stopped after step 3: checkpoints at steps 2 and 3."""
    cut = train_lora(base_model_dir=base_dir, dataset_dir=dataset_dir, output_dir=out, config=FAST,
                     stop_after_steps=3)  # fmt: skip
    assert not cut.completed
    assert sorted(p.name for p in (out / "checkpoint").iterdir()) == ["step-0000002", "step-0000003"]
    return out / "checkpoint"


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_last_byte(path):  # inside the tensor data: the header still parses, only the hash can tell
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated adapter": ("adapter.safetensors", _truncate, "does not match its recorded sha256"),
    "flipped byte in the optimizer state": (
        "state.safetensors", _flip_last_byte, "does not match its recorded sha256"),
    "truncated state.json": ("state.json", _truncate, "state.json is unreadable"),
    "missing tensor file": ("state.safetensors", Path.unlink, "state.safetensors is missing"),
    "missing state.json": ("state.json", Path.unlink, "has no state.json"),
}  # fmt: skip


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(
    damage, base_dir, dataset_dir, clean_run, tmp_path, caplog
):
    root = _interrupted(base_dir, dataset_dir, tmp_path / "job")
    name, wreck, reason = DAMAGE[damage]
    wreck(root / "step-0000003" / name)
    caplog.set_level(logging.WARNING, logger="pipeline.training.checkpoint")
    resumed = train_lora(
        base_model_dir=base_dir, dataset_dir=dataset_dir, output_dir=tmp_path / "job", config=FAST
    )
    assert resumed.completed and resumed.resumed_from_step == 2
    _assert_same_adapter(clean_run, _tensors(resumed.adapter_dir))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert (
        "step-0000003" in warnings[0]
        and reason in warnings[0]
        and "resuming from step-0000002" in warnings[0]
    )


def test_another_jobs_checkpoint_is_passed_over_and_both_damaged_means_step_zero(
    base_dir, dataset_dir, clean_run, tmp_path, caplog
):
    """An intact checkpoint of another job (here: another learning rate) placed newest is skipped, with a
    warning; when every checkpoint of the job is damaged the job starts again and still gets it right."""
    other = TrainConfig(**{**FAST.__dict__, "lr": 2e-3})
    train_lora(base_model_dir=base_dir, dataset_dir=dataset_dir, output_dir=tmp_path / "other", config=other,
               stop_after_steps=4)  # fmt: skip
    root = _interrupted(base_dir, dataset_dir, tmp_path / "job")
    shutil.copytree(tmp_path / "other" / "checkpoint" / "step-0000004", root / "step-0000004")
    caplog.set_level(logging.WARNING, logger="pipeline.training.checkpoint")
    resumed = train_lora(
        base_model_dir=base_dir, dataset_dir=dataset_dir, output_dir=tmp_path / "job", config=FAST
    )
    assert resumed.resumed_from_step == 3
    _assert_same_adapter(clean_run, _tensors(resumed.adapter_dir))
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "step-0000004" in warning and "different job" in warning

    caplog.clear()
    root = _interrupted(base_dir, dataset_dir, tmp_path / "again")
    _truncate(root / "step-0000003" / "adapter.safetensors")
    _flip_last_byte(root / "step-0000002" / "state.safetensors")
    resumed = train_lora(
        base_model_dir=base_dir, dataset_dir=dataset_dir, output_dir=tmp_path / "again", config=FAST
    )
    assert resumed.resumed_from_step == 0
    _assert_same_adapter(clean_run, _tensors(resumed.adapter_dir))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("starting from step 0" in w for w in warnings)


class _Planted:
    """Unpickling this creates ``path``: the marker that a pickle was loaded."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_pickle_planted_in_the_checkpoints_is_never_unpickled(base_dir, dataset_dir, clean_run, tmp_path):
    """The old format (``state.pt`` beside ``meta.json``, loaded with ``torch.load(weights_only=False)``)
    planted as the newest checkpoint, with this job's key, and pickles beside a real checkpoint: resuming
    opens none of them and reproduces the clean run."""
    root = _interrupted(base_dir, dataset_dir, tmp_path / "job")
    marker = tmp_path / "unpickled"
    job_key = json.loads((root / "step-0000003" / "state.json").read_text())["body"]["job_key"]
    legacy = root / "step-0000009"
    legacy.mkdir()
    shutil.copy(root / "step-0000003" / "adapter.safetensors", legacy / "adapter.safetensors")
    (legacy / "meta.json").write_text(json.dumps({"step": 9, "job_key": job_key}))
    for path in (
        legacy / "state.pt",
        root / "step-0000003" / "state.pt",
        root / "step-0000003" / "optimizer.pkl",
    ):
        path.write_bytes(pickle.dumps(_Planted(marker)))
    pickle.loads((legacy / "state.pt").read_bytes())  # the planted file does what it says ...
    assert marker.exists()
    marker.unlink()
    resumed = train_lora(
        base_model_dir=base_dir, dataset_dir=dataset_dir, output_dir=tmp_path / "job", config=FAST
    )
    assert not marker.exists()  # ... and training never loaded it
    assert resumed.resumed_from_step == 3
    _assert_same_adapter(clean_run, _tensors(resumed.adapter_dir))


# ---- the artifact store refuses the adapter, through the training step ---------------------------------------
def _curated_candidate():
    """Generation 1 of the ``lineage`` fixture built up to training (from the ingested corrections only)."""
    from pipeline.loop.advance import begin_candidate, step_functions

    config = ADVANCE
    gid = begin_candidate(config=config, owner="test")
    for step in ("collect", "score", "curate"):
        step_functions()[step](generation_id=gid, config=config, progress=None)
    return gid, config


def _first_job_dir(gid):
    """The output directory of the first specialist the training step trains."""
    from pipeline.loop.candidate import artifacts_for
    from pipeline.registry import TrainingDataset, get_engine, session_scope

    with session_scope(get_engine()) as s:
        first = min(s.scalars(select(TrainingDataset.specialist).where(TrainingDataset.generation_id == gid)))
    return first, artifacts_for("main", 1) / "adapters" / f"main-gen1-{first}"


def _assert_failed_cleanly(gid, specialist, job_dir, why):
    """Failed with the reason; the champion, the adapters and MLflow's model registry untouched."""
    from pipeline.registry import Adapter, Generation, get_champion, get_engine, session_scope
    from pipeline.registry.tracking import MLflowTracker

    with session_scope(get_engine()) as s:
        gen = s.get(Generation, gid)
        assert gen.status == "failed" and gen.step == "curate"
        assert (
            f"training {specialist}" in gen.decision
            and why in gen.decision
            and "full or not writable" in gen.decision
        )
        assert get_champion(session=s).number == 0
        assert s.scalar(select(func.count()).select_from(Adapter)) == 0  # no row for an adapter not saved
    assert not (job_dir / "adapter").exists()
    client = MLflowTracker.from_settings().client
    assert client.search_model_versions() == []
    [run] = client.search_runs([client.get_experiment_by_name("ratchet").experiment_id])
    assert run.info.status == "FAILED" and run.info.run_name == job_dir.name


def test_an_unwritable_artifact_store_fails_the_candidate_and_keeps_the_champion(lineage):
    """The job's directory made immutable (``chattr +i``: root ignores permission bits but not this; as
    another user, ``chmod a-w``): saving the adapter fails, the generation ends failed with why."""
    from pipeline.errors import RatchetError
    from pipeline.registry.tracking import MLflowTracker
    from pipeline.training import train_step

    gid, config = _curated_candidate()
    specialist, job_dir = _first_job_dir(gid)
    job_dir.mkdir(parents=True)
    lock = ["chattr", "+i", str(job_dir)] if os.geteuid() == 0 else ["chmod", "a-w", str(job_dir)]
    unlock = ["chattr", "-i", str(job_dir)] if os.geteuid() == 0 else ["chmod", "u+w", str(job_dir)]
    if subprocess.run(lock, capture_output=True).returncode != 0:
        pytest.skip(f"cannot make {job_dir} unwritable with {lock[0]} here")
    try:
        with pytest.raises(RatchetError) as failed:
            train_step(generation_id=gid, config=config, tracker=MLflowTracker.from_settings())
    finally:
        subprocess.run(unlock, check=True)
    message = str(failed.value)
    assert message.startswith(
        f"generation 1 failed: training {specialist}: {job_dir / 'adapter'}: cannot write"
    )
    assert "\n" not in message
    why = "Operation not permitted" if os.geteuid() == 0 else "Permission denied"
    _assert_failed_cleanly(gid, specialist, job_dir, why)
    from pipeline.loop.advance import begin_candidate
    from pipeline.registry import Generation, get_engine, session_scope

    with session_scope(get_engine()) as s:  # failed is final: the next advance builds a new candidate
        assert s.get(Generation, begin_candidate(config=config, owner="next")).number == 2


def _mount_namespace() -> list[str] | None:
    """An ``unshare`` prefix giving a child its own mount namespace (root, or a user namespace), or None."""
    for prefix in (
        ["unshare", "--mount", "--propagation", "private"],
        ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"],
    ):
        if shutil.which("unshare") and subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return prefix
    return None


TRAIN_IN_CHILD = """
import json, sys
from pipeline.loop.candidate import AdvanceConfig
from pipeline.registry.tracking import MLflowTracker
from pipeline.training import train_step
train_step(generation_id=int(sys.argv[1]), config=AdvanceConfig(**json.loads(sys.argv[2])),
           tracker=MLflowTracker.from_settings())
"""


def test_a_full_artifact_store_fails_the_candidate_and_keeps_the_champion(lineage):
    """The job's directory is a 16 KiB tmpfs (the adapter is ~26 KiB), mounted in a private mount namespace
    of the child that runs the training step, so nothing outlives the child: the save hits ENOSPC."""
    prefix = _mount_namespace()
    if prefix is None:
        pytest.skip("no mount namespace available (unshare --mount fails) to mount a size-limited tmpfs")
    gid, config = _curated_candidate()
    specialist, job_dir = _first_job_dir(gid)
    job_dir.mkdir(parents=True)
    script = 'mount -t tmpfs -o size=16k ratchet-full "$0" && exec "$1" -c "$2" "$3" "$4"'
    child = subprocess.run(
        [*prefix, "sh", "-c", script, str(job_dir), sys.executable, TRAIN_IN_CHILD, str(gid),
         json.dumps(config.__dict__)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert child.returncode == 1, child.stderr[-3000:]
    last = child.stderr.strip().splitlines()[-1]
    assert (
        f"generation 1 failed: training {specialist}: {job_dir / 'adapter'}: cannot write the adapter" in last
    )
    assert "No space left on device" in last
    assert not any(job_dir.iterdir())  # the tmpfs went with the child; nothing was written underneath
    _assert_failed_cleanly(gid, specialist, job_dir, "No space left on device")


# ---- the registry refuses the adapter row once, after the job finished -----------------------------------------
def test_a_training_step_that_failed_after_its_job_finished_reuses_the_job(lineage):
    """The first adapter row the step writes fails (SQLite's "database is locked", raised at the registry's
    INSERT by a hook on its engine) after that job finished and MLflow has its run and model version. Running
    the step again reuses the job: no optimizer step, the same adapter (sha256), one MLflow run and one model
    version per job. (The job's checkpoints were deleted before the registry commit: the rerun trained again
    from step 0 into a second MLflow run.)"""
    import sqlite3

    from sqlalchemy import event
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from pipeline.registry import Adapter, get_engine, session_scope
    from pipeline.registry.tracking import MLflowTracker
    from pipeline.training import train_step

    gid, config = _curated_candidate()
    specialist, job_dir = _first_job_dir(gid)
    engine = get_engine()
    refused = []

    def refuse_once(conn, cursor, statement, parameters, context, executemany):
        if statement.lstrip().upper().startswith("INSERT INTO ADAPTERS") and not refused:
            refused.append(statement)
            raise sqlite3.OperationalError("database is locked")

    steps = []
    count_steps = register_optimizer_step_post_hook(lambda *_: steps.append(1))
    event.listen(engine, "before_cursor_execute", refuse_once)
    try:
        with pytest.raises(Exception, match="database is locked"):
            train_step(generation_id=gid, config=config, tracker=MLflowTracker.from_settings())
        first_steps = len(steps)
        assert refused and first_steps > 0
        weights = job_dir / "adapter" / "adapter_model.safetensors"
        sha = hashlib.sha256(weights.read_bytes()).hexdigest()
        results = train_step(generation_id=gid, config=config, tracker=MLflowTracker.from_settings())
    finally:
        event.remove(engine, "before_cursor_execute", refuse_once)
        count_steps.remove()
    with session_scope(engine) as s:
        adapters = {a.specialist: a for a in s.scalars(select(Adapter))}
    assert adapters[specialist].sha256 == sha == hashlib.sha256(weights.read_bytes()).hexdigest()
    redone = len(steps) - first_steps  # the other specialists train now for the first time
    others = sum(r["steps"] for sp, r in results.items() if sp != specialist)
    assert redone == others, (redone, others)
    client = MLflowTracker.from_settings().client
    runs = client.search_runs([client.get_experiment_by_name("ratchet").experiment_id])
    names = [r.info.run_name for r in runs]
    assert names.count(job_dir.name) == 1 and len(names) == len(set(names)) == len(adapters), names
    assert adapters[specialist].mlflow_run_id == next(
        r.info.run_id for r in runs if r.info.run_name == job_dir.name
    )
    versions = client.search_model_versions(f"run_id = '{adapters[specialist].mlflow_run_id}'")
    assert [str(v.version) for v in versions] == [adapters[specialist].mlflow_model_version]
    assert not (job_dir / "checkpoint").exists()  # the registry has it: the checkpoints are gone
