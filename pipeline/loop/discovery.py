"""Discovery: before collecting, find task variants the champion can do sometimes but not reliably.

For each specialist with a task source, ``discover_step`` draws training items (the held-out predicate
applied, as for collection), makes variants of them -- the source's own ``variants`` (the demo: nearby
operands, swapped order, another tool or widget; training-split problems only), or, for a source without
one, compositions: another training item's question and reference answer written ahead of the item's own
question, whose checks still apply -- leaves out every variant the shared held-out predicate
matches, and has the champion answer each ``discovery_samples`` times at the collection temperature. A
variant is kept when the contract solves (verified, total at least ``selection.min_score``) more than none
and fewer than half of its samples: within reach, not yet learned.

Kept variants are written as JSONL under the generation's artifacts (path and sha256 in the step's outcome);
collection practises on them in place of as many regular prompts, GRPO adds them to its prompt pool, and
evaluation reports how the champion and the candidate answer them (greedy, contract totals).
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.errors import RatchetError
from pipeline.loop.candidate import (
    AdvanceConfig,
    Progress,
    artifacts_for,
    contract_of,
    load_generation,
    mark_step,
    step_seed,
)
from pipeline.loop.clock import CLOCK
from pipeline.modeling.pair import answer_items, pair_for_generation
from pipeline.registry import get_engine, session_scope
from pipeline.registry.documents import GenerationState
from pipeline.registry.locations import home_path, stored_path
from pipeline.scoring import score_trace
from pipeline.specs.contract import file_reader
from pipeline.specs.heldout import heldout_index
from pipeline.specs.tasksource import draw, task_sources

if TYPE_CHECKING:
    from pipeline.specs.contract import ContractSpec
    from pipeline.specs.harness import HarnessSpec
    from pipeline.specs.heldout import HeldoutIndex
    from pipeline.specs.tasksource import TaskSource


def composed_variants(items: list[dict[str, Any]], n: int, seed: int) -> list[dict[str, Any]]:
    """Up to ``n`` compositions of ``items``: another item's question and reference answer
    (``metadata.expected``, text) written into the item's first user message ahead of its own question; the
    item's checks apply unchanged. The prefix is text in the user's turn, never an assistant turn: nothing in
    the conversation is scored but the reply to the item."""
    rng = random.Random(f"compose:{seed}")
    answered = [
        it
        for it in items
        if isinstance((it.get("metadata") or {}).get("expected"), str)
        and not (it.get("metadata") or {}).get("expected_call")
        and isinstance(_first_user(it), str)
    ]
    out, seen = [], set()
    for _ in range(4 * n):
        if len(out) >= n or not answered or len(items) < 2:
            break
        item, prior = rng.choice(items), rng.choice(answered)
        first = next((i for i, m in enumerate(item["messages"]) if m.get("role") == "user"), None)
        if prior is item or first is None or not isinstance(item["messages"][first].get("content"), str):
            continue
        messages = [dict(m) for m in item["messages"]]
        lead = f"{_first_user(prior)}\n{prior['metadata']['expected']}\n\n"
        messages[first]["content"] = lead + messages[first]["content"]
        key = json.dumps(messages, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        out.append({"messages": messages, "metadata": dict(item.get("metadata") or {}), "feedback": None})
    return out


def _first_user(item: dict[str, Any]) -> Any:
    return next((m.get("content") for m in item["messages"] if m.get("role") == "user"), None)


def make_variants(source: TaskSource, items: list[dict[str, Any]], n: int, seed: int) -> list[dict[str, Any]]:
    """The source's ``variants`` when it has them, else ``composed_variants``."""
    own = getattr(source, "variants", None)
    return own(items, n, seed) if callable(own) else composed_variants(items, n, seed)


def solved(contract: ContractSpec, trace: dict[str, Any], *, harness: HarnessSpec, specialist: str) -> bool:
    """Whether the contract counts a trace as solved: what it would learn from (its final turn passed a
    verifying check, none failed, and scores at least the selection threshold)."""

    result = score_trace(contract, trace, harness=harness, specialist=specialist)
    return result.learnable(contract.selection.min_score)


def solved_counts(
    contract: ContractSpec,
    attempts: list[list[dict[str, Any]]],
    *,
    harness: HarnessSpec,
    specialist: str,
) -> list[int]:
    """Per item, how many of its sampled traces (``attempts``) are ``solved``, timed as contract scoring
    (``CLOCK``'s ``score``, as the scoring step's). One after another: in a pool of two threads (the scoring
    step's) the demo's 4,096 took as long or longer on two cores (the rule-based scorers hold the GIL)."""

    with CLOCK.measure("score"):
        return [
            sum(solved(contract, t, harness=harness, specialist=specialist) for t in item)
            for item in attempts
        ]


