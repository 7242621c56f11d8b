"""The harness: everything around the frozen model that a generation can change without training.

Per specialist: a system prompt template with named slots, few-shot exemplars and decoding
parameters; shared tool definitions (OpenAI function tools), a context policy and the routing
policy (signal library, guardrails, learned-router settings). ``pipeline.specs.compatibility.check_harness``
lists every violation of a contract's context protocol. What the model is actually given (system prompt,
exemplars, trimmed conversation) is rendered by ``pipeline.modeling.prompting``.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from pipeline.experience.toolcalls import compact_value_ok
from pipeline.specs.contract import JsonSchema, Name, Regex, StrictModel, ToolCallFormat, Version
from pipeline.specs.loading import content_hash, load_spec


def template_slots(template: str) -> list[str]:
    """Names of the ``{slot}`` fields in a ``str.format`` template (raises ``ValueError`` if malformed)."""
    names = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"not a valid template ({exc}; write {{{{ and }}}} for literal braces)") from None
    for _, field, _, _ in parsed:
        if field is None:
            continue
        if not field.isidentifier():
            raise ValueError(f"slot {{{field}}} is not a plain name (use {{{{ and }}}} for literal braces)")
        names.append(field)
    return list(dict.fromkeys(names))


class ToolCallSpec(StrictModel):
    """A tool call inside an exemplar message (OpenAI shape, arguments as an object)."""

    name: Name = Field(description="Tool name (a tool declared in `tools`).")
    arguments: dict[str, Any] = Field(default_factory=dict, description="Call arguments.")


class ExemplarMessage(StrictModel):
    """One message of a few-shot exemplar."""

    role: str = Field(description="Message role; the contract decides which roles are allowed.")
    content: str | None = Field(default=None, description="Message text (null for a pure tool call).")
    tool_calls: list[ToolCallSpec] | None = Field(default=None, description="Assistant tool calls, if any.")

    @model_validator(mode="after")
    def _has_body(self) -> ExemplarMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError("a message needs `content` or `tool_calls`")
        return self


class Exemplar(StrictModel):
    """A few-shot example: a short exchange ending with the assistant's reply."""

    messages: list[ExemplarMessage] = Field(min_length=2, description="The exchange, user first.")

    @model_validator(mode="after")
    def _ends_with_assistant(self) -> Exemplar:
        if self.messages[-1].role != "assistant":
            raise ValueError("an exemplar must end with an assistant message")
        return self


class DecodingParams(StrictModel):
    """Sampling parameters of a specialist."""

    temperature: float = Field(default=0.0, ge=0.0, le=2.0, description="0 = greedy decoding.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_new_tokens: int = Field(default=128, ge=1, description="Generation length limit.")
    stop: list[str] = Field(default_factory=list, description="Stop strings (not included in the output).")


class SpecialistHarness(StrictModel):
    """The prompt, exemplars, decoding and tools of one specialist."""

    description: str = Field(default="", description="What this specialist handles (also shown to routers).")
    system_prompt: str = Field(description="System prompt template; `{slot}` fields are filled from `slots`.")
    slots: dict[Name, str] = Field(default_factory=dict, description="Values of the template's slots.")
    exemplars: list[Exemplar] = Field(
        default_factory=list, description="Few-shot exemplars (harness mutation adds)."
    )
    decoding: DecodingParams = Field(default_factory=DecodingParams, description="Decoding parameters.")
    tools: list[Name] = Field(
        default_factory=list, description="Names of the harness tools this specialist may call."
    )

    @model_validator(mode="after")
    def _slots_filled(self) -> SpecialistHarness:
        missing = [s for s in template_slots(self.system_prompt) if s not in self.slots]
        if missing:
            raise ValueError(f"system_prompt uses slots with no value in `slots`: {', '.join(missing)}")
        return self

    def render_system_prompt(self) -> str:
        """The system prompt with its slots filled."""
        return self.system_prompt.format(**self.slots)


class FunctionSpec(StrictModel):
    """An OpenAI function definition."""

    name: Name = Field(description="Function name the model calls.")
    description: str = Field(default="", description="What the function does (shown to the model).")
    parameters: JsonSchema = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description="JSON Schema of the arguments object (checked against the JSON Schema meta-schema).",
    )


