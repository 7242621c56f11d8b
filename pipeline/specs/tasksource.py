"""Task sources: where a specialist's practice prompts come from, as its contract entry declares.

A contract specialist may name ``tasks``:

- ``{path: FILE.jsonl, sha256: ...}``: task items, one JSON object per line, in the held-out suites' item
  format: ``{"messages": [...], "metadata": {...}}``, the conversation without its final assistant turn
  plus the verification metadata the contract's scorers read (``expected``, ``tests``, ``schema``,
  ``expected_call``, ``tools``...). The file is stored in the registry at registration; its items are split
  by a hash of their prompt into ``validation`` (``validation_share`` of them, what co-design chooses
  harness variants on) and ``train`` (what collection practises on);
- ``{generator: NAME, options: {...}}``: a registered Python task source. ``demo`` is built in (the demo
  environment; ``options.family`` defaults to the specialist's name); third-party ones are found through the
  entry-point group ``ratchet.tasks``;
- nothing: the specialist learns only from deployment and ingested experience, and co-design validates it on
  a fixed slice of its verified experience that is kept out of training (``eligibility.in_validation_slice``).

The protocol a generator implements (a factory registered under ``ratchet.tasks``)::

    def factory(*, specialist: str, **options) -> TaskSource: ...

    class TaskSource(Protocol):
        def items(self, split: str, n: int, seed: int) -> list[dict]: ...
        # optional: task variants with their verification metadata (discovery; without it, ``discovery``
        # composes and perturbs the items itself)
        def variants(self, items: list[dict], n: int, seed: int) -> list[dict]: ...
        # optional: an action substrate for multi-turn tool episodes (``method: grpo``)
        def reset(self, item: dict) -> Any: ...                    # the state an episode starts from
        def act(self, state: Any, call: dict) -> tuple[Any, Any]: ...  # one call -> (new state, result)
        # optional: the canonical form of the problems a conversation poses (the held-out predicate)
        def canonical(self, messages: list[dict]) -> Hashable | set | list | None: ...

``items`` returns ``n`` task items of ``split`` (``train``: with repeats when it has fewer; ``validation``
and ``heldout``: distinct items, at most ``n``) as a pure function of ``seed``; a split it does not have
raises ``ValueError``. Items of ``heldout`` are marked held-out whatever they say. Whatever the source,
collection also drops any item the contract's held-out predicate matches.

``canonical(messages)`` says which problem a conversation poses, however it is worded: a hashable key (two
conversations posing the same problem get the same key), a ``set``, ``frozenset`` or ``list`` of keys for a
conversation that poses several, or None for none it recognises. It reads every message (any role: a
problem may be stated in a correction, an assistant turn or a tool result; ``pipeline.experience.texts.message_texts``
gives a message's texts), and must be a pure, fast function of them: the held-out predicate
(``pipeline.specs.heldout``) applies it to every trace, correction, exemplar, task item and variant, and apart to
the strings of a trace's tool schemas as one ``system`` message (one string a line). Every key it gives for
an item of a held-out suite drawn from this source (or of a file suite of a specialist whose tasks this
source generates) is held out, and a conversation posing one is never learned from; keys are compared only
with those of the same ``canonical``. One that raises on a held-out item stops the index's build
(``RatchetError``); one that raises on a trace excludes it. The demo's is the unordered operand pair,
``("add", low, high)`` (``pipeline.environment.problems``).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Hashable
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Protocol

from pipeline.environment import (
    FAMILIES,
    execute_call,
    heldout_suite,
    initial_state,
    perturbed_items,
    sample_prompts,
)
from pipeline.environment.problems import problem_keys
from pipeline.errors import RatchetError

if TYPE_CHECKING:
    from pipeline.specs.contract import ContractSpec, TaskSourceSpec

ENTRY_POINT_GROUP = "ratchet.tasks"
SPLITS = ("train", "validation", "heldout")


class TaskSource(Protocol):
    """What collection, co-design and generated held-out suites draw task items from."""

    def items(self, split: str, n: int, seed: int) -> list[dict[str, Any]]: ...


Factory = Callable[..., TaskSource]


def canonical_of(source: Any) -> Callable[[list[dict[str, Any]]], Hashable | None] | None:
    """A task source's ``canonical`` (see the module doc), or None when it has none (or no source)."""
    canonical = getattr(source, "canonical", None)
    return canonical if callable(canonical) else None


