"""An operator's decision stands (issue 22 §3): `ratchet abandon` fails the candidate in flight (audited, an
evaluated one still counted as an attempt) and the next advance starts anew; a rollback made while a candidate
is being built is not undone by that candidate's decision."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import ROOT, write_specs
from sqlalchemy import select

from pipeline.loop.advance import advance_once, begin_candidate, release_candidate, run_steps
from pipeline.loop.candidate import STEPS, AdvanceConfig, load_generation, mark_step
from pipeline.registry import (
    AuditLog,
    create_generation,
    get_champion,
    get_engine,
    list_generations,
    promote_generation,
    rollback_champion,
    session_scope,
)

# Learns from the ingested corrections only (no practice, no co-design): the quickest whole generation.
QUICK = AdvanceConfig(prompts_per_specialist=4, samples_per_prompt=1, min_examples=2, validation_items=4,
                      seed=1, collect=False, codesign=False)  # fmt: skip


def build_until_decide(config: AdvanceConfig = QUICK) -> int:
    """Build the lineage's candidate through its evaluation, as `ratchet advance` does, and stop before
    deciding (the lease given back, as a run that stopped there leaves it); its generation id."""
    generation_id = begin_candidate(config=config, owner="test-run")
    try:
        run_steps(STEPS[:-1], generation_id=generation_id, config=config)
    finally:
        release_candidate(generation_id=generation_id, owner="test-run")
    return generation_id


def audit_rows(action: str) -> list[tuple[str, int | None, str | None, dict]]:
    with session_scope(get_engine()) as s:
        rows = s.execute(
            select(AuditLog.actor, AuditLog.entity_id, AuditLog.message, AuditLog.details)
            .where(AuditLog.action == action)
            .order_by(AuditLog.id)
        ).all()
    return [tuple(r) for r in rows]


def test_abandon_fails_the_candidate_counts_its_attempt_and_the_next_advance_starts_anew(lineage, capsys):
    from pipeline.cli import main

    with pytest.raises(SystemExit) as exc:  # nothing in flight yet: one line, non-zero
        main(["abandon", "--reason", "nothing"])
    assert exc.value.code == 1 and "no candidate in flight" in capsys.readouterr().err
    first = build_until_decide()  # generation 1, evaluated: its comparison was made
    main(["abandon", "--reason", "the chat data was poisoned"])
    out = capsys.readouterr().out
    assert "generation 1 of 'main' is abandoned" in out and "evaluate" in out
    with session_scope(get_engine()) as s:
        gen = list_generations(session=s)[1]
        assert (gen.id, gen.status, gen.lease_owner) == (first, "failed", None)
        assert gen.decision == "abandoned by cli: the chat data was poisoned"
        assert gen.evaluation["attempt"] == 1
    ((actor, entity, message, details),) = audit_rows("abandon")
    assert (actor, entity, message) == ("cli", first, "the chat data was poisoned")
    assert details["from"] == "evaluating" and details["evaluated"] is True
    outcome = advance_once(config=QUICK)  # the next advance proceeds, with a new candidate
    assert outcome["generation"] == 2 and outcome["status"] in ("promoted", "rejected"), outcome
    with session_scope(get_engine()) as s:
        second = list_generations(session=s)[2]
        assert second.parent_id == gen.parent_id
        # attempt 2 against generation 0: the abandoned candidate's test was spent (alpha spending)
        assert second.evaluation["attempt"] == 2 and "attempt 2 on its held-out suites" in second.decision


def test_abandon_stops_a_run_still_building_the_candidate(lineage):
    """A run that holds the lease when the operator abandons its candidate stops at its next write."""
    from pipeline.loop.lease import Lease, LeaseLostError
    from pipeline.registry.generations import abandon_generation

    generation_id = begin_candidate(config=QUICK, owner="stuck-run")
    lease = Lease(generation_id, "stuck-run", QUICK.lease_seconds, get_engine()).start()
    try:
        with session_scope(get_engine()) as s:
            s.info["lease"] = True  # the operator's transaction (another process in life: not fenced)
            abandon_generation(session=s, reason="stuck on a bad row", actor="cli")
        with pytest.raises(LeaseLostError), session_scope(get_engine()) as s:
            mark_step(s, load_generation(s, generation_id), "discover", {})
    finally:
        lease.stop()
    assert begin_candidate(config=QUICK, owner="next-run") != generation_id  # a new candidate


def wrecked_adapter(base_dir: Path, name: str) -> tuple[Path, list[str]]:
    """A LoRA adapter of random, large weights on the base (its answers are noise), in the artifact store."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from pipeline.settings import get_settings

    modules = ["q_proj", "v_proj", "up_proj", "down_proj"]
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), LoraConfig(r=4, lora_alpha=8,
                                                                                      target_modules=modules))  # fmt: skip
    torch.manual_seed(0)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "lora_" in param_name:
                param.normal_(0.0, 2.0)
    out = get_settings().artifacts_dir / f"wrecked-{name}"
    model.save_pretrained(out)
    return out, modules


