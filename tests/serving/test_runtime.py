"""The embedded runtime: checked adapter loading, mixed-adapter batches equal to single rows, streaming,
stop strings, constrained label decoding, and the async micro-batching scheduler."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from pipeline.errors import RatchetError
from pipeline.serving.runtime import BASE, AdapterSource, GenerationRequest, load_runtime, tree_sha256
from pipeline.serving.scheduler import MicroBatchScheduler
from pipeline.specs.loading import file_sha256
from serving.support import RANK, SPECIALISTS, TARGETS, TOOL_ANSWER, TOOL_VIEW


def source(path, specialist="chat", **over):
    if "sha256" not in over:
        over["sha256"] = file_sha256(path / "adapter_model.safetensors")
    fields = dict(specialist=specialist, path=path, rank=RANK, target_modules=TARGETS, base_model_id=1)
    fields.update(over)
    return AdapterSource(**fields)


@pytest.fixture(scope="module")
def runtime(tiny_artifacts):
    srcs = [source(tiny_artifacts["adapters"][s], s) for s in SPECIALISTS]
    return load_runtime(
        tiny_artifacts["base"], srcs, specialists=[*SPECIALISTS, "extra"], base_model_id=1, device="cpu"
    )


def prompts(runtime):
    texts = ["12+35=?", "timer 3+4", "f adds 12 35 and more text", "counter 1+2", "hi"]
    return [tuple(runtime.encode([{"role": "user", "content": t}])) for t in texts]


def test_adapters_change_outputs_and_unknown_specialists_use_the_base(runtime):
    ids = prompts(runtime)[0]
    outs = runtime.generate([GenerationRequest(a, ids, 10) for a in [*SPECIALISTS, BASE, "extra"]])
    texts = [o.text for o in outs]
    assert len(set(texts[:5])) == 5, texts  # every adapter differs from the others and from the base
    assert texts[5] == texts[4] and runtime.adapter_name("extra") == BASE


@pytest.mark.parametrize("mode", ["merged", "stacked", "segments"])
def test_mixed_batch_rows_equal_rows_alone_under_greedy(runtime, mode):
    ps = prompts(runtime)
    reqs = [GenerationRequest(a, p, 12) for p in ps for a in (*SPECIALISTS, BASE)][::2]
    runtime.segmented.mode = mode
    try:
        batch = runtime.generate(reqs)
        alone = [runtime.generate([r])[0] for r in reqs]
    finally:
        runtime.segmented.mode = "merged"
    assert [b.text for b in batch] == [a.text for a in alone]
    assert [b.completion_tokens for b in batch] == [a.completion_tokens for a in alone]


def test_trained_adapter_answers_its_view(runtime):
    out = runtime.generate([GenerationRequest("agent", tuple(runtime.encode(TOOL_VIEW)), 30)])[0]
    assert out.text == TOOL_ANSWER and out.finish_reason == "stop"


def test_stop_strings_length_and_streaming(runtime):
    ids = tuple(runtime.encode(TOOL_VIEW))
    deltas: dict[int, str] = {}
    reqs = [
        GenerationRequest("agent", ids, 30, stop=("(min",)),
        GenerationRequest("agent", ids, 4),
        GenerationRequest("chat", ids, 6),
    ]
    outs = runtime.generate(reqs, on_text=lambda i, d: deltas.__setitem__(i, deltas.get(i, "") + d))
    assert outs[0].text == "set_timer" and outs[0].finish_reason == "stop"
    assert outs[1].text == "set_" and outs[1].finish_reason == "length" and outs[1].completion_tokens == 4
    assert [deltas.get(i, "") for i in range(3)] == [o.text for o in outs]


def test_sampling_is_seeded(runtime):
    ids = prompts(runtime)[0]
    a = runtime.generate([GenerationRequest("chat", ids, 12, temperature=1.0, top_p=0.9, seed=7)])[0].text
    b = runtime.generate([GenerationRequest("chat", ids, 12, temperature=1.0, top_p=0.9, seed=7)])[0].text
    assert a == b


def test_constrained_label_scores(runtime):
    scores = runtime.label_scores([{"role": "user", "content": "timer 3+4"}], list(SPECIALISTS), "chat")
    assert set(scores) == set(SPECIALISTS) and abs(sum(scores.values()) - 1) < 1e-5


def _copy(tiny_artifacts, tmp_path, name="chat"):
    dst = tmp_path / f"copy-{name}"
    shutil.copytree(tiny_artifacts["adapters"][name], dst)
    return dst


def _rename_keys(path, rename):
    from safetensors.torch import load_file, save_file

    state = load_file(str(path / "adapter_model.safetensors"))
    save_file({rename(k): v for k, v in state.items()}, str(path / "adapter_model.safetensors"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p: (p / "adapter_model.safetensors").write_bytes(b"x" * 10), "does not match the registry"),
        ("rank", "rank r=8 but the registry says 4"),
        ("targets", "target modules"),
        ("base", "trained on base model id 2"),
        ("pickle", "pickled weights are never loaded"),
        ("missing_module", "target module 'nope_proj' does not exist"),
        ("no_module", "match no module"),
        ("one_unmatched", "matches no module"),
    ],
)
def test_refuses_adapters_that_do_not_fit(tiny_artifacts, tmp_path, change, message):
    path = _copy(tiny_artifacts, tmp_path)
    over: dict = {}
    if callable(change):
        src = source(path)
        change(path)
    else:
        if change == "rank":
            over["rank"] = 4
        elif change == "targets":
            over["target_modules"] = ("q_proj",)
        elif change == "base":
            over["base_model_id"] = 2
        elif change == "pickle":
            (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")
            over["sha256"] = "0" * 64
        elif change == "missing_module":
            cfg = json.loads((path / "adapter_config.json").read_text())
            cfg["target_modules"] = [*TARGETS, "nope_proj"]
            (path / "adapter_config.json").write_text(json.dumps(cfg))
            over["target_modules"] = (*TARGETS, "nope_proj")
        elif change == "no_module":
            _rename_keys(path, lambda k: k.replace("layers.", "blocks."))
        elif change == "one_unmatched":
            _rename_keys(path, lambda k: k.replace("layers.1.mlp.up_proj", "layers.1.mlp.side_proj"))
        src = source(path, **over)
    with pytest.raises(RatchetError, match=message):
        load_runtime(tiny_artifacts["base"], [src], base_model_id=1, device="cpu")


def test_directory_sha256_is_accepted(tiny_artifacts, tmp_path):
    path = _copy(tiny_artifacts, tmp_path)
    rt = load_runtime(tiny_artifacts["base"], [source(path, sha256=tree_sha256(path))], device="cpu")
    assert rt.adapters == {"chat"}


def test_scheduler_batches_concurrent_requests(runtime):
    ps = prompts(runtime)
    reqs = [GenerationRequest(SPECIALISTS[i % 4], ps[i % len(ps)], 8) for i in range(12)]
    expected = [runtime.generate([r])[0].text for r in reqs]

    async def main():
        sched = MicroBatchScheduler(max_batch_size=8, max_wait_ms=20)
        tickets = [sched.submit(runtime, r) for r in reqs]
        streamed = await asyncio.gather(*[_collect(t) for t in tickets])
        results = [await t.result for t in tickets]
        await sched.close()
        return sched.stats, streamed, results

    stats, streamed, results = asyncio.run(main())
    assert [r.text for r in results] == expected and streamed == expected
    assert stats.rows == 12 and stats.max_rows == 8 and stats.batches == 2


async def _collect(ticket):
    return "".join([d async for d in ticket.stream()])


def test_mixed_lora_modes_agree_with_peft(runtime, tiny_artifacts):
    srcs = [source(tiny_artifacts["adapters"][s], s) for s in SPECIALISTS]
    peft_rt = load_runtime(tiny_artifacts["base"], srcs, device="cpu", mix="peft")
    assert runtime.mix == "segments" and runtime.segmented.mode == "merged" and peft_rt.segmented is None
    reqs = [GenerationRequest(a, p, 10) for p in prompts(runtime)[:3] for a in (*SPECIALISTS, BASE)]
    texts = {}
    for mode in ("stacked", "segments", "merged"):
        runtime.segmented.mode = mode
        try:
            texts[mode] = [r.text for r in runtime.generate(reqs)]
        finally:
            runtime.segmented.mode = "merged"
    assert (
        texts["stacked"] == texts["segments"] == texts["merged"] == [r.text for r in peft_rt.generate(reqs)]
    )
