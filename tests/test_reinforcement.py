"""The GRPO job: group-relative advantages raise the reward it is given, flat rewards leave the policy where it
was, multi-turn episodes run tool calls against the task's substrate, every assistant turn (and no tool
result) is trained on -- on the char model and on a real architecture's template."""

from __future__ import annotations

import json

import pytest

from pipeline.environment import sample_prompts, training_corpus
from pipeline.environment.tinymodel import TinyModelConfig, ensure_tiny_model
from pipeline.modeling.packing import IGNORE
from pipeline.scoring import EpisodeReward
from pipeline.specs.modelspec import GrpoSettings, LoraConfig
from pipeline.specs.tasksource import DemoTasks
from pipeline.training import TrainConfig, train_lora, write_dataset
from pipeline.training.grpo import Episodes, roll_out, train_grpo
from pipeline.training.likelihood import encode_episode

SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                        max_position_embeddings=96, bootstrap_steps=40, bootstrap_batch_size=32,
                        corpus_size=400, seed=2)  # fmt: skip
LORA = LoraConfig(rank=4, alpha=8)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return ensure_tiny_model(config=SMALL, cache_dir=tmp_path_factory.mktemp("tiny"))


def _episodes(items, reward, **kw) -> Episodes:
    """Episodes paid ``reward(trace)`` for their whole length (no turn singled out as the checked one)."""
    return Episodes(items=items, view=lambda messages: messages, max_new_tokens=32,
                    reward=lambda trace: EpisodeReward(reward(trace), None), **kw)  # fmt: skip


def _reply(trace) -> str:
    return trace["messages"][-1].get("content") or ""


def test_grpo_raises_the_reward_it_is_given(base_dir, tmp_path):
    from pipeline.registry.tracking import MLflowTracker

    tracker = MLflowTracker(
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_root=tmp_path / "art"
    )

    def digits(trace):  # a dense reward the barely trained base can climb: the share of digits it writes
        reply = _reply(trace)
        return sum(c.isdigit() for c in reply) / max(1, len(reply))

    task = _episodes(sample_prompts("chat", 64, seed=1), digits)
    settings = GrpoSettings(group_size=8, prompts_per_step=8, steps=16, lr=1e-2, kl_beta=0.1)
    result = train_grpo(base_model_dir=base_dir, output_dir=tmp_path / "job", episodes=task, settings=settings,
                        lora=LORA, tracker=tracker, seed=3)  # fmt: skip
    rewards = [r for _, r in result.loss_curve]
    assert len(rewards) == 16
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.06, rewards  # measured: 0.24 -> 0.34
    record = json.loads((result.adapter_dir / "lineage.json").read_text())
    assert record["method"] == "grpo" and record["prompts"] == 64 and record["reference"] == "base model"
    for metric in ("reward", "reward_std", "informative_groups", "kl", "assistant_turns"):
        assert len(tracker.client.get_metric_history(result.run_id, metric)) == 16, metric


def test_flat_rewards_teach_nothing(base_dir, tmp_path):
    """Every group's rewards equal: no advantage, no update; the adapter stays the fresh one (B = 0)."""
    from safetensors.torch import load_file

    flat = _episodes(sample_prompts("chat", 16, seed=1), lambda trace: 1.0)
    result = train_grpo(base_model_dir=base_dir, output_dir=tmp_path / "job", episodes=flat, lora=LORA,
                        settings=GrpoSettings(group_size=4, prompts_per_step=4, steps=3))  # fmt: skip
    weights = load_file(str(result.adapter_dir / "adapter_model.safetensors"))
    assert all(float(t.abs().max()) == 0.0 for k, t in weights.items() if "lora_B" in k)


