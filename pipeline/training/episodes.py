"""What a GRPO job practises on (``Episodes``) and how its policy plays them (``roll_out``).

``roll_out`` runs ``group_size`` episodes per prompt: the policy answers, a reply's tool calls are executed
against the episode's own substrate state and given back as ``tool`` messages, until it answers without a
call or ``max_turns`` replies were written. The policy samples in this process (``decoding.generate``) or, when
the loop's rollout engine is ``openai`` (``settings.rollout_engine``), on that engine: ``served_policy`` saves
the policy's adapter as it is at the step, loads it there by a versioned name and runs the parity probe
against the trainer's own forward before a single rollout is sampled (``modeling.samplers``), so an engine
that kept older weights is refused, not trained on.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.experience.toolcalls import assistant_message, from_openai, tool_names
from pipeline.modeling.decoding import SamplingConfig, generate
from pipeline.modeling.templating import encode_prompt

if TYPE_CHECKING:
    from pipeline.modeling.samplers import OpenAISampler, Sampler
    from pipeline.scoring import EpisodeReward
    from pipeline.specs.modelspec import GrpoSettings

log = logging.getLogger(__name__)

__all__ = ["Episodes", "roll_out", "served_policy"]


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


def roll_out(
    model: Any,
    tokenizer: Any,
    items: list[dict[str, Any]],
    episodes: Episodes,
    settings: GrpoSettings,
    *,
    fmt: str,
    seed: int,
    sampler: Sampler | None = None,
    adapter: str | None = None,
) -> list[dict[str, Any]]:
    """``group_size`` episodes per item (in item order), each a finished trace: the item's messages, the
    policy's replies and, where the substrate executed calls, their results. The replies are ``model``'s
    (``decoding.generate`` in this process), or, with a ``sampler`` (the ``openai`` rollout engine), the
    engine's under its served name ``adapter`` (``served_policy``: ``model``'s adapter, probed)."""
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
        if sampler is None:
            texts = generate(model, tokenizer, prompts, config)
        else:
            texts = [[s.text for s in row] for row in sampler.sample(prompts, config, adapter=adapter)]
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


def first_prompts(
    tokenizer: Any, items: list[dict[str, Any]], episodes: Episodes, *, fmt: str
) -> list[list[int]]:
    """The token ids of ``items``' first-turn prompts as ``roll_out`` encodes them (a prompt the template
    refuses is left out): what the engine is about to be asked, for the parity probe's spot check."""
    from jinja2 import TemplateError

    prompts = []
    for item in items:
        tools = (item.get("metadata") or {}).get("tools") or episodes.tools or None
        try:
            prompts.append(encode_prompt(tokenizer, episodes.view(item["messages"]), fmt=fmt, tools=tools))
        except TemplateError:
            continue
    return prompts


def served_policy(
    model: Any,
    sampler: OpenAISampler,
    directory: Path,
    *,
    name: str,
    tolerance: float,
    prompts: Sequence[Sequence[int]] = (),
) -> str:
    """The name the ``openai`` engine samples ``model``'s policy under: its active adapter saved alone (not the
    reference beside it) to ``directory`` (replaced; it must be readable by the engine), loaded there as
    ``{name}-{sha256[:12]}`` and parity-probed against ``model`` on the fixed probe and on a few of
    ``prompts`` drawn at random (the step's own: a server that recognises the fixed probe is caught there;
    ``samplers.OpenAISampler.ready``: ``EngineRefused`` when the engine does not serve these weights)."""
    directory = Path(directory)
    shutil.rmtree(directory, ignore_errors=True)
    model.save_pretrained(directory, selected_adapters=[model.active_adapter], safe_serialization=True)
    return sampler.ready(directory, name=name, model=model, tolerance=tolerance, prompts=prompts)
