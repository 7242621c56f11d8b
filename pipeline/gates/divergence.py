"""Divergence: how far a candidate's specialists moved from the base model and from their parent.

Per specialist, the mean per-token KL divergence ``KL(candidate || reference)`` (nats) of the next-token
distributions, over the answer tokens of the candidate's own greedy answers to its held-out prompts
(teacher-forced: prompt + answer in one forward per model; the candidate's harness renders the prompt for
all three models, so only the weights differ). The reference is the bare base (adapter off) and the parent
generation's adapter. Forgetting tracks this distance on the new task's prompts (Shenfeld et al., "RL's
Razor", 2025): a specialist that had to move far from the base to fit its data is the one likely to lose
what the base could do elsewhere. ``promotion.max_kl_to_base`` (when set) blocks a candidate above it.

The cost is capped: the first ``MAX_ITEMS`` held-out answers per specialist, three forwards each, and none
where a model is the reference itself (an untrained specialist is 0 to the base; an adapter kept from the
parent is 0 to the parent).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from pipeline.loop.clock import CLOCK
from pipeline.modeling.pair import offered_tools, pair_model
from pipeline.modeling.prompting import render_messages
from pipeline.modeling.templating import RowSkipped, encode_chat

if TYPE_CHECKING:
    from pipeline.modeling.pair import PairSpec

log = logging.getLogger(__name__)

MAX_ITEMS = 32  # per specialist: the mean over ~30 answers' tokens is stable to a few percent (demo)
CHUNK = 8  # answers per forward


def answer_examples(
    candidate: PairSpec, specialist: str, traces: list[dict[str, Any]], tokenizer: Any, max_len: int
) -> list[tuple[list[int], list[int]]]:
    """``(ids, labels)`` of each answered trace as the candidate's model saw it: the harness's rendering of
    the prompt, then the answer (labels on the answer's tokens only); traces that cannot be encoded are
    skipped."""

    fmt = candidate.harness.tool_call_format
    tools = offered_tools(candidate.harness, specialist)
    out = []
    for trace in traces:
        messages = trace["messages"]
        if not messages or messages[-1].get("role") != "assistant":
            continue
        shown = [*render_messages(candidate.harness, specialist, messages[:-1]), messages[-1]]
        try:
            ids, labels = encode_chat(
                tokenizer, shown, max_len, fmt=fmt, tools=(trace.get("metadata") or {}).get("tools") or tools
            )
        except RowSkipped:
            continue
        if any(label != -100 for label in labels):
            out.append((ids, labels))
    return out


def answer_logprobs(model: Any, examples: list[tuple[list[int], list[int]]], pad_id: int) -> Any:
    """Log-softmax of the next-token distribution at every labelled position, ``[T, vocab]`` (float32),
    the examples' positions in order."""
    import torch

    device = next(model.parameters()).device
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    labelled = torch.zeros((len(examples), width), dtype=torch.bool)
    for i, (row, labels) in enumerate(examples):  # right-padded: positions are 0.. for every row
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
        labelled[i, : len(row)] = torch.tensor([label != -100 for label in labels])
    with torch.inference_mode():
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
    # the distribution that predicts token t sits at position t - 1
    at = labelled[:, 1:].to(logits.device)
    return torch.log_softmax(logits[:, :-1][at].float(), dim=-1)


def kl_sum(p_log: Any, q_log: Any) -> float:
    """Sum over positions of ``KL(p || q)`` from log-probabilities ``[T, vocab]``. A token ``p`` gives
    probability 0 (a masked vocabulary entry: log-probability -inf) adds 0, as ``0 log 0 = 0`` says;
    computed plainly it would be ``0 * (-inf - q)``, NaN, and a NaN KL compares false with any budget."""
    import torch

    p = p_log.exp()
    terms = torch.where(p > 0, p * (p_log - q_log), torch.zeros_like(p))
    return float(terms.sum(-1).sum())


def specialist_divergence(
    candidate: PairSpec, parent: PairSpec, specialist: str, traces: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """``{"kl_to_base", "kl_to_parent", "tokens", "items", "seconds"}`` for one specialist (None when no
    trace could be encoded)."""

    started = time.perf_counter()
    mine, theirs = candidate.adapters.get(specialist), parent.adapters.get(specialist)
    # one copy of the base holds the candidate's, the parent's and no adapter in turn (``pair.PairModel``)
    shared = pair_model(candidate)
    tokenizer = shared.tokenizer
    max_len = int(getattr(shared.model.config, "max_position_embeddings", 0) or 4096)
    examples = answer_examples(candidate, specialist, traces[:MAX_ITEMS], tokenizer, max_len)
    if not examples:
        return None
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # the references: the bare base, and the parent's own adapter (to itself: 0; a parent without one is the
    # bare base, the same sum as to_base)
    to_up = theirs is not None and mine != theirs
    tokens, to_base, to_parent = 0, 0.0, 0.0
    for at in range(
        0, len(examples), CHUNK
    ):  # [tokens, vocab] per chunk: bounded memory on large vocabularies
        chunk = examples[at : at + CHUNK]
        # model compute (teacher-forced forwards), as bench/overhead.py counts it
        with CLOCK.measure("forward"):
            with shared.use(mine) as model:
                p_log = answer_logprobs(model, chunk, pad)
            tokens += int(p_log.shape[0])
            if mine is not None:
                with shared.use(None) as model:
                    to_base += kl_sum(p_log, answer_logprobs(model, chunk, pad))
            if to_up:
                with shared.use(theirs) as model:
                    to_parent += kl_sum(p_log, answer_logprobs(model, chunk, pad))
    if theirs is None:
        to_parent = to_base
    to_base, to_parent = to_base / max(tokens, 1), to_parent / max(tokens, 1)
    return {
        "kl_to_base": round(to_base, 6),
        "kl_to_parent": round(to_parent, 6),
        "tokens": tokens,
        "items": len(examples),
        "seconds": round(time.perf_counter() - started, 3),
    }


def measure_divergence(
    candidate: PairSpec, parent: PairSpec, answers: dict[str, list[dict[str, Any]]]
) -> dict[str, dict[str, Any]]:
    """``evaluation["divergence"]``: per specialist with held-out answers, ``specialist_divergence``."""
    out = {}
    for specialist in sorted(answers):
        if specialist not in candidate.adapters or not answers[specialist]:
            continue
        found = specialist_divergence(candidate, parent, specialist, answers[specialist])
        if found is not None:
            out[specialist] = found
    return out
