"""Preference pairs: what ``method: dpo`` learns from -- two replies to the same prompt, ranked by the contract.

``preference_pairs`` groups the lineage's verified experience of a specialist by prompt
(``eligibility.prompt_key``: the conversation before the final assistant turn, system prompts aside). In a
group, every distinct reply (the final assistant turn) that the group's best reply -- highest total, then
newest -- beats by at least ``selection.min_preference_margin`` becomes the *other* side of a pair whose
*preferred* side is that best reply, when it reaches ``selection.min_score`` (the preferred reply is also
trained on, with ``sft_weight``). Both replies were verified by the contract: a form-only score never ranks
anything. An accepted user correction (scored under the contract without its rating, and passed:
``eligibility.accepted_correction``) is preferred to the reply it corrects, whatever that reply scored.

Never in a pair: a held-out trace (``eligibility.load_candidates`` applies the shared predicate, and every
pair's two conversations are checked again, so a correction cannot smuggle a held-out prompt in), a reply the
server cut off (timeout, disconnect), the validation slice of a specialist without a task source. Both
conversations of a pair share the preferred trace's context. At most ``max_pairs[specialist]`` are kept,
largest margins first, newest first among equal ones.

Reasons counted per specialist (``Drops``), besides those of ``load_candidates``: ``unverified``, ``held-out``,
``reply stopped before its end``, ``validation slice``, ``no pair within margin`` (a reply no other beats by
the margin, and that beats none), ``over cap`` (pairs).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.contract import ContractSpec
    from pipeline.eligibility import Candidate, Drops
    from pipeline.heldout import HeldoutIndex


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
    from pipeline.eligibility import Drops, accepted_correction, excluded, in_validation_slice, prompt_key
    from pipeline.serving.turns import STOPPED

    rules = contract.selection
    wanted = set(specialists)
    sliced = {s for s, entry in contract.specialists.items() if entry.tasks is None}
    drops = Drops()
    groups: dict[tuple[str, str], dict[str, _Reply]] = {}
    corrections: dict[str, list[tuple[float, int, dict[str, Any]]]] = {s: [] for s in wanted}
    for order, cand in enumerate(candidates):
        if cand.specialist not in wanted:
            continue
        if rules.sources is not None and cand.source not in rules.sources:
            drops.add(cand.specialist, "source not selected")
            continue
        if excluded(cand, heldout):
            drops.add(cand.specialist, "held-out")
            continue
        if not any(m.get("role") == "assistant" for m in cand.messages):
            drops.add(cand.specialist, "no assistant turn")
            continue
        if cand.specialist in sliced and in_validation_slice(cand.messages, rules.validation_share):
            drops.add(cand.specialist, "validation slice")
            continue
        tools = cand.metadata.get("tools")
        corrected = accepted_correction(cand, contract)
        if corrected is not None and cand.correction:
            row = {
                "messages": corrected,
                "rejected": _with_reply(corrected, _through_final_reply(cand.messages)),
                "score": float(cand.correction["total"]),
                "rejected_score": cand.score,
                "margin": 1.0,  # a user's accepted correction outranks the reply it corrects
                "experience_id": cand.experience_id,
                "rejected_experience_id": cand.experience_id,
                "tools": tools,
            }
            corrections[cand.specialist].append((1.0, order, row))
            continue
        if not cand.verified or cand.score is None:
            drops.add(cand.specialist, "unverified")
            continue
        if cand.metadata.get("finish_reason") in STOPPED:
            drops.add(cand.specialist, "reply stopped before its end")
            continue
        messages = _through_final_reply(cand.messages)
        group = groups.setdefault((cand.specialist, prompt_key(messages)), {})
        key = _reply_key(messages)
        reply = _Reply(float(cand.score), order, messages, cand.experience_id, tools)
        if key not in group or (reply.score, reply.order) > (group[key].score, group[key].order):
            group[key] = reply
    ranked: dict[str, list[tuple[float, int, dict[str, Any]]]] = corrections
    for (specialist, _), group in groups.items():
        replies = sorted(group.values(), key=lambda r: (r.score, r.order), reverse=True)
        best, paired = replies[0], 0
        if best.score < rules.min_score:  # the preferred side is also trained on (RPO): it must pass
            drops.add(specialist, "no pair within margin", len(replies))
            continue
        for other in replies[1:]:
            margin = best.score - other.score
            if margin < rules.min_preference_margin:
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
            }
            ranked[specialist].append((margin, max(best.order, other.order), row))
        unpaired = len(replies) - paired - (1 if paired else 0)
        if unpaired:
            drops.add(specialist, "no pair within margin", unpaired)
    result = PairResult(dropped=drops)
    for specialist in sorted(wanted):
        rows = []
        for _, _, row in sorted(ranked[specialist], key=lambda r: (r[0], r[1]), reverse=True):
            both = [*row["messages"], row["rejected"][-1]]
            if heldout.exclusion(messages=both) is not None:  # a correction's own text is checked here
                drops.add(specialist, "held-out")
                continue
            rows.append(row)
        cap = max_pairs[specialist]
        if len(rows) > cap:
            drops.add(specialist, "over cap", len(rows) - cap)
            rows = rows[:cap]
        result.pairs[specialist] = rows
    return result
