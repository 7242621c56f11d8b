"""Held-out items: the contract's suites, and the one predicate that keeps them out of everything learned.

``resolve_suites(contract)`` gives the items of every held-out suite. ``heldout_index(contract)`` is the
exclusion predicate every consumer of experience goes through (curation, co-design exemplars, router
training data: ``pipeline.eligibility.load_candidates`` applies it before anything else sees a trace):
``HeldoutIndex.exclusion(messages, metadata, source)`` says why a trace may not be learned from, or None.
A trace is excluded when its metadata marks it held-out, when it came from an evaluation run, or when any
of its messages contains a held-out prompt (every user turn of every suite item, and every prompt of the
contract's routing suite): texts are compared as words and punctuation after Unicode NFKC normalisation
and case folding (so whitespace, content-part layout, full-width digits and letter case change nothing),
and near-duplicates are found by word n-gram overlap (``contract.decontamination``), the decontamination
check LLM evaluations use. What it cannot catch: a held-out item paraphrased into different words, or
the same problem posed another way (the demo's split keeps ``a+b`` and ``b+a`` together for that reason).
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.contract import ContractSpec

MIN_CONTAINED = 3  # a held-out prompt of fewer words only matches a message that is exactly it
_WORD = re.compile(r"\w+|[^\w\s]")


def resolve_suites(
    contract: ContractSpec, *, contract_path: Path | None = None
) -> dict[str, list[dict[str, Any]]]:
    """Items of every held-out suite of the contract, per specialist. File suites come from the given
    contract file's directory (sha256-checked), or without one from the registry, which stored them at
    registration; generated suites from their task generator's ``heldout`` split."""
    from pipeline.contract import file_reader
    from pipeline.tasksource import draw, generator_source

    suites: dict[str, list[dict[str, Any]]] = {}
    read = file_reader(contract, contract_path)
    for suite in contract.heldout:
        if suite.generator is not None:
            source = generator_source(suite.generator, specialist=suite.specialist, options=suite.options)
            items, _ = draw(source, "heldout", suite.size, suite.seed)
        else:
            text = read(suite.sha256)
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
        for item in items:  # whatever the source, these are held-out items
            item.setdefault("metadata", {})["split"] = "heldout"
        suites.setdefault(suite.specialist, []).extend(items)
    return suites


def words(text: str) -> tuple[str, ...]:
    """``text`` as the comparison sees it: NFKC-normalised, case-folded words and punctuation marks."""
    return tuple(_WORD.findall(unicodedata.normalize("NFKC", text).casefold()))


def message_texts(message: dict[str, Any]) -> list[str]:
    """Every text a message carries: its content and its tool calls' arguments. Content parts are read both
    run together (as a chat template shows them: ``"progres" + "s 12"``) and apart (``"counter" + "12"``)."""
    content = message.get("content")
    if isinstance(content, list):
        parts = [str(p.get("text", "")) for p in content if isinstance(p, dict)]
        texts = ["".join(parts), " ".join(parts)]
    else:
        texts = [content] if isinstance(content, str) else []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            texts.append(f"{fn.get('name', '')} {fn.get('arguments', '')}")
    return texts


def _ngrams(tokens: tuple[str, ...], n: int) -> set[tuple[str, ...]]:
    return {tokens[i : i + n] for i in range(len(tokens) - n + 1)}


