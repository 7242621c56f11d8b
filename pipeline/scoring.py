"""Scoring traces under a contract: pure functions first, then the registry step.

``score_trace`` scores every assistant turn with the scorers of the specialist that served it and
aggregates per the contract: scorer values -> turn score (weighted mean or min, zeroed by a failed
``required`` gate) -> trace total (mean of the scored turns). ``score_experience`` does this for every
trace in the registry not yet scored under a contract version, in batches, storing one ``Score`` row
per scorer plus a ``total`` row.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from statistics import mean
from typing import TYPE_CHECKING, Any

from pipeline.contract import ContractSpec
from pipeline.harness import HarnessSpec
from pipeline.scorers import TurnContext, called_tool, run_scorer

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from pipeline.candidate import AdvanceConfig, Progress

log = logging.getLogger(__name__)
TOTAL = "total"


@dataclass
class TurnScore:
    """One assistant turn: who served it, each scorer's value and error, and the turn score."""

    turn: int
    specialist: str
    values: dict[str, float | None]
    errors: dict[str, str]
    total: float | None
    gated_by: str | None = None


@dataclass
class TraceScoreResult:
    """A trace's scores under one contract."""

    specialist: str
    total: float | None
    values: dict[str, float | None]
    details: dict[str, dict[str, Any]]
    turns: list[TurnScore] = field(default_factory=list)
    by_specialist: dict[str, float | None] = field(default_factory=dict)

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
        )
        values: dict[str, float | None] = {}
        errors: dict[str, str] = {}
        if known != name:
            errors["specialist"] = f"{name!r} is not in the contract; scored as {known!r}"
        for cfg in entry.scorers:
            outcome = run_scorer(cfg, ctx)
            values[cfg.key] = outcome.value
            if outcome.error:
                errors[cfg.key] = outcome.error
        total, gate = aggregate_turn(list(entry.scorers), values, entry.aggregate)
        turns.append(TurnScore(index, name, values, errors, total, gate))
    return _summarise(contract, trace, served, turns)


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


