"""Evaluation: the champion and the candidate on the contract's held-out suites, in the same run.

Both pairs answer the same items greedily and are scored under the contract, so the comparison is paired:
per specialist the mean of the item-level differences and its standard error; overall the mean of the
specialists' means (each specialist counts the same), whose variance is the sum of theirs over the number
of specialists squared. Both pairs answer first; then their answers are scored item by item, interleaved
(``score_both``), each on its final assistant turn (``item_score``), so a scorer that fails for a while (a
judge down, then back) fails on both sides of the same items. An item unscored on either side is left out
of the comparison on both sides and counted per specialist (``evaluation["unscored"]``, its first reason in
``evaluation["unscored_errors"]``); more than ``promotion.max_unscored_share`` of all items unscored fails
the step with one line (``check_unscored``). Every compared item's scores are stored with the candidate
(``evaluation["items"]``, and with both answers in ``evaluation_items``; unscored items in neither), as are
the router's accuracy on the contract's routing suite for both harnesses, which attempt against this
champion the candidate is, and how both pairs answer the variants discovery found this generation
(``evaluation["discovery"]``: greedy final-turn scores, unscored as 0; they were practised on: a report,
never a gate); ``pipeline.promotion`` turns the rest into a verdict.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from statistics import fmean
from typing import TYPE_CHECKING, Any

from pipeline.candidate import AdvanceConfig, Progress, contract_of, load_generation, mark_step
from pipeline.errors import RatchetError

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from pipeline.contract import ContractSpec
    from pipeline.eligibility import Candidate
    from pipeline.harness import HarnessSpec
    from pipeline.pair import PairSpec
    from pipeline.registry import Generation
    from pipeline.serving.router import TokenClassifier


@dataclass(frozen=True)
class SpecialistComparison:
    """One specialist's held-out result for both pairs: means, the mean paired difference and its SE."""

    specialist: str
    n: int
    champion: float
    candidate: float
    delta: float
    se: float


@dataclass(frozen=True)
class Comparison:
    """The paired comparison of two pairs on the same items."""

    specialists: dict[str, SpecialistComparison]
    champion_overall: float
    candidate_overall: float
    delta: float
    se: float
    df: float  # Welch-Satterthwaite degrees of freedom of the overall delta's t statistic

    def to_dict(self) -> dict[str, Any]:
        """As stored (JSON has no infinity: an infinite ``df`` -- no variance at all -- is null)."""
        return {**asdict(self), "df": None if math.isinf(self.df) else self.df}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Comparison:
        specialists = {k: SpecialistComparison(**v) for k, v in data["specialists"].items()}
        return cls(
            **{**data, "specialists": specialists, "df": math.inf if data["df"] is None else data["df"]}
        )


def compare_scores(champion: dict[str, list[float]], candidate: dict[str, list[float]]) -> Comparison:
    """Paired statistics of per-item scores (same items, same order, per specialist)."""
    import numpy as np

    if set(champion) != set(candidate):
        raise ValueError(f"specialists differ: {sorted(champion)} vs {sorted(candidate)}")
    per: dict[str, SpecialistComparison] = {}
    parts = []  # (variance of the specialist's mean, n)
    for s in sorted(champion):
        if len(champion[s]) != len(candidate[s]):
            raise ValueError(f"{s}: {len(champion[s])} champion items vs {len(candidate[s])} candidate items")
        if not champion[s]:
            continue
        a, b = np.asarray(champion[s], dtype=np.float64), np.asarray(candidate[s], dtype=np.float64)
        d = b - a
        var = float(d.var(ddof=1)) / len(d) if len(d) > 1 else 0.0
        parts.append((var, len(d)))
        per[s] = SpecialistComparison(
            s, len(d), float(a.mean()), float(b.mean()), float(d.mean()), math.sqrt(var)
        )
    if not per:
        return Comparison({}, 0.0, 0.0, 0.0, 0.0, 0.0)
    k = len(per)
    var = sum(v for v, _ in parts) / k**2
    df = sum(v for v, _ in parts) ** 2 / sum(v**2 / max(1, n - 1) for v, n in parts) if var > 0 else math.inf
    champ = fmean(c.champion for c in per.values())
    cand = fmean(c.candidate for c in per.values())
    return Comparison(per, champ, cand, cand - champ, math.sqrt(var), df)


