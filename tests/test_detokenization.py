"""Exact incremental detokenization on real tokenizers (byte-level BPE and Metaspace/SentencePiece), in the
loop's decoding and in serving, plain and streamed, checked against ``tokenizer.decode`` and against
``transformers``' own ``generate`` on a random-weight Qwen3 (tests/realmodel.py)."""

from __future__ import annotations

import pytest
from realmodel import build_real_model, train_tokenizer

from pipeline.modeling.decoding import SamplingConfig, end_token_ids, generate, load_model
from pipeline.modeling.detokenization import REPLACEMENT, TextStream

TEXTS = [
    "Résumé 😀 naïve",
    " leading and  double spaces",
    "日本語のテキスト 🎉🚀 done",
    "👩‍💻 🇫🇷 👍🏽 ½ € ✓",
    "def add(a, b):\n    return a + b\n",
]
KINDS = ("bytelevel", "metaspace")
PROMPTS = ["say it", "Résumé", "日本語", "hello 😀", "def add", "Grüße"]


def per_token(tokenizer, ids: list[int]) -> str:
    """The old way: each token decoded alone (what this module replaces)."""
    return "".join(tokenizer.decode([i], skip_special_tokens=True) for i in ids)


REPLY = "Résumé 😀 naïve café"  # what the fixture model is taught to answer to MEMORIZED


MEMORIZED = "say it"


def teach(model, tokenizer, prompt: str, reply: str, steps: int = 150) -> None:
    """Train the random model (all weights) until its greedy answer to ``prompt`` is ``reply``."""
    import torch

    ids = tokenizer(prompt + reply + "<|im_end|>", add_special_tokens=False)["input_ids"]
    n_prompt = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    x = torch.tensor([ids])
    labels = x.clone()
    labels[0, :n_prompt] = -100
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=x, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


@pytest.fixture(scope="module", params=KINDS)
def real_model(request, tmp_path_factory):
    path = build_real_model(tmp_path_factory.mktemp(request.param), kind=request.param)
    model, tokenizer = load_model(path)
    teach(model, tokenizer, chat_prompt(tokenizer, MEMORIZED), REPLY)
    return request.param, model, tokenizer


@pytest.mark.parametrize("kind", KINDS)
def test_stream_equals_decode_at_every_whole_character(kind):
    tok = train_tokenizer(kind)
    broken = 0
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        stream = TextStream(tok)
        for n, i in enumerate(ids, 1):
            stream.push(i)
            reference = tok.decode(ids[:n], skip_special_tokens=True)
            if not reference.endswith(REPLACEMENT):
                assert stream.text == reference, (kind, text, n)
            assert tok.decode(ids, skip_special_tokens=True).startswith(stream.text)  # never half a character
        assert stream.final() == tok.decode(ids, skip_special_tokens=True)
        broken += per_token(tok, ids) != stream.final()
    assert broken >= 3, "the texts no longer exercise what per-token decoding gets wrong"


def test_special_tokens_add_nothing():
    tok = train_tokenizer("bytelevel")
    stream = TextStream(tok)
    ids = tok("hi", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_start|>")]
    for i in ids:
        stream.push(i)
    assert stream.text == stream.final() == "hi"


def hf_greedy(model, tokenizer, prompt: str, max_new_tokens: int) -> list[int]:
    import torch

    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    out = model.generate(
        ids,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=end_token_ids(model, tokenizer).pop(),
    )
    new = out[0, ids.shape[1] :].tolist()
    ends = end_token_ids(model, tokenizer)
    return new[: next((k for k, t in enumerate(new) if t in ends), len(new))]


def chat_prompt(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def test_every_eos_of_generation_config_ends_a_reply(real_model):
    _, model, tokenizer = real_model
    assert tokenizer.pad_token is None
    assert end_token_ids(model, tokenizer) == {
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    }


def test_loop_decoding_matches_transformers_generate(real_model):
    kind, model, tokenizer = real_model
    prompts = [chat_prompt(tokenizer, p) for p in PROMPTS]
    config = SamplingConfig(temperature=0.0, max_new_tokens=24, batch_size=1)
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]  # benign prompts
    ours = [texts[0] for texts in generate(model, tokenizer, encoded, config)]
    refs = [hf_greedy(model, tokenizer, p, 24) for p in prompts]
    assert ours == [tokenizer.decode(ids, skip_special_tokens=True) for ids in refs]
    # the taught reply splits characters (byte-level) or drops spaces (Metaspace) token by token
    assert ours[0] == REPLY and per_token(tokenizer, refs[0]) != REPLY, (kind, ours[0])


def test_serving_stream_matches_transformers_generate(real_model):
    from pipeline.serving.runtime import GenerationRequest, MixtureRuntime

    kind, model, tokenizer = real_model
    runtime = MixtureRuntime(model, tokenizer, ["chat"], set(), "cpu")
    prompts = [chat_prompt(tokenizer, p) for p in PROMPTS]
    requests = [
        GenerationRequest(
            adapter="chat",
            prompt_ids=tuple(tokenizer(p, add_special_tokens=False)["input_ids"]),
            max_new_tokens=24,
        )
        for p in prompts
    ]
    deltas: dict[int, list[str]] = {i: [] for i in range(len(requests))}
    results = runtime.generate(requests, on_text=lambda i, d: deltas[i].append(d))
    refs = [tokenizer.decode(hf_greedy(model, tokenizer, p, 24), skip_special_tokens=True) for p in prompts]
    assert [r.text for r in results] == refs, kind
    assert ["".join(deltas[i]) for i in range(len(requests))] == refs
    assert refs[0] == REPLY and results[0].finish_reason == "stop"
