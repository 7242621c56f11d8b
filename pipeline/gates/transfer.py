"""The accuracy matrix: every generation's score on every suite (held-out and retention), and backward transfer.

Columns are suites: ``heldout:<specialist>`` (the specialist's held-out suite) and ``retention:<name>``. A
generation's score on a suite is the mean of its greedy per-item scores as measured at its own evaluation
(as the candidate), or else as the parent in a child's evaluation (generation 0 is only ever measured as a
parent; so is a champion measured again on a suite added after its own evaluation). A cell nobody measured
is None.

Backward transfer of a generation on a suite: its score minus the score of the earliest generation of its
line of descent (itself, its parent, the parent's parent, ... back to generation 0) that was measured on the
suite -- how much of what its line could do when the suite was first measured it still can. Negative is
forgetting. The lineage's backward transfer is the champion's. (Continual-learning papers average
``R[T, i] - R[i, i]`` over tasks learned in sequence; here every suite is present from the start of the
line that measures it, so the first measurement is the reference.)
"""

from __future__ import annotations

from statistics import fmean
from typing import Any

from pipeline.registry import Generation, get_engine, list_generations, session_scope
from pipeline.registry.documents import GenerationEvaluation

HELDOUT, RETENTION = "heldout:", "retention:"

DEFINITION = (
    "backward transfer on a suite = the generation's score minus the score of the earliest generation of its "
    "line of descent measured on that suite (negative: forgotten)"
)


def _mean(values: list[float]) -> float | None:
    return round(fmean(values), 4) if values else None


def measured(evaluation: GenerationEvaluation | dict[str, Any], side: str) -> dict[str, float]:
    """The suite scores one evaluation measured for ``side`` (``candidate`` or ``parent``)."""
    evaluation = GenerationEvaluation.model_validate(evaluation)
    out: dict[str, float] = {}
    for s, pair in evaluation.items.items():
        if (value := _mean(pair.candidate if side == "candidate" else pair.parent)) is not None:
            out[HELDOUT + s] = value
    if not evaluation.items:  # an evaluation stored before per-item scores: its means
        scores = evaluation.scores if side == "candidate" else evaluation.parent_scores
        out.update({HELDOUT + s: round(float(v), 4) for s, v in scores.items() if v is not None})
    for name, record in evaluation.retention.items():
        if (value := _mean(record.candidate if side == "candidate" else record.parent)) is not None:
            out[RETENTION + name] = value
    return out


def accuracy_matrix(generations: list[dict[str, Any]]) -> dict[str, Any]:
    """From ``[{"generation": n, "parent": n or None, "evaluation": dict}, ...]`` (number order; instead of
    ``evaluation``, ``measured(evaluation, "candidate")`` and ``(..., "parent")`` as ``candidate`` and
    ``parent_measured``): ``{"suites": [...], "rows": {n: {suite: score or None}}, "backward_transfer":
    {n: {suite: x}}, "first": {n: {suite: the generation it is measured against}}}``."""

    def side(g: dict[str, Any], which: str) -> dict[str, float]:
        if "evaluation" in g:
            return measured(g["evaluation"] or {}, which)
        return g["candidate" if which == "candidate" else "parent_measured"]

    rows: dict[int, dict[str, float]] = {g["generation"]: {} for g in generations}
    parents = {g["generation"]: g["parent"] for g in generations}
    for g in generations:  # own measurements first, then what a child measured of its parent
        rows[g["generation"]].update(side(g, "candidate"))
    for g in generations:
        if g["parent"] in rows:
            for suite, value in side(g, "parent").items():
                rows[g["parent"]].setdefault(suite, value)
    suites = sorted({s for r in rows.values() for s in r}, key=lambda s: (not s.startswith(HELDOUT), s))
    transfer: dict[int, dict[str, float]] = {}
    first: dict[int, dict[str, int]] = {}
    for n, scores in rows.items():
        line, at = [], n
        while at is not None and at in rows and at not in line:
            line.append(at)
            at = parents.get(at)
        transfer[n], first[n] = {}, {}
        for suite, value in scores.items():
            origin = next(a for a in reversed(line) if suite in rows[a])
            first[n][suite] = origin
            transfer[n][suite] = round(value - rows[origin][suite], 4)
    return {
        "suites": suites,
        "rows": {n: {s: rows[n].get(s) for s in suites} for n in rows},
        "backward_transfer": transfer,
        "first": first,
    }


