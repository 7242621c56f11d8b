"""Scorers over the assistant's text: exact_match, regex, json_schema, length, feedback."""

from __future__ import annotations

import re
import string
from typing import Any

from pipeline.scoring.context import (
    NOT_APPLICABLE,
    ScorerOutcome,
    TurnContext,
    parse_json_content,
    schema_validator,
)
from pipeline.scoring.patterns import PatternError, compile_pattern
from pipeline.specs.scorers import (
    ExactMatchScorer,
    FeedbackScorer,
    JsonSchemaScorer,
    LengthScorer,
    RegexScorer,
)

_PUNCT = string.punctuation + "“”‘’"


def normalise(text: str, cfg: ExactMatchScorer) -> str:
    """Apply the exact_match normalisation options to ``text``."""
    if cfg.strip:
        text = text.strip()
    if cfg.collapse_whitespace:
        text = re.sub(r"\s+", " ", text)
    if cfg.strip_punctuation:
        text = text.strip(_PUNCT + " ")
    if not cfg.case_sensitive:
        text = text.casefold()
    return text


def _as_number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").replace("_", ""))
    except ValueError:
        return None


def score_exact_match(cfg: ExactMatchScorer, ctx: TurnContext) -> ScorerOutcome:
    """1 when the answer equals (or contains) one of the expected answers after normalisation."""
    expected = ctx.certified(cfg, cfg.field)
    if expected is None:
        return NOT_APPLICABLE
    options = expected if isinstance(expected, list) else [expected]
    answer = normalise(ctx.text, cfg)
    answer_num = _as_number(answer) if cfg.numeric else None
    for option in options:
        want = normalise(str(option), cfg)
        if cfg.contains and want in answer:
            return ScorerOutcome(1.0, verified=True)
        if answer == want:
            return ScorerOutcome(1.0, verified=True)
        if answer_num is not None and (want_num := _as_number(want)) is not None and answer_num == want_num:
            return ScorerOutcome(1.0, verified=True)
    shown = options[0] if len(options) == 1 else options
    return ScorerOutcome(0.0, f"expected {shown!r}, got {ctx.text[:200]!r}", verified=True)


def score_regex(cfg: RegexScorer, ctx: TurnContext) -> ScorerOutcome:
    """1 when the pattern matches (or, with ``negate``, does not); matched by RE2 (linear time), and not
    applicable, with the reason, when RE2 cannot run the pattern (``pipeline.scoring.patterns``)."""
    try:
        pattern = compile_pattern(cfg.pattern, cfg.flags)
    except PatternError as exc:
        return ScorerOutcome(None, str(exc))
    matched = (pattern.fullmatch if cfg.full_match else pattern.search)(ctx.text) is not None
    if matched != cfg.negate:
        return ScorerOutcome(1.0)
    return ScorerOutcome(0.0, f"{'matched forbidden' if cfg.negate else 'no match for'} /{cfg.pattern}/")


def score_json_schema(cfg: JsonSchemaScorer, ctx: TurnContext) -> ScorerOutcome:
    """1 when the content is JSON valid against the inline or metadata schema."""
    import jsonschema

    if ctx.message.get("tool_calls") and not ctx.text.strip():
        return NOT_APPLICABLE
    schema: Any = cfg.json_schema if cfg.json_schema is not None else ctx.certified(cfg, cfg.schema_field)
    try:
        data = parse_json_content(ctx.text)
    except ValueError as exc:
        return ScorerOutcome(0.0, str(exc), verified=isinstance(schema, dict))
    if schema is None:  # form only: nothing says what the JSON should be
        return ScorerOutcome(1.0, info={"note": "no schema: checked that the answer parses as JSON"})
    if not isinstance(schema, dict):
        return ScorerOutcome(None, f"metadata.{cfg.schema_field} is not a JSON Schema object")
    try:  # a pattern RE2 cannot run makes the schema invalid: not verified, with the reason
        validator = schema_validator(schema)
        errors = sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path))
    except jsonschema.SchemaError as exc:
        return ScorerOutcome(None, f"invalid schema in metadata.{cfg.schema_field}: {exc.message}")
    if not errors:
        return ScorerOutcome(1.0, verified=True)
    first = errors[0]
    where = "/".join(str(p) for p in first.absolute_path) or "<root>"
    return ScorerOutcome(
        0.5 if cfg.partial_credit else 0.0,
        f"{len(errors)} schema error(s); at {where}: {first.message}",
        verified=True,
    )


def score_length(cfg: LengthScorer, ctx: TurnContext) -> ScorerOutcome:
    """1 inside [min_chars, max_chars]; falls linearly to 0 at ``softness`` relative distance outside."""
    if ctx.message.get("tool_calls") and not ctx.text:
        return NOT_APPLICABLE
    n = len(ctx.text)
    if n < cfg.min_chars:
        value = max(0.0, 1.0 - (cfg.min_chars - n) / (cfg.min_chars * cfg.softness))
        return ScorerOutcome(value, f"{n} chars, below min_chars {cfg.min_chars}")
    if cfg.max_chars is not None and n > cfg.max_chars:
        value = max(0.0, 1.0 - (n - cfg.max_chars) / (cfg.max_chars * cfg.softness))
        return ScorerOutcome(value, f"{n} chars, above max_chars {cfg.max_chars}")
    return ScorerOutcome(1.0)


def feedback_rating(feedback: Any) -> float | None:
    """The numeric rating in a trace's ``feedback`` (a number, a bool, or ``{"rating": ...}``), if any."""
    if isinstance(feedback, dict):
        feedback = feedback.get("rating")
    if isinstance(feedback, bool):
        return 1.0 if feedback else 0.0
    if isinstance(feedback, (int, float)):
        return float(feedback)
    return None


def feedback_rater(feedback: Any, principal: str | None) -> str | None:
    """Who gave a trace's counted rating: ``feedback.rating_by`` (served feedback), else the trace's principal
    (a rating that came with the trace, e.g. through ``ratchet ingest``)."""
    by = feedback.get("rating_by") if isinstance(feedback, dict) else None
    return by if isinstance(by, str) else principal


def score_feedback(cfg: FeedbackScorer, ctx: TurnContext) -> ScorerOutcome:
    """The rating mapped from [min_rating, max_rating] to [0, 1] (clamped); None without a counted rating
    (ratings from principals without the ``rate`` scope are kept under ``feedback.claimed`` and never read
    here) or from a rater the contract does not trust (``trusted``)."""
    rating = feedback_rating(ctx.feedback)
    rater = feedback_rater(ctx.feedback, ctx.principal)
    if rating is None or not cfg.trusts(rater):
        return NOT_APPLICABLE
    value = (rating - cfg.min_rating) / (cfg.max_rating - cfg.min_rating)
    return ScorerOutcome(min(1.0, max(0.0, value)), info={"rating": rating, "by": rater}, verified=True)
