"""Retention: the capabilities a lineage must keep, measured for champion and candidate every generation.

A contract's ``retention`` suites (``pipeline.specs.contract.RetentionSuite``) are items one specialist answers --
often another family's or a dropped contract version's held-out items -- scored by ``scored_as``'s scorers
(the specialist's own when unset). Evaluation answers each suite greedily with the champion's and the
candidate's ``specialist`` and scores both item by item, interleaved (``evaluation.score_both``), exactly
as the held-out suites are; an item unscored on either pair is left out of both sides and counted. The
result is stored per suite in ``evaluation["retention"][name]``: the paired per-item scores, the suite's
tolerance and error rate, and its content hash, under which the registry's spending ledger counts the
non-inferiority tests ever made on it (``evaluation["attempts"]["retention"][name]``, the attempt ``j``
whose test spends ``error_rate * 6 / (pi**2 * j**2)``). ``pipeline.loop.promotion.judge`` gates on it.

``forgetting`` is what ``evaluate_step`` calls: the retention suites and the divergence of the candidate
from the base and from its parent (``pipeline.gates.divergence``), as additions to the evaluation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pipeline.gates.answers import answer_suites, check_unscored, paired_values, score_both
from pipeline.gates.divergence import measure_divergence
from pipeline.gates.suites import compared_groups, item_keys
from pipeline.registry import Generation, get_engine, session_scope
from pipeline.registry.ledger import spend
from pipeline.specs.heldout import resolve_retention, suite_sha256

if TYPE_CHECKING:
    from pipeline.modeling.pair import PairSpec
    from pipeline.specs.contract import ContractSpec, RetentionSuite

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]


def evaluate_suite(
    contract: ContractSpec,
    suite: RetentionSuite,
    items: list[dict[str, Any]],
    champion: PairSpec,
    candidate: PairSpec,
    *,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Both pairs' ``suite.specialist`` answer ``items`` greedily; each answer is scored on its final turn
    under ``suite.scored_as`` (or the specialist's own scorers). The stored record of the suite (without the
    ledger's attempt): paired per-item scores of the items scored on both pairs, their groups when any item
    has one, how many were left out, the tolerance, the error rate and the suite's content hash."""

    scorer = suite.scored_as or suite.specialist
    report = (
        (lambda who: lambda d, t: progress(f"retention {suite.name}: {who}", d, t))
        if progress
        else (lambda who: None)
    )
    champ = answer_suites(champion, {suite.specialist: items}, progress=report("champion"))
    cand = answer_suites(candidate, {suite.specialist: items}, progress=report("candidate"))
    # keyed by whose scorers apply: ``score_both`` scores each list as the specialist it is filed under
    scored = score_both(
        contract,
        (champion.harness, {scorer: champ[suite.specialist]}),
        (candidate.harness, {scorer: cand[suite.specialist]}),
    )
    parent, cand_scores, unscored = paired_values(scored)
    check_unscored(scored, unscored, contract.promotion.max_unscored_share)
    left_out = set(unscored[scorer])
    record: dict[str, Any] = {
        "specialist": suite.specialist,
        "scored_as": scorer,
        "parent": [round(v, 4) for v in parent[scorer]],
        "candidate": [round(v, 4) for v in cand_scores[scorer]],
        "max_regression": suite.max_regression,
        "error_rate": suite.error_rate,
        "sha256": suite_sha256(items),
        # the held-out suites' one reader of groups (``metadata.group``): lint refuses any other form
        **compared_groups(items, left_out),
    }
    if left_out:
        record["unscored"] = len(left_out)
    return record


def evaluate_retention(
    contract: ContractSpec,
    champion: PairSpec,
    candidate: PairSpec,
    *,
    resolved: dict[str, list[dict[str, Any]]] | None = None,
    progress: Progress | None = None,
) -> dict[str, dict[str, Any]]:
    """``evaluation["retention"]``: every retention suite whose specialist the candidate serves, by name (a
    suite of a specialist the lineage does not serve is skipped, with a log line). ``resolved``: the suites'
    items (``resolve_retention``'s), when the caller has them already."""

    if not contract.retention:
        return {}
    resolved = resolved if resolved is not None else resolve_retention(contract)
    out: dict[str, dict[str, Any]] = {}
    for suite in contract.retention:
        if suite.specialist not in candidate.adapters or suite.specialist not in champion.adapters:
            log.info(
                "retention suite %s: the lineage does not serve %s; skipped", suite.name, suite.specialist
            )
            continue
        out[suite.name] = evaluate_suite(
            contract, suite, resolved[suite.name], champion, candidate, progress=progress
        )
    return out


def spend_retention(
    *, generation_id: int, retention: dict[str, dict[str, Any]], items: dict[str, list[dict[str, Any]]]
) -> dict[str, int]:
    """The attempt ``j`` of each suite's non-inferiority test, from the registry's spending ledger (every
    earlier generation, of any lineage or contract version, whose non-inferiority or retention tests used
    any of the suite's items; ``items``: suite name -> its resolved items, ``resolve_retention``'s)."""

    if not retention:
        return {}
    with session_scope(get_engine()) as session:
        lineage = session.get(Generation, generation_id).lineage
        spent = spend(
            session,
            generation_id=generation_id,
            lineage=lineage,
            tests={f"retention:{name}": [r["sha256"]] for name, r in retention.items()},
            items={r["sha256"]: item_keys(items[name], r["specialist"]) for name, r in retention.items()},
        )
    return {name: int(spent[f"retention:{name}"]) for name in retention}


def forgetting(
    contract: ContractSpec,
    champion: PairSpec,
    candidate: PairSpec,
    answers: dict[str, list[dict[str, Any]]],
    *,
    generation_id: int,
    attempts: dict[str, Any] | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """What ``evaluate_step`` adds to a candidate's evaluation: ``retention`` (per suite), ``attempts`` with
    the retention suites' attempts added to ``attempts`` (the held-out tests' ones, kept), and
    ``divergence`` (per specialist, the candidate's KL to the base and to its parent, teacher-forced on its
    greedy held-out ``answers``)."""

    items = resolve_retention(contract) if contract.retention else {}  # answered, and counted by the ledger
    retention = evaluate_retention(contract, champion, candidate, resolved=items, progress=progress)
    return {
        "retention": retention,
        "attempts": {**(attempts or {}), "retention": spend_retention(generation_id=generation_id,
                                                                      retention=retention, items=items)},
        "divergence": measure_divergence(candidate, champion, answers),
    }  # fmt: skip
