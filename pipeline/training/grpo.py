"""The GRPO job: setup, train, save, clean up -- in that order, in this one file.

``train_grpo`` fine-tunes one LoRA adapter by group-relative policy optimisation (Shao et al., 2024) on a
task source's training prompts, online: every step the policy itself answers ``prompts_per_step`` prompts
``group_size`` times at ``temperature``; each finished episode is scored by the contract (``Episodes.reward``:
the same scoring code as everything else, ``scoring.score_trace``), and each episode's advantage is its
reward minus its group's mean, over the group's standard deviation. The loss is the policy gradient of the
episode's assistant tokens times its advantage, plus ``kl_beta`` times a per-token KL estimate toward the
reference (Schulman's k3: ``exp(ref - logp) - (ref - logp) - 1``), averaged per episode and then over the
episodes. The reference is the parent pair (its adapter merged into a frozen copy of the base; the bare base
without a parent); the policy starts from the parent's adapter. One optimizer step per batch of rollouts
(strictly on-policy), so PPO's clipped ratio is always 1 and is left out. Groups whose rewards are all equal
carry no signal and sit out the update, as in DAPO's dynamic sampling; the step still counts.

Episodes are multi-turn where the task source has an action substrate (``Episodes.act``): a reply that
calls tools (read by the one reader of replies, ``toolcalls.assistant_message``, in the harness's format) has
each call executed against the episode's own substrate state, the results are appended as ``tool`` messages,
and the policy continues, until it answers without a call or ``max_turns`` replies were written. The reward
pays for the episode's last turn a verifying scorer checked (``scoring.episode_reward``): every assistant turn
the policy wrote up to it is trained on (``likelihood.encode_episode``), a turn after it that nothing checked
never is; tool results, prompts, exemplars and the task item's own turns are context.

Why not TRL's ``GRPOTrainer`` (``docs/methods.md``, *Training methods*): its multi-turn tool loop reads calls
through transformers' response templates, a second parser beside the one the contract's scorers and the
server use (it knows neither the compact format of the demo nor every harness's), its checkpoints are
pickles, and its rollouts use ``generate`` where this job uses the project's batched decoder.

Rollouts of step ``s`` are seeded by ``(seed, s)``, so a job resumed from a checkpoint (safetensors + JSON,
as in SFT) draws the same prompts and samples it would have; the adapter is saved atomically with
``lineage.json`` (``artifacts.save_adapter``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.errors import RatchetError
from pipeline.experience.toolcalls import assistant_message, from_openai, tool_names
from pipeline.modeling.decoding import SamplingConfig, generate
from pipeline.modeling.placement import placement
from pipeline.modeling.templating import encode_prompt
from pipeline.specs.loading import content_hash, weights_sha256
from pipeline.training.artifacts import save_adapter
from pipeline.training.checkpoint import resume, save_checkpoint
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
    encode_episode,
    optimizer,
    policy_model,
    reference_model,
    sequence_logprobs,
)

if TYPE_CHECKING:
    from pipeline.modeling.placement import Placement
    from pipeline.registry.tracking import Tracker
    from pipeline.scoring import EpisodeReward
    from pipeline.specs.modelspec import GrpoSettings, LoraConfig

log = logging.getLogger(__name__)

ADVANTAGE_EPS = 1e-4


@dataclass(frozen=True)
class Episodes:
    """What a GRPO job practises on and how an episode is judged (built by ``training.step`` from the contract,
    the harness and the task source)."""

    items: list[dict[str, Any]]  # task items of the training split (none held out): the prompt pool
    view: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]  # the conversation as the specialist sees it
    reward: Callable[[dict[str, Any]], EpisodeReward]  # a finished episode's trace -> its reward and turn
    tools: list[dict[str, Any]] = field(default_factory=list)  # the tools the harness offers (item's win)
    # The task source's action substrate: ``reset(item) -> state``, ``act(state, call) -> (state, result)``.
    reset: Callable[[dict[str, Any]], Any] | None = None
    act: Callable[[Any, dict[str, Any]], tuple[Any, Any]] | None = None
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()


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
) -> TrainResult:
    """Train (or resume) a LoRA adapter with GRPO on ``episodes``; return where it was saved and how it went
    (``final_loss`` and the curve are the mean reward of each step's rollouts).

    ``stop_after_steps`` interrupts the job after that many steps in this call (after checkpointing),
    returning ``completed=False``, as ``train_lora`` does."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
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
    model = policy_model(
        base_model_dir,
        rank=lora.rank,
        alpha=lora.alpha,
        dropout=lora.dropout,
        target_modules=lora.target_modules,
        parent_adapter_dir=parent_adapter_dir,
        where=where,
    )
    reference = None
    if settings.kl_beta > 0:
        reference = reference_model(
            base_model_dir, parent_adapter_dir=parent_adapter_dir, where=where, tokenizer_dir=tokenizer_dir
        )
    params, optim, sched = optimizer(model, lr=settings.lr, warmup_steps=settings.warmup_steps)
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
        }  # fmt: skip
    )
    ckpt_root = output_dir / "checkpoint"
    if (done := finished_before(ckpt_root, job_key=job_key)) is not None:
        return done  # it finished, then its registry commit failed: no step is trained again, no second run
    start = resume(ckpt_root, job_key=job_key, model=model, optim=optim, sched=sched, total=total)

    # ---- train -------------------------------------------------------------------------------------
    with contextlib.ExitStack() as stack:
        stack.enter_context(merged_lora(model))
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
            rolled = roll_out(
                model, tokenizer, batch, episodes, settings, fmt=tool_call_format, seed=_step_seed(seed, step)
            )
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
                _, logp, owner = sequence_logprobs(
                    model, examples, row_len=max_len, pad_id=pad_id, device=where.device
                )
                adv = advantages[kept].to(logp.device)[owner]
                per_token = -adv * torch.exp(logp - logp.detach())  # = -A * logp in value and gradient
                if reference is not None:
                    with torch.no_grad():
                        _, ref_logp, _ = sequence_logprobs(
                            reference, examples, row_len=max_len, pad_id=pad_id, device=where.device
                        )
                    gap = ref_logp - logp
                    kl = torch.exp(gap) - gap - 1
                    per_token = per_token + settings.kl_beta * kl
                    kl_value = float(kl.detach().mean())
                count = torch.bincount(owner, minlength=len(examples)).clamp(min=1)
                per_episode = torch.zeros(len(examples), device=logp.device).index_add(0, owner, per_token)
                loss = (per_episode / count).mean()
                loss.backward()
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
            if step % settings.checkpoint_every == 0 or interrupted:
                save_checkpoint(ckpt_root, job_key=job_key, step=step, model=model, optim=optim, sched=sched,
                                get_state=get_peft_model_state_dict)  # fmt: skip
            if interrupted:
                seconds = time.perf_counter() - started
                return TrainResult(output_dir / "adapter", "", step, reward_mean, tokens / seconds, start,
                                   len(episodes.items), seconds, run_id, completed=False, loss_curve=tuple(curve),
                                   dropped=dropped)  # fmt: skip
        seconds = time.perf_counter() - started

        # ---- save ----------------------------------------------------------------------------------
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
    return finish(ckpt_root, job_key=job_key, result=result, keep=keep_checkpoints)


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