def discover_step(
    *, generation_id: int, config: AdvanceConfig, progress: Progress | None = None
) -> dict[str, Any]:
    """Find, per specialist with a task source, variants the champion solves in (0, k/2) of k samples."""

    engine = get_engine()
    with session_scope(engine) as session:
        gen = load_generation(session, generation_id)
        number = gen.number
        if not (config.collect and config.discover):
            outcome = {"skipped": "discovery is off" if config.collect else "collection is off"}
            mark_step(session, gen, "discover", outcome)
            return outcome
        pair = pair_for_generation(load_generation(session, gen.parent_id))
        contract = contract_of(gen)
    sources = task_sources(contract, read=file_reader(contract))
    index = heldout_index(contract)
    k = config.discovery_samples
    tried: dict[str, list[dict[str, Any]]] = {}
    left_out: dict[str, int] = {}
    for s in sorted(set(pair.adapters) & set(sources)):
        seed = step_seed(config, number, f"discover:{s}")
        items, _ = draw(sources[s], "train", config.discovery_candidates, seed, heldout=index)
        variants = make_variants(sources[s], items, config.discovery_candidates, seed)
        tried[s], left_out[s] = keep_allowed(variants, index)
    answered = answer_items(
        pair,
        tried,
        num_samples=k,
        temperature=config.temperature,
        seed=step_seed(config, number, "discover-sample"),
        progress=(lambda d, t: progress("discover", d, t)) if progress else None,
    )
    out_dir = artifacts_for(config.lineage, number) / "discovery"
    found: dict[str, Any] = {}
    for s, attempts in answered.items():
        kept = []
        counts = solved_counts(contract, attempts, harness=pair.harness, specialist=s)
        for item, wins in zip(tried[s], counts, strict=True):
            if 0 < wins < k / 2:
                kept.append({**item, "metadata": {**item["metadata"], "discovered_pass_rate": wins / k}})
        found[s] = {"tried": len(tried[s]), "found": len(kept), "held_out_left_out": left_out[s]}
        if kept:
            found[s].update(write_variants(kept, out_dir / f"{s}.jsonl"))
    with session_scope(engine) as session:
        outcome = {"samples": k, "specialists": found}
        mark_step(session, load_generation(session, generation_id), "discover", outcome)
    return outcome


def keep_allowed(variants: list[dict[str, Any]], index: HeldoutIndex) -> tuple[list[dict[str, Any]], int]:
    """The variants the held-out predicate lets through (none a source marked held-out or validation), and how
    many were stopped."""
    kept = []
    for v in variants:
        given = v.get("metadata") or {}
        if given.get("split") not in (None, "train"):  # a source's validation item is never practised
            continue
        if index.exclusion(messages=v.get("messages") or [], metadata=given) is None:
            kept.append({**v, "metadata": {**given, "split": "train", "discovered": True}})
    return kept, len(variants) - len(kept)


def write_variants(items: list[dict[str, Any]], path: Path) -> dict[str, Any]:
    """Write items as JSONL; their path, count and sha256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(it, sort_keys=True, separators=(",", ":")) + "\n" for it in items)
    path.write_text(text)
    # the path as the registry keeps paths: relative to the home when inside it (the home may move)
    return {"path": stored_path(path), "sha256": hashlib.sha256(text.encode()).hexdigest()}


def discovered_items(state: GenerationState | dict[str, Any] | None, specialist: str) -> list[dict[str, Any]]:
    """The variants discovery kept for ``specialist`` in a generation (its ``state``), checked against the
    recorded sha256; [] when there are none."""
    discover = GenerationState.model_validate(state or {}).steps.discover
    entry = discover.specialists.get(specialist) if discover is not None else None
    if entry is None or not entry.path:
        return []
    path = Path(home_path(entry.path))
    try:
        text = path.read_text()
    except OSError as exc:
        raise RatchetError(
            f"{path}: the discovered variants of {specialist} cannot be read ({exc})"
        ) from None
    if hashlib.sha256(text.encode()).hexdigest() != entry.sha256:
        raise RatchetError(
            f"{path}: the discovered variants of {specialist} do not match their recorded sha256"
        )
    return [json.loads(line) for line in text.splitlines() if line.strip()]
