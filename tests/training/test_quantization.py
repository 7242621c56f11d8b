"""QLoRA (the model spec's ``quantization: nf4``): a 4-bit base through bitsandbytes where it can run,
refused in one line where it cannot; the adapter trained on it is saved unquantized and loads onto the float
base. bitsandbytes is an optional extra (``ratchet-lineage[qlora]``): with it installed the training test
runs (on the CPU: bitsandbytes >= 0.50 quantizes and computes there), without it the refusal test does."""

from __future__ import annotations

import importlib.util

import pytest

from pipeline.errors import RatchetError
from pipeline.modeling.placement import Placement
from pipeline.modeling.quantization import quantized_load_kwargs
from pipeline.training import TrainConfig, train_lora, write_dataset

HAVE_BNB = importlib.util.find_spec("bitsandbytes") is not None
CPU = Placement(device="cpu", dtype="float32")


def test_none_adds_nothing_and_an_unknown_kind_is_refused():
    assert quantized_load_kwargs("none", CPU) == {}
    with pytest.raises(RatchetError, match="quantization is one of none, nf4, not 'int3'"):
        quantized_load_kwargs("int3", CPU)


@pytest.mark.skipif(HAVE_BNB, reason="bitsandbytes is installed: the training test below runs instead")
def test_nf4_without_bitsandbytes_is_refused_in_one_line(tmp_path):
    from realmodel import build_real_model

    from pipeline.training.likelihood import policy_model

    with pytest.raises(
        RatchetError, match=r"needs bitsandbytes, which is not installed \(pip install"
    ) as err:
        quantized_load_kwargs("nf4", CPU)
    assert "\n" not in str(err.value)
    base = build_real_model(tmp_path / "qwen", sharpness=1.0)
    with pytest.raises(RatchetError, match="needs bitsandbytes"):  # before any weight is read
        policy_model(base, rank=4, alpha=8, dropout=0.0, target_modules=["q_proj"], parent_adapter_dir=None,
                     where=CPU, quantization="nf4")  # fmt: skip


@pytest.mark.skipif(not HAVE_BNB, reason="bitsandbytes is not installed (ratchet-lineage[qlora])")
def test_qlora_trains_on_a_4bit_base_and_saves_an_unquantized_adapter_for_the_float_base(tmp_path):
    import torch
    from peft import PeftModel
    from realmodel import build_real_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pipeline.training.likelihood import policy_model

    base = build_real_model(tmp_path / "qwen", sharpness=1.0)
    quantized = policy_model(base, rank=4, alpha=8, dropout=0.0, target_modules=["q_proj", "up_proj"],
                             parent_adapter_dir=None, where=CPU, quantization="nf4")  # fmt: skip
    weights = {type(p).__name__ for n, p in quantized.named_parameters() if "lora_" not in n}
    assert "Params4bit" in weights  # the base is 4-bit ...
    trainable = [p for p in quantized.parameters() if p.requires_grad]
    assert trainable and all(
        p.dtype == torch.float32 for p in trainable
    )  # ... the LoRA float32, alone trained

    rows = [{"messages": [{"role": "user", "content": f"say café {i}"},
                          {"role": "assistant", "content": f"déjà vu {i % 3} señor"}]} for i in range(16)]  # fmt: skip
    write_dataset(rows, tmp_path / "ds")
    config = TrainConfig(rank=4, alpha=8, dropout=0.0, target_modules=("q_proj", "up_proj"), max_steps=6,
                         batch_size=8, lr=2e-2, warmup_steps=1)  # fmt: skip
    result = train_lora(base_model_dir=base, dataset_dir=tmp_path / "ds", output_dir=tmp_path / "job",
                        config=config, where=CPU, quantization="nf4")  # fmt: skip
    assert result.completed and result.loss_curve[-1][1] < result.loss_curve[0][1]

    saved = load_file(str(result.adapter_dir / "adapter_model.safetensors"))
    assert saved and all(t.dtype == torch.float32 for t in saved.values())  # unquantized
    assert any("lora_B" in k and t.abs().sum() > 0 for k, t in saved.items())
    float_base = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    pair = PeftModel.from_pretrained(float_base, result.adapter_dir)  # onto the float base, as served
    assert {type(p).__name__ for p in pair.parameters()} == {"Parameter"}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    ids = tok.apply_chat_template(rows[0]["messages"], return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        with pair.disable_adapter():
            before = pair(input_ids=ids, labels=ids).loss
        after = pair(input_ids=ids, labels=ids).loss
    assert after < before  # what was learned on the 4-bit base carries over to the float one
