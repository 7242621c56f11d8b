"""`ratchet contract adopt`: a lineage moves to a new version of its contract without starting over."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, run_cli
from sqlalchemy import select

from pipeline.loop.candidate import AdvanceConfig
from pipeline.registry import (
    AuditLog,
    ContractVersion,
    Experience,
    Generation,
    Score,
    get_champion,
    get_engine,
    session_scope,
)

# No practice and no co-design: the candidate learns from the ingested corrections only (seconds).
FAST = AdvanceConfig(prompts_per_specialist=12, samples_per_prompt=2, min_examples=2, validation_items=4,
                     collect=False, discover=False, codesign=False, seed=1)  # fmt: skip


def new_version(specs: dict[str, Path], tmp: Path, *, name: str = "v2", **changes) -> Path:
    """The lineage's contract file with ``changes`` applied to its YAML data, written as ``name``.yaml."""
    data = yaml.safe_load(specs["contract"].read_text())
    data["version"] = "test2"
    for key, value in changes.items():
        data[key] = value(data) if callable(value) else value
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def changed_and_dropped(data: dict) -> list[dict]:
    """chat's suite drawn with another seed, genui's dropped (genui is then ``ungated: true``)."""
    suites = [dict(s) for s in data["heldout"] if s["specialist"] != "genui"]
    next(s for s in suites if s["specialist"] == "chat")["seed"] = 4321
    data["specialists"]["genui"]["ungated"] = True
    return suites


def _scores(cv_id: int) -> dict[tuple[int, str], float | None]:
    with session_scope(get_engine()) as s:
        rows = s.execute(
            select(Score.experience_id, Score.scorer, Score.value).where(Score.contract_version_id == cv_id)
        ).all()
    return {(e, k): v for e, k, v in rows}


def _build_by_hand(config: AdvanceConfig) -> int:
    """A candidate with the champion's adapters, every step before evaluation marked done (no training)."""
    from pipeline.loop.advance import begin_candidate, release_candidate
    from pipeline.loop.candidate import load_generation, mark_step

    gen_id = begin_candidate(config=config, owner="test")
    with session_scope(get_engine()) as s:
        gen = load_generation(s, gen_id)
        for step in ("discover", "collect", "score", "curate", "train", "codesign"):
            mark_step(s, gen, step, {"skipped": "built by hand: the champion's own adapters"})
    release_candidate(generation_id=gen_id, owner="test")
    return gen_id


