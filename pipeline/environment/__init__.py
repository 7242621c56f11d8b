"""The task environment: a simulated deployment with verifiable outcomes (see ``tasks`` for formats)."""

from pipeline.environment.rollout import CollectResult, EvalResult, collect, evaluate
from pipeline.environment.tasks import (
    FAMILIES,
    completion_trace,
    heldout_suite,
    is_heldout,
    make_item,
    perturbed_items,
    reference_answer,
    sample_prompts,
    split_of,
    training_corpus,
)
from pipeline.environment.toolbox import (
    TOOLS,
    apply_call,
    execute_call,
    format_compact_call,
    initial_state,
    openai_tool_call,
    parse_compact_call,
)
from pipeline.environment.verify import verify

__all__ = [
    "FAMILIES",
    "TOOLS",
    "CollectResult",
    "EvalResult",
    "apply_call",
    "collect",
    "completion_trace",
    "evaluate",
    "execute_call",
    "format_compact_call",
    "heldout_suite",
    "initial_state",
    "is_heldout",
    "make_item",
    "openai_tool_call",
    "parse_compact_call",
    "perturbed_items",
    "reference_answer",
    "sample_prompts",
    "split_of",
    "training_corpus",
    "verify",
]
