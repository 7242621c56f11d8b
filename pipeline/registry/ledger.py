"""The spending ledger: how many tests have been made on each held-out and retention item.

A suite is known by the content hash of its resolved items (``pipeline.specs.heldout.suite_sha256``), and each row
of ``suite_attempts`` is one test a generation made on one suite: ``improvement`` (on every suite the
comparison uses), ``noninferiority:<specialist>`` (that specialist's suite) and ``retention:<name>`` (that
retention suite). What is counted, though, is the items: the first time a suite is spent on, its item keys
are written (``suite_items``; ``pipeline.gates.suites.item_key``: the hash of an item's prompts as the duplicate check compares
them, so ``metadata`` such as ``group``, whitespace, case and NFKC differences do not make another item).
A test's attempt ``j`` is 1 + the largest number, over its suites' items, of other generations whose tests
of the same budget used a suite holding that item. So a suite one item bigger, a suite added beside a kept
one, or the same items with a group added continue the count of the items they share, instead of opening a
fresh budget. The ``j``-th test is made at its rate ``* 6 / (pi**2 * j**2)``, which sums to the rate over
every test an item will ever see: a promotion, a manual ``ratchet promote``, a rollback, a new lineage or
an adopted contract gives nothing a fresh budget. Only new items do, and the samples of one ``fresh``
suite: they are not counted against each other here but by their sample share (``sample``, ``samples_of``,
``PromotionGates.attempt_rate(j, sample)``).

Generations evaluated before the ledger (an evaluation with ``comparison`` but no ``suites`` or
``attempts``) left no rows: each one of the same lineage counts as one earlier test on every suite of every
test a new evaluation makes (it may have tested other items: over-counting only makes the gates stricter).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sqlalchemy import ColumnElement, exists, func, insert, or_, select
from sqlalchemy.orm import Session, aliased

from pipeline.errors import NotFoundError
from pipeline.registry.db import hold_lock
from pipeline.registry.models import Generation, SuiteAttempt, SuiteItem

LEDGER_LOCK = "ratchet:suite-ledger"
# Non-inferiority on a specialist's held-out suite and on a retention suite are one budget when they test
# the same items: a suite a contract adoption turned from held-out into retention keeps counting where its
# non-inferiority tests left off (counting more tests can only make the gate stricter).
NONINFERIORITY = ("noninferiority:", "retention:")


def _same_budget(test: str) -> ColumnElement[bool]:
    """The ledger rows that spend the same budget as ``test`` on a suite."""
    if test.startswith(NONINFERIORITY):
        return or_(*(SuiteAttempt.test.startswith(prefix) for prefix in NONINFERIORITY))
    return SuiteAttempt.test == test


def spend(
    session: Session,
    *,
    generation_id: int,
    lineage: str,
    tests: Mapping[str, Sequence[str]],
    items: Mapping[str, Sequence[str]],
    families: Mapping[str, str] | None = None,
) -> dict[str, int]:
    """Record that generation ``generation_id`` (of ``lineage``) makes each test of ``tests`` (test name ->
    the sha256s of the suites it uses) and return each test's attempt number ``j``: 1 + the largest number,
    over its suites' items, of other generations whose tests of the same budget (non-inferiority and
    retention count together: ``NONINFERIORITY``) used a suite holding that item, plus the lineage's
    generations evaluated before the ledger (``legacy_tests``).

    ``items``: suite sha256 -> its item keys (``pipeline.gates.suites.item_keys``); needed for a suite the ledger has not seen (its
    keys are written once, then read back). ``families``: suite sha256 -> its family, for the samples of a
    ``fresh`` suite (the hash of its declaration); a suite not named is a family of its own. Other samples of
    a suite's own fresh family do not count towards its ``j``: each row records the suite's sample number
    ``e`` in its family (1 + the other samples of the family tested before it; a sample tested before keeps
    its number), and the e-th sample's test spends ``6 / (pi**2 * e**2)`` of the rate (``samples_of``).

    Idempotent per generation: a rerun of the same generation's evaluation gets the numbers it got the first
    time (a suite it did not use then is spent now). The registry's ledger lock is held until the session's
    transaction ends, so two evaluations spending at once get distinct numbers."""
    hold_lock(session=session, key=LEDGER_LOCK)
    gen = session.get(Generation, generation_id)
    if gen is None:
        raise NotFoundError(f"no generation with id {generation_id}: it cannot spend on a suite")
    mine = {
        (row.test, row.suite_sha256): row.attempt
        for row in session.scalars(select(SuiteAttempt).where(SuiteAttempt.generation_id == generation_id))
    }
    _record_items(session, {s for suites in tests.values() for s in suites}, items)
    legacy: int | None = None
    out: dict[str, int] = {}
    for test, suites in sorted(tests.items()):
        wanted = sorted(set(suites))
        if not wanted:
            raise ValueError(f"test {test!r} names no suite to spend on")
        have = [mine[(test, s)] for s in wanted if (test, s) in mine]
        missing = [s for s in wanted if (test, s) not in mine]
        family = {s: (families or {}).get(s, s) for s in missing}
        if missing and legacy is None:
            legacy = legacy_tests(session, lineage=lineage, generation_id=generation_id)
        counts = [
            _tested(session, test=test, suite=s, family=family[s], generation_id=generation_id)
            for s in missing
        ]
        j = max([*have, *(1 + (legacy or 0) + n for n in counts)])
        session.add_all(
            SuiteAttempt(
                suite_sha256=s,
                test=test,
                generation_id=generation_id,
                lineage=lineage,
                generation_number=gen.number,
                contract_version_id=gen.contract_version_id,
                attempt=j,
                family=family[s],
                sample=_sample_number(session, test=test, suite=s, family=family[s]),
            )
            for s in missing
        )
        out[test] = j
    session.flush()
    return out


def _record_items(session: Session, suites: set[str], items: Mapping[str, Sequence[str]]) -> None:
    """Write the item keys of each of ``suites`` the ledger has not seen (once per suite; a suite with no
    items is its own one item, so its tests still count). One query finds the suites seen; the keys go in
    as one Core executemany per suite (the ORM's bulk insert took three times as long)."""
    seen = set(
        session.scalars(
            select(SuiteItem.suite_sha256).where(SuiteItem.suite_sha256.in_(sorted(suites))).distinct()
        )
    )
    for suite in sorted(suites - seen):
        if suite not in items:
            raise ValueError(f"suite {suite[:12]}: the ledger has not seen it and was given no item keys")
        keys = sorted(set(items[suite])) or [suite]
        session.execute(insert(SuiteItem.__table__), [{"suite_sha256": suite, "item_key": k} for k in keys])


def _tested(session: Session, *, test: str, suite: str, family: str, generation_id: int) -> int:
    """The largest number, over ``suite``'s items, of other generations whose tests of ``test``'s budget used
    a suite holding the item; other samples of the suite's own fresh family left out (``family`` != ``suite``:
    they are counted by the sample share)."""
    mine, other = aliased(SuiteItem), aliased(SuiteItem)
    where = [mine.suite_sha256 == suite, _same_budget(test), SuiteAttempt.generation_id != generation_id]
    if family != suite:
        where.append(or_(SuiteAttempt.family != family, SuiteAttempt.suite_sha256 == suite))
    per_item = (
        select(func.count(func.distinct(SuiteAttempt.generation_id)).label("n"))
        .select_from(mine)
        .join(other, other.item_key == mine.item_key)
        .join(SuiteAttempt, SuiteAttempt.suite_sha256 == other.suite_sha256)
        .where(*where)
        .group_by(mine.item_key)
        .subquery()
    )
    return int(session.scalar(select(func.max(per_item.c.n))) or 0)


def legacy_tests(session: Session, *, lineage: str, generation_id: int) -> int:
    """The generations of ``lineage`` (other than ``generation_id``) evaluated before the ledger: a comparison
    but no ``suites`` or ``attempts`` in their evaluation, and no ledger row. Their suites' items were never
    recorded, so each counts as one earlier test on every suite a new evaluation tests (migration 0010)."""
    spent = exists().where(SuiteAttempt.generation_id == Generation.id)
    evaluations = session.scalars(
        select(Generation.evaluation).where(
            Generation.lineage == lineage, Generation.id != generation_id, ~spent
        )
    )
    return sum(
        1
        for ev in evaluations
        if isinstance(ev, dict) and "comparison" in ev and "suites" not in ev and "attempts" not in ev
    )


def _sample_number(session: Session, *, test: str, suite: str, family: str) -> int:
    """The number of sample ``suite`` in ``family`` for ``test``'s budget: the one it got when first tested, or
    1 + the distinct other samples of the family tested before."""
    if family == suite:
        return 1
    same = (_same_budget(test), SuiteAttempt.family == family)
    known = session.scalar(
        select(func.max(SuiteAttempt.sample)).where(*same, SuiteAttempt.suite_sha256 == suite)
    )
    if known is not None:
        return int(known)
    others = session.scalar(
        select(func.count(func.distinct(SuiteAttempt.suite_sha256))).where(
            *same, SuiteAttempt.suite_sha256 != suite
        )
    )
    return 1 + int(others or 0)


def samples_of(session: Session, *, generation_id: int) -> dict[str, int]:
    """Per test a generation spent: the largest sample number ``e`` among its suites (1 unless a suite is the
    e-th fresh sample of its family)."""
    out: dict[str, int] = {}
    for row in attempts_on(session, generation_id=generation_id):
        out[row.test] = max(out.get(row.test, 1), row.sample)
    return out


def attempts_on(
    session: Session,
    *,
    suite_sha256: str | None = None,
    lineage: str | None = None,
    generation_id: int | None = None,
    test: str | None = None,
) -> list[SuiteAttempt]:
    """The ledger's rows, oldest first, filtered by suite, lineage, generation and test (None: any)."""
    query = select(SuiteAttempt).order_by(SuiteAttempt.id)
    for column, value in (
        (SuiteAttempt.suite_sha256, suite_sha256),
        (SuiteAttempt.lineage, lineage),
        (SuiteAttempt.generation_id, generation_id),
        (SuiteAttempt.test, test),
    ):
        if value is not None:
            query = query.where(column == value)
    return list(session.scalars(query))


def spent_on(session: Session, *, generation_id: int) -> dict[str, int]:
    """What ``spend`` returned for a generation (test -> j), read back; empty when it has not spent."""
    out: dict[str, int] = {}
    for row in attempts_on(session, generation_id=generation_id):
        out[row.test] = max(out.get(row.test, 0), row.attempt)
    return out
