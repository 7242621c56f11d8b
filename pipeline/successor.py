"""Building the successor: train one LoRA per specialist, then co-design the harness around the new adapters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.advance import (
    AdvanceConfig,
    Progress,
    artifacts_for,
    contract_of,
    lineage_candidates,
    load_generation,
    mark_step,
    step_seed,
)


def registered_model_name(lineage: str, specialist: str) -> str:
    """The MLflow registered model holding a lineage's adapters for one specialist."""
    return f"ratchet-{lineage}-{specialist}"


def train_step(
    *, generation_id: int, config: AdvanceConfig, tracker: Any = None, progress: Progress | None = None
) -> dict[str, Any]:
    """Train one LoRA per specialist with a dataset, continuing the parent's adapter; record each in the registry."""
    import json as _json

    from pipeline.clock import CLOCK
    from pipeline.modelspec import ModelSpec
    from pipeline.registry import (
        TrainingDataset,
        create_adapter,
        get_engine,
        session_scope,
        set_generation_adapter,
        set_generation_status,
    )
    from pipeline.training import TrainConfig, train_lora

    engine = get_engine()
    with session_scope(engine) as session:
        gen = load_generation(session, generation_id)
        if gen.status == "candidate":
            set_generation_status(session=session, generation=gen, status="training")
        parent = load_generation(session, gen.parent_id)
        spec = ModelSpec.model_validate(gen.base_model.spec)
        base_dir, base_id, number = Path(gen.base_model.path), gen.base_model_id, gen.number
        parent_adapters = {a.specialist: a.adapter for a in parent.adapters}
        datasets = {
            d.specialist: (d.path, d.sha256, d.num_rows)
            for d in session.query(TrainingDataset).filter_by(generation_id=generation_id)
        }
        lineage_info = {
            "lineage": config.lineage,
            "generation": number,
            "parent_generation": parent.number,
            "contract": f"{gen.contract_version.name} {gen.contract_version.version}",
            "contract_sha256": gen.contract_version.content_hash,
            "harness": f"{gen.harness_version.name} {gen.harness_version.version}",
            "harness_sha256": gen.harness_version.content_hash,
            "base_model": gen.base_model.name,
            "base_model_sha256": gen.base_model.content_hash,
        }
        trained = dict((gen.state or {}).get("trained", {}))
    out_dir = artifacts_for(config.lineage, number) / "adapters"
    results: dict[str, Any] = {}
    for specialist, (path, digest, _rows) in sorted(datasets.items()):
        if specialist in trained:  # done before a crash: keep it
            results[specialist] = trained[specialist]
            continue
        lora, defaults = spec.specialists[specialist].lora, spec.specialists[specialist].training
        parent_adapter = parent_adapters.get(specialist)
        train_config = TrainConfig(
            rank=lora.rank,
            alpha=lora.alpha,
            dropout=lora.dropout,
            target_modules=tuple(lora.target_modules),
            lr=defaults.lr,
            epochs=defaults.epochs,
            max_steps=defaults.max_steps,
            batch_size=defaults.batch_size,
            seed=step_seed(config, number, specialist),
        )
        result = train_lora(
            base_model_dir=base_dir,
            dataset_dir=Path(path),
            output_dir=out_dir / f"{config.lineage}-gen{number}-{specialist}",
            config=train_config,
            parent_adapter_dir=Path(parent_adapter.artifact_uri) if parent_adapter else None,
            lineage={
                **lineage_info,
                "specialist": specialist,
                "dataset_sha256": digest,
                "parent_adapter_sha256": parent_adapter.sha256 if parent_adapter else None,
            },
            tracker=tracker,
            progress=(lambda s, t, _loss, sp=specialist: progress(f"train {sp}", s, t)) if progress else None,
        )
        CLOCK.add("train", result.seconds)  # the optimisation loop itself; loading and saving are overhead
        version = None
        if tracker is not None and result.run_id:
            version = tracker.register_adapter(
                registered_model_name(config.lineage, specialist), result.run_id, "adapter"
            )
        with session_scope(engine) as session:
            gen = load_generation(session, generation_id)
            adapter = create_adapter(
                session=session,
                specialist=specialist,
                base_model_id=base_id,
                rank=lora.rank,
                alpha=lora.alpha,
                target_modules=list(lora.target_modules),
                artifact_uri=str(result.adapter_dir),
                sha256=result.adapter_sha256,
                parent_adapter_id=parent_adapter.id if parent_adapter else None,
                mlflow_run_id=result.run_id,
                dataset_sha256=digest,
                metrics={
                    "final_loss": result.final_loss,
                    "steps": result.steps,
                    "tokens_per_s": result.tokens_per_second,
                },
            )
            adapter.mlflow_model_version = version
            set_generation_adapter(
                session=session, generation=gen, specialist=specialist, adapter_id=adapter.id
            )
            results[specialist] = {
                "adapter_id": adapter.id,
                "steps": result.steps,
                "loss": result.final_loss,
                "resumed_from_step": result.resumed_from_step,
            }
            state = dict(gen.state or {})
            state["trained"] = {**state.get("trained", {}), specialist: results[specialist]}
            gen.state = _json.loads(_json.dumps(state))
    with session_scope(engine) as session:
        mark_step(session, load_generation(session, generation_id), "train", {"adapters": results})
    return results


