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
(``EngineRefused``). The probe runs once per served name per process (``OpenAISampler.ready``). The fixed
prompts are recognisable, so a caller that knows the prompts it is about to sample passes them: a few,
drawn at random per call (``SPOT_PROMPTS``, cut to ``SPOT_TOKENS``), are scored the same way at every
``ready``, so a server cannot answer the probe with one set of weights and the workload with another.

Every reply is untrusted: a field missing or of the wrong type, a count that is not what was asked for, a
token id outside the vocabulary, a log-probability that is not a finite number <= 0, more tokens than
``max_tokens``: ``EngineRefused``, one line. A completion's text is decoded here from its token ids, as the
embedded engine decodes it (an end token dropped, special tokens skipped, cut at the first stop string), so
what the loop stores and trains on is what the ids say, whatever text the server sent (vLLM's text also
differs by its own detokenizer settings).
"""

from __future__ import annotations

import logging
import math
import random
import secrets
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pipeline.errors import RatchetError
from pipeline.modeling import decoding
from pipeline.modeling.decoding import Sample, SamplingConfig
from pipeline.modeling.engine_replies import EngineRefused, one_line, prompt_values, reply_samples
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
SPOT_PROMPTS = 2  # the caller's own prompts scored beside the fixed probe, drawn per ``ready``
SPOT_TOKENS = 256  # each cut to its first tokens
MAX_CONCURRENT = 64  # requests in flight to the engine at once (it batches them)


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
        # what ends a completion (dropped from its text): the tokenizer's EOS, and the models' (``ready``)
        self.end_ids: set[int] = decoding.end_token_ids(None, tokenizer)

    def base_model(self) -> str:
        """The served name of the bare base model."""
        if self._base_model is None:
            import openai

            try:
                listed = self.client.models.list().data
            except openai.APIError as exc:
                raise EngineRefused(
                    f"rollout engine at {self.url}: /v1/models: {one_line(str(exc))}"
                ) from None
            bare = [
                m.id for m in listed if isinstance(m.id, str) and (m.model_extra or {}).get("parent") is None
            ]
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
        try:
            r = httpx.post(
                f"{self.url}/unload_lora_adapter",
                json={"lora_name": served},
                headers=headers,
                timeout=self.timeout,
            )
        except (
            httpx.HTTPError
        ) as exc:  # raised in a caller's `finally`: one line, not a traceback over its own
            raise EngineRefused(f"rollout engine at {self.url}: unloading {served!r} failed: {exc}") from None
        if r.status_code != 200:
            raise EngineRefused(
                f"rollout engine at {self.url}: unloading {served!r} failed ({r.status_code}): "
                f"{' '.join(r.text.split())[:300]}"
            )
        self.probed.pop(served, None)

    def ready(
        self,
        adapter_dir: Path | None,
        *,
        name: str,
        model: Any,
        tolerance: float,
        prompts: Sequence[Sequence[int]] = (),
    ) -> str:
        """The served name to sample ``name`` with: its adapter loaded (``None``: the bare base) and probed
        against ``model`` (base + that adapter, as the trainer holds it) once per process; ``prompts``: the
        ones about to be sampled, of which ``SPOT_PROMPTS`` drawn at random are scored at every call."""
        served = self.base_model() if adapter_dir is None else self.load(adapter_dir, name=name)
        self.end_ids |= decoding.end_token_ids(model, self.tokenizer)
        spot = spot_prompts(prompts)
        if served not in self.probed:
            batch = probe_prompts(self.tokenizer) + spot
            self.probed[served] = parity_probe(
                self, served, model, self.tokenizer, tolerance=tolerance, prompts=batch
            )
        elif spot:
            try:
                parity_probe(self, served, model, self.tokenizer, tolerance=tolerance, prompts=spot)
            except EngineRefused:
                self.probed.pop(served, None)  # probed again, in full, next time
                raise
        return served

    def _complete(self, prompt: Sequence[int], model: str, **kwargs: Any) -> dict[str, Any]:
        """The engine's reply to one completion request, as JSON (checked to have a list of choices)."""
        import openai

        at = f"rollout engine at {self.url}, model {model!r}"
        try:
            raw = self.client.completions.with_raw_response.create(model=model, prompt=list(prompt), **kwargs)
            body = raw.http_response.json()
        except openai.APIError as exc:
            raise EngineRefused(f"{at}: {one_line(str(exc))}") from None
        except ValueError:  # not JSON (json.JSONDecodeError is a ValueError)
            raise EngineRefused(f"{at}: the reply is not JSON") from None
        if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
            raise EngineRefused(f"{at}: the reply has no list of choices")
        return body

    def sample(
        self, prompts: Sequence[Sequence[int]], config: SamplingConfig, *, adapter: str | None
    ) -> list[list[Sample]]:
        """``config.num_samples`` completions per prompt from the served ``adapter`` (a ``ready`` name;
        ``None``: the base), all prompts in flight at once (the engine batches them). Prompt ``i`` is sampled
        with seed ``config.seed + i * num_samples`` (its choice ``j``: that plus ``j`` on ``ratchet serve``).
        Each reply is checked (``engine_replies.reply_samples``) and each text decoded here from its ids."""
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
            at = f"rollout engine at {self.url}, model {model!r}"
            return reply_samples(out, config, vocab=len(self.tokenizer), text_of=self.text_of, at=at)

        with ThreadPoolExecutor(max_workers=max(1, min(MAX_CONCURRENT, len(prompts)))) as pool:
            return list(pool.map(one, range(len(prompts))))

    def text_of(self, ids: Sequence[int], stop: Sequence[str]) -> str:
        """A completion's text as the embedded engine gives it for the same ids (``decoding.sample``): the
        end token it stopped on dropped, special tokens skipped, cut at the first stop string."""
        ids = list(ids[:-1] if ids and ids[-1] in self.end_ids else ids)
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
        hits = [at for at in (text.find(s) for s in stop) if at >= 0]
        return text[: min(hits)] if hits else text

    def prompt_logprobs(self, prompts: Sequence[Sequence[int]], *, adapter: str) -> list[list[float]]:
        """Each prompt token's log-probability after the first, as the engine scores it under ``adapter``."""
        at = f"rollout engine at {self.url}, model {adapter!r}"
        out = []
        for prompt in prompts:
            body = self._complete(
                prompt, adapter, max_tokens=1, temperature=0.0, extra_body={"prompt_logprobs": 0}
            )
            out.append(prompt_values(body, prompt, at))
        return out


