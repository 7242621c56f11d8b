"""Router accuracy on the contract's labelled routing suite, recorded per generation (``measure_router``).

The suite (``contract.routing``) holds requests written differently from the harness's signal patterns,
each labelled with the specialist that should serve it; its prompts are held out (never router training
data). The router's configuration is part of the harness, so the accuracy belongs to the (generation,
harness version).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from pipeline.serving.router import RouteTurn, TokenClassifier, evaluate_router, turn_from_messages
from pipeline.specs.harness import HarnessSpec

if TYPE_CHECKING:
    from pipeline.specs.contract import ContractSpec


def routing_items(
    traces: Iterable[Mapping[str, Any]], label_key: str = "specialist"
) -> list[tuple[RouteTurn, str]]:
    """``(turn, label)`` pairs from traces: the conversation up to its last user message, labelled with
    ``metadata[label_key]`` (falling back to ``metadata.task``). Traces without a label are skipped."""
    items = []
    for trace in traces:
        meta = trace.get("metadata") or {}
        label = meta.get(label_key) or meta.get("task")
        messages = list(trace.get("messages") or [])
        while messages and messages[-1].get("role") == "assistant":
            messages.pop()
        if label and messages:
            items.append((turn_from_messages(messages), str(label)))
    return items


def suite_items(contract: ContractSpec) -> list[tuple[RouteTurn, str]]:
    """``(turn, label)`` pairs of the contract's routing suite (empty without one)."""
    if contract.routing is None:
        return []
    return [
        (turn_from_messages([{"role": "user", "content": prompt}]), specialist)
        for specialist, prompts in contract.routing.prompts.items()
        for prompt in prompts
    ]


def fit_router_classifier(
    items: Iterable[tuple[RouteTurn, str]], labels: list[str], alpha: float = 0.5
) -> TokenClassifier:
    """Train the learned router from labelled turns (e.g. ``routing_items`` over traces labelled with the
    specialist the contract scored best). Store ``to_dict()`` in the generation's ``state`` under
    ``router_classifier``; ``ratchet serve`` then uses it in ``learned`` / ``hybrid`` mode."""
    return TokenClassifier.fit(((turn.text, label) for turn, label in items), labels, alpha=alpha)


def measure_router(
    harness: HarnessSpec,
    items: list[tuple[RouteTurn, str]],
    *,
    classifier: TokenClassifier | None = None,
    label_scorer: Callable[[str], dict[str, float]] | None = None,
) -> dict[str, Any]:
    """The router evaluation to store under ``generation.evaluation["router"]``.

    ``label_scorer`` (e.g. the embedded runtime's entry-adapter label decoding) or ``classifier`` supplies
    learned scores in ``learned``/``hybrid`` mode; the classifier wins when both are given, as in serving.
    """
    scorer = classifier.scores if classifier is not None else label_scorer
    result = evaluate_router(items, harness.routing, learned=scorer).to_dict()
    result.update({"mode": harness.routing.mode, "harness": harness.name, "harness_version": harness.version})
    return result


def entry_label_scorer(runtime: Any, harness: HarnessSpec) -> Callable[[str], dict[str, float]]:
    """A ``text -> label probabilities`` scorer from the entry adapter of a loaded ``MixtureRuntime``."""
    labels = harness.routing.learned.labels or list(harness.specialists)

    def score(text: str) -> dict[str, float]:
        return runtime.label_scores([{"role": "user", "content": text}], labels, harness.routing.entry)

    return score
