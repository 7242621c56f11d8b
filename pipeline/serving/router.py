"""The router: which specialist answers a turn. A pure function of the turn and the harness (no torch).

``route_turn(turn, policy, learned=...)`` returns a ``RouteDecision`` (specialist, reason, scores):

1. A tool result continues on the specialist that issued the tool call (no new route hop).
2. ``signals`` mode: the harness's signal library. A ``strong`` pattern routes at once; otherwise each
   specialist scores the summed weight of its matching ``positive`` patterns minus its ``negative`` ones,
   and the best score routes when it reaches ``min_signal_score``.
3. ``learned`` mode: the label probabilities of a learned router (computed by the caller: the entry
   adapter decoding a label under a constrained vocabulary, or a ``TokenClassifier`` trained from
   experience) pick the specialist. ``hybrid``: the learned choice when its probability reaches
   ``learned.min_confidence``, the signal library otherwise.
4. When nothing decides: ``routing.entry`` on the first user turn, ``routing.default`` later.
5. Guardrails override whatever 2-4 chose (e.g. a code fence always goes to ``coding``).

The text of a user message is untrusted: nothing in it can name an adapter directly (there is no
directive syntax); it only contributes evidence to signals and learned scores, and the decision is
always one of the policy's specialists.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.experience.texts import message_text
from pipeline.specs.harness import HarnessSpec, RoutingPolicy

__all__ = [
    "RouteDecision",
    "RouteTurn",
    "RouterEvaluation",
    "TokenClassifier",
    "evaluate_router",
    "route_turn",
    "signal_scores",
    "turn_from_messages",
]


@dataclass(frozen=True)
class RouteTurn:
    """What the router sees of a request: the newest user text and where the conversation stands."""

    text: str
    first_turn: bool = True
    tool_result_for: str | None = None  # specialist that issued the call a trailing tool result answers
    tools_offered: bool = False


@dataclass(frozen=True)
class RouteDecision:
    """The chosen specialist, why, and the scores behind it (stored with the turn)."""

    specialist: str
    reason: str
    method: str  # tool | signals | learned | guardrail | entry | default
    scores: dict[str, dict[str, float]] = field(default_factory=dict)

    def as_route(self, turn_index: int) -> dict[str, Any]:
        """The trace's ``routes`` entry for the assistant message at ``turn_index``."""
        return {
            "turn": turn_index,
            "specialist": self.specialist,
            "reason": self.reason,
            "scores": self.scores,
        }


def turn_from_messages(
    messages: Sequence[Mapping[str, Any]],
    *,
    issuer_of: Mapping[str, str] | None = None,
    tools_offered: bool = False,
) -> RouteTurn:
    """Build the ``RouteTurn`` of a chat request. ``issuer_of`` maps tool-call ids to the specialist that
    issued them (server-side memory); a trailing tool result whose call is known continues there."""
    issuer_of = issuer_of or {}
    text = next((message_text(m) for m in reversed(messages) if m.get("role") == "user"), "")
    first = not any(m.get("role") == "assistant" for m in messages)
    continues = None
    if messages and messages[-1].get("role") == "tool":
        for m in reversed(messages):
            if m.get("role") == "tool" and m.get("tool_call_id") in issuer_of:
                continues = issuer_of[m["tool_call_id"]]
                break
            if m.get("role") != "tool":
                break
    return RouteTurn(text=text, first_turn=first, tool_result_for=continues, tools_offered=tools_offered)


def _search(pattern: str, text: str) -> bool:
    return re.search(pattern, text, flags=re.IGNORECASE) is not None


def signal_scores(
    text: str, policy: RoutingPolicy
) -> tuple[dict[str, float], dict[str, list[str]], list[str]]:
    """Per-specialist net signal weight, the patterns that matched (``-`` marks a negative one), and the
    specialists with a matching strong pattern (in declaration order)."""
    scores: dict[str, float] = {}
    matched: dict[str, list[str]] = {}
    strong: list[str] = []
    for name, sigs in policy.signals.items():
        hits = [p for p in sigs.strong if _search(p, text)]
        if hits:
            strong.append(name)
        score = 0.0
        found = [f"strong:{p}" for p in hits]
        for s in sigs.positive:
            if _search(s.pattern, text):
                score += s.weight
                found.append(s.pattern)
        for s in sigs.negative:
            if _search(s.pattern, text):
                score -= s.weight
                found.append(f"-{s.pattern}")
        scores[name] = round(score, 6)
        matched[name] = found
    return scores, matched, strong