# ------------------------------------------------------------------------------------------ file items
def parse_items(text: str, *, where: str) -> list[dict[str, Any]]:
    """Task items of a JSONL text; ``RatchetError`` naming every bad line (``where:line: problem``)."""
    items, problems = [], []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.append(f"{where}:{number}: not JSON ({exc.msg})")
            continue
        messages = item.get("messages") if isinstance(item, dict) else None
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            problems.append(f"{where}:{number}: expected an object with a non-empty `messages` list")
            continue
        if not any(m.get("role") == "user" for m in messages):
            problems.append(f"{where}:{number}: the conversation has no user message")
            continue
        if messages[-1].get("role") == "assistant":
            problems.append(f"{where}:{number}: a task item ends before the assistant's answer")
            continue
        if not isinstance(item.get("metadata", {}), dict):
            problems.append(f"{where}:{number}: `metadata` must be an object")
            continue
        if (item.get("metadata") or {}).get("split") == "heldout":
            problems.append(
                f"{where}:{number}: marked held-out (metadata.split); it belongs in a held-out suite"
            )
            continue
        items.append({"messages": messages, "metadata": dict(item.get("metadata") or {}), "feedback": None})
    if problems:
        raise RatchetError(
            "; ".join(problems[:20]) + (f" (and {len(problems) - 20} more)" if len(problems) > 20 else "")
        )
    if not items:
        raise RatchetError(f"{where}: no task items")
    return items


def _bucket(item: dict[str, Any]) -> float:
    """A stable number in [0, 1) from the item's conversation (what decides its split)."""
    text = json.dumps(item["messages"], sort_keys=True, ensure_ascii=False)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64


class FileTasks:
    """Task items of a JSONL file, split into ``train`` and ``validation`` by a hash of each prompt."""

    def __init__(self, items: list[dict[str, Any]], *, validation_share: float, label: str = "tasks"):
        self.label = label
        self.splits: dict[str, list[dict[str, Any]]] = {"train": [], "validation": []}
        for item in items:
            split = "validation" if _bucket(item) < validation_share else "train"
            self.splits[split].append({**item, "metadata": {**item["metadata"], "split": split}})

    def items(self, split: str, n: int, seed: int) -> list[dict[str, Any]]:
        pool = self.splits.get(split)
        if pool is None:
            raise ValueError(f"{self.label}: a task file has train and validation items, not {split!r}")
        if not pool or n <= 0:
            return []
        rng = random.Random(f"{split}:{seed}")
        if split != "train":
            return [_copy(it) for it in rng.sample(pool, min(n, len(pool)))]
        out: list[dict[str, Any]] = []
        while len(out) < n:  # every train item once per pass, each pass in its own order
            order = list(pool)
            rng.shuffle(order)
            out += [_copy(it) for it in order[: n - len(out)]]
        return out


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(item))


