"""The training step: one LoRA job per specialist, by the method its model spec names, continuing the parent's
adapter: ``sft`` on its curated dataset (``job``), ``dpo`` on its preference pairs (``preference``), ``grpo``
online on its task source's training prompts with the contract's scoring as the reward (``reinforcement``).
A specialist with no dataset (sft, dpo) or no task source (grpo) keeps its parent's adapter. A spec with
``training.processes`` > 1 runs its sft and dpo jobs under ``torchrun`` (``distributed.launch``: one process
per GPU, gloo on the CPU; rank 0's result is the job's); the jobs get the spec's micro-batch budget,
activation checkpointing and ``quantization`` (QLoRA).

Each job is recorded as it finishes (registry adapter row with its method, MLflow run and registered model
version; the rows it left out, by reason, in the step's outcome), so a crashed step resumes with the
specialists still to train, and an interrupted job resumes from its checkpoint. A job's checkpoints stay, with
its finished result, until its registry row is committed: a step that failed after a job finished (the
registry write refused, the process killed) reuses that job's adapter and MLflow run when it runs again,
training nothing twice and opening no second run (``job.finished_before``). The registry row is written only after its MLflow run and model version exist: when
MLflow is unreachable (``tracking.TrackingUnavailable``) the step stops with the candidate still in flight and
nothing pointing at a run that is not there, and running it again continues. When the artifact store
refuses the adapter (``artifacts.ArtifactStoreError``: full or not writable) the candidate is marked failed
with that reason; no adapter row is written for a job that did not save a complete adapter, and the champion
is untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.errors import RatchetError
from pipeline.loop.candidate import (
    AdvanceConfig,
    Progress,
    artifacts_for,
    contract_of,
    load_generation,
    mark_step,
    step_seed,
)
from pipeline.loop.clock import CLOCK
from pipeline.loop.discovery import discovered_items
from pipeline.modeling.pair import offered_tools
from pipeline.modeling.placement import spec_placement, tokenizer_dir
from pipeline.modeling.prompting import decoding_for, render_messages
from pipeline.registry import (
    TrainingDataset,
    create_adapter,
    get_engine,
    session_scope,
    set_generation_adapter,
    set_generation_status,
)
from pipeline.registry.documents import AdapterMetrics, GenerationState, TrainedAdapter, state_of
from pipeline.registry.tracking import registered_model_name
from pipeline.scoring import episode_reward
from pipeline.specs.contract import file_reader
from pipeline.specs.harness import HarnessSpec
from pipeline.specs.heldout import heldout_index
from pipeline.specs.modelspec import ModelSpec
from pipeline.specs.tasksource import draw, task_sources
from pipeline.training.artifacts import ArtifactStoreError
from pipeline.training.checkpoint import discard
from pipeline.training.dpo import train_dpo
from pipeline.training.grpo import Episodes, train_grpo
from pipeline.training.job import TrainConfig, train_lora
from pipeline.training.torchrun import launch

if TYPE_CHECKING:
    from pipeline.registry.tracking import Tracker
    from pipeline.specs.contract import ContractSpec
    from pipeline.training.job import TrainResult

log = logging.getLogger(__name__)

RunJob = Callable[..., "TrainResult"]
"""``run_job(name, fn, **kwargs)``: how a job is run (a Prefect task per method in ``flows``); default
``fn(**kwargs)``."""


def grpo_episodes(
    *,
    contract: ContractSpec,
    harness: HarnessSpec,
    specialist: str,
    state: dict[str, Any] | None,
    prompts: int,
    seed: int,
) -> Episodes:
    """What a GRPO job practises on: ``prompts`` training items of the specialist's task source (the held-out
    predicate applied) after the variants discovery found, seen through the harness, rewarded by the
    contract (``scoring.episode_reward``), with the source's action substrate when it has one."""

    sources = task_sources(contract, read=file_reader(contract))
    if specialist not in sources:
        raise RatchetError(
            f"specialist {specialist!r} trains with method grpo but its contract entry names no task source "
            "(`tasks`): GRPO practises on a task source's training prompts"
        )
    variants = discovered_items(state, specialist)
    items, _ = draw(sources[specialist], "train", prompts, seed, heldout=heldout_index(contract))
    source = sources[specialist]
    decoding = decoding_for(harness, specialist)
    return Episodes(
        items=[*variants, *items],
        view=lambda messages: render_messages(harness, specialist, messages),
        reward=lambda trace: episode_reward(contract, trace, harness=harness, specialist=specialist),
        tools=offered_tools(harness, specialist),
        reset=getattr(source, "reset", None) if callable(getattr(source, "act", None)) else None,
        act=getattr(source, "act", None) if callable(getattr(source, "act", None)) else None,
        max_new_tokens=decoding.max_new_tokens,
        stop=tuple(decoding.stop),
    )