def lineage_matrix(session: Any, lineage: str, gens: list[Any] | None = None) -> dict[str, Any]:
    """``accuracy_matrix`` of a lineage's generations in the registry (``gens``: already loaded), with the
    champion's number and ``DEFINITION``."""

    gens = list_generations(session=session, lineage=lineage) if gens is None else gens
    numbers = {g.id: g.number for g in gens}
    matrix = accuracy_matrix(
        [
            {"generation": g.number, "parent": numbers.get(g.parent_id), "evaluation": g.evaluation or {}}
            for g in gens
        ]
    )  # fmt: skip
    champion = next((g.number for g in gens if g.status == "promoted"), None)
    return {**matrix, "champion": champion, "definition": DEFINITION}


def matrix_view(
    gens: list[dict[str, Any]], nodes: list[dict[str, Any]], champion: int | None
) -> dict[str, Any]:
    """The accuracy matrix as the dashboard shows it, from its generation summaries (``gens``: ``measured``
    and ``parent_measured`` of each) and tree nodes (number, parent, status, champion): suites, one row per
    measured generation (a score or None per suite, backward transfer per suite), and the champion's
    backward transfer per suite with what it is measured against."""
    matrix = accuracy_matrix(
        [
            {"generation": n["number"], "parent": n["parent"], "candidate": g["measured"],
             "parent_measured": g["parent_measured"]}
            for g, n in zip(gens, nodes, strict=True)
        ]
    )  # fmt: skip
    suites = matrix["suites"]
    rows = [
        {
            "generation": n["number"],
            "status": n["status"],
            "champion": n["champion"],
            "scores": [matrix["rows"][n["number"]][s] for s in suites],
            "transfer": [matrix["backward_transfer"][n["number"]].get(s) for s in suites],
        }
        for n in nodes
        if any(matrix["rows"][n["number"]][s] is not None for s in suites)
    ]
    return {
        "suites": suites,
        "retention": [s for s in suites if s.startswith(RETENTION)],
        "rows": rows,
        "champion": champion,
        "transfer": [  # the champion's backward transfer per suite, and what it is measured against
            {
                "suite": suite,
                "first": matrix["first"][champion][suite],
                "first_score": matrix["rows"][matrix["first"][champion][suite]][suite],
                "champion_score": matrix["rows"][champion][suite],
                "transfer": value,
            }
            for suite, value in sorted(matrix["backward_transfer"].get(champion, {}).items())
        ]
        if champion is not None
        else [],
        "definition": DEFINITION,
    }


def generation_metrics(
    matrix: dict[str, Any], number: int, evaluation: GenerationEvaluation | dict[str, Any]
) -> dict[str, float]:
    """One generation's metrics as MLflow keys: ``accuracy/<suite>``, ``backward_transfer/<suite>`` and
    ``kl_to_base/<specialist>``, ``kl_to_parent/<specialist>`` (suite names' ``:`` as ``.``: MLflow keys)."""
    out: dict[str, float] = {}
    for suite, value in (matrix["rows"].get(number) or {}).items():
        if value is not None:
            out[f"accuracy/{suite.replace(':', '.')}"] = value
    for suite, value in (matrix["backward_transfer"].get(number) or {}).items():
        out[f"backward_transfer/{suite.replace(':', '.')}"] = value
    for s, d in GenerationEvaluation.model_validate(evaluation).divergence.items():
        if d.kl_to_base is not None:  # null: not a finite number when measured (JSON has no NaN)
            out[f"kl_to_base/{s}"] = float(d.kl_to_base)
        if d.kl_to_parent is not None:
            out[f"kl_to_parent/{s}"] = float(d.kl_to_parent)
    return out


def track_generation(tracker: Any, *, lineage: str, generation_id: int) -> list[int]:
    """Log the accuracy matrix's row, backward transfer and KL of a decided generation and of its parent
    (whose row its evaluation may have filled) as MLflow metrics of each generation's own run
    (``MLflowTracker.log_generation_metrics``); returns the generations logged. A tracker without
    generation runs logs nothing."""

    if tracker is None or not hasattr(tracker, "log_generation_metrics"):
        return []
    with session_scope(get_engine()) as session:
        gen = session.get(Generation, generation_id)
        parent = session.get(Generation, gen.parent_id) if gen.parent_id is not None else None
        matrix = lineage_matrix(session, lineage)
        todo = [(g.number, g.evaluation or {}) for g in (parent, gen) if g is not None]
    logged = []
    for number, evaluation in todo:
        metrics = generation_metrics(matrix, number, evaluation)
        if metrics:
            tracker.log_generation_metrics(lineage, number, metrics)
            logged.append(number)
    return logged
