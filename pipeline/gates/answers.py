"""Answers: a pair's greedy answers to suite items, and their scores under the contract, item by item.

What evaluation (held-out suites, ``pipeline.loop.evaluation``), retention suites (``pipeline.gates.retention``),
co-design and a contract adoption's re-evaluation of the champion share: ``answer_suites`` (one greedy trace
per item), ``item_score`` (the final assistant turn's score, or unscored with why), ``score_both`` (two
pairs' answers scored interleaved, so a scorer that fails for a while fails on both sides of the same
items), ``paired_values`` and ``check_unscored`` (items unscored on either side are left out of both, and
too many fail the step), and ``score_pair`` (a report or a choice among harness variants, never a gate).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline.errors import RatchetError
from pipeline.loop.clock import CLOCK
from pipeline.modeling.pair import answer_items
from pipeline.scoring import score_trace

if TYPE_CHECKING:
    from pipeline.modeling.pair import PairSpec
    from pipeline.specs.contract import ContractSpec
    from pipeline.specs.harness import HarnessSpec


def score_pair(
    pair: PairSpec,
    items: dict[str, list[dict[str, Any]]],
    contract: ContractSpec,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, list[float]]:
    """Greedy answers of the pair on the items, each item's final-turn score under the contract (unscored =
    0: a report or a choice among harness variants, never the promotion gate, which uses ``score_both``)."""
    return score_answers(contract, pair.harness, answer_suites(pair, items, progress=progress))


def score_answers(
    contract: ContractSpec, harness: HarnessSpec, answered: dict[str, list[dict[str, Any]]]
) -> dict[str, list[float]]:
    """Per specialist, each answered trace's final-turn score (unscored = 0), timed as contract scoring."""

    with CLOCK.measure("score"):
        return {
            s: [item_score(contract, t, harness=harness, specialist=s).value or 0.0 for t in traces]
            for s, traces in answered.items()
        }


def answer_suites(
    pair: PairSpec,
    items: dict[str, list[dict[str, Any]]],
    *,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """The pair's greedy answer to every item: per specialist, one trace per item."""

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
