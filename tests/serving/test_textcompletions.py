"""``POST /v1/completions`` (vLLM's token protocol on ``ratchet serve --expose-adapters``) under attack: every
hostile parameter is a one-line 400 before anything is decoded (a seed the generator cannot take would have
failed the whole batch, other clients' rows with it); ``prompt_logprobs`` is bounded by the logits it would
hold and computed exactly in float32 chunks; a request whose model is unloaded, or whose client leaves,
leaves its batch at once instead of decoding ``n * max_tokens`` for nobody."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from pipeline.serving import textcompletions
from serving.support import ServerThread, champion_registry

KEY = "engine-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "chat-g0"


def engine_app(registry_url):
    from pipeline.registry import get_engine
    from pipeline.serving.adapter_app import create_adapter_app
    from pipeline.serving.scheduler import MicroBatchScheduler
    from pipeline.serving.served import ServeConfig, load_served, plan_generation

    plan = plan_generation(get_engine(registry_url), "main", "champion")
    config = ServeConfig(registry_url=registry_url, device="cpu", poll_seconds=0, max_lora_rank=8)
    served = load_served(plan, config, MicroBatchScheduler())
    names = {f"{s}-g{plan.number}": s for s in served.specialists}
    return create_adapter_app(served.engine, api_key=KEY, model_names=names), served


@pytest.fixture(scope="module")
def registry_url(tmp_path_factory, tiny_artifacts):
    return champion_registry(tmp_path_factory.mktemp("textcompletions"), tiny_artifacts)


@pytest.fixture(scope="module")
def engine(registry_url):
    app, served = engine_app(registry_url)
    with ServerThread(app) as srv:
        srv.runtime = served.engine.runtime
        yield srv


def complete(engine, timeout: float = 60, **body):
    return httpx.post(
        engine.url + "/v1/completions",
        json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, **body},
        headers=AUTH,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"seed": 2**64}, "seed"),  # torch's generator takes -2**63 .. 2**64 - 1
        ({"seed": 2**64 - 1, "n": 2}, "seed"),  # choice 1 is sampled with seed + 1
        ({"seed": -(2**63) - 1}, "seed"),
        ({"temperature": True}, "temperature"),  # pydantic's lax float would take it as 1.0
        ({"temperature": "0.5"}, "temperature"),
        ({"top_p": "1"}, "top_p"),
        ({"stop": ["x"] * (textcompletions.MAX_STOPS + 1)}, "stop"),  # each scanned at every step
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": [True, 5]}, "prompt"),
        ({"n": 65}, "n"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_hostile_parameters_are_one_line_400s(engine, body, param):
    r = complete(engine, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].split(".")[0] == param and "\n" not in error["message"]


def test_a_bad_seed_never_fails_another_clients_row(engine):
    """Sent together, the good request is decoded (it would have shared the failing batch)."""
    out = {}

    def good():
        out["good"] = complete(engine, temperature=1.0, seed=3, max_tokens=8)

    t = threading.Thread(target=good)
    t.start()
    bad = complete(engine, temperature=1.0, seed=2**64 + 5, max_tokens=8)
    t.join(60)
    assert bad.status_code == 400 and out["good"].status_code == 200, out["good"].text
    assert out["good"].json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_non_json_and_out_of_vocabulary_prompts_are_refused(engine):
    r = httpx.post(engine.url + "/v1/completions", content=b"{not json", headers=AUTH, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    vocab = engine.runtime.vocab_size
    r = complete(engine, prompt=[1, vocab])
    assert r.status_code == 400 and f"0..{vocab - 1}" in r.json()["error"]["message"]
    assert httpx.post(engine.url + "/v1/completions", json={"model": MODEL, "prompt": [1]}).status_code == 401


def test_prompt_logprobs_are_bounded_and_exact_in_chunks(engine, monkeypatch):
    """Beyond ``MAX_PROMPT_LOGPROB_VALUES`` (prompt tokens x vocabulary) a 400 naming the parameter; within
    it, the float32 log-softmax taken a few positions at a time gives what one whole pass gives."""
    vocab = engine.runtime.vocab_size
    prompt = [3, 9, 4, 7, 12, 5, 8]
    whole = complete(engine, prompt=prompt, max_tokens=1, temperature=0, prompt_logprobs=2)
    assert whole.status_code == 200, whole.text
    monkeypatch.setattr(textcompletions, "LOGSOFTMAX_ROWS", 2)
    chunked = complete(engine, prompt=prompt, max_tokens=1, temperature=0, prompt_logprobs=2, n=2)
    assert chunked.status_code == 200, chunked.text
    rows = [c["prompt_logprobs"] for c in chunked.json()["choices"]]
    assert rows[0] == rows[1] == whole.json()["choices"][0]["prompt_logprobs"]
    assert len(rows[0]) == len(prompt) and rows[0][0] is None
    monkeypatch.setattr(textcompletions, "MAX_PROMPT_LOGPROB_VALUES", vocab * len(prompt) - 1)
    r = complete(engine, prompt=prompt, prompt_logprobs=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
    assert complete(engine, prompt=prompt[:-1], prompt_logprobs=0).status_code == 200


def slowed(runtime, seconds: float = 0.02):
    """A decoding step made ``seconds`` slower (a hook on the head), so a long request takes a while."""
    return runtime.model.get_base_model().lm_head.register_forward_pre_hook(lambda *_: time.sleep(seconds))


def test_a_client_that_leaves_frees_its_rows(engine):
    """``n`` long choices, the client gone after 0.5 s: the next request is answered at once, not after the
    abandoned rows' remaining ~5 s of steps."""
    long = engine.runtime.context_limit - 4
    hook = slowed(engine.runtime)
    try:
        with pytest.raises(httpx.ReadTimeout):
            complete(engine, timeout=0.5, n=4, max_tokens=long, temperature=1.0, seed=1)
        t0 = time.monotonic()
        r = complete(engine, max_tokens=2)
        took = time.monotonic() - t0
    finally:
        hook.remove()
    assert r.status_code == 200, r.text
    assert took < 1.5, f"waited {took:.1f} s behind a request nobody reads"


def test_unloading_ends_a_completion_in_flight(registry_url):
    """As a chat request: a completion of a model being unloaded is a 404 at once, never finished on the
    base (the runtime answers a removed adapter's name with the bare base)."""
    app, served = engine_app(registry_url)
    runtime = served.engine.runtime
    hook = slowed(runtime)
    out = {}
    try:
        with ServerThread(app) as srv:

            def run():
                out["r"] = complete(srv, max_tokens=runtime.context_limit - 4, temperature=0)

            t = threading.Thread(target=run)
            t.start()
            time.sleep(0.5)  # decoding
            t0 = time.monotonic()
            unload = httpx.post(
                srv.url + "/v1/unload_lora_adapter", json={"lora_name": MODEL}, headers=AUTH, timeout=30
            )
            t.join(30)
            took = time.monotonic() - t0
    finally:
        hook.remove()
    assert unload.status_code == 200, unload.text
    r = out["r"]
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    assert "was unloaded" in r.json()["error"]["message"]
    assert took < 1.5
