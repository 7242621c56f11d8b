"""The scoring step: every trace in the registry scored under a contract version, in resumable batches.

``score_experience`` scores what has no current score under a version and stores one ``Score`` row per
scorer, a ``total`` row (the mean over the trace's scored turns) and a ``final`` row (the final assistant
turn: its score, ``verified`` when a verifying scorer checked it, and the checks that failed on it -- what
decides whether the trace may be learned from);
``rescore_experience`` replaces the scores of given traces (feedback that arrived later). Replaced rows
move to ``score_history``: nothing scored is lost.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipeline.errors import NotFoundError
from pipeline.loop.candidate import load_generation, mark_step
from pipeline.loop.clock import CLOCK
from pipeline.registry import get_engine, session_scope
from pipeline.registry.models import ContractVersion, Experience, HarnessVersion, Score
from pipeline.registry.scores import ScoreRow, insert_scores, supersede_scores
from pipeline.scoring.trace import (
    FINAL,
    TOTAL,
    TraceScoreResult,
    TurnScore,
    final_details,
    score_trace,
    total_details,
)
from pipeline.specs.contract import stored_contract
from pipeline.specs.harness import HarnessSpec

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from pipeline.loop.candidate import AdvanceConfig, Progress

log = logging.getLogger(__name__)


@dataclass
class ScoreRunResult:
    """What a ``score_experience`` run did."""

    contract_version_id: int
    scored: int = 0
    rows: int = 0
    already_scored: int = 0
    unscorable: int = 0
    unverified: int = 0
    errors: int = 0
    superseded: int = 0
    by_specialist: dict[str, int] = field(default_factory=dict)


_COLUMNS = ("id", "messages", "meta", "feedback", "routes", "specialist", "harness_version_id", "principal")


class _Batches:
    """Scores batches of experience rows under one contract version: harness per trace, thread pool, rows."""

    def __init__(
        self,
        session: Session,
        contract_version_id: int,
        harness: HarnessSpec | None,
        workers: int,
        timeout_s: float = 0.0,
    ):

        row = session.get(ContractVersion, contract_version_id)
        if row is None:
            raise NotFoundError(f"contract version id {contract_version_id} does not exist in the registry")
        self.session, self.contract_version_id = session, contract_version_id
        self.contract = stored_contract(row.spec)
        self.fallback = harness
        self.harnesses: dict[int, HarnessSpec | None] = {}
        self.pool = ThreadPoolExecutor(max_workers=max(1, workers))
        self.timeout_s = timeout_s  # per batch; 0: none (see ``timed``)

    def harness_for(self, version_id: int | None) -> HarnessSpec | None:

        if version_id is None:
            return self.fallback
        if version_id not in self.harnesses:
            hv = self.session.get(HarnessVersion, version_id)
            try:
                self.harnesses[version_id] = HarnessSpec.model_validate(hv.spec) if hv else self.fallback
            except ValueError as exc:
                log.warning("harness version %s does not validate (%s); using the fallback", version_id, exc)
                self.harnesses[version_id] = self.fallback
        return self.harnesses[version_id]

    def timed(self, jobs: list[tuple[int, dict, HarnessSpec | None]]) -> list[TraceScoreResult]:
        """Score each job in a daemon thread, waiting ``timeout_s`` for them all: a trace whose scoring is
        still running then is stored as scored by nothing (not verified), with the reason, and its thread is
        left to end on its own (a thread cannot be stopped; a daemon one holds no exit). Nothing hangs the
        caller -- the server's feedback -- whatever a scorer does."""
        out: list[TraceScoreResult | BaseException | None] = [None] * len(jobs)

        def run(i: int, trace: dict, harness: HarnessSpec | None) -> None:
            try:
                out[i] = score_trace(self.contract, trace, harness=harness)
            except BaseException as exc:  # raised in the caller, as without a timeout
                out[i] = exc

        threads = [
            threading.Thread(target=run, args=(i, job[1], job[2]), daemon=True, name="rescore")
            for i, job in enumerate(jobs)
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + self.timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        done = []
        for (exp_id, trace, _), result in zip(jobs, out, strict=True):
            if isinstance(result, BaseException):
                raise result
            if result is None:  # still running
                log.warning("scoring experience %s did not finish within %g s", exp_id, self.timeout_s)
                result = _unscored(trace, f"scoring did not finish within {self.timeout_s:g} s: not verified")
            done.append(result)
        return done

    def score(self, rows: list[Any], result: ScoreRunResult, reason: str) -> None:
        """Score ``rows`` (experience columns ``_COLUMNS``), replace their scores under this version (the
        old ones go to ``score_history`` with ``reason``) and commit."""

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
                "principal": r.principal,  # who certified its metadata (None: nobody known)
            }
            jobs.append((r.id, trace, self.harness_for(r.harness_version_id)))
        with CLOCK.measure("score"):
            if self.timeout_s:
                scored = self.timed(jobs)
            else:
                scored = list(
                    self.pool.map(lambda job: score_trace(self.contract, job[1], harness=job[2]), jobs)
                )
        ids = [job[0] for job in jobs]
        result.superseded += supersede_scores(
            session=self.session,
            experience_ids=ids,
            contract_version_id=self.contract_version_id,
            reason=reason,
        )
        new_rows = []
        for exp_id, res in zip(ids, scored, strict=True):
            final = res.turns[-1] if res.turns else None
            for key, value in res.values.items():
                checked = final is not None and key in final.verified_by
                new_rows.append(
                    ScoreRow(
                        exp_id,
                        self.contract_version_id,
                        key,
                        value,
                        res.details[key],
                        checked,
                        res.specialist,
                    )
                )
            new_rows.append(
                ScoreRow(
                    exp_id,
                    self.contract_version_id,
                    TOTAL,
                    res.total,
                    total_details(res),
                    res.verified,
                    res.specialist,
                )
            )
            new_rows.append(
                ScoreRow(
                    exp_id,
                    self.contract_version_id,
                    FINAL,
                    final.total if final is not None else None,
                    final_details(res),
                    res.verified,
                    res.specialist,
                )
            )
            result.scored += 1
            result.errors += res.errors
            result.unscorable += res.total is None
            result.unverified += not res.verified
            result.by_specialist[res.specialist] = result.by_specialist.get(res.specialist, 0) + 1
        result.rows += insert_scores(session=self.session, rows=new_rows)  # one executemany per batch
        self.session.commit()


