"""A served multi-turn tool episode trains on exactly the ids that were served (issue 25): on the Qwen3 fixture
(a random-weight Qwen3, a BPE tokenizer trained in the test, a ChatML template with tools), a client calls
``ratchet serve``'s app with ``tool_choice: required`` (the call is forced by constrained decoding), sends
the tool's result back and gets the answer; both turns come back with vLLM's ``return_token_ids``, are
stored with their ids, and the SFT job's own encoding of the curated rows is exactly ``prompt_token_ids +
token_ids`` with labels on ``token_ids`` alone -- no re-rendering through the chat template."""

from __future__ import annotations

import json

import pytest
from realmodel import build_real_model
from training.test_served_tokens import contract, served_sft_examples

from pipeline.modeling.templating import IGNORE
from pipeline.registry import Experience, get_engine, session_scope, upgrade_db
from pipeline.specs.harness import HarnessSpec
from serving.support import HARNESS, SPECIALISTS, build_adapter, register_generation

TIMER = HARNESS["tools"]
# the serving harness with a context the fixture's 400-token vocabulary fits a tool schema in
AGENT_HARNESS = {**HARNESS, "context": {**HARNESS["context"], "max_context_tokens": 1024}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The two turns of one tool episode as the client saw them, and the registry the server stored them in."""
    from fastapi.testclient import TestClient

    from pipeline.serving.served import ServeConfig
    from pipeline.serving.server import create_app

    root = tmp_path_factory.mktemp("served-ids")
    base = build_real_model(root / "qwen3", family="chatml", sharpness=1.0)
    adapters = {s: build_adapter(base, root / f"adapter-{s}", seed=i) for i, s in enumerate(SPECIALISTS)}
    url = f"sqlite:///{root / 'serve.db'}"
    upgrade_db(url)
    register_generation(url, {"base": base, "adapters": adapters}, harness=AGENT_HARNESS)
    config = ServeConfig(registry_url=url, poll_seconds=0, device="cpu", flush_seconds=0.05, allow_anonymous=True,
                         spool_dir=str(root / "spool"))  # fmt: skip
    turns = []
    with TestClient(create_app(config)) as client:
        messages = [{"role": "user", "content": "timer 3+4"}]
        first = client.post("/v1/chat/completions", json={
            "model": "ratchet", "messages": messages, "tools": TIMER, "tool_choice": "required",
            "parallel_tool_calls": False, "return_token_ids": True, "max_tokens": 160, "seed": 3,
            "metadata": {"conversation_id": "episode-1"},
        })  # fmt: skip
        assert first.status_code == 200, first.text
        turns.append(first.json())
        call = first.json()["choices"][0]["message"]["tool_calls"][0]
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"ok": True})},
        ]
        second = client.post("/v1/chat/completions", json={
            "model": "ratchet", "messages": messages, "tools": TIMER, "return_token_ids": True,
            "max_tokens": 12, "seed": 4, "metadata": {"conversation_id": "episode-1"},
        })  # fmt: skip
        assert second.status_code == 200, second.text
        turns.append(second.json())
    return {"base": base, "url": url, "turns": turns, "root": root}


def test_both_turns_are_stored_with_the_ids_the_client_got(served):
    """The stored ``served_tokens`` are the ids the response carried, and the turns share one conversation."""
    engine = get_engine(served["url"])
    with session_scope(engine) as session:
        rows = {r.completion_id: r for r in session.query(Experience)}
    assert len(rows) == 2
    for body in served["turns"]:
        row = rows[body["id"]]
        index = str(len(row.messages) - 1)
        stored = row.served_tokens[index]
        assert stored["prompt_ids"] == body["prompt_token_ids"]
        assert stored["completion_ids"] == body["choices"][0]["token_ids"]
        assert row.conversation_id == "episode-1"
        assert row.tools == TIMER
    first = served["turns"][0]["choices"][0]
    assert first["finish_reason"] == "tool_calls"
    assert first["message"]["tool_calls"][0]["function"]["name"] == "set_timer"


def test_sft_trains_on_exactly_the_served_ids(served):
    """The job's examples from the curated rows are the served prompt + completion ids, labels on the
    completion only (its end token included); both turns of the episode use their stored ids."""
    engine = get_engine(served["url"])
    encoded = served_sft_examples(
        engine,
        model_dir=served["base"],
        harness=HarnessSpec.model_validate(AGENT_HARNESS),
        contract=contract(),
        specialist="agent",
        out_dir=served["root"] / "dataset",
    )
    assert encoded.token_ids.get("served") == 2, encoded.token_ids
    examples = {tuple(ids): labels for ids, labels in encoded.examples}
    for body in served["turns"]:
        prompt, completion = body["prompt_token_ids"], body["choices"][0]["token_ids"]
        labels = examples[tuple(prompt + completion)]
        assert labels == [IGNORE] * len(prompt) + completion