def _fallback(turn: RouteTurn, policy: RoutingPolicy, why: str, scores: dict) -> RouteDecision:
    if turn.first_turn:
        return RouteDecision(policy.entry, f"{why}: entry specialist on the first turn", "entry", scores)
    return RouteDecision(policy.default, f"{why}: default specialist", "default", scores)


def _by_signals(turn: RouteTurn, policy: RoutingPolicy, scores: dict) -> RouteDecision:
    values, matched, strong = signal_scores(turn.text, policy)
    scores["signals"] = values
    if strong:
        best = max(strong, key=lambda s: (values[s], -strong.index(s)))
        pats = ", ".join(p.removeprefix("strong:") for p in matched[best] if p.startswith("strong:"))
        return RouteDecision(best, f"strong signal for {best}: {pats}", "signals", scores)
    if values:
        order = list(values)
        best = max(order, key=lambda s: (values[s], -order.index(s)))
        if values[best] >= policy.min_signal_score:
            hits = ", ".join(matched[best])
            return RouteDecision(best, f"signals: {best} scored {values[best]:g} ({hits})", "signals", scores)
    return _fallback(turn, policy, f"no signal reached {policy.min_signal_score:g}", scores)


def route_turn(
    turn: RouteTurn,
    policy: RoutingPolicy,
    *,
    learned: Mapping[str, float] | None = None,
    specialists: Iterable[str] | None = None,
) -> RouteDecision:
    """Pick the specialist for ``turn`` under ``policy`` (see the module docstring for the order).

    ``learned`` holds the learned router's label probabilities (required for a decision in ``learned``
    mode; without them ``learned`` and ``hybrid`` fall back to the signal library). ``specialists``, when
    given, is the set the decision must fall in (a route elsewhere is a harness bug and raises).
    """
    if turn.tool_result_for is not None:
        return RouteDecision(
            turn.tool_result_for, f"tool result continues on {turn.tool_result_for}", "tool", {}
        )
    scores: dict[str, dict[str, float]] = {}
    decision: RouteDecision | None = None
    if policy.mode in ("learned", "hybrid") and learned:
        labels = set(policy.learned.labels) if policy.learned.labels else None
        probs = {k: float(v) for k, v in learned.items() if labels is None or k in labels}
        scores["learned"] = {k: round(v, 6) for k, v in probs.items()}
        if probs:
            best = max(probs, key=lambda k: probs[k])
            confident = probs[best] >= policy.learned.min_confidence
            if policy.mode == "learned" or confident:
                decision = RouteDecision(
                    best, f"learned router: {best} p={probs[best]:.2f}", "learned", scores
                )
            else:
                decision = _by_signals(turn, policy, scores)
                decision = RouteDecision(
                    decision.specialist,
                    f"learned router unsure ({best} p={probs[best]:.2f} < {policy.learned.min_confidence:g}); "
                    + decision.reason,
                    decision.method,
                    scores,
                )
    if decision is None:
        decision = _by_signals(turn, policy, scores)
        if policy.mode != "signals":
            decision = RouteDecision(
                decision.specialist, "no learned scores; " + decision.reason, decision.method, scores
            )
    for rule in policy.guardrails:
        if _search(rule.pattern, turn.text):
            if rule.route != decision.specialist:
                why = rule.description or f"pattern {rule.pattern}"
                decision = RouteDecision(
                    rule.route, f"guardrail ({why}) overrides {decision.specialist}", "guardrail", scores
                )
            break
    if specialists is not None and decision.specialist not in set(specialists):
        raise ValueError(f"routing policy chose {decision.specialist!r}, not a served specialist")
    return decision


def policy_of(harness: HarnessSpec) -> RoutingPolicy:
    """The routing policy of a harness (versioned with it)."""
    return harness.routing


# ----------------------------------------------------------------------------------- learned classifier
_WORD = re.compile(r"[a-z_]+|\d+|[^\sa-z\d]")


