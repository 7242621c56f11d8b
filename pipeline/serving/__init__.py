"""Mixture-of-LoRA serving: router, runtime, micro-batching scheduler, engines and the OpenAI server.

Modules: ``router`` (pure routing policy, learned classifier, accuracy), ``routereval`` (router accuracy
per generation), ``toolcalls`` (tool-call text formats <-> OpenAI ``tool_calls``), ``views`` (per-specialist
views, turn memory, summaries), ``runtime`` (checked adapter loading, batched mixed-adapter decoding),
``adapters`` (adapter checks, the attached-adapter budget; ``adapter_weights``: the weights file's
safetensors header), ``mixlora`` (fast per-row LoRA), ``scheduler``
(async micro-batching), ``engines`` (embedded / external OpenAI-compatible), ``limits`` (body size,
admission, disconnects), ``served`` (``ServeConfig``, loading a generation), ``turns`` (route -> answer ->
summary -> record), ``traces`` (a turn and its experience row), ``recorder`` (experience writer),
``protocol`` (OpenAI wire format), ``constraints`` (a request's grammar: response formats, forced tool calls),
``completions`` (chat completion bodies, chunks, logprobs, token ids), ``responses`` (OpenAI's Responses API
routes; ``responseitems``: its requests, ``responseobjects``: its Response object and stream events),
``server`` (``create_app``), ``adapter_app`` (the embedded engine as a multi-LoRA OpenAI server).

Importing the package is torch-free; torch / transformers / peft / fastapi load in the modules that use them.
"""

from typing import Any

# Names resolved on first use (PEP 562), so that importing a light module of the package (``served`` for
# ``ServeConfig``, as the CLI does) does not load the router and the harness.
_EXPORTS = {
    "RouteDecision": "pipeline.serving.router",
    "RouteTurn": "pipeline.serving.router",
    "RouterEvaluation": "pipeline.serving.router",
    "TokenClassifier": "pipeline.serving.router",
    "evaluate_router": "pipeline.serving.router",
    "route_turn": "pipeline.serving.router",
    "signal_scores": "pipeline.serving.router",
    "turn_from_messages": "pipeline.serving.router",
    "parse_tool_calls": "pipeline.experience.toolcalls",
    "register_format": "pipeline.experience.toolcalls",
    "render_tool_calls": "pipeline.experience.toolcalls",
    "to_openai": "pipeline.experience.toolcalls",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pipeline.serving' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