@dataclass
class HeldoutIndex:
    """Every held-out prompt, indexed for the exclusion check (build with ``HeldoutIndex.build``)."""

    ngram: int
    threshold: float
    key: str = ""  # what it was built from (the contract's hash), for caches of its answers
    labels: list[str] = field(default_factory=list)
    exact: dict[tuple[str, ...], int] = field(default_factory=dict)  # whole normalised prompt -> item
    whole: dict[int, dict[tuple[str, ...], int]] = field(default_factory=dict)  # length -> prompt -> item
    grams: dict[tuple[str, ...], list[int]] = field(default_factory=dict)  # n-gram -> long items having it
    needed: dict[int, int] = field(default_factory=dict)  # long item -> n-grams that must be found

    @classmethod
    def build(cls, prompts: Iterable[tuple[str, str]], *, ngram: int, threshold: float) -> HeldoutIndex:
        """An index of ``(label, prompt text)`` pairs."""
        index = cls(ngram=ngram, threshold=threshold)
        for label, text in prompts:
            tokens = words(text)
            if not tokens or tokens in index.exact:
                continue
            item = len(index.labels)
            index.labels.append(label)
            index.exact[tokens] = item
            if len(tokens) >= ngram:
                grams = _ngrams(tokens, ngram)
                index.needed[item] = max(1, int(len(grams) * threshold + 0.999999))
                for gram in grams:
                    index.grams.setdefault(gram, []).append(item)
            elif len(tokens) >= MIN_CONTAINED:
                index.whole.setdefault(len(tokens), {})[tokens] = item
        return index

    def __len__(self) -> int:
        return len(self.labels)

    def find(self, texts: Iterable[str]) -> str | None:
        """The label of a held-out prompt that one of ``texts`` contains, or None."""
        for text in texts:
            tokens = words(text)
            if not tokens:
                continue
            if tokens in self.exact:
                return self.labels[self.exact[tokens]]
            for length, prompts in self.whole.items():
                for i in range(len(tokens) - length + 1):
                    found = prompts.get(tokens[i : i + length])
                    if found is not None:
                        return self.labels[found]
            if self.grams and len(tokens) >= self.ngram:
                hits: dict[int, int] = {}
                for gram in _ngrams(tokens, self.ngram):
                    for item in self.grams.get(gram, ()):
                        hits[item] = hits.get(item, 0) + 1
                        if hits[item] >= self.needed[item]:
                            return self.labels[item]
        return None

    def exclusion(
        self,
        *,
        messages: list[dict[str, Any]],
        metadata: dict[str, Any] | None = None,
        source: str | None = None,
    ) -> str | None:
        """Why a trace must never be learned from (held out), or None when it may be."""
        if (metadata or {}).get("split") == "heldout":
            return "marked held-out (metadata.split)"
        if source == "evaluation":
            return "an evaluation trace"
        found = self.find(text for m in messages if isinstance(m, dict) for text in message_texts(m))
        return None if found is None else f"contains held-out prompt {found}"


def heldout_prompts(contract: ContractSpec, *, contract_path: Path | None = None) -> list[tuple[str, str]]:
    """``(label, text)`` of every held-out prompt of the contract: each user turn of each suite item and
    each prompt of the routing suite (file suites as ``resolve_suites`` finds them)."""
    out = []
    for specialist, items in resolve_suites(contract, contract_path=contract_path).items():
        for i, item in enumerate(items):
            for m in item.get("messages") or []:
                if isinstance(m, dict) and m.get("role") in ("user", "system", "developer"):
                    out += [(f"{specialist} #{i}", text) for text in message_texts(m)]
    if contract.routing is not None:
        for specialist, prompts in contract.routing.prompts.items():
            out += [(f"routing {specialist} #{i}", text) for i, text in enumerate(prompts)]
    return out


_INDEXES: dict[str, HeldoutIndex] = {}


def heldout_index(contract: ContractSpec, *, contract_path: Path | None = None) -> HeldoutIndex:
    """The contract's exclusion predicate (built once per contract content in this process; before
    registration, ``contract_path`` locates its file suites)."""
    from pipeline.contract import contract_hash

    key = contract_hash(contract)
    if key not in _INDEXES:
        policy = contract.decontamination
        index = HeldoutIndex.build(
            heldout_prompts(contract, contract_path=contract_path),
            ngram=policy.ngram,
            threshold=policy.threshold,
        )
        index.key = key
        if len(_INDEXES) >= 8:
            _INDEXES.pop(next(iter(_INDEXES)))
        _INDEXES[key] = index
    return _INDEXES[key]
