"""The project's own GPU benchmark: Ratchet's training, serving and rollout code against plain transformers + peft,
bf16, on random-weight models of real shapes (nothing is downloaded). ``docs/gpu.md`` says how to run it on a GPU
machine and what was measured.

    python bench/gpu.py                  # on a GPU: about 6-7 minutes (--budget 330 s: rows past it are skipped)
    python bench/gpu.py --tiny           # the same code on the CPU with toy shapes, < 1 minute (timings meaningless)

Two shapes: ``qwen3-0.6b`` (Qwen3-0.6B's 28 layers, vocabulary 151,936, tied embeddings) and ``qwen3-8b`` (Qwen3-8B's
full width: hidden 4096, MLP 12,288, 32/8 heads; as many of its 36 layers as the budget left allows). Sections, each
recorded on its own (a failure is one line in the JSON and the log; the rest goes on), the JSON (``--out``)
rewritten after each:

- ``env``: versions, the device, its peak bf16 FLOP/s (``PEAK_BF16_TFLOPS``), the packages imported and
  ``gpu_image_gap`` (packages imported that neither the GPU image nor the shipped wheels provide);
- ``<shape>/build``: the random-weight base, a BPE tokenizer trained here, five saved LoRAs (r16, all linear);
- ``<shape>/sft``: LoRA SFT tokens/s, MFU (6 N tokens/s over the peak) and peak memory of ``train_lora`` (the job
  itself) and of plain peft + transformers loops on the same batches, padded and padding-free (one row, positions
  restarting per example); step-1 losses (B = 0: the base's loss) and final losses compared;
- ``<shape>/decode``: the serving runtime (``load_runtime``) with 4 adapters mixed per row vs base-only, vs HF
  ``generate`` base-only and peft's ``generate(adapter_names=...)`` mixed;
- ``qwen3-0.6b/greedy``: greedy rows of one mixed batch (4 adapters + base rows) vs each row alone, in the run's
  dtype and in float32;
- ``qwen3-0.6b/grpo``: GRPO rollouts (``episodes.roll_out`` on the job's policy model) vs HF ``generate``
  sampling on the same PeftModel.

Ratios are against the strongest baseline measured in the same run. ``train_lora`` reads a dataset saved with
``datasets``; where ``datasets`` is not installed (the GPU image), the rows are written as JSON and, for the duration
of the call, ``datasets.load_from_disk`` is a reader of that file (``dataset_reader``): the job itself is unchanged.
Exit status 1 when a section failed.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.machinery
import importlib.util
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

log = logging.getLogger("bench.gpu")

SPECIALISTS = ("chat", "agent", "coding", "genui")
# Qwen3-8B's config.json (but its weights): full width; the layer count is chosen by the budget (at most 36)
QWEN3_8B = {"hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
            "rope_theta": 1_000_000.0, "attention_bias": False, "attention_dropout": 0.0,
            "initializer_range": 0.02, "tie_word_embeddings": False, "use_sliding_window": False}  # fmt: skip
QWEN3_VOCAB = 151_936
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_hidden_layers": 2}  # fmt: skip
# Dense (no sparsity) BF16 tensor-core peaks in TFLOP/s, from NVIDIA's product datasheets (half their "with
# sparsity" figures); matched in this order against torch.cuda.get_device_name (the first name it contains).
# None: a known name with no figure here (A10G: not the A10's)
PEAK_BF16_TFLOPS: list[tuple[str, float | None]] = [
                    ("A10G", None), ("GH200", 989.0), ("H200 NVL", 835.0), ("H200", 989.0), ("H100 NVL", 835.0),
                    ("H100 PCIe", 756.0), ("H100", 989.0), ("B200", 2250.0), ("A100", 312.0), ("L40S", 362.0),
                    ("L40", 181.0), ("L4", 121.0), ("A10", 125.0)]  # fmt: skip
# Missing on the GPU image (docs/gpu.md); --block makes them unimportable here to run as there.
GPU_IMAGE_MISSING = (
    "datasets",
    "mlflow",
    "prefect",
    "fastapi",
    "starlette",
    "uvicorn",
    "alembic",
    "pyarrow",
    "pandas",
)
GPU_IMAGE_HAS = ("torch", "transformers", "accelerate", "safetensors", "tokenizers", "numpy", "scipy", "jinja2",
                 "pyyaml", "httpx")  # fmt: skip
# Shipped to the GPU machine as wheels (--prepare), at the versions installed here: what the pipeline's import
# chain of train_lora / load_runtime / roll_out needs beyond the image (pipeline.specs.contract imports the
# registry, hence sqlalchemy; pipeline.settings, pydantic_settings).
GPU_WHEELS = ("pydantic", "pydantic_core", "annotated-types", "typing-inspection", "typing_extensions", "peft",
              "pydantic-settings", "python-dotenv", "SQLAlchemy", "jsonschema", "jsonschema-specifications",
              "referencing", "rpds-py", "attrs", "orjson", "google-re2", "rfc3339-validator", "jsonpointer",
              "six")  # fmt: skip


# ---------------------------------------------------------------------------------------------------- recording
def one_line(exc: BaseException) -> str:
    """``Type: message [at file:line]`` (the innermost frame of the project's code), at most ~300 characters."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "/pipeline/" in f.filename or "/bench/" in f.filename]
    at = (ours or frames)[-1] if frames else None
    return text[:300] + (f" [at {Path(at.filename).name}:{at.lineno}]" if at else "")


def is_oom(exc: BaseException) -> bool:
    """A device out-of-memory error: a measured outcome (recorded with the row), not a failure of the bench."""
    return "out of memory" in str(exc).lower()


class Report:
    """The run's results; ``save`` rewrites the JSON file (atomically: written beside it, then renamed)."""

    def __init__(self, path: Path, run: dict[str, Any]):
        self.path, self.started = path, time.perf_counter()
        self.data: dict[str, Any] = {"run": run, "env": {}, "sections": {}, "summary": {}}

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def save(self) -> None:
        self.data["run"]["elapsed_s"] = round(self.elapsed(), 1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[dict[str, Any]]:
        """A section: ``ok``, ``failed`` (it raised, or one of its rows did: ``errors``) or ``skipped`` (every row
        was skipped for the budget). It never raises."""
        entry: dict[str, Any] = {"status": "running", "rows": {}}
        self.data["sections"][name] = entry
        started = time.perf_counter()
        log.info("== %s", name)
        try:
            yield entry
        except Exception as exc:  # noqa: BLE001 - every failure is a finding; the other sections go on
            entry["error"] = one_line(exc)
            log.info("  !! %s failed: %s", name, entry["error"])
            if os.environ.get("BENCH_GPU_TRACE"):
                traceback.print_exc()
        rows = entry["rows"].values()
        if "error" in entry or entry.get("errors"):
            entry["status"] = "failed"
        elif rows and all("skipped" in r for r in rows):
            entry["status"] = "skipped"
        else:
            entry["status"] = "ok"
        entry["seconds"] = round(time.perf_counter() - started, 2)
        free_memory()
        self.save()

    @contextlib.contextmanager
    def row(self, entry: dict[str, Any], label: str) -> Iterator[dict[str, Any]]:
        """One measured row of a section; an exception is recorded on it (the section then failed, but for an
        out-of-memory error, which is a result) and does not propagate."""
        row: dict[str, Any] = {}
        entry["rows"][label] = row
        try:
            yield row
        except Exception as exc:  # noqa: BLE001
            row["error"] = one_line(exc)
            if is_oom(exc):
                row["oom"] = True
            else:
                entry.setdefault("errors", []).append(f"{label}: {row['error']}")
            log.info("  !! %s: %s", label, row["error"])
            if os.environ.get("BENCH_GPU_TRACE"):
                traceback.print_exc()
        if row and "error" not in row:
            log.info("  %-52s %s", label, ", ".join(f"{k} {v}" for k, v in row.items() if k in SHOWN))
        free_memory()
        self.save()

    def needs(self, entry: dict[str, Any], built: Built | None, shape: str) -> bool:
        """Whether the shape's base was built; if its build was skipped for the budget, so is this section
        (recorded); if it failed, this section fails too."""
        if built is not None:
            return True
        if self.data["sections"].get(f"{shape}/build", {}).get("status") == "skipped":
            entry["rows"]["all"] = {"skipped": f"{shape}/build was skipped (budget)"}
            return False
        raise RuntimeError(f"needs {shape}/build, which did not finish")

    def allows(self, entry: dict[str, Any], label: str, need_s: float, budget: float) -> bool:
        """Whether ``need_s`` more seconds fit the budget; if not, the row is recorded as skipped."""
        if self.elapsed() + need_s <= budget:
            return True
        entry["rows"][label] = {"skipped": f"budget: {self.elapsed():.0f} s of {budget:.0f} s used"}
        log.info("  -- %s skipped (budget)", label)
        return False


SHOWN = ("tok_s", "mfu", "peak_gb", "loss_first", "loss_last", "equal", "seconds")


def free_memory() -> None:
    if "torch" not in sys.modules:
        return
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Clock:
    """Wall time of a block with the device synchronised at both ends, and its peak device memory (GiB)."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.seconds = 0.0
        self.peak_gb: float | None = None

    def __enter__(self) -> Clock:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self.peak_gb = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        self.seconds = time.perf_counter() - self.t0


# ---------------------------------------------------------------------------------------------------- environment
def block_imports(names: list[str]) -> None:
    """Make these top-level packages unimportable in this process (to run as on the GPU image)."""
    for name in names:
        sys.modules[name] = None  # type: ignore[assignment]  # `import name` raises, find_spec says None


def peak_tflops(device_name: str) -> tuple[float | None, str]:
    """The dense bf16 peak of a device by name (``PEAK_BF16_TFLOPS``) and where the figure came from."""
    for key, value in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower() and value is not None:
            return value, f"NVIDIA datasheet, {key}, dense BF16 (half the sparsity figure)"
        if key.lower() in device_name.lower():
            break
    return None, f"no peak known for {device_name!r} (pass --peak-tflops)"


def gpu_image_gap(imported: set[str]) -> list[str]:
    """Top-level packages in ``imported`` that the GPU machine would not have: neither the standard library,
    this project, a package of the GPU image (``GPU_IMAGE_HAS`` and what they require, transitively, as
    installed here) nor a shipped wheel (``GPU_WHEELS`` only: they are installed without their requirements)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    def key(name: str) -> str:
        return name.lower().replace("_", "-")

    image: set[str] = set()
    todo = list(GPU_IMAGE_HAS)
    while todo:
        name = key(todo.pop())
        if name in image:
            continue
        image.add(name)
        with contextlib.suppress(metadata.PackageNotFoundError):
            for text in metadata.requires(name) or []:
                req = Requirement(text)
                if req.marker is None or req.marker.evaluate({"extra": ""}):
                    todo.append(req.name)
    there = image | {key(n) for n in GPU_WHEELS}
    provided = {"re2"} if "google-re2" in there else set()  # google-re2's module, not in its top_level
    provided |= {mod for mod, dists in metadata.packages_distributions().items()
                 if any(key(d) in there for d in dists)}  # fmt: skip
    own = {"pipeline", "bench", "__main__", "__mp_main__"}
    return sorted(m for m in imported if m not in sys.stdlib_module_names and m not in provided
                  and m not in own and not m.startswith("_"))  # fmt: skip


PIPELINE_MODULES = ("pipeline.modeling.placement", "pipeline.training", "pipeline.training.grpo",
                    "pipeline.training.likelihood", "pipeline.serving.runtime", "pipeline.modeling.templating",
                    "pipeline.specs.loading", "pipeline.specs.modelspec", "bench.realproportions")  # fmt: skip


def section_env(report: Report, args: argparse.Namespace) -> None:
    """Versions, the device and its peak, and ``gpu_image_gap`` of what importing the pipeline's modules the
    sections use pulls in at module level (imports inside functions: ``--block`` runs them as on the image)."""
    with report.section("env"):
        import peft  # noqa: F401 - imported before the pipeline's modules: not counted in their chain
        import torch
        import transformers  # noqa: F401

        env = report.data["env"]
        env.update(python=sys.version.split()[0], torch=torch.__version__, cuda=torch.version.cuda,
                   device=args.device, dtype=args.dtype)  # fmt: skip
        for name in ("transformers", "peft", "accelerate", "pydantic"):
            env[name] = getattr(importlib.import_module(name), "__version__", "?")
        env["datasets"] = "installed" if importlib.util.find_spec("datasets") else "missing (bench reader)"
        env["installed"] = [
            n for n in ("flash_attn", "bitsandbytes", "liger_kernel") if importlib.util.find_spec(n)
        ]
        if args.device.startswith("cuda"):
            props = torch.cuda.get_device_properties(0)
            env.update(gpu=props.name, gpu_mem_gb=round(props.total_memory / 2**30, 1),
                       capability=f"{props.major}.{props.minor}")  # fmt: skip
            peak, source = (
                (args.peak_tflops, "--peak-tflops") if args.peak_tflops else peak_tflops(props.name)
            )
        else:
            peak, source = args.peak_tflops, "--peak-tflops" if args.peak_tflops else "CPU: no MFU"
        env["peak_bf16_tflops"], env["peak_source"] = peak, source
        before = {m.split(".")[0] for m in sys.modules}
        for name in PIPELINE_MODULES:
            importlib.import_module(name)  # what the sections call: fails here first, on one line
        chain = {m.split(".")[0] for m in sys.modules if sys.modules[m] is not None} - before
        env["pipeline_imports"] = sorted(chain)
        env["gpu_image_gap"] = gpu_image_gap(chain)
        log.info("  %s", ", ".join(f"{k} {v}" for k, v in env.items()))


# ---------------------------------------------------------------------------------------------------- models
class Built:
    """A saved base model: its directory, tokenizer, LoRAs (``init``: B = 0, and one per specialist) and size."""

    def __init__(self, base: Path, adapters: dict[str, Path], params: int, matmul_params: int, layers: int):
        self.base, self.adapters, self.params, self.layers = base, adapters, params, layers
        self.matmul_params = (
            matmul_params  # N of MFU: all but an untied input embedding (a lookup, no matmul)
        )


def train_tokenizer(work: Path, tiny: bool) -> Path:
    """A byte-level BPE tokenizer trained here on the standard library's sources, with realproportions'
    ChatML template and special tokens (16,384 ids; tiny: 1,024)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from bench import realproportions as rp

    files = rp.corpus_files()
    texts = [t for t in map(rp._read, files[:: max(1, len(files) // (20 if tiny else 250))]) if t]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=1024 if tiny else 16_384, special_tokens=rp.SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))  # fmt: skip
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  bos_token=None, model_max_length=40960)  # fmt: skip
    tok.chat_template = rp.CHATML
    out = work / "tokenizer"
    tok.save_pretrained(out)
    return out


def build_base(work: Path, shape: str, layers: int, tok_dir: Path, args: argparse.Namespace) -> Built:
    """A random-weight Qwen3 of ``shape`` in the run's dtype, saved with the tokenizer, and its LoRAs. The final
    norm is scaled up (``--sharpness``) so that greedy choices are not near-ties; ids past the tokenizer get zero
    embeddings (never chosen) while the head keeps Qwen3's full vocabulary and cost."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from bench import realproportions as rp

    tok = AutoTokenizer.from_pretrained(tok_dir)
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    width = dict(rp.QWEN3_06B) if shape == "qwen3-0.6b" else dict(QWEN3_8B)
    if args.tiny:
        width.update(TINY, vocab_size=len(tok) + 64)
    else:
        width.update(num_hidden_layers=layers, vocab_size=QWEN3_VOCAB)
    config = AutoConfig.for_model("qwen3", **width, eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=args.torch_dtype)
    with torch.no_grad():
        model.model.norm.weight.mul_(args.sharpness)
        model.model.embed_tokens.weight[len(tok) :].zero_()
        model.lm_head.weight[len(tok) :].zero_()
    model.generation_config = GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad)
    base = work / shape / "base"
    model.save_pretrained(base, safe_serialization=True)
    tok.save_pretrained(base)
    params = sum(p.numel() for p in model.parameters())
    lookup = 0 if config.tie_word_embeddings else model.model.embed_tokens.weight.numel()
    adapters = save_adapters(model, work / shape, args.adapter_scale)
    del model
    return Built(base, adapters, params, params - lookup, config.num_hidden_layers)


def save_adapters(model: Any, where: Path, scale: float) -> dict[str, Path]:
    """LoRAs of the job's default shape (r 16, alpha 32, all linear layers, no dropout): ``init`` (B = 0, the
    SFT runs' common start) and one per specialist with a random B scaled by ``scale`` (decoding)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from pipeline.training import ALL_LINEAR

    out = {}
    for i, name in enumerate(("init", *SPECIALISTS)):
        torch.manual_seed(100 + i)
        config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(ALL_LINEAR),
                            task_type="CAUSAL_LM", init_lora_weights=name == "init")  # fmt: skip
        peft_model = get_peft_model(model, config)
        if name != "init":
            with torch.no_grad():
                for key, p in peft_model.named_parameters():
                    if "lora_B" in key:
                        p.mul_(scale)
        out[name] = where / f"adapter-{name}"
        peft_model.save_pretrained(out[name])
        model = peft_model.unload()
    return out


def traces(base: Path, n: int, seed: int, max_tokens: int) -> list[dict[str, Any]]:
    """``n`` chat traces of 30..``max_tokens`` tokens (log-uniform) from local text (``realproportions.traces``)."""
    from transformers import AutoTokenizer

    from bench import realproportions as rp

    rp.MAX_TOKENS = max_tokens
    return rp.traces(AutoTokenizer.from_pretrained(base), n, seed=seed)


# ---------------------------------------------------------------------------------------------------- SFT
@contextlib.contextmanager
def dataset_reader() -> Iterator[str]:
    """``datasets`` when installed; otherwise, while the block runs, a ``datasets`` module whose
    ``load_from_disk`` reads ``rows.json`` (what ``train_lora`` and ``stored_dataset_sha256`` use of a
    dataset: ``column_names``, ``select_columns``, ``iter``, ``to_list``). Yields which one."""
    if importlib.util.find_spec("datasets") is not None:
        yield "datasets"
        return

    class Rows:
        def __init__(self, rows: list[dict[str, Any]]):
            self.rows, self.column_names = rows, sorted({k for r in rows for k in r})

        def select_columns(self, columns: list[str]) -> Rows:
            return Rows([{c: r.get(c) for c in columns} for r in self.rows])

        def iter(self, batch_size: int) -> Iterator[dict[str, list[Any]]]:
            for i in range(0, len(self.rows), batch_size):
                yield {c: [r.get(c) for r in self.rows[i : i + batch_size]] for c in self.column_names}

        def to_list(self) -> list[dict[str, Any]]:
            return [dict(r) for r in self.rows]

    reader = types.ModuleType("datasets")
    reader.__spec__ = importlib.machinery.ModuleSpec("datasets", None)
    reader.load_from_disk = lambda path: Rows(json.loads((Path(path) / "rows.json").read_text()))  # type: ignore
    before = sys.modules.get("datasets", False)
    sys.modules["datasets"] = reader
    try:
        yield "bench reader (no datasets)"
    finally:
        if before is False:
            sys.modules.pop("datasets", None)
        else:
            sys.modules["datasets"] = before  # type: ignore[assignment]


def write_rows(rows: list[dict[str, Any]], path: Path, reader: str) -> None:
    if reader == "datasets":
        from pipeline.training import write_dataset

        write_dataset(rows, path)
        return
    path.mkdir(parents=True, exist_ok=True)
    (path / "rows.json").write_text(json.dumps([{"messages": r["messages"]} for r in rows]))
    (path / "state.json").write_text("{}")


def timed_row(
    marks: list[tuple[float, float]], tokens: list[int], untimed: int, peak: float | None
) -> dict[str, Any]:
    """tokens/s and ms/step over the steps after the first ``untimed``, and the losses."""
    (t0, _), (t1, _) = marks[untimed - 1], marks[-1]
    timed, steps = sum(tokens[untimed : len(marks)]), len(marks) - untimed
    return {"tok_s": round(timed / (t1 - t0), 1), "step_ms": round(1000 * (t1 - t0) / steps, 1),
            "tokens_per_step": round(timed / steps), "peak_gb": peak, "loss_first": round(marks[0][1], 5),
            "loss_last": round(marks[-1][1], 5), "losses": [round(m[1], 5) for m in marks]}  # fmt: skip


def run_train_lora(built: Built, data: Path, out: Path, args: argparse.Namespace, where: Any, batch: int,
                   tokens: list[int]) -> dict[str, Any]:  # fmt: skip
    """``train_lora`` itself from the ``init`` adapter, at the spec's defaults but steps and batch."""
    from pipeline.training import TrainConfig, train_lora

    marks: list[tuple[float, float]] = []
    config = TrainConfig(
        max_steps=args.steps, batch_size=batch, warmup_steps=2, checkpoint_every=10**9, seed=0
    )
    with Clock(where.device) as clock:
        train_lora(base_model_dir=built.base, dataset_dir=data, output_dir=out, config=config,
                   parent_adapter_dir=built.adapters["init"], where=where, lineage={"code_version": "bench-gpu"},
                   progress=lambda step, total, loss: marks.append((time.perf_counter(), loss)))  # fmt: skip
    return timed_row(marks, tokens, args.untimed, clock.peak_gb)


def run_peft_loop(built: Built, examples: list, pad: int, args: argparse.Namespace, where: Any, batch: int,
                  tokens: list[int], kind: str) -> dict[str, Any]:  # fmt: skip
    """Plain transformers + peft on the same batches, adapter start, AdamW (fused), warm-up and clipping:
    ``padded`` (right padding, attention mask) or ``padding-free`` (the batch as one row, positions restarting
    per example, no mask: transformers' packed path, as ``DataCollatorWithFlattening`` feeds it)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from pipeline.training import TrainConfig, batch_indices

    marks: list[tuple[float, float]] = []
    dev, defaults = where.device, TrainConfig()
    with Clock(dev) as clock:
        model = AutoModelForCausalLM.from_pretrained(built.base, dtype=where.torch_dtype).to(dev)
        model = PeftModel.from_pretrained(model, built.adapters["init"], is_trainable=True)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        optim = torch.optim.AdamW(params, lr=defaults.lr, weight_decay=defaults.weight_decay, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 2))
        for step in range(args.steps):
            chunk = [examples[i] for i in batch_indices(len(examples), batch, step, 0)]
            if kind == "padded":
                width = max(len(ids) for ids, _ in chunk)
                ids = torch.full((len(chunk), width), pad, dtype=torch.long)
                labels = torch.full((len(chunk), width), -100, dtype=torch.long)
                mask = torch.zeros((len(chunk), width), dtype=torch.long)
                for r, (x, y) in enumerate(chunk):
                    ids[r, : len(x)], labels[r, : len(y)], mask[r, : len(x)] = (
                        torch.tensor(x),
                        torch.tensor(y),
                        1,
                    )
                inputs = {"attention_mask": mask}
            else:
                ids = torch.tensor([t for x, _ in chunk for t in x])[None]
                labels = torch.tensor([t for _, y in chunk for t in y])[None]
                inputs = {"position_ids": torch.tensor([p for x, _ in chunk for p in range(len(x))])[None]}
            out = model(input_ids=ids.to(dev), labels=labels.to(dev), use_cache=False,
                        **{k: v.to(dev) for k, v in inputs.items()})  # fmt: skip
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            marks.append((time.perf_counter(), float(out.loss.detach())))
            del out
        del model, optim, params
    return timed_row(marks, tokens, args.untimed, clock.peak_gb)


def section_sft(report: Report, shape: str, built: Built | None, args: argparse.Namespace, where: Any,
                batch: int, baselines: tuple[str, ...]) -> None:  # fmt: skip
    with report.section(f"{shape}/sft") as entry:
        if not report.needs(entry, built, shape):
            return
        from transformers import AutoTokenizer

        from pipeline.training import batch_indices
        from pipeline.training.job import encode_dataset, sequence_limit

        rows = traces(built.base, max(batch * args.steps, 2 * batch), 7, args.max_tokens)
        tok = AutoTokenizer.from_pretrained(built.base)
        max_len = sequence_limit(built.base)
        examples = encode_dataset(tok, rows, max_len, fmt="compact", where="bench").examples
        pad = tok.pad_token_id
        tokens = [
            sum(len(examples[i][0]) for i in batch_indices(len(examples), batch, s, 0))
            for s in range(args.steps)
        ]
        lengths = sorted(len(e[0]) for e in examples)
        with dataset_reader() as reader:
            data = Path(args.work) / shape / "sft-data"
            write_rows(rows, data, reader)
            entry["setup"] = {"examples": len(examples), "batch": batch, "steps": args.steps,
                              "untimed": args.untimed, "max_len": max_len, "dataset": reader,
                              "tokens_min_median_max": [lengths[0], lengths[len(lengths) // 2], lengths[-1]],
                              "params": built.params, "mfu_n": built.matmul_params, "layers": built.layers}  # fmt: skip
            with report.row(entry, "train_lora") as row:
                row.update(
                    run_train_lora(built, data, Path(args.work) / shape / "job", args, where, batch, tokens)
                )
        for kind in baselines:
            label = f"peft+transformers {kind}"
            if report.allows(entry, label, 30 * (not args.tiny), args.budget):
                with report.row(entry, label) as row:
                    row.update(run_peft_loop(built, examples, pad, args, where, batch, tokens, kind))
        finish_sft(report, entry, built, args)


def finish_sft(report: Report, entry: dict[str, Any], built: Built, args: argparse.Namespace) -> None:
    """MFU of each row, ``train_lora`` against the strongest baseline, and the losses compared."""
    peak = report.data["env"].get("peak_bf16_tflops")
    rows = entry["rows"]
    for row in rows.values():
        if "tok_s" in row:
            row["mfu"] = round(6 * built.matmul_params * row["tok_s"] / (peak * 1e12), 4) if peak else None
    ours = rows.get("train_lora", {})
    others = {k: r for k, r in rows.items() if k != "train_lora" and "tok_s" in r}
    if "tok_s" not in ours or not others:
        return
    best = max(others, key=lambda k: others[k]["tok_s"])
    entry["vs_strongest"] = {"baseline": best, "speedup": round(ours["tok_s"] / others[best]["tok_s"], 3)}
    tol_first, tol_last = (1e-4, 1e-3) if args.dtype == "float32" else (2e-2, 5e-2)
    checks = {}
    for name, r in others.items():
        d1 = abs(r["loss_first"] - ours["loss_first"]) / abs(ours["loss_first"])
        d2 = abs(r["loss_last"] - ours["loss_last"]) / abs(ours["loss_last"])
        checks[name] = {
            "step1_rel": round(d1, 5),
            "last_rel": round(d2, 5),
            "ok": d1 <= tol_first and d2 <= tol_last,
        }
    entry["loss_checks"] = {"tolerance_step1_last": [tol_first, tol_last], "vs_train_lora": checks}
    log.info("  vs strongest: %s; losses: %s", entry.get("vs_strongest"), checks)


# ---------------------------------------------------------------------------------------------------- decoding
def prompts_of(built: Built, n: int, seed: int, max_tokens: int) -> tuple[list[str], list[list[int]]]:
    """``n`` user prompts (texts) and their ids as the serving runtime encodes them."""
    from transformers import AutoTokenizer

    from pipeline.modeling.templating import encode_prompt

    tok = AutoTokenizer.from_pretrained(built.base)
    texts = [t["messages"][0]["content"] for t in traces(built.base, n, seed, max_tokens)]
    return texts, [encode_prompt(tok, [{"role": "user", "content": t}], fmt="openai") for t in texts]


def left_padded(prompts: list[list[int]], pad: int, device: str) -> tuple[Any, Any]:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    return ids.to(device), mask.to(device)


def best_of(repeats: int, device: str, fn: Callable[[], int]) -> dict[str, Any]:
    """tokens/s of ``fn`` (which returns the tokens it decoded): the best of ``repeats`` runs (the first of a
    shape pays for allocator and library set-up) and the peak memory over them."""
    best, tokens, peak = math.inf, 0, None
    for _ in range(repeats):
        with Clock(device) as clock:
            tokens = fn()
        best = min(best, clock.seconds)
        if clock.peak_gb is not None:
            peak = max(peak or 0.0, clock.peak_gb)
    return {"tok_s": round(tokens / best, 1), "tokens": tokens, "seconds": round(best, 3), "peak_gb": peak}


def section_decode(report: Report, shape: str, built: Built | None, args: argparse.Namespace, where: Any,
                   hf: bool) -> None:  # fmt: skip
    with report.section(f"{shape}/decode") as entry:
        if not report.needs(entry, built, shape):
            return
        import dataclasses

        import torch

        from pipeline.serving.runtime import AdapterSource, GenerationRequest, load_runtime
        from pipeline.specs.loading import file_sha256
        from pipeline.training import ALL_LINEAR

        n, t = args.requests, args.new_tokens
        sources = [AdapterSource(s, built.adapters[s], file_sha256(built.adapters[s] / "adapter_model.safetensors"),
                                 16, tuple(ALL_LINEAR)) for s in SPECIALISTS]  # fmt: skip
        _, prompts = prompts_of(built, n, 11, args.max_tokens)
        mixed = [GenerationRequest(SPECIALISTS[i % 4], tuple(p), t) for i, p in enumerate(prompts)]
        base_only = [dataclasses.replace(r, adapter="__base__") for r in mixed]
        entry["setup"] = {
            "requests": n,
            "new_tokens": t,
            "adapters": len(SPECIALISTS),
            "layers": built.layers,
        }
        runtimes = {"mixed": load_runtime(built.base, sources, where=where),
                    "base": load_runtime(built.base, [], specialists=list(SPECIALISTS), where=where)}  # fmt: skip
        for rt in runtimes.values():
            rt.end_ids = (
                set()
            )  # every row decodes exactly `t` tokens: equal work in every row (HF: min_new_tokens)
            rt.generate(mixed[:2] if rt is runtimes["mixed"] else base_only[:2])  # warm-up

        def run(rt: Any, reqs: list) -> int:
            return sum(r.completion_tokens for r in rt.generate(reqs))

        with report.row(entry, "runtime base-only") as row:
            row.update(best_of(args.repeats, where.device, lambda: run(runtimes["base"], base_only)))
        with report.row(entry, "runtime 4 adapters mixed") as row:
            row.update(best_of(args.repeats, where.device, lambda: run(runtimes["mixed"], mixed)))
        if hf:
            model = runtimes.pop("base").model
            model = model.get_base_model() if hasattr(model, "get_base_model") else model
            ids, mask = left_padded(prompts, model.generation_config.pad_token_id, where.device)
            kw = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": t, "min_new_tokens": t}

            def generated(model: Any, **extra: Any) -> int:
                return int(model.generate(**kw, **extra, do_sample=False)[:, ids.shape[1] :].numel())

            with report.row(entry, "HF generate base-only") as row, torch.inference_mode():
                row.update(best_of(args.repeats, where.device, lambda: generated(model)))
            del model
            runtimes.clear()
            free_memory()
            label = "HF peft generate 4 adapters mixed"
            if report.allows(entry, label, 30 * (not args.tiny), args.budget):
                with report.row(entry, label) as row, torch.inference_mode():
                    peft = peft_mixture(built, where)
                    names = [r.adapter for r in mixed]
                    row.update(
                        best_of(args.repeats, where.device, lambda: generated(peft, adapter_names=names))
                    )
                    del peft
        runtimes.clear()
        rows = entry["rows"]
        ours, base = rows.get("runtime 4 adapters mixed", {}), rows.get("runtime base-only", {})
        hf_rows = {k: r for k, r in rows.items() if k.startswith("HF") and "tok_s" in r}
        if "tok_s" in ours and "tok_s" in base:
            entry["mixed_vs_base_only"] = round(ours["tok_s"] / base["tok_s"], 3)
        if "tok_s" in ours and hf_rows:
            best = max(hf_rows, key=lambda k: hf_rows[k]["tok_s"])
            entry["vs_strongest"] = {
                "baseline": best,
                "speedup": round(ours["tok_s"] / hf_rows[best]["tok_s"], 3),
            }
        log.info(
            "  mixed/base-only %s; vs strongest %s",
            entry.get("mixed_vs_base_only"),
            entry.get("vs_strongest"),
        )


def peft_mixture(built: Built, where: Any) -> Any:
    """Plain peft: the base with the four specialists' adapters loaded by name (``generate(adapter_names=)``)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(built.base, dtype=where.torch_dtype).to(where.device)
    first, *rest = SPECIALISTS
    peft = PeftModel.from_pretrained(model, built.adapters[first], adapter_name=first)
    for name in rest:
        peft.load_adapter(built.adapters[name], adapter_name=name)
    return peft.eval()


def section_greedy(
    report: Report, shape: str, built: Built | None, args: argparse.Namespace, where: Any
) -> None:
    """Greedy rows of one mixed batch (``--check-rows`` adapter rows and 2 base rows) vs each row alone."""
    with report.section(f"{shape}/greedy") as entry:
        if not report.needs(entry, built, shape):
            return
        import dataclasses

        from pipeline.modeling.placement import placement
        from pipeline.serving.runtime import AdapterSource, GenerationRequest, load_runtime
        from pipeline.specs.loading import file_sha256
        from pipeline.training import ALL_LINEAR

        sources = [AdapterSource(s, built.adapters[s], file_sha256(built.adapters[s] / "adapter_model.safetensors"),
                                 16, tuple(ALL_LINEAR)) for s in SPECIALISTS]  # fmt: skip
        _, prompts = prompts_of(built, args.check_rows, 13, args.max_tokens)
        reqs = [
            GenerationRequest(SPECIALISTS[i % 4], tuple(p), args.new_tokens) for i, p in enumerate(prompts)
        ]
        reqs += [dataclasses.replace(r, adapter="__base__") for r in reqs[:2]]
        for dtype in dict.fromkeys([args.dtype, "float32"]):
            if not report.allows(entry, dtype, 20 * (not args.tiny), args.budget):
                continue
            with report.row(entry, dtype) as row:
                rt = load_runtime(built.base, sources, where=placement(dtype=dtype, device=where.device))
                rt.end_ids = set()
                batched = [r.completion_ids for r in rt.generate(reqs)]
                alone = [rt.generate([r])[0].completion_ids for r in reqs]
                same_prompt = [
                    (i, len(reqs) - 2 + i) for i in range(2)
                ]  # adapter row vs the base row of its prompt
                row.update(equal=f"{sum(a == b for a, b in zip(batched, alone, strict=True))}/{len(reqs)}",
                           adapter_differs_from_base=f"{sum(batched[i] != batched[j] for i, j in same_prompt)}/2",
                           )  # fmt: skip
                del rt


def section_grpo(
    report: Report, shape: str, built: Built | None, args: argparse.Namespace, where: Any
) -> None:
    """GRPO rollouts: ``roll_out`` (``pipeline.training.episodes``) on the job's policy model (``policy_model``
    from a parent adapter, under ``merged_lora`` as ``train_grpo`` runs it), prompts x group episodes of one turn
    at temperature 1, vs HF ``generate`` sampling the same rows on the same PeftModel. Tokens: the completions'
    (rollouts: re-encoded from their text, +1 end token; HF: up to the first end token)."""
    with report.section(f"{shape}/grpo") as entry:
        if not report.needs(entry, built, shape) or not report.allows(
            entry, "all", 40 * (not args.tiny), args.budget
        ):
            return
        import torch
        from transformers import AutoTokenizer

        from pipeline.specs.modelspec import GrpoSettings
        from pipeline.training import ALL_LINEAR

        try:  # roll_out's home since issue 26 (grpo imports it from there)
            from pipeline.training.episodes import Episodes, roll_out
        except ImportError:
            from pipeline.training.grpo import Episodes, roll_out
        from pipeline.training.kernels import merged_lora
        from pipeline.training.likelihood import policy_model

        tok = AutoTokenizer.from_pretrained(built.base)
        texts, prompts = prompts_of(built, args.grpo_prompts, 17, args.max_tokens)
        items = [{"messages": [{"role": "user", "content": t}], "metadata": {}} for t in texts]
        settings = GrpoSettings(group_size=args.grpo_group, temperature=1.0, max_turns=1)
        episodes = Episodes(
            items=items, view=lambda m: m, reward=lambda trace: None, max_new_tokens=args.new_tokens
        )
        policy = policy_model(built.base, rank=16, alpha=32, dropout=0.0, target_modules=ALL_LINEAR,
                              parent_adapter_dir=built.adapters["chat"], where=where).eval()  # fmt: skip
        entry["setup"] = {"prompts": len(items), "group": args.grpo_group, "max_new_tokens": args.new_tokens}

        def rollouts() -> int:
            done = roll_out(policy, tok, items, episodes, settings, fmt="compact", seed=0)
            replies = [t["messages"][-1].get("content") or "" for t in done]
            return sum(len(tok(r, add_special_tokens=False)["input_ids"]) + 1 for r in replies)

        with merged_lora(policy), report.row(entry, "grpo.roll_out") as row:
            row.update(best_of(args.repeats, where.device, rollouts))
        ids, mask = left_padded(
            [p for p in prompts for _ in range(args.grpo_group)], tok.pad_token_id, where.device
        )
        ends = torch.tensor(sorted({tok.eos_token_id, tok.pad_token_id}), device=where.device)

        def sampled() -> int:
            new = policy.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                  max_new_tokens=args.new_tokens)[:, ids.shape[1] :]  # fmt: skip
            ended = torch.isin(new, ends).int().cumsum(-1)
            return int(((ended == 0) | ((ended == 1) & torch.isin(new, ends))).sum())

        with report.row(entry, "HF generate, same PeftModel") as row, torch.inference_mode():
            row.update(best_of(args.repeats, where.device, sampled))
        rows = entry["rows"]
        if "tok_s" in rows["grpo.roll_out"] and "tok_s" in rows["HF generate, same PeftModel"]:
            entry["vs_strongest"] = {"baseline": "HF generate, same PeftModel", "speedup": round(
                rows["grpo.roll_out"]["tok_s"] / rows["HF generate, same PeftModel"]["tok_s"], 3)}  # fmt: skip


