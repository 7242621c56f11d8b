"""What a suite counts: duplicate items, correlated groups, and specialists no suite judges.

A held-out or retention suite is evidence only as far as its items are distinct problems. An item repeated
three times is one observation counted three times: the gate's error rate no longer holds (three copies of
each of 100 items raise the first attempt's false-promotion rate from 0.014 to 0.091, issue 23). So
``ratchet init`` and ``ratchet contract lint`` refuse a contract whose suites repeat an item
(``suite_problems``), one line per repeat naming where it is (a file suite's JSONL line, a generated suite's
item position and generator).

Two items are the same when the held-out predicate (``pipeline.specs.heldout``) reads them as the same:

- the same prompts: every system, developer and user message, compared as words and punctuation after
  Unicode NFKC normalisation, removal of format characters and case folding, leading and trailing
  punctuation trimmed (``What is 12+35?`` and ``what is 12+35``);
- or, where the suite's source has a canonical form (``pipeline.specs.tasksource``: a generated suite's generator,
  a file suite's specialist's task generator), the same non-empty set of canonical keys: the demo's is the
  unordered operand pair, so ``12+35=?`` and ``35+12=?`` are one problem.

Duplicates are looked for across all the held-out suites of one specialist (they are evaluated as one list)
and within each retention suite.

Correlated items that are not duplicates (the turns of one dialogue, variants of one document) stay, marked
by a string ``metadata.group`` on each item: ``item_groups`` is the one reader of groups (held-out and
retention suites alike), evaluation stores them beside the compared scores
(``evaluation["items"][specialist]["groups"]``, ``evaluation["retention"][name]["groups"]``) and the gates
resample a group as one unit. A group is named per specialist (the same name in two suites of one specialist
is one group). A group it would not read -- a top-level ``group``, a non-string ``metadata.group`` -- is
refused, and so is a suite with no items (it would count as a gate and judge nothing).

Every specialist a lineage trains needs a held-out suite, or its contract says ``ungated: true`` for it
(``ContractSpec.ungated_problems``): ``require_counted`` refuses both at ``ratchet init`` and before
``advance`` builds a candidate.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.errors import NotFoundError, RatchetError
from pipeline.experience.texts import message_text, trimmed, words
from pipeline.registry import get_engine, load_stored_file, session_scope
from pipeline.specs.contract import stored_contract
from pipeline.specs.heldout import Canonical, canonical_keys
from pipeline.specs.loading import content_hash, file_sha256
from pipeline.specs.tasksource import canonical_of, draw, generator_source

if TYPE_CHECKING:
    from pipeline.registry import Generation
    from pipeline.specs.contract import ContractSpec, HeldoutSuite, RetentionSuite

# A generator that repeats itself can repeat hundreds of items: name this many per scope, then count the rest.
MAX_LINES_PER_SUITE = 20
PROMPT_ROLES = ("system", "developer", "user")


@dataclass(frozen=True)
class ResolvedSuite:
    """One suite of a contract with its items, and how to name an item of it."""

    where: str  # ``heldout[1] (agent)``, ``retention[0] (sums)``
    scope: str  # items are compared within a scope: one specialist's held-out suites, or one retention suite
    origin: str  # ``suites/chat.jsonl`` or ``generator demo (seed 1234, size 300)``
    items: list[dict[str, Any]]
    lines: list[int] | None  # the JSONL line of each item (file suites); None: generated, named by position
    canonical: Canonical | None
    unreadable: tuple[str, ...] = ()  # lines of a file that are not JSON objects

    def position(self, i: int) -> str:
        """How a user finds item ``i``: its line in the file, or its position (from 1) in the generated list."""
        return f"line {self.lines[i]}" if self.lines is not None else f"item {i + 1}"


def item_groups(items: Iterable[dict[str, Any]]) -> list[str | None]:
    """Each item's ``metadata.group`` (a non-empty string), or None: an item of its own."""
    out: list[str | None] = []
    for item in items:
        meta = item.get("metadata") if isinstance(item, dict) else None
        group = meta.get("group") if isinstance(meta, dict) else None
        out.append(group if isinstance(group, str) and group else None)
    return out


def compared_groups(items: list[dict[str, Any]], left_out: Iterable[int]) -> dict[str, list[str | None]]:
    """``{"groups": [...]}`` aligned with the items scored on both pairs (those not in ``left_out``), or ``{}``
    when no item has a group (every item its own unit): what evaluation stores beside the compared scores."""
    skipped = set(left_out)
    groups = [g for i, g in enumerate(item_groups(items)) if i not in skipped]
    return {"groups": groups} if any(g is not None for g in groups) else {}


