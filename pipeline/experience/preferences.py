"""Preference pairs: what ``method: dpo`` learns from -- two replies to the same prompt, ranked by the contract.

``preference_pairs`` groups the lineage's verified experience of a specialist by prompt
(``eligibility.prompt_key``: the conversation before the final assistant turn, system prompts aside). In a
group, every distinct reply (the final assistant turn) that the group's best reply -- highest total, then
newest -- beats by at least ``selection.min_preference_margin`` becomes the *other* side of a pair whose
*preferred* side is that best reply, when it passed (a verifying check applied to its final turn and none
failed) and reaches ``selection.min_score`` (the preferred reply is also trained on, with ``sft_weight``).
Both replies were checked by the contract: a form-only score never ranks anything. Replies are ranked on
their final turn's score. An accepted user correction (a trusted principal's, scored under the contract
without its rating, and passed: ``eligibility.accepted_correction``) is a reply of its group like any other,
and is preferred to the reply it corrects when that reply was itself checked and scored below the selection
threshold -- never to a reply nothing checked, or to one the contract found right.

Never in a pair: a held-out trace (``eligibility.load_candidates`` applies the shared predicate, and every
pair's two conversations are checked again, so a correction cannot smuggle a held-out prompt in), a reply the
server cut off (timeout, disconnect), the validation slice of a specialist without a task source. Both
conversations of a pair share the preferred trace's context. At most ``max_pairs[specialist]`` are kept,
largest margins first, newest first among equal ones.

Reasons counted per specialist (``Drops``), besides those of ``load_candidates``: ``unverified``, ``held-out``,
``reply stopped before its end``, ``validation slice``, ``no pair within margin`` (a reply no other beats by
the margin, and that beats none), ``over principal share`` (pairs whose preferred side is an outside
principal's beyond ``selection.max_share_per_principal``), ``over cap`` (pairs).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipeline.experience.eligibility import (
    Drops,
    accepted_correction,
    cap_principal_share,
    excluded,
    in_validation_slice,
    prompt_key,
)

if TYPE_CHECKING:
    from pipeline.experience.eligibility import Candidate
    from pipeline.specs.contract import ContractSpec
    from pipeline.specs.heldout import HeldoutIndex


@dataclass
class PairResult:
    """Per specialist, the preference rows (``messages``: preferred conversation, ``rejected``: the other),
    and why the rest was left out."""

    dropped: Drops
    pairs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


@dataclass(frozen=True)
class _Reply:
    score: float
    order: int  # arrival order (experience id order): larger is newer
    messages: list[dict[str, Any]]
    experience_id: int
    tools: Any
    principal: str | None = None  # whose reply it is (the corrector's, for an accepted correction)
    passed: bool = True  # checked, and no verifying check failed on it (only such a reply is preferred)
    metadata: dict[str, Any] = field(default_factory=dict)  # its trace's (what the held-out check reads)


_PRIVATE = ("principal", "metadata", "rejected_metadata")  # what a row carries through selection, not saved


def _reply_key(messages: list[dict[str, Any]]) -> str:
    """The final assistant turn's content address (what makes two replies the same reply)."""
    last = messages[max(i for i, m in enumerate(messages) if m.get("role") == "assistant")]
    body = {"content": last.get("content"), "tool_calls": last.get("tool_calls")}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _through_final_reply(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation up to and including its final assistant turn (what follows it is no part of the
    reply being ranked)."""
    last = max(i for i, m in enumerate(messages) if m.get("role") == "assistant")
    return messages[: last + 1]


def _with_reply(context_from: list[dict[str, Any]], reply_from: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``context_from``'s conversation before its final assistant turn, then ``reply_from``'s final turn."""
    last = max(i for i, m in enumerate(context_from) if m.get("role") == "assistant")
    final = max(i for i, m in enumerate(reply_from) if m.get("role") == "assistant")
    return [*context_from[:last], reply_from[final]]


def preference_pairs(
    candidates: list[Candidate],
    *,
    contract: ContractSpec,
    heldout: HeldoutIndex,
    specialists: list[str],
    max_pairs: dict[str, int],
) -> PairResult:
    """Preference rows per specialist from verified experience (see the module doc)."""
    from pipeline.serving.turns import STOPPED  # lazy: imports fastapi

    rules = contract.selection
    wanted = set(specialists)
    sliced = {s for s, entry in contract.specialists.items() if entry.tasks is None}
    drops = Drops()

    def drop(specialist: str, reason: str, principal: str | None, n: int = 1) -> None:
        drops.add(specialist, reason, n, principal=principal)

    groups: dict[tuple[str, str], dict[str, _Reply]] = {}
    corrections: dict[str, list[tuple[float, int, dict[str, Any]]]] = {s: [] for s in wanted}

    def add(group: dict[str, _Reply], reply: _Reply) -> None:
        key = _reply_key(reply.messages)
        if key not in group or (reply.score, reply.order) > (group[key].score, group[key].order):
            group[key] = reply

    for order, cand in enumerate(candidates):
        if cand.specialist not in wanted:
            continue
        if rules.sources is not None and cand.source not in rules.sources:
            drop(cand.specialist, "source not selected", cand.principal)
            continue
        if excluded(cand, heldout):
            drop(cand.specialist, "held-out", cand.principal)
            continue
        if not any(m.get("role") == "assistant" for m in cand.messages):
            drop(cand.specialist, "no assistant turn", cand.principal)
            continue
        if cand.specialist in sliced and in_validation_slice(cand.messages, rules.validation_share):
            drop(cand.specialist, "validation slice", cand.principal)
            continue
        tools = cand.metadata.get("tools")
        corrected = accepted_correction(cand, contract)
        if corrected is not None and cand.correction:
            fixed = _Reply(float(cand.correction["total"]), order, corrected, cand.experience_id, tools,
                           cand.corrector(), metadata=cand.metadata)  # fmt: skip
            wrong = cand.verified and cand.score is not None and cand.score < rules.min_score
            if wrong and cand.metadata.get("finish_reason") not in STOPPED:
                row = {
                    "messages": corrected,
                    "rejected": _with_reply(corrected, _through_final_reply(cand.messages)),
                    "score": fixed.score,
                    "rejected_score": cand.score,
                    "margin": 1.0,  # a user's accepted correction outranks the checked reply it corrects
                    "experience_id": cand.experience_id,
                    "rejected_experience_id": cand.experience_id,
                    "tools": tools,
                    "principal": fixed.principal,
                    "metadata": cand.metadata,
                    "rejected_metadata": cand.metadata,
                }
                corrections[cand.specialist].append((1.0, order, row))
            else:  # nothing says the reply it replaces was wrong: the correction only joins its group
                add(groups.setdefault((cand.specialist, prompt_key(corrected)), {}), fixed)
            continue
        if not cand.verified or cand.score is None:
            drop(cand.specialist, "unverified", cand.principal)
            continue
        if cand.metadata.get("finish_reason") in STOPPED:
            drop(cand.specialist, "reply stopped before its end", cand.principal)
            continue
        messages = _through_final_reply(cand.messages)
        reply = _Reply(
            float(cand.score),
            order,
            messages,
            cand.experience_id,
            tools,
            cand.principal,
            cand.passed,
            cand.metadata,
        )
        add(groups.setdefault((cand.specialist, prompt_key(messages)), {}), reply)
    ranked: dict[str, list[tuple[float, int, dict[str, Any]]]] = corrections
    for (specialist, _), group in groups.items():
        replies = sorted(group.values(), key=lambda r: (r.score, r.order), reverse=True)
        preferable = [r for r in replies if r.passed and r.score >= rules.min_score]
        if not preferable:  # the preferred side is also trained on (RPO): it must pass
            for r in replies:
                drop(specialist, "no pair within margin", r.principal)
            continue
        best, paired = preferable[0], 0
        for other in replies:
            margin = best.score - other.score
            if other is best or margin < rules.min_preference_margin:
                continue
            paired += 1
            row = {
                "messages": best.messages,
                "rejected": _with_reply(best.messages, other.messages),
                "score": best.score,
                "rejected_score": other.score,
                "margin": margin,
                "experience_id": best.experience_id,
                "rejected_experience_id": other.experience_id,
                "tools": best.tools or other.tools,
                "principal": best.principal,
                "metadata": best.metadata,
                "rejected_metadata": other.metadata,
            }
            ranked[specialist].append((margin, max(best.order, other.order), row))
        for r in replies:
            if r is not best and best.score - r.score < rules.min_preference_margin:
                drop(specialist, "no pair within margin", r.principal)
        if not paired:
            drop(specialist, "no pair within margin", best.principal)
    result = PairResult(dropped=drops)
    for specialist in sorted(wanted):
        rows = []
        for _, _, row in sorted(ranked[specialist], key=lambda r: (r[0], r[1]), reverse=True):
            # each side as it is trained on, with its own trace's metadata (a side's reply that is its own
            # reference answer is no held-out answer: ``heldout``); a correction's own text is checked here too
            if heldout.teaches(row["messages"], row["metadata"]) or any(  # the preferred side is learned
                heldout.exclusion(messages=row[side], metadata=row[meta]) is not None
                for side, meta in (("messages", "metadata"), ("rejected", "rejected_metadata"))
            ):
                drop(specialist, "held-out", row["principal"])
                continue
            rows.append(row)
        kept, over_share = cap_principal_share(
            rows, share=rules.max_share_per_principal, principal_of=lambda r: r["principal"],
            cap=max_pairs[specialist],
        )  # fmt: skip
        placed = {id(r) for r in kept} | {id(r) for r in over_share}
        for reason, left in (("over principal share", over_share),
                             ("over cap", [r for r in rows if id(r) not in placed])):  # fmt: skip
            for r in left:
                drop(specialist, reason, r["principal"])
        result.pairs[specialist] = [{k: v for k, v in r.items() if k not in _PRIVATE} for r in kept]
    return result
