"""Promotion: the contract's gates turn the candidate's evaluation into a verdict; promote or reject.

``judge(comparison, gates, attempt=j, attempts=..., retention=..., divergence=..., router=...)`` promotes
only when all hold, every test one-sided on the paired item-level differences (``pipeline.gates.inference``; a
group of items is one unit):

- **improvement**: the overall delta (the mean of the specialists' mean differences) is above
  ``min_improvement``, by an exact sign-flip permutation test whose null is exchangeability of the two
  pairs' scores on each item (each unit's difference as likely to have had the other sign: valid for
  bounded, tied scores; not for the wider null "equal means" with skewed differences, see
  ``pipeline.gates.inference``), tested at the rate attempt ``j`` on the held-out suites may spend
  (``PromotionGates.attempt_rate``: ``false_promotion_rate * 6 / (pi**2 j**2)``, times ``6 / (pi**2 e**2)``
  on the ``e``-th fresh sample of suites that draw one per champion). ``j`` and ``e`` come from the
  registry's spending ledger (``evaluation.attempts.improvement``): it counts every test ever made on
  the suites, whatever the champion, lineage or contract version, so the rates of all tests on a suite sum
  to ``false_promotion_rate``: the chance that any of them promotes a candidate no better than its parent
  stays at most that (no independence needed: a union bound);
- **no regression**: per specialist, its mean difference is above minus its tolerance (non-inferiority: a
  betting test of the mean of bounded differences, valid for any distribution whose mean is at the margin
  or below), at ``regression_error_rate`` spent the same way over that specialist's own attempts
  (``attempts["noninferiority"][s]``);
- **retention**: per retention suite (``evaluation.retention``), the candidate has not lost more than
  the suite's ``max_regression`` (the same betting test), at the suite's ``error_rate`` spent over its attempts
  (``attempts["retention"][name]``);
- **divergence**: with ``promotion.max_kl_to_base`` set, every specialist's mean per-token KL to the base
  model (``evaluation.divergence``) is within it (not measured, or not a finite number: not promoted);
- **enough items**: every specialist has ``min_heldout_samples`` held-out items scored on both pairs, and
  every specialist that was evaluated (``evaluation.suites``, ``evaluation.items``) is in the
  comparison: one whose items were all left out would otherwise escape every gate;
- **routing**: the router's accuracy on the contract's routing suite has not dropped below the parent's
  by more than ``routing.max_accuracy_drop``.

An evaluation written before the ledger has only ``attempt``: every test then uses it as its ``j``. The
comparison is made of the items scored on both pairs: the evaluation left out those a scorer could not
score on either side (``evaluation.unscored``, at most ``promotion.max_unscored_share`` of them, or the
evaluation step failed), and the verdict says how many. Its reasons say all of it in words and numbers
(p-values, how each was computed, the rate used and the attempt it was); ``Verdict.tests`` keeps them as
rows. ``decide_step`` applies it. The registry is the truth about the champion: MLflow's ``champion`` alias
of each specialist's adapter moves only after the registry's commit (``sync_champion_aliases``), and where
that fails (MLflow unreachable between the two) the next sync (``ratchet advance``, ``ratchet
promote``/``rollback``, ``ratchet sync-aliases``) repairs it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipeline.errors import RatchetError
from pipeline.gates.inference import Betting, Comparison, SignFlip, improvement_test, noninferiority_test
from pipeline.gates.transfer import track_generation
from pipeline.loop.candidate import AdvanceConfig, Progress, contract_of, load_generation, mark_step
from pipeline.loop.publication import publish_decision
from pipeline.registry import (
    Generation,
    get_champion,
    get_engine,
    promote_generation,
    session_scope,
    set_generation_status,
)
from pipeline.registry.db import hold_lock
from pipeline.registry.documents import (
    Attempts,
    DecideOutcome,
    DivergenceRecord,
    GenerationEvaluation,
    RetentionRecord,
    RouterRecord,
    VerdictRecord,
    evaluation_of,
)
from pipeline.registry.tracking import TrackingUnavailable, registered_model_name

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from pipeline.registry.tracking import Tracker
    from pipeline.specs.contract import PromotionGates, RoutingSuite


@dataclass
class Verdict:
    """The gates' decision, in words and numbers."""

    promote: bool
    attempt: int
    rate: float  # the error rate this attempt's improvement test used
    lower: float  # the overall delta's one-sided t lower bound at that rate (descriptive; the gate is p)
    reasons: list[str] = field(default_factory=list)
    p: float | None = None  # the improvement test's p-value
    tests: list[dict[str, Any]] = field(default_factory=list)  # every test: name, p, rate, attempt, ...

    @property
    def decision(self) -> str:
        return ("promote: " if self.promote else "reject: ") + "; ".join(self.reasons)

    def to_dict(self) -> dict[str, Any]:
        """As stored with the evaluation (``evaluation.verdict``)."""
        return {
            "promote": self.promote,
            "rate": self.rate,
            "lower": self.lower,
            "p": self.p,
            "tests": self.tests,
            "reasons": self.reasons,
        }