def test_an_interrupted_grpo_job_resumes_with_the_same_result(base_dir, tmp_path):
    from safetensors.torch import load_file

    task = _episodes(sample_prompts("chat", 32, seed=2), lambda trace: float("1" in _reply(trace)))
    settings = GrpoSettings(group_size=4, prompts_per_step=4, steps=4, lr=1e-2, kl_beta=0.1)
    whole = train_grpo(base_model_dir=base_dir, output_dir=tmp_path / "w", episodes=task, settings=settings,
                       lora=LORA)  # fmt: skip
    cut = train_grpo(base_model_dir=base_dir, output_dir=tmp_path / "c", episodes=task, settings=settings,
                     lora=LORA, stop_after_steps=2)  # fmt: skip
    assert not cut.completed
    rest = train_grpo(base_model_dir=base_dir, output_dir=tmp_path / "c", episodes=task, settings=settings,
                      lora=LORA)  # fmt: skip
    assert rest.resumed_from_step == 2
    a = load_file(str(whole.adapter_dir / "adapter_model.safetensors"))
    b = load_file(str(rest.adapter_dir / "adapter_model.safetensors"))
    assert all((a[k] - b[k]).abs().max() < 1e-5 for k in a)


@pytest.fixture(scope="module")
def caller(small_base, tmp_path_factory):
    """The lineage tests' small base taught the agent family's compact calls (so that it makes some)."""
    work = tmp_path_factory.mktemp("caller")
    write_dataset([t for t in training_corpus(2000, seed=7) if t["metadata"]["task"] == "agent"], work / "d")
    return train_lora(base_model_dir=small_base, dataset_dir=work / "d", output_dir=work / "job",
                      config=TrainConfig(rank=8, alpha=16, epochs=3, batch_size=32, lr=5e-3)).adapter_dir  # fmt: skip


def test_multi_turn_episodes_act_on_the_substrate(small_base, caller):
    """Each call is executed against the episode's own substrate state and its result given back; the
    episode goes on until a reply without a call or max_turns."""
    from pipeline.environment import TOOLS, initial_state
    from pipeline.modeling.decoding import load_model

    model, tok = load_model(small_base, caller)
    source = DemoTasks(specialist="agent")
    items = sample_prompts("agent", 6, seed=4)
    task = _episodes(items, lambda t: 0.0, reset=source.reset, act=source.act, tools=TOOLS)
    traces = roll_out(model, tok, items, task, GrpoSettings(group_size=2, max_turns=3, temperature=0.7),
                      fmt="compact", seed=0)  # fmt: skip
    assert len(traces) == 12
    acted = 0
    for trace in traces:
        new = trace["messages"][1:]
        assert new[0]["role"] == "assistant" and len([m for m in new if m["role"] == "assistant"]) <= 3
        state = initial_state()
        for i, message in enumerate(new):
            if message["role"] != "tool":
                continue
            acted += 1
            call = next(tc for tc in new[i - 1]["tool_calls"] if tc["id"] == message["tool_call_id"])
            state, result = source.act(state, {"name": call["function"]["name"],
                                               "arguments": json.loads(call["function"]["arguments"])})  # fmt: skip
            assert json.loads(message["content"]) == result  # the substrate's answer, nothing else
        last = new[-1]
        assert last["role"] == "assistant"
        assert not last.get("tool_calls") or sum(m["role"] == "assistant" for m in new) == 3
    assert acted > 0  # the taught model calls tools, so some episodes have several turns