def prompt_form(item: dict[str, Any]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The item's prompts as the held-out predicate compares them: ``(role, trimmed normalised words)`` of
    every system, developer and user message (an item without prompt text: ``()``)."""
    form = []
    for m in item.get("messages") or []:
        if isinstance(m, dict) and m.get("role") in PROMPT_ROLES:
            tokens = trimmed(words(message_text(m)))
            if tokens:
                form.append((str(m["role"]), tokens))
    return tuple(form)


def _first_prompt(item: dict[str, Any]) -> str:
    for m in item.get("messages") or []:
        if isinstance(m, dict) and m.get("role") == "user":
            text = " ".join(message_text(m).split())
            return text if len(text) <= 60 else text[:57] + "..."
    return ""


def _file_text(contract_path: Path | None, name: str, digest: str) -> str:
    """A suite file's text: beside the contract file (its sha256 checked), or without one from the registry."""

    if contract_path is None:
        with session_scope(get_engine()) as session:
            return load_stored_file(session=session, sha256=digest).decode("utf-8")
    path = Path(name)
    path = path if path.is_absolute() else Path(contract_path).resolve().parent / path
    if not path.is_file():
        raise NotFoundError(f"{contract_path}: suite file {path} not found")
    if file_sha256(path) != digest:
        raise RatchetError(f"{contract_path}: the sha256 of {path} is not the one the contract declares")
    return path.read_text(encoding="utf-8")


def _resolve(
    contract: ContractSpec,
    suite: HeldoutSuite | RetentionSuite,
    *,
    where: str,
    scope: str,
    contract_path: Path | None,
) -> ResolvedSuite:

    if suite.generator is not None:
        source = generator_source(suite.generator, specialist=suite.specialist, options=suite.options)
        items, _ = draw(source, "heldout", suite.size or 0, suite.seed or 0)
        origin = f"generator {suite.generator} (seed {suite.seed}, size {suite.size})"
        return ResolvedSuite(where, scope, origin, items, None, canonical_of(source))
    items, lines, unreadable = [], [], []
    text = _file_text(contract_path, suite.path or "", suite.sha256 or "")
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            unreadable.append(f"line {n}: not valid JSON ({exc.msg} at column {exc.colno})")
            continue
        if not isinstance(item, dict):
            unreadable.append(f"line {n}: not a JSON object")
            continue
        items.append(item)
        lines.append(n)
    tasks = contract.specialists[suite.specialist].tasks
    source = (  # a file suite is in the form of its specialist's generated tasks, as the held-out index reads it
        generator_source(tasks.generator, specialist=suite.specialist, options=tasks.options)
        if tasks is not None and tasks.generator is not None
        else None
    )
    return ResolvedSuite(
        where, scope, suite.path or "", items, lines, canonical_of(source), tuple(unreadable)
    )


def contract_suites(contract: ContractSpec, *, contract_path: Path | None = None) -> list[ResolvedSuite]:
    """Every held-out and retention suite of the contract with its items (files from beside
    ``contract_path``, or without one from the registry; generated suites drawn from their generator)."""
    out = [
        _resolve(contract, s, where=f"heldout[{i}] ({s.specialist})", scope=f"the held-out suites of {s.specialist}",
                 contract_path=contract_path)
        for i, s in enumerate(contract.heldout)
    ]  # fmt: skip
    out += [
        _resolve(contract, r, where=f"retention[{i}] ({r.name})", scope=f"retention suite {r.name}",
                 contract_path=contract_path)
        for i, r in enumerate(contract.retention)
    ]  # fmt: skip
    return out


def _keys(suite: ResolvedSuite, i: int) -> tuple[list[Hashable], str | None]:
    """The identities of item ``i`` (its prompt form; its canonical keys as one set, when its source has a
    canonical form), and why its canonical form could not be read, if it could not."""
    item = suite.items[i]
    form = prompt_form(item)
    keys: list[Hashable] = [("prompt", form)] if form else []
    if suite.canonical is not None:
        try:
            problem = canonical_keys(suite.canonical, item.get("messages") or [])
            if problem:
                keys.append(("problem", problem))
        except Exception as exc:  # a third party's code: say which item, not a traceback
            return keys, f"its source's canonical() failed on it ({type(exc).__name__}: {exc})"
    return keys, None


def duplicate_problems(suites: list[ResolvedSuite]) -> list[str]:
    """One line per item that repeats an earlier item of its scope (see the module doc), at most
    ``MAX_LINES_PER_SUITE`` per scope and then a count of the rest; one per item whose canonical form fails."""
    out: list[str] = []
    seen: dict[str, dict[Hashable, tuple[ResolvedSuite, int]]] = {}
    named: dict[str, int] = {}
    for suite in suites:
        known = seen.setdefault(suite.scope, {})
        for i in range(len(suite.items)):
            keys, failed = _keys(suite, i)
            if failed is not None:
                out.append(f"{suite.where}, {suite.origin}: {suite.position(i)}: {failed}")
            matched = next((k for k in keys if k in known), None)
            if matched is None:
                for k in keys:
                    known[k] = (suite, i)
                continue
            named[suite.scope] = named.get(suite.scope, 0) + 1
            if named[suite.scope] > MAX_LINES_PER_SUITE:
                continue
            other, j = known[matched]
            then = (
                other.position(j) if other is suite else f"{other.where}, {other.origin}: {other.position(j)}"
            )
            why = "the same prompt" if matched[0] == "prompt" else "the same problem"
            out.append(
                f"{suite.where}, {suite.origin}: {suite.position(i)} repeats {then} ({why}: "
                f"{_first_prompt(other.items[j])!r} / {_first_prompt(suite.items[i])!r}); "
                + ("remove one" if suite.lines is not None else "its generator must draw distinct problems")
            )
    out += [
        f"{scope}: {n - MAX_LINES_PER_SUITE} more repeated item(s) not listed"
        for scope, n in named.items()
        if n > MAX_LINES_PER_SUITE
    ]
    return out


def group_problems(suites: list[ResolvedSuite]) -> list[str]:
    """One line per item whose group ``item_groups`` would not read: a ``metadata.group`` set but not a
    non-empty string, or a ``group`` at the item's top level. Either is a group the user meant and no gate
    would see (its items counted as independent), so it is refused rather than ignored."""
    out = []
    for suite in suites:
        for i, item in enumerate(suite.items):
            where = f"{suite.where}, {suite.origin}: {suite.position(i)}"
            if "group" in item:
                out.append(f"{where}: a top-level `group` is read by no gate: put it under metadata.group")
            meta = item.get("metadata")
            group = meta.get("group") if isinstance(meta, dict) else None
            if group is not None and not (isinstance(group, str) and group):
                out.append(
                    f"{where}: metadata.group must be a non-empty string naming the item's group of correlated "
                    f"items (got {json.dumps(group)[:40]})"
                )
    return out


def empty_problems(suites: list[ResolvedSuite]) -> list[str]:
    """One line per suite with no items (an empty file, a generator that draws none): it would count as the
    specialist's gate and judge nothing. A file whose lines are all unreadable is named by those lines."""
    return [
        f"{s.where}, {s.origin}: no items: an empty suite judges nothing (a suite needs at least one item)"
        for s in suites
        if not s.items and not s.unreadable
    ]


def suite_problems(contract: ContractSpec, *, contract_path: Path | None = None) -> list[str]:
    """Every problem of what the contract's suites count: unreadable file lines, empty suites, repeated items,
    malformed groups (one line each; ``RatchetError`` when a suite cannot be read at all)."""
    suites = contract_suites(contract, contract_path=contract_path)
    unreadable = [f"{s.where}, {s.origin}: {line}" for s in suites for line in s.unreadable]
    return unreadable + empty_problems(suites) + duplicate_problems(suites) + group_problems(suites)


def ungated_lines(contract: ContractSpec, specialists: Iterable[str] | None = None) -> list[str]:
    """``contract.ungated_problems()`` for ``specialists`` only (those a lineage trains; None: all)."""
    names = None if specialists is None else set(specialists)
    return [
        line
        for line in contract.ungated_problems()
        if names is None or line.split(":", 1)[0].removeprefix("specialists.") in names
    ]


def require_counted(
    contract: ContractSpec,
    *,
    where: str,
    contract_path: Path | None = None,
    specialists: Iterable[str] | None = None,
) -> None:
    """``RatchetError`` listing, one line each and prefixed with ``where``, every specialist of
    ``specialists`` (None: all) that no held-out suite judges without ``ungated: true``, and every problem of
    ``suite_problems``."""
    problems = ungated_lines(contract, specialists) + suite_problems(contract, contract_path=contract_path)
    if problems:
        raise RatchetError("\n".join(f"{where}: {p}" for p in problems))


def require_gated(generation: Generation, *, lineage: str) -> None:
    """Before ``advance`` builds a candidate from ``generation`` (the champion): ``RatchetError`` naming every
    specialist it trains that its contract gives no held-out suite without ``ungated: true``. Such a contract
    was registered before every specialist needed one; training the specialist with no gate at all and
    saying nothing is what this rule exists to stop, so the lineage must adopt a version that decides."""

    contract = stored_contract(generation.contract_version.spec)
    lines = ungated_lines(contract, [slot.specialist for slot in generation.adapters])
    if lines:
        name = f"{contract.name} {contract.version}"
        raise RatchetError(
            "\n".join(f"lineage {lineage!r}, contract {name}: {line}" for line in lines)
            + f"\nlineage {lineage!r}: no candidate is built until its contract gives each of them a held-out "
            f"suite or says `ungated: true`: adopt such a version with `ratchet contract adopt FILE --lineage {lineage}`"
        )


def item_key(item: Mapping[str, Any], specialist: str | None = None) -> str:
    """An item's identity in the ledger: the hash of its prompts as the duplicate check compares them
    (``prompt_form``; an item without prompt text, of its messages) and of the specialist that answers it. The
    same prompt answered by another specialist (a retention suite drawn from another family's split) is
    another test, and does not spend that specialist's budget."""
    form = prompt_form(dict(item))
    key = form if form else {"messages": item.get("messages")}
    return content_hash(key if specialist is None else {"specialist": specialist, "item": key})


def item_keys(items: Sequence[Mapping[str, Any]], specialist: str | None = None) -> list[str]:
    """``item_key`` of each item, in order."""
    return [item_key(item, specialist) for item in items]
