"""A generation's stored JSON documents (``pipeline.registry.documents``): one model per shape, an unknown key
refused, a stored document read and written back unchanged, one written by an older release still read."""

from __future__ import annotations

import copy

import pytest
from pydantic import ValidationError

from pipeline.registry.documents import (
    CurateOutcome,
    GenerationEvaluation,
    GenerationState,
    Steps,
)

ROUTER = {
    "accuracy": 0.875, "total": 8, "correct": 7, "per_label": {"chat": 1.0, "coding": 0.75},
    "confusion": {"chat": {"chat": 4}, "coding": {"coding": 3, "chat": 1}}, "by_method": {"signals": 8},
    "mode": "signals", "harness": "demo", "harness_version": "1",
}  # fmt: skip

# What `evaluate_step` and `decide_step` store today, every key present.
EVALUATION = {
    "scores": {"chat": 0.55, "coding": 0.4},
    "overall": 0.475,
    "parent_scores": {"chat": 0.5, "coding": 0.4},
    "parent_overall": 0.45,
    "comparison": {
        "specialists": {
            "chat": {"specialist": "chat", "n": 2, "champion": 0.5, "candidate": 0.55, "delta": 0.05,
                     "se": 0.05, "diffs": [0.0, 0.1], "groups": None},
            "coding": {"specialist": "coding", "n": 2, "champion": 0.4, "candidate": 0.4, "delta": 0.0,
                       "se": 0.0, "diffs": [0.0, 0.0], "groups": ["g1", "g1"]},
        },
        "champion_overall": 0.45, "candidate_overall": 0.475, "delta": 0.025, "se": 0.025, "df": None,
    },
    "suites": {"chat": "a" * 64, "coding": "b" * 64},
    "attempts": {"improvement": 2, "improvement_sample": None, "noninferiority": {"chat": 2, "coding": 1},
                 "retention": {"sums": 1}},
    "attempt": 2,
    "items": {"chat": {"parent": [0.5, 0.5], "candidate": [0.5, 0.6]},
              "coding": {"parent": [0.4, 0.4], "candidate": [0.4, 0.4], "groups": ["g1", "g1"]}},
    "unscored": {"chat": 1},
    "unscored_errors": {"chat": "judge unreachable"},
    "discovery": {"chat": {"variants": 3, "champion": 0.2, "candidate": 0.6}},
    "router": ROUTER,
    "parent_router": {**ROUTER, "accuracy": 0.75, "correct": 6},
    "retention": {"sums": {"specialist": "chat", "scored_as": "chat", "parent": [1.0, 0.0],
                           "candidate": [1.0, 1.0], "max_regression": 0.05, "error_rate": 0.05,
                           "sha256": "c" * 64}},
    "divergence": {"chat": {"kl_to_base": 0.0123, "kl_to_parent": 0.004, "tokens": 120, "items": 2,
                            "seconds": 0.5}},
    "verdict": {"promote": False, "rate": 0.0076, "lower": -0.02, "p": 0.3,
                "tests": [{"test": "improvement", "p": 0.3, "passed": False}], "reasons": ["not significant"]},
}  # fmt: skip

# What `ratchet advance` stored before the spending ledger and the item-level differences (the writer of
# commit 676c7fe^): `attempt` only, no `attempts`, `suites`, `retention` or `divergence`; comparisons
# without `diffs`; a verdict without `p` and `tests`.
LEGACY_EVALUATION = {
    "scores": {"chat": 0.55},
    "overall": 0.55,
    "parent_scores": {"chat": 0.5},
    "parent_overall": 0.5,
    "comparison": {
        "specialists": {"chat": {"specialist": "chat", "n": 2, "champion": 0.5, "candidate": 0.55,
                                 "delta": 0.05, "se": 0.05}},
        "champion_overall": 0.5, "candidate_overall": 0.55, "delta": 0.05, "se": 0.05, "df": 1.0,
    },
    "attempt": 3,
    "items": {"chat": {"parent": [0.5, 0.5], "candidate": [0.5, 0.6]}},
    "unscored": {},
    "unscored_errors": {},
    "discovery": {},
    "router": None,
    "parent_router": None,
    "verdict": {"promote": False, "rate": 0.0034, "lower": -0.1, "reasons": ["not significant"]},
}  # fmt: skip

# What the steps stored at commit 7858632 (before training methods, principals and discovery): no `method`
# on a dataset or an adapter, no `dropped_by_principal`, no `discovered_variants`, no `seconds` or `crashes`.
LEGACY_STATE = {
    "steps": {
        "collect": {"attempts": 6, "stored": 6, "prompts": 2, "specialists": ["chat"], "without_tasks": [],
                    "held_out_left_out": {"chat": 0}},
        "score": {"scored": 6, "unverified": 0, "errors": 0, "by_specialist": {"chat": 6}},
        "curate": {"datasets": {"chat": {"rows": 20, "sha256": "e" * 64, "path": "/a/chat"},
                                "coding": {"rows": 3, "skipped": "fewer than 16"}},
                   "dropped": {"chat": {"held-out": 2}}},
        "train": {"adapters": {"chat": {"adapter_id": 7, "steps": 4, "loss": 1.25, "resumed_from_step": None}}},
        "codesign": {"chosen": "1", "variants": {"1": 0.5}, "operators": {}},
        "evaluate": {"overall": 0.5, "parent_overall": 0.45, "attempt": 1},
    },
    "config": {"lineage": "main", "seed": 0},
    "trained": {"chat": {"adapter_id": 7, "steps": 4, "loss": 1.25, "resumed_from_step": None}},
}  # fmt: skip

