"""Spec files for a lineage cheap enough to advance inside a fast test: one specialist (chat, SFT) on a small
tiny base that is built in the home (so its path lies inside it), and the demo contract with small held-out
suites. Used where the ``ratchet`` commands themselves are under test (``test_wheel``, ``test_home``)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
# the conftest's SMALL tiny model, as a model spec's ``base.tiny``
SMALL_TINY = {
    "vocab": "char",
    "hidden_size": 48,
    "num_layers": 2,
    "num_heads": 2,
    "intermediate_size": 96,
    "max_position_embeddings": 64,
    "pretrain": {"steps": 60, "batch_size": 32, "corpus_size": 1000, "seed": 3},
}
# `ratchet advance` options that keep one generation small
ADVANCE_ARGS = [
    "--prompts", "12", "--samples", "1", "--no-codesign", "--no-discover", "--min-examples", "2",
    "--validation-items", "4",
]  # fmt: skip


def write_small_specs(folder: Path, *, heldout_size: int = 8) -> dict[str, Path]:
    """The model spec and contract files (and a feedback JSONL of corrected chat traces) in ``folder``."""
    from pipeline.environment import reference_answer, sample_prompts

    folder.mkdir(parents=True, exist_ok=True)
    model = {
        "name": "small-tiny",
        "base": {"tiny": SMALL_TINY},
        "specialists": {
            "chat": {"lora": {"rank": 4, "alpha": 8}, "training": {"epochs": 1, "batch_size": 16}}
        },
    }
    contract = yaml.safe_load((ROOT / "contracts" / "demo.yaml").read_text())
    contract["version"] = "small"
    for suite in contract["heldout"] + contract.get("retention", []):
        suite["size"] = heldout_size
    paths = {
        "model": folder / "model.yaml",
        "contract": folder / "contract.yaml",
        "harness": ROOT / "harnesses" / "demo.yaml",
        "feedback": folder / "feedback.jsonl",
    }
    paths["model"].write_text(yaml.safe_dump(model))
    paths["contract"].write_text(yaml.safe_dump(contract))
    with open(paths["feedback"], "w") as fh:
        for item in sample_prompts("chat", 12, seed=99):
            trace = {
                "messages": [*item["messages"], {"role": "assistant", "content": "?"}],
                "metadata": item["metadata"],
                "feedback": {"rating": 1, "correction": reference_answer(item)},
            }
            fh.write(json.dumps(trace) + "\n")
    return paths
