"""``bench/gpu.py --tiny``: the GPU benchmark's code runs end to end on the CPU, as on the GPU image (the packages
that machine lacks made unimportable), and a section that fails fails the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = {
    "env",
    "tokenizer",
    "qwen3-0.6b/build",
    "qwen3-0.6b/sft",
    "qwen3-0.6b/decode",
    "qwen3-0.6b/greedy",
    "qwen3-0.6b/grpo",
    "qwen3-8b/build",
    "qwen3-8b/sft",
    "qwen3-8b/decode",
}


def bench(out: Path, *, block: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``bench/gpu.py --tiny`` in a subprocess, with the GPU image's missing packages (and ``block``) unimportable."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench.gpu import GPU_IMAGE_MISSING

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    return subprocess.run(
        [
            sys.executable,
            "bench/gpu.py",
            "--tiny",
            "--out",
            str(out),
            "--block",
            ",".join((*GPU_IMAGE_MISSING, *block)),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_tiny_run_measures_every_section_as_on_the_gpu_image(tmp_path):
    out = tmp_path / "gpu.json"
    proc = bench(out)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    sections = result["sections"]
    assert set(sections) == SECTIONS
    assert {name: s["status"] for name, s in sections.items() if s["status"] != "ok"} == {}
    assert result["env"]["datasets"].startswith("missing")  # train_lora ran on the bench's reader
    assert result["env"]["gpu_image_gap"] == []  # nothing the pipeline imports is missing there
    for shape in ("qwen3-0.6b", "qwen3-8b"):
        sft = sections[f"{shape}/sft"]
        assert sft["rows"]["train_lora"]["tok_s"] > 0
        assert all(check["ok"] for check in sft["loss_checks"]["vs_train_lora"].values())
        assert sft["vs_strongest"]["speedup"] > 0
        assert sections[f"{shape}/decode"]["mixed_vs_base_only"] > 0
    decode = sections["qwen3-0.6b/decode"]["rows"]
    assert all(r["tok_s"] > 0 for r in decode.values()) and len(decode) == 4
    greedy = sections["qwen3-0.6b/greedy"]["rows"]["float32"]
    assert greedy["equal"] == "6/6"  # each row of a mixed batch decodes as it does alone
    assert greedy["adapter_differs_from_base"] == "2/2"  # and the adapters change what is decoded
    assert sections["qwen3-0.6b/grpo"]["rows"]["grpo.roll_out"]["tok_s"] > 0
    assert result["summary"]["failed"] == [] and result["summary"]["skipped"] == []


def test_a_failing_section_fails_the_run_and_keeps_the_others(tmp_path):
    out = tmp_path / "gpu.json"
    proc = bench(out, block=("peft",))  # the LoRAs cannot be made: every model section fails
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    sections = result["sections"]
    assert set(sections) == SECTIONS
    assert sections["tokenizer"]["status"] == "ok"
    failed = {name for name, s in sections.items() if s["status"] == "failed"}
    assert failed == SECTIONS - {"tokenizer"}
    assert "peft" in sections["env"]["error"]
    assert sections["qwen3-0.6b/sft"]["error"].startswith("RuntimeError: needs qwen3-0.6b/build")
    assert result["summary"]["failed"] == sorted(failed, key=list(sections).index)