def t_quantile(q: float, df: float) -> float:
    """The ``q`` quantile of Student's t with ``df`` degrees of freedom (normal for infinite ``df``)."""
    from scipy.stats import norm, t

    return float(norm.ppf(q) if math.isinf(df) else t.ppf(q, df))


def spent_rate(rate: float, attempt: int) -> float:
    """The share of ``rate`` the ``attempt``-th test on a suite may use: ``rate * 6 / (pi**2 attempt**2)``
    (the shares of attempts 1, 2, ... sum to ``rate``)."""
    return rate * 6 / (math.pi**2 * max(1, attempt) ** 2)


def _row(
    name: str, result: SignFlip | Betting, *, rate: float, attempt: int, margin: float, passed: bool
) -> dict:
    return {
        "test": name,
        "p": result.p,
        "method": result.method,
        "units": result.units,
        "draws": result.draws,
        "mc_error": result.error,
        "rate": rate,
        "attempt": attempt,
        "margin": margin,
        "passed": passed,
    }


def judge(
    comparison: Comparison,
    gates: PromotionGates,
    *,
    attempt: int,
    attempts: Attempts | dict[str, Any] | None = None,
    retention: dict[str, RetentionRecord | dict[str, Any]] | None = None,
    divergence: dict[str, DivergenceRecord | dict[str, Any]] | None = None,
    routing: RoutingSuite | None = None,
    router: RouterRecord | dict[str, Any] | None = None,
    parent_router: RouterRecord | dict[str, Any] | None = None,
    unscored: dict[str, int] | None = None,
    evaluated: Iterable[str] | None = None,
) -> Verdict:
    """Apply the promotion gates to a paired comparison (see the module doc). ``attempt``: the improvement
    test's attempt ``j`` on its suites; ``attempts``: the ledger's numbers as stored
    (``{"noninferiority": {s: j}, "retention": {name: j}}``; a test missing there uses ``attempt``).
    ``unscored``: per specialist, the held-out items the evaluation left out of the comparison (named in the
    reasons; not a gate here). ``evaluated``: the specialists whose held-out suites were evaluated; each
    must be in the comparison with items (so must those with ``unscored`` items). Each stored part is read
    as its document model (``pipeline.registry.documents``)."""
    attempts = Attempts.model_validate(attempts or {})
    retention = {n: RetentionRecord.model_validate(r) for n, r in (retention or {}).items()}
    divergence = {s: DivergenceRecord.model_validate(d) for s, d in (divergence or {}).items()}
    router = RouterRecord.model_validate(router) if router is not None else None
    parent_router = RouterRecord.model_validate(parent_router) if parent_router is not None else None
    sample = attempts.improvement_sample  # which fresh sample of the suites (None: fixed suites)
    rate = gates.attempt_rate(attempt, sample)
    lower = comparison.delta - t_quantile(1 - rate, comparison.df) * comparison.se
    verdict = Verdict(promote=True, attempt=attempt, rate=rate, lower=lower)
    reasons = verdict.reasons
    if not comparison.specialists:
        verdict.promote = False
        reasons.append("no held-out items")
        return verdict
    # evaluated but absent from the comparison (every item left out, an empty suite): no test would see it
    expected = set(evaluated or ()) | {s for s, n in (unscored or {}).items() if n}
    empty = sorted(expected - {s for s, c in comparison.specialists.items() if c.n > 0})
    empty += sorted(s for s, c in comparison.specialists.items() if c.n == 0 and s not in empty)
    small = [f"{s} has 0 items" for s in empty] + [
        f"{s} has {c.n} items < {gates.min_heldout_samples}"
        for s, c in comparison.specialists.items()
        if 0 < c.n < gates.min_heldout_samples
    ]
    if small:
        verdict.promote = False
        reasons.append("too few held-out items (" + ", ".join(small) + ")")
    missing = sorted(s for s, c in comparison.specialists.items() if len(c.diffs) != c.n)
    if missing:
        verdict.promote = False
        reasons.append(f"no item-level differences stored for {', '.join(missing)}: nothing to test")
    margin = gates.min_improvement
    test = improvement_test(comparison, margin=margin, alpha=rate)
    verdict.p, significant = test.p, test.rejects(rate) and not missing
    verdict.tests.append(
        _row("improvement", test, rate=rate, attempt=attempt, margin=margin, passed=significant)
    )
    reasons.append(
        f"overall {comparison.candidate_overall:.3f} vs champion {comparison.champion_overall:.3f}: "
        f"delta {comparison.delta:+.3f} (sign-flip {test.describe()}; needs p <= {rate:.4g}: attempt "
        f"{attempt} on its held-out suites{f', fresh sample {sample}' if sample else ''}, {rate:.4g} of "
        f"the lineage's {gates.false_promotion_rate:g})"
    )
    if unscored and (left_out := sum(unscored.values())):
        where = ", ".join(f"{s} {n}" for s, n in sorted(unscored.items()) if n)
        reasons.append(f"{left_out} held-out items left out, unscored on a pair ({where})")
    if not significant:
        verdict.promote = False
        need = "above 0" if margin == 0 else f"above the minimum improvement {margin:+.3f}"
        reasons.append(f"the improvement is not significant: the overall delta must be {need}")
    kept = []
    for s, c in comparison.specialists.items():
        tol, j = gates.tolerance(s), int(attempts.noninferiority.get(s, attempt))
        r = spent_rate(gates.regression_error_rate, j)
        ni = noninferiority_test(c.diffs, c.groups, tolerance=tol, alpha=r)
        ok = ni.rejects(r) and len(c.diffs) == c.n
        verdict.tests.append(_row(f"noninferiority:{s}", ni, rate=r, attempt=j, margin=-tol, passed=ok))
        where = f"{ni.describe()}; needs p <= {r:.4g}: attempt {j} on its suite"
        if ok:
            kept.append(f"{s}: {ni.describe()}, needs <= {r:.2g} at attempt {j}")
            continue
        verdict.promote = False
        reasons.append(
            f"{s} may have regressed beyond its tolerance: {c.champion:.3f} -> {c.candidate:.3f} "
            f"({c.delta:+.3f}; non-inferiority at -{tol:.3f}: {where}, of regression_error_rate "
            f"{gates.regression_error_rate:g})"
        )
    if kept:
        reasons.append(f"no specialist regressed beyond its tolerance ({'; '.join(kept)})")
    _retention(verdict, retention, attempts.retention, attempt)
    _divergence(verdict, comparison, gates, divergence)
    before = parent_router.accuracy if parent_router is not None else None
    after = router.accuracy if router is not None else None
    if routing is not None and before is not None and after is not None:
        if before - after > routing.max_accuracy_drop:
            verdict.promote = False
            reasons.append(
                f"router accuracy fell {before:.3f} -> {after:.3f} on the routing suite (tolerance "
                f"{routing.max_accuracy_drop:.3f})"
            )
    return verdict


