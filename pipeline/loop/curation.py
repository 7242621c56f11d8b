"""Curation: scored experience becomes one dataset per specialist, under the contract's selection rules.

A trace may be learned from only when the contract verified it or a user's correction passed it, and never
when it is held out (``pipeline.experience.eligibility``, the gate every consumer of experience passes through); SFT
examples must also reach the selection threshold. ``curate_step`` writes, per specialist and by the method
its model spec names, SFT examples (``select_examples``), preference pairs (``pipeline.experience.preferences``), or
nothing (``grpo`` practises online).

Reasons a turn is dropped, in the order they are decided: ``specialist not trained``, ``source not
selected``, ``unverified`` (no verifying scorer checked the final turn, no accepted correction), ``failed
check`` (a verifying check on the final turn failed, whatever the total), ``below threshold``, ``correction
failed the contract``, ``reply stopped before its end``, ``held-out``, ``no assistant turn``, ``validation
slice``, ``duplicate``, ``over principal share`` (``selection.max_share_per_principal``), ``over cap``;
then, as the rows are built (``training_rows``), ``malformed metadata.tools``, ``cannot be rendered`` and
``cannot be stored`` (Arrow cannot hold the row beside the others): one row never stops a generation.
Every drop is also counted by the principal whose row it was (``Drops.principals``).

The validation slice of a specialist without a task source (``eligibility.in_validation_slice``) is never
trained on.

A reply the server decoded was stored with the exact ids it was given and wrote (``Experience.served_tokens``,
by the message's index). A row keeps them (``served_tokens``; a preference row's other side
``rejected_served_tokens``: ``documents.ServedTokens`` as JSON text, empty when none) only when the reply it
trains on is that served message itself, not a user's correction in its place (``served_entry``); the
training job uses them when its tokenizer is the one that served them (``packing.encode_reply``), and they
are part of what the dataset's hash covers.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.experience.eligibility import (
    Candidate,
    Drops,
    accepted_correction,
    cap_principal_share,
    excluded,
    in_validation_slice,
    lineage_candidates,
    prompt_key,
)
from pipeline.experience.preferences import preference_pairs
from pipeline.experience.toolcalls import normalize_tool_calls, tools_problem
from pipeline.loop.candidate import artifacts_for, contract_of, load_generation, mark_step
from pipeline.modeling.pair import offered_tools
from pipeline.modeling.prompting import render_messages
from pipeline.registry import DatasetExample, Experience, TrainingDataset, get_engine, session_scope
from pipeline.registry.documents import CurateOutcome, ServedTokens
from pipeline.serving.views import recorded_writer
from pipeline.specs.contract import ContractSpec
from pipeline.specs.harness import HarnessSpec
from pipeline.specs.heldout import heldout_index
from pipeline.specs.modelspec import ModelSpec
from pipeline.training.artifacts import stored_dataset_sha256

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from pipeline.loop.candidate import AdvanceConfig, Progress
    from pipeline.specs.heldout import HeldoutIndex

log = logging.getLogger(__name__)


@dataclass
class CurationResult:
    """What curation kept per specialist, and why the rest was left out."""

    examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    dropped: Drops = field(default_factory=Drops)


@dataclass(frozen=True)
class _Row:
    """A selected turn on its way into a dataset."""

    score: float
    order: int  # arrival order: larger is newer
    messages: list[dict[str, Any]]
    experience_id: int
    tools: Any
    principal: str | None  # whose row it is (the corrector's, for an accepted correction)


def _content_key(messages: list[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()


def select_examples(
    candidates: list[Candidate],
    *,
    contract: ContractSpec,
    heldout: HeldoutIndex,
    specialists: list[str] | None = None,
) -> CurationResult:
    """Apply the contract's selection rules: verification, corrections, threshold, held-out, dedup, caps.

    Only the final assistant turn of each selected conversation is a training target (``packing``);
    the turns before it are context."""
    from pipeline.serving.turns import STOPPED  # lazy: imports fastapi

    rules = contract.selection
    wanted = set(specialists) if specialists is not None else set(contract.specialists)
    sliced = {s for s, entry in contract.specialists.items() if entry.tasks is None}
    best: dict[str, dict[str, _Row]] = {s: {} for s in wanted}
    result = CurationResult()

    def drop(cand: Candidate, reason: str, principal: str | None = None) -> None:
        result.dropped.add(cand.specialist, reason, principal=principal or cand.principal)

    for order, cand in enumerate(candidates):
        if cand.specialist not in wanted:
            drop(cand, "specialist not trained")
            continue
        if rules.sources is not None and cand.source not in rules.sources:
            drop(cand, "source not selected")
            continue
        messages = accepted_correction(cand, contract)
        principal = cand.corrector() if messages is not None else cand.principal
        score = cand.correction["total"] if messages is not None and cand.correction else cand.score
        if messages is None:
            usable = cand.passed and cand.score is not None and cand.score >= rules.min_score
            if not usable:
                why = (
                    "unverified"
                    if not cand.verified
                    else "failed check"
                    if cand.failed
                    else "below threshold"
                )
                failed = cand.correction and rules.use_corrections
                drop(cand, "correction failed the contract" if failed else why)
                continue
            messages = cand.messages
            if cand.metadata.get("finish_reason") in STOPPED:  # cut off (timeout, disconnect): never whole
                drop(cand, "reply stopped before its end")
                continue
        if excluded(cand, heldout) or heldout.teaches(messages, cand.metadata):
            drop(cand, "held-out", principal)
            continue
        if not any(m.get("role") == "assistant" for m in messages):
            drop(cand, "no assistant turn", principal)
            continue
        if cand.specialist in sliced and in_validation_slice(messages, rules.validation_share):
            drop(cand, "validation slice", principal)
            continue
        key = (
            prompt_key(messages)
            if rules.dedup == "prompt"
            else _content_key(messages)
            if rules.dedup == "content"
            else str(order)
        )
        slot = best[cand.specialist]
        row = _Row(float(score), order, messages, cand.experience_id, cand.metadata.get("tools"), principal)
        if key in slot:
            loser = slot[key] if slot[key].score < row.score else row
            result.dropped.add(cand.specialist, "duplicate", principal=loser.principal)
            if loser is row:
                continue
        slot[key] = row
    for specialist, slot in best.items():
        # highest scores first; among equal scores the newest: accumulated experience outgrows the cap, and
        # the newest was earned by the best policy (the problems it newly solves are at the end)
        ranked = sorted(slot.values(), key=lambda item: (-item.score, -item.order))
        cap = rules.max_examples.get(specialist, rules.max_examples_per_specialist)
        chosen, over_share = cap_principal_share(
            ranked, share=rules.max_share_per_principal, principal_of=lambda r: r.principal, cap=cap
        )
        placed = {id(r) for r in chosen} | {id(r) for r in over_share}
        over_cap = [r for r in ranked if id(r) not in placed]
        for reason, rows in (("over principal share", over_share), ("over cap", over_cap)):
            for r in rows:
                result.dropped.add(specialist, reason, principal=r.principal)
        chosen.sort(key=lambda item: item.order)  # keep arrival order in the dataset
        result.examples[specialist] = [
            {"messages": r.messages, "score": r.score, "experience_id": r.experience_id, "tools": r.tools}
            for r in chosen
        ]
    return result


def _served_text(served: dict[str, Any] | None) -> str:
    return json.dumps(served, sort_keys=True, separators=(",", ":")) if served else ""


def dataset_row(example: dict[str, Any]) -> dict[str, Any]:
    """The dataset row of an example. Tools: the schemas the chat template was given; served tokens: the ids
    its reply was served with (``served_entry``; empty: none) -- JSON text both, one column type for every
    row."""
    e = example
    row = {
        "messages": e["messages"],
        "score": e["score"],
        "experience_id": e["experience_id"],
        "tools": json.dumps(e.get("tools") or [], separators=(",", ":")),
        "served_tokens": _served_text(e.get("served_tokens")),
    }
    if "rejected" in e:
        row |= {
            "rejected": e["rejected"],
            "rejected_score": e["rejected_score"],
            "rejected_experience_id": e["rejected_experience_id"],
            "rejected_served_tokens": _served_text(e.get("rejected_served_tokens")),
        }
    return row


def _final_reply(messages: list[dict[str, Any]]) -> int | None:
    return max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)


def _reply_body(message: dict[str, Any]) -> tuple[Any, Any]:
    normal = normalize_tool_calls([message])[0]
    return normal.get("content"), normal.get("tool_calls") or None


def served_entry(
    reply_from: list[dict[str, Any]], source: Candidate | None, served: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The served ids (``documents.ServedTokens``, as JSON data) of ``reply_from``'s final assistant turn:
    those ``served`` (the source trace's ``served_tokens`` column) holds for the source's final assistant
    message, when that message is the reply trained on -- the same content and tool calls, not a
    correction written in its place. None otherwise, or when the stored entry is unreadable."""
    if source is None or not served:
        return None
    mine, theirs = _final_reply(reply_from), _final_reply(source.messages)
    if mine is None or theirs is None or str(theirs) not in served:
        return None
    if _reply_body(reply_from[mine]) != _reply_body(source.messages[theirs]):
        return None  # a correction (or an edit) replaced the reply the server decoded
    try:
        return ServedTokens.read(served[str(theirs)]).model_dump(mode="json")
    except ValueError as exc:  # pydantic's ValidationError: stored data this version cannot read
        log.warning("trace %s: its served token ids are unreadable, re-rendered: %s", source.experience_id,
                    _first_line(exc))  # fmt: skip
        return None


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def served_tokens_by_trace(
    session: Session, ids: list[int], *, heldout: HeldoutIndex | None = None
) -> dict[int, dict[str, Any]]:
    """The ``served_tokens`` column of the traces ``ids`` that have one (trace id -> entries by index).
    The served prompt holds the client's tools (``Experience.tools``) as the model was given them, which a
    re-rendering never shows: a trace whose tools hold a held-out text (``heldout``) keeps no served ids."""
    from sqlalchemy import select

    found: dict[int, dict[str, Any]] = {}
    unique = sorted(set(ids))
    for start in range(0, len(unique), 500):  # SQLite's bound-parameter limit
        chunk = unique[start : start + 500]
        query = select(Experience.id, Experience.served_tokens, Experience.tools).where(
            Experience.id.in_(chunk), Experience.served_tokens.is_not(None)
        )
        for trace_id, served, tools in session.execute(query):
            if not isinstance(served, dict) or not served:
                continue
            why = heldout.exclusion(messages=[], metadata={"tools": tools}) if heldout and tools else None
            if why is not None:
                log.warning("trace %s: its served prompt %s; re-rendered without it", trace_id, why)
                continue
            found[trace_id] = served
    return found


