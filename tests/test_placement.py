"""Device and dtype resolution (this machine has no GPU: the CUDA branch is checked where it refuses)."""

from __future__ import annotations

import logging

import pytest
import torch

from pipeline.errors import RatchetError
from pipeline.modeling import placement as placement_module
from pipeline.modeling.placement import placement, tokenizer_dir


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU defaults")
def test_auto_is_float32_on_the_cpu_and_cuda_is_refused_without_a_gpu():
    where = placement()
    assert (where.device, where.dtype, where.torch_dtype) == ("cpu", "float32", torch.float32)
    with pytest.raises(RatchetError, match="torch sees no CUDA GPU"):
        placement(device="cuda")


def test_half_precision_on_the_cpu_warns_once(caplog, monkeypatch):
    monkeypatch.setattr(placement_module, "_WARNED", set())
    with caplog.at_level(logging.WARNING, logger="pipeline.modeling.placement"):
        assert placement(dtype="float16", device="cpu").torch_dtype == torch.float16
        placement(dtype="float16", device="cpu")
    assert sum("slow" in r.message for r in caplog.records) == 1
    with pytest.raises(ValueError, match="unknown dtype"):
        placement(dtype="int4")


def test_bfloat16_warns_only_without_native_support(caplog, monkeypatch):
    monkeypatch.setattr(placement_module, "_WARNED", set())
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    with caplog.at_level(logging.WARNING, logger="pipeline.modeling.placement"):
        placement(dtype="bfloat16", device="cpu")
    assert any("slow" in r.message for r in caplog.records)
    caplog.clear()
    monkeypatch.setattr(placement_module, "_WARNED", set())
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    with caplog.at_level(logging.WARNING, logger="pipeline.modeling.placement"):
        placement(dtype="bfloat16", device="cpu")
    assert not caplog.records


def test_tokenizer_dir(tmp_path):
    assert tokenizer_dir("same_as_base", tmp_path) == tmp_path
    assert tokenizer_dir(str(tmp_path / "tok"), "/base") == tmp_path / "tok"


def test_loaded_models_follow_the_placement(tmp_path):
    """The loop's loader honours the dtype (bfloat16 on the CPU here: honoured, with the warning)."""
    from realmodel import build_real_model

    from pipeline.modeling.decoding import SamplingConfig, generate, load_model
    from pipeline.modeling.templating import encode_prompt

    path = build_real_model(tmp_path / "m")
    model, tok = load_model(path, where=placement(dtype="bfloat16", device="cpu"))
    assert next(model.parameters()).dtype == torch.bfloat16
    prompt = encode_prompt(tok, [{"role": "user", "content": "hi"}])
    (texts,) = generate(model, tok, [prompt], SamplingConfig(temperature=0.0, max_new_tokens=4))
    assert isinstance(texts[0], str)