def test_the_turns_the_policy_wrote_are_trained_and_no_tool_result_or_exemplar_on_a_real_template(tmp_path):
    from realmodel import train_tokenizer

    from pipeline.experience.toolcalls import to_openai

    tok = train_tokenizer()
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    episode = [
        {"role": "user", "content": "weather code for Bonn?"},  # an exemplar: context, never trained on
        {"role": "assistant", "content": "21"},
        {"role": "user", "content": "weather code for Köln?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": to_openai([{"name": "lookup", "arguments": {"city": "Köln"}}]),
        },  # fmt: skip
        {"role": "tool", "tool_call_id": "x", "content": '{"code": 17}'},
        {"role": "assistant", "content": "17 😀"},
    ]
    ids, labels = encode_episode(tok, episode, 512, fmt="openai", tools=tools, turns=2)  # the policy wrote 2
    spans, current = [], []
    for i, label in zip(ids, labels, strict=True):
        if label != IGNORE:
            current.append(i)
        elif current:
            spans.append(tok.decode(current))
            current = []
    spans += [tok.decode(current)] if current else []
    assert spans == [  # each turn as SFT labels a final turn: through the template's end of turn
        '<tool_call>\n{"name": "lookup", "arguments": {"city": "Köln"}}\n</tool_call><|im_end|>\n',
        "17 😀<|im_end|>\n",
    ]
    assert "tool_response" not in "".join(spans) and "21" not in "".join(spans)


def test_grpo_runs_on_a_real_architecture_with_tools(tmp_path):
    from realmodel import build_real_model

    base = build_real_model(tmp_path / "qwen", sharpness=1.0)
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    items = [{"messages": [{"role": "user", "content": f"code for city {i}?"}], "metadata": {"task_id": str(i)}}
             for i in range(8)]  # fmt: skip
    task = Episodes(
        items=items,
        view=lambda messages: messages,
        reward=lambda trace: EpisodeReward(float(len(_reply(trace)) % 2), None),
        tools=tools,
        reset=lambda item: {},
        act=lambda state, call: (state, {"code": 17}),
        max_new_tokens=8,
    )
    result = train_grpo(base_model_dir=base, output_dir=tmp_path / "job", episodes=task, lora=LORA,
                        settings=GrpoSettings(group_size=4, prompts_per_step=4, steps=2, max_turns=2),
                        tool_call_format="openai")  # fmt: skip
    assert result.completed and result.steps == 2 and len(result.adapter_sha256) == 64


def test_a_substrate_that_fails_on_a_call_answers_with_an_error(small_base, caller):
    """The model's calls are untrusted input: a substrate that raises on one ends nothing but that call."""
    from pipeline.environment import TOOLS
    from pipeline.modeling.decoding import load_model

    def broken(state, call):
        raise KeyError(call["name"])

    model, tok = load_model(small_base, caller)
    items = sample_prompts("agent", 4, seed=4)
    task = _episodes(items, lambda t: 0.0, reset=lambda item: {}, act=broken, tools=TOOLS)
    traces = roll_out(model, tok, items, task, GrpoSettings(group_size=2, max_turns=2), fmt="compact", seed=0)
    results = [m["content"] for t in traces for m in t["messages"] if m["role"] == "tool"]
    assert results and all(json.loads(r)["error"].startswith("KeyError") for r in results)


def test_the_update_trains_the_turns_the_reward_paid_for_and_none_after():
    """Found on main: a text turn ending a tool episode was paid by the call before it (a lie after a right
    `set_timer` earned 1.0) and trained on. The reward now names the checked turn it pays for; the update trains
    the policy's turns up to it and never the unchecked text after it."""
    from pipeline.training.grpo import paid_turns

    episode = [
        {"role": "user", "content": "timer 20+27"},
        {"role": "assistant", "content": "set_timer(minutes=47)"},
        {"role": "tool", "tool_call_id": "a", "content": "ok"},
        {"role": "assistant", "content": "I could not set any timer, sorry. Also 2+2=5."},
    ]
    kept, turns = paid_turns(episode, EpisodeReward(1.0, 1), asked=0)
    assert kept == episode[:2] and turns == 1
    whole, turns = paid_turns(episode, EpisodeReward(0.0, None), asked=0)  # nothing checked: all, at 0 reward
    assert whole == episode and turns == 2
    with_item_turn = [{"role": "assistant", "content": "an exemplar"}, *episode]
    assert paid_turns(with_item_turn, EpisodeReward(1.0, 2), asked=1)[1] == 1