UNRENDERABLE = "cannot be rendered"
BAD_TOOLS = "malformed metadata.tools"
UNSTORABLE = "cannot be stored"


def training_rows(
    examples: list[dict[str, Any]],
    *,
    harness: HarnessSpec,
    specialist: str,
    sources: dict[int, Candidate],
    dropped: Drops,
    served: dict[int, dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """``examples`` as the model sees them under the harness, as the server shows them (the context rendered,
    nothing after the reply, tool-call arguments as JSON text, the harness's tools where the trace names
    none), each reply with the ids it was served with where it is the served message (``served``: the
    traces' ``served_tokens`` columns by trace id; ``served_entry``). A row that cannot be rendered
    (``UNRENDERABLE``), names malformed tools (``BAD_TOOLS``) or cannot be stored in one dataset beside the
    rows before it (``UNSTORABLE``, ``unstorable``) is left out and counted in ``dropped``: one row never
    stops a generation."""

    offered = offered_tools(harness, specialist)
    kept: list[dict[str, Any]] = []
    for ex in examples:
        source = sources.get(ex["experience_id"])
        principal = source.principal if source is not None else None
        if tools_problem(ex.get("tools")):
            dropped.add(specialist, BAD_TOOLS, principal=principal)
            continue
        served_of = (served or {}).get
        ex["served_tokens"] = served_entry(ex["messages"], source, served_of(ex["experience_id"]))
        if "rejected" in ex:
            other = ex.get("rejected_experience_id")
            ex["rejected_served_tokens"] = served_entry(ex["rejected"], sources.get(other), served_of(other))
        messages = normalize_tool_calls(ex["messages"])
        last = max(i for i, m in enumerate(messages) if m.get("role") == "assistant")
        context, answer = messages[:last], messages[last]  # nothing after the reply
        try:
            writer = recorded_writer(source.routes, source.metadata) if source is not None else None
            context = render_messages(harness, specialist, context, writer=writer)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:  # stored data a view cannot read
            log.warning("%s: trace %s cannot be rendered, left out: %s", specialist, ex["experience_id"], exc)
            dropped.add(specialist, UNRENDERABLE, principal=principal)
            continue
        ex["messages"] = [*context, answer]
        if "rejected" in ex:  # the same rendered context for the other reply
            ex["rejected"] = [*context, *normalize_tool_calls(ex["rejected"][-1:])]
        ex["tools"] = ex.get("tools") or offered
        kept.append(ex)
    refused = set(unstorable([dataset_row(ex) for ex in kept]))
    for i in sorted(refused):
        source = sources.get(kept[i]["experience_id"])
        log.warning(
            "%s: trace %s cannot be stored in a dataset, left out", specialist, kept[i]["experience_id"]
        )
        dropped.add(specialist, UNSTORABLE, principal=source.principal if source is not None else None)
    return [ex for i, ex in enumerate(kept) if i not in refused]


def unstorable(rows: list[dict[str, Any]]) -> list[int]:
    """Indices of the ``rows`` a ``datasets.Dataset`` cannot hold beside the rows before them (Arrow infers
    one type per column: a field that is text in one row and an object in another refuses the whole
    dataset), or at all (an integer beyond 64 bits). Rows of one inferred schema are interchangeable for
    that, so only a row of a schema not seen yet is tried, with one row of each schema kept so far."""
    import datasets
    import pyarrow as pa

    kinds: dict[str, dict[str, Any]] = {}  # each inferred schema kept so far -> one row of it
    refused = []
    for i, row in enumerate(rows):
        try:
            kind = pa.Table.from_pylist([row]).schema.to_string()
            if kind not in kinds:
                datasets.Dataset.from_list([*kinds.values(), row])
                kinds[kind] = row
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            refused.append(i)
    return refused


def save_dataset(examples: list[dict[str, Any]], path: Path) -> tuple[str, int]:
    """Save with ``datasets.Dataset.save_to_disk``; return (sha256 of the conversations as stored, rows).
    Preference rows (a ``rejected`` conversation beside ``messages``) keep it, and its score and trace, and are
    hashed with both conversations. The hash is of the saved dataset read back (``stored_dataset_sha256``):
    the one its training job logs with the adapter."""
    import datasets

    datasets.disable_progress_bars()
    rows = [dataset_row(e) for e in examples]
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return stored_dataset_sha256(path), len(rows)


def curate_step(
    *, generation_id: int, config: AdvanceConfig, progress: Progress | None = None
) -> dict[str, Any]:
    """One dataset per specialist from all eligible experience of the lineage (accumulated), by the training
    method its model spec names: SFT examples (``select_examples``), preference pairs (``method: dpo``,
    ``pipeline.experience.preferences``), or none (``method: grpo`` practises online on its task source)."""
    from sqlalchemy import delete, insert

    engine = get_engine()
    with session_scope(engine) as session:
        gen = load_generation(session, generation_id)
        contract = contract_of(gen)
        harness = HarnessSpec.model_validate(gen.harness_version.spec)
        spec = ModelSpec.model_validate(gen.base_model.spec)
        specialists = [a.specialist for a in gen.adapters]
        methods = {s: spec.specialists[s].method if s in spec.specialists else "sft" for s in specialists}
        by_method = {m: [s for s in specialists if methods[s] == m] for m in ("sft", "dpo", "grpo")}
        candidates, dropped = lineage_candidates(session, gen, contract, specialists=by_method["sft"])
        pair_candidates: list[Candidate] = []
        if by_method["dpo"]:  # every verified reply, not only those above the threshold: both sides of a pair
            pair_candidates, pair_drops = lineage_candidates(
                session, gen, contract, min_score=0.0, specialists=by_method["dpo"]
            )
            dropped.merge(pair_drops)
        number = gen.number
    index = heldout_index(contract)
    selected = select_examples(candidates, contract=contract, heldout=index, specialists=by_method["sft"])
    dropped.merge(selected.dropped)
    rows_of = dict(selected.examples)
    if by_method["dpo"]:
        paired = preference_pairs(
            pair_candidates,
            contract=contract,
            heldout=index,
            specialists=by_method["dpo"],
            max_pairs={s: spec.specialists[s].dpo.max_pairs for s in by_method["dpo"]},
        )
        dropped.merge(paired.dropped)
        rows_of.update(paired.pairs)
    by_id = {c.experience_id: c for c in [*candidates, *pair_candidates]}
    wanted = [
        int(ex[key])
        for rows in rows_of.values()
        for ex in rows
        for key in ("experience_id", "rejected_experience_id")
        if ex.get(key) is not None
    ]
    with session_scope(engine) as session:
        served = served_tokens_by_trace(session, wanted, heldout=index)
    out_dir = artifacts_for(config.lineage, number) / "datasets"
    datasets: dict[str, Any] = {}
    # The dataset files are written outside any transaction and their rows committed in one short one after:
    # SQLite has one writer at a time, and holding its lock across every save_to_disk stalled ingest, serving
    # and every other writer for as long as the files took (past the 30 s busy timeout: "database is locked").
    written: list[tuple[TrainingDataset, list[int]]] = []
    for specialist in specialists:
        method = methods[specialist]
        if method == "grpo":
            datasets[specialist] = {"method": "grpo", "rows": 0, "skipped": "practises online (grpo)"}
            continue
        examples = training_rows(
            rows_of.get(specialist, []),
            harness=harness,
            specialist=specialist,
            sources=by_id,
            dropped=dropped,
            served=served,
        )
        if len(examples) < config.min_examples:
            datasets[specialist] = {
                "method": method,
                "rows": len(examples),
                "skipped": f"fewer than {config.min_examples}",
            }
            continue
        digest, rows = save_dataset(examples, out_dir / specialist)
        traces = sorted(
            {
                int(ex[key])
                for ex in examples
                for key in ("experience_id", "rejected_experience_id")
                if ex.get(key) is not None
            }
        )
        row = TrainingDataset(
            generation_id=generation_id,
            specialist=specialist,
            path=str(out_dir / specialist),
            sha256=digest,
            num_rows=rows,
        )
        written.append((row, traces))
        datasets[specialist] = {
            "method": method,
            "rows": rows,
            "sha256": digest,
            "path": str(out_dir / specialist),
        }
    with session_scope(engine) as session:
        session.execute(delete(TrainingDataset).where(TrainingDataset.generation_id == generation_id))
        for dataset, traces in written:
            session.add(dataset)
            session.flush()
            if traces:  # provenance: which traces this dataset (and so its adapter) learned from
                session.execute(
                    insert(DatasetExample),
                    [{"dataset_id": dataset.id, "experience_id": e} for e in traces],
                )
        outcome = CurateOutcome(
            datasets=datasets, dropped=dropped.counts, dropped_by_principal=dropped.principals
        )
        mark_step(session, load_generation(session, generation_id), "curate", outcome)
    return outcome.as_stored()