def train_step(
    *,
    generation_id: int,
    config: AdvanceConfig,
    tracker: Tracker | None = None,
    progress: Progress | None = None,
    run_job: RunJob | None = None,
) -> dict[str, Any]:
    """Train one LoRA per specialist by its method, continuing the parent's adapter; record each in the
    registry."""

    engine = get_engine()
    with session_scope(engine) as session:
        gen = load_generation(session, generation_id)
        if gen.status == "candidate":
            set_generation_status(session=session, generation=gen, status="training")
        parent = load_generation(session, gen.parent_id)
        spec = ModelSpec.model_validate(gen.base_model.spec)
        contract = contract_of(gen)
        harness = HarnessSpec.model_validate(gen.harness_version.spec)
        base_dir, base_id, number, state = Path(gen.base_model.path), gen.base_model_id, gen.number, gen.state
        parent_adapters = {a.specialist: a.adapter for a in parent.adapters}
        specialists = sorted(a.specialist for a in gen.adapters)
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
        trained = {s: t.as_stored() for s, t in GenerationState.model_validate(state or {}).trained.items()}
    out_dir = artifacts_for(config.lineage, number) / "adapters"
    where, tokenizer = spec_placement(spec.dtype), tokenizer_dir(spec.tokenizer, base_dir)
    results: dict[str, Any] = {}
    for specialist in specialists:
        job_dir = out_dir / f"{config.lineage}-gen{number}-{specialist}"
        if specialist in trained:  # done before a crash: keep it
            results[specialist] = trained[specialist]
            discard(job_dir / "checkpoint")  # (a crash right after its commit left them)
            continue
        settings = spec.specialists[specialist]
        method = settings.method
        if method != "grpo" and specialist not in datasets:
            continue  # no dataset: the parent's adapter stays
        parent_adapter = parent_adapters.get(specialist)
        seed = step_seed(config, number, specialist)
        common: dict[str, Any] = {
            "base_model_dir": base_dir,
            "output_dir": job_dir,
            # kept, with the finished job's result, until the registry has its adapter (below): a step that
            # fails in between and runs again reuses the adapter and its MLflow run instead of training again
            "keep_checkpoints": True,
            "parent_adapter_dir": Path(parent_adapter.artifact_uri) if parent_adapter else None,
            "tracker": tracker,
            "progress": (lambda s, t, _v, sp=specialist: progress(f"train {sp}", s, t)) if progress else None,
            "where": where,
            "tokenizer_dir": tokenizer,
        }
        info = {
            **lineage_info,
            "specialist": specialist,
            "parent_adapter_sha256": parent_adapter.sha256 if parent_adapter else None,
        }
        digest = datasets[specialist][1] if specialist in datasets else None
        fn, kwargs = job_for(
            method,
            spec,
            specialist,
            seed=seed,
            fmt=harness.tool_call_format,
            dataset=datasets.get(specialist),
        )
        if method == "grpo":
            kwargs["episodes"] = grpo_episodes(
                contract=contract,
                harness=harness,
                specialist=specialist,
                state=state,
                prompts=settings.grpo.steps * settings.grpo.prompts_per_step,
                seed=step_seed(config, number, f"grpo:{specialist}"),
            )
        try:
            rows = datasets[specialist][2] if specialist in datasets else None
            call = {**common, **kwargs, "lineage": {**info, "dataset_sha256": digest, "dataset_rows": rows}}
            result = run_job(f"train-{method}-{specialist}", fn, **call) if run_job else fn(**call)
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
        lora = settings.lora
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
                method=method,
                metrics=AdapterMetrics.model_validate(
                    {
                        "final_loss" if method != "grpo" else "final_reward": result.final_loss,
                        "steps": result.steps,
                        "tokens_per_s": result.tokens_per_second,
                        "loss_curve": [list(point) for point in result.loss_curve],
                        "mlflow_experiment_id": getattr(tracker, "experiment_id", None),
                    }
                ),
            )
            adapter.mlflow_model_version = version
            set_generation_adapter(
                session=session, generation=gen, specialist=specialist, adapter_id=adapter.id
            )
            results[specialist] = {
                "adapter_id": adapter.id,
                "method": method,
                "steps": result.steps,
                "loss" if method != "grpo" else "reward": result.final_loss,
                "resumed_from_step": result.resumed_from_step,
                # rows (examples, pairs, episodes) left out, by reason: the template refused them, too long...
                "dropped": dict(result.dropped),
                # examples by where their token ids came from: served (as decoded) or re-rendered, and why
                "token_ids": dict(result.token_ids),
            }
            state = state_of(gen)  # kept as each finishes: a resumed step skips what is done
            state.trained = {**state.trained, specialist: TrainedAdapter.model_validate(results[specialist])}
            gen.state = state.as_stored()
        discard(job_dir / "checkpoint")
    with session_scope(engine) as session:
        mark_step(session, load_generation(session, generation_id), "train", {"adapters": results})
    return results


