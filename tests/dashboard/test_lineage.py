"""Small pieces of the lineage views: reasons of a decision, links into the MLflow UI."""

from __future__ import annotations

from pipeline.dashboard.lineage import mlflow_run_link, split_reasons


def test_split_reasons_keeps_parentheses_whole():
    decision = (
        "reject: overall 0.075 vs champion 0.075: delta +0.000 (96.96% lower bound +0.000; attempt 1 since the "
        "last promotion); the improvement is not significant: the lower bound must be above 0"
    )
    assert split_reasons(decision) == [
        "overall 0.075 vs champion 0.075: delta +0.000 (96.96% lower bound +0.000; attempt 1 since the last promotion)",
        "the improvement is not significant: the lower bound must be above 0",
    ]
    assert split_reasons(None) == [] and split_reasons("generation 0: the base") == ["generation 0: the base"]


def test_mlflow_links_only_for_a_server():
    assert mlflow_run_link("sqlite:///x/mlflow.db", "1", "abc") is None
    assert mlflow_run_link(None, "1", "abc") is None
    assert (
        mlflow_run_link("http://127.0.0.1:5000/", "7", "abc")
        == "http://127.0.0.1:5000/#/experiments/7/runs/abc"
    )
    assert mlflow_run_link("https://mlflow.example", None, "abc") == "https://mlflow.example/#/runs/abc"
    assert mlflow_run_link("http://127.0.0.1:5000", "7", None) is None


def test_held_out_answers_are_read_only_by_evaluation_and_the_dashboard():
    """``evaluation_items`` holds held-out items and both pairs' answers: no step that collects, curates,
    trains, co-designs, routes or serves may read it (a held-out item must never reach what the model learns
    from or is prompted with)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "pipeline"
    readers = {
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if "EvaluationItem" in p.read_text() or "evaluation_items" in p.read_text()
    }
    assert readers == {
        "registry/models.py",
        "registry/__init__.py",
        "loop/evaluation.py",
        "dashboard/comparison.py",
    }
