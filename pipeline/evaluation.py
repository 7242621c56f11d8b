"""Evaluation: the champion and the candidate on the contract's held-out suites, in the same run.

Both pairs answer the same items greedily and are scored under the contract, so the comparison is paired:
per specialist the mean of the item-level differences and its standard error; overall the mean of the
specialists' means (each specialist counts the same), whose variance is the sum of theirs over the number
of specialists squared. Every item's score is stored with the candidate (``evaluation["items"]``), as is
the router's accuracy on the contract's routing suite for both harnesses, which attempt against this
champion the candidate is, and how both pairs answer the variants discovery found this generation
(``evaluation["discovery"]``: greedy contract totals; they were practised on, so this is a report, never a
gate); ``pipeline.promotion`` turns the rest into a verdict.
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
    """Greedy answers of the pair on the items, each trace's total under the contract (unscorable = 0)."""
    answered = answer_and_score(pair, items, contract, progress=progress)
    return {s: [value for value, _ in results] for s, results in answered.items()}


def answer_and_score(
    pair: PairSpec,
    items: dict[str, list[dict[str, Any]]],
    contract: ContractSpec,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, list[tuple[float, dict[str, Any]]]]:
    """``score_pair`` with each item's answer kept: per specialist, (total, the answering message)."""
    from pipeline.clock import CLOCK
    from pipeline.pair import answer_items
    from pipeline.scoring import score_trace

    answered = answer_items(pair, items, num_samples=1, temperature=0.0, progress=progress)
    out: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    with CLOCK.measure("score"):
        for specialist, traces in answered.items():
            results = []
            for (trace,) in traces:
                result = score_trace(contract, trace, harness=pair.harness, specialist=specialist)
                results.append((float(result.total or 0.0), trace["messages"][-1]))
            out[specialist] = results
    return out


def attempt_number(session: Session, gen: Generation) -> int:
    """Which attempt against its parent (the champion it was built from) this candidate is: 1 + the
    siblings decided before it (rejected, or promoted and since retired)."""
    from sqlalchemy import func, select

    from pipeline.registry import Generation as G

    earlier = session.scalar(
        select(func.count())
        .select_from(G)
        .where(G.parent_id == gen.parent_id, G.number < gen.number, G.status.in_(("rejected", "retired")))
    )
    return 1 + int(earlier or 0)


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
    champ_answers = answer_and_score(champion, suites, contract, progress=report("champion"))
    cand_answers = answer_and_score(candidate, suites, contract, progress=report("candidate"))
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
    champ_scores = {s: [v for v, _ in r] for s, r in champ_answers.items()}
    cand_scores = {s: [v for v, _ in r] for s, r in cand_answers.items()}
    comparison = compare_scores(champ_scores, cand_scores)
    classifier = fit_router(candidate.harness, contract, candidates) if candidates is not None else None
    evaluation = {
        "scores": {s: round(c.candidate, 4) for s, c in comparison.specialists.items()},
        "overall": round(comparison.candidate_overall, 4),
        "parent_scores": {s: round(c.champion, 4) for s, c in comparison.specialists.items()},
        "parent_overall": round(comparison.champion_overall, 4),
        "comparison": comparison.to_dict(),
        "attempt": attempt,
        "items": {
            s: {
                "parent": [round(v, 4) for v in champ_scores[s]],
                "candidate": [round(v, 4) for v in cand_scores[s]],
            }
            for s in sorted(suites)
        },
        "discovery": discovery,
        "router": measure_routing(candidate.harness, contract, classifier),
        "parent_router": measure_routing(champion.harness, contract, _classifier(parent_classifier)),
    }
    with session_scope(engine) as session:
        gen = load_generation(session, generation_id)
        gen.evaluation = evaluation
        store_items(session, generation_id, suites, champ_answers, cand_answers)
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
    parent: dict[str, list[tuple[float, dict[str, Any]]]],
    candidate: dict[str, list[tuple[float, dict[str, Any]]]],
) -> None:
    """Keep every held-out item with both answers and scores (replacing an earlier, crashed attempt's)."""
    from sqlalchemy import delete, insert

    from pipeline.registry import EvaluationItem

    session.execute(delete(EvaluationItem).where(EvaluationItem.generation_id == generation_id))
    rows = [
        {
            "generation_id": generation_id,
            "specialist": s,
            "position": i,
            "messages": item["messages"],
            "parent_answer": parent[s][i][1],
            "candidate_answer": candidate[s][i][1],
            "parent_value": parent[s][i][0],
            "candidate_value": candidate[s][i][0],
        }
        for s in sorted(suites)
        for i, item in enumerate(suites[s])
        if i < len(parent.get(s, ())) and i < len(candidate.get(s, ()))
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