def test_adopt_moves_the_lineage_and_the_next_advance_is_judged_under_it(lineage, tmp_path, capsys):
    """One suite changed (chat), one dropped (genui): the old ones become retention suites, experience is
    scored under the new version with the old scores kept, the champion is re-evaluated and moves (audited),
    served traffic stays the lineage's, and the next advance is judged under the new version with the
    spending ledger continued on the suites kept."""
    from pipeline.environment import reference_answer, sample_prompts
    from pipeline.experience.eligibility import lineage_candidates
    from pipeline.loop.advance import advance_once
    from pipeline.loop.evaluation import evaluate_step
    from pipeline.loop.promotion import decide_step
    from pipeline.specs.contract import load_contract, stored_contract
    from pipeline.specs.loading import content_hash

    # before: one candidate evaluated (and rejected) under the old version, which spends on all four suites
    earlier = _build_by_hand(FAST)
    evaluate_step(generation_id=earlier, config=FAST)
    decided = decide_step(generation_id=earlier, config=FAST)
    assert decided["status"] == "rejected"  # the champion's own adapters: no gain
    # served traffic of the champion (``ratchet ingest`` attributes it to the champion)
    served = tmp_path / "served.jsonl"
    item = sample_prompts("chat", 1, seed=5)[0]
    trace = {"messages": [*item["messages"], {"role": "assistant", "content": "?"}], "metadata": item["metadata"],
             "feedback": {"rating": 1, "correction": reference_answer(item)}}  # fmt: skip
    served.write_text(json.dumps(trace) + "\n")
    assert run_cli(["ingest", str(served), "--source", "deployment"]) == 0
    with session_scope(get_engine()) as s:
        champion = get_champion(session=s)
        old_id, champion_id, before = champion.contract_version_id, champion.id, dict(champion.evaluation)
        served_id = s.scalar(select(Experience.id).where(Experience.generation_id == champion_id))
    from pipeline.scoring import score_experience

    with session_scope(get_engine()) as s:  # every trace scored under the old version first
        score_experience(session=s, contract_version_id=old_id)
    old_scores = _scores(old_id)
    capsys.readouterr()

    path = new_version(lineage, tmp_path, heldout=changed_and_dropped)
    assert (
        run_cli(["contract", "adopt", str(path), "--lineage", "main", "--reason", "chat suite redrawn"]) == 0
    )
    out = capsys.readouterr().out
    file_hash = content_hash(load_contract(path))
    with session_scope(get_engine()) as s:
        cv = s.scalar(select(ContractVersion).where(ContractVersion.version == "test2"))
        stored, new_id = stored_contract(cv.spec), cv.id
        champion = s.get(Generation, champion_id)
        event = s.scalar(select(AuditLog).where(AuditLog.action == "adopt"))
        gens = {g.number: g.contract_version_id for g in s.scalars(select(Generation))}
        served_gen = s.scalar(select(Experience.generation_id).where(Experience.id == served_id))
        candidates, _ = lineage_candidates(s, champion, stored)
        after = dict(champion.evaluation)
    # the stored version: the file plus the dropped and the changed suite as retention suites
    own = {r.name for r in load_contract(lineage["contract"]).retention}  # the file's own retention suites
    retention = {r.name: r for r in stored.retention if r.name not in own}
    assert set(retention) == {"chat-vtest", "genui-vtest"}
    assert own <= {r.name for r in stored.retention}  # carried over
    assert (retention["genui-vtest"].generator, retention["genui-vtest"].seed, retention["genui-vtest"].size) == (
        "demo", 1234, 20)  # fmt: skip
    assert retention["chat-vtest"].seed == 1234 and retention["chat-vtest"].specialist == "chat"
    old_gates = load_contract(lineage["contract"]).promotion
    assert retention["genui-vtest"].max_regression == old_gates.tolerance("genui")
    assert retention["genui-vtest"].error_rate == old_gates.regression_error_rate
    assert [h.specialist for h in stored.heldout] == ["chat", "agent", "coding"]
    # both hashes where a user sees them: the command's output and the audited event
    assert cv.content_hash != file_hash and cv.content_hash == content_hash(stored)
    assert f"file {file_hash[:12]}, stored {cv.content_hash[:12]}" in out
    assert "became retention suites: chat-vtest, genui-vtest" in out
    assert "kept (their spending continues): agent, coding" in out
    assert event.actor == "cli" and event.message == "chat suite redrawn" and event.entity_id == champion_id
    assert (event.details["file_sha256"], event.details["stored_sha256"]) == (file_hash, cv.content_hash)
    # the champion moved; the candidate judged before keeps its version
    assert gens == {0: new_id, 1: old_id}
    # re-evaluated: the new suites' scores where `ratchet lineage` reads them, the old ones kept
    assert set(after["scores"]) == {"chat", "agent", "coding"}
    assert after["adoptions"][0]["previous_scores"] == before["scores"]
    assert set(after["adoptions"][0]["retention"]) == {"chat-vtest", "genui-vtest"} | own
    for unchanged in ("agent", "coding"):  # the same items, the same greedy champion: the same scores
        assert after["scores"][unchanged] == pytest.approx(before["scores"][unchanged], abs=1e-6)
    # experience scored under the new version; the old version's scores untouched
    new_scores = _scores(new_id)
    with session_scope(get_engine()) as s:
        traces = set(s.scalars(select(Experience.id)))
    assert {e for e, k in new_scores if k == "final"} == traces
    assert _scores(old_id) == old_scores
    # the served trace is still the lineage's, and curation under the new version finds it
    assert served_gen == champion_id and served_id in {c.experience_id for c in candidates}

    capsys.readouterr()
    outcome = advance_once(config=FAST)
    with session_scope(get_engine()) as s:
        gen = s.scalar(select(Generation).where(Generation.number == outcome["generation"]))
        ev, judged_under = gen.evaluation, gen.contract_version_id
    assert outcome["generation"] == 2 and judged_under == new_id
    assert (
        set(ev["items"]) == {"chat", "agent", "coding"}
        and set(ev.get("retention") or {}) == set(retention) | own
    )
    # the ledger continues on the items kept (gen 1 tested them): per item, so the redrawn chat suite continues
    # too where it shares an item with the old sample
    attempts = ev["attempts"]
    assert attempts["improvement"] == 2
    assert attempts["noninferiority"] == {"chat": 2, "agent": 2, "coding": 2}
    # the dropped suites become retention suites at their declared seed's sample, not the fresh samples gen 1
    # was judged on: their items were not tested by chat or genui before, so their count starts at 1 (items a
    # specialist was tested on before continue their count: tests/test_ledger.py)
    assert {k: v for k, v in attempts["retention"].items() if k in retention} == {
        "chat-vtest": 1,
        "genui-vtest": 1,
    }
    # the lineage's files can still be given to `ratchet init` again (generation 0 moved to the new version)
    from pipeline.loop.founding import init_lineage

    init_lineage(contract_path=lineage["contract"], harness_path=ROOT / "harnesses" / "demo.yaml",
                 model_path=lineage["model"])  # fmt: skip


