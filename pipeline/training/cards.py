"""An adapter's model card: ``README.md`` in its directory, in Hugging Face's ``ModelCard`` format (YAML front
matter with ``base_model``, ``library_name: peft`` and tags, then Markdown), made from its ``lineage.json``.

peft's ``save_pretrained`` writes an empty template card; ``artifacts.save_adapter`` writes this one over it
when the adapter is saved: base model, method, dataset hash and size, parent, contract and harness versions,
training figures. Its held-out scores are not known yet then: ``write_model_card`` is called again once the
generation is decided (``pipeline.loop.publication``), with the scores, the retention suites and the
decision, and replaces the file atomically. The decision is the moment the card can be complete: the
evaluation alone could still be re-run (a crash before the decision) and would name scores with no verdict.
The weights and ``lineage.json`` are never rewritten (the adapter's sha256 is of the weights).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CARD = "README.md"


@dataclass(frozen=True)
class CardScores:
    """What the evaluation and the decision said of one adapter's generation (scores in [0, 1])."""

    decision: str  # promoted | rejected: what the decide step did
    candidate: float | None  # this specialist's held-out mean, the adapter's pair
    champion: float | None  # the same suite, the champion it was compared with
    overall: float | None
    champion_overall: float | None
    # retention suites the specialist answers: name -> (champion's mean, this generation's mean)
    retention: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)
    reasons: tuple[str, ...] = ()


def _score(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _front_matter(record: dict[str, Any]) -> str:
    from huggingface_hub import ModelCardData

    tags = ["ratchet", "lora", *(str(record[k]) for k in ("method",) if record.get(k))]
    tags += [f"{k}:{record[k]}" for k in ("lineage", "specialist") if record.get(k)]
    data = ModelCardData(base_model=record.get("base_model"), library_name="peft", tags=tags)
    return data.to_yaml()


def _token_ids(record: dict[str, Any]) -> list[tuple[str, str]]:
    """Where the trained ids came from (``TrainResult.token_ids``): the ids the server decoded, or a
    re-rendering of the stored text; no row when the record does not say (GRPO, older adapters)."""
    counts = record.get("token_ids")
    if not isinstance(counts, dict) or not counts:
        return []
    served = sum(n for how, n in counts.items() if str(how).endswith("served"))
    detail = ", ".join(f"{n} {how}" for how, n in sorted(counts.items()))
    return [("Token ids", f"{served} of {sum(counts.values())} as served ({detail})")]


def _facts(record: dict[str, Any]) -> list[tuple[str, str]]:
    size = next(
        (f"{record[k]} {k}" for k in ("examples", "pairs", "prompts") if record.get(k) is not None), None
    )
    rows = record.get("dataset_rows")
    dataset = record.get("dataset_sha256") or record.get("prompt_pool_sha256")
    parent = record.get("parent_generation")
    parent_sha = record.get("parent_adapter_sha256")
    parent_adapter = f"sha256 `{parent_sha}`" if parent_sha else "none (a fresh LoRA)"
    return [
        (
            "Base model",
            f"{record.get('base_model', '-')} (weights sha256 `{record.get('base_model_sha256', '-')}`)",
        ),
        ("Method", str(record.get("method", "-"))),
        (
            "Dataset" if record.get("dataset_sha256") else "Prompt pool",
            f"sha256 `{dataset or '-'}`"
            + (f", {rows} rows" if rows is not None else "")
            + (f", {size} trained on" if size else ""),
        ),
        *_token_ids(record),
        (
            "Parent",
            f"generation {parent}" if parent is not None else "-",
        ),
        ("Parent adapter", parent_adapter),
        ("Contract", f"{record.get('contract', '-')} (sha256 `{record.get('contract_sha256', '-')}`)"),
        ("Harness", f"{record.get('harness', '-')} (sha256 `{record.get('harness_sha256', '-')}`)"),
        ("Adapter weights", f"sha256 `{record.get('adapter_sha256', '-')}`"),
        ("Steps", str(record.get("steps", "-"))),
        (
            "Final reward" if "final_reward" in record else "Final loss",
            _score(record.get("final_reward", record.get("final_loss"))),
        ),
        ("Code version", str(record.get("code_version", "-"))),
    ]


def _evaluation(scores: CardScores | None, specialist: str) -> list[str]:
    if scores is None:
        return [
            "Not evaluated yet: this card is rewritten with the held-out scores and the promotion decision once "
            "the generation is decided."
        ]
    lines = [
        f"**Decision: {scores.decision}** (this generation against the champion it was built from).",
        "",
        "| Suite | Champion | This generation |",
        "|---|---|---|",
        f"| held-out: {specialist} | {_score(scores.champion)} | {_score(scores.candidate)} |",
        f"| held-out: overall | {_score(scores.champion_overall)} | {_score(scores.overall)} |",
    ]
    lines += [
        f"| retention: {name} | {_score(before)} | {_score(after)} |"
        for name, (before, after) in sorted(scores.retention.items())
    ]
    if scores.reasons:
        lines += ["", "Why:", "", *(f"- {reason}" for reason in scores.reasons)]
    return lines


def model_card(record: dict[str, Any], scores: CardScores | None = None) -> str:
    """The card of the adapter ``record`` (its ``lineage.json``) describes, as text; ``scores`` once decided."""
    from huggingface_hub import ModelCard

    specialist = record.get("specialist", "adapter")
    title = f"{record.get('lineage', 'ratchet')}: generation {record.get('generation', '-')}, {specialist}"
    body = [
        f"# {title}",
        "",
        f"A LoRA adapter trained by Ratchet ({record.get('method', '-')}) for the `{specialist}` specialist. "
        f"Load it with peft on its base model; `lineage.json` beside it holds the full training record.",
        "",
        "## Lineage",
        "",
        "| | |",
        "|---|---|",
        *(f"| {name} | {value} |" for name, value in _facts(record)),
        "",
        "## Evaluation",
        "",
        *_evaluation(scores, specialist),
    ]
    return str(ModelCard(f"---\n{_front_matter(record)}\n---\n\n" + "\n".join(body) + "\n"))


def write_model_card(adapter_dir: Path, *, record: dict[str, Any] | None = None,
                     scores: CardScores | None = None) -> Path:  # fmt: skip
    """Write (or replace, atomically) ``adapter_dir/README.md``; ``record`` defaults to its ``lineage.json``."""
    adapter_dir = Path(adapter_dir)
    if record is None:
        record = json.loads((adapter_dir / "lineage.json").read_text())
    path, tmp = adapter_dir / CARD, adapter_dir / f".{CARD}.tmp-{os.getpid()}"
    tmp.write_text(model_card(record, scores))
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return path