def _retention(
    verdict: Verdict, retention: dict[str, RetentionRecord], attempts: dict[str, int], default: int
) -> None:
    """Non-inferiority on every retention suite, each at its own error rate spent over its attempts."""
    kept = []
    for name, suite in sorted(retention.items()):
        parent, candidate = suite.parent, suite.candidate
        diffs = [b - a for a, b in zip(parent, candidate, strict=True)]
        tol, j = float(suite.max_regression or 0.0), int(attempts.get(name, default))
        error_rate = float(suite.error_rate if suite.error_rate is not None else 0.05)
        r = spent_rate(error_rate, j)
        ni = noninferiority_test(diffs, suite.groups, tolerance=tol, alpha=r)
        ok = ni.rejects(r)
        verdict.tests.append(_row(f"retention:{name}", ni, rate=r, attempt=j, margin=-tol, passed=ok))
        if ok:
            kept.append(f"{name}: {ni.describe()}, needs <= {r:.2g} at attempt {j}")
            continue
        before = sum(parent) / len(parent) if parent else 0.0
        after = sum(candidate) / len(candidate) if candidate else 0.0
        verdict.promote = False
        verdict.reasons.append(
            f"retention suite {name} ({suite.specialist}) may have been forgotten beyond its "
            f"tolerance: {before:.3f} -> {after:.3f} ({after - before:+.3f} over {len(diffs)} items; "
            f"non-inferiority at -{tol:.3f}: {ni.describe()}; needs p <= {r:.4g}: attempt {j} on the suite, "
            f"of its error_rate {error_rate:g})"
        )
    if kept:
        verdict.reasons.append(f"retention suites kept ({'; '.join(kept)})")


