"""``ratchet lineage --json`` and the dashboard's ``/api/lineage`` describe a lineage with one model
(``pipeline.registry.summaries.LineageSummary``): the same keys and the same values for the same registry."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_cli
from fastapi.testclient import TestClient

from pipeline.dashboard import create_app
from pipeline.registry import (
    create_generation,
    get_champion,
    get_engine,
    session_scope,
    set_generation_status,
)
from pipeline.registry.summaries import LineageSummary
from pipeline.settings import Settings

ROOT = Path(__file__).resolve().parent.parent

ROUTER = {"accuracy": 0.75, "total": 4, "correct": 3, "per_label": {"chat": 1.0, "coding": 0.5},
          "confusion": {"chat": {"chat": 2}, "coding": {"coding": 1, "chat": 1}}, "by_method": {"signals": 4},
          "mode": "signals", "harness": "demo", "harness_version": "1"}  # fmt: skip
EVALUATION = {
    "scores": {"chat": 0.6, "coding": 0.4},
    "overall": 0.5,
    "parent_scores": {"chat": 0.5, "coding": 0.4},
    "parent_overall": 0.45,
    "comparison": {
        "specialists": {
            "chat": {"specialist": "chat", "n": 2, "champion": 0.5, "candidate": 0.6, "delta": 0.1,
                     "se": 0.1, "diffs": [0.0, 0.2], "groups": None},
            "coding": {"specialist": "coding", "n": 2, "champion": 0.4, "candidate": 0.4, "delta": 0.0,
                       "se": 0.0, "diffs": [0.0, 0.0], "groups": None},
        },
        "champion_overall": 0.45, "candidate_overall": 0.5, "delta": 0.05, "se": 0.05, "df": 1.0,
    },
    "suites": {"chat": "a" * 64, "coding": "b" * 64},
    "attempts": {"improvement": 1, "improvement_sample": None, "noninferiority": {"chat": 1, "coding": 1},
                 "retention": {"sums": 1}},
    "attempt": 1,
    "items": {"chat": {"parent": [0.5, 0.5], "candidate": [0.5, 0.7]},
              "coding": {"parent": [0.4, 0.4], "candidate": [0.4, 0.4]}},
    "unscored": {"coding": 1},
    "unscored_errors": {"coding": "judge unreachable"},
    "discovery": {"chat": {"variants": 1, "champion": 0.0, "candidate": 1.0}},
    "router": ROUTER,
    "parent_router": {**ROUTER, "accuracy": 0.5, "correct": 2},
    "retention": {"sums": {"specialist": "chat", "scored_as": "chat", "parent": [1.0, 0.0],
                           "candidate": [1.0, 1.0], "max_regression": 0.05, "error_rate": 0.05,
                           "sha256": "c" * 64}},
    "divergence": {"chat": {"kl_to_base": 0.0123, "kl_to_parent": 0.004, "tokens": 120, "items": 2,
                            "seconds": 0.5}},
    "verdict": {"promote": False, "rate": 0.0076, "lower": -0.02, "p": 0.3,
                "tests": [{"test": "improvement", "p": 0.3, "passed": False}], "reasons": ["not significant"]},
}  # fmt: skip
STATE = {
    "steps": {
        "discover": {"samples": 8, "specialists": {"chat": {"tried": 4, "found": 1, "held_out_left_out": 0}}},
        "curate": {"datasets": {"chat": {"method": "sft", "rows": 20, "sha256": "e" * 64, "path": "/a/chat"}},
                   "dropped": {"chat": {"held-out": 2}}, "dropped_by_principal": {"loop": {"held-out": 2}}},
        "evaluate": {"overall": 0.5, "parent_overall": 0.45, "attempt": 1},
        "decide": {"status": "rejected"},
    },
    "seconds": {"discover": 4.2, "evaluate": 3.0},
}  # fmt: skip


def _registry(specs: dict[str, Path]) -> None:
    """Generation 0 and a decided generation 1 whose documents hold every key the summaries read."""
    from pipeline.loop.founding import init_lineage

    init_lineage(contract_path=specs["contract"], harness_path=ROOT / "harnesses" / "demo.yaml",
                 model_path=specs["model"])  # fmt: skip
    with session_scope(get_engine()) as s:
        zero = get_champion(session=s)
        one = create_generation(
            session=s,
            base_model_id=zero.base_model_id,
            harness_version_id=zero.harness_version_id,
            contract_version_id=zero.contract_version_id,
            specialists=[a.specialist for a in zero.adapters],
            parent_id=zero.id,
            state=STATE,
        )
        one.evaluation = EVALUATION
        one.step = "decide"
        set_generation_status(session=s, generation=one, status="rejected", reason="reject: not significant")


def test_lineage_json_and_the_api_are_one_model(specs, ratchet_home, capsys):
    _registry(specs)
    capsys.readouterr()
    assert run_cli(["lineage", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    app = create_app(Settings(home=ratchet_home), allowed_hosts=["testserver"])
    [route] = [r for r in app.routes if getattr(r, "path", None) == "/api/lineage"]
    assert route.response_model is LineageSummary  # the route declares the model (its OpenAPI schema)
    with TestClient(app, base_url="https://testserver") as client:
        served = client.get("/api/lineage").json()
        assert client.get("/").status_code == 200  # the page renders the same document
    cli, api = LineageSummary.model_validate(printed), LineageSummary.model_validate(served)
    assert printed == served and cli == api
    zero, one = api.generations
    assert (zero.number, one.number, one.parent, one.status) == (0, 1, 0, "rejected")
    assert (one.router_accuracy, one.parent_router_accuracy, one.overall, one.attempt) == (0.75, 0.5, 0.5, 1)
    assert one.unscored == {"coding": 1} and one.curation.kept == {"chat": 20}
    assert one.discovery["chat"].found == 1 and one.discovery["chat"].candidate == 1.0
    assert one.accuracy["retention:sums"] == 1.0 and one.backward_transfer["retention:sums"] == 0.5
    assert one.divergence["chat"].kl_to_base == 0.0123 and one.method == "no new adapters"
    assert zero.scores == {} and zero.accuracy["heldout:chat"] == 0.5  # measured as its child's parent
    assert api.matrix.rows[1].scores == [0.6, 0.4, 1.0] and api.matrix.suites[-1] == "retention:sums"
    assert one.seconds == {"discover": 4.2, "evaluate": 3.0} and api.lineages == ["main"]
