"""Mixture-of-LoRA serving: router, runtime, micro-batching scheduler, engines and the OpenAI server.

Modules: ``router`` (pure routing policy, learned classifier, accuracy), ``routereval`` (router accuracy
per generation), ``toolcalls`` (tool-call text formats <-> OpenAI ``tool_calls``), ``views`` (per-specialist
views, turn memory, summaries), ``runtime`` (checked adapter loading, batched mixed-adapter decoding),
``mixlora`` (fast per-row LoRA), ``scheduler`` (async micro-batching), ``engines`` (embedded / external
OpenAI-compatible), ``served`` (``ServeConfig``, loading a generation), ``turns`` (route -> answer ->
summary -> record), ``recorder`` (experience writer), ``protocol`` (OpenAI wire format), ``server``
(``create_app``), ``adapter_app`` (the embedded engine as a multi-LoRA OpenAI server).

Importing the package is torch-free; torch / transformers / peft / fastapi load in the modules that use them.
"""

from pipeline.serving.router import (
    RouteDecision,
    RouterEvaluation,
    RouteTurn,
    TokenClassifier,
    evaluate_router,
    route_turn,
    signal_scores,
    turn_from_messages,
)
from pipeline.toolcalls import parse_tool_calls, register_format, render_tool_calls, to_openai

__all__ = [
    "RouteDecision",
    "RouteTurn",
    "RouterEvaluation",
    "TokenClassifier",
    "evaluate_router",
    "parse_tool_calls",
    "register_format",
    "render_tool_calls",
    "route_turn",
    "signal_scores",
    "to_openai",
    "turn_from_messages",
]