def _divergence(
    verdict: Verdict,
    comparison: Comparison,
    gates: PromotionGates,
    divergence: dict[str, DivergenceRecord],
) -> None:
    """``promotion.max_kl_to_base``: every specialist's KL to the base within it (unmeasured: refused)."""
    budget = gates.max_kl_to_base
    if budget is None:
        return
    over, unmeasured = [], []
    for s in sorted(comparison.specialists):
        kl = divergence[s].kl_to_base if s in divergence else None
        if not isinstance(kl, int | float) or not math.isfinite(kl):  # NaN passes every comparison
            unmeasured.append(s if kl is None else f"{s} (KL {kl})")
        elif kl > budget:
            over.append(f"{s} {kl:.4f}")
    if over:
        verdict.promote = False
        verdict.reasons.append(
            f"KL to the base model above promotion.max_kl_to_base {budget:g} nats/token ({', '.join(over)})"
        )
    if unmeasured:
        verdict.promote = False
        verdict.reasons.append(
            f"KL to the base model not measured for {', '.join(unmeasured)} (promotion.max_kl_to_base "
            f"{budget:g} is set: it cannot be checked)"
        )


def attempts_of(evaluation: GenerationEvaluation | dict[str, Any]) -> tuple[int, Attempts]:
    """The improvement test's attempt and the ledger's attempts as stored; an evaluation written before
    the ledger has only ``attempt`` (every test then uses it)."""
    evaluation = GenerationEvaluation.model_validate(evaluation)
    return evaluation.improvement_attempt(), evaluation.attempts or Attempts()


