"""Template probes: whether the model's chat template takes every kind of conversation the harness gives it.

``check_template`` renders one probe conversation per feature a harness uses through the model's own
tokenizer and chat template (``templating.encode_chat``: the prompt with its generation header, and the
reply as it is trained), at ``ratchet init`` and in ``ratchet contract lint`` given a model spec:

- a system prompt, when ``context.include_system_prompt`` and the specialist's system prompt is not empty;
- a tool result, for a specialist with tools: its call, the tool's result, its answer;
- its exemplars, as the specialist sees them (``prompting.render_messages``);
- several calls in one reply, for a specialist with tools.

A template that refuses one of the first three (Gemma-2 refuses a system role and, having no tool role,
a tool result; Mistral refuses a tool result written as text) stops ``init`` with one line naming the
feature, the harness and the specialist: every such conversation would otherwise fail at serving (a 400)
and be left out of training. Several calls in one reply (Llama-3.1 takes one) stop it only when a harness
exemplar has such a reply (the specialist would be shown it on every turn); otherwise one warning says such
replies are never trained on (their rows are left out and counted).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from pipeline.environment.tinymodel import build_tokenizer
from pipeline.errors import RatchetError
from pipeline.experience.toolcalls import openai_tool_call
from pipeline.modeling.pair import offered_tools
from pipeline.modeling.prompting import render_messages
from pipeline.modeling.templating import TEMPLATE_ERROR, RowSkipped, encode_chat

if TYPE_CHECKING:
    from pipeline.specs.harness import HarnessSpec
    from pipeline.specs.modelspec import ModelSpec

log = logging.getLogger(__name__)

SYSTEM, TOOL_RESULT, EXEMPLARS, SEVERAL_CALLS = (
    "a system prompt",
    "a tool result",
    "its exemplars",
    "several calls in one reply",
)
ASK, ANSWER = "ping", "pong"


@dataclass(frozen=True)
class Probe:
    """One conversation showing one feature of a specialist's prompts; ``required``: a template that refuses
    it refuses the lineage (else a warning)."""

    feature: str
    specialist: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    required: bool = True


def _call(name: str, n: int) -> dict[str, Any]:

    return openai_tool_call({"name": name, "arguments": {}}, seed_text=f"probe#{n}")


def probes(harness: HarnessSpec, specialists: list[str]) -> list[Probe]:
    """The probe conversations of ``specialists`` (those the harness declares), in the order they are
    checked: system prompt, tool result, exemplars, several calls."""

    user, answer = {"role": "user", "content": ASK}, {"role": "assistant", "content": ANSWER}
    out: list[Probe] = []
    for name in specialists:
        sp = harness.specialists.get(name)
        if sp is None:
            continue
        tools = offered_tools(harness, name) or None
        system = sp.render_system_prompt() if harness.context.include_system_prompt else ""
        if system:
            out.append(Probe(SYSTEM, name, [{"role": "system", "content": system}, user, answer], tools))
        if tools:
            tool = str(tools[0]["function"]["name"])
            call = _call(tool, 0)
            result = {"role": "tool", "tool_call_id": call["id"], "content": "ok"}
            episode = [user, {"role": "assistant", "content": None, "tool_calls": [call]}, result, answer]
            out.append(Probe(TOOL_RESULT, name, episode, tools))
        if sp.exemplars:
            out.append(Probe(EXEMPLARS, name, [*render_messages(harness, name, [user]), answer], tools))
        if tools:
            calls = [_call(str(t["function"]["name"]), n) for n, t in enumerate([tools[0], *tools][:2])]
            results = [{"role": "tool", "tool_call_id": c["id"], "content": "ok"} for c in calls]
            several = [user, {"role": "assistant", "content": None, "tool_calls": calls}, *results, answer]
            shown = any(len(m.tool_calls or []) > 1 for ex in sp.exemplars for m in ex.messages)
            out.append(Probe(SEVERAL_CALLS, name, several, tools, required=shown))
    return out


def refusal(tokenizer: Any, probe: Probe, fmt: str) -> str | None:
    """What the chat template says when it refuses ``probe`` (its first line), or None when it takes it."""

    try:
        encode_chat(tokenizer, probe.messages, 1 << 30, fmt=fmt, tools=probe.tools)
    except TemplateError as exc:
        return _first_line(exc)
    except RowSkipped as exc:
        if exc.reason != TEMPLATE_ERROR:
            return None  # not a refusal: how the template renders a turn (checked where rows are encoded)
        return _first_line(exc.__cause__ if isinstance(exc.__cause__, TemplateError) else exc)
    return None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def check_template(
    tokenizer: Any, harness: HarnessSpec, *, specialists: list[str], model: str, where: str
) -> list[str]:
    """Render every probe of ``harness`` for ``specialists``; ``RatchetError`` (one line, naming the
    feature) at the first one the template refuses that the harness cannot do without; returns the warnings
    (logged once each) for the others. ``model`` names the model, ``where`` the model spec file."""
    warnings: list[str] = []
    for probe in probes(harness, specialists):
        said = refusal(tokenizer, probe, harness.tool_call_format)
        if said is None:
            continue
        by = "an exemplar of harness" if probe.feature == SEVERAL_CALLS else "harness"
        used = f"used by {by} {harness.name} {harness.version}, specialist {probe.specialist}"
        if probe.required:
            raise RatchetError(
                f"{where}: the chat template of {model} rejects {probe.feature} ({used}): {said}"
            )
        if not warnings:  # the one optional feature: said once, not per specialist
            warnings.append(
                f"{where}: the chat template of {model} rejects {probe.feature} ({said}): such replies are "
                "never trained on (their rows are left out, counted), and a conversation holding one is refused"
            )
            log.warning("%s", warnings[-1])
    return warnings


def spec_dirs(model: ModelSpec, model_path: Path) -> tuple[Path | None, Path | None]:
    """``(base_dir, tokenizer_dir)`` a model spec names, relative paths taken from its file's folder (None:
    the tiny model's base; the base's own tokenizer)."""

    def resolve(text: str) -> Path:
        path = Path(text).expanduser()
        return path if path.is_absolute() else (Path(model_path).resolve().parent / path).resolve()

    base = resolve(model.base.path) if model.base.path is not None else None
    return base, resolve(model.tokenizer) if model.tokenizer != "same_as_base" else None


def spec_tokenizer(model: ModelSpec, *, base_dir: Path | None, tokenizer_dir: Path | None) -> Any:
    """The tokenizer (with its chat template) a model spec names: ``tokenizer_dir`` when the spec names
    one, else the base directory's; the tiny model's built in code (its base need not be built yet)."""
    if tokenizer_dir is None and model.base.path is None:
        return build_tokenizer()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    source = tokenizer_dir or base_dir
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source))
    except (OSError, ValueError) as exc:
        raise RatchetError(
            f"cannot load the tokenizer at {source} to check its chat template: {exc}"
        ) from None
    if not getattr(tokenizer, "chat_template", None):
        raise RatchetError(
            f"the tokenizer at {source} has no chat template: conversations cannot be rendered"
        )
    return tokenizer
