"""Scoring one trace under a contract: pure functions (no registry).

``score_trace`` scores every assistant turn with the scorers of the specialist that served it and
aggregates per the contract: scorer values -> turn score (weighted mean or min, zeroed by a failed
``required`` gate) -> trace total (mean of the scored turns, shown) and the *final* turn's score (what
selection, preference ranking, exemplars, router data and evaluation read: the final assistant turn is the
only one a trace can teach, and earlier turns must not lift a wrong ending). A turn is *checked* when at
least one scorer that verifies outcomes (``ScorerBase.verifies_outcome``) applied to it, and *passed* when it
was checked and none of those checks failed (``TraceScoreResult.final_passed``). A user's correction is scored
as the trace with the corrected final turn (the user's rating, which judged the original answer, left out).

A trace's ``principal`` (``pipeline.experience.principals``) is who certified its metadata; a trace dict without the
key is the loop's own (evaluation items, discovery, rewards), one from the registry always has it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from statistics import mean
from typing import Any

from pipeline.experience.principals import LOOP
from pipeline.scoring.scorers import TurnContext, called_tool, run_scorer
from pipeline.specs.contract import ContractSpec
from pipeline.specs.harness import HarnessSpec

log = logging.getLogger(__name__)
TOTAL = "total"
FINAL = "final"  # the score row of the final assistant turn (``final_details``)


@dataclass
class TurnScore:
    """One assistant turn: who served it, each scorer's value and error, and the turn score."""

    turn: int
    specialist: str
    values: dict[str, float | None]
    errors: dict[str, str]
    total: float | None
    gated_by: str | None = None
    verified_by: list[str] = field(default_factory=list)  # the verifying scorers that applied
    failed_checks: list[str] = field(default_factory=list)  # ... and of those, the ones below pass_threshold


@dataclass
class TraceScoreResult:
    """A trace's scores under one contract."""

    specialist: str
    total: float | None
    values: dict[str, float | None]
    details: dict[str, dict[str, Any]]
    turns: list[TurnScore] = field(default_factory=list)
    by_specialist: dict[str, float | None] = field(default_factory=dict)
    correction: dict[str, Any] | None = None  # the corrected trace's total, verifiers and failed checks

    @property
    def verified(self) -> bool:
        """Whether the final assistant turn (the training target) was checked by a verifying scorer."""
        return bool(self.turns) and bool(self.turns[-1].verified_by)

    @property
    def final(self) -> TurnScore | None:
        """The final assistant turn's score: what selection, preference ranking, exemplars, router data and
        evaluation read (the trace's ``total`` is the mean over every scored turn, shown beside it)."""
        return self.turns[-1] if self.turns else None

    @property
    def final_passed(self) -> bool:
        """Whether a verifying scorer checked the final turn and none of the verifying checks on it failed."""
        final = self.final
        return final is not None and bool(final.verified_by) and not final.failed_checks

    def learnable(self, min_score: float) -> bool:
        """Whether the trace may be learned from as it is: its final turn passed and scores at least
        ``min_score`` (the contract's ``selection.min_score``)."""
        final = self.final
        return (
            self.final_passed and final is not None and final.total is not None and final.total >= min_score
        )

    @property
    def errors(self) -> int:
        """Number of scorer errors over all turns."""
        return sum(len(t.errors) for t in self.turns)


def turn_specialists(
    contract: ContractSpec, trace: dict[str, Any], *, specialist: str | None = None
) -> dict[int, str]:
    """Map each assistant message index to the specialist that served it.

    ``specialist`` (when given) overrides everything; else a ``routes`` entry ``{"turn", "specialist"}``
    for that message, else ``metadata.specialist``, else the contract's default specialist.
    """
    messages = trace.get("messages") or []
    routes: dict[int, str] = {}
    for route in trace.get("routes") or []:
        if isinstance(route, dict) and isinstance(route.get("turn"), int) and route.get("specialist"):
            routes[route["turn"]] = str(route["specialist"])
    fallback = (trace.get("metadata") or {}).get("specialist") or contract.default_specialist
    out = {}
    for i, msg in enumerate(messages):
        if isinstance(msg, dict) and msg.get("role") == "assistant":
            out[i] = specialist or routes.get(i) or str(fallback)
    return out


def aggregate_turn(
    scorers: list[Any], values: dict[str, float | None], how: str
) -> tuple[float | None, str | None]:
    """Combine one turn's scorer values: (score, name of the failed required gate or None)."""
    applicable = [(s, values[s.key]) for s in scorers if values.get(s.key) is not None]
    if not applicable:
        return None, None
    for s, v in applicable:
        if s.required and v < s.pass_threshold:
            return 0.0, s.key
    if how == "min":
        return min(v for _, v in applicable), None
    weight = sum(s.weight for s, _ in applicable)
    if weight <= 0:  # only zero-weight gates applied, and they passed
        return mean(v for _, v in applicable), None
    return sum(s.weight * v for s, v in applicable) / weight, None


