"""Running a model in the environment: ``collect`` experience (sample, verify, keep) and ``evaluate``
greedily on a held-out suite. Both take a loaded ``(model, tokenizer)`` (see ``decoding.load_model``) and
sample through a ``Sampler`` (``pipeline.modeling.samplers``): by default that model in this process; an
``OpenAISampler`` with the served name of the same weights (``OpenAISampler.ready``) samples on an engine."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline.environment.tasks import completion_trace
from pipeline.environment.verify import verify
from pipeline.modeling.decoding import SamplingConfig
from pipeline.modeling.samplers import EmbeddedSampler, Sampler
from pipeline.modeling.templating import encode_prompt


@dataclass
class CollectResult:
    """Sampled experience: every verified completion as a trace, plus counts."""

    traces: list[dict[str, Any]]
    prompts: int
    samples: int
    verified: int
    pass_at_k: float  # share of prompts with at least one verified sample

    @property
    def success_rate(self) -> float:
        return self.verified / self.samples if self.samples else 0.0


@dataclass
class EvalResult:
    """Greedy held-out accuracy, overall and per task family."""

    accuracy: float
    n: int
    per_family: dict[str, float] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)


def collect(
    model: Any,
    tokenizer: Any,
    items: list[dict[str, Any]],
    *,
    num_samples: int = 4,
    temperature: float = 0.7,
    top_p: float = 1.0,
    max_new_tokens: int = 40,
    seed: int = 0,
    batch_size: int = 256,
    dedupe: bool = False,
    progress: Callable[[int, int], None] | None = None,
    sampler: Sampler | None = None,
    adapter: str | None = None,
) -> CollectResult:
    """Sample ``num_samples`` completions per training item, verify each, keep the verified ones as traces
    (``metadata.verified = True``; ``dedupe`` keeps one per distinct (item, completion)). Refuses
    held-out items: they never enter a training stream. ``sampler`` / ``adapter``: where to sample (default:
    ``model`` in this process)."""

    if any(item["metadata"].get("split") == "heldout" for item in items):
        raise ValueError("collect() got held-out items; held-out items never enter a training set")
    config = SamplingConfig(
        temperature=temperature,
        top_p=top_p,
        num_samples=num_samples,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        seed=seed,
    )
    prompts = [encode_prompt(tokenizer, item["messages"]) for item in items]
    sampler = sampler or EmbeddedSampler(model, tokenizer, progress=progress)
    completions = [[s.text for s in row] for row in sampler.sample(prompts, config, adapter=adapter)]
    traces, solved, verified, seen = [], 0, 0, set()
    for item, texts in zip(items, completions, strict=True):
        any_ok = False
        for text in texts:
            ok, _ = verify(item, text)
            if not ok:
                continue
            verified += 1
            any_ok = True
            key = (item["metadata"]["task_id"], text)
            if dedupe and key in seen:
                continue
            seen.add(key)
            trace = completion_trace(item, text)
            trace["metadata"]["verified"] = True
            traces.append(trace)
        solved += any_ok
    n = len(items)
    return CollectResult(traces, n, n * num_samples, verified, solved / n if n else 0.0)


def evaluate(
    model: Any,
    tokenizer: Any,
    suite: list[dict[str, Any]],
    *,
    max_new_tokens: int = 40,
    batch_size: int = 256,
    progress: Callable[[int, int], None] | None = None,
    sampler: Sampler | None = None,
    adapter: str | None = None,
) -> EvalResult:
    """Greedy accuracy of the model on ``suite`` (held-out items), by the environment's verifiers (sampled
    where ``sampler`` / ``adapter`` say, as ``collect``)."""

    config = SamplingConfig(
        temperature=0.0, num_samples=1, max_new_tokens=max_new_tokens, batch_size=batch_size
    )
    prompts = [encode_prompt(tokenizer, item["messages"]) for item in suite]
    sampler = sampler or EmbeddedSampler(model, tokenizer, progress=progress)
    completions = [[s.text for s in row] for row in sampler.sample(prompts, config, adapter=adapter)]
    hits: dict[str, list[bool]] = defaultdict(list)
    failures = []
    for item, (text,) in zip(suite, completions, strict=True):
        ok, details = verify(item, text)
        hits[item["metadata"]["task"]].append(ok)
        if not ok and len(failures) < 20:
            failures.append({"task_id": item["metadata"]["task_id"], "got": text, **details})
    flat = [h for v in hits.values() for h in v]
    per_family = {k: sum(v) / len(v) for k, v in sorted(hits.items())}
    return EvalResult(sum(flat) / len(flat) if flat else 0.0, len(flat), per_family, failures)
