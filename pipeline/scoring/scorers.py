"""Built-in scorers. Each is a function ``(config, TurnContext) -> ScorerOutcome``; ``run_scorer``
dispatches on the config's ``kind``. Values are in 0..1; None means "does not apply to this turn"."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pipeline.errors import RatchetError
from pipeline.scoring.code import extract_code, run_io_tests, run_python_tests, score_python_tests
from pipeline.scoring.context import NOT_APPLICABLE, ScorerOutcome, TurnContext, message_text
from pipeline.scoring.judge import score_judge
from pipeline.scoring.text import (
    feedback_rating,
    score_exact_match,
    score_feedback,
    score_json_schema,
    score_length,
    score_regex,
)
from pipeline.scoring.tools import called_tool, extract_calls, score_tool_call

log = logging.getLogger(__name__)

SCORERS: dict[str, Callable[[Any, TurnContext], ScorerOutcome]] = {
    "exact_match": score_exact_match,
    "regex": score_regex,
    "json_schema": score_json_schema,
    "python_tests": score_python_tests,
    "tool_call": score_tool_call,
    "length": score_length,
    "feedback": score_feedback,
    "judge": score_judge,
}


def run_scorer(config: Any, ctx: TurnContext) -> ScorerOutcome:
    """Run one scorer on one turn, honouring its scope; a crash becomes a failed, unverified outcome with
    the error (logged), so one odd trace cannot stop a scoring run or slip past a gate."""
    if config.effective_scope == "final" and not ctx.is_final:
        return NOT_APPLICABLE
    try:
        return SCORERS[config.kind](config, ctx)
    except RatchetError:  # a setup problem (no sandbox, a bad setting): stop the run, say why
        raise
    except Exception as exc:  # noqa: BLE001 - a scorer bug must not abort a run over many traces
        # Fail closed: a crash is a failed check (0, never verified), not "does not apply", which would let a
        # required gate step aside for exactly the answer that made it crash.
        log.exception("scorer %s crashed on turn %d", config.key, ctx.index)
        return ScorerOutcome(0.0, f"scorer crashed: {type(exc).__name__}: {exc}")


__all__ = [
    "NOT_APPLICABLE",
    "SCORERS",
    "ScorerOutcome",
    "TurnContext",
    "called_tool",
    "extract_calls",
    "extract_code",
    "feedback_rating",
    "message_text",
    "run_io_tests",
    "run_python_tests",
    "run_scorer",
]
