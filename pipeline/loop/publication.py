"""What a decided generation publishes for its users: its scores and its decision, where they open its
artifacts -- MLflow (``pipeline.registry.tracking``) and each adapter's model card (``pipeline.training.cards``).

``publish_decision`` runs after the decision is committed (``promotion.decide_step``); it reads the registry
only (the evaluation and state documents of ``pipeline.registry.documents``) and writes:

- metrics, at step = the generation's number: ``heldout/{candidate,champion}/<specialist>`` and ``/overall``
  (the held-out means of the candidate and of the champion it was compared with) and
  ``retention/{candidate,champion}/<suite>`` and ``/overall`` (the mean over suites), on the generation's own
  run (``kind=generation``); each training run gets those of its specialist and the overall ones;
- tags ``decision`` (``promoted`` or ``rejected``: what the decide step did) and ``status`` (the generation's
  status in the registry now) on the generation's run, its training runs and their model versions; each
  version's description says the decision and why (a rejected version says it was rejected). The parent's
  runs and versions get its status again: a promotion retires it;
- each adapter trained in the generation gets its card rewritten with the scores and the decision, and the
  card is uploaded again into its run's ``adapter/`` artifacts (the model version's source).

Nothing here can undo the decision: a failure is the caller's to log.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

from pipeline.registry import Adapter, Generation, get_engine, session_scope
from pipeline.registry.documents import GenerationEvaluation, evaluation_of, state_of
from pipeline.registry.tracking import registered_model_name
from pipeline.training.cards import CARD, CardScores, write_model_card


@dataclass(frozen=True)
class TrainedRun:
    """An adapter a generation trained, as MLflow knows it."""

    specialist: str
    method: str
    adapter_dir: Path
    run_id: str | None
    version: str | None


def _mean(values: list[float]) -> float | None:
    return round(fmean(values), 4) if values else None


def outcome_metrics(evaluation: GenerationEvaluation) -> dict[str, float]:
    """The held-out and retention scores of an evaluation as MLflow metrics (see the module doc)."""
    out: dict[str, float] = {}
    for side, scores, overall in (
        ("candidate", evaluation.scores, evaluation.overall),
        ("champion", evaluation.parent_scores, evaluation.parent_overall),
    ):
        out |= {f"heldout/{side}/{s}": float(v) for s, v in scores.items() if v is not None}
        if overall is not None:
            out[f"heldout/{side}/overall"] = float(overall)
    means: dict[str, list[float]] = {"candidate": [], "champion": []}
    for name, suite in evaluation.retention.items():
        for side, values in (("candidate", suite.candidate), ("champion", suite.parent)):
            if (value := _mean(values)) is not None:
                out[f"retention/{side}/{name}"] = value
                means[side].append(value)
    for side, values in means.items():
        if values:
            out[f"retention/{side}/overall"] = round(fmean(values), 4)
    return out


def specialist_metrics(metrics: dict[str, float], evaluation: GenerationEvaluation, specialist: str) -> dict:
    """Of ``outcome_metrics``, those a specialist's training run gets: its suites' and the overall ones."""
    own = {specialist, "overall"} | {n for n, r in evaluation.retention.items() if r.specialist == specialist}
    return {k: v for k, v in metrics.items() if k.rsplit("/", 1)[1] in own}


def card_scores(evaluation: GenerationEvaluation, specialist: str, decision: str) -> CardScores:
    reasons = tuple(evaluation.verdict.reasons) if evaluation.verdict is not None else ()
    return CardScores(
        decision=decision,
        candidate=evaluation.scores.get(specialist),
        champion=evaluation.parent_scores.get(specialist),
        overall=evaluation.overall,
        champion_overall=evaluation.parent_overall,
        retention={
            name: (_mean(r.parent), _mean(r.candidate))
            for name, r in evaluation.retention.items()
            if r.specialist == specialist
        },
        reasons=reasons,
    )


def _trained(session: Any, gen: Any) -> list[TrainedRun]:
    runs = []
    for specialist, trained in sorted(state_of(gen).trained.items()):
        adapter = session.get(Adapter, trained.adapter_id)
        if adapter is not None:
            runs.append(TrainedRun(specialist, adapter.method, Path(adapter.artifact_uri),
                                   adapter.mlflow_run_id, adapter.mlflow_model_version))  # fmt: skip
    return runs


def describe(*, lineage: str, number: int, specialist: str, decision: str, why: str | None) -> str:
    """A model version's description: which generation it is and what was decided, and why."""
    verdict = {"promoted": "PROMOTED: it became the champion", "rejected": "REJECTED: it was not promoted"}
    said = verdict.get(decision, decision)
    return f"{lineage} generation {number}, {specialist}: {said}." + (f" {why}" if why else "")


def publish_decision(*, lineage: str, generation_id: int, tracker: Any = None) -> dict[str, Any]:
    """Publish a decided generation (see the module doc); returns what was written, by kind."""
    with session_scope(get_engine()) as session:
        gen = session.get(Generation, generation_id)
        state = state_of(gen)
        decision = state.steps.decide.status if state.steps.decide is not None else str(gen.status)
        number, status, why = gen.number, str(gen.status), gen.decision
        evaluation = evaluation_of(gen)
        trained = _trained(session, gen)
        parent = session.get(Generation, gen.parent_id) if gen.parent_id is not None else None
        parent_runs = _trained(session, parent) if parent is not None else []
        parent_number, parent_status = (
            (parent.number, str(parent.status)) if parent is not None else (None, None)
        )
    cards = []
    for run in trained:
        if (run.adapter_dir / "lineage.json").is_file():
            cards.append(
                write_model_card(run.adapter_dir, scores=card_scores(evaluation, run.specialist, decision))
            )
    done: dict[str, Any] = {"cards": [str(c) for c in cards], "runs": [], "versions": []}
    if tracker is None or not hasattr(tracker, "tag_version"):
        return done
    metrics = outcome_metrics(evaluation)
    tags = {"decision": decision, "status": status}
    generation_run = tracker.log_generation_metrics(lineage, number, metrics)
    tracker.tag_run(generation_run, tags)
    done["runs"].append(generation_run)
    for run in trained:
        name = registered_model_name(lineage, run.specialist)
        if run.run_id:
            tracker.log_run_metrics(
                run.run_id, specialist_metrics(metrics, evaluation, run.specialist), number
            )
            tracker.tag_run(run.run_id, tags)
            if (run.adapter_dir / CARD).is_file():
                tracker.log_run_artifact(run.run_id, run.adapter_dir / CARD, "adapter")
            done["runs"].append(run.run_id)
        if run.version:
            text = describe(
                lineage=lineage, number=number, specialist=run.specialist, decision=decision, why=why
            )
            tracker.tag_version(name, run.version, tags, description=text)
            done["versions"].append((name, run.version))
    if parent_number is not None:  # a promotion retired the parent: its runs and versions say so
        again = {"status": parent_status}
        tracker.tag_run(tracker.generation_run(lineage, parent_number), again)
        for run in parent_runs:
            if run.run_id:
                tracker.tag_run(run.run_id, again)
            if run.version:
                tracker.tag_version(registered_model_name(lineage, run.specialist), run.version, again)
    return done
