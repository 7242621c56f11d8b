"""The spending ledger (issue 23 §1): every test on a held-out suite spends from that suite's error rate,
whatever its champion, lineage or contract version; a fresh sample per champion is a new suite, and every
sample a fresh suite could draw is held out of training."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, init_with_corrections, write_specs
from sqlalchemy import func, select
from test_operator import QUICK, build_until_decide

from pipeline.gates.suites import item_keys
from pipeline.registry import (
    BaseModelRow,
    ContractVersion,
    Generation,
    HarnessVersion,
    SuiteAttempt,
    SuiteItem,
    attempts_on,
    get_engine,
    list_generations,
    make_engine,
    samples_of,
    session_scope,
    spend,
)
from pipeline.registry.ledger import legacy_tests
from pipeline.specs.contract import ContractSpec, load_contract
from pipeline.specs.heldout import heldout_index, resolve_suites, suite_sha256


def _contract(tmp_path: Path, *, fresh: bool = False, size: int = 20) -> ContractSpec:
    data = yaml.safe_load((ROOT / "contracts" / "demo.yaml").read_text())
    data["version"] = "ledger-test"
    for suite in data["heldout"]:
        suite["size"] = size
        suite["fresh"] = fresh
    path = tmp_path / f"contract-{'fresh' if fresh else 'fixed'}.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_contract(path)


def _generations(engine, plan: dict[str, int], *, versions: int = 1) -> dict:
    """Generation rows (no models: the ledger needs none): per lineage of ``plan``, a champion 0 and that many
    rejected candidates, under contract version 1 (and ``versions`` - 1 more versions of the same suites,
    the last lineage's candidates on the newest); ``{(lineage, number): id}``."""
    ids = {}
    with session_scope(engine) as s:
        base = BaseModelRow(name="tiny", content_hash="0" * 64, path="/tiny", spec={})
        harness = HarnessVersion(name="demo", version="1", content_hash="1" * 64, spec={})
        cvs = [
            ContractVersion(name="demo", version=f"v{v}", content_hash=f"{v}" * 64, spec={})
            for v in range(versions)
        ]
        s.add_all([base, harness, *cvs])
        s.flush()
        for k, (lineage, candidates) in enumerate(plan.items()):
            cv = cvs[-1] if k == len(plan) - 1 else cvs[0]
            common = dict(lineage=lineage, base_model_id=base.id, harness_version_id=harness.id)
            champion = Generation(number=0, status="promoted", contract_version_id=cvs[0].id, **common)
            s.add(champion)
            s.flush()
            ids[(lineage, 0)] = champion.id
            for n in range(1, candidates + 1):
                gen = Generation(
                    number=n, status="rejected", parent_id=champion.id, contract_version_id=cv.id, **common
                )
                s.add(gen)
                s.flush()
                ids[(lineage, n)] = gen.id
    return ids


def _use(monkeypatch, url: str) -> None:
    """Make ``url`` the registry that ``get_engine()`` (the evaluation step's) opens."""
    from pipeline.settings import get_settings

    monkeypatch.setenv("RATCHET_DATABASE_URL", url)
    get_settings.cache_clear()


def _keys(*suites: str, shared: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """Item keys of made-up suites: three of each suite's own, plus ``shared`` ones in every suite."""
    return {s: [f"{s[:8]}-{n}" for n in range(3)] + list(shared) for s in suites}


A, B, C = "a" * 64, "b" * 64, "c" * 64
KEYS = _keys(A, B, C)


def test_a_test_counts_every_earlier_generation_on_its_suite_and_a_rerun_spends_nothing(engine):
    ids = _generations(engine, {"main": 4})
    a, b = A, B
    with session_scope(engine) as s:
        first = spend(s, generation_id=ids[("main", 1)], lineage="main", tests={"improvement": [a, b]},
                      items=KEYS)  # fmt: skip
    with session_scope(engine) as s:
        second = spend(
            s, generation_id=ids[("main", 2)], lineage="main", tests={"improvement": [a]}, items=KEYS
        )
        other = spend(s, generation_id=ids[("main", 3)], lineage="main", tests={"noninferiority:chat": [a]},
                      items=KEYS)  # fmt: skip
    assert (
        first == {"improvement": 1} and second == {"improvement": 2} and other == {"noninferiority:chat": 1}
    )
    with session_scope(engine) as s:  # the max over its suites: a has 2 earlier, b has 1
        assert spend(s, generation_id=ids[("main", 4)], lineage="main", tests={"improvement": [b, a]},
                     items=KEYS) == {"improvement": 3}  # fmt: skip
    with session_scope(engine) as s:  # reruns of generation 2's evaluation, after 4 spent: the same j
        again = spend(s, generation_id=ids[("main", 2)], lineage="main", tests={"improvement": [a]}, items={})
        rows = s.scalar(select(func.count()).select_from(SuiteAttempt))
    assert again == {"improvement": 2} and rows == 2 + 1 + 1 + 2
    with session_scope(engine) as s:
        shown = [(r.generation_number, r.test, r.attempt) for r in attempts_on(s, suite_sha256=a)]
        assert shown == [(1, "improvement", 1), (2, "improvement", 2), (3, "noninferiority:chat", 1),
                         (4, "improvement", 3)]  # fmt: skip
        assert all(r.lineage == "main" and r.created_at.tzinfo for r in attempts_on(s, suite_sha256=a))


def test_a_suite_that_became_a_retention_suite_keeps_counting_its_noninferiority_tests(engine):
    """An adopted contract turns a dropped held-out suite into a retention suite: its non-inferiority budget is
    the one its specialist's tests already spent on the same items (not a fresh one)."""
    ids = _generations(engine, {"main": 3})
    a = A
    with session_scope(engine) as s:

        def test(n: int, name: str) -> dict[str, int]:
            return spend(s, generation_id=ids[("main", n)], lineage="main", tests={name: [a]}, items=KEYS)

        first, second = test(1, "noninferiority:chat"), test(2, "noninferiority:chat")
        kept, improvement = test(3, "retention:chat-v3"), test(3, "improvement")
    assert (first, second, kept) == (
        {"noninferiority:chat": 1},
        {"noninferiority:chat": 2},
        {"retention:chat-v3": 3},
    )
    assert improvement == {"improvement": 1}  # its own budget (false_promotion_rate), not non-inferiority's


def _coding(size: int, seed: int = 1234) -> list[dict]:
    """The demo generator's held-out coding items, as a generated suite of that seed and size draws them."""
    from pipeline.specs.tasksource import draw, generator_source

    return draw(generator_source("demo", specialist="coding", options={}), "heldout", size, seed)[0]


def _grouped(items: list[dict]) -> list[dict]:
    return [{**x, "metadata": {**x["metadata"], "group": f"dialogue-{i // 2}"}} for i, x in enumerate(items)]


def _reworded(items: list[dict]) -> list[dict]:
    """Every prompt in capitals with a trailing space and a full-width digit: the same prompts to the
    duplicate check (NFKC, case folding, whitespace), other bytes."""
    out = []
    for x in items:
        messages = [
            {**m, "content": m["content"].upper().replace("1", "\uff11") + " "} for m in x["messages"]
        ]
        out.append({**x, "messages": messages})
    return out


@pytest.mark.parametrize(
    "dodge",
    [
        pytest.param(lambda items: _coding(301), id="one-item-more"),
        pytest.param(lambda items: items[:-1], id="one-item-fewer"),
        pytest.param(_grouped, id="group-metadata-added"),
        pytest.param(_reworded, id="case-whitespace-nfkc"),
    ],
)
def test_a_near_duplicate_suite_continues_the_count_of_the_items_it_shares(engine, dodge):
    """Ten candidates tested on a suite of 300 items; the eleventh on a suite with another hash but (almost)
    the same items -- ``size`` bumped by one, an item dropped, ``metadata.group`` added, prompts re-cased and
    re-spaced -- is the 11th test of those items, not a fresh budget at attempt 1."""
    ids = _generations(engine, {"main": 11})
    old = _coding(300)
    new = dodge(old)
    h_old, h_new = suite_sha256(old), suite_sha256(new)
    assert h_old != h_new and len(set(item_keys(old)) & set(item_keys(new))) >= 280
    tests = lambda h: {"improvement": [h], "noninferiority:coding": [h]}  # noqa: E731
    for n in range(1, 11):
        with session_scope(engine) as s:
            spend(
                s,
                generation_id=ids[("main", n)],
                lineage="main",
                tests=tests(h_old),
                items={h_old: item_keys(old)},
            )
    with session_scope(engine) as s:
        j = spend(
            s,
            generation_id=ids[("main", 11)],
            lineage="main",
            tests=tests(h_new),
            items={h_new: item_keys(new)},
        )
        stored = s.scalar(select(func.count()).select_from(SuiteItem))
    assert j == {"improvement": 11, "noninferiority:coding": 11}
    assert stored == len(set(item_keys(old))) + len(set(item_keys(new))), (
        stored
    )  # once per suite, not per test


def test_a_suite_added_beside_a_kept_one_continues_its_count(registry_url, tmp_path, monkeypatch):
    """A contract version that adds a second chat suite keeps chat's items: its chat suite (both, evaluated
    as one list) continues at the kept items' count, for improvement and chat's non-inferiority alike."""
    from pipeline.loop.evaluation import spend_attempts

    _use(monkeypatch, registry_url)
    old = _contract(tmp_path)
    data = old.model_dump(mode="json")
    data["version"] = "ledger-test-2"
    data["heldout"].append({"specialist": "chat", "generator": "demo", "seed": 99, "size": 5})
    (tmp_path / "v2.yaml").write_text(yaml.safe_dump(data))
    new = load_contract(tmp_path / "v2.yaml")
    engine = make_engine(registry_url)
    try:
        ids = _generations(engine, {"main": 11}, versions=2)
    finally:
        engine.dispose()
    for n, contract in [*((n, old) for n in range(1, 11)), (11, new)]:
        items = resolve_suites(contract, epoch=0)
        hashes = {s: suite_sha256(v) for s, v in items.items()}
        got = spend_attempts(generation_id=ids[("main", n)], lineage="main", suites=hashes, items=items)
    assert len(items["chat"]) == 25 and hashes["chat"] != suite_sha256(resolve_suites(old)["chat"])
    assert got["improvement"] == 11 and got["noninferiority"] == dict.fromkeys(hashes, 11), got


def test_fresh_samples_of_one_family_are_counted_by_their_share_not_against_each_other(engine):
    """Samples of one fresh family may share items: another sample's tests do not count towards a sample's
    ``j`` (its sample number ``e`` spends for them), but a fixed suite holding the same items counts every
    test on them, and a sample tested again counts the fixed suite's tests."""
    ids = _generations(engine, {"main": 5})
    family, s1, s2, fixed = "f" * 64, "1" * 64, "2" * 64, "9" * 64
    keys = _keys(s1, s2, fixed, shared=("shared-item",))
    families = {s1: family, s2: family}

    def test(n: int, suite: str) -> tuple[int, int]:
        with session_scope(engine) as s:
            j = spend(s, generation_id=ids[("main", n)], lineage="main", tests={"improvement": [suite]},
                      items=keys, families=families)["improvement"]  # fmt: skip
            return j, samples_of(s, generation_id=ids[("main", n)])["improvement"]

    assert test(1, s1) == (1, 1) and test(2, s1) == (2, 1)
    assert test(3, s2) == (1, 2)  # a new sample: j restarts, its share is the second sample's
    assert test(4, fixed) == (4, 1)  # not a sample of the family: every earlier test on the shared item
    assert test(5, s2) == (3, 2)  # generation 3 on this sample and 4 on the fixed suite; 1-2 on s1 are not


def test_retention_shares_noninferiority_budget_by_items(registry_url, monkeypatch):
    """A dropped held-out suite kept as a retention suite, its items grouped on the way (another hash): its
    non-inferiority test continues at the count of the held-out suite's non-inferiority tests, through
    ``spend_retention`` as evaluation calls it."""
    from pipeline.gates.retention import spend_retention

    _use(monkeypatch, registry_url)
    engine = make_engine(registry_url)
    try:
        ids = _generations(engine, {"main": 3})
        heldout = _coding(40)
        h = suite_sha256(heldout)
        for n in (1, 2):
            with session_scope(engine) as s:
                spend(s, generation_id=ids[("main", n)], lineage="main", tests={"noninferiority:coding": [h]},
                      items={h: item_keys(heldout, "coding")})  # fmt: skip
    finally:
        engine.dispose()
    kept = _grouped(heldout)
    record = {"coding-v1": {"sha256": suite_sha256(kept), "specialist": "coding"}}
    assert record["coding-v1"]["sha256"] != h
    got = spend_retention(generation_id=ids[("main", 3)], retention=record, items={"coding-v1": kept})
    assert got == {"coding-v1": 3}
    assert spend_retention(generation_id=ids[("main", 3)], retention=record, items={"coding-v1": kept}) == got
    # the same prompts answered by another specialist (the demo's coding-keeps-sums asks chat's sums of the
    # coding adapter) are another test: they spend nothing of coding's held-out budget, nor it of theirs
    other = {"chat-asked": {"sha256": "b" * 64, "specialist": "chat"}}
    assert spend_retention(generation_id=ids[("main", 3)], retention=other, items={"chat-asked": kept}) == {
        "chat-asked": 1
    }


def test_generations_evaluated_before_the_ledger_count_as_earlier_tests(engine):
    """0010 enters no rows for generations evaluated before it: each of the lineage's (a comparison, no
    ``suites``/``attempts``) counts as one earlier test on every suite of every test, so an upgraded
    lineage does not start again at attempt 1. Another lineage's, an unevaluated champion's and a
    ledger-era evaluation's do not."""
    ids = _generations(engine, {"other": 1, "main": 4})
    legacy = {"comparison": {"specialists": {}}, "attempt": 1, "scores": {"chat": 0.5}}
    with session_scope(engine) as s:
        for key, ev in {("main", 1): legacy, ("main", 2): legacy, ("other", 1): legacy,
                        ("main", 0): {"scores": {"chat": 0.4}},
                        ("main", 3): {**legacy, "suites": {"chat": A}, "attempts": {}}}.items():  # fmt: skip
            s.get(Generation, ids[key]).evaluation = ev
    tests = {"improvement": [A], "noninferiority:chat": [A], "retention:kept": [B]}
    with session_scope(engine) as s:
        assert legacy_tests(s, lineage="main", generation_id=ids[("main", 4)]) == 2
        first = spend(s, generation_id=ids[("main", 4)], lineage="main", tests=tests, items=KEYS)
    assert first == {"improvement": 3, "noninferiority:chat": 3, "retention:kept": 3}
    with session_scope(engine) as s:  # a rerun spends nothing; generation 3 counts 4's test too
        assert spend(s, generation_id=ids[("main", 4)], lineage="main", tests=tests, items={}) == first
        assert spend(s, generation_id=ids[("main", 3)], lineage="main", tests={"improvement": [A]},
                     items={}) == {"improvement": 4}  # fmt: skip
        assert spend(s, generation_id=ids[("other", 1)], lineage="other", tests={"improvement": [C]},
                     items=KEYS) == {"improvement": 1}  # fmt: skip


def test_a_suite_the_ledger_has_not_seen_needs_its_items(engine):
    ids = _generations(engine, {"main": 1})
    with pytest.raises(ValueError, match="was given no item keys"), session_scope(engine) as s:
        spend(s, generation_id=ids[("main", 1)], lineage="main", tests={"improvement": [A]}, items={})


def test_a_new_lineage_or_contract_version_on_the_same_suites_continues_the_ledger(
    registry_url, tmp_path, monkeypatch
):
    """Two lineages started on the same contract, the second's candidates under a later contract version
    that kept the suites: the same items are the same suites, and their spending goes on."""
    from pipeline.loop.evaluation import spend_attempts

    _use(monkeypatch, registry_url)
    contract = _contract(tmp_path)
    suites = {s: suite_sha256(items) for s, items in resolve_suites(contract, epoch=0).items()}
    assert suites == {s: suite_sha256(items) for s, items in resolve_suites(contract, epoch=5).items()}
    assert len(set(suites.values())) == 4  # one suite per specialist
    engine = make_engine(registry_url)
    try:
        ids = _generations(engine, {"main": 2, "second": 2}, versions=2)
    finally:
        engine.dispose()
    items = resolve_suites(contract, epoch=0)
    seen = [spend_attempts(generation_id=ids[(lin, n)], lineage=lin, suites=suites, items=items)
            for lin, n in (("main", 1), ("main", 2), ("second", 1), ("second", 2))]  # fmt: skip
    assert [a["improvement"] for a in seen] == [1, 2, 3, 4]
    assert seen[2]["noninferiority"] == dict.fromkeys(suites, 3)
    only_chat = spend_attempts(
        generation_id=ids[("second", 0)], lineage="second", suites={"chat": suites["chat"]}, items=items
    )
    assert only_chat == {"improvement": 5, "improvement_sample": None, "noninferiority": {"chat": 5}}


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def test_concurrent_evaluations_get_distinct_attempts(backend, tmp_path, request):
    """Eight evaluations spending on one suite at the same instant, each in its own connection: 1 to 8, each
    once (without the ledger's lock two read the same count and both test at attempt 1's rate)."""
    from pipeline.registry import upgrade_db

    url = (
        f"sqlite:///{tmp_path / 'race.db'}"
        if backend == "sqlite"
        else request.getfixturevalue("postgres_url")
    )
    upgrade_db(url)
    engine = make_engine(url)
    try:
        ids = _generations(engine, {"main": 8})
        start, got, errors = threading.Barrier(8), {}, []

        def evaluation(n: int) -> None:
            try:
                start.wait()
                with session_scope(engine) as s:
                    got[n] = spend(s, generation_id=ids[("main", n)], lineage="main",
                                   tests={"improvement": [C]}, items=KEYS)["improvement"]  # fmt: skip
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=evaluation, args=(n,)) for n in range(1, 9)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        engine.dispose()
    assert errors == [] and sorted(got.values()) == list(range(1, 9)), (got, errors)


def test_a_fresh_suite_is_a_new_sample_and_a_new_suite_for_each_champion(tmp_path):
    """A fresh suite draws per champion (seed and champion's generation number): the same sample every time
    against the same champion, another for another champion, so its ledger starts again at 1."""
    from pipeline.loop.evaluation import spend_attempts

    contract = _contract(tmp_path, fresh=True)
    ids = _generations(get_engine(), {"main": 4})
    from pipeline.loop.evaluation import suite_families

    # two candidates against 0, one against 3, one against 5: attempt j restarts on each new sample (whatever
    # items it shares with the earlier ones), which is sample 2, 3 of the suites' family, so the improvement
    # test's rate is still spent lineage-wide (6/(pi^2 e^2) of it)
    for epoch, n, j, e in ((0, 1, 1, 1), (0, 2, 2, 1), (3, 3, 1, 2), (5, 4, 1, 3)):
        drawn = resolve_suites(contract, epoch=epoch)
        hashes = {s: suite_sha256(items) for s, items in drawn.items()}
        families = suite_families(contract, hashes)
        assert len(set(families.values())) == 4  # one family per specialist, whatever the sample
        spent = spend_attempts(
            generation_id=ids[("main", n)], lineage="main", suites=hashes, items=drawn, families=families
        )
        assert (spent["improvement"], spent["improvement_sample"]) == (j, e)
    share = 6 / 3.14159265358979**2
    assert contract.promotion.attempt_rate(1) == pytest.approx(0.05 * share)  # fixed suites: as before
    assert contract.promotion.attempt_rate(3, 2) == pytest.approx(0.05 * share / 9 * share / 4)
    epoch0, again, epoch3 = (resolve_suites(contract, epoch=e) for e in (0, 0, 3))
    assert epoch0 == again and {s: len(v) for s, v in epoch3.items()} == dict.fromkeys(epoch0, 20)
    for s in epoch0:
        assert suite_sha256(epoch0[s]) != suite_sha256(epoch3[s])
        keys = {item["metadata"]["task_id"] for item in epoch0[s]}
        assert len(keys & {item["metadata"]["task_id"] for item in epoch3[s]}) < 10  # mostly other items
    fixed = _contract(tmp_path, fresh=False)
    assert resolve_suites(fixed, epoch=0) == resolve_suites(fixed, epoch=3) == resolve_suites(fixed)


def test_every_sample_a_fresh_suite_could_draw_is_held_out_of_training(tmp_path):
    """The exclusion predicate of a fresh contract holds out the whole held-out split: every item of the
    samples of 30 champions, and every held-out problem of the demo in every family and wording; training
    items stay learnable."""
    from pipeline.environment import FAMILIES, make_item, sample_prompts
    from pipeline.environment.tasks import _pairs

    contract = _contract(tmp_path, fresh=True)
    index = heldout_index(contract)
    for epoch in range(30):
        for items in resolve_suites(contract, epoch=epoch).values():
            for item in items:
                assert index.exclusion(messages=item["messages"]) is not None, item
    for a, b in _pairs("heldout"):
        for family in FAMILIES:
            for variant in (0, 1, 5):
                item = make_item(family, a, b, variant=variant)
                assert index.exclusion(messages=item["messages"]) is not None, item["messages"]
    for family in FAMILIES:
        for item in sample_prompts(family, 50, seed=7):
            assert index.exclusion(messages=item["messages"], metadata=item["metadata"]) is None


def test_retention_items_are_held_out_of_training_and_not_evaluated_as_held_out(tmp_path):
    """A retention suite is never trained on (the exclusion predicate holds its items out) and is resolved
    apart from the held-out suites (``resolve_retention``, by name)."""
    from pipeline.specs.heldout import resolve_retention

    data = yaml.safe_load((ROOT / "contracts" / "demo.yaml").read_text())
    data["version"] = "retention-test"
    # fixed held-out suites: a fresh one would hold out its whole split, the retention items among them
    data["heldout"] = [{**h, "size": 20, "fresh": False} for h in data["heldout"]]
    data["retention"] = [{"name": "sums-as-widgets", "specialist": "chat", "generator": "demo",
                          "options": {"family": "genui"}, "seed": 99, "size": 40}]  # fmt: skip
    path = tmp_path / "retention.yaml"
    path.write_text(yaml.safe_dump(data))
    contract = load_contract(path)
    kept = resolve_retention(contract)
    assert list(kept) == ["sums-as-widgets"] and len(kept["sums-as-widgets"]) == 40
    heldout = resolve_suites(contract)
    assert {s: len(v) for s, v in heldout.items()} == dict.fromkeys(("chat", "agent", "coding", "genui"), 20)
    held = {item["metadata"]["task_id"] for items in heldout.values() for item in items}
    assert not held & {item["metadata"]["task_id"] for item in kept["sums-as-widgets"]}
    index = heldout_index(contract)
    for item in kept["sums-as-widgets"]:
        why = index.exclusion(messages=item["messages"])
        assert why is not None and "retention sums-as-widgets" in why, (item["messages"], why)


def test_fresh_is_refused_for_a_generator_without_a_canonical_form(tmp_path, monkeypatch):
    """Without a canonical form no finite index says whether a conversation poses one of the held-out
    problems a fresh suite could draw: `ratchet contract lint` (and init) refuse it in one line."""
    from pipeline.cli.contract import lint_file
    from pipeline.specs.tasksource import BUILT_IN

    class Plain:  # a task source with no `canonical`
        def __init__(self, *, specialist: str):
            self.specialist = specialist

        def items(self, split: str, n: int, seed: int) -> list[dict]:
            return [{"messages": [{"role": "user", "content": f"question {split} {seed} {i}"}], "metadata": {}}
                    for i in range(min(n, 50))]  # fmt: skip

    monkeypatch.setitem(BUILT_IN, "plain", Plain)
    data = yaml.safe_load((ROOT / "contracts" / "demo.yaml").read_text())
    data["heldout"] = [{"specialist": s, "generator": "plain", "seed": 1, "size": 20, "fresh": True}
                       for s in ("chat", "agent", "coding", "genui")]  # fmt: skip
    path = tmp_path / "plain.yaml"
    path.write_text(yaml.safe_dump(data))
    issues, _, _ = lint_file(path)
    assert len(issues) == 1 and "`fresh: true` needs a task generator with a canonical form" in issues[0]
    data["heldout"] = [{**h, "fresh": False} for h in data["heldout"]]
    path.write_text(yaml.safe_dump(data))
    assert lint_file(path)[0] == []


# ---- through `ratchet advance` ---------------------------------------------------------------------------------
def test_a_manual_promote_of_a_rejected_candidate_does_not_reset_spending(small_base, tmp_path, capsys):
    """Generation 1 is rejected (the contract asks for an impossible gain); the operator promotes it by hand.
    Generation 2 is built from it and evaluated on the same suites: its improvement test is attempt 2, not
    1 (before the ledger, the count restarted with every new parent). Re-running its evaluation spends
    nothing more."""
    from pipeline.cli import main
    from pipeline.loop.advance import advance_once
    from pipeline.loop.evaluation import evaluate_step

    specs = write_specs(tmp_path, small_base)
    data = yaml.safe_load(specs["contract"].read_text())
    data["promotion"]["min_improvement"] = 0.99
    # fixed suites: the same items under the new champion (a fresh suite's new sample spends by its share,
    # test_a_fresh_suite_is_a_new_sample_and_a_new_suite_for_each_champion)
    data["heldout"] = [{**h, "fresh": False} for h in data["heldout"]]
    specs["contract"].write_text(yaml.safe_dump(data))
    init_with_corrections(specs, tmp_path)
    first = advance_once(config=QUICK)
    assert first["status"] == "rejected" and first["generation"] == 1, first
    main(["promote", "1", "--reason", "I like it"])
    assert "generation 1 is now the champion" in capsys.readouterr().out
    second = build_until_decide()
    with session_scope(get_engine()) as s:
        one, two = list_generations(session=s)[1:3]
        assert two.parent_id == one.id and one.status == "promoted"
        assert one.evaluation["attempt"] == 1 and two.evaluation["attempt"] == 2
        assert two.evaluation["attempts"]["noninferiority"] == dict.fromkeys(two.evaluation["suites"], 2)
        assert two.evaluation["suites"] == one.evaluation["suites"]
        rows = len(attempts_on(s))
    again = evaluate_step(generation_id=second, config=QUICK)
    with session_scope(get_engine()) as s:
        assert again["attempts"] == two.evaluation["attempts"] and len(attempts_on(s)) == rows


def test_the_same_items_in_another_order_are_the_same_suite(tmp_path):
    """Reordering a suite's file is no new suite: it would otherwise restart the ledger on the same items."""
    items = resolve_suites(_contract(tmp_path), epoch=0)["chat"]
    assert suite_sha256(items[::-1]) == suite_sha256(items)
    assert suite_sha256(items[1:]) != suite_sha256(items)  # other items: another suite