def total_details(result: TraceScoreResult) -> dict[str, Any]:
    """The ``details`` stored with a trace's ``total`` row."""
    return {
        "specialist": result.specialist,
        "by_specialist": result.by_specialist,
        "turns": [
            {
                "turn": t.turn,
                "specialist": t.specialist,
                "total": t.total,
                **({"gated_by": t.gated_by} if t.gated_by else {}),
            }
            for t in result.turns
        ],
        "errors": {t.turn: t.errors for t in result.turns if t.errors},
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


# ----------------------------------------------------------------------------------------- registry
@dataclass
class ScoreRunResult:
    """What a ``score_experience`` run did."""

    contract_version_id: int
    scored: int = 0
    rows: int = 0
    already_scored: int = 0
    unscorable: int = 0
    errors: int = 0
    by_specialist: dict[str, int] = field(default_factory=dict)


def score_experience(
    *,
    session: Session,
    contract_version_id: int,
    batch_size: int = 500,
    rescore: bool = False,
    progress: Callable[[int], None] | None = None,
    harness: HarnessSpec | None = None,
    workers: int | None = None,
) -> ScoreRunResult:
    """Score every trace that has no ``scores`` row under ``contract_version_id``.

    Streams the ``experience`` table by id in batches of ``batch_size`` (committing after each, so
    an interrupted run resumes where it stopped), and writes one ``Score`` row per scorer plus a
    ``total`` row whose details name the trace's specialist. Scores under other contract versions
    are untouched. ``rescore=True`` replaces this version's scores for every trace. Each trace is
    scored with the harness version it was served by (``harness`` is the fallback for traces that
    name none). ``progress(n)`` is called with the number of traces done after each batch.
    """
    from sqlalchemy import delete, exists, func, select

    from pipeline.clock import CLOCK
    from pipeline.contract import ContractSpec as _Contract
    from pipeline.errors import NotFoundError
    from pipeline.registry.models import ContractVersion, Experience, HarnessVersion, Score
    from pipeline.registry.scores import ScoreRow, insert_scores

    row = session.get(ContractVersion, contract_version_id)
    if row is None:
        raise NotFoundError(f"contract version id {contract_version_id} does not exist in the registry")
    contract = _Contract.model_validate(row.spec)
    result = ScoreRunResult(contract_version_id=contract_version_id)
    has_scores = exists().where(
        Score.experience_id == Experience.id, Score.contract_version_id == contract_version_id
    )
    if not rescore:
        result.already_scored = (
            session.scalar(select(func.count()).select_from(Experience).where(has_scores)) or 0
        )
    harnesses: dict[int, HarnessSpec | None] = {}

    def harness_for(version_id: int | None) -> HarnessSpec | None:
        if version_id is None:
            return harness
        if version_id not in harnesses:
            hv = session.get(HarnessVersion, version_id)
            try:
                harnesses[version_id] = HarnessSpec.model_validate(hv.spec) if hv is not None else harness
            except ValueError as exc:
                log.warning("harness version %s does not validate (%s); using the fallback", version_id, exc)
                harnesses[version_id] = harness
        return harnesses[version_id]

    columns = (
        Experience.id,
        Experience.messages,
        Experience.meta,
        Experience.feedback,
        Experience.routes,
        Experience.specialist,
        Experience.harness_version_id,
    )
    last_id = 0
    workers = workers or min(4, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        while True:
            stmt = select(*columns).where(Experience.id > last_id).order_by(Experience.id).limit(batch_size)
            if not rescore:
                stmt = stmt.where(~has_scores)
            rows = session.execute(stmt).all()
            if not rows:
                break
            last_id = rows[-1].id
            jobs = []
            for r in rows:
                meta = dict(r.meta or {})
                if r.specialist and not meta.get("specialist"):
                    meta["specialist"] = r.specialist
                trace = {
                    "messages": r.messages or [],
                    "metadata": meta,
                    "feedback": r.feedback,
                    "routes": r.routes,
                }
                jobs.append((r.id, trace, harness_for(r.harness_version_id)))
            with CLOCK.measure("score"):
                scored = list(pool.map(lambda job: score_trace(contract, job[1], harness=job[2]), jobs))
            ids = [job[0] for job in jobs]
            if rescore:
                session.execute(
                    delete(Score).where(
                        Score.contract_version_id == contract_version_id, Score.experience_id.in_(ids)
                    )
                )
            new_rows = []
            for exp_id, res in zip(ids, scored, strict=True):
                for key, value in res.values.items():
                    new_rows.append(ScoreRow(exp_id, contract_version_id, key, value, res.details[key]))
                new_rows.append(ScoreRow(exp_id, contract_version_id, TOTAL, res.total, total_details(res)))
                result.scored += 1
                result.errors += res.errors
                result.unscorable += res.total is None
                result.by_specialist[res.specialist] = result.by_specialist.get(res.specialist, 0) + 1
            result.rows += insert_scores(session=session, rows=new_rows)  # one executemany per batch
            session.commit()
            if progress is not None:
                progress(len(rows))
    return result


def score_step(
    *, generation_id: int, config: AdvanceConfig, progress: Progress | None = None
) -> dict[str, Any]:
    """Score all experience not yet scored under the candidate's contract version."""
    from pipeline.candidate import load_generation, mark_step
    from pipeline.registry import get_engine, session_scope

    engine = get_engine()
    with session_scope(engine) as session:
        contract_version_id = load_generation(session, generation_id).contract_version_id
    done = 0

    def report(n: int) -> None:
        nonlocal done
        done += n
        if progress:
            progress("score", done, 0)

    with session_scope(engine) as session:
        result = score_experience(session=session, contract_version_id=contract_version_id, progress=report)
    outcome = {"scored": result.scored, "errors": result.errors, "by_specialist": result.by_specialist}
    with session_scope(engine) as session:
        mark_step(session, load_generation(session, generation_id), "score", outcome)
    return outcome
