"""Collection: the champion pair practises on its task sources' training items; every attempt is kept.

``collect_step`` draws ``prompts_per_specialist`` training items per specialist from the task source its
contract entry names (``pipeline.specs.tasksource``; a specialist without one is skipped: it learns from
deployment and ingested experience only) -- with the variants discovery found (``pipeline.loop.discovery``) in
place of as many drawn items -- leaves out any item the held-out predicate matches, answers each
``samples_per_prompt`` times with the parent pair (the champion) at the collection temperature, and
stores every attempt as experience (source ``simulation``), right or wrong: scoring decides later what
the contract verified, and curation what may be learned from. With ``AdvanceConfig.collect`` off
(``ratchet advance --no-collect``) it records nothing and the generation learns from served and ingested
experience only.
"""

from __future__ import annotations

from typing import Any

from pipeline.experience.ingest import trace_row, validate_trace
from pipeline.experience.principals import LOOP
from pipeline.loop.candidate import (
    AdvanceConfig,
    Progress,
    contract_of,
    load_generation,
    mark_step,
    step_seed,
)
from pipeline.loop.discovery import discovered_items
from pipeline.modeling.pair import answer_items, pair_for_generation
from pipeline.registry import get_engine, insert_traces, session_scope
from pipeline.specs.contract import file_reader
from pipeline.specs.heldout import heldout_index
from pipeline.specs.tasksource import draw, task_sources


def collect_step(
    *, generation_id: int, config: AdvanceConfig, progress: Progress | None = None
) -> dict[str, Any]:
    """Run the champion (the parent pair) in the task environment; record every attempt as experience."""

    engine = get_engine()
    if not config.collect:
        with session_scope(engine) as session:
            outcome = {
                "attempts": 0,
                "stored": 0,
                "prompts": 0,
                "skipped": "collection is off (--no-collect)",
            }
            mark_step(session, load_generation(session, generation_id), "collect", outcome)
        return outcome
    with session_scope(engine) as session:
        gen = load_generation(session, generation_id)
        parent = load_generation(session, gen.parent_id)
        pair = pair_for_generation(parent)
        number, parent_id, harness_id, state = gen.number, parent.id, parent.harness_version_id, gen.state
        contract = contract_of(gen)
    sources = task_sources(contract, read=file_reader(contract))
    index = heldout_index(contract)
    items, left_out, discovered = {}, {}, {}
    for s in sorted(pair.adapters):
        if s in sources:
            seed = step_seed(config, number, f"collect:{s}")
            variants = discovered_items(state, s)[: config.prompts_per_specialist]
            regular, left_out[s] = draw(
                sources[s], "train", config.prompts_per_specialist - len(variants), seed, heldout=index
            )
            # variants last: the newest experience is what curation keeps first when the cap is reached
            items[s], discovered[s] = [*regular, *variants], len(variants)
    answered = answer_items(
        pair,
        items,
        num_samples=config.samples_per_prompt,
        temperature=config.temperature,
        seed=step_seed(config, number, "sample"),
        progress=(lambda d, t: progress("collect", d, t)) if progress else None,
    )
    rows = []
    for specialist, traces in answered.items():
        for attempts in traces:
            for trace in attempts:
                trace["metadata"]["collected_for"] = number
                trace["metadata"]["specialist"] = specialist
                rows.append(
                    trace_row(
                        validate_trace(trace),
                        source="simulation",
                        generation_id=parent_id,
                        harness_version_id=harness_id,
                        principal=LOOP,
                    )
                )
    stored = 0
    with session_scope(engine) as session:
        for start in range(0, len(rows), 2000):
            stored += insert_traces(session=session, rows=rows[start : start + 2000])
        outcome = {
            "attempts": len(rows),
            "stored": stored,
            "prompts": sum(len(v) for v in items.values()),
            "specialists": sorted(items),
            "without_tasks": sorted(set(pair.adapters) - set(items)),
            "held_out_left_out": left_out,
            "discovered_variants": discovered,
        }
        mark_step(session, load_generation(session, generation_id), "collect", outcome)
    return outcome