def probe_prompts(tokenizer: Any) -> list[list[int]]:
    """The fixed probe batch: ``PROBE_TEXTS`` as literal text in ``tokenizer`` (after its BOS, when it has
    one), each cut to ``PROBE_TOKENS`` tokens."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return [(bos + encode_text(tokenizer, text))[:PROBE_TOKENS] for text in PROBE_TEXTS]


def spot_prompts(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """``SPOT_PROMPTS`` of ``prompts`` (those of at least two tokens) drawn at random, each cut to its first
    ``SPOT_TOKENS``: unpredictable to the engine, unlike the fixed probe."""
    usable = [list(p)[:SPOT_TOKENS] for p in prompts if len(p) >= 2]
    rng = random.Random(secrets.randbits(64))
    return rng.sample(usable, min(SPOT_PROMPTS, len(usable)))


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
    sampler: OpenAISampler,
    served_name: str,
    model: Any,
    tokenizer: Any,
    *,
    tolerance: float,
    prompts: Sequence[Sequence[int]] | None = None,
) -> ProbeResult:
    """Score ``prompts`` (default ``probe_prompts``) on the engine under ``served_name`` and locally with
    ``model``; raise ``EngineRefused`` (one line) when the worst prompt's mean absolute difference exceeds
    ``tolerance`` (or any figure is not a number)."""
    prompts = probe_prompts(tokenizer) if prompts is None else [list(p) for p in prompts]
    remote = sampler.prompt_logprobs(prompts, adapter=served_name)  # finite, checked
    local = local_prompt_logprobs(model, prompts)
    diffs = [[abs(a - b) for a, b in zip(r, loc, strict=True)] for r, loc in zip(remote, local, strict=True)]
    means = [sum(d) / len(d) for d in diffs if d]
    # NaN (a local forward gone wrong) compares false: max() would skip it unless first; count it as inf
    mean_abs = max((m if m == m else math.inf for m in means), default=0.0)
    max_abs = max((x if x == x else math.inf for d in diffs for x in d), default=0.0)
    result = ProbeResult(served_name, mean_abs, max_abs, sum(map(len, diffs)))
    if not mean_abs <= tolerance:
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


# one per engine, key and tokenizer (its probes are kept), the most recently used last; a sampler decodes
# texts and probes with its own tokenizer, never one swapped in by another thread's caller
_OPENAI: dict[tuple[str, str | None, int], OpenAISampler] = {}
_OPENAI_LOCK = threading.Lock()
MAX_SAMPLERS = 8


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
    key = (settings.rollout_engine_url, settings.rollout_engine_api_key, id(tokenizer))
    with _OPENAI_LOCK:  # the sampler holds its tokenizer: the id is not reused while it is kept
        found = _OPENAI.pop(key, None) or OpenAISampler(key[0], api_key=key[1], tokenizer=tokenizer)
        _OPENAI[key] = found
        while len(_OPENAI) > MAX_SAMPLERS:
            _OPENAI.pop(next(iter(_OPENAI)))
        return found
