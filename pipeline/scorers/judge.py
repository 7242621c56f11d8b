"""The judge scorer: a model behind an OpenAI-compatible endpoint grades the answer against a rubric."""

from __future__ import annotations

import logging
import os
import re

from pipeline.scorers.base import ScorerOutcome, TurnContext, message_text
from pipeline.scorers.config import JudgeScorer

log = logging.getLogger(__name__)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")

JUDGE_SYSTEM = (
    "You grade an assistant's reply. Rubric:\n{rubric}\n\n"
    "Reply with only a number from 0 to {max_grade:g} (higher is better)."
)


def judge_messages(cfg: JudgeScorer, ctx: TurnContext) -> list[dict[str, str]]:
    """The chat request sent to the judge: rubric as system, the conversation and reply as user."""
    lines = []
    for msg in ctx.messages[: ctx.index]:
        if msg.get("role") in ("user", "assistant", "tool"):
            lines.append(f"{msg['role'].upper()}: {message_text(msg)}")
    transcript = "\n".join(lines[-12:])
    user = f"Conversation:\n{transcript}\n\nReply to grade:\n{ctx.text}"
    return [
        {"role": "system", "content": JUDGE_SYSTEM.format(rubric=cfg.rubric, max_grade=cfg.max_grade)},
        {"role": "user", "content": user},
    ]


def score_judge(cfg: JudgeScorer, ctx: TurnContext) -> ScorerOutcome:
    """grade / max_grade; None (with the error) when the judge is unreachable or replies without a grade."""
    import httpx

    headers = {}
    if cfg.api_key_env and os.environ.get(cfg.api_key_env):
        headers["Authorization"] = f"Bearer {os.environ[cfg.api_key_env]}"
    body = {"model": cfg.model, "messages": judge_messages(cfg, ctx), "temperature": 0.0, "max_tokens": 16}
    url = cfg.base_url.rstrip("/") + "/chat/completions"
    try:
        resp = httpx.post(url, json=body, headers=headers, timeout=cfg.timeout_s)
        resp.raise_for_status()
        reply = resp.json()["choices"][0]["message"]["content"] or ""
    except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as exc:
        log.warning("judge %s at %s failed: %s", cfg.model, url, exc)
        return ScorerOutcome(None, f"judge request failed: {type(exc).__name__}: {str(exc)[:200]}")
    match = _NUMBER.search(reply)
    if match is None:
        return ScorerOutcome(None, f"judge reply has no grade: {reply[:100]!r}")
    grade = float(match.group())
    value = min(1.0, max(0.0, grade / cfg.max_grade))
    return ScorerOutcome(value, None, {"grade": grade, "reply": reply[:200]})
