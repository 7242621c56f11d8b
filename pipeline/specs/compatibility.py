"""Whether a harness satisfies a contract's context protocol: roles, slots, tool format, context budget.

``check_harness(harness, contract)`` lists every violation (empty: compatible); ``require_compatible``
raises with the first one. Prompt sizes are measured as ``pipeline.modeling.prompting`` renders them.
"""

from __future__ import annotations

from pipeline.errors import RatchetError
from pipeline.modeling.prompting import exemplar_messages, message_chars
from pipeline.specs.contract import ContractSpec
from pipeline.specs.harness import HarnessSpec, template_slots

__all__ = ["check_harness", "require_compatible"]


def check_harness(harness: HarnessSpec, contract: ContractSpec) -> list[str]:
    """Every way ``harness`` violates ``contract``'s context protocol (empty list: compatible)."""
    proto = contract.protocol
    budget = proto.context_budget
    out: list[str] = []
    if harness.tool_call_format != proto.tool_call_format:
        out.append(
            f"tool_call_format is {harness.tool_call_format!r}, the contract requires {proto.tool_call_format!r}"
        )
    if harness.context.max_context_tokens > budget.max_tokens:
        out.append(
            f"context.max_context_tokens {harness.context.max_context_tokens} exceeds the contract's "
            f"context budget of {budget.max_tokens} tokens"
        )
    for name in sorted(set(contract.specialists) - set(harness.specialists)):
        out.append(f"specialist {name!r} of the contract has no entry in the harness")
    window = min(budget.max_tokens, harness.context.max_context_tokens)
    for name, sp in harness.specialists.items():
        where = f"specialists.{name}"
        if name not in contract.specialists:
            out.append(
                f"{where}: specialist not covered by the contract (contract: {', '.join(contract.specialists)})"
            )
            continue
        template = set(template_slots(sp.system_prompt))
        for slot in contract.required_slots_for(name):
            if slot not in template:
                out.append(f"{where}.system_prompt: required slot {{{slot}}} is not used")
            elif not sp.slots.get(slot, "").strip():
                out.append(f"{where}.slots.{slot}: required slot is empty")
        if harness.context.include_system_prompt and "system" not in proto.roles:
            out.append(f"{where}: the contract does not allow the `system` role used by the system prompt")
        for i, ex in enumerate(sp.exemplars):
            for j, msg in enumerate(ex.messages):
                if msg.role not in proto.roles:
                    out.append(
                        f"{where}.exemplars[{i}].messages[{j}].role: {msg.role!r} is not allowed "
                        f"(allowed: {', '.join(proto.roles)})"
                    )
                for call in msg.tool_calls or []:
                    if call.name not in {t.function.name for t in harness.tools_for(name)}:
                        out.append(f"{where}.exemplars[{i}].messages[{j}]: calls unknown tool {call.name!r}")
        system_chars = len(sp.render_system_prompt()) if harness.context.include_system_prompt else 0
        prompt_chars = system_chars + sum(
            message_chars(m, harness.tool_call_format) for ex in exemplar_messages(harness, name) for m in ex
        )
        if budget.max_system_chars is not None and prompt_chars > budget.max_system_chars:
            out.append(
                f"{where}: system prompt + exemplars are {prompt_chars} chars, over the contract's "
                f"max_system_chars {budget.max_system_chars}"
            )
        est_tokens = prompt_chars / budget.chars_per_token
        if est_tokens + sp.decoding.max_new_tokens > window:
            out.append(
                f"{where}: system prompt + exemplars (~{est_tokens:.0f} tokens) plus max_new_tokens "
                f"{sp.decoding.max_new_tokens} exceed the context window of {window} tokens"
            )
        chars = harness.context.max_context_chars
        if chars is not None and prompt_chars + sp.decoding.max_new_tokens >= chars:
            out.append(
                f"{where}: system prompt + exemplars ({prompt_chars} chars) plus max_new_tokens "
                f"{sp.decoding.max_new_tokens} leave no room for the conversation in "
                f"context.max_context_chars {chars}"
            )
    chars = harness.context.max_context_chars
    if chars is not None and chars > budget.max_tokens * budget.chars_per_token:
        out.append(
            f"context.max_context_chars {chars} exceeds the contract's context budget of {budget.max_tokens} "
            f"tokens x {budget.chars_per_token:g} chars per token"
        )
    return out


def require_compatible(harness: HarnessSpec, contract: ContractSpec) -> None:
    """Raise ``RatchetError`` with the first violation (and the count) when the harness breaks the contract."""
    problems = check_harness(harness, contract)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise RatchetError(
            f"harness {harness.name} {harness.version} violates contract {contract.name} {contract.version}: "
            f"{problems[0]}{more}"
        )