def roll_out(
    model: Any,
    tokenizer: Any,
    items: list[dict[str, Any]],
    episodes: Episodes,
    settings: GrpoSettings,
    *,
    fmt: str,
    seed: int,
) -> list[dict[str, Any]]:
    """``group_size`` episodes per item (in item order), each a finished trace: the item's messages, the
    policy's replies and, where the substrate executed calls, their results."""
    from jinja2 import TemplateError

    runs = []
    for item in items:
        meta = dict(item.get("metadata") or {})
        for copy in range(settings.group_size):
            state = episodes.reset(item) if episodes.reset is not None else None
            runs.append({"messages": list(item["messages"]), "metadata": meta, "state": state, "copy": copy})
    active = list(range(len(runs)))
    for turn in range(settings.max_turns):
        if not active:
            break
        prompts, rendered = [], []
        for i in active:  # token ids, content inert; a prompt the template refuses ends its episode there
            try:
                prompts.append(
                    encode_prompt(
                        tokenizer,
                        episodes.view(runs[i]["messages"]),
                        fmt=fmt,
                        tools=runs[i]["metadata"].get("tools") or episodes.tools or None,
                    )
                )
                rendered.append(i)
            except TemplateError as exc:
                log.warning("an episode ends: the chat template refuses its prompt: %s", exc)
        active = rendered
        if not active:
            break
        config = SamplingConfig(
            temperature=settings.temperature,
            num_samples=1,
            max_new_tokens=episodes.max_new_tokens,
            stop=episodes.stop,
            seed=seed + turn,
        )
        texts = generate(model, tokenizer, prompts, config)
        still = []
        for i, (text,) in zip(active, texts, strict=True):
            run = runs[i]
            offered = run["metadata"].get("tools") or episodes.tools
            seed_text = f"{run['metadata'].get('task_id', '')}#{run['copy']}#{turn}"
            message = assistant_message(text, tool_names(offered), fmt, seed_text=seed_text)
            run["messages"].append(message)
            calls = message.get("tool_calls")
            if not calls or episodes.act is None or turn + 1 >= settings.max_turns:
                continue
            for call in calls:
                try:
                    run["state"], result = episodes.act(run["state"], _call(call))
                except (
                    Exception
                ) as exc:  # the call is the model's: whatever it does to a substrate is an answer
                    log.warning(
                        "the substrate failed on a call (%s: %s); given back as an error",
                        type(exc).__name__,
                        exc,
                    )
                    result = {"error": f"{type(exc).__name__}: {exc}"}
                run["messages"].append(
                    {
                        "role": "tool",
                        "tool_call_id": call["id"],
                        "content": json.dumps(result, sort_keys=True),
                    }
                )
            still.append(i)
        active = still
    return [{"messages": r["messages"], "metadata": r["metadata"], "feedback": None} for r in runs]


def _call(tool_call: dict[str, Any]) -> dict[str, Any]:

    return from_openai([tool_call])[0]
