"""Padding-free attention over packed rows (``pipeline.training.attention``): the same logits, loss and
LoRA gradients as transformers' block-diagonal masked SDPA, on a Qwen3-style model (``realmodel``) and a
Llama-style one with grouped-query attention, with no mask given to SDPA; and exact fallbacks inside the
switch (a padding mask, a KV cache)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from realmodel import build_real_model  # noqa: E402

from pipeline.modeling.packing import IGNORE, packed_tensors  # noqa: E402
from pipeline.training import ALL_LINEAR  # noqa: E402
from pipeline.training.attention import PACKED, attention_kwargs, padding_free  # noqa: E402
from pipeline.training.kernels import assistant_loss, merged_lora  # noqa: E402

VOCAB = 400


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def base_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "model"
    if request.param == "qwen3":
        return build_real_model(path, sharpness=1.0)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def _lora(base_dir):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="sdpa"),
        LoraConfig(r=4, lora_alpha=8, target_modules=list(ALL_LINEAR), task_type="CAUSAL_LM"),
    )
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    return model


def _examples(n=12, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(1, 40) if rng.random() < 0.2 else rng.randint(8, 40)
        ids = [rng.randrange(4, VOCAB) for _ in range(length)]
        cut = rng.randint(0, max(0, length - 2))
        out.append((ids, [IGNORE] * max(cut, 1) + ids[max(cut, 1) :]))
    return out


def _hidden(model, batch):
    decoder = model.get_base_model().get_decoder()
    return decoder(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False,
                   **attention_kwargs(model, batch)).last_hidden_state  # fmt: skip


def test_padding_free_equals_the_masked_path(base_dir, monkeypatch):
    """Hidden states, loss and LoRA gradients through the kernel equal the masked path's, and SDPA never
    gets a mask while the switch is on (its flash/memory-efficient kernels on a GPU)."""
    import torch

    model = _lora(base_dir)
    batch = packed_tensors(_examples(), 64, 0)
    assert batch["input_ids"].shape[0] < 12  # several examples share a row

    def run():
        model.zero_grad()
        with merged_lora(model):
            loss = assistant_loss(model, batch)
            loss.backward()
        with torch.no_grad():
            hidden = _hidden(model, batch)
        return (
            hidden,
            loss.item(),
            {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad},
        )

    masked = run()
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("attn_mask"), kwargs.get("is_causal"), args[0].shape[2]))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    with padding_free(model, cpu=True) as implementation:
        assert implementation == PACKED
        free = run()
    assert model.get_base_model().config._attn_implementation == "sdpa"  # restored
    segments = len(batch["cu_seq_lens"]) - 1
    assert len(calls) >= 2 * segments  # per segment, per layer (and again in backward's recompute: none)
    assert all(mask is None and (causal or length == 1) for mask, causal, length in calls)
    torch.testing.assert_close(free[0], masked[0], atol=2e-5, rtol=1e-5)
    assert free[1] == pytest.approx(masked[1], rel=1e-6)
    for name, grad in masked[2].items():
        torch.testing.assert_close(free[2][name], grad, atol=1e-6, rtol=1e-4)


def test_inside_the_switch_padding_masks_and_caches_stay_exact(base_dir):
    """A padded batch with its attention mask, and greedy decoding with a KV cache, give the same as the
    model's own SDPA: the switch only drops the mask of a whole-row causal forward."""
    import torch

    model = _lora(base_dir).eval()
    rows = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    ids = torch.tensor([r + [0] * (6 - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (6 - len(r)) for r in rows])

    def outputs():
        with torch.no_grad():
            padded = model(input_ids=ids, attention_mask=mask).logits * mask[..., None]
            greedy = model.generate(input_ids=ids[:1], max_new_tokens=5, do_sample=False, output_logits=True,
                                    return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
        return padded, greedy.sequences, torch.stack(greedy.logits)

    plain = outputs()
    with padding_free(model, cpu=True):
        switched = outputs()
    for a, b in zip(switched, plain, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


def test_switch_only_where_it_is_exact(base_dir, tmp_path):
    """Off on a CPU unless asked (the masked path is as fast there); off for sliding-window attention."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    model = _lora(base_dir)
    with padding_free(model) as implementation:
        assert implementation is None
        assert model.get_base_model().config._attn_implementation == "sdpa"
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, use_sliding_window=True,
                         sliding_window=8, max_window_layers=0)  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "sliding")
    sliding = AutoModelForCausalLM.from_pretrained(tmp_path / "sliding", attn_implementation="sdpa")
    with padding_free(sliding, cpu=True) as implementation:
        assert implementation is None
