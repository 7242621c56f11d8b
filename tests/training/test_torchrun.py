"""How a failed ``torchrun`` launch is reported (``torchrun._failure``), without launching: the root cause is
raised as its own kind even when another process's error file was cut short (torchrun stopped it while it
wrote), never a ``JSONDecodeError`` from reading that file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeline.errors import RatchetError
from pipeline.training.torchrun import Job, _failure


def job_in(tmp_path: Path) -> Job:
    return Job(method="sft", base_model_dir=tmp_path, dataset_dir=tmp_path, output_dir=tmp_path / "out",
               device="cpu", dtype="float32", options={}, result=tmp_path / "result.json",
               errors=tmp_path)  # fmt: skip


def test_a_half_written_error_file_does_not_hide_the_root_cause(tmp_path):
    job = job_in(tmp_path)
    (tmp_path / "rank0.json").write_text(json.dumps({"kind": "RatchetError", "ratchet": True,
                                                     "message": "dataset has no rows"}))  # fmt: skip
    (tmp_path / "rank1.json").write_text('{"kind": "SignalExcep')  # killed while it wrote
    os.utime(tmp_path / "rank1.json", ns=(1, 1))  # the older file: read first
    error = _failure(job, 2, 1, ["tail"])
    assert isinstance(error, RatchetError) and str(error) == "dataset has no rows"


def test_only_unreadable_error_files_give_torchruns_exit_code(tmp_path):
    job = job_in(tmp_path)
    (tmp_path / "rank0.json").write_bytes(b"\xff\xfe")
    error = _failure(job, 2, 7, ["the last line"])
    assert isinstance(error, RuntimeError) and "torchrun exited 7" in str(error)
    assert "the last line" in str(error)


@pytest.mark.parametrize("kind", ["SignalException", "KeyboardInterrupt"])
def test_the_stop_torchrun_sent_is_never_the_reported_cause(tmp_path, kind):
    job = job_in(tmp_path)
    (tmp_path / "rank1.json").write_text(json.dumps({"kind": kind, "ratchet": False, "message": "stop"}))
    os.utime(tmp_path / "rank1.json", ns=(1, 1))
    (tmp_path / "rank0.json").write_text(
        json.dumps({"kind": "ValueError", "ratchet": False, "message": "bad"})
    )
    error = _failure(job, 2, 1, [])
    assert "rank0 failed with ValueError: bad" in str(error)
