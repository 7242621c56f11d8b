"""Harness co-design: mutation operators that propose harness variants of a parent harness.

``propose_variants(parent, top_traces=..., contract=..., rng_seed=...)`` returns up to ``max_variants`` new
``HarnessVariant``s (with ``include_parent=True``, the parent first: the "no change" candidate), each
from one operator:

- ``fewshot``: each specialist's exemplars become a few of its top-scoring exchanges (the newest user
  message and the replies after it), chosen only among traces the contract verified at or above its
  selection threshold, never ones the held-out predicate excludes (``pipeline.specs.heldout``), and only as
  many as fit the context budget next to the longest prompt seen (so a real turn still fits);
- ``decoding``: ``max_new_tokens`` tightened to the longest successful answer (characters, an upper
  bound of tokens for any tokenizer on ASCII text) plus a margin, and ``"\\n"`` added as a stop string
  when no successful answer contains a newline. Never loosened: no evidence says longer answers help;
- ``prompt`` (only when the harness shows system prompts): either an ``{answer_format}`` slot showing a
  successful answer, or the template cut down to the contract's required slots (fewer characters).

A variant's version label is derived from the parent's and its content: ``v1+fewshot.3f2a9c`` (the
hash covers everything but the version and description, so the same content gets the same label).
Every variant passes ``check_harness`` against the contract; one that would not is dropped. The
contract itself is never changed. The caller evaluates every variant as a model-harness pair on the
held-out suites and keeps the best; the parent is one of them, so "no change" is a legitimate outcome.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from pipeline.experience.toolcalls import call_text, compact_value_ok
from pipeline.modeling.prompting import (
    MESSAGE_OVERHEAD_CHARS,
    PROMPT_OVERHEAD_CHARS,
    message_chars,
    prompt_budget_chars,
)
from pipeline.specs.compatibility import check_harness, require_compatible
from pipeline.specs.contract import ContractSpec
from pipeline.specs.harness import Exemplar, ExemplarMessage, HarnessSpec, ToolCallSpec, template_slots
from pipeline.specs.loading import content_hash

if TYPE_CHECKING:
    from pipeline.specs.heldout import HeldoutIndex

log = logging.getLogger(__name__)

OPERATORS = ("fewshot", "decoding", "prompt")
MAX_EXEMPLARS = 3  # per specialist: each one costs context and the tiny model's window is 128 chars
POOL = 8  # exemplars are drawn from this many best distinct prompts
FORMAT_SLOT = "answer_format"
MAX_VERSION = 100

__all__ = ["OPERATORS", "HarnessVariant", "parent_variant", "propose_variants", "variant_label"]


@dataclass(frozen=True)
class HarnessVariant:
    """A candidate harness: its version label, the operator that made it, the spec, what changed."""

    label: str
    operator: str
    spec: HarnessSpec
    description: str


def _content_key(spec: HarnessSpec) -> str:
    return content_hash(spec.model_dump(mode="json", exclude={"version", "description"}))


def variant_label(parent_version: str, operator: str, spec: HarnessSpec) -> str:
    """``<parent>+<operator>.<hash6>``; when that passes 100 characters, ``<root>+<operator>.<hash6>``."""
    tail = f"+{operator}.{_content_key(spec)[:6]}"
    label = parent_version + tail
    return (
        label if len(label) <= MAX_VERSION else parent_version.split("+")[0][: MAX_VERSION - len(tail)] + tail
    )


def parent_variant(parent: HarnessSpec) -> HarnessVariant:
    """The parent as a candidate ("no change")."""
    return HarnessVariant(parent.version, "parent", parent, "the parent harness, unchanged")


# ------------------------------------------------------------------------------------------ evidence
def _eligible(
    traces: list[dict[str, Any]], contract: ContractSpec, heldout: HeldoutIndex
) -> list[dict[str, Any]]:
    """Verified traces at or above the selection threshold, not held out, best first (stable)."""
    out = []
    for t in traces:
        score = t.get("score")
        if t.get("verified") is not True:
            continue
        if not isinstance(score, (int, float)) or score < contract.selection.min_score:
            continue
        if heldout.exclusion(
            messages=t.get("messages") or [], metadata=t.get("metadata"), source=t.get("source")
        ):
            continue
        if _exchange(t.get("messages") or []) is None:
            continue
        out.append(t)
    return sorted(out, key=lambda t: -float(t["score"]))


def _exchange(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The newest user message and everything after it, when that ends with an assistant reply."""
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if not users:
        return None
    tail = messages[users[-1] :]
    last = tail[-1]
    if (
        len(tail) < 2
        or last.get("role") != "assistant"
        or not (last.get("content") or last.get("tool_calls"))
    ):
        return None
    if not isinstance(tail[0].get("content"), str):
        return None
    return tail


