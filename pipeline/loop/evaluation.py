"""Evaluation: the champion and the candidate on the contract's held-out suites, in the same run.

Both pairs answer the same items greedily and are scored under the contract, so the comparison is paired:
per specialist the mean of the item-level differences and its standard error; overall the mean of the
specialists' means (each specialist counts the same), whose variance is the sum of theirs over the number
of specialists squared. Both pairs answer first; then their answers are scored item by item, interleaved
(``score_both``), each on its final assistant turn (``item_score``), so a scorer that fails for a while (a
judge down, then back) fails on both sides of the same items. An item unscored on either side is left out
of the comparison on both sides and counted per specialist (``evaluation.unscored``, its first reason in
``evaluation.unscored_errors``); more than ``promotion.max_unscored_share`` of all items unscored fails
the step with one line (``check_unscored``). Every compared item's scores are stored with the candidate
(``evaluation.items``, and with both answers in ``evaluation_items``; unscored items in neither), as are
the router's accuracy on the contract's routing suite for both harnesses, each specialist's suite hash
(``evaluation.suites``) and the attempt number of each test on its suites from the registry's spending
ledger (``evaluation.attempts``: every earlier evaluation on the same suite counts, whatever its champion,
lineage or contract version; a ``fresh`` suite is a new sample, and a new suite, per champion), and how both
pairs answer the variants discovery found this generation
(``evaluation.discovery``: greedy final-turn scores, unscored as 0; they were practised on: a report,
never a gate); ``pipeline.loop.promotion`` turns the rest into a verdict.
"""

from __future__ import annotations

from statistics import fmean
from typing import TYPE_CHECKING, Any

from pipeline.errors import RatchetError
from pipeline.experience.eligibility import eligible_examples, lineage_candidates
from pipeline.gates.answers import (  # noqa: F401 - re-exported: evaluation's vocabulary, used by co-design and tests
    ItemScore,
    answer_suites,
    check_unscored,
    item_score,
    paired_values,
    score_both,
    score_pair,
)
from pipeline.gates.inference import Comparison, SpecialistComparison, compare_scores  # noqa: F401
from pipeline.gates.retention import forgetting
from pipeline.gates.suites import compared_groups, item_keys
from pipeline.loop.candidate import AdvanceConfig, Progress, contract_of, load_generation, mark_step
from pipeline.loop.discovery import discovered_items
from pipeline.modeling.pair import pair_for_generation
from pipeline.registry import (
    EvaluationItem,
    get_engine,
    samples_of,
    session_scope,
    set_generation_status,
    spend,
)
from pipeline.registry.documents import EvaluateOutcome, GenerationEvaluation, evaluation_of, state_of
from pipeline.serving.router import TokenClassifier
from pipeline.serving.routereval import fit_router_classifier, measure_router, routing_items, suite_items
from pipeline.specs.heldout import resolve_suites, suite_sha256
from pipeline.specs.loading import content_hash

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from pipeline.experience.eligibility import Candidate
    from pipeline.specs.contract import ContractSpec
    from pipeline.specs.harness import HarnessSpec