def _unscored(trace: dict[str, Any], reason: str) -> TraceScoreResult:
    """A trace scored by nothing: its final assistant turn holds ``reason`` as its one error."""
    messages = trace.get("messages") or []
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=0)
    specialist = str((trace.get("metadata") or {}).get("specialist") or "")
    turn = TurnScore(last, specialist, {}, {"timeout": reason}, None)
    return TraceScoreResult(specialist=specialist, total=None, values={}, details={}, turns=[turn])


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
    """Score every trace without a current score under ``contract_version_id``.

    A trace scored before its final turn's row was recorded (no ``final`` row) counts as unscored. Streams the ``experience`` table by id in batches of ``batch_size`` (committing after each,
    so an interrupted run resumes where it stopped), and writes one ``Score`` row per scorer plus a
    ``total`` row. Scores under other contract versions are untouched. ``rescore=True`` scores every trace
    again. Replaced rows are kept in ``score_history``. Each trace is scored with the harness version it
    was served by (``harness`` is the fallback for traces that name none). ``progress(n)`` is called with
    the number of traces done after each batch.
    """
    from sqlalchemy import exists, func, select

    batches = _Batches(session, contract_version_id, harness, workers or min(4, os.cpu_count() or 1))
    result = ScoreRunResult(contract_version_id=contract_version_id)
    current = exists().where(
        Score.experience_id == Experience.id,
        Score.contract_version_id == contract_version_id,
        Score.scorer == FINAL,
    )
    if not rescore:
        result.already_scored = (
            session.scalar(select(func.count()).select_from(Experience).where(current)) or 0
        )
    columns = [getattr(Experience, c) for c in _COLUMNS]
    reason = (
        "rescored on request" if rescore else "scored again: written before the final turn's row was recorded"
    )
    last_id = 0
    try:
        while True:
            stmt = select(*columns).where(Experience.id > last_id).order_by(Experience.id).limit(batch_size)
            if not rescore:
                stmt = stmt.where(~current)
            rows = session.execute(stmt).all()
            if not rows:
                break
            last_id = rows[-1].id
            batches.score(rows, result, reason)
            if progress is not None:
                progress(len(rows))
    finally:
        batches.pool.shutdown()
    return result


def rescore_experience(
    *,
    session: Session,
    experience_ids: list[int],
    reason: str,
    also_under: int | None = None,
    timeout_s: float = 0.0,
) -> list[ScoreRunResult]:
    """Score these traces again under every contract version that has scored them (e.g. feedback arrived
    after scoring), and under contract version ``also_under`` if given; the replaced rows stay in
    ``score_history`` with ``reason``. With ``timeout_s``, a trace whose scoring under one version takes
    longer is stored as not verified (``_Batches.timed``)."""
    from sqlalchemy import select

    versions = session.scalars(
        select(Score.contract_version_id)
        .where(Score.experience_id.in_(experience_ids), Score.scorer == TOTAL)
        .distinct()
        .order_by(Score.contract_version_id)
    ).all()
    if also_under is not None and also_under not in versions:
        versions = sorted([*versions, also_under])
    rows = session.execute(
        select(*(getattr(Experience, c) for c in _COLUMNS)).where(Experience.id.in_(experience_ids))
    ).all()
    out = []
    for version_id in versions:
        batches = _Batches(session, version_id, None, 1, timeout_s)
        try:
            result = ScoreRunResult(contract_version_id=version_id)
            batches.score(rows, result, reason)
            out.append(result)
        finally:
            batches.pool.shutdown()
    return out


def score_step(
    *, generation_id: int, config: AdvanceConfig, progress: Progress | None = None
) -> dict[str, Any]:
    """Score all experience not yet scored under the candidate's contract version."""

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
    outcome = {
        "scored": result.scored,
        "unverified": result.unverified,
        "errors": result.errors,
        "by_specialist": result.by_specialist,
    }
    with session_scope(engine) as session:
        mark_step(session, load_generation(session, generation_id), "score", outcome)
    return outcome