def test_a_rollback_during_evaluation_is_not_undone_by_the_decision(small_base, tmp_path):
    """Generation 2 is built from generation 1 and clearly beats it; the operator rolls back to generation 0
    before it is decided: the decision must not promote 2 over 0, which it was never compared with."""
    import yaml

    from pipeline.loop.evaluation import evaluate_step
    from pipeline.loop.founding import init_lineage
    from pipeline.registry import create_adapter, set_generation_adapter
    from pipeline.specs.loading import file_sha256

    specs = write_specs(tmp_path, small_base, heldout_size=40)
    contract = yaml.safe_load(specs["contract"].read_text())  # lenient gates: any gain promotes (the decision
    contract["promotion"].update(false_promotion_rate=0.45, regression_error_rate=0.45, max_regression=1.0)
    specs["contract"].write_text(yaml.safe_dump(contract))  # is about the parent here, not the statistics)
    init_lineage(contract_path=specs["contract"], harness_path=ROOT / "harnesses" / "demo.yaml",
                 model_path=specs["model"])  # fmt: skip
    with session_scope(get_engine()) as s:  # generation 1: wrecked adapters, made champion by an operator
        zero = get_champion(session=s)
        adapters = {}
        for slot in zero.adapters:
            path, modules = wrecked_adapter(small_base, slot.specialist)
            adapters[slot.specialist] = create_adapter(
                session=s, specialist=slot.specialist, base_model_id=zero.base_model_id, rank=4, alpha=8,
                target_modules=modules, artifact_uri=str(path), sha256=file_sha256(path / "adapter_model.safetensors"),
            ).id  # fmt: skip
        one = create_generation(
            session=s,
            base_model_id=zero.base_model_id,
            harness_version_id=zero.harness_version_id,
            contract_version_id=zero.contract_version_id,
            specialists=list(adapters),
            adapters=adapters,
            parent_id=zero.id,
            state={"steps": {}},
        )
        promote_generation(session=s, generation=one, reason="manual: test", actor="test")
    two = begin_candidate(config=QUICK, owner="test-run")  # generation 2, built from generation 1 ...
    with session_scope(get_engine()) as s:  # ... by hand: the bare base again (no adapters), clearly better
        gen = load_generation(s, two)
        for slot in list(gen.adapters):
            set_generation_adapter(session=s, generation=gen, specialist=slot.specialist, adapter_id=None)
        for step in STEPS[: STEPS.index("evaluate")]:
            mark_step(s, gen, step, {"skipped": "test builds the candidate by hand"})
    release_candidate(generation_id=two, owner="test-run")
    evaluation = evaluate_step(generation_id=two, config=QUICK)  # compared with generation 1, its parent
    assert evaluation["comparison"]["delta"] > 0, evaluation["comparison"]
    with session_scope(get_engine()) as s:
        assert rollback_champion(session=s, actor="operator").number == 0
    outcome = advance_once(config=QUICK)  # resumes generation 2: only its decision is left
    assert outcome["generation"] == 2 and outcome["status"] == "rejected", outcome
    assert "its parent is no longer the champion" in outcome["decision"]
    with session_scope(get_engine()) as s:
        assert get_champion(session=s).number == 0  # the operator's champion
    assert any(e == two and "its parent is no longer the champion" in (m or "") for _, e, m, _ in
               audit_rows("status"))  # fmt: skip
