"""The co-design step: harness variants around the candidate's new adapters, scored on validation items.

The parent harness is one of the variants, so keeping it is a legitimate outcome; the contract is never
changed, and every variant must satisfy it.
"""

from __future__ import annotations

from typing import Any

from pipeline.candidate import AdvanceConfig, Progress, contract_of, load_generation, mark_step, step_seed


def validation_items(specialists: list[str], *, n: int, seed: int) -> dict[str, list[dict[str, Any]]]:
    """Training-split items for choosing among harness variants (never the held-out suites)."""
    from pipeline.environment import sample_prompts

    return {s: sample_prompts(s, n, seed) for s in specialists}


def codesign_step(
    *, generation_id: int, config: AdvanceConfig, progress: Progress | None = None
) -> dict[str, Any]:
    """Evaluate harness variants with the candidate's adapters on validation items; keep the best pair."""
    from pipeline.codesign.operators import propose_variants
    from pipeline.compatibility import check_harness
    from pipeline.curation import eligible_examples, lineage_candidates
    from pipeline.evaluation import score_pair
    from pipeline.heldout import heldout_index
    from pipeline.pair import PairSpec, pair_for_generation
    from pipeline.registry import get_engine, register_harness, session_scope

    engine = get_engine()
    with session_scope(engine) as session:
        gen = load_generation(session, generation_id)
        contract = contract_of(gen)
        pair = pair_for_generation(gen)
        parent_harness = pair.harness
        candidates, _ = lineage_candidates(session, gen, contract)
        number = gen.number
    if not config.codesign:
        outcome = {"chosen": parent_harness.version, "variants": {}}
    else:
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
            sorted(pair.adapters), n=config.validation_items, seed=step_seed(config, number, "validation")
        )
        scores = {}
        best_label, best_value, best_spec = parent_harness.version, None, parent_harness
        for label, spec in [(parent_harness.version, parent_harness), *((v.label, v.spec) for v in variants)]:
            if check_harness(spec, contract):
                continue
            per = score_pair(PairSpec(pair.base_dir, pair.adapters, spec), items, contract)
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
    with session_scope(engine) as session:
        mark_step(session, load_generation(session, generation_id), "codesign", outcome)
    return outcome
