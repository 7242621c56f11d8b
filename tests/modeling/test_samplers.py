"""The ``openai`` rollout engine against a real server speaking vLLM's protocol (``ratchet serve
--expose-adapters``' app under uvicorn): adapters loaded by versioned name, token ids and log-probabilities
back, the parity probe passing on the right weights and refusing, in one line, a stale server that answers
the load but keeps sampling an older adapter; and the pair's one shared base."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from serving.support import build_adapter, build_base

from pipeline.errors import RatchetError
from pipeline.modeling.decoding import SamplingConfig
from pipeline.modeling.samplers import (
    EngineRefused,
    OpenAISampler,
    local_prompt_logprobs,
    probe_prompts,
    versioned_name,
)
from pipeline.specs.loading import file_sha256

KEY = "engine-admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """A tiny random Llama (the char tokenizer) and two different random adapters of it."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("samplers")
    base = build_base(root / "base")
    out = {"root": root, "base": base}
    out["old"] = build_adapter(base, root / "old", seed=1)
    out["new"] = build_adapter(base, root / "new", seed=2)
    torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module")
def server(built):
    """``ratchet serve --expose-adapters`` as a process over a registry whose champion has the ``old``
    adapter for ``chat`` (its other specialists answer with the bare base), loading adapters from the
    test's directory; admin key ``KEY``. ``.url``, ``.base``: a name the bare base answers."""
    from serving.support import SPECIALISTS, free_port, register_generation

    from pipeline.registry import upgrade_db

    url = f"sqlite:///{built['root'] / 'serve.db'}"
    upgrade_db(url)
    register_generation(
        url, {"base": built["base"], "adapters": {"chat": built["old"]}}, specialists=("chat",)
    )
    port = free_port()
    env = {**os.environ, "RATCHET_DATABASE_URL": url, "RATCHET_HOME": str(built["root"] / "home"),
           "RATCHET_DEVICE": "cpu", "RATCHET_API_KEY": KEY}  # fmt: skip
    cmd = [sys.executable, "-c", "from pipeline.cli import main; main()", "serve", "--expose-adapters"]
    cmd += ["--port", str(port), "--threads", "1", "--adapter-root", str(built["root"])]
    log = built["root"] / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if (
                    httpx.get(f"http://127.0.0.1:{port}/v1/models", headers=AUTH, timeout=1).status_code
                    == 200
                ):
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "ratchet serve did not start: " + log.read_text()
            time.sleep(0.2)
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}", base=SPECIALISTS[1])
    finally:
        proc.terminate()
        proc.wait(30)


