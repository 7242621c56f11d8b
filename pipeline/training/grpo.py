"""The GRPO job: setup, train, save, clean up -- in that order, in this one file.

``train_grpo`` fine-tunes one LoRA adapter by group-relative policy optimisation (Shao et al., 2024) on a
task source's training prompts, online: every step the policy itself answers ``prompts_per_step`` prompts
``group_size`` times at ``temperature``; each finished episode is scored by the contract (``Episodes.reward``:
the same scoring code as everything else, ``scoring.score_trace``), and each episode's advantage is its
reward minus its group's mean, over the group's standard deviation. The loss is the policy gradient of the
episode's assistant tokens times its advantage, plus ``kl_beta`` times a per-token KL estimate toward the
reference (Schulman's k3: ``exp(ref - logp) - (ref - logp) - 1``), averaged per episode and then over the
episodes. The reference is the parent pair (``likelihood.reference_of``: the parent's adapter loaded, frozen,
into the same model beside the policy's, or the adapters switched off without a parent -- never a second
copy of the base); the policy starts from the parent's adapter. One optimizer step per batch of rollouts
(strictly on-policy), so PPO's clipped ratio is always 1 and is left out. Groups whose rewards are all equal
carry no signal and sit out the update, as in DAPO's dynamic sampling; the step still counts.

Episodes are multi-turn where the task source has an action substrate (``Episodes.act``): a reply that
calls tools (read by the one reader of replies, ``toolcalls.assistant_message``, in the harness's format) has
each call executed against the episode's own substrate state, the results are appended as ``tool`` messages,
and the policy continues, until it answers without a call or ``max_turns`` replies were written. The reward
pays for the episode's last turn a verifying scorer checked (``scoring.episode_reward``): every assistant turn
the policy wrote up to it is trained on (``likelihood.encode_episode``), a turn after it that nothing checked
never is; tool results, prompts, exemplars and the task item's own turns are context. The episodes are
played by ``episodes.roll_out``: in this process, or, when the loop's rollout engine is ``openai``
(``settings.rollout_engine``), on that engine, the policy's adapter of the step saved under the job's
directory, loaded by a versioned name and parity-probed first (``episodes.served_policy``), then unloaded.

Why not TRL's ``GRPOTrainer`` (``docs/methods.md``, *Training methods*): its multi-turn tool loop reads calls
through transformers' response templates, a second parser beside the one the contract's scorers and the
server use (it knows neither the compact format of the demo nor every harness's), its checkpoints are
pickles, and its rollouts use ``generate`` where this job uses the project's batched decoder.

Rollouts of step ``s`` are seeded by ``(seed, s)``, so a job resumed from a checkpoint (safetensors + JSON,
as in SFT) draws the same prompts and samples it would have; the adapter is saved atomically with
``lineage.json`` (``artifacts.save_adapter``).

Memory: a step's update runs its episodes in micro-batches of at most ``micro_batch_tokens`` packed tokens
(``memory.micro_batches``), the reference's KL pass with them; each micro-batch adds its episodes' mean
per-token losses over the step's episode count, so the accumulated gradient is the one of the whole step's
mean over episodes. Under ``torchrun`` each process runs its share of the micro-batches and the gradients
are summed before clipping (``distributed``); only the main process writes files and metrics.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.errors import RatchetError
from pipeline.modeling.placement import placement
from pipeline.modeling.samplers import sampler_for
from pipeline.settings import get_settings
from pipeline.specs.loading import content_hash, file_sha256, weights_sha256
from pipeline.training.artifacts import save_adapter
from pipeline.training.attention import padding_free
from pipeline.training.checkpoint import resume, save_checkpoint
from pipeline.training.distributed import (
    broadcast_parameters,
    is_main,
    least,
    reduce_gradients,
    share,
    split,
    world,
)
from pipeline.training.episodes import Episodes, first_prompts, roll_out, served_policy
from pipeline.training.job import (
    LOSS_POINTS,
    ROW_ERRORS,
    TrainResult,
    batch_indices,
    finish,
    finished_before,
    git_describe,
    log_dropped,
    sequence_limit,
    skip_reason,
)
from pipeline.training.kernels import merged_lora
from pipeline.training.likelihood import (
    REFERENCE,
    encode_episode,
    optimizer,
    policy_model,
    reference_of,
    sequence_logprobs,
)
from pipeline.training.memory import token_budget

if TYPE_CHECKING:
    import torch

    from pipeline.modeling.placement import Placement
    from pipeline.registry.tracking import Tracker
    from pipeline.scoring import EpisodeReward
    from pipeline.specs.modelspec import GrpoSettings, LoraConfig

log = logging.getLogger(__name__)

ADVANTAGE_EPS = 1e-4
ROLLOUT_ADAPTER = "rollout-adapter"  # under the job's directory: the policy as the `openai` engine loads it


def train_grpo(
    *,
    base_model_dir: Path,
    output_dir: Path,
    episodes: Episodes,
    settings: GrpoSettings,
    lora: LoraConfig,
    seed: int = 0,
    tool_call_format: str = "compact",
    max_seq_len: int | None = None,
    parent_adapter_dir: Path | None = None,
    lineage: dict[str, Any] | None = None,
    tracker: Tracker | None = None,
    progress: Callable[[int, int, float], None] | None = None,
    stop_after_steps: int | None = None,
    where: Placement | None = None,
    tokenizer_dir: Path | None = None,
    keep_checkpoints: bool = False,
    micro_batch_tokens: int | None = None,
    activation_checkpointing: str = "auto",
    quantization: str = "none",
) -> TrainResult:
    """Train (or resume) a LoRA adapter with GRPO on ``episodes``; return where it was saved and how it went
    (``final_loss`` and the curve are the mean reward of each step's rollouts).

    ``stop_after_steps`` interrupts the job after that many steps in this call (after checkpointing),
    returning ``completed=False``, as ``train_lora`` does. ``micro_batch_tokens`` (None: all of a step's
    episodes at once), ``activation_checkpointing`` and ``quantization`` are the model spec's
    (``TrainDefaults``): the first cuts each update (see the module doc), the other two are
    ``likelihood.policy_model``'s."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import torch.distributed as dist
    from peft import get_peft_model_state_dict
    from transformers import AutoTokenizer

    # ---- setup -------------------------------------------------------------------------------------
    base_model_dir, output_dir = Path(base_model_dir), Path(output_dir)
    if not episodes.items:
        raise RatchetError(
            f"{output_dir.name}: no training prompts to practise on (the task source gave none)"
        )
    pool_hash = content_hash(
        [{"messages": it["messages"], "metadata": it.get("metadata")} for it in episodes.items]
    )
    torch.manual_seed(seed)
    random.seed(seed)
    where = where or placement()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or base_model_dir)
    tokenizer.padding_side = "left"
    pad_id = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)
    max_len = max_seq_len or sequence_limit(base_model_dir)
    team = world()
    tracker = tracker if is_main(team) else None  # one process writes the run's metrics and files
    model = policy_model(
        base_model_dir,
        rank=lora.rank,
        alpha=lora.alpha,
        dropout=lora.dropout,
        target_modules=lora.target_modules,
        parent_adapter_dir=parent_adapter_dir,
        where=where,
        quantization=quantization,
        activation_checkpointing=activation_checkpointing,
        max_seq_len=max_len,
    )
    params, optim, sched = optimizer(model, lr=settings.lr, warmup_steps=settings.warmup_steps)
    # rollouts in this process, or on the loop's `openai` engine (``episodes.served_policy``)
    loop = get_settings()
    engine = sampler_for(loop, tokenizer=tokenizer) if loop.rollout_engine == "openai" else None
    # the KL's reference runs through the same model (no second base), never in the optimizer
    reference = reference_of(model, parent_adapter_dir) if settings.kl_beta > 0 else None
    total = settings.steps
    job_key = content_hash(
        {
            "method": "grpo",
            "settings": settings.model_dump(mode="json"),
            "lora": lora.model_dump(mode="json"),
            "seed": seed,
            "fmt": tool_call_format,
            "prompts": pool_hash,
            "max_len": max_len,
            "max_new_tokens": episodes.max_new_tokens,
            "parent": str(parent_adapter_dir),
            # a 4-bit base is another job (the key of a job on the unquantized base stays as it was)
            **({"quantization": quantization} if quantization != "none" else {}),
        }  # fmt: skip
    )
    ckpt_root = output_dir / "checkpoint"
    if (done := finished_before(ckpt_root, job_key=job_key)) is not None:
        return done  # it finished, then its registry commit failed: no step is trained again, no second run
    start = resume(ckpt_root, job_key=job_key, model=model, optim=optim, sched=sched, total=total)
    broadcast_parameters(params, team)  # every process resumed the same files; this makes it certain
    budget = least(token_budget(micro_batch_tokens, where=where, model=model, max_seq_len=max_len), world())

    # ---- train -------------------------------------------------------------------------------------
    with contextlib.ExitStack() as stack:
        # rewards overlap on a few threads: sandboxed test runs and judge calls wait on other processes
        scoring = stack.enter_context(ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)))
        run_id = None
        if tracker:
            run_id = stack.enter_context(
                tracker.start_run(output_dir.name, {"kind": "lora", "method": "grpo", "resumed_from_step": str(start)})
            )  # fmt: skip
            tracker.log_params(
                {**settings.model_dump(), "method": "grpo", "rank": lora.rank, "alpha": lora.alpha, "seed": seed,
                 "prompt_pool": len(episodes.items), "prompt_pool_sha256": pool_hash, "total_steps": total}
            )  # fmt: skip
        reward_mean, started, step, tokens = float("nan"), time.perf_counter(), start, 0
        curve: list[tuple[int, float]] = []
        every = max(1, -(-total // LOSS_POINTS))
        dropped: dict[str, int] = {}  # episodes left out of the updates, by reason (templating.RowSkipped)
        while step < total:
            batch = [
                episodes.items[i]
                for i in batch_indices(len(episodes.items), settings.prompts_per_step, step, seed)
            ]
            model.eval()
            if engine is None:
                with merged_lora(model):
                    rolled = roll_out(model, tokenizer, batch, episodes, settings, fmt=tool_call_format,
                                      seed=_step_seed(seed, step))  # fmt: skip
            else:  # the policy as it is now, on the engine: saved, loaded by versioned name, probed
                served = None
                try:
                    asked = first_prompts(tokenizer, batch, episodes, fmt=tool_call_format)
                    served = served_policy(model, engine, output_dir / ROLLOUT_ADAPTER, name=f"{output_dir.name}-grpo",
                                           tolerance=loop.parity_tolerance, prompts=asked)  # fmt: skip
                    rolled = roll_out(model, tokenizer, batch, episodes, settings, fmt=tool_call_format,
                                      seed=_step_seed(seed, step), sampler=engine, adapter=served)  # fmt: skip
                finally:
                    if served is not None:
                        engine.unload(served)  # the next step's policy is another adapter
                    shutil.rmtree(output_dir / ROLLOUT_ADAPTER, ignore_errors=True)
            paid = list(scoring.map(episodes.reward, rolled))
            rewards = torch.tensor([p.value for p in paid], dtype=torch.float32)
            groups = rewards.view(len(batch), settings.group_size)
            spread = groups.std(dim=1, keepdim=True)
            advantages = ((groups - groups.mean(dim=1, keepdim=True)) / (spread + ADVANTAGE_EPS)).flatten()
            advantages = torch.where((spread > 0).expand_as(groups).flatten(), advantages, 0.0)
            informative = advantages.nonzero().flatten().tolist()
            asked = [sum(m.get("role") == "assistant" for m in it["messages"]) for it in batch]
            episodes_paid = [paid_turns(t["messages"], p, asked[n // settings.group_size])
                             for n, (t, p) in enumerate(zip(rolled, paid, strict=True))]  # fmt: skip
            trained = [messages for messages, _ in episodes_paid]
            written = [turns for _, turns in episodes_paid]
            examples, kept = [], []
            for i in informative:
                view = episodes.view(trained[i])
                tools = (rolled[i]["metadata"] or {}).get("tools") or episodes.tools
                try:
                    ids, labels = encode_episode(tokenizer, view, max_len, fmt=tool_call_format,
                                                 tools=tools or None, turns=written[i])  # fmt: skip
                except ROW_ERRORS as exc:  # the template refuses it, it does not fit, it rewrites a reply...
                    log.warning("an episode is left out of the update: %s", exc)
                    reason = skip_reason(exc)
                    dropped[reason] = dropped.get(reason, 0) + 1
                    if tracker:
                        log_dropped(tracker, dropped, step=step)
                    continue
                if any(label != -100 for label in labels):
                    examples.append((ids, labels))
                    kept.append(i)
            model.train()
            kl_value = 0.0
            if examples:
                kl_value = policy_update(model, examples, advantages[kept], reference=reference,
                                         kl_beta=settings.kl_beta, budget=budget, row_len=max_len,
                                         pad_id=pad_id, device=where.device)  # fmt: skip
                reduce_gradients(params, team)
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optim.step()
                sched.step()  # warm-up counts updates: a step with nothing to learn from made none
                optim.zero_grad(set_to_none=True)
                tokens += sum(len(ids) for ids, _ in examples)
            step += 1
            reward_mean = float(rewards.mean())
            if step % every == 0 or step == total:
                curve.append((step, round(reward_mean, 5)))
            if tracker:
                for key, value in {
                    "reward": reward_mean,
                    "reward_std": float(rewards.std()),
                    "best_in_group": float(groups.max(dim=1).values.mean()),
                    "informative_groups": float((spread > 0).float().mean()),
                    "kl": kl_value,
                    "assistant_turns": sum(written) / len(written),
                }.items():
                    tracker.log_metric(key, value, step=step)
            if progress is not None:
                progress(step, total, reward_mean)
            interrupted = stop_after_steps is not None and step - start >= stop_after_steps and step < total
            if (step % settings.checkpoint_every == 0 or interrupted) and is_main(team):
                save_checkpoint(ckpt_root, job_key=job_key, step=step, model=model, optim=optim, sched=sched,
                                get_state=get_peft_model_state_dict)  # fmt: skip
            if interrupted:
                seconds = time.perf_counter() - started
                return TrainResult(output_dir / "adapter", "", step, reward_mean, tokens / seconds, start,
                                   len(episodes.items), seconds, run_id, completed=False, loss_curve=tuple(curve),
                                   dropped=dropped)  # fmt: skip
        seconds = time.perf_counter() - started

        # ---- save ----------------------------------------------------------------------------------
        if REFERENCE in model.peft_config:  # the parent's weights: never saved with the policy
            model.delete_adapter(REFERENCE)
        adapter_dir, adapter_sha = output_dir / "adapter", ""
        if is_main(team):
            adapter_dir, adapter_sha = save_adapter(
                model,
                output_dir,
                record={
                    **(lineage or {}),
                    "method": "grpo",
                    "prompt_pool_sha256": pool_hash,
                    "base_model_sha256": weights_sha256(base_model_dir),
                    "code_version": (lineage or {}).get("code_version") or git_describe(),
                    "parent_adapter": str(parent_adapter_dir) if parent_adapter_dir else None,
                    "reference": "parent adapter" if parent_adapter_dir else "base model",
                    "train_config": {**settings.model_dump(), "lora": lora.model_dump(), "seed": seed},
                    "steps": total,
                    "final_reward": reward_mean,
                    "prompts": len(episodes.items),
                },
                tracker=tracker,
            )
        if team.size > 1:  # the other processes return the adapter the main one saved
            dist.barrier()
            adapter_sha = adapter_sha or file_sha256(adapter_dir / "adapter_model.safetensors")

    # ---- clean up ----------------------------------------------------------------------------------
    del model, optim, reference
    result = TrainResult(
        adapter_dir,
        adapter_sha,
        total,
        reward_mean,
        tokens / max(seconds, 1e-9),
        start,
        len(episodes.items),
        seconds,
        run_id,
        loss_curve=tuple(curve),
        dropped=dropped,
    )
    if not is_main(team):
        return result
    return finish(ckpt_root, job_key=job_key, result=result, keep=keep_checkpoints)


def policy_update(
    model: Any,
    examples: list[tuple[list[int], list[int]]],
    advantages: torch.Tensor,
    *,
    reference: Callable[[], contextlib.AbstractContextManager[Any]] | None,
    kl_beta: float,
    budget: int | None,
    row_len: int,
    pad_id: int,
    device: Any,
) -> float:
    """Accumulate into ``model``'s LoRA gradients the step's loss over ``examples`` (one per informative
    episode, ``advantages`` theirs): per labelled token ``-A * logp``, plus ``kl_beta`` times the k3 KL
    estimate toward ``reference`` (``likelihood.reference_of``; None: no KL term), averaged per episode and
    then over all the step's episodes. Runs in micro-batches of at most ``budget`` packed tokens (None: all
    at once; under ``torchrun`` this process's share), each one's reference pass just before its policy pass,
    so only one micro-batch's activations are alive. Returns the mean per-token KL over the step's tokens
    (0.0 without a reference)."""
    import torch
    import torch.distributed as dist

    team = world()
    shape = {"row_len": row_len, "pad_id": pad_id, "device": device}
    kl_sums = torch.zeros(2, dtype=torch.float64, device=device)  # summed KL, tokens
    for group in share(split([len(ids) for ids, _ in examples], budget, team), team):
        part = [examples[j] for j in group]
        ref_logp = None
        if reference is not None:
            with reference(), torch.no_grad():
                _, ref_logp, _ = sequence_logprobs(model, part, **shape)
        # never around the reference pass: it switches the adapter underneath; padding-free (GPU) spans
        # the backward too (activation checkpointing runs the forward again there)
        with merged_lora(model), padding_free(model):
            _, logp, owner = sequence_logprobs(model, part, **shape)
            adv = advantages[group].to(logp.device)[owner]
            per_token = -adv * torch.exp(logp - logp.detach())  # = -A * logp in value and gradient
            if ref_logp is not None:
                gap = ref_logp - logp
                kl = torch.exp(gap) - gap - 1
                per_token = per_token + kl_beta * kl
                kl_sums += torch.stack([kl.detach().sum().double(), torch.tensor(kl.numel(), device=device)])
            count = torch.bincount(owner, minlength=len(part)).clamp(min=1)
            per_episode = torch.zeros(len(part), device=logp.device).index_add(0, owner, per_token)
            ((per_episode / count).sum() / len(examples)).backward()  # summed: the step's mean
    if team.size > 1:
        dist.all_reduce(kl_sums)
    return float(kl_sums[0] / kl_sums[1]) if kl_sums[1] > 0 else 0.0


def paid_turns(
    messages: list[dict[str, Any]], paid: EpisodeReward, asked: int
) -> tuple[list[dict[str, Any]], int]:
    """What an episode's update trains: its messages up to the turn its reward pays for (a turn after it,
    that nothing checked, is never trained; with no checked turn, the whole episode) and how many assistant
    turns the policy wrote in them (the task item's own ``asked`` ones are context)."""
    kept = messages[: paid.turn + 1] if paid.turn is not None else messages
    return kept, sum(m.get("role") == "assistant" for m in kept) - asked


def _step_seed(seed: int, step: int) -> int:
    return zlib.crc32(f"grpo:{seed}:{step}".encode())