def _calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for tc in message.get("tool_calls") or []:
        fn = tc.get("function") or {}
        args = fn.get("arguments") or {}
        if isinstance(args, str):
            args = json.loads(args) if args.strip() else {}
        out.append({"name": fn.get("name"), "arguments": args})
    return out


def _answer_text(trace: dict[str, Any], fmt: str) -> str:
    """The final reply as the model wrote it (tool calls in the harness's format)."""
    last = _exchange(trace["messages"])[-1]  # type: ignore[index]
    calls = _calls(last)
    if calls:
        return "\n".join(call_text(c["name"], c["arguments"], fmt) for c in calls)
    return str(last.get("content") or "")


def _exemplar(trace: dict[str, Any]) -> Exemplar | None:
    try:
        msgs = []
        for m in _exchange(trace["messages"]) or []:
            calls = [ToolCallSpec(**c) for c in _calls(m)] or None
            content = m.get("content") if isinstance(m.get("content"), str) else None
            msgs.append(ExemplarMessage(role=m["role"], content=content, tool_calls=calls))
        return Exemplar(messages=msgs)
    except (ValidationError, ValueError, TypeError, KeyError):
        return None


# ------------------------------------------------------------------------------------------ operators
Evidence = dict[str, list[dict[str, Any]]]
# A proposal: the variant's data, what the operator did, and a note per specialist it changed.
Proposal = tuple[dict[str, Any], str, dict[str, str]]
Operator = Callable[[HarnessSpec, Evidence, ContractSpec, random.Random], Iterator[Proposal]]


def _fewshot(parent: HarnessSpec, evidence: Evidence, contract: ContractSpec, rng: random.Random):
    data = parent.model_dump(mode="json")
    fmt = parent.tool_call_format
    cpt = contract.protocol.context_budget.chars_per_token
    max_system = contract.protocol.context_budget.max_system_chars
    notes = {}
    for name, traces in evidence.items():
        sp = parent.specialists[name]
        tools = {t.function.name for t in parent.tools_for(name)}
        pool, seen = [], set()
        for t in traces:
            ex = _exemplar(t)
            prompt = ex.messages[0].content if ex else None
            if (
                ex is None
                or prompt in seen
                or any(m.role not in contract.protocol.roles for m in ex.messages)
            ):
                continue
            calls = [c for m in ex.messages for c in m.tool_calls or []]
            if any(c.name not in tools for c in calls):
                continue
            if fmt == "compact" and not all(compact_value_ok(v) for c in calls for v in c.arguments.values()):
                continue
            seen.add(prompt)
            pool.append(ex)
            if len(pool) == POOL:
                break
        if not pool:
            continue
        rng.shuffle(pool)
        system = len(sp.render_system_prompt()) if parent.context.include_system_prompt else 0
        longest = max(len(_exchange(t["messages"])[0]["content"]) for t in traces)  # type: ignore[index]
        fixed = PROMPT_OVERHEAD_CHARS + message_chars({"content": "x" * longest})
        fixed += system + MESSAGE_OVERHEAD_CHARS if system else 0
        budget = prompt_budget_chars(parent, name, chars_per_token=cpt)
        want, chosen, used = rng.randint(1, MAX_EXEMPLARS), [], 0
        for ex in pool:
            cost = sum(message_chars(_openai(m), fmt) for m in ex.messages)
            fits = fixed + used + cost <= budget
            if max_system is not None:
                fits = fits and system + used + cost <= max_system
            if fits:
                chosen.append(ex)
                used += cost
            if len(chosen) == want:
                break
        if chosen:
            data["specialists"][name]["exemplars"] = [ex.model_dump(mode="json") for ex in chosen]
            notes[name] = str(len(chosen))
    if notes:
        yield data, "exemplars from top-scoring experience", notes


def _openai(m: ExemplarMessage) -> dict[str, Any]:
    calls = [{"function": {"name": c.name, "arguments": c.arguments}} for c in m.tool_calls or []]
    return {"role": m.role, "content": m.content, "tool_calls": calls}


def _decoding(parent: HarnessSpec, evidence: Evidence, contract: ContractSpec, rng: random.Random):
    data = parent.model_dump(mode="json")
    notes = {}
    for name, traces in evidence.items():
        dec = data["specialists"][name]["decoding"]
        answers = [_answer_text(t, parent.tool_call_format) for t in traces]
        longest = max(len(a) for a in answers)
        # Margin: a quarter of the answer (at least 4 characters) plus the end-of-sequence token.
        tight = longest + max(4, math.ceil(longest / 4)) + 1
        done = []
        if tight < dec["max_new_tokens"]:
            done.append(f"max_new_tokens {dec['max_new_tokens']} -> {tight}")
            dec["max_new_tokens"] = tight
        if "\n" not in dec["stop"] and not any("\n" in a.strip() for a in answers):
            dec["stop"] = [*dec["stop"], "\n"]
            done.append("stop at newline")
        if done:
            notes[name] = ", ".join(done)
    if notes:
        yield data, "decoding fitted to successful answers", notes