# ---------------------------------------------------------------------------------------------------- the run
def section_build(
    report: Report, shape: str, layers: int, tok_dir: Path | None, args: argparse.Namespace
) -> Built | None:
    built = None
    with report.section(f"{shape}/build") as entry:
        if tok_dir is None:
            raise RuntimeError("needs the tokenizer, which did not train")
        label = "random-weight base and LoRAs"
        need = (
            0 if args.tiny else (SECONDS_8B_FIXED + 2 * SECONDS_PER_8B_LAYER if shape == "qwen3-8b" else 20)
        )
        if not report.allows(entry, label, need, args.budget):
            return None
        with report.row(entry, label) as row:
            with Clock(args.device) as clock:
                built = build_base(Path(args.work), shape, layers, tok_dir, args)
            row.update(params=built.params, layers=built.layers, seconds=round(clock.seconds, 1),
                       weights_gb=round(built.params * args.torch_dtype.itemsize / 2**30, 2))  # fmt: skip
    return built


def layers_8b(report: Report, args: argparse.Namespace) -> int:
    """Qwen3-8B's layers that fit the budget left: ``SECONDS_PER_8B_LAYER`` each (building, saving, three loads,
    training and decoding at batch 64) after a fixed ``SECONDS_8B_FIXED`` -- estimates until a GPU run measures
    them -- at least 2, at most 36."""
    if args.layers_8b:
        return args.layers_8b
    left = args.budget - report.elapsed() - SECONDS_8B_FIXED
    return max(2, min(36, int(left / SECONDS_PER_8B_LAYER)))