def job_for(
    method: str,
    spec: ModelSpec,
    specialist: str,
    *,
    seed: int,
    fmt: str,
    dataset: tuple[str, str, int] | None,
) -> tuple[Callable[..., TrainResult], dict[str, Any]]:
    """The job function of ``method`` and its method-specific arguments (from the model spec). With
    ``training.processes`` > 1, sft and dpo run under ``torchrun`` (``distributed.launch``, which returns
    the same ``TrainResult``); grpo runs in this process (its rollouts are not split across processes)."""
    settings = spec.specialists[specialist]
    processes = settings.training.processes
    if method == "grpo" and processes > 1:
        log.warning("specialist %r: training.processes is %d, but grpo trains in one process", specialist,
                    processes)  # fmt: skip
    across = {"method": method, "processes": processes}
    if method == "sft":
        config = TrainConfig.from_spec(settings, seed=seed, tool_call_format=fmt)
        assert dataset is not None
        kwargs = {"dataset_dir": Path(dataset[0]), "config": config, "quantization": spec.quantization}
        return (launch, {**kwargs, **across}) if processes > 1 else (train_lora, kwargs)
    common = {
        "lora": settings.lora,
        "seed": seed,
        "tool_call_format": fmt,
        "max_seq_len": settings.training.max_seq_len,
        "micro_batch_tokens": settings.training.micro_batch_tokens,
        "activation_checkpointing": settings.training.activation_checkpointing,
        "quantization": spec.quantization,
    }
    if method == "dpo":
        assert dataset is not None
        kwargs = {**common, "dataset_dir": Path(dataset[0]), "settings": settings.dpo}
        return (launch, {**kwargs, **across}) if processes > 1 else (train_dpo, kwargs)
    if method == "grpo":
        return train_grpo, {**common, "settings": settings.grpo}
    raise RatchetError(f"specialist {specialist!r}: unknown training method {method!r}")