def _prompt(parent: HarnessSpec, evidence: Evidence, contract: ContractSpec, rng: random.Random):
    if not parent.context.include_system_prompt:
        return  # the model never sees the prompt: a variant could not change the outcome
    kinds = ["format", "terse"]
    rng.shuffle(kinds)
    for kind in kinds:
        data = parent.model_dump(mode="json")
        notes = {}
        for name, traces in evidence.items():
            sp = data["specialists"][name]
            before = (sp["system_prompt"], dict(sp["slots"]))
            if kind == "format":
                example = _answer_text(traces[0], parent.tool_call_format).strip().replace("\n", " ")[:60]
                if FORMAT_SLOT not in template_slots(sp["system_prompt"]):
                    sp["system_prompt"] = (sp["system_prompt"] + " {" + FORMAT_SLOT + "}").strip()
                sp["slots"][FORMAT_SLOT] = f"Reply like: {example}"
            else:
                required = contract.required_slots_for(name)
                sp["system_prompt"] = " ".join("{" + s + "}" for s in required)
                sp["slots"] = {k: v for k, v in sp["slots"].items() if k in required}
            if (sp["system_prompt"], sp["slots"]) != before:
                notes[name] = repr(sp["system_prompt"])
        if notes:
            what = "an answer-format slot" if kind == "format" else "the prompt cut to its required slots"
            yield data, f"system prompt with {what}", notes


_OPERATORS: dict[str, Operator] = {"fewshot": _fewshot, "decoding": _decoding, "prompt": _prompt}


def _fitted(parent: HarnessSpec, data: dict[str, Any], contract: ContractSpec) -> HarnessSpec | None:
    """The variant with every specialist that breaks the contract restored to the parent's entry (None
    when nothing is left changed or the variant is not a valid harness)."""
    original = parent.model_dump(mode="json")["specialists"]
    for _ in range(len(original) + 1):
        try:
            spec = HarnessSpec.model_validate(data)
        except ValidationError as exc:
            log.info("codesign: a variant of %s is not a valid harness: %s", parent.version, exc)
            return None
        problems = check_harness(spec, contract)
        broken = {name for name in original for p in problems if p.startswith(f"specialists.{name}")}
        if not problems:
            return spec if _content_key(spec) != _content_key(parent) else None
        if not broken:
            return None
        for name in broken:
            data["specialists"][name] = copy.deepcopy(original[name])
    return None


def propose_variants(
    parent: HarnessSpec,
    *,
    top_traces: dict[str, list[dict[str, Any]]],
    contract: ContractSpec,
    heldout: HeldoutIndex,
    rng_seed: int,
    max_variants: int = 3,
    include_parent: bool = False,
) -> list[HarnessVariant]:
    """Up to ``max_variants`` distinct new variants (the parent first when ``include_parent``).

    ``top_traces[specialist]`` holds scored traces ``{"messages", "score", "verified", "specialist"}``
    (optionally ``metadata``, ``source``), e.g. the best experience of the lineage under ``contract``; only
    verified ones that ``heldout`` does not exclude become exemplars.
    Deterministic for the same inputs and ``rng_seed``; the operators are tried in an order drawn from
    the seed, so a small ``max_variants`` still reaches every operator over successive generations.
    Raises ``RatchetError`` when the parent itself violates the contract.
    """
    require_compatible(parent, contract)
    evidence = {
        name: eligible
        for name in parent.specialists
        if name in contract.specialists
        and (eligible := _eligible(top_traces.get(name) or [], contract, heldout))
    }
    order = list(OPERATORS)
    random.Random(f"codesign:{rng_seed}:order").shuffle(order)
    out = [parent_variant(parent)] if include_parent else []
    seen = {_content_key(parent)}
    for op in order:
        if len(out) - include_parent >= max_variants:
            break
        for data, what, notes in _OPERATORS[op](
            parent, evidence, contract, random.Random(f"codesign:{rng_seed}:{op}")
        ):
            spec = _fitted(parent, data, contract)
            if spec is None or _content_key(spec) in seen:
                continue
            kept = [n for n in notes if spec.specialists[n] != parent.specialists[n]]
            description = f"{what} (" + "; ".join(f"{n}: {notes[n]}" for n in kept) + ")"
            label = variant_label(parent.version, op, spec)
            spec = HarnessSpec.model_validate(
                {
                    **spec.model_dump(mode="json"),
                    "version": label,
                    "description": f"{parent.version} + {description}",
                }
            )
            seen.add(_content_key(spec))
            out.append(HarnessVariant(label, op, spec, description))
            break
        else:
            log.info(
                "codesign: no %s variant of %s satisfies the contract and changes anything",
                op,
                parent.version,
            )
    return out