STATE = {
    "steps": {
        "discover": {"samples": 8, "specialists": {"chat": {"tried": 4, "found": 1, "held_out_left_out": 0,
                                                            "path": "/a/chat.jsonl", "sha256": "d" * 64}}},
        "collect": {"attempts": 6, "stored": 6, "prompts": 2, "specialists": ["chat"], "without_tasks": [],
                    "held_out_left_out": {"chat": 0}, "discovered_variants": {"chat": 1}},
        "score": {"scored": 6, "unverified": 0, "errors": 0, "by_specialist": {"chat": 6}},
        "curate": {"datasets": {"chat": {"method": "sft", "rows": 20, "sha256": "e" * 64, "path": "/a/chat"},
                                "coding": {"method": "sft", "rows": 3, "skipped": "fewer than 16"}},
                   "dropped": {"chat": {"held-out": 2}}, "dropped_by_principal": {"loop": {"held-out": 2}}},
        "train": {"adapters": {"chat": {"adapter_id": 7, "method": "sft", "steps": 4, "loss": 1.25,
                                        "resumed_from_step": None, "dropped": {}}}},
        "codesign": {"chosen": "1", "variants": {"1": 0.5}, "operators": {}, "skipped": {"malformed": 1}},
        "evaluate": {"overall": 0.475, "parent_overall": 0.45, "attempt": 2},
        "decide": {"status": "rejected"},
    },
    "config": {"lineage": "main", "seed": 0},
    "seconds": {"discover": 4.2, "collect": 10.0},
    "trained": {"chat": {"adapter_id": 7, "method": "grpo", "steps": 4, "reward": 0.5,
                         "resumed_from_step": 2, "dropped": {"too long": 1}}},
    "router_classifier": {"kind": "token_nb", "labels": ["chat"]},
    "crashes": [{"owner": "host:1", "step": "collect", "why": "process gone", "at": "2026-12-04 10:00:00"}],
}  # fmt: skip


@pytest.mark.parametrize(
    ("model", "document"), [(GenerationEvaluation, EVALUATION), (GenerationState, STATE)]
)
def test_a_stored_document_reads_and_writes_back_unchanged(model, document):
    read = model.read(copy.deepcopy(document))
    assert read.as_stored() == document
    assert model.read(read.as_stored()) == read


@pytest.mark.parametrize(
    ("model", "document", "path"),
    [
        (GenerationEvaluation, EVALUATION, ()),
        (GenerationEvaluation, EVALUATION, ("comparison", "specialists", "chat")),
        (GenerationEvaluation, EVALUATION, ("router",)),
        (GenerationEvaluation, EVALUATION, ("verdict",)),
        (GenerationState, STATE, ()),
        (GenerationState, STATE, ("steps",)),
        (GenerationState, STATE, ("steps", "curate", "datasets", "chat")),
        (GenerationState, STATE, ("trained", "chat")),
    ],
)
def test_an_unknown_key_in_a_new_document_is_refused(model, document, path):
    bad = copy.deepcopy(document)
    at = bad
    for key in path:
        at = at[key]
    at["router_acuracy"] = 0.9  # a misspelt key: refused wherever it is, never silently dropped
    with pytest.raises(ValidationError, match="router_acuracy"):
        model.read(bad)


def test_an_evaluation_stored_by_an_older_release_still_reads():
    old = GenerationEvaluation.read(copy.deepcopy(LEGACY_EVALUATION))
    assert old.improvement_attempt() == 3 and old.attempts is None  # every test then uses `attempt`
    assert (
        old.comparison.specialists["chat"].diffs == [] and old.verdict.tests == [] and old.verdict.p is None
    )
    assert old.retention == {} and old.divergence == {} and old.router is None
    assert old.as_stored() == LEGACY_EVALUATION  # written back as it was: no key added, none lost
    assert GenerationEvaluation.read(None).as_stored() == {}  # generation 0 before any evaluation


def test_a_state_stored_by_an_older_release_still_reads():
    old = GenerationState.read(copy.deepcopy(LEGACY_STATE))
    assert old.steps.curate.dropped_by_principal is None and old.steps.curate.datasets["chat"].method is None
    assert old.trained["chat"].method == "sft" and old.steps.discover is None and old.seconds == {}
    assert old.steps.collect.discovered_variants == {} and old.crashes == []
    assert old.as_stored() == LEGACY_STATE


def test_an_empty_state_and_a_curation_report_before_principals_read():
    assert GenerationState.read({}).steps == Steps()
    report = CurateOutcome.read({"datasets": {}, "dropped": {"chat": {"duplicate": 1}}})
    assert report.dropped_by_principal is None and report.as_stored() == {
        "datasets": {},
        "dropped": {"chat": {"duplicate": 1}},
    }