def codesign_step(
    *, generation_id: int, config: AdvanceConfig, progress: Progress | None = None
) -> dict[str, Any]:
    """Evaluate harness variants with the candidate's adapters on validation items; keep the best pair."""
    from pipeline.codesign import propose_variants
    from pipeline.harness import check_harness
    from pipeline.heldout import score_pair, validation_items
    from pipeline.pair import PairSpec, pair_for_generation
    from pipeline.registry import get_engine, register_harness, session_scope

    engine = get_engine()
    with session_scope(engine) as session:
        gen = load_generation(session, generation_id)
        contract = contract_of(gen)
        pair = pair_for_generation(gen)
        parent_harness = pair.harness
        candidates = lineage_candidates(session, gen, contract)
        number = gen.number
    if not config.codesign:
        outcome = {"chosen": parent_harness.version, "variants": {}}
    else:
        top: dict[str, list[dict[str, Any]]] = {}
        for c in sorted(candidates, key=lambda c: -(c.score or 0)):
            if c.score is not None and c.metadata.get("split") != "heldout" and c.source != "evaluation":
                top.setdefault(c.specialist, []).append(
                    {"messages": c.messages, "score": c.score, "specialist": c.specialist}
                )
        top = {s: v[:20] for s, v in top.items()}
        variants = propose_variants(
            parent_harness, top_traces=top, contract=contract, rng_seed=step_seed(config, number, "codesign")
        )
        items = validation_items(
            sorted(pair.adapters), n=config.validation_items, seed=step_seed(config, number, "validation")
        )
        scores = {}
        best_label, best_value, best_spec = parent_harness.version, None, parent_harness
        for label, spec in [(parent_harness.version, parent_harness), *((v.label, v.spec) for v in variants)]:
            if check_harness(spec, contract):
                continue
            per = score_pair(PairSpec(pair.base_dir, pair.adapters, spec), items, contract)
            value = sum(sum(v) / len(v) for v in per.values() if v) / max(
                1, sum(1 for v in per.values() if v)
            )
            scores[label] = round(value, 4)
            if best_value is None or value > best_value + 1e-9:
                best_label, best_value, best_spec = label, value, spec
        outcome = {
            "chosen": best_label,
            "variants": scores,
            "operators": {v.label: v.operator for v in variants},
        }
        if best_spec is not parent_harness:
            with session_scope(engine) as session:
                gen = load_generation(session, generation_id)
                row = register_harness(
                    session=session,
                    name=best_spec.name,
                    version=best_spec.version,
                    spec=best_spec.model_dump(mode="json"),
                    parent_id=gen.harness_version_id,
                    actor="codesign",
                )
                gen.harness_version_id = row.id
    with session_scope(engine) as session:
        mark_step(session, load_generation(session, generation_id), "codesign", outcome)
    return outcome