def spend_attempts(
    *,
    generation_id: int,
    lineage: str,
    suites: dict[str, str],
    items: dict[str, list[dict[str, Any]]],
    families: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Spend the candidate's tests in the registry's ledger (``pipeline.registry.ledger``): the improvement
    test on every evaluated suite (``suites``: specialist -> suite sha256; ``items``: specialist -> the
    suite's resolved items, which the ledger counts by) and each specialist's non-inferiority test on its
    own; ``{"improvement": j, "improvement_sample": e, "noninferiority": {specialist: j}}`` (``e``: which
    sample of a fresh suite's family this is, None for fixed suites; ``families``: suite sha256 -> family,
    for fresh suites). A rerun of the same generation's evaluation gets the same numbers."""

    tests = {"improvement": sorted(set(suites.values()))}
    tests |= {f"noninferiority:{s}": [digest] for s, digest in suites.items()}
    keys = {digest: item_keys(items[s], s) for s, digest in suites.items()}
    with session_scope(get_engine()) as session:
        spent = spend(
            session, generation_id=generation_id, lineage=lineage, tests=tests, items=keys, families=families
        )
        samples = samples_of(session, generation_id=generation_id)
    return {
        "improvement": spent["improvement"],
        # the fresh sample's number in its family (None: fixed suites, whose rate has no sample share)
        "improvement_sample": samples.get("improvement", 1) if families else None,
        "noninferiority": {s: spent[f"noninferiority:{s}"] for s in sorted(suites)},
    }


def suite_families(contract: ContractSpec, hashes: dict[str, str]) -> dict[str, str]:
    """Suite sha256 -> family for the specialists whose held-out suites draw fresh samples: the hash of the
    specialist's suite declarations (which do not change from one sample to the next)."""

    out = {}
    for specialist, digest in hashes.items():
        mine = [h.model_dump(mode="json") for h in contract.heldout if h.specialist == specialist]
        if any(h["fresh"] for h in mine):
            out[digest] = content_hash({"specialist": specialist, "suites": mine})
    return out


def evaluate_step(
    *, generation_id: int, config: AdvanceConfig, progress: Progress | None = None
) -> dict[str, Any]:
    """Score the champion and the candidate on the contract's held-out suites in the same run; compare."""

    engine = get_engine()
    with session_scope(engine) as session:
        gen = load_generation(session, generation_id)
        if gen.status in ("candidate", "training"):
            set_generation_status(session=session, generation=gen, status="evaluating")
        contract = contract_of(gen)
        parent = load_generation(session, gen.parent_id)
        candidate, champion = pair_for_generation(gen), pair_for_generation(parent)
        lineage, epoch, state = gen.lineage, parent.number, gen.state  # epoch: the champion's (fresh suites)
        parent_classifier = state_of(parent).router_classifier
        candidates = None
        if candidate.harness.routing.mode != "signals":
            candidates, _ = lineage_candidates(session, gen, contract)
    # the generation's specialists only (a lineage may serve a subset of the contract's specialists)
    suites = {
        s: items for s, items in resolve_suites(contract, epoch=epoch).items() if s in candidate.adapters
    }
    if not suites:
        raise RatchetError("the contract declares no held-out suites: nothing to evaluate a candidate on")
    report = (lambda who: lambda d, t: progress(f"evaluate {who}", d, t)) if progress else (lambda who: None)
    champ_answers = answer_suites(champion, suites, progress=report("champion"))
    cand_answers = answer_suites(candidate, suites, progress=report("candidate"))
    scored = score_both(contract, (champion.harness, champ_answers), (candidate.harness, cand_answers))
    champ_scores, cand_scores, unscored = paired_values(scored)
    check_unscored(scored, unscored, contract.promotion.max_unscored_share)
    variants = {s: items for s in sorted(candidate.adapters) if (items := discovered_items(state, s))}
    discovery = {}
    if variants:  # how both pairs answer what discovery found (trained on: a report, never a gate)
        before = score_pair(champion, variants, contract, progress=report("champion on discovered"))
        after = score_pair(candidate, variants, contract, progress=report("candidate on discovered"))
        discovery = {
            s: {"variants": len(variants[s]), "champion": round(fmean(before[s]), 4),
                "candidate": round(fmean(after[s]), 4)}
            for s in variants
        }  # fmt: skip
    groups = {s: compared_groups(suites[s], unscored.get(s, [])).get("groups") for s in suites}
    comparison = compare_scores(champ_scores, cand_scores, {s: g for s, g in groups.items() if g})
    hashes = {s: suite_sha256(suites[s]) for s in sorted(suites)}
    attempts = spend_attempts(
        generation_id=generation_id,
        lineage=lineage,
        suites=hashes,
        items=suites,
        families=suite_families(contract, hashes),
    )
    attempt = attempts["improvement"]
    classifier = fit_router(candidate.harness, contract, candidates) if candidates is not None else None

    lost = forgetting(contract, champion, candidate, cand_answers, generation_id=generation_id,
                      attempts=attempts, progress=progress)  # fmt: skip
    evaluation = GenerationEvaluation(
        scores={s: round(c.candidate, 4) for s, c in comparison.specialists.items()},
        overall=round(comparison.candidate_overall, 4),
        parent_scores={s: round(c.champion, 4) for s, c in comparison.specialists.items()},
        parent_overall=round(comparison.champion_overall, 4),
        comparison=comparison.to_dict(),
        suites=hashes,  # each specialist's held-out suite, as the spending ledger knows it
        attempts=lost["attempts"],  # the held-out tests' attempts and the retention suites'
        attempt=attempt,  # the improvement test's (what readers before the per-test attempts read)
        items={  # the items scored on both pairs (what the comparison is made of)
            s: {
                "parent": [round(v, 4) for v in champ_scores[s]],
                "candidate": [round(v, 4) for v in cand_scores[s]],
                # metadata.group of each compared item, when any has one: a group is resampled as one unit
                **compared_groups(suites[s], unscored.get(s, [])),
            }
            for s in sorted(suites)
        },
        unscored={s: len(v) for s, v in unscored.items() if v},  # left out of the comparison, both sides
        unscored_errors={
            s: scored[s][v[0]][0].error or scored[s][v[0]][1].error for s, v in unscored.items() if v
        },
        discovery=discovery,
        router=measure_routing(candidate.harness, contract, classifier),
        parent_router=measure_routing(champion.harness, contract, _classifier(parent_classifier)),
        retention=lost["retention"],
        divergence=lost["divergence"],
    )
    with session_scope(engine) as session:
        gen = load_generation(session, generation_id)
        gen.evaluation = evaluation.as_stored()
        store_items(session, generation_id, suites, scored, champ_answers, cand_answers)
        if classifier is not None:
            state = state_of(gen)
            state.router_classifier = classifier.to_dict()
            gen.state = state.as_stored()
        parent = load_generation(session, gen.parent_id)
        first = evaluation_of(parent)
        if not first.scores:  # generation 0 gets its held-out scores too
            first.scores, first.overall = evaluation.parent_scores, evaluation.parent_overall
            first.router = evaluation.parent_router
            parent.evaluation = first.as_stored()
        mark_step(
            session,
            gen,
            "evaluate",
            EvaluateOutcome(
                overall=evaluation.overall, parent_overall=evaluation.parent_overall, attempt=attempt
            ),
        )
    return evaluation.as_stored()


def store_items(
    session: Session,
    generation_id: int,
    suites: dict[str, list[dict[str, Any]]],
    scored: dict[str, list[tuple[ItemScore, ItemScore]]],
    parent: dict[str, list[dict[str, Any]]],
    candidate: dict[str, list[dict[str, Any]]],
) -> None:
    """Keep every held-out item scored on both pairs, with both answers and scores (replacing an earlier,
    crashed attempt's); an unscored item is left out, as it is of the comparison."""
    from sqlalchemy import delete, insert

    session.execute(delete(EvaluationItem).where(EvaluationItem.generation_id == generation_id))
    rows = [
        {
            "generation_id": generation_id,
            "specialist": s,
            "position": i,
            "messages": item["messages"],
            "parent_answer": parent[s][i]["messages"][-1],
            "candidate_answer": candidate[s][i]["messages"][-1],
            "parent_value": scored[s][i][0].value,
            "candidate_value": scored[s][i][1].value,
        }
        for s in sorted(suites)
        for i, item in enumerate(suites[s])
        if i < len(scored.get(s, ())) and None not in (scored[s][i][0].value, scored[s][i][1].value)
    ]
    if rows:
        session.execute(insert(EvaluationItem), rows)


def _classifier(data: dict[str, Any] | None) -> TokenClassifier | None:

    return TokenClassifier.from_dict(data) if data else None


def router_training_traces(
    harness: HarnessSpec, contract: ContractSpec, candidates: list[Candidate]
) -> list[dict[str, Any]]:
    """What the learned router learns from: the lineage's verified, non-held-out experience that passed the
    selection rules (``eligibility.eligible_examples`` over ``load_candidates``), labelled with the specialist
    that served it."""

    return [
        {"messages": messages, "metadata": {"specialist": cand.specialist}}
        for cand, messages, _ in eligible_examples(candidates, contract)
        if cand.specialist in harness.specialists
    ]


def fit_router(
    harness: HarnessSpec, contract: ContractSpec, candidates: list[Candidate]
) -> TokenClassifier | None:
    """The learned router's classifier fitted on ``router_training_traces`` (None without any)."""

    traces = router_training_traces(harness, contract, candidates)
    if not traces:
        return None
    return fit_router_classifier(routing_items(traces), labels=sorted(harness.specialists))


def measure_routing(
    harness: HarnessSpec, contract: ContractSpec, classifier: TokenClassifier | None
) -> dict[str, Any] | None:
    """Router accuracy and confusion matrix on the contract's routing suite (None when it has none)."""

    if contract.routing is None:
        return None
    items = [(turn, label) for turn, label in suite_items(contract) if label in harness.specialists]
    return measure_router(harness, items, classifier=classifier)