def test_adopt_refuses_with_one_line(lineage, tmp_path, capsys):
    """Another contract's name, the version the lineage is on, a specialist left without a suite or
    `ungated: true`, a candidate in flight: each refused with one line, nothing moved."""
    other = new_version(lineage, tmp_path, name="other")
    data = yaml.safe_load(other.read_text())
    data["name"] = "elsewhere"
    other.write_text(yaml.safe_dump(data))
    same = tmp_path / "same.yaml"
    same.write_text(lineage["contract"].read_text())
    ungated = new_version(
        lineage,
        tmp_path,
        name="ungated",
        heldout=lambda d: [s for s in d["heldout"] if s["specialist"] != "genui"],
    )
    cases = [
        (other, "is not lineage 'main''s contract 'demo'"),
        (same, "is already on demo version 'test'"),
        (ungated, "specialists.genui: no held-out suite judges it"),
    ]
    for path, message in cases:
        assert run_cli(["contract", "adopt", str(path)]) == 1
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    good = new_version(lineage, tmp_path, heldout=changed_and_dropped)
    assert run_cli(["contract", "adopt", str(good), "--lineage", "nowhere"]) == 1
    assert "lineage 'nowhere' has no champion" in capsys.readouterr().err
    assert run_cli(["contract", "adopt", str(good), "--release", "nothing"]) == 1
    assert "--release nothing: contract demo test has no such retention suite" in capsys.readouterr().err
    _build_by_hand(FAST)
    assert run_cli(["contract", "adopt", str(good)]) == 1
    assert "generation 1 of lineage 'main' is candidate" in capsys.readouterr().err
    with session_scope(get_engine()) as s:
        assert s.scalar(select(ContractVersion).where(ContractVersion.version == "test2")) is None
        assert get_champion(session=s).contract_version.version == "test"
        assert s.scalar(select(AuditLog).where(AuditLog.action == "adopt")) is None