def score_pair(
    pair: PairSpec,
    items: dict[str, list[dict[str, Any]]],
    contract: ContractSpec,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, list[float]]:
    """Greedy answers of the pair on the items, each item's final-turn score under the contract (unscored =
    0: a report or a choice among harness variants, never the promotion gate, which uses ``score_both``)."""
    answered = answer_suites(pair, items, progress=progress)
    return {
        s: [item_score(contract, t, harness=pair.harness, specialist=s).value or 0.0 for t in traces]
        for s, traces in answered.items()
    }


def answer_suites(
    pair: PairSpec,
    items: dict[str, list[dict[str, Any]]],
    *,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """The pair's greedy answer to every item: per specialist, one trace per item."""
    from pipeline.pair import answer_items

    answered = answer_items(pair, items, num_samples=1, temperature=0.0, progress=progress)
    return {s: [trace for (trace,) in traces] for s, traces in answered.items()}


@dataclass(frozen=True)
class ItemScore:
    """One held-out item's score on one pair: the final assistant turn's score under the contract, or None
    (unscored) with why."""

    value: float | None
    error: str | None = None


def item_score(
    contract: ContractSpec, trace: dict[str, Any], *, harness: HarnessSpec, specialist: str
) -> ItemScore:
    """The score of an answered item: its final assistant turn's total (``score_trace(...).final.total``; a
    multi-turn item is judged on the turn that answers it, not on the mean of its turns).

    *Unscored* (value None, with the first reason) when the trace has no assistant turn, when no scorer gave
    its final turn a value, or when one of the contract's scorers gave its final turn no value *and* an error
    -- the scorer applied but could not reach a verdict: a judge that was unreachable or whose reply was not a
    grade, a schema or test cases in the item's metadata that could not be read. Such a turn's total would be
    made of the other scorers alone, unlike the same item's total on the other pair. A scorer that does not
    apply (None without an error) leaves an item scored; a scorer that crashed scores 0 with its error
    (``run_scorer`` fails closed), which is a score."""
    from pipeline.scoring import score_trace

    final = score_trace(contract, trace, harness=harness, specialist=specialist).final
    if final is None or final.total is None:
        why = "; ".join(f"{k}: {e}" for k, e in (final.errors if final else {}).items())
        return ItemScore(None, why or "no scorer applies to the final turn")
    broken = [  # only the scorers' own keys: the errors also say e.g. that a specialist was scored as another
        f"{key}: {error}"
        for key, error in final.errors.items()
        if key in final.values and final.values[key] is None
    ]
    if broken:
        return ItemScore(None, broken[0])
    return ItemScore(float(final.total))


def score_both(
    contract: ContractSpec,
    champion: tuple[HarnessSpec, dict[str, list[dict[str, Any]]]],
    candidate: tuple[HarnessSpec, dict[str, list[dict[str, Any]]]],
) -> dict[str, list[tuple[ItemScore, ItemScore]]]:
    """Both pairs' answers (``(harness, answer_suites(...))`` each) scored item by item, interleaved --
    champion's item 1, candidate's item 1, champion's item 2, ... -- so a scorer that fails for a while (a
    judge that goes down and comes back) fails on both sides of the same items, never on one pair's half."""
    from pipeline.clock import CLOCK

    (champ_harness, champ), (cand_harness, cand) = champion, candidate
    out: dict[str, list[tuple[ItemScore, ItemScore]]] = {}
    with CLOCK.measure("score"):
        for specialist in champ:
            out[specialist] = [
                (
                    item_score(contract, a, harness=champ_harness, specialist=specialist),
                    item_score(contract, b, harness=cand_harness, specialist=specialist),
                )
                for a, b in zip(champ[specialist], cand[specialist], strict=True)
            ]
    return out


def paired_values(
    scored: dict[str, list[tuple[ItemScore, ItemScore]]],
) -> tuple[dict, dict, dict[str, list[int]]]:
    """``(champion, candidate, unscored)``: per specialist, the scores of the items scored on both pairs (same
    order), and the positions of the items left out because either side is unscored."""
    champ: dict[str, list[float]] = {}
    cand: dict[str, list[float]] = {}
    unscored: dict[str, list[int]] = {}
    for specialist, rows in scored.items():
        champ[specialist], cand[specialist], unscored[specialist] = [], [], []
        for i, (a, b) in enumerate(rows):
            if a.value is None or b.value is None:
                unscored[specialist].append(i)
            else:
                champ[specialist].append(a.value)
                cand[specialist].append(b.value)
    return champ, cand, unscored


def check_unscored(
    scored: dict[str, list[tuple[ItemScore, ItemScore]]], unscored: dict[str, list[int]], limit: float
) -> None:
    """``RatchetError`` (one line: how many of how many, the limit, and the first item's reason, its
    whitespace collapsed) when more than ``limit`` of all items could not be scored on both pairs."""
    total = sum(len(rows) for rows in scored.values())
    left_out = sum(len(v) for v in unscored.values())
    if total and left_out / total > limit:
        first = next(
            (x.error for s, rows in scored.items() for i in unscored[s] for x in rows[i] if x.value is None),
            "",
        )
        raise RatchetError(
            f"evaluation: {left_out:,} of {total:,} held-out items ({left_out / total:.1%}) could not be scored on "
            f"both pairs (over promotion.max_unscored_share {limit:g}): {' '.join(first.split())[:300]}"
        )


def attempt_number(session: Session, gen: Generation) -> int:
    """Which attempt against its parent (the champion it was built from) this candidate is: 1 + the
    siblings decided before it (rejected, or promoted and since retired) and those failed after their
    evaluation (abandoned by an operator: their comparison was made all the same)."""
    from sqlalchemy import func, select

    from pipeline.registry import Generation as G

    siblings = (G.parent_id == gen.parent_id, G.number < gen.number)
    earlier = session.scalar(
        select(func.count()).select_from(G).where(*siblings, G.status.in_(("rejected", "retired")))
    )
    failed = session.scalars(select(G.evaluation).where(*siblings, G.status == "failed")).all()
    return 1 + int(earlier or 0) + sum(1 for e in failed if "comparison" in (e or {}))


def evaluate_step(
    *, generation_id: int, config: AdvanceConfig, progress: Progress | None = None
) -> dict[str, Any]:
    """Score the champion and the candidate on the contract's held-out suites in the same run; compare."""
    from pipeline.discovery import discovered_items
    from pipeline.heldout import resolve_suites
    from pipeline.pair import pair_for_generation
    from pipeline.registry import get_engine, session_scope, set_generation_status

    engine = get_engine()
    with session_scope(engine) as session:
        gen = load_generation(session, generation_id)
        if gen.status in ("candidate", "training"):
            set_generation_status(session=session, generation=gen, status="evaluating")
        contract = contract_of(gen)
        parent = load_generation(session, gen.parent_id)
        candidate, champion = pair_for_generation(gen), pair_for_generation(parent)
        attempt, state = attempt_number(session, gen), gen.state
        parent_classifier = (parent.state or {}).get("router_classifier")
        candidates = None
        if candidate.harness.routing.mode != "signals":
            from pipeline.eligibility import lineage_candidates

            candidates, _ = lineage_candidates(session, gen, contract)
    # the generation's specialists only (a lineage may serve a subset of the contract's specialists)
    suites = {s: items for s, items in resolve_suites(contract).items() if s in candidate.adapters}
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
    comparison = compare_scores(champ_scores, cand_scores)
    classifier = fit_router(candidate.harness, contract, candidates) if candidates is not None else None
    evaluation = {
        "scores": {s: round(c.candidate, 4) for s, c in comparison.specialists.items()},
        "overall": round(comparison.candidate_overall, 4),
        "parent_scores": {s: round(c.champion, 4) for s, c in comparison.specialists.items()},
        "parent_overall": round(comparison.champion_overall, 4),
        "comparison": comparison.to_dict(),
        "attempt": attempt,
        "items": {  # the items scored on both pairs (what the comparison is made of)
            s: {
                "parent": [round(v, 4) for v in champ_scores[s]],
                "candidate": [round(v, 4) for v in cand_scores[s]],
            }
            for s in sorted(suites)
        },
        "unscored": {s: len(v) for s, v in unscored.items() if v},  # left out of the comparison, both sides
        "unscored_errors": {
            s: scored[s][v[0]][0].error or scored[s][v[0]][1].error for s, v in unscored.items() if v
        },
        "discovery": discovery,
        "router": measure_routing(candidate.harness, contract, classifier),
        "parent_router": measure_routing(champion.harness, contract, _classifier(parent_classifier)),
    }
    with session_scope(engine) as session:
        gen = load_generation(session, generation_id)
        gen.evaluation = evaluation
        store_items(session, generation_id, suites, scored, champ_answers, cand_answers)
        if classifier is not None:
            gen.state = {**(gen.state or {}), "router_classifier": classifier.to_dict()}
        parent = load_generation(session, gen.parent_id)
        if not (parent.evaluation or {}).get("scores"):  # generation 0 gets its held-out scores too
            parent.evaluation = {
                **(parent.evaluation or {}),
                "scores": evaluation["parent_scores"],
                "overall": evaluation["parent_overall"],
                "router": evaluation["parent_router"],
            }
        mark_step(
            session,
            gen,
            "evaluate",
            {
                "overall": evaluation["overall"],
                "parent_overall": evaluation["parent_overall"],
                "attempt": attempt,
            },
        )
    return evaluation


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

    from pipeline.registry import EvaluationItem

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
    from pipeline.serving.router import TokenClassifier

    return TokenClassifier.from_dict(data) if data else None


def router_training_traces(
    harness: HarnessSpec, contract: ContractSpec, candidates: list[Candidate]
) -> list[dict[str, Any]]:
    """What the learned router learns from: the lineage's verified, non-held-out experience that passed the
    selection rules (``eligibility.eligible_examples`` over ``load_candidates``), labelled with the specialist
    that served it."""
    from pipeline.eligibility import eligible_examples

    return [
        {"messages": messages, "metadata": {"specialist": cand.specialist}}
        for cand, messages, _ in eligible_examples(candidates, contract)
        if cand.specialist in harness.specialists
    ]


def fit_router(
    harness: HarnessSpec, contract: ContractSpec, candidates: list[Candidate]
) -> TokenClassifier | None:
    """The learned router's classifier fitted on ``router_training_traces`` (None without any)."""
    from pipeline.serving.routereval import fit_router_classifier, routing_items

    traces = router_training_traces(harness, contract, candidates)
    if not traces:
        return None
    return fit_router_classifier(routing_items(traces), labels=sorted(harness.specialists))


def measure_routing(
    harness: HarnessSpec, contract: ContractSpec, classifier: TokenClassifier | None
) -> dict[str, Any] | None:
    """Router accuracy and confusion matrix on the contract's routing suite (None when it has none)."""
    from pipeline.serving.routereval import measure_router, suite_items

    if contract.routing is None:
        return None
    items = [(turn, label) for turn, label in suite_items(contract) if label in harness.specialists]
    return measure_router(harness, items, classifier=classifier)
