"""The co-design step: harness variants around the candidate's new adapters, scored on validation items.

The parent harness is one of the variants, so keeping it is a legitimate outcome; the contract is never
changed, and every variant must satisfy it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from pipeline.experience.eligibility import eligible_examples, lineage_candidates
from pipeline.experience.eligibility import validation_items as experience_items
from pipeline.experience.toolcalls import tools_problem
from pipeline.gates.answers import score_pair
from pipeline.loop.candidate import (
    AdvanceConfig,
    Progress,
    contract_of,
    load_generation,
    mark_step,
    step_seed,
)
from pipeline.modeling.pair import offered_tools, pair_for_generation, pair_model
from pipeline.modeling.prompting import render_messages
from pipeline.modeling.templating import TemplateError, encode_prompt
from pipeline.registry import get_engine, register_harness, session_scope
from pipeline.specs.compatibility import check_harness
from pipeline.specs.contract import file_reader
from pipeline.specs.heldout import heldout_index
from pipeline.specs.tasksource import draw, task_sources

if TYPE_CHECKING:
    from pipeline.experience.eligibility import Candidate
    from pipeline.modeling.pair import PairSpec
    from pipeline.specs.contract import ContractSpec

MALFORMED = "malformed metadata.tools"  # a trace's tools no chat template can be given
REFUSED = "the chat template refuses the prompt"


def well_formed(candidates: list[Candidate], skipped: dict[str, int]) -> list[Candidate]:
    """The candidates whose ``metadata.tools`` a chat template can be given (``toolcalls.tools_problem``);
    the rest are counted in ``skipped``: a client's malformed tools never stop co-design."""

    kept = [c for c in candidates if not tools_problem((c.metadata or {}).get("tools"))]
    if len(kept) < len(candidates):
        skipped[MALFORMED] = skipped.get(MALFORMED, 0) + len(candidates) - len(kept)
    return kept


def refusal(pair: PairSpec, specialist: str, item: dict[str, Any]) -> str | None:
    """Why the pair's chat template cannot encode ``item``'s prompt under its harness, as ``pair.answer_items``
    builds it (None: it can)."""

    tokenizer = pair_model(pair).tokenizer
    tools = (item.get("metadata") or {}).get("tools") or offered_tools(pair.harness, specialist)
    try:
        messages = render_messages(pair.harness, specialist, item["messages"])
        encode_prompt(tokenizer, messages, fmt=pair.harness.tool_call_format, tools=tools)
    except (TemplateError, ValueError, TypeError) as exc:  # transformers refuses malformed tools: ValueError
        return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return None


def renderable(
    pair: PairSpec, items: dict[str, list[dict[str, Any]]], skipped: dict[str, int]
) -> dict[str, list[dict[str, Any]]]:
    """The items whose prompt the pair's chat template encodes; the rest are counted in ``skipped``."""
    out = {}
    for s, rows in items.items():
        out[s] = [it for it in rows if refusal(pair, s, it) is None]
        if len(out[s]) < len(rows):
            skipped[REFUSED] = skipped.get(REFUSED, 0) + len(rows) - len(out[s])
    return out


def validation_items(
    contract: ContractSpec,
    specialists: list[str],
    *,
    n: int,
    seed: int,
    candidates: list[Candidate],
) -> dict[str, list[dict[str, Any]]]:
    """Items to choose among harness variants on (never the held-out suites): each specialist's task source's
    validation split, or for a specialist without one the validation slice of its verified experience
    (``eligibility.validation_items``), which curation keeps out of training."""

    sources = task_sources(contract, read=file_reader(contract))
    index = heldout_index(contract)
    out = {}
    for s in specialists:
        if s in sources:
            out[s], _ = draw(sources[s], "validation", n, seed, heldout=index)
        else:
            out[s] = experience_items(candidates, contract, s, n)
    return out


def codesign_step(
    *, generation_id: int, config: AdvanceConfig, progress: Progress | None = None
) -> dict[str, Any]:
    """Evaluate harness variants with the candidate's adapters on validation items; keep the best pair."""
    from pipeline.codesign.operators import (
        propose_variants,  # lazy: looked up per call: tests replace propose_variants
    )

    engine = get_engine()
    with session_scope(engine) as session:
        gen = load_generation(session, generation_id)
        contract = contract_of(gen)
        pair = pair_for_generation(gen)
        parent_harness = pair.harness
        candidates, _ = lineage_candidates(session, gen, contract)
        number = gen.number
    skipped: dict[str, int] = {}  # traces and items left out, by reason
    if not config.codesign:
        outcome = {"chosen": parent_harness.version, "variants": {}}
    else:
        candidates = well_formed(candidates, skipped)
        # Exemplar material: verified experience that passed the selection rules (held out: never there).
        top: dict[str, list[dict[str, Any]]] = {}
        for cand, messages, score in sorted(eligible_examples(candidates, contract), key=lambda e: -e[2]):
            top.setdefault(cand.specialist, []).append(
                {
                    "messages": messages,
                    "score": score,
                    "verified": True,
                    "specialist": cand.specialist,
                    "metadata": cand.metadata,
                    "source": cand.source,
                    "experience_id": cand.experience_id,
                }
            )
        top = {s: v[:20] for s, v in top.items()}
        variants = propose_variants(
            parent_harness,
            top_traces=top,
            contract=contract,
            heldout=heldout_index(contract),
            rng_seed=step_seed(config, number, "codesign"),
        )
        items = validation_items(
            contract,
            sorted(pair.adapters),
            n=config.validation_items,
            seed=step_seed(config, number, "validation"),
            candidates=candidates,
        )
        # an item the parent's chat template refuses (a trace's own text or tools): left out, counted
        items = renderable(pair, items, skipped)
        scores, refused = {}, {}
        best_label, best_value, best_spec = parent_harness.version, None, parent_harness
        for label, spec in [(parent_harness.version, parent_harness), *((v.label, v.spec) for v in variants)]:
            if check_harness(spec, contract):
                continue
            variant = dataclasses.replace(pair, harness=spec)
            why = next(
                (w for s, rows in items.items() for it in rows if (w := refusal(variant, s, it))), None
            )
            if why is not None:  # e.g. an exemplar the chat template refuses: a variant the model cannot use
                refused[label] = why[:200]
                continue
            per = score_pair(variant, items, contract)
            value = sum(sum(v) / len(v) for v in per.values() if v) / max(
                1, sum(1 for v in per.values() if v)
            )
            scores[label] = round(value, 4)
            if best_value is None or value > best_value + 1e-9:
                best_label, best_value, best_spec = label, value, spec
        outcome = {
            "chosen": best_label,
            "variants": scores,
            "operators": {v.label: v.operator for v in variants},
            **({"refused": refused} if refused else {}),
        }
        if best_spec is not parent_harness:
            with session_scope(engine) as session:
                gen = load_generation(session, generation_id)
                row = register_harness(
                    session=session,
                    name=best_spec.name,
                    version=best_spec.version,
                    spec=best_spec.model_dump(mode="json"),
                    parent_id=gen.harness_version_id,
                    actor="codesign",
                )
                gen.harness_version_id = row.id
    if skipped:
        outcome["skipped"] = skipped
    with session_scope(engine) as session:
        mark_step(session, load_generation(session, generation_id), "codesign", outcome)
    return outcome