def test_carried_suites_keep_what_the_old_version_measured():
    """Kept suites stay held-out; a changed or dropped one becomes `<specialist>-v<old version>` with the old
    tolerance and error rate (a file suite by its sha256); an old retention suite is carried unless released;
    names never collide."""
    from pipeline.loop.adoption import adopted_spec, carried_suites
    from pipeline.specs.contract import ContractSpec

    root = Path(__file__).resolve().parent.parent
    data = yaml.safe_load((root / "contracts" / "demo.yaml").read_text())
    data["version"] = "3 beta"
    data["heldout"] = [{**h, "size": 300, "fresh": False} for h in data["heldout"]]
    data["promotion"]["max_regression_per_specialist"] = {"agent": 0.01}
    data["heldout"].append({"specialist": "chat", "path": "suites/chat.jsonl", "sha256": "a" * 64})
    data["retention"] = [{"name": "forgotten", "specialist": "chat", "generator": "demo", "seed": 5, "size": 10,
                          "options": {"family": "coding"}, "scored_as": "coding"}]  # fmt: skip
    old = ContractSpec.model_validate(data)
    new_data = json.loads(json.dumps(data))
    new_data["version"] = "4"
    new_data["heldout"] = [
        {"specialist": "chat", "generator": "demo", "seed": 1234, "size": 300},  # kept
        {"specialist": "agent", "generator": "demo", "seed": 99, "size": 300},  # changed
        {"specialist": "coding", "generator": "demo", "seed": 1234, "size": 300},  # kept
        # genui dropped; the chat file suite dropped
    ]
    new_data["specialists"]["genui"]["ungated"] = True
    new_data["retention"] = [
        {"name": "agent-v3-beta", "specialist": "chat", "generator": "demo", "seed": 1, "size": 5}
    ]  # fmt: skip  (a user's suite that takes the generated name)
    new = ContractSpec.model_validate(new_data)

    carried, kept, released = carried_suites(old, new)
    assert kept == ["chat", "coding"] and released == []
    by_name = {r.name: r for r in carried}
    assert list(by_name) == ["agent-v3-beta-2", "genui-v3-beta", "chat-v3-beta", "forgotten"]
    assert by_name["agent-v3-beta-2"].max_regression == 0.01  # the old per-specialist tolerance
    assert by_name["genui-v3-beta"].max_regression == old.promotion.max_regression
    assert by_name["genui-v3-beta"].error_rate == old.promotion.regression_error_rate
    assert (by_name["chat-v3-beta"].sha256, by_name["chat-v3-beta"].generator) == ("a" * 64, None)
    assert by_name["forgotten"].scored_as == "coding"

    stored, *_ = adopted_spec(old, new, release=["forgotten"])
    assert [r.name for r in stored.retention] == [
        "agent-v3-beta",
        "agent-v3-beta-2",
        "genui-v3-beta",
        "chat-v3-beta",
    ]
    again, kept_again, _ = carried_suites(stored, stored.model_copy(update={"version": "5"}))
    assert again == [] and kept_again == ["chat", "agent", "coding"]  # nothing dropped: nothing added


def test_adopt_refuses_a_raised_error_rate(lineage, tmp_path, capsys):
    """The ledger counts the tests made on each suite, not the rates they spent: a version that raises
    `false_promotion_rate`, `regression_error_rate`, or the error rate of a retention suite it keeps (by name
    or by items) would spend more than the budget stated, and is refused with one line, nothing moved;
    lowering a rate is fine."""

    def promotion(**rates):
        return lambda d: {**d["promotion"], **rates}

    def renamed(rate):  # the demo's retention suite under another name: the same items
        return lambda d: [{**d["retention"][0], "name": "keeps-sums", "error_rate": rate}]

    cases = [
        (new_version(lineage, tmp_path, name="fpr", promotion=promotion(false_promotion_rate=0.1)),
         "promotion.false_promotion_rate 0.1 is above 0.05"),
        (new_version(lineage, tmp_path, name="ret", retention=renamed(0.08)),
         "retention[0] (keeps-sums): error_rate 0.08 is above the 0.05 its items were tested at"),
    ]  # fmt: skip
    for path, message in cases:
        assert run_cli(["contract", "adopt", str(path)]) == 1
        err = capsys.readouterr().err
        assert message in err and "not raised" in err and err.count("\n") == 1, err
    with session_scope(get_engine()) as s:
        assert s.scalar(select(ContractVersion).where(ContractVersion.version == "test2")) is None
        assert s.scalar(select(AuditLog).where(AuditLog.action == "adopt")) is None

    from pipeline.loop.adoption import raised_rates
    from pipeline.specs.contract import load_contract

    old = load_contract(lineage["contract"])
    lower = new_version(lineage, tmp_path, name="lower", retention=renamed(0.01),
                        promotion=promotion(false_promotion_rate=0.01, regression_error_rate=0.01))  # fmt: skip
    assert raised_rates(old, load_contract(lower)) == []
    nie = new_version(lineage, tmp_path, name="nie", promotion=promotion(regression_error_rate=0.2))
    assert raised_rates(old, load_contract(nie)) == ["promotion.regression_error_rate 0.2 is above 0.05"]
    # a held-out suite of the old version kept as a retention suite: its non-inferiority tests ran at 0.05
    chat = next(h for h in old.model_dump(mode="json")["heldout"] if h["specialist"] == "chat")
    kept = {k: chat[k] for k in ("specialist", "generator", "options", "seed", "size")}
    moved = new_version(lineage, tmp_path, name="moved",
                        retention=[{"name": "chat-sums", **kept, "error_rate": 0.1}])  # fmt: skip
    assert raised_rates(old, load_contract(moved)) == [
        "retention[0] (chat-sums): error_rate 0.1 is above the 0.05 its items were tested at"
    ]