class ToolSpec(StrictModel):
    """An OpenAI function tool: `{type: function, function: {name, description, parameters}}`."""

    type: Literal["function"] = Field(default="function", description="Tool type (only `function`).")
    function: FunctionSpec = Field(description="The function definition.")


class ContextPolicy(StrictModel):
    """How much conversation a specialist sees."""

    max_context_tokens: int = Field(ge=1, description="Context window the harness fills (prompt + history).")
    max_context_chars: int | None = Field(
        default=None,
        ge=8,
        description="Hard character budget of the whole context (rendered prompt plus the answer's "
        "`max_new_tokens`, one character each, as in a character-level model; e.g. 128 for the tiny "
        "model). Null: `max_context_tokens` times the contract's `chars_per_token`.",
    )
    include_system_prompt: bool = Field(
        default=True,
        description="Give the model the specialist's system prompt. Combination rule: one system message, "
        "the harness's prompt first, then each system/developer message of the client's conversation in "
        "order, joined by a blank line. False: no system message at all (client ones dropped too). Real "
        "chat models are tuned to follow one; a tiny model pretrained without system prompts is better "
        "served without (it spends scarce positions on text it never learned to use). The prompt is still "
        "validated and stored.",
    )
    keep_turns: int = Field(
        default=8, ge=0, description="Past user/assistant turns kept (oldest dropped first)."
    )
    other_specialists: Literal["full", "summary", "hide"] = Field(
        default="full",
        description="How other specialists' turns are shown: verbatim, as one-line summaries, or not at all.",
    )


class WeightedSignal(StrictModel):
    """A keyword or regex that votes for (or against) a specialist."""

    pattern: Regex = Field(description="Regular expression searched (case-insensitively) in the user turn.")
    weight: float = Field(default=1.0, gt=0, description="Votes added (positive) or subtracted (negative).")


class SignalSet(StrictModel):
    """The signal library of one specialist."""

    strong: list[Regex] = Field(default_factory=list, description="Patterns that route here immediately.")
    positive: list[WeightedSignal] = Field(default_factory=list, description="Patterns that add weight.")
    negative: list[WeightedSignal] = Field(default_factory=list, description="Patterns that subtract weight.")


class Guardrail(StrictModel):
    """A rule that overrides any routing decision (e.g. a code block goes to coding)."""

    pattern: Regex = Field(description="Regular expression searched in the user turn.")
    route: Name = Field(description="Specialist that must serve the turn when the pattern matches.")
    description: str = Field(default="", description="Why this rule exists.")


class LearnedRouting(StrictModel):
    """Settings of the learned router (a classifier over specialist labels)."""

    labels: list[Name] = Field(
        default_factory=list, description="Label vocabulary; empty means all specialists."
    )
    min_confidence: float = Field(
        default=0.6, ge=0.0, le=1.0, description="Below this, `hybrid` falls back to signals / default."
    )


class RoutingPolicy(StrictModel):
    """Which specialist serves a turn."""

    default: Name = Field(description="Specialist used when nothing decides.")
    entry: Name = Field(description="Specialist serving the first turn when nothing decides.")
    mode: Literal["signals", "learned", "hybrid"] = Field(
        default="signals",
        description="Signal library only, learned router only, or learned with signal fallback.",
    )
    signals: dict[Name, SignalSet] = Field(default_factory=dict, description="Signal library per specialist.")
    guardrails: list[Guardrail] = Field(
        default_factory=list, description="Overrides applied after the decision."
    )
    learned: LearnedRouting = Field(default_factory=LearnedRouting, description="Learned-router settings.")
    min_signal_score: float = Field(
        default=1.0, gt=0, description="Net positive weight needed to pick a specialist."
    )