def score_trace(
    contract: ContractSpec,
    trace: dict[str, Any],
    *,
    harness: HarnessSpec | None = None,
    specialist: str | None = None,
) -> TraceScoreResult:
    """Score every assistant turn of ``trace`` and aggregate per ``contract`` (see the module doc)."""
    messages = trace.get("messages") or []
    metadata = trace.get("metadata") or {}
    principal = trace.get("principal", LOOP)
    served = turn_specialists(contract, trace, specialist=specialist)
    last = max(served) if served else None
    callers = {sp for i, sp in served.items() if called_tool(messages[i])}
    turns: list[TurnScore] = []
    for index, name in served.items():
        known = name if name in contract.specialists else contract.default_specialist
        entry = contract.specialists[known]
        ctx = TurnContext(
            messages=messages,
            index=index,
            specialist=name,
            metadata=metadata,
            feedback=trace.get("feedback"),
            harness=harness,
            is_final=index == last,
            specialist_called_tool=name in callers,
            principal=principal,
        )
        values: dict[str, float | None] = {}
        errors: dict[str, str] = {}
        verified_by, failed = [], []
        if known != name:
            errors["specialist"] = f"{name!r} is not in the contract; scored as {known!r}"
        for cfg in entry.scorers:
            outcome = run_scorer(cfg, ctx)
            values[cfg.key] = outcome.value
            if outcome.error:
                errors[cfg.key] = outcome.error
            if cfg.verifies_outcome(outcome.value, outcome.verified):
                verified_by.append(cfg.key)
                if outcome.value < cfg.pass_threshold:
                    failed.append(cfg.key)
        total, gate = aggregate_turn(list(entry.scorers), values, entry.aggregate)
        turns.append(TurnScore(index, name, values, errors, total, gate, verified_by, failed))
    result = _summarise(contract, trace, served, turns)
    corrected = corrected_trace(trace)
    if corrected is not None:
        checked = score_trace(contract, corrected, harness=harness, specialist=specialist)
        final = checked.final
        result.correction = {  # the corrected final turn's own score and checks
            "total": final.total if final else None,
            "verified_by": final.verified_by if final else [],
            "failed": final.failed_checks if final else [],
            "errors": final.errors if final else {},
        }
    return result


@dataclass(frozen=True)
class EpisodeReward:
    """What reinforcement learning gets for one episode: the reward, and the last assistant turn it pays for
    (its index in the episode's messages; None when no turn was checked)."""

    value: float
    turn: int | None


def episode_reward(
    contract: ContractSpec, trace: dict[str, Any], *, harness: HarnessSpec | None, specialist: str
) -> EpisodeReward:
    """What reinforcement learning maximises (``training.reinforcement``): the score of the episode's last
    *checked* assistant turn -- the last one a verifying scorer applied to -- and that turn, so the update
    trains the policy's turns up to it and never a turn after it that nothing checked (a tool call's verdict
    belongs to the turn that made the calls; a text turn is checked only by a scorer of its own content). No
    turn checked: 0, as in curation (what the contract could not check pays nothing). The tool-call scorer
    judges a turn on every action of the request up to it, so an earlier call cannot buy a later pass."""
    result = score_trace(contract, trace, harness=harness, specialist=specialist)
    checked = [t for t in result.turns if t.verified_by and t.total is not None]
    if not checked:
        return EpisodeReward(0.0, None)
    last = checked[-1]
    return EpisodeReward(float(last.total), last.turn)  # type: ignore[arg-type]


def corrected_trace(trace: dict[str, Any]) -> dict[str, Any] | None:
    """The trace with its final assistant turn replaced by the user's ``feedback.correction`` (and nothing
    after it), without the feedback itself; None when there is no correction."""
    fb = trace.get("feedback")
    correction = fb.get("correction") if isinstance(fb, dict) else None
    if not isinstance(correction, str) or not correction.strip():
        return None
    messages = trace.get("messages") or []
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    if last is None:
        return None
    return {
        **trace,
        "messages": [*messages[:last], {"role": "assistant", "content": correction}],
        "feedback": None,
    }


