"""Decoding on the device (issue 26): finished rows leave the batch (their KV-cache rows dropped) without
changing any completion, seeded sampling draws the same completions as when every row stayed, the
preallocated ``StaticCache`` decodes what the dynamic cache does, and ``sample`` returns the ids decoded
with their log-probabilities under the model.

The reference below is the loop as it was before: every row kept to the end of the batch, the last
position's full logits copied to the host as float32 and sampled there with ``torch.multinomial``."""

from __future__ import annotations

import pytest
from realmodel import build_real_model

from pipeline.modeling.decoding import (
    SamplingConfig,
    cache_keyword,
    end_token_ids,
    generate,
    load_model,
    sample,
)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A random-weight Qwen3 (SDPA attention) whose end tokens' output rows are scaled up so that rows end
    at different steps (greedy: after 1 to 9 tokens on ``mixed``; sampled: 2 to 40)."""
    import torch

    model, tok = load_model(
        build_real_model(tmp_path_factory.mktemp("qwen") / "model", sharpness=1.0, shards=1)
    )
    with torch.no_grad():
        model.lm_head.weight[sorted(end_token_ids(model, tok))] *= 3.0
    return model, tok


@pytest.fixture(scope="module")
def mixed() -> list[list[int]]:
    """Twelve prompts of 2 to 13 random ids (seeded)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 14, (12,), generator=gen).tolist()
    return [torch.randint(3, 300, (n,), generator=gen).tolist() for n in lengths]


def _reference(model, tok, prompts, config):
    """The pre-issue-26 loop for one batch: no row leaves, logits go to the host, CPU multinomial."""
    import torch

    batch, width = len(prompts), max(len(p) for p in prompts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    eos = torch.tensor(sorted(end_token_ids(model, tok)))
    kw = cache_keyword(model)
    gen, past, out = torch.Generator().manual_seed(config.seed), None, [[] for _ in prompts]
    done = torch.zeros(batch, dtype=torch.bool)
    with torch.inference_mode():
        for _ in range(config.max_new_tokens):
            res = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{kw: past})
            past, logits = getattr(res, kw), res.logits[:, -1, :].float().cpu()
            if config.temperature == 0:
                nxt = logits.argmax(-1)
            else:
                probs = torch.softmax(logits / config.temperature, -1)
                nxt = torch.multinomial(probs, 1, generator=gen)[:, 0]
            for i in (~done).nonzero().flatten().tolist():
                out[i].append(int(nxt[i]))
            done |= torch.isin(nxt, eos)
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones((batch, 1), dtype=torch.long)], 1)
            pos, ids = pos[:, -1:] + 1, torch.where(done, pad, nxt)[:, None]
    return out


def _batch_sizes(model):
    """A list that records the batch size of every forward of ``model``, and the hook's handle."""
    sizes: list[int] = []
    handle = model.register_forward_pre_hook(
        lambda _m, _a, kw: sizes.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    return sizes, handle


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_finished_rows_leave_the_batch_and_nothing_changes(qwen, mixed, temperature):
    model, tok = qwen
    config = SamplingConfig(temperature=temperature, max_new_tokens=40, batch_size=len(mixed), seed=3)
    sizes, handle = _batch_sizes(model)
    try:
        ours = sample(model, tok, mixed, config)
    finally:
        handle.remove()
    ordered = sorted(range(len(mixed)), key=lambda i: len(mixed[i]))  # sample's batch order
    ref = _reference(model, tok, [mixed[i] for i in ordered], config)
    assert [list(ours[i][0].token_ids) for i in ordered] == ref
    lengths = sorted(len(r) for r in ref)
    assert lengths[0] < lengths[-1], "the probe batch must have rows that end at different steps"
    assert sizes[0] == len(mixed) and sizes[-1] < len(mixed)  # rows left
    assert sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_static_cache_decodes_what_the_dynamic_cache_does(qwen, mixed, temperature):
    model, tok = qwen
    base = {"temperature": temperature, "max_new_tokens": 24, "batch_size": 3, "seed": 11, "top_p": 0.95}
    dynamic = sample(model, tok, mixed, SamplingConfig(**base, kv_cache="dynamic"))
    static = sample(model, tok, mixed, SamplingConfig(**base, kv_cache="static"))
    assert [[s.token_ids for s in r] for r in static] == [[s.token_ids for s in r] for r in dynamic]
    for a, b in zip(static, dynamic, strict=True):
        assert a[0].logprobs == pytest.approx(b[0].logprobs, abs=1e-4)


def test_samples_carry_their_ids_and_logprobs(qwen, mixed):
    """Each sample's ids are what was decoded (its end token included) and its log-probs are the model's raw
    log-softmax at each position, as a teacher-forced forward of prompt + ids gives them."""
    import torch

    model, tok = qwen
    config = SamplingConfig(temperature=1.0, num_samples=2, max_new_tokens=30, seed=4)
    samples = sample(model, tok, mixed, config)
    assert generate(model, tok, mixed, config) == [[s.text for s in row] for row in samples]
    ends = end_token_ids(model, tok)
    for prompt, row in zip(mixed, samples, strict=True):
        for s in row:
            assert len(s.token_ids) == len(s.logprobs) >= 1
            assert s.token_ids[-1] in ends or len(s.token_ids) == config.max_new_tokens
            with torch.inference_mode():
                logits = model(input_ids=torch.tensor([prompt + list(s.token_ids)])).logits[0].float()
            steps = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
            forced = steps.gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0].tolist()
            assert list(s.logprobs) == pytest.approx(forced, abs=1e-4)
            assert s.text == tok.decode([t for t in s.token_ids if t not in ends], skip_special_tokens=True)