def local(built, adapter: str | None):
    """The trainer's view: the base with ``adapter`` (unmerged peft), float32, eval mode."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(built["base"])
    if adapter is not None:
        model = PeftModel.from_pretrained(model, built[adapter])
    return model.eval(), AutoTokenizer.from_pretrained(built["base"])


def test_the_completions_endpoint_speaks_vllms_token_protocol(built, server):
    """``/v1/completions`` takes token ids, returns vLLM's ``prompt_token_ids`` / ``token_ids`` (the end token
    kept), a logprob per completion token, and ``prompt_logprobs`` (first None) equal to a local forward."""
    model, tok = local(built, None)
    prompt = probe_prompts(tok)[0]
    body = {"model": server.base, "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 2,
            "prompt_logprobs": 1, "return_token_ids": True}  # fmt: skip
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["prompt_token_ids"] == prompt
    assert 1 <= len(choice["token_ids"]) <= 6 == body["max_tokens"]
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])
    assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"])
    rows = choice["prompt_logprobs"]
    assert rows[0] is None and len(rows) == len(prompt)
    served = [rows[p][str(t)]["logprob"] for p, t in enumerate(prompt) if p > 0]
    (mine,) = local_prompt_logprobs(model, [prompt])
    assert max(abs(a - b) for a, b in zip(served, mine, strict=True)) < 1e-4
    # the completion's own logprobs are the model's: teacher-forcing prompt + completion locally agrees
    (forced,) = local_prompt_logprobs(model, [prompt + choice["token_ids"]])
    tail = forced[len(prompt) - 1 :]
    assert max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], tail, strict=True)) < 1e-4
    refused = httpx.post(server.url + "/v1/completions", json={**body, "stream": True},
                         headers=AUTH)  # fmt: skip
    assert refused.status_code == 400 and "stream" in refused.json()["error"]["message"]


def test_an_adapter_is_loaded_by_versioned_name_probed_and_sampled(built, server):
    model, tok = local(built, "new")
    sampler = OpenAISampler(server.url, api_key=KEY, tokenizer=tok)
    served = sampler.ready(built["new"], name="chat", model=model, tolerance=1e-3)
    assert served == f"chat-{file_sha256(built['new'] / 'adapter_model.safetensors')[:12]}"
    assert served == versioned_name(built["new"], "chat")
    probe = sampler.probed[served]
    assert probe.tokens > 50 and probe.mean_abs < 1e-4  # the same weights: float rounding only
    assert sampler.ready(built["new"], name="chat", model=model, tolerance=1e-3) == served  # loaded once

    prompts = probe_prompts(tok)[:3]
    greedy = sampler.sample(prompts, SamplingConfig(temperature=0.0, max_new_tokens=8), adapter=served)
    assert [len(row) for row in greedy] == [1, 1, 1]
    for prompt, (s,) in zip(prompts, greedy, strict=True):
        assert len(s.token_ids) == len(s.logprobs) >= 1
        (forced,) = local_prompt_logprobs(model, [prompt + list(s.token_ids)])
        assert max(abs(a - b) for a, b in zip(s.logprobs, forced[len(prompt) - 1 :], strict=True)) < 1e-4
    hot = SamplingConfig(temperature=1.0, num_samples=3, max_new_tokens=8, seed=5)
    sampled = sampler.sample(prompts, hot, adapter=served)
    assert [len(row) for row in sampled] == [3, 3, 3]
    assert len({s.token_ids for s in sampled[0]}) > 1  # different seeds, different samples
    sampler.unload(served)  # a GRPO step's adapter, replaced by the next one
    assert served not in sampler.probed
    with pytest.raises(EngineRefused, match="does not exist"):
        sampler.sample(prompts[:1], hot, adapter=served)


class StaleProxy:
    """A loopback proxy in front of the real server that answers ``/v1/load_lora_adapter`` with 200 without
    forwarding it, and sends every completion to ``stale`` (an older adapter's served name) whatever the
    request's model: the silent failure of a server that keeps sampling old weights."""

    def __init__(self, target: str, stale: str):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                return None

            def _send(self, status: int, body: bytes, kind: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                r = httpx.get(target + self.path, headers={"Authorization": self.headers["Authorization"]})
                self._send(r.status_code, r.content, r.headers["content-type"])

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path.endswith("/load_lora_adapter"):
                    proxy.swallowed.append(json.loads(raw)["lora_name"])
                    self._send(200, b"Success: LoRA adapter added successfully.", "text/plain")
                    return
                body = json.loads(raw)
                body["model"] = stale
                r = httpx.post(target + self.path, json=body,
                               headers={"Authorization": self.headers["Authorization"]}, timeout=60)  # fmt: skip
                self._send(r.status_code, r.content, r.headers["content-type"])

        self.swallowed: list[str] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> StaleProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_the_probe_refuses_a_stale_server_in_one_line(built, server):
    """The old adapter is loaded for real; the proxy then takes the new one's load (200) but the server
    keeps sampling the old weights under the new name: the probe refuses, naming adapter, figure, tolerance."""
    model, tok = local(built, "new")
    old = OpenAISampler(server.url, api_key=KEY, tokenizer=tok).load(built["old"], name="chat")
    with StaleProxy(server.url, stale=old) as proxy:
        sampler = OpenAISampler(proxy.url, api_key=KEY, tokenizer=tok)
        new = versioned_name(built["new"], "chat")
        with pytest.raises(EngineRefused) as refused:
            sampler.ready(built["new"], name="chat", model=model, tolerance=0.05)
        assert proxy.swallowed == [new]
    message = str(refused.value)
    assert isinstance(refused.value, RatchetError) and "\n" not in message
    assert repr(new) in message and "tolerance 0.05" in message and "stale" in message
    figure = float(message.split("differ from the trainer's by ")[1].split(" ")[0])
    assert figure > 0.5  # far beyond any rounding: another adapter's weights
    assert new not in sampler.probed  # never marked ready: the next call probes again


def test_the_pair_answers_every_specialist_on_one_base_copy(built):
    """``PairModel`` holds both adapters on one base (the base's weight tensors are the same objects
    whichever adapter is active) and, per adapter, gives the logits of a merged private copy."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from pipeline.modeling.pair import PairModel

    base, tok = local(built, None)
    shared = PairModel(base, tok)
    x = torch.tensor([probe_prompts(tok)[1]])
    weights = set()
    for name in ("old", "new", None, "new"):
        with shared.use(None if name is None else built[name]) as model, torch.inference_mode():
            got = model(input_ids=x).logits
            weights |= {p.data_ptr() for n, p in model.named_parameters() if "lora_" not in n}
        fresh = AutoModelForCausalLM.from_pretrained(built["base"])
        if name is not None:
            fresh = PeftModel.from_pretrained(fresh, built[name]).merge_and_unload()
        with torch.inference_mode():
            want = fresh.eval()(input_ids=x).logits
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-3), name
    assert len(weights) == len([n for n, _ in base.named_parameters() if "lora_" not in n])
    assert len(shared.names) == 2  # each adapter attached once


def test_answer_items_on_the_openai_engine_equal_the_embedded_answers(built, server, monkeypatch):
    """Collection's, discovery's and evaluation's sampling (``pair.answer_items``) on the engine: the chat
    specialist's adapter loaded by versioned name and probed, the agent answering on the bare base; greedy
    answers equal those decoded in this process; sampled ones come ``num_samples`` per item."""
    from serving.support import HARNESS

    from pipeline.modeling.pair import PairSpec, answer_items
    from pipeline.settings import get_settings
    from pipeline.specs.harness import HarnessSpec

    pair = PairSpec(built["base"], {"chat": built["new"], "agent": None}, HarnessSpec.model_validate(HARNESS))
    asks = ["12+35=?", "hello there", "timer 3+4"]
    items = {s: [{"messages": [{"role": "user", "content": a}], "metadata": {"task_id": f"{s}{i}"}}
                 for i, a in enumerate(asks)] for s in ("chat", "agent")}  # fmt: skip
    embedded = answer_items(pair, items, temperature=0.0)
    monkeypatch.setenv("RATCHET_ROLLOUT_ENGINE", "openai")
    monkeypatch.setenv("RATCHET_ROLLOUT_ENGINE_URL", server.url)
    monkeypatch.setenv("RATCHET_ROLLOUT_ENGINE_API_KEY", KEY)
    get_settings.cache_clear()
    remote = answer_items(pair, items, temperature=0.0)
    assert remote == embedded
    assert any(t["messages"][-1].get("content") for (t,) in remote["chat"])  # not all empty
    listed = httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"]
    assert {m["id"]: m["parent"] for m in listed}[versioned_name(built["new"], "chat")] == server.base
    sampled = answer_items(pair, items, num_samples=2, temperature=1.0, seed=3)
    assert [len(t) for t in sampled["chat"]] == [2, 2, 2]


class HostileEngine:
    """A loopback server speaking the protocol's shape with whatever ``reply(request body)`` returns
    (``(status, bytes)``): a buggy or hostile engine."""

    def __init__(self, reply):
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                return None

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._send(200, json.dumps({"object": "list", "data": [{"id": "base", "object": "model",
                                                                        "parent": None}]}).encode())  # fmt: skip

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self._send(*reply(body))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> HostileEngine:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def choice(index=0, ids=(5, 6), logprobs=(-0.5, -1.0), text="", **extra):
    return {"index": index, "text": text, "token_ids": list(ids), "finish_reason": "length",
            "logprobs": {"token_logprobs": list(logprobs), "tokens": [], "top_logprobs": []}, **extra}  # fmt: skip


def replying(choices):
    return lambda body: (
        200,
        json.dumps({"id": "x", "object": "text_completion", "choices": choices}).encode(),
    )


HOSTILE_REPLIES = {
    "no token_ids": replying([{**choice(), "token_ids": None}]),
    "id beyond the vocabulary": replying([choice(ids=(5, 10**6))]),
    "negative id": replying([choice(ids=(-1, 6))]),
    "float id": replying([choice(ids=(5.0, 6))]),
    "bool id": replying([choice(ids=(True, 6))]),
    "NaN logprob": replying([choice(logprobs=(float("nan"), -1.0))]),
    "positive logprob": replying([choice(logprobs=(3.0, -1.0))]),
    "string logprob": replying([choice(logprobs=("-1", -1.0))]),
    "fewer logprobs": replying([choice(logprobs=(-1.0,))]),
    "more tokens than max_tokens": replying([choice(ids=(5,) * 9, logprobs=(-1.0,) * 9)]),
    "fewer choices than n": replying([choice(0)]),
    "a choice twice": replying([choice(0), choice(0)]),
    "a third choice with a string index": replying([choice(0), choice(1), choice("x")]),
    "choices not a list": replying({"0": choice()}),
    "a choice not an object": replying([choice(0), 7]),
    "logprobs not an object": replying([{**choice(), "logprobs": [1]}]),
    "not JSON": lambda body: (200, b"<html>oops</html>"),
    "an error with a multi-line body": lambda body: (500, b'{"error": {"message": "a\\nb\\nTraceback"}}'),
}


@pytest.mark.parametrize("reply", HOSTILE_REPLIES.values(), ids=HOSTILE_REPLIES.keys())
def test_a_hostile_engines_reply_is_one_refusal_line(built, reply):
    """Whatever the engine sends back, sampling ends in one ``EngineRefused`` line, never a traceback of
    another kind and never a sample the loop would train on."""
    _, tok = local(built, None)
    with HostileEngine(reply) as engine:
        sampler = OpenAISampler(engine.url, api_key=None, tokenizer=tok, timeout=10)
        sampler.client = sampler.client.with_options(max_retries=0)
        config = SamplingConfig(temperature=1.0, num_samples=2, max_new_tokens=8, seed=1)
        with pytest.raises(EngineRefused) as refused:
            sampler.sample([[1, 2, 3]], config, adapter="base")
    assert "\n" not in str(refused.value) and engine.url in str(refused.value)


def test_the_text_is_what_the_ids_say(built):
    """The engine's text is not trusted: each sample's text is decoded here from its ids (end token dropped,
    cut at the stop string), so rewards and training see what was sampled."""
    _, tok = local(built, None)
    ids = tok.encode("ab;cd", add_special_tokens=False) + [tok.eos_token_id]
    reply = replying([choice(0, ids=ids, logprobs=[-1.0] * len(ids), text="I AM SOMETHING ELSE")])
    with HostileEngine(reply) as engine:
        sampler = OpenAISampler(engine.url, api_key=None, tokenizer=tok, timeout=10)
        config = SamplingConfig(temperature=1.0, max_new_tokens=8, stop=(";",))
        ((s,),) = sampler.sample([[1, 2, 3]], config, adapter="base")
    assert s.text == "ab" and s.token_ids == tuple(ids)


def test_a_nan_in_a_later_probe_prompt_refuses(built):
    """The first probe prompt scored exactly, the others NaN: max() over the prompts' figures skipped NaN
    after the first, so the probe passed on numbers it never compared."""
    model, tok = local(built, None)
    prompts = probe_prompts(tok)
    exact = {tuple(p): lp for p, lp in zip(prompts, local_prompt_logprobs(model, prompts), strict=True)}

    def reply(body):
        prompt = body["prompt"]
        values = exact[tuple(prompt)] if prompt == prompts[0] else [float("nan")] * (len(prompt) - 1)
        rows = [None] + [{str(t): {"logprob": v, "rank": 1}} for t, v in zip(prompt[1:], values, strict=True)]
        return replying([{**choice(0, ids=(5,), logprobs=(-1.0,)), "prompt_logprobs": rows}])(body)

    with HostileEngine(reply) as engine:
        sampler = OpenAISampler(engine.url, api_key=None, tokenizer=tok, timeout=10)
        with pytest.raises(EngineRefused) as refused:
            sampler.ready(None, name="base", model=model, tolerance=0.05)
    assert "\n" not in str(refused.value) and "nan" in str(refused.value).lower()
    assert "base" not in sampler.probed


class RecognisingProxy(StaleProxy):
    """A server that knows the fixed probe: probe prompts go to the adapter asked for, every other prompt to
    ``stale`` (the load is forwarded for real)."""

    def __init__(self, target: str, stale: str, probe: list[list[int]]):
        super().__init__(target, stale)
        handler = self.server.RequestHandlerClass

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers["Content-Length"]))
            body = json.loads(raw)
            if not self.path.endswith("/completions") or body.get("prompt") in probe:
                r = httpx.post(target + self.path, content=raw, timeout=60,
                               headers={"Authorization": self.headers["Authorization"],
                                        "Content-Type": "application/json"})  # fmt: skip
            else:
                r = httpx.post(target + self.path, json={**body, "model": stale}, timeout=60,
                               headers={"Authorization": self.headers["Authorization"]})  # fmt: skip
            self._send(r.status_code, r.content, r.headers["content-type"])

        handler.do_POST = do_POST


def test_a_server_that_recognises_the_probe_is_caught_on_the_real_prompts(built, server):
    """The fixed probe passes (it is answered with the right weights), but a few of the prompts the caller
    is about to sample, drawn at random, are probed too and the stale weights behind them refuse."""
    model, tok = local(built, "new")
    old = OpenAISampler(server.url, api_key=KEY, tokenizer=tok).load(built["old"], name="chat")
    real = [tok.encode(f"what is {i}+{i}? answer briefly please", add_special_tokens=False) for i in range(6)]
    with RecognisingProxy(server.url, stale=old, probe=probe_prompts(tok)) as proxy:
        sampler = OpenAISampler(proxy.url, api_key=KEY, tokenizer=tok)
        with pytest.raises(EngineRefused, match="differ from the trainer's"):
            sampler.ready(built["new"], name="chat", model=model, tolerance=0.05, prompts=real)
        # the fixed probe alone is fooled: that is why the real prompts are drawn
        assert sampler.ready(built["new"], name="chat", model=model, tolerance=0.05)


def test_an_engine_that_is_down_is_one_refusal_line(built):
    """Nothing listens: listing, sampling and unloading each end in one ``EngineRefused`` line."""
    _, tok = local(built, None)
    with HostileEngine(replying([])) as engine:
        url = engine.url
    sampler = OpenAISampler(url, api_key=None, tokenizer=tok, timeout=5)
    sampler.client = sampler.client.with_options(max_retries=0)
    for call in (sampler.base_model, lambda: sampler.unload("x-123")):
        with pytest.raises(EngineRefused) as refused:
            call()
        assert "\n" not in str(refused.value) and url in str(refused.value)


def test_a_sampler_keeps_its_own_tokenizer(built):
    """Two callers with different bases on one engine (collection and a GRPO job in one worker): each gets a
    sampler decoding with its own tokenizer; the first's is not swapped for the second's mid-flight."""
    from transformers import AutoTokenizer

    from pipeline.modeling.samplers import sampler_for
    from pipeline.settings import Settings

    settings = Settings(
        rollout_engine="openai", rollout_engine_url="http://127.0.0.1:9", rollout_engine_api_key=None
    )
    one, two = (AutoTokenizer.from_pretrained(built["base"]) for _ in range(2))
    first = sampler_for(settings, tokenizer=one)
    second = sampler_for(settings, tokenizer=two)
    assert first is not second and first.tokenizer is one and second.tokenizer is two
    assert sampler_for(settings, tokenizer=one) is first  # its probes are kept