class HarnessSpec(StrictModel):
    """A harness (one YAML file under ``harnesses/``)."""

    name: Name = Field(description="Harness name.")
    version: Version = Field(description="Version label (content-addressed in the registry).")
    description: str = Field(default="", description="What changed / what this harness is for.")
    tool_call_format: ToolCallFormat = Field(
        default="openai",
        description="How the model emits tool calls (must match the contract): `openai`, `json` or "
        "`compact` (`name(key=value,...)`, see `pipeline.experience.toolcalls`).",
    )
    specialists: dict[Name, SpecialistHarness] = Field(min_length=1, description="Per-specialist prompts.")
    tools: list[ToolSpec] = Field(
        default_factory=list, description="Tool definitions (OpenAI function tools)."
    )
    context: ContextPolicy = Field(description="Context policy.")
    routing: RoutingPolicy = Field(description="Routing policy.")

    @model_validator(mode="after")
    def _references(self) -> HarnessSpec:
        known = set(self.specialists)
        names = [t.function.name for t in self.tools]
        problems = [f"tool {n!r} is defined twice" for n in sorted({n for n in names if names.count(n) > 1})]
        for sp_name, sp in self.specialists.items():
            problems += [
                f"specialists.{sp_name}.tools: {t!r} is not a defined tool"
                for t in sp.tools
                if t not in names
            ]
        r = self.routing
        refs = [("routing.default", r.default), ("routing.entry", r.entry)]
        refs += [("routing.signals", n) for n in r.signals]
        refs += [(f"routing.guardrails[{i}].route", g.route) for i, g in enumerate(r.guardrails)]
        refs += [("routing.learned.labels", n) for n in r.learned.labels]
        problems += [f"{where}: {n!r} is not a declared specialist" for where, n in refs if n not in known]
        if self.tool_call_format == "compact":
            problems += self._compact_problems()
        if problems:
            raise ValueError("; ".join(problems) + f" (specialists: {', '.join(sorted(known))})")
        return self

    def _compact_problems(self) -> list[str]:
        """What the compact format cannot express: non-integer/string parameters, values with , = ( )."""
        out = []
        for t in self.tools:
            for key, prop in (t.function.parameters.get("properties") or {}).items():
                kind = prop.get("type") if isinstance(prop, dict) else None
                if kind not in ("integer", "string"):
                    out.append(
                        f"tools.{t.function.name}.{key}: type {kind!r} cannot be written in the compact "
                        "tool-call format (integers and strings only)"
                    )
        for sp_name, sp in self.specialists.items():
            for i, ex in enumerate(sp.exemplars):
                for j, msg in enumerate(ex.messages):
                    for call in msg.tool_calls or []:
                        bad = [k for k, v in call.arguments.items() if not compact_value_ok(v)]
                        out += [
                            f"specialists.{sp_name}.exemplars[{i}].messages[{j}]: argument "
                            f"{k}={call.arguments[k]!r} cannot be written in the compact tool-call format"
                            for k in bad
                        ]
        return out

    def tool(self, name: str) -> ToolSpec | None:
        """The tool named ``name``, if defined."""
        return next((t for t in self.tools if t.function.name == name), None)

    def tools_for(self, specialist: str) -> list[ToolSpec]:
        """Tools the specialist may call (all tools when the specialist is unknown or lists none)."""
        sp = self.specialists.get(specialist)
        if sp is None or not sp.tools:
            return list(self.tools)
        return [t for t in self.tools if t.function.name in sp.tools]


def load_harness(path: str | Path) -> HarnessSpec:
    """Load and validate a harness YAML file (raises ``SpecError`` listing every problem)."""
    return load_spec(path, HarnessSpec)


def harness_hash(spec: HarnessSpec) -> str:
    """The harness's content address."""
    return content_hash(spec)