SECONDS_PER_8B_LAYER, SECONDS_8B_FIXED = 4.0, 60.0


def run(args: argparse.Namespace, report: Report) -> None:
    section_env(report, args)
    from pipeline.modeling.placement import placement

    where = placement(dtype=args.dtype, device=args.device)
    tok_dir = None
    with report.section("tokenizer") as entry, report.row(entry, "byte-level BPE") as row:
        with Clock("cpu") as clock:
            tok_dir = train_tokenizer(Path(args.work), args.tiny)
        row["seconds"] = round(clock.seconds, 1)
    small = section_build(report, "qwen3-0.6b", 28, tok_dir, args)
    section_sft(report, "qwen3-0.6b", small, args, where, args.batch, ("padded", "padding-free"))
    section_decode(report, "qwen3-0.6b", small, args, where, hf=True)
    section_greedy(report, "qwen3-0.6b", small, args, where)
    section_grpo(report, "qwen3-0.6b", small, args, where)
    large = section_build(report, "qwen3-8b", layers_8b(report, args), tok_dir, args)
    section_sft(report, "qwen3-8b", large, args, where, args.batch, ("padding-free",))
    section_decode(report, "qwen3-8b", large, args, where, hf=False)


def summarize(report: Report) -> None:
    """The ratios of every section, and which sections failed or were skipped."""
    sections = report.data["sections"]
    report.data["summary"] = {
        name: {k: v for k, v in s.items() if k in ("vs_strongest", "mixed_vs_base_only")}
        for name, s in sections.items() if "vs_strongest" in s or "mixed_vs_base_only" in s
    }  # fmt: skip
    report.data["summary"]["failed"] = [n for n, s in sections.items() if s["status"] == "failed"]
    report.data["summary"]["skipped"] = [n for n, s in sections.items() if s["status"] == "skipped"]