# ------------------------------------------------------------------------------------------ generators
class DemoTasks:
    """The demo environment's items of one family (``pipeline.environment``)."""

    def __init__(self, *, specialist: str, family: str | None = None):

        self.family = family or specialist
        if self.family not in FAMILIES:
            raise RatchetError(
                f"tasks generator demo has no family {self.family!r} (for specialist {specialist!r}); "
                f"expected one of {', '.join(FAMILIES)} (set `options: {{family: ...}}`)"
            )

    def items(self, split: str, n: int, seed: int) -> list[dict[str, Any]]:

        if split == "heldout":
            return heldout_suite(self.family, n, seed)
        return sample_prompts(self.family, n, seed, split=split)

    def variants(self, items: list[dict[str, Any]], n: int, seed: int) -> list[dict[str, Any]]:
        """Up to ``n`` perturbed training items (``pipeline.environment.perturbed_items``: nearby operands,
        swapped order, another tool or widget; training-split problems only), each with its answer."""

        return perturbed_items(self.family, items, n, seed)

    # the problem's identity, the unordered operand pair, whatever the family or wording (one function for
    # every family: a pair held out in one family is held out in all of them, and the predicate applies it once)
    canonical = staticmethod(problem_keys)

    def reset(self, item: dict[str, Any]) -> dict[str, Any]:
        """The action substrate before an episode (the ``agent`` family's timer and cart)."""

        return initial_state()

    def act(self, state: dict[str, Any], call: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Execute one tool call against the substrate: ``(new state, result)``; the result is the new state,
        or an error (unknown tool, invalid arguments) that leaves the state as it was."""

        return execute_call(state, call)


BUILT_IN: dict[str, Factory] = {"demo": DemoTasks}


def generators() -> dict[str, Factory | Any]:
    """Every known generator: the built-in ones and the entry points of ``ratchet.tasks`` (not loaded)."""
    found: dict[str, Any] = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return {**found, **BUILT_IN}


def generator_source(name: str, *, specialist: str, options: dict[str, Any] | None = None) -> TaskSource:
    """The task source ``name`` builds for ``specialist`` (``RatchetError`` when it is unknown or fails)."""
    known = generators()
    if name not in known:
        raise RatchetError(
            f"unknown task generator {name!r} (for specialist {specialist!r}); known: {', '.join(sorted(known))} "
            f"(third-party generators register under the entry-point group {ENTRY_POINT_GROUP!r})"
        )
    factory = known[name]
    if hasattr(factory, "load") and not callable(getattr(factory, "items", None)):
        try:
            factory = factory.load()
        except Exception as exc:  # a broken third-party package: say which, not a traceback
            raise RatchetError(f"task generator {name!r}: its entry point does not load ({exc})") from None
    try:
        source = factory(specialist=specialist, **(options or {}))
    except RatchetError:
        raise
    except TypeError as exc:
        raise RatchetError(
            f"task generator {name!r} (for specialist {specialist!r}): bad options ({exc})"
        ) from None
    if not callable(getattr(source, "items", None)):
        raise RatchetError(f"task generator {name!r} returned {type(source).__name__}, which has no items()")
    return source


# ------------------------------------------------------------------------------------------- contracts
def source_for(spec: TaskSourceSpec, *, specialist: str, read: Callable[[str], str]) -> TaskSource:
    """The task source a contract entry describes; ``read(sha256)`` gives a task file's text."""
    if spec.generator is not None:
        return generator_source(spec.generator, specialist=specialist, options=spec.options)
    assert spec.sha256 is not None
    where = f"tasks of {specialist} ({spec.path})"
    return FileTasks(
        parse_items(read(spec.sha256), where=where), validation_share=spec.validation_share, label=where
    )


def task_sources(contract: ContractSpec, *, read: Callable[[str], str]) -> dict[str, TaskSource]:
    """Per specialist that declares ``tasks``, its source (specialists without one are absent)."""
    return {
        name: source_for(entry.tasks, specialist=name, read=read)
        for name, entry in contract.specialists.items()
        if entry.tasks is not None
    }


def draw(
    source: TaskSource, split: str, n: int, seed: int, *, heldout: Any = None
) -> tuple[list[dict[str, Any]], int]:
    """``n`` items of ``split`` with everything the held-out predicate matches left out; returns the
    items and how many were left out. Train and validation items never carry the held-out mark."""
    items = source.items(split, n, seed)
    kept = []
    for item in items:
        meta = item.setdefault("metadata", {})
        if split == "heldout":
            meta["split"] = "heldout"
        elif heldout is not None and heldout.exclusion(messages=item.get("messages") or [], metadata=meta):
            continue
        kept.append(item)
    return kept, len(items) - len(kept)
