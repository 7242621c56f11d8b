"""Batched decoding: agreement with transformers' greedy generate, sampling, stop strings, k samples; prompts
are token ids (``templating.encode_prompt``), never text."""

from __future__ import annotations

import pytest

from pipeline.environment import FAMILIES, sample_prompts
from pipeline.environment.tinymodel import TinyModelConfig, ensure_tiny_model
from pipeline.modeling.decoding import SamplingConfig, generate, load_model
from pipeline.modeling.templating import encode_prompt

SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                        max_position_embeddings=96, bootstrap_steps=40, bootstrap_batch_size=32,
                        corpus_size=400, seed=2)  # fmt: skip


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(ensure_tiny_model(config=SMALL, cache_dir=tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def prompts(loaded):
    _, tok = loaded
    items = [i for f in FAMILIES for i in sample_prompts(f, 5, seed=0)]
    return [encode_prompt(tok, i["messages"]) for i in items]


def test_greedy_matches_transformers_generate(loaded, prompts):
    import torch

    model, tok = loaded
    ours = generate(model, tok, prompts, SamplingConfig(temperature=0, max_new_tokens=12, batch_size=7))
    for prompt, (text,) in zip(prompts, ours, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)  # fmt: skip
        ref = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        assert text == ref


def test_sampling_is_seeded_and_gives_k_samples(loaded, prompts):
    model, tok = loaded
    config = SamplingConfig(temperature=1.0, top_p=0.9, num_samples=3, max_new_tokens=8, seed=5)
    a = generate(model, tok, prompts, config)
    b = generate(model, tok, prompts, config)
    assert a == b and all(len(s) == 3 for s in a)
    assert generate(model, tok, prompts, SamplingConfig(**{**config.__dict__, "seed": 6})) != a
    with pytest.raises(ValueError):
        generate(model, tok, prompts, SamplingConfig(temperature=0, num_samples=2))


def test_stop_strings_and_progress(loaded, prompts):
    model, tok = loaded
    seen = []
    full = generate(model, tok, prompts, SamplingConfig(temperature=0, max_new_tokens=10))
    cut = generate(model, tok, prompts, SamplingConfig(temperature=0, max_new_tokens=10, stop=("(", "1"), batch_size=4),
                   progress=lambda d, n: seen.append((d, n)))  # fmt: skip
    for (f,), (c,) in zip(full, cut, strict=True):
        assert f.startswith(c) and "(" not in c and "1" not in c
    assert seen[-1] == (len(prompts), len(prompts))


def test_text_prompts_are_refused(loaded):
    """A rendered string would be tokenized again with special-token parsing on: content holding a role
    marker's text would become the role marker. ``generate`` takes ids only."""
    model, tok = loaded
    with pytest.raises(TypeError, match="token ids"):
        generate(model, tok, ["<|user|>1+2=?<|assistant|>"], SamplingConfig(temperature=0, max_new_tokens=2))


def test_kv_cache_choice(loaded):
    """``auto`` is the dynamic cache off CUDA (the static one measured slower on the CPU), ``static`` a
    preallocated ``StaticCache`` of the batch's full length; a misspelt kind is refused."""
    from transformers import StaticCache

    from pipeline.modeling.decoding import kv_cache

    model, _ = loaded
    assert kv_cache(model, SamplingConfig(), length=50) is None
    static = kv_cache(model, SamplingConfig(kv_cache="static"), length=50)
    assert isinstance(static, StaticCache) and static.layers[0].max_cache_len == 50
    with pytest.raises(ValueError, match="kv_cache"):
        kv_cache(model, SamplingConfig(kv_cache="paged"), length=50)