def prepare(target: Path) -> None:
    """Download the wheels of ``GPU_WHEELS`` the GPU machine lacks (Python 3.12, manylinux x86-64), at the
    versions installed here, into ``target`` (``.gpu/whl``: it travels with the tree; docs/gpu.md)."""
    import subprocess
    from importlib import metadata

    pins = [f"{name}=={metadata.version(name)}" for name in GPU_WHEELS]
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                    "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "-d", str(target),
                    *pins], check=True)  # fmt: skip
    log.info("%d wheels in %s", len(list(target.glob("*.whl"))), target)


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="toy shapes on the CPU: a dry run of the same code")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--dtype", default="bfloat16", help="the base's dtype (bfloat16; float32 for a check)")
    ap.add_argument(
        "--out", type=Path, default=None, help="JSON results (default $OUT/gpu.json or bench/out/gpu.json)"
    )
    ap.add_argument("--work", default=None, help="where models and adapters are built (default: a temp dir)")
    ap.add_argument("--budget", type=float, default=None, help="seconds; rows past it are skipped (GPU 330)")
    ap.add_argument(
        "--layers-8b", type=int, default=None, help="the 8B shape's layers (default: by the budget)"
    )
    ap.add_argument(
        "--peak-tflops", type=float, default=None, help="the device's bf16 peak, if not in the table"
    )
    ap.add_argument("--block", default="", help="comma-separated packages made unimportable (the GPU image: "
                    + ",".join(GPU_IMAGE_MISSING) + ")")  # fmt: skip
    ap.add_argument("--prepare", type=Path, default=None, help="only download the GPU machine's wheels here")
    ap.add_argument("--sharpness", type=float, default=8.0, help="final-norm scale (sharper greedy choices)")
    ap.add_argument("--adapter-scale", type=float, default=0.5, help="scale of the decode adapters' random B")
    args = ap.parse_args(argv)
    args.steps, args.untimed, args.batch = (3, 1, 4) if args.tiny else (8, 2, 64)
    args.requests, args.new_tokens, args.max_tokens = (4, 4, 80) if args.tiny else (64, 64, 512)
    args.check_rows, args.repeats = (4, 1) if args.tiny else (8, 2)
    args.grpo_prompts, args.grpo_group = (2, 2) if args.tiny else (16, 8)
    args.budget = args.budget or (900.0 if args.tiny else 330.0)
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
    log.setLevel(logging.INFO)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    args = arguments(argv)
    if args.prepare:
        prepare(args.prepare)
        return 0
    block_imports([n for n in args.block.split(",") if n])
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    args.torch_dtype = getattr(torch, args.dtype)
    own_work = args.work is None
    args.work = args.work or tempfile.mkdtemp(prefix="ratchet-bench-gpu-")
    out = args.out or (
        Path(os.environ["OUT"]) / "gpu.json" if os.environ.get("OUT") else ROOT / "bench/out/gpu.json"
    )
    report = Report(out, {"argv": sys.argv[1:], "tiny": args.tiny, "budget_s": args.budget,
                          "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})  # fmt: skip
    log.info("bench/gpu.py: device %s, %s, tiny=%s, budget %.0f s, results %s", args.device, args.dtype, args.tiny,
             args.budget, out)  # fmt: skip
    try:
        run(args, report)
    except Exception as exc:  # noqa: BLE001 - outside any section (the pipeline cannot be imported): one line
        report.data["fatal"] = one_line(exc)
        log.info("!! fatal: %s", report.data["fatal"])
    finally:
        summarize(report)
        report.save()
        if own_work:
            shutil.rmtree(args.work, ignore_errors=True)
    summary = report.data["summary"]
    log.info("summary: %s", json.dumps(summary))
    log.info("%.0f s; wrote %s", report.elapsed(), out)
    return 1 if summary["failed"] or "fatal" in report.data else 0


if __name__ == "__main__":
    sys.exit(main())
