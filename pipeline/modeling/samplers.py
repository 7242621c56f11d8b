"""Where the loop samples: in this process (``embedded``) or on an OpenAI-compatible engine (``openai``).

A ``Sampler`` turns prompts (token ids) into completions with their ids and log-probabilities
(``decoding.Sample``). ``EmbeddedSampler`` decodes with a loaded model (``decoding.sample``);
``OpenAISampler`` drives a vLLM / SGLang server the operator runs with LoRA and runtime adapter loading on
(or ``ratchet serve --expose-adapters``, which speaks the same protocol): an adapter is loaded under a
versioned name (``{name}-{sha256[:12]}`` of its weights file, so a retrained adapter never reuses a name)
through ``POST /v1/load_lora_adapter``, prompts go to ``POST /v1/completions`` as token ids and the token ids
and log-probabilities come back (vLLM's ``return_token_ids``).

The silent failure of every trainer-to-server hand-off is a server that keeps sampling old weights (a load
that did not take, a name that maps to an older adapter). ``parity_probe`` makes it loud: after a load, a
fixed probe batch (``probe_prompts``: a few short texts in the model's own tokenizer) is scored on the
server (vLLM's ``prompt_logprobs``) and with the trainer's own forward (base + adapter, unmerged, float32
log-softmax); the figure is the largest, over the probe prompts, mean absolute difference of the prompt
tokens' log-probabilities. Above ``parity_tolerance`` the engine is refused for that adapter with one line
(``EngineRefused``). The probe runs once per served name per process (``OpenAISampler.ready``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pipeline.errors import RatchetError
from pipeline.modeling import decoding
from pipeline.modeling.decoding import Sample, SamplingConfig
from pipeline.modeling.templating import encode_text
from pipeline.specs.loading import file_sha256

if TYPE_CHECKING:
    from pipeline.settings import Settings

log = logging.getLogger(__name__)

WEIGHTS = "adapter_model.safetensors"
# the probe batch: short texts of different kinds (prose, code, arithmetic, a chat line), each cut to
# PROBE_TOKENS tokens in the model's tokenizer
PROBE_TEXTS = (
    "The quick brown fox jumps over the lazy dog, then rests in the shade.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "12+35=47; 8*7=56; 100-1=99",
    "Hello! How can I help you today? Set a timer for 5 minutes.",
)
PROBE_TOKENS = 32
MAX_CONCURRENT = 64  # requests in flight to the engine at once (it batches them)


class EngineRefused(RatchetError):
    """The rollout engine does not serve what the trainer holds (the parity probe failed), or cannot be used."""


class Sampler(Protocol):
    """Completions of prompts given as token ids: per prompt, ``config.num_samples`` samples."""

    def sample(
        self, prompts: Sequence[Sequence[int]], config: SamplingConfig, *, adapter: str | None
    ) -> list[list[Sample]]: ...


class EmbeddedSampler:
    """Decoding in this process with ``model`` as it is (``decoding.sample``); ``adapter`` is ignored: the
    caller has already made ``model`` the pair to sample (``pair.PairModel.use``)."""

    def __init__(self, model: Any, tokenizer: Any, *, progress: Callable[[int, int], None] | None = None):
        self.model, self.tokenizer, self.progress = model, tokenizer, progress

    def sample(
        self, prompts: Sequence[Sequence[int]], config: SamplingConfig, *, adapter: str | None = None
    ) -> list[list[Sample]]:
        # decoding.sample looked up per call: tests wrap it
        return decoding.sample(self.model, self.tokenizer, prompts, config, progress=self.progress)


@dataclass(frozen=True)
class ProbeResult:
    """A passed parity probe: the served name, the figure (worst prompt's mean absolute log-probability
    difference), the largest single-token difference, and how many prompt tokens were compared."""

    served_name: str
    mean_abs: float
    max_abs: float
    tokens: int


def versioned_name(adapter_dir: Path, name: str) -> str:
    """``{name}-{sha256[:12]}`` of the adapter's weights file: a new adapter under a new name, always."""
    return f"{name}-{file_sha256(Path(adapter_dir) / WEIGHTS)[:12]}"


