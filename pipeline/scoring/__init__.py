"""Scoring: one trace under a contract (``trace``, pure) and the registry step over all experience
(``store``)."""

from pipeline.scoring.store import ScoreRunResult, rescore_experience, score_experience, score_step
from pipeline.scoring.trace import (
    FINAL,
    TOTAL,
    EpisodeReward,
    ScorerStats,
    TraceScoreResult,
    TurnScore,
    aggregate_turn,
    corrected_trace,
    episode_reward,
    final_details,
    score_trace,
    score_traces,
    summarise_results,
    total_details,
    turn_specialists,
)

__all__ = [
    "FINAL",
    "TOTAL",
    "EpisodeReward",
    "ScoreRunResult",
    "ScorerStats",
    "TraceScoreResult",
    "TurnScore",
    "aggregate_turn",
    "corrected_trace",
    "episode_reward",
    "final_details",
    "rescore_experience",
    "score_experience",
    "score_step",
    "score_trace",
    "score_traces",
    "summarise_results",
    "total_details",
    "turn_specialists",
]
