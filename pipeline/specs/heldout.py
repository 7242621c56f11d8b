"""Held-out items: the contract's suites, and the one predicate that keeps them out of everything learned.

``resolve_suites(contract, epoch=...)`` gives the items of every held-out suite (a ``fresh`` suite's sample for
the champion of generation ``epoch``), ``resolve_retention(contract)`` those of every retention suite, and
``suite_sha256(items)`` a suite's identity in the spending ledger (``pipeline.registry.ledger``). Retention
items are held out like held-out ones, and so is every item a fresh suite could ever draw: its generator's
whole held-out split (a fresh suite needs a generator with a ``canonical`` form, which recognises each of
those problems however it is worded). ``heldout_index(contract)`` is the
exclusion predicate every consumer of experience goes through (curation, co-design exemplars, router
training data: ``pipeline.experience.eligibility.load_candidates`` applies it before anything else sees a trace; task
items, variants, corrections and harness exemplars are checked with it too):
``HeldoutIndex.exclusion(messages, metadata, source)`` says why a trace may not be learned from, or None.
A trace is excluded when

- its metadata marks it held-out, or it came from an evaluation run;
- any of its texts -- every message's content (parts run together and apart) and tool-call arguments, and
  every string of the client's tool schemas in ``metadata.tools`` (they reach the training prompt: curation
  gives them to the chat template) -- contains a held-out prompt (every user turn of every suite item, and
  every prompt of the contract's routing suite). Texts are compared as words and punctuation after Unicode
  NFKC normalisation, removal of format characters (zero-width spaces...) and case folding, with leading
  and trailing punctuation trimmed (``15+42`` is ``15+42=?``; a routing prompt without its ``?`` is the
  prompt); a prompt of ``MIN_CONTAINED`` tokens or more also matches inside a longer text, a shorter one
  only a text that is exactly it; near-duplicates are found by word n-gram overlap
  (``contract.decontamination``), the decontamination check LLM evaluations use;
- it poses a held-out item's problem: a task source may give the canonical form of the problems a
  conversation poses (``canonical(messages)``, ``pipeline.specs.tasksource``; the demo's is the unordered operand
  pair, so ``42+15``, ``what is 15 plus 42?`` and ``f adds 42 15`` are all the held-out ``15+42=?``). Every
  held-out item's keys are indexed under its suite's source (a generated suite's generator; a file suite's
  specialist's generator, when it has one), and every such source's ``canonical`` is applied to every
  trace's messages and tool strings;
- its final assistant reply is a held-out item's reference answer (``metadata.expected`` of
  ``MIN_ANSWER_TOKENS`` tokens or more, compared trimmed): a reply that teaches the answer without the
  prompt. EXCEPT when the trace carries its own top-level ``metadata.expected``: a reference answer of its
  own, which only the loop's task sources, the operator's ingest or a principal granted ``certify`` can put
  there (anyone else's is ``metadata.claimed``), for a prompt the checks above found not held out; its reply
  is learned only if it passes that trace's own checks, and a wrong one is at most the rejected side of a
  preference pair, which pushes it down. Answers are often shared by many problems (the demo's are sums:
  ``f adds 20 37`` and the held-out ``f adds 15 42`` both want ``def f(x):return x+57``), and refusing them
  would stop the loop learning its own training items (7 in 10 of the demo's coding and genui training
  traces) and most of their preference pairs. A reply about to be learned positively -- an SFT target, a
  preferred side, an exemplar -- is held to the stricter rule (``HeldoutIndex.teaches``): it must *be* its
  trace's own reference answer. Without metadata (a harness exemplar) no reply is exempt.

What it cannot catch: a held-out item paraphrased into different words that its source's canonical form
does not recognise (or any paraphrase, for a source without one), a short reference answer (a bare number)
given without its problem, and an answer written in another form than the reference (another spelling
of the same code; a tool call rather than the compact text of ``metadata.expected``).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.errors import RatchetError
from pipeline.experience.texts import KEPT_CHARS, KEPT_TEXTS, json_strings, message_texts, trimmed, words
from pipeline.specs.contract import contract_hash, file_reader
from pipeline.specs.loading import content_hash
from pipeline.specs.tasksource import canonical_of, draw, generator_source

if TYPE_CHECKING:
    from pipeline.specs.contract import ContractSpec, HeldoutSuite, RetentionSuite

MIN_CONTAINED = 3  # a held-out prompt of fewer tokens (trimmed) only matches a text that is exactly it
# A reference answer of fewer tokens (words and punctuation marks, trimmed) is not indexed: one to three
# tokens ("57", "Paris.", "yes it is", "x + 1") is the natural reply to countless prompts, so a reply equal
# to it says nothing about a held-out item, and refusing it would refuse ordinary traffic. From four tokens
# on, an answer is a phrase, a call, code or JSON specific enough for equality to be evidence. The demo's
# chat answers (a number: one token) are not indexed; its calls (``set_timer(minutes=57)``: 5 tokens), code
# (``def f(x):return x+57``: 10) and JSON (12) are.
MIN_ANSWER_TOKENS = 4
# A fresh suite's held-out split is drawn whole for the exclusion predicate (every sample any champion's
# seed could draw is held out); a generator giving this many items or more is refused for `fresh`.
FRESH_SPLIT_LIMIT = 100_000

Canonical = Callable[[list[dict[str, Any]]], Any]
Suite = tuple[str, list[dict[str, Any]], "Canonical | None"]  # specialist, items, its source's canonical


def fresh_seed(seed: int, epoch: int) -> int:
    """The seed of a ``fresh`` suite's sample for the champion of generation ``epoch``: a hash of both, so each
    champion gets its own sample, the same one every time it is evaluated against (in any lineage)."""
    return int.from_bytes(hashlib.sha256(f"fresh:{seed}:{epoch}".encode()).digest()[:4], "big") >> 1


def suite_sha256(items: list[dict[str, Any]]) -> str:
    """A suite's identity in the spending ledger: the content hash of its resolved items (conversations and
    metadata), whatever contract, lineage or file they came from. Order does not count: the same items
    shuffled are the same suite (reordering a file buys no fresh error budget)."""
    return content_hash(sorted(content_hash(item) for item in items))


def _drawn(
    contract: ContractSpec,
    suite: HeldoutSuite | RetentionSuite,
    read: Callable[[str], str],
    *,
    seed: int | None,
    size: int | None,
) -> tuple[list[dict[str, Any]], Canonical | None]:
    """A suite's items (marked held-out) and its source's ``canonical``: a generated suite's generator's
    ``heldout`` split, or a file suite (in the form of its specialist's generated tasks, when it has some)."""

    if suite.generator is not None:
        source = generator_source(suite.generator, specialist=suite.specialist, options=suite.options)
        items, _ = draw(source, "heldout", int(size or 0), int(seed or 0))
    else:
        text = read(str(suite.sha256))
        items = [json.loads(line) for line in text.splitlines() if line.strip()]
        tasks = contract.specialists[suite.specialist].tasks
        source = (
            generator_source(tasks.generator, specialist=suite.specialist, options=tasks.options)
            if tasks is not None and tasks.generator is not None
            else None
        )
    for item in items:  # whatever the source, these are held-out items
        item.setdefault("metadata", {})["split"] = "heldout"
    return items, canonical_of(source)


def _heldout(
    contract: ContractSpec, read: Callable[[str], str], *, epoch: int | None, every: bool
) -> list[Suite]:
    """Every held-out suite: its specialist, its items and its source's ``canonical``. A ``fresh`` suite is
    the sample of the champion of generation ``epoch`` (its own seed without one); with ``every``, the whole
    held-out split it draws its samples from (what the exclusion predicate must hold out)."""
    out: list[Suite] = []
    for i, suite in enumerate(contract.heldout):
        seed, size = suite.seed, suite.size
        if suite.fresh and every:
            size = FRESH_SPLIT_LIMIT
        elif suite.fresh and epoch is not None and seed is not None:
            seed = fresh_seed(seed, epoch)
        items, canonical = _drawn(contract, suite, read, seed=seed, size=size)
        if suite.fresh and canonical is None:
            raise RatchetError(
                f"heldout[{i}] ({suite.specialist}): `fresh: true` needs a task generator with a canonical form "
                f"(canonical(messages)), and {suite.generator!r} has none: without it no exclusion check covers "
                "every sample a fresh suite could draw"
            )
        if suite.fresh and every and len(items) >= FRESH_SPLIT_LIMIT:
            raise RatchetError(
                f"heldout[{i}] ({suite.specialist}): generator {suite.generator!r} gives {FRESH_SPLIT_LIMIT:,} or "
                "more held-out items: too many to hold out every sample a fresh suite could draw; set `fresh: false`"
            )
        out.append((suite.specialist, items, canonical))
    return out


def _retention(contract: ContractSpec, read: Callable[[str], str]) -> list[tuple[str, Suite]]:
    """Every retention suite: its name, and its specialist, items and source's ``canonical``."""
    out = []
    for suite in contract.retention:
        items, canonical = _drawn(contract, suite, read, seed=suite.seed, size=suite.size)
        out.append((suite.name, (suite.specialist, items, canonical)))
    return out


def _suites(contract: ContractSpec, contract_path: Path | None) -> list[Suite]:
    """What the exclusion predicate holds out: every held-out suite (all a fresh one could draw) and every
    retention suite (labelled ``retention <name>``)."""

    read = file_reader(contract, contract_path)
    kept = [
        (f"retention {name}", items, canonical) for name, (_, items, canonical) in _retention(contract, read)
    ]
    return _heldout(contract, read, epoch=None, every=True) + kept


def resolve_suites(
    contract: ContractSpec, *, contract_path: Path | None = None, epoch: int | None = None
) -> dict[str, list[dict[str, Any]]]:
    """Items of every held-out suite of the contract, per specialist. File suites come from the given
    contract file's directory (sha256-checked), or without one from the registry, which stored them at
    registration; generated suites from their task generator's ``heldout`` split; a ``fresh`` suite is the
    sample of the champion of generation ``epoch`` (``fresh_seed``; its own seed when None)."""

    suites: dict[str, list[dict[str, Any]]] = {}
    for specialist, items, _ in _heldout(
        contract, file_reader(contract, contract_path), epoch=epoch, every=False
    ):
        suites.setdefault(specialist, []).extend(items)
    return suites


def resolve_retention(
    contract: ContractSpec, *, contract_path: Path | None = None
) -> dict[str, list[dict[str, Any]]]:
    """Items of every retention suite of the contract, by suite name (held out like ``resolve_suites``')."""

    return {name: items for name, (_, items, _) in _retention(contract, file_reader(contract, contract_path))}


@functools.lru_cache(maxsize=KEPT_TEXTS)
def _compared_short(text: str) -> tuple[str, ...]:
    return trimmed(words(text))


def _compared(text: str) -> tuple[str, ...]:
    """``trimmed(words(text))`` (kept for short texts)."""
    return _compared_short(text) if len(text) <= KEPT_CHARS else trimmed(words(text))


def tool_texts(metadata: dict[str, Any]) -> list[str]:
    """Every string of the tool schemas a trace's metadata carries (``tools``, certified or ``claimed``)."""
    claimed = metadata.get("claimed")
    found = [metadata.get("tools"), claimed.get("tools") if isinstance(claimed, dict) else None]
    return [text for tools in found if tools for text in json_strings(tools)]


def canonical_keys(canonical: Canonical, messages: list[dict[str, Any]]) -> frozenset[Hashable]:
    """What a source's ``canonical`` returns, as a set of keys (None: none; a set, frozenset or list: those
    keys; anything else: that one key)."""
    got = canonical(messages)
    if got is None:
        return frozenset()
    return frozenset(got) if isinstance(got, (set, frozenset, list)) else frozenset([got])


def _ngrams(tokens: tuple[str, ...], n: int) -> set[tuple[str, ...]]:
    return {tokens[i : i + n] for i in range(len(tokens) - n + 1)}


@dataclass
class HeldoutIndex:
    """Every held-out prompt, problem and reference answer, indexed for the exclusion check (build with
    ``HeldoutIndex.build``)."""

    ngram: int
    threshold: float
    key: str = ""  # what it was built from (the contract's hash), for caches of its answers
    labels: list[str] = field(default_factory=list)
    exact: dict[tuple[str, ...], int] = field(default_factory=dict)  # whole trimmed prompt -> item
    whole: dict[int, dict[tuple[str, ...], int]] = field(default_factory=dict)  # length -> prompt -> item
    grams: dict[tuple[str, ...], list[int]] = field(default_factory=dict)  # n-gram -> long items having it
    needed: dict[int, int] = field(default_factory=dict)  # long item -> n-grams that must be found
    answers: dict[tuple[str, ...], int] = field(default_factory=dict)  # trimmed reference answer -> item
    problems: dict[Canonical, dict[Hashable, int]] = field(default_factory=dict)  # canonical -> key -> item
    _found: dict[str, int | None] = field(default_factory=dict, repr=False)  # text -> find's answer (kept)
    _schemas: dict[str, str | None] = field(
        default_factory=dict, repr=False
    )  # tool strings -> posed's answer

    @classmethod
    def build(
        cls,
        prompts: Iterable[tuple[str, str]],
        *,
        ngram: int,
        threshold: float,
        answers: Iterable[tuple[str, str]] = (),
        problems: Iterable[tuple[str, Canonical, list[dict[str, Any]]]] = (),
    ) -> HeldoutIndex:
        """An index of ``(label, prompt text)`` pairs, ``(label, reference answer)`` pairs (those of
        ``MIN_ANSWER_TOKENS`` or more) and ``(label, canonical, item messages)`` triples (the keys
        ``canonical`` gives for the item's messages; ``RatchetError`` when they are not hashable)."""
        index = cls(ngram=ngram, threshold=threshold)
        for label, text in prompts:
            tokens = trimmed(words(text))
            if not tokens or tokens in index.exact:
                continue
            item = index._label(label)
            index.exact[tokens] = item
            if len(tokens) >= ngram:
                grams = _ngrams(tokens, ngram)
                index.needed[item] = max(1, int(len(grams) * threshold + 0.999999))
                for gram in grams:
                    index.grams.setdefault(gram, []).append(item)
            elif len(tokens) >= MIN_CONTAINED:
                index.whole.setdefault(len(tokens), {})[tokens] = item
        for label, text in answers:
            tokens = trimmed(words(text))
            if len(tokens) >= MIN_ANSWER_TOKENS and tokens not in index.answers:
                index.answers[tokens] = index._label(label)
        for label, canonical, messages in problems:
            try:
                keys = canonical_keys(canonical, messages)
            except Exception as exc:  # a third party's code: say which item, not a traceback
                raise RatchetError(
                    f"held-out item {label}: its task source's canonical() failed on it ({type(exc).__name__}: "
                    f"{exc}); it must return a hashable key, a set or list of them, or None"
                ) from None
            known, item = index.problems.setdefault(canonical, {}), None
            for k in sorted(keys - known.keys(), key=repr):
                item = index._label(label) if item is None else item
                known[k] = item
        return index

    def _label(self, label: str) -> int:
        self.labels.append(label)
        return len(self.labels) - 1

    def __len__(self) -> int:
        return len(self.labels)

    def find(self, texts: Iterable[str]) -> str | None:
        """The label of a held-out prompt that one of ``texts`` contains, or None."""
        for text in texts:
            if len(text) > KEPT_CHARS:
                found = self._find_one(text)
            elif text in self._found:
                found = self._found[text]
            else:
                if len(self._found) >= KEPT_TEXTS:
                    self._found.clear()
                found = self._found[text] = self._find_one(text)
            if found is not None:
                return self.labels[found]
        return None

    def _find_one(self, text: str) -> int | None:
        tokens = _compared(text)
        if not tokens:
            return None
        if tokens in self.exact:
            return self.exact[tokens]
        for length, prompts in self.whole.items():
            for i in range(len(tokens) - length + 1):
                found = prompts.get(tokens[i : i + length])
                if found is not None:
                    return found
        if self.grams and len(tokens) >= self.ngram:
            hits: dict[int, int] = {}
            for gram in _ngrams(tokens, self.ngram):
                for item in self.grams.get(gram, ()):
                    hits[item] = hits.get(item, 0) + 1
                    if hits[item] >= self.needed[item]:
                        return item
        return None

    def posed(self, messages: list[dict[str, Any]]) -> str | None:
        """Why ``messages`` pose a held-out item's problem (its source's canonical form), or None. A canonical
        form that fails on them excludes them: refused rather than missed."""
        for canonical, keys in self.problems.items():
            if not keys:
                continue
            try:
                for k in canonical_keys(canonical, messages):
                    if k in keys:
                        return f"poses the problem of held-out item {self.labels[keys[k]]}"
            except Exception as exc:  # a third party's code on untrusted text: fail closed, and say so
                return f"its task source's canonical() failed on it ({type(exc).__name__}: {exc})"
        return None

    def _posed_schemas(self, text: str) -> str | None:
        """``posed`` for a trace's tool-schema strings (one a line, as one ``system`` message), kept per text:
        a deployment sends the same schemas with every turn."""
        if len(text) > 16 * KEPT_CHARS:
            return self.posed([{"role": "system", "content": text}])
        if text not in self._schemas:
            if len(self._schemas) >= 1024:
                self._schemas.clear()
            self._schemas[text] = self.posed([{"role": "system", "content": text}])
        return self._schemas[text]

    def answered(self, messages: list[dict[str, Any]], metadata: dict[str, Any]) -> str | None:
        """The label of a held-out item whose reference answer is the final assistant reply, unless the
        trace carries a reference answer of its own (``metadata.expected``; see the module doc), or None."""
        if metadata.get("expected") not in (None, "", []):
            return None
        return self.teaches(messages, {})

    def teaches(self, messages: list[dict[str, Any]], metadata: dict[str, Any]) -> str | None:
        """For a reply about to be *learned* (an SFT target, a preferred side, an exemplar): the label of a
        held-out item whose reference answer the final assistant reply is, unless it is the trace's own
        reference answer (``metadata.expected``), or None. Stricter than ``exclusion``, which lets a trace
        with any reference of its own through (its wrong reply may be a preference pair's rejected side):
        a reply learned positively must be its own trace's answer when it is a held-out one."""
        if not self.answers:
            return None
        final = next((m for m in reversed(messages) if m.get("role") == "assistant"), None)
        if final is None:
            return None
        own = metadata.get("expected")
        mine = {_compared(o) for o in (own if isinstance(own, list) else [own]) if isinstance(o, str)}
        for text in message_texts(final):
            tokens = _compared(text)
            item = self.answers.get(tokens)
            if item is not None and tokens not in mine:
                return self.labels[item]
        return None

    def exclusion(
        self,
        *,
        messages: list[dict[str, Any]],
        metadata: dict[str, Any] | None = None,
        source: str | None = None,
    ) -> str | None:
        """Why a trace must never be learned from (held out), or None when it may be (see the module doc)."""
        meta = metadata if isinstance(metadata, dict) else {}
        if meta.get("split") == "heldout":
            return "marked held-out (metadata.split)"
        if source == "evaluation":
            return "an evaluation trace"
        turns = [m for m in messages if isinstance(m, dict)]
        found = self.find(text for m in turns for text in message_texts(m))
        if found is not None:
            return f"contains held-out prompt {found}"
        tools = tool_texts(meta)
        found = self.find(tools)
        if found is not None:
            return f"contains held-out prompt {found} in metadata.tools"
        posed = self.posed(turns) or (self._posed_schemas("\n".join(tools)) if tools else None)
        if posed is not None:
            return posed
        found = self.answered(turns, meta)
        if found is not None:
            return f"replies with the reference answer of held-out item {found}"
        return None


def _labelled(suites: list[Suite]) -> Iterator[tuple[str, dict[str, Any], Canonical | None]]:
    """Every suite item with its label (``specialist #i`` numbered per specialist, ``retention <name> #i``)
    and its source's canonical form."""
    counts: dict[str, int] = {}
    for specialist, items, canonical in suites:
        for item in items:
            i = counts.get(specialist, 0)
            counts[specialist] = i + 1
            yield f"{specialist} #{i}", item, canonical


def heldout_prompts(contract: ContractSpec, *, contract_path: Path | None = None) -> list[tuple[str, str]]:
    """``(label, text)`` of every held-out prompt of the contract: each user turn of each item of each held-out
    suite (all a fresh one could draw) and retention suite, and each prompt of the routing suite (file suites as
    ``resolve_suites`` finds them)."""
    return _prompts(contract, _suites(contract, contract_path))


def _prompts(contract: ContractSpec, suites: list[Suite]) -> list[tuple[str, str]]:
    out = []
    for label, item, _ in _labelled(suites):
        for m in item.get("messages") or []:
            if isinstance(m, dict) and m.get("role") in ("user", "system", "developer"):
                out += [(label, text) for text in message_texts(m)]
    if contract.routing is not None:
        for specialist, prompts in contract.routing.prompts.items():
            out += [(f"routing {specialist} #{i}", text) for i, text in enumerate(prompts)]
    return out


def _answers(suites: list[Suite]) -> list[tuple[str, str]]:
    """``(label, reference answer)`` of every suite item whose ``metadata.expected`` is a string."""
    out = []
    for label, item, _ in _labelled(suites):
        expected = (item.get("metadata") or {}).get("expected")
        if isinstance(expected, str):
            out.append((label, expected))
    return out


def _problems(suites: list[Suite]) -> list[tuple[str, Canonical, list[dict[str, Any]]]]:
    """``(label, canonical, messages)`` of every suite item whose source has a canonical form."""
    return [
        (label, canonical, item.get("messages") or [])
        for label, item, canonical in _labelled(suites)
        if canonical is not None
    ]


_INDEXES: dict[str, HeldoutIndex] = {}


def heldout_index(contract: ContractSpec, *, contract_path: Path | None = None) -> HeldoutIndex:
    """The contract's exclusion predicate (built once per contract content in this process; before
    registration, ``contract_path`` locates its file suites)."""

    key = contract_hash(contract)
    if key not in _INDEXES:
        policy = contract.decontamination
        suites = _suites(contract, contract_path)
        index = HeldoutIndex.build(
            _prompts(contract, suites),
            ngram=policy.ngram,
            threshold=policy.threshold,
            answers=_answers(suites),
            problems=_problems(suites),
        )
        index.key = key
        if len(_INDEXES) >= 8:
            _INDEXES.pop(next(iter(_INDEXES)))
        _INDEXES[key] = index
    return _INDEXES[key]