class OpenAISampler:
    """A vLLM / SGLang / ``ratchet serve --expose-adapters`` server at ``url`` (``/v1`` added when missing).

    ``api_key``: its bearer key (loading adapters needs one allowed to: vLLM's ``--api-key``, the admin scope
    on ``ratchet serve``); ``tokenizer``: the base's (probe prompts); ``base_model``: the served name of the
    bare base (default: the first model ``/v1/models`` lists without a ``parent``, as vLLM lists its base)."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None,
        tokenizer: Any,
        timeout: float = 600.0,
        base_model: str | None = None,
    ):
        import openai

        self.url = url.rstrip("/") if url.rstrip("/").endswith("/v1") else url.rstrip("/") + "/v1"
        self.api_key = api_key
        self.tokenizer = tokenizer
        self.timeout = timeout
        self._base_model = base_model
        self.client = openai.OpenAI(
            base_url=self.url, api_key=api_key or "none", timeout=timeout, max_retries=2
        )
        self.probed: dict[str, ProbeResult] = {}  # served name -> its passed probe

    def base_model(self) -> str:
        """The served name of the bare base model."""
        if self._base_model is None:
            listed = self.client.models.list().data
            bare = [m.id for m in listed if (m.model_extra or {}).get("parent") is None]
            if not bare:
                raise EngineRefused(f"rollout engine at {self.url}: /v1/models lists no base model")
            self._base_model = bare[0]
        return self._base_model

    def load(self, adapter_dir: Path, *, name: str) -> str:
        """Load ``adapter_dir`` under ``versioned_name(adapter_dir, name)`` (a name the engine already has is
        taken as loaded: the name carries the weights' hash) and return that name. vLLM's endpoint is
        ``/v1/load_lora_adapter``, SGLang's ``/load_lora_adapter`` (tried when the first is not found). The
        path must be readable on the engine's machine (a shared artifact store)."""
        import httpx

        served = versioned_name(adapter_dir, name)
        body = {"lora_name": served, "lora_path": str(Path(adapter_dir).resolve())}
        body["sha256"] = file_sha256(Path(adapter_dir) / WEIGHTS)  # checked by ratchet; vLLM ignores it
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            r = httpx.post(f"{self.url}/load_lora_adapter", json=body, headers=headers, timeout=self.timeout)
            if r.status_code == 404 and "lora" not in r.text.lower():  # SGLang has it at the root
                root = self.url.removesuffix("/v1")
                r = httpx.post(f"{root}/load_lora_adapter", json=body, headers=headers, timeout=self.timeout)
        except httpx.HTTPError as exc:
            raise EngineRefused(f"rollout engine at {self.url}: loading {served!r} failed: {exc}") from None
        if r.status_code != 200 and "already been loaded" not in r.text:
            raise EngineRefused(
                f"rollout engine at {self.url} refused adapter {served!r} ({r.status_code}): "
                f"{' '.join(r.text.split())[:300]}"
            )
        return served

    def unload(self, served: str) -> None:
        """Stop serving ``served`` (``POST /v1/unload_lora_adapter``): a GRPO job loads a new adapter per
        step; the old ones are unloaded so the engine's adapter slots do not fill up."""
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        r = httpx.post(
            f"{self.url}/unload_lora_adapter",
            json={"lora_name": served},
            headers=headers,
            timeout=self.timeout,
        )
        if r.status_code != 200:
            raise EngineRefused(
                f"rollout engine at {self.url}: unloading {served!r} failed ({r.status_code}): "
                f"{' '.join(r.text.split())[:300]}"
            )
        self.probed.pop(served, None)

    def ready(self, adapter_dir: Path | None, *, name: str, model: Any, tolerance: float) -> str:
        """The served name to sample ``name`` with: its adapter loaded (``None``: the bare base) and probed
        against ``model`` (base + that adapter, as the trainer holds it) once per process."""
        served = self.base_model() if adapter_dir is None else self.load(adapter_dir, name=name)
        if served not in self.probed:
            self.probed[served] = parity_probe(self, served, model, self.tokenizer, tolerance=tolerance)
        return served

    def _complete(self, prompt: Sequence[int], model: str, **kwargs: Any) -> Any:
        import openai

        try:
            return self.client.completions.create(model=model, prompt=list(prompt), **kwargs)
        except openai.APIError as exc:
            raise EngineRefused(f"rollout engine at {self.url}, model {model!r}: {exc}") from None

    def sample(
        self, prompts: Sequence[Sequence[int]], config: SamplingConfig, *, adapter: str | None
    ) -> list[list[Sample]]:
        """``config.num_samples`` completions per prompt from the served ``adapter`` (a ``ready`` name;
        ``None``: the base), all prompts in flight at once (the engine batches them). Prompt ``i`` is sampled
        with seed ``config.seed + i * num_samples`` (its choice ``j``: that plus ``j`` on ``ratchet serve``)."""
        if config.temperature == 0 and config.num_samples != 1:
            raise ValueError(
                "greedy decoding (temperature 0) gives one completion per prompt; set num_samples=1"
            )
        model = adapter if adapter is not None else self.base_model()

        def one(i: int) -> list[Sample]:
            out = self._complete(
                prompts[i],
                model,
                max_tokens=config.max_new_tokens,
                temperature=config.temperature,
                top_p=config.top_p if config.temperature > 0 else 1.0,
                n=config.num_samples,
                seed=config.seed + i * config.num_samples,
                stop=list(config.stop) or None,
                logprobs=0,
                extra_body={"return_token_ids": True},
            )
            return [_sample_of(c, self.url, model) for c in sorted(out.choices, key=lambda c: c.index)]

        with ThreadPoolExecutor(max_workers=max(1, min(MAX_CONCURRENT, len(prompts)))) as pool:
            return list(pool.map(one, range(len(prompts))))

    def prompt_logprobs(self, prompts: Sequence[Sequence[int]], *, adapter: str) -> list[list[float]]:
        """Each prompt token's log-probability after the first, as the engine scores it under ``adapter``."""
        out = []
        for prompt in prompts:
            choice = self._complete(
                prompt, adapter, max_tokens=1, temperature=0.0, extra_body={"prompt_logprobs": 0}
            ).choices[0]
            rows = (choice.model_extra or {}).get("prompt_logprobs")
            if not isinstance(rows, list) or len(rows) != len(prompt):
                raise EngineRefused(
                    f"rollout engine at {self.url}: no prompt_logprobs for {adapter!r} "
                    "(the parity probe needs vLLM's prompt_logprobs)"
                )
            out.append([float(rows[p][str(t)]["logprob"]) for p, t in enumerate(prompt) if p > 0])
        return out


def _sample_of(choice: Any, url: str, model: str) -> Sample:
    extra = choice.model_extra or {}
    ids = extra.get("token_ids")
    if ids is None:
        raise EngineRefused(
            f"rollout engine at {url}, model {model!r}: no token_ids in the reply (vLLM >= 0.10.2 returns "
            "them for return_token_ids)"
        )
    logprobs = tuple(float(x) for x in (choice.logprobs.token_logprobs if choice.logprobs else []))
    if len(logprobs) != len(ids):
        raise EngineRefused(
            f"rollout engine at {url}, model {model!r}: {len(ids)} token ids, {len(logprobs)} logprobs"
        )
    return Sample(choice.text, tuple(int(t) for t in ids), logprobs)


def probe_prompts(tokenizer: Any) -> list[list[int]]:
    """The fixed probe batch: ``PROBE_TEXTS`` as literal text in ``tokenizer`` (after its BOS, when it has
    one), each cut to ``PROBE_TOKENS`` tokens."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return [(bos + encode_text(tokenizer, text))[:PROBE_TOKENS] for text in PROBE_TEXTS]


def local_prompt_logprobs(model: Any, prompts: Sequence[Sequence[int]]) -> list[list[float]]:
    """The trainer's own forward: each prompt token's log-probability after the first under ``model`` with
    its active adapter, in eval mode (float32 log-softmax; one prompt per forward, no padding)."""
    import torch

    device = next(model.parameters()).device
    out = []
    training = model.training
    model.eval()  # no dropout: a policy mid-training is probed as it will sample
    try:
        with torch.inference_mode():
            for prompt in prompts:
                logits = model(input_ids=torch.tensor([list(prompt)], device=device), use_cache=False).logits
                logp = torch.log_softmax(logits[0, :-1].float(), dim=-1)
                out.append(logp.gather(-1, torch.tensor(prompt[1:], device=device)[:, None])[:, 0].tolist())
    finally:
        model.train(training)
    return out


def parity_probe(
    sampler: OpenAISampler, served_name: str, model: Any, tokenizer: Any, *, tolerance: float
) -> ProbeResult:
    """Score ``probe_prompts`` on the engine under ``served_name`` and locally with ``model``; raise
    ``EngineRefused`` (one line) when the worst prompt's mean absolute difference exceeds ``tolerance``."""
    prompts = probe_prompts(tokenizer)
    remote = sampler.prompt_logprobs(prompts, adapter=served_name)
    local = local_prompt_logprobs(model, prompts)
    diffs = [[abs(a - b) for a, b in zip(r, loc, strict=True)] for r, loc in zip(remote, local, strict=True)]
    mean_abs = max(sum(d) / len(d) for d in diffs if d)
    max_abs = max(max(d) for d in diffs if d)
    result = ProbeResult(served_name, mean_abs, max_abs, sum(map(len, diffs)))
    if not mean_abs <= tolerance:  # NaN refuses too
        raise EngineRefused(
            f"rollout engine at {sampler.url} refused for adapter {served_name!r}: its log-probabilities differ "
            f"from the trainer's by {mean_abs:.4g} (mean absolute over a probe prompt; largest token "
            f"{max_abs:.4g}), above the tolerance {tolerance:g}: it is not serving these weights (a stale "
            "adapter?)"
        )
    log.info(
        "parity probe passed for %s at %s: mean |dlogp| %.3g, max %.3g over %d tokens",
        served_name, sampler.url, mean_abs, max_abs, result.tokens,
    )  # fmt: skip
    return result


_OPENAI: dict[tuple[str, str | None], OpenAISampler] = {}  # one per engine and key: its probes are kept


def sampler_for(
    settings: Settings,
    *,
    tokenizer: Any,
    model: Any = None,
    progress: Callable[[int, int], None] | None = None,
) -> EmbeddedSampler | OpenAISampler:
    """The sampler ``settings.rollout_engine`` names: ``embedded`` over ``model``, or the process's
    ``OpenAISampler`` for ``rollout_engine_url`` (kept, so each adapter is probed once per process)."""
    if settings.rollout_engine == "embedded":
        if model is None:
            raise ValueError("the embedded rollout engine needs the loaded model")
        return EmbeddedSampler(model, tokenizer, progress=progress)
    if not settings.rollout_engine_url:
        raise RatchetError(
            "RATCHET_ROLLOUT_ENGINE=openai needs RATCHET_ROLLOUT_ENGINE_URL (the vLLM / SGLang server's URL)"
        )
    key = (settings.rollout_engine_url, settings.rollout_engine_api_key)
    if key not in _OPENAI:
        _OPENAI[key] = OpenAISampler(key[0], api_key=key[1], tokenizer=tokenizer)
    _OPENAI[key].tokenizer = tokenizer  # the probe prompts are the caller's base's
    return _OPENAI[key]
