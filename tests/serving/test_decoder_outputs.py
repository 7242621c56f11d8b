"""What the batched decoder returns besides text: ``completion_ids`` (exactly the ids decoded, the end token
included) and per-row ``logprobs`` (the model's log-softmax before the grammar's mask, with the top k), on
the char model and the real-proportion BPE model, through ``EmbeddedEngine`` too."""

from __future__ import annotations

import asyncio
import math

import pytest
from realmodel import build_real_model

from pipeline.modeling.grammar import json_schema_grammar
from pipeline.modeling.templating import tokenizer_fingerprint
from pipeline.serving.engines import EmbeddedEngine, EngineRequest, EngineResult, ExternalEngine, complete
from pipeline.serving.runtime import BASE, GenerationRequest, load_runtime
from pipeline.serving.scheduler import MicroBatchScheduler
from serving.support import build_base

SCHEMA = {
    "type": "object",
    "properties": {
        "word": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["word", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=["tiny", "real"])
def runtime(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    base = build_base(root / "base") if request.param == "tiny" else build_real_model(root / "base")
    return load_runtime(base, [], specialists=["chat"], device="cpu")


def _prompt(rt, k):
    return tuple(rt.encode([{"role": "user", "content": f"say something {k}"}]))


def _teacher_forced(rt, prompt, completion):
    """log_softmax of the model's logits at every completion position, from one plain forward pass."""
    import torch

    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.inference_mode():
        logits = rt.model(input_ids=ids).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)


@pytest.mark.parametrize("grammar", [False, True], ids=["free", "json"])
def test_logprobs_are_the_models_log_softmax_with_top_k(runtime, grammar):
    spec = json_schema_grammar(SCHEMA) if grammar else None
    reqs = [
        GenerationRequest(BASE, _prompt(runtime, 0), 12, logprobs=3, grammar=spec),
        GenerationRequest(BASE, _prompt(runtime, 1), 12, temperature=1.0, seed=5, logprobs=0, grammar=spec),
        GenerationRequest(BASE, _prompt(runtime, 2), 12, grammar=spec),  # none asked
    ]
    greedy, sampled, plain = runtime.generate(reqs)
    assert plain.logprobs is None
    for req, r, k in ((reqs[0], greedy, 3), (reqs[1], sampled, 0)):
        assert r.logprobs is not None and len(r.logprobs) == len(r.completion_ids) > 0
        forced = _teacher_forced(runtime, req.prompt_ids, r.completion_ids)
        for pos, (tok, lp) in enumerate(zip(r.completion_ids, r.logprobs, strict=True)):
            assert lp.logprob == pytest.approx(float(forced[pos, tok]), abs=2e-3)
            assert len(lp.top) == k
            values = [v for _, v, _ in lp.top]
            assert values == sorted(values, reverse=True)
            assert sum(math.exp(v) for v in values) <= 1 + 1e-5
            for text, _value, raw in lp.top:
                assert bytes(raw).decode("utf-8", errors="replace") == text
            if k:
                assert values[0] == pytest.approx(float(forced[pos].max()), abs=2e-3)
            if k and not grammar:  # greedy and free: the chosen token is the most likely one
                assert lp.logprob == pytest.approx(values[0], abs=1e-5)


@pytest.mark.parametrize("grammar", [False, True], ids=["free", "json"])
def test_completion_ids_decode_to_the_text(runtime, grammar):
    spec = json_schema_grammar(SCHEMA) if grammar else None
    reqs = [
        GenerationRequest(BASE, _prompt(runtime, k), 40, temperature=1.0 if k else 0.0, seed=k, grammar=spec)
        for k in range(8)
    ]
    for r in runtime.generate(reqs):
        assert runtime.tokenizer.decode(r.completion_ids, skip_special_tokens=True) == r.text
        ended = bool(r.completion_ids) and r.completion_ids[-1] in runtime.end_ids
        assert ended == (r.finish_reason == "stop")
        assert len(r.completion_ids) == r.completion_tokens + (1 if ended else 0)


def test_the_embedded_engine_returns_ids_fingerprint_and_logprobs(runtime):
    async def main():
        engine = EmbeddedEngine(runtime, MicroBatchScheduler(max_batch_size=4, max_wait_ms=5))
        messages = [{"role": "user", "content": "hello"}]
        spec = json_schema_grammar(SCHEMA)
        engine.check_grammar(spec)
        request = EngineRequest(
            "chat", messages, 30, grammar=spec, logprobs=2, passthrough={"logprobs": True}
        )
        try:
            return await complete(engine, request), runtime.encode(messages)
        finally:
            await engine.scheduler.close()

    result, prompt = asyncio.run(main())
    assert isinstance(result, EngineResult)
    assert result.prompt_ids == list(prompt)
    assert result.tokenizer == tokenizer_fingerprint(runtime.tokenizer)
    assert runtime.tokenizer.decode(result.completion_ids, skip_special_tokens=True) == result.text
    # OpenAI's content logprobs leave out the end token, which completion_ids keep (training learns to stop)
    assert result.logprobs is not None and len(result.logprobs) == result.completion_tokens
    assert len(result.completion_ids) - result.completion_tokens == (result.finish_reason == "stop")
    assert all(len(lp.top) == 2 for lp in result.logprobs)


def test_the_external_engine_sends_passthrough_unchanged():
    engine = ExternalEngine("http://127.0.0.1:9", model_names={"chat": "m"})
    params = {
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "logprobs": True,
        "top_logprobs": 2,
    }
    body = engine._body(EngineRequest("chat", [{"role": "user", "content": "hi"}], 5, passthrough=params))
    assert {k: body[k] for k in params} == params
    engine.check_grammar(json_schema_grammar(SCHEMA))  # the external engine enforces its own: no-op
    asyncio.run(engine.aclose())