def _features(text: str) -> list[str]:
    low = text.lower()
    words = _WORD.findall(low)
    shape = re.sub(r"\d+", "0", low)
    grams = [shape[i : i + 3] for i in range(max(0, len(shape) - 2))]
    return [f"w:{w}" for w in words] + [f"c:{g}" for g in grams]


@dataclass
class TokenClassifier:
    """A multinomial naive-Bayes router over words and character 3-grams, trained from experience
    (``(user text, specialist that served best)`` pairs). Serialises to plain JSON (``to_dict``)."""

    labels: list[str]
    priors: dict[str, float] = field(default_factory=dict)
    counts: dict[str, dict[str, float]] = field(default_factory=dict)
    totals: dict[str, float] = field(default_factory=dict)
    vocab_size: int = 1
    alpha: float = 0.5

    @classmethod
    def fit(
        cls, examples: Iterable[tuple[str, str]], labels: Sequence[str], alpha: float = 0.5
    ) -> TokenClassifier:
        per_label: dict[str, Counter] = {lab: Counter() for lab in labels}
        docs: Counter = Counter()
        for text, label in examples:
            if label not in per_label:
                raise ValueError(f"example label {label!r} is not one of {list(labels)}")
            per_label[label].update(_features(text))
            docs[label] += 1
        n = sum(docs.values()) or 1
        vocab = set().union(*per_label.values()) if per_label else set()
        return cls(
            labels=list(labels),
            priors={lab: (docs[lab] + 1) / (n + len(labels)) for lab in labels},
            counts={lab: dict(c) for lab, c in per_label.items()},
            totals={lab: float(sum(c.values())) for lab, c in per_label.items()},
            vocab_size=max(1, len(vocab)),
            alpha=alpha,
        )

    def scores(self, text: str) -> dict[str, float]:
        """Label probabilities for ``text`` (sum to 1)."""
        feats = _features(text)
        logp = {}
        for lab in self.labels:
            counts, denom = self.counts.get(lab, {}), self.totals.get(lab, 0.0) + self.alpha * self.vocab_size
            logp[lab] = math.log(self.priors.get(lab, 1e-9)) + sum(
                math.log((counts.get(f, 0.0) + self.alpha) / denom) for f in feats
            )
        top = max(logp.values())
        exp = {k: math.exp(v - top) for k, v in logp.items()}
        total = sum(exp.values())
        return {k: v / total for k, v in exp.items()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "token_nb",
            "labels": self.labels,
            "priors": self.priors,
            "counts": self.counts,
            "totals": self.totals,
            "vocab_size": self.vocab_size,
            "alpha": self.alpha,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TokenClassifier:
        return cls(**{k: v for k, v in data.items() if k != "kind"})


# --------------------------------------------------------------------------------------------- accuracy
@dataclass(frozen=True)
class RouterEvaluation:
    """Router accuracy on a labelled held-out set (recorded per generation)."""

    accuracy: float
    total: int
    correct: int
    per_label: dict[str, float]
    confusion: dict[str, dict[str, int]]
    by_method: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return {
            "accuracy": self.accuracy,
            "total": self.total,
            "correct": self.correct,
            "per_label": self.per_label,
            "confusion": self.confusion,
            "by_method": self.by_method,
        }


def evaluate_router(
    items: Iterable[tuple[RouteTurn, str]],
    policy: RoutingPolicy,
    *,
    learned: Any = None,
) -> RouterEvaluation:
    """Accuracy of ``policy`` on labelled turns. ``learned``: a callable ``text -> label probabilities``
    (a ``TokenClassifier().scores`` or the runtime's entry-adapter scorer), used in learned/hybrid mode."""
    confusion: dict[str, Counter] = {}
    methods: Counter = Counter()
    total = correct = 0
    for turn, label in items:
        scores = learned(turn.text) if learned is not None and policy.mode != "signals" else None
        decision = route_turn(turn, policy, learned=scores)
        confusion.setdefault(label, Counter())[decision.specialist] += 1
        methods[decision.method] += 1
        total += 1
        correct += decision.specialist == label
    per_label = {lab: row[lab] / sum(row.values()) for lab, row in sorted(confusion.items())}
    return RouterEvaluation(
        accuracy=correct / total if total else 0.0,
        total=total,
        correct=correct,
        per_label=per_label,
        confusion={k: dict(v) for k, v in sorted(confusion.items())},
        by_method=dict(methods),
    )
