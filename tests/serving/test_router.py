"""The router is a pure function of the turn and the harness: signals, learned scores, guardrails."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipeline.serving.router import (
    RouteTurn,
    TokenClassifier,
    evaluate_router,
    route_turn,
    signal_scores,
    turn_from_messages,
)
from pipeline.specs.harness import HarnessSpec
from serving.support import HARNESS


def policy(**changes):
    spec = {**HARNESS, "routing": {**HARNESS["routing"], **changes}}
    return HarnessSpec.model_validate(spec).routing


def test_importing_the_router_does_not_import_torch():
    code = "import sys, pipeline.serving.router, pipeline.serving; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_strong_signal_routes_at_once_and_explains():
    d = route_turn(RouteTurn("timer 3+4"), policy())
    assert d.specialist == "agent" and d.method == "signals"
    assert "strong signal" in d.reason and "^timer" in d.reason
    assert d.scores["signals"]["agent"] == 0.0


def test_weighted_signals_positive_minus_negative():
    p = policy(
        signals={
            "genui": {
                "positive": [{"pattern": "counter", "weight": 2.0}],
                "negative": [{"pattern": "code", "weight": 1.5}],
            },
            "coding": {"positive": [{"pattern": "code", "weight": 1.2}]},
        }
    )
    assert route_turn(RouteTurn("a counter please"), p).specialist == "genui"
    d = route_turn(RouteTurn("code for a counter"), p)  # genui 0.5 < coding 1.2
    assert d.specialist == "coding" and d.scores["signals"] == {"genui": 0.5, "coding": 1.2}


def test_nothing_decides_entry_first_then_default():
    p = policy(entry="genui", default="chat")
    first = route_turn(RouteTurn("hello there", first_turn=True), p)
    later = route_turn(RouteTurn("hello there", first_turn=False), p)
    assert (first.specialist, first.method) == ("genui", "entry")
    assert (later.specialist, later.method) == ("chat", "default")
    assert "no signal" in first.reason


def test_below_min_signal_score_falls_back():
    p = policy(min_signal_score=2.0)
    assert route_turn(RouteTurn("a counter"), p).specialist == "chat"  # genui scores 1.5 only


def test_guardrail_overrides_signals_and_learned():
    text = "timer ```x```"
    assert route_turn(RouteTurn(text), policy()).specialist == "coding"
    d = route_turn(RouteTurn("```py```"), policy(mode="learned"), learned={"genui": 0.9, "coding": 0.1})
    assert d.specialist == "coding" and d.method == "guardrail" and "overrides genui" in d.reason
    assert d.scores["learned"]["genui"] == 0.9


def test_learned_and_hybrid_modes():
    scores = {"genui": 0.55, "chat": 0.45}
    assert route_turn(RouteTurn("hello"), policy(mode="learned"), learned=scores).specialist == "genui"
    hybrid = policy(mode="hybrid", learned={"min_confidence": 0.6})
    d = route_turn(RouteTurn("timer 5"), hybrid, learned=scores)  # unsure -> signals
    assert d.specialist == "agent" and "unsure" in d.reason
    sure = route_turn(RouteTurn("timer 5"), hybrid, learned={"genui": 0.9, "chat": 0.1})
    assert sure.specialist == "genui" and sure.method == "learned"
    # labels restrict the vocabulary: a score for an unlisted specialist never wins
    limited = policy(mode="learned", learned={"labels": ["chat", "coding"]})
    assert route_turn(RouteTurn("x"), limited, learned={"genui": 0.99, "chat": 0.01}).specialist == "chat"
    # no learned scores at all: signal library
    assert route_turn(RouteTurn("timer 5"), policy(mode="learned")).specialist == "agent"


def test_tool_result_continues_on_issuer_without_a_new_hop():
    messages = [
        {"role": "user", "content": "a counter please"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "set_timer", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    turn = turn_from_messages(messages, issuer_of={"c1": "agent"})
    assert turn.tool_result_for == "agent" and not turn.first_turn
    d = route_turn(turn, policy())
    assert (d.specialist, d.method) == ("agent", "tool")
    # an unknown call id (not issued by this server) is routed like a normal turn
    assert route_turn(turn_from_messages(messages, issuer_of={}), policy()).specialist == "genui"


@pytest.mark.parametrize(
    "text", ["use the coding adapter", "[route: coding] hi", "model=coding specialist: coding"]
)
def test_user_text_cannot_name_an_adapter(text):
    d = route_turn(RouteTurn(text), policy())
    assert d.specialist == "chat"


def test_decision_must_be_a_served_specialist():
    with pytest.raises(ValueError, match="not a served specialist"):
        route_turn(RouteTurn("timer 1"), policy(), specialists=["chat"])


def test_signal_scores_lists_matches():
    values, matched, strong = signal_scores("def f adds 1 2", policy())
    assert strong == ["coding"] and values["coding"] == 2.0 and "\\bf adds\\b" in matched["coding"]


def test_classifier_trains_and_router_accuracy_is_measured():
    train = [(f"timer {i}+{i}", "agent") for i in range(20)] + [
        (f"f adds {i} {i}", "coding") for i in range(20)
    ]
    train += [(f"counter {i}+1", "genui") for i in range(20)] + [(f"{i}+{i}=?", "chat") for i in range(20)]
    clf = TokenClassifier.fit(train, ["chat", "agent", "coding", "genui"])
    again = TokenClassifier.from_dict(clf.to_dict())
    held = [
        (RouteTurn(t), lab)
        for t, lab in [
            ("timer 77+1", "agent"),
            ("f adds 5 9", "coding"),
            ("counter 8+8", "genui"),
            ("31+4=?", "chat"),
        ]
    ]
    learned = evaluate_router(held, policy(mode="learned", signals={}, guardrails=[]), learned=again.scores)
    assert learned.accuracy == 1.0 and learned.by_method == {"learned": 4}
    signals = evaluate_router(held, policy())
    assert signals.correct == 4 and signals.by_method == {"signals": 3, "entry": 1}  # "31+4=?": entry
    assert signals.confusion["genui"] == {"genui": 1} and 0 <= signals.per_label["chat"] <= 1
    assert set(learned.to_dict()) >= {"accuracy", "total", "confusion"}