def _summarise(
    contract: ContractSpec, trace: dict[str, Any], served: dict[int, str], turns: list[TurnScore]
) -> TraceScoreResult:
    keys = list(dict.fromkeys(k for t in turns for k in t.values))
    values: dict[str, float | None] = {}
    details: dict[str, dict[str, Any]] = {}
    for key in keys:
        per_turn = [t for t in turns if key in t.values]
        applied = [t.values[key] for t in per_turn if t.values[key] is not None]
        values[key] = mean(applied) if applied else None
        details[key] = {
            "turns": [{"turn": t.turn, "specialist": t.specialist, "value": t.values[key]} for t in per_turn],
            "errors": [f"turn {t.turn}: {t.errors[key]}" for t in per_turn if key in t.errors],
        }
    scored = [t.total for t in turns if t.total is not None]
    by_specialist: dict[str, float | None] = {}
    for name in dict.fromkeys(t.specialist for t in turns):
        sp_scores = [t.total for t in turns if t.specialist == name and t.total is not None]
        by_specialist[name] = mean(sp_scores) if sp_scores else None
    if turns:
        trace_specialist = turns[-1].specialist
    else:
        trace_specialist = str((trace.get("metadata") or {}).get("specialist") or contract.default_specialist)
    return TraceScoreResult(
        specialist=trace_specialist,
        total=mean(scored) if scored else None,
        values=values,
        details=details,
        turns=turns,
        by_specialist=by_specialist,
    )


def final_details(result: TraceScoreResult) -> dict[str, Any]:
    """The ``details`` stored with a trace's ``final`` row: the final turn's checks (the row's ``verified``:
    a verifying scorer applied to it; ``failed``: those of them below their pass threshold), and the
    correction's score when the trace has a correction."""
    final = result.final
    return {
        "turn": final.turn if final else None,
        "verified_by": final.verified_by if final else [],
        "failed": final.failed_checks if final else [],
        **({"gated_by": final.gated_by} if final and final.gated_by else {}),
        **({"correction": result.correction} if result.correction is not None else {}),
    }


def total_details(result: TraceScoreResult) -> dict[str, Any]:
    """The ``details`` stored with a trace's ``total`` row."""
    return {
        "specialist": result.specialist,
        "by_specialist": result.by_specialist,
        "verified": result.verified,
        "verified_by": result.turns[-1].verified_by if result.turns else [],
        "turns": [
            {
                "turn": t.turn,
                "specialist": t.specialist,
                "total": t.total,
                "verified_by": t.verified_by,
                "failed": t.failed_checks,
                **({"gated_by": t.gated_by} if t.gated_by else {}),
            }
            for t in result.turns
        ],
        "errors": {t.turn: t.errors for t in result.turns if t.errors},
        **({"correction": result.correction} if result.correction is not None else {}),
    }


def score_traces(
    contract: ContractSpec,
    traces: Iterable[dict[str, Any]],
    *,
    harness: HarnessSpec | None = None,
    workers: int | None = None,
) -> list[TraceScoreResult]:
    """Score many traces; sandboxed tests and judge calls overlap on a small thread pool."""
    traces = list(traces)
    workers = workers or min(4, os.cpu_count() or 1)
    if workers <= 1 or len(traces) <= 1:
        return [score_trace(contract, t, harness=harness) for t in traces]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda t: score_trace(contract, t, harness=harness), traces))


@dataclass
class ScorerStats:
    """Summary of one scorer for one specialist over many traces (the dry-run table)."""

    scorer: str
    specialist: str
    n: int = 0
    mean: float | None = None
    min: float | None = None
    max: float | None = None
    failures: int = 0


def summarise_results(contract: ContractSpec, results: list[TraceScoreResult]) -> list[ScorerStats]:
    """Per (scorer, specialist) statistics over trace-level values; ``total`` rows last."""
    thresholds = {
        (name, s.key): s.pass_threshold for name, entry in contract.specialists.items() for s in entry.scorers
    }
    buckets: dict[tuple[str, str], list[float]] = {}
    failures: dict[tuple[str, str], int] = {}
    for r in results:
        items = [*r.values.items(), (TOTAL, r.total)]
        for key, value in items:
            bucket = (key, r.specialist)
            buckets.setdefault(bucket, [])
            failures.setdefault(bucket, 0)
            if value is None:
                continue
            buckets[bucket].append(value)
            threshold = thresholds.get(
                (r.specialist, key), thresholds.get((contract.default_specialist, key), 1.0)
            )
            if key != TOTAL and value < threshold:
                failures[bucket] += 1
            if key == TOTAL and value < contract.selection.min_score:
                failures[bucket] += 1
    out = []
    for (key, sp), vals in buckets.items():
        out.append(
            ScorerStats(
                scorer=key,
                specialist=sp,
                n=len(vals),
                mean=mean(vals) if vals else None,
                min=min(vals) if vals else None,
                max=max(vals) if vals else None,
                failures=failures[(key, sp)],
            )
        )
    out.sort(key=lambda s: (s.scorer == TOTAL, s.specialist, s.scorer))
    return out