def decide_step(
    *,
    generation_id: int,
    config: AdvanceConfig,
    tracker: Tracker | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Apply the gates' verdict: promote or reject in the registry; then MLflow's champion aliases follow."""

    with session_scope(get_engine()) as session:
        gen = load_generation(session, generation_id)
        # Champion moves of the lineage wait until this decision commits (a rollback cannot slip in between
        # the check below and the promotion), and the champion is read after taking the lock.
        hold_lock(session=session, key=f"lineage:{gen.lineage}")
        evaluation = evaluation_of(gen)
        contract = contract_of(gen)
        champion = get_champion(session=session, lineage=gen.lineage)
        if champion is None or champion.id != gen.parent_id:
            # An operator moved the champion (a rollback, a manual promotion) while this candidate was being
            # built: it was compared with its parent only, never with the champion it would replace.
            parent = session.get(Generation, gen.parent_id) if gen.parent_id is not None else None
            now = f"generation {champion.number}" if champion else "none"
            promote = False
            decision = (
                f"reject: its parent is no longer the champion (built from generation "
                f"{parent.number if parent else '-'}; the champion is now {now}): it was never compared "
                "with the champion it would replace"
            )
        elif evaluation.comparison is not None:
            attempt, attempts = attempts_of(evaluation)
            verdict = judge(
                Comparison.from_dict(
                    evaluation.comparison.as_stored(), {s: i.as_stored() for s, i in evaluation.items.items()}
                ),
                contract.promotion,
                attempt=attempt,
                attempts=attempts,
                retention=evaluation.retention,
                divergence=evaluation.divergence,
                routing=contract.routing,
                router=evaluation.router,
                parent_router=evaluation.parent_router,
                unscored=evaluation.unscored,
                evaluated=set(evaluation.suites) | set(evaluation.items),
            )
            promote, decision = verdict.promote, verdict.decision
            evaluation.verdict = VerdictRecord.model_validate(verdict.to_dict())
            gen.evaluation = evaluation.as_stored()
        else:
            promote, decision = False, "reject: not evaluated"
        if promote:
            promote_generation(session=session, generation=gen, reason=decision, actor="advance")
            status = "promoted"
        else:
            set_generation_status(
                session=session, generation=gen, status="rejected", reason=decision, actor="advance"
            )
            status = "rejected"
        mark_step(session, gen, "decide", DecideOutcome(status=status))
        outcome = {
            "generation": gen.number,
            "status": status,
            "decision": decision,
            "overall": evaluation.overall,
            "parent_overall": evaluation.parent_overall,
        }
    if promote:  # after the commit: the registry decided, the aliases follow (or the next sync repairs them)
        try:
            sync_champion_aliases(lineage=config.lineage, tracker=tracker)
        except RatchetError as exc:
            log.warning("%s", exc)
            outcome["aliases"] = str(exc)
    if tracker is not None:  # its accuracy-matrix row, backward transfer and KL as MLflow metrics (a report)
        try:
            track_generation(tracker, lineage=config.lineage, generation_id=generation_id)
        except Exception as exc:  # the decision is committed: MLflow missing a report must not undo it
            log.warning(
                "generation %s: its metrics were not logged to MLflow (%s)", outcome["generation"], exc
            )

    try:
        publish_decision(lineage=config.lineage, generation_id=generation_id, tracker=tracker)
    except Exception as exc:  # committed already, as above
        log.warning("generation %s: its decision was not published (%s)", outcome["generation"], exc)
    return outcome


def sync_champion_aliases(
    *, lineage: str, tracker: Tracker | Callable[[], Tracker] | None, engine: Engine | None = None
) -> int:
    """Point each specialist's MLflow ``champion`` alias at the registry champion's adapter (or remove it
    where the champion has none registered); returns how many aliases were set. Idempotent: run after every
    champion move's commit, and again at the next advance in case MLflow was unreachable the first time.

    ``tracker`` may be a function that makes it (opening MLflow can fail too, and is reported the same way).
    An MLflow failure is one ``RatchetError`` saying that the registry has moved and how to repair."""

    if tracker is None:
        return 0
    with session_scope(engine or get_engine()) as session:
        champion = get_champion(session=session, lineage=lineage)
        if champion is None:
            return 0
        number = champion.number
        wanted = {
            slot.specialist: slot.adapter.mlflow_model_version if slot.adapter is not None else None
            for slot in champion.adapters
        }
    done = 0
    try:
        if callable(tracker):
            tracker = tracker()
        for specialist, version in sorted(wanted.items()):
            name = registered_model_name(lineage, specialist)
            if version:
                tracker.set_alias(name, "champion", version)
                done += 1
            else:
                tracker.delete_alias(name, "champion")
    except Exception as exc:  # MLflow's errors (HTTP, store) are many types; none may pass as a traceback
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        reason = reason.removeprefix("error: ")
        raise RatchetError(
            f"generation {number} is the champion of {lineage!r} in the registry, but MLflow's champion "
            f"aliases could not be moved ({reason[:200]}): `ratchet sync-aliases --lineage {lineage}` (or the "
            "next `ratchet advance`) moves them once MLflow is reachable"
        ) from (exc if isinstance(exc, TrackingUnavailable) else None)
    return done
