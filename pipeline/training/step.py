"""The training step: one LoRA job per specialist with a curated dataset, continuing the parent's adapter.

Each job is recorded as it finishes (registry adapter row, MLflow run and registered model version), so a
crashed step resumes with the specialists still to train. The registry row is written only after its MLflow
run and model version exist: when MLflow is unreachable (``tracking.TrackingUnavailable``) the step stops
with the candidate still in flight and nothing pointing at a run that is not there, and running it again
continues. When the artifact store refuses the adapter (``artifacts.ArtifactStoreError``: full or not
writable) the candidate is marked failed with that reason; no adapter row is written for a job that did not
save a complete adapter, and the champion is untouched.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.candidate import AdvanceConfig, Progress, artifacts_for, load_generation, mark_step, step_seed

if TYPE_CHECKING:
    from pipeline.tracking import Tracker


def train_step(
    *,
    generation_id: int,
    config: AdvanceConfig,
    tracker: Tracker | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Train one LoRA per specialist with a dataset, continuing the parent's adapter; record each in the registry."""
    import json as _json

    from pipeline.clock import CLOCK
    from pipeline.modelspec import ModelSpec
    from pipeline.placement import spec_placement, tokenizer_dir
    from pipeline.registry import (
        TrainingDataset,
        create_adapter,
        get_engine,
        session_scope,
        set_generation_adapter,
        set_generation_status,
    )
    from pipeline.tracking import registered_model_name
    from pipeline.training.artifacts import ArtifactStoreError
    from pipeline.training.job import TrainConfig, train_lora

    engine = get_engine()
    with session_scope(engine) as session:
        gen = load_generation(session, generation_id)
        if gen.status == "candidate":
            set_generation_status(session=session, generation=gen, status="training")
        parent = load_generation(session, gen.parent_id)
        spec = ModelSpec.model_validate(gen.base_model.spec)
        tool_call_format = gen.harness_version.spec.get("tool_call_format", "openai")
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
            max_seq_len=defaults.max_seq_len,
            seed=step_seed(config, number, specialist),
            tool_call_format=tool_call_format,
        )
        try:
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
                progress=(lambda s, t, _loss, sp=specialist: progress(f"train {sp}", s, t))
                if progress
                else None,
                where=spec_placement(spec.dtype),
                tokenizer_dir=tokenizer_dir(spec.tokenizer, base_dir),
            )
        except ArtifactStoreError as exc:  # not transient: record why, so the next advance starts afresh
            reason = f"failed: training {specialist}: {exc}"
            with session_scope(engine) as session:
                gen = load_generation(session, generation_id)
                set_generation_status(session=session, generation=gen, status="failed", reason=reason,
                                      actor="advance")  # fmt: skip
            raise ArtifactStoreError(f"generation {number} {reason}") from exc
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
                    "loss_curve": [list(point) for point in result.loss_curve],
                    "mlflow_experiment_id": getattr(tracker, "experiment_id", None),
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
