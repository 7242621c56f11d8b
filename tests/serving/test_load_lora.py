"""Runtime adapter loading: the project's own engine (``--expose-adapters``) speaks vLLM's
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` with load_runtime's checks, and a server in
front of it (``--engine external``) loads a newly promoted generation's adapters into it before any turn
goes to them, keeping the old champion when loading fails."""

from __future__ import annotations

import logging
import shutil

import httpx
import openai
import pytest

from pipeline.serving.served import ServeConfig
from pipeline.serving.server import create_app
from serving.support import SPECIALISTS, ServerThread, build_adapter, experience_rows, register_generation

KEY = "engine-key"
TEMPLATE = "{specialist}-g{generation}"
PROMPTS = ["12+35=?", "f adds 3 4", "counter 5+6", "hello there"]


ADMIN = {"Authorization": "Bearer operator-key-of-the-front"}  # /admin/reload needs the admin scope


def config(url, **over):
    return ServeConfig(
        **{"registry_url": url, "device": "cpu", "poll_seconds": 0, "flush_seconds": 0.05,
           "api_key": "operator-key-of-the-front", "allow_anonymous": True, **over}
    )  # fmt: skip


def engine_app(url, *, api_key=KEY, names=None, **options):
    """The project's engine over ``url``'s champion (only its adapters loaded), named by TEMPLATE;
    ``options`` go to ``create_adapter_app`` (``adapter_roots``)."""
    from pipeline.registry import get_engine
    from pipeline.serving.adapter_app import create_adapter_app
    from pipeline.serving.scheduler import MicroBatchScheduler
    from pipeline.serving.served import load_served, plan_generation

    plan = plan_generation(get_engine(url), "main", "champion")
    served = load_served(plan, config(url, max_lora_rank=8), MicroBatchScheduler())
    names = names or {TEMPLATE.format(specialist=s, generation=plan.number): s for s in served.specialists}
    return create_adapter_app(served.engine, api_key=api_key, model_names=names, **options), served


@pytest.fixture(scope="module")
def next_adapters(tiny_artifacts, tmp_path_factory):
    root = tmp_path_factory.mktemp("next")
    base = tiny_artifacts["base"]
    return {s: build_adapter(base, root / s, seed=200 + i) for i, s in enumerate(SPECIALISTS)}


def ask(url, prompts=PROMPTS):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    return [
        client.chat.completions.create(
            model="ratchet", messages=[{"role": "user", "content": p}], max_tokens=6, temperature=0
        )
        for p in prompts
    ]


def models(url):
    r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    return {m["id"] for m in r.json()["data"]}


def test_a_promotion_is_loaded_into_the_external_engine_first(
    registry, tiny_artifacts, next_adapters, tmp_path, caplog
):
    from pipeline.registry import get_engine
    from pipeline.serving.served import plan_generation

    roots = [next_adapters["chat"].parent, tmp_path]  # besides the artifact store, where they are
    app, _served = engine_app(registry, adapter_roots=roots)
    with ServerThread(app) as engine:
        assert models(engine.url) == {f"{s}-g0" for s in SPECIALISTS}  # only the old adapters
        front_app = create_app(
            config(
                registry,
                engine="external",
                engine_url=engine.url,
                engine_api_key=KEY,
                engine_model_template=TEMPLATE,
            )
        )
        with ServerThread(front_app) as front:
            before = ask(front.url)
            assert {r.metadata["generation"] for r in before} == {"0"}

            register_generation(registry, {**tiny_artifacts, "adapters": next_adapters})  # promoted
            switched = httpx.post(front.url + "/admin/reload", headers=ADMIN).json()
            assert switched == {"generation": 1, "previous": 0, "switched": True}
            assert {f"{s}-g1" for s in SPECIALISTS} <= models(engine.url)  # the engine got the load calls
            after = ask(front.url)
            assert {r.metadata["generation"] for r in after} == {"1"}
            with ServerThread(create_app(config(registry))) as embedded:  # generation 1, all in process
                reference = ask(embedded.url)
            texts = [r.choices[0].message.content for r in after]
            assert texts == [r.choices[0].message.content for r in reference]
            assert texts != [r.choices[0].message.content for r in before]  # new adapters, new answers

            # generation 2: its last adapter does not match the registry: the engine refuses it
            copies = {s: tmp_path / s for s in SPECIALISTS}
            for s, path in copies.items():
                shutil.copytree(next_adapters[s], path)
            register_generation(registry, {**tiny_artifacts, "adapters": copies})
            last = plan_generation(get_engine(registry), "main", "champion").adapters[-1]
            (last.path / "adapter_model.safetensors").write_bytes(b"not the weights")
            caplog.clear()
            with caplog.at_level(logging.ERROR, logger="pipeline.serving.turns"):
                failed = httpx.post(front.url + "/admin/reload", headers=ADMIN).json()
            assert failed["switched"] is False and failed["generation"] == 1
            assert f"'{last.specialist}-g2'" in failed["error"] and "sha256" in failed["error"]
            [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
            assert "not switching to generation 2" in line and "still serving 1" in line
            assert not any(m.endswith("-g2") for m in models(engine.url))  # the partial load was undone
            assert {r.metadata["generation"] for r in ask(front.url, PROMPTS[:1])} == {"1"}
            front_app.state.ratchet.recorder.flush()
    rows = [e for e in experience_rows(registry) if e.meta["engine"] == "external"]
    served_models = {e.meta["generation"]: set() for e in rows}
    for e in rows:
        served_models[e.meta["generation"]].add(e.meta["engine_model"])
    assert served_models[0] <= {f"{s}-g0" for s in SPECIALISTS}
    assert served_models[1] <= {f"{s}-g1" for s in SPECIALISTS} and served_models[1]


def test_the_engine_loads_and_unloads_adapters_as_vllm_does(registry, tiny_artifacts, tmp_path):
    from pipeline.specs.loading import file_sha256

    app, served = engine_app(registry, adapter_roots=[tiny_artifacts["root"], tmp_path])
    chat_dir = tiny_artifacts["adapters"]["chat"]
    sha = file_sha256(chat_dir / "adapter_model.safetensors")
    with ServerThread(app) as engine:
        auth = {"Authorization": f"Bearer {KEY}"}

        def load(body, headers=auth):
            return httpx.post(engine.url + "/v1/load_lora_adapter", json=body, headers=headers)

        def chat(model):
            return httpx.post(
                engine.url + "/v1/chat/completions",
                headers=auth,
                json={"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6},
            )

        assert load({"lora_name": "x", "lora_path": str(chat_dir)}, headers={}).status_code == 401
        ok = load({"lora_name": "chat-copy", "lora_path": str(chat_dir), "sha256": sha})
        assert ok.status_code == 200 and ok.text == "Success: LoRA adapter 'chat-copy' added successfully."
        assert "chat-copy" in models(engine.url)
        same = chat("chat-copy").json()["choices"][0]["message"]["content"]
        assert same == chat("chat-g0").json()["choices"][0]["message"]["content"]
        again = load({"lora_name": "chat-copy", "lora_path": str(chat_dir)})
        assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]

        pickled = tmp_path / "pickled"
        shutil.copytree(chat_dir, pickled)
        (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
        wide = build_adapter(tiny_artifacts["base"], tmp_path / "wide", seed=5, rank=16)
        for body, message in [
            ({"lora_path": str(pickled)}, "pickled weights are never loaded"),
            ({"lora_path": str(chat_dir), "sha256": "0" * 64}, "does not match"),
            ({"lora_path": str(wide)}, "rank 16 is above this server's maximum of 8"),
            ({"lora_path": str(chat_dir), "base_model_id": 999}, "trained on base model id 999"),
            ({"lora_path": str(tmp_path / "nowhere")}, "no such directory"),
            ({"lora_path": str(tmp_path)}, "no adapter_config.json"),
        ]:
            r = load({"lora_name": "bad", **body})
            assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
            assert "'bad'" in r.json()["error"]["message"]
        assert "bad" not in models(engine.url)
        assert chat("chat-g0").status_code == 200  # still serving

        unload = httpx.post(
            engine.url + "/v1/unload_lora_adapter", json={"lora_name": "chat-copy"}, headers=auth
        )
        assert unload.status_code == 200 and "removed successfully" in unload.text
        assert "chat-copy" not in models(engine.url) and chat("chat-copy").status_code == 404
        gone = httpx.post(
            engine.url + "/v1/unload_lora_adapter", json={"lora_name": "chat-copy"}, headers=auth
        )
        assert gone.status_code == 404 and "cannot be found" in gone.json()["error"]["message"]
        assert "chat-copy" not in served.engine.runtime.pool  # its weights are gone too


def test_runtime_loading_is_off_without_an_api_key(registry, tiny_artifacts):
    from fastapi.testclient import TestClient

    app, _served = engine_app(registry, api_key=None)
    with TestClient(app) as c:
        r = c.post(
            "/v1/load_lora_adapter",
            json={"lora_name": "x", "lora_path": str(tiny_artifacts["adapters"]["chat"])},
        )
        assert r.status_code == 403 and "RATCHET_API_KEY" in r.json()["error"]["message"]


def test_a_name_that_would_keep_serving_old_weights_is_not_switched_to(
    registry, tiny_artifacts, next_adapters
):
    """With the default ``--engine-model {specialist}`` both generations want the same names: the engine
    would go on serving the old adapters under the new generation's label, so the server keeps the old."""
    app, _served = engine_app(registry, names={s: s for s in SPECIALISTS})
    with ServerThread(app) as engine:
        front_config = config(registry, engine="external", engine_url=engine.url, engine_api_key=KEY)
        with ServerThread(create_app(front_config)) as front:
            register_generation(registry, {**tiny_artifacts, "adapters": next_adapters})
            r = httpx.post(front.url + "/admin/reload", headers=ADMIN).json()
            assert r["switched"] is False and "put {generation} in --engine-model" in r["error"]
            assert {a.metadata["generation"] for a in ask(front.url, PROMPTS[:1])} == {"0"}


def _load(url, name, path, **extra):
    return httpx.post(
        url + "/v1/load_lora_adapter",
        json={"lora_name": name, "lora_path": str(path), **extra},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )


def _one_line_400(r, *words):
    message = r.json()["error"]["message"] if r.status_code == 400 else r.text
    assert r.status_code == 400, (r.status_code, r.text)
    assert "\n" not in message and "Traceback" not in message, message
    assert all(w in message for w in words), message
    return message


def test_only_directories_under_the_allowed_roots_are_loaded(
    registry, tiny_artifacts, ratchet_home, tmp_path
):
    """The artifact store by default; a URL, a path outside, a link leading outside, ``..`` out of the store:
    400, one line, nothing loaded. A root the operator adds is allowed."""
    chat_dir = tiny_artifacts["adapters"]["chat"]
    store = ratchet_home / "artifacts"
    inside = store / "main" / "gen-0001" / "adapters" / "chat"
    shutil.copytree(chat_dir, inside)
    (store / "main" / "escape").symlink_to(chat_dir, target_is_directory=True)
    app, _served = engine_app(registry)
    with ServerThread(app) as engine:
        for path in [
            chat_dir,  # readable by the server, but not in the artifact store
            f"file://{chat_dir}",
            "file:///etc",
            "http://203.0.113.9/adapter",
            "/etc",
            store / "main" / "escape",  # a link inside the store to a directory outside
            f"{inside}/../../../../../{chat_dir.relative_to(chat_dir.anchor)}",
            inside.parent / "missing",
            f"{inside}\n/etc",
            f"{inside}\x00",
        ]:
            _one_line_400(_load(engine.url, "intruder", path), "'intruder'")
        assert "intruder" not in models(engine.url)
        assert _load(engine.url, "stored", inside).status_code == 200
        assert "stored" in models(engine.url)
    app, _served = engine_app(registry, adapter_roots=[tiny_artifacts["root"]])
    with ServerThread(app) as engine:
        assert _load(engine.url, "rooted", chat_dir).status_code == 200
        _one_line_400(_load(engine.url, "other", tmp_path), "outside")


def _rewrite(path, edit):
    """Rewrite a safetensors file's JSON header with ``edit(header)`` (the data bytes unchanged)."""
    import json

    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = edit(json.loads(raw[8 : 8 + n]))
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])


def _first_a(header):
    return next(k for k in header if ".lora_A." in k)


def test_a_corrupt_weights_file_is_refused_with_one_line(registry, tiny_artifacts, ratchet_home):
    """Truncated, a flipped bit in the header, sizes beyond the file, a huge header length, integer
    weights, a shape of another rank than the config's, a config peft cannot take: 400 with one line,
    never a 500 or a traceback."""
    chat_dir = tiny_artifacts["adapters"]["chat"]

    def huge(h):
        h[_first_a(h)]["shape"] = [2**40, 2**20]
        return h

    def integers(h):
        h[_first_a(h)]["dtype"] = "I32"  # same size as F32: only the dtype says it is wrong
        return h

    def other_rank(h):
        r, n = h[_first_a(h)]["shape"]
        h[_first_a(h)]["shape"] = [r // 2, n * 2]  # as many numbers, but rank 4 in a rank-8 config
        return h

    def flip(path):
        raw = bytearray(path.read_bytes())
        raw[8 + raw[8:].index(b'"shape"') + 2] ^= 0x04  # a bit of the header's JSON
        path.write_bytes(bytes(raw))

    def truncate(path):
        path.write_bytes(path.read_bytes()[:-100])

    def header_length(path):
        raw = path.read_bytes()
        path.write_bytes((2**62).to_bytes(8, "little") + raw[8:])

    def config(text):
        return lambda p: (p.parent / "adapter_config.json").write_bytes(text)

    cases = {
        "truncated": truncate,
        "flipped": flip,
        "header-length": header_length,
        "huge": lambda p: _rewrite(p, huge),
        "integers": lambda p: _rewrite(p, integers),
        "other-rank": lambda p: _rewrite(p, other_rank),
        "config-list": config(b"[1, 2]"),
        "config-rank": config(b'{"peft_type": "LORA", "r": "eight", "target_modules": ["q_proj"]}'),
        "config-targets": config(b'{"peft_type": "LORA", "r": 8, "target_modules": [{"a": 1}]}'),
        "config-bytes": config(b'{"peft_type": "LORA", "r": 8, "x": "\xff\xfe"}'),
    }
    app, _served = engine_app(registry)
    with ServerThread(app) as engine:
        for name, damage in cases.items():
            bad = ratchet_home / "artifacts" / name
            shutil.copytree(chat_dir, bad)
            damage(bad / "adapter_model.safetensors")
            _one_line_400(_load(engine.url, name, bad), f"'{name}'")
        assert not set(cases) & models(engine.url)
        hello = {"model": "chat-g0", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        r = httpx.post(
            engine.url + "/v1/chat/completions", json=hello, headers={"Authorization": f"Bearer {KEY}"}
        )
        assert r.status_code == 200  # still serving


def test_unloading_ends_the_requests_in_flight_with_an_error(registry, tiny_artifacts):
    """A stream of the unloaded model gets an OpenAI error event and is closed; a non-streamed request in
    flight gets a clear error; the unload succeeds and the other models keep serving."""
    import json
    import threading
    import time

    app, served = engine_app(registry)
    runtime = served.engine.runtime
    slow = runtime.model.get_base_model().lm_head.register_forward_pre_hook(lambda *_: time.sleep(0.02))
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "chat-g0", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    body["max_tokens"] = runtime.context_limit - served.engine.count_tokens(body["messages"])  # ~2 s
    events, plain = [], {}
    started = threading.Event()

    def stream(url):
        with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, headers=auth,
                          timeout=60) as r:  # fmt: skip
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if '"content":"' in line and line.count('"content":""') == 0:
                        started.set()

    def complete(url):
        r = httpx.post(url + "/v1/chat/completions", json=body, headers=auth, timeout=60)
        plain.update(status=r.status_code, body=r.json())

    try:
        with ServerThread(app) as engine:
            threads = [threading.Thread(target=f, args=(engine.url,)) for f in (stream, complete)]
            for t in threads:
                t.start()
            assert started.wait(30), events  # text is flowing
            t0 = time.monotonic()
            unload = httpx.post(
                engine.url + "/v1/unload_lora_adapter",
                json={"lora_name": "chat-g0"},
                headers=auth,
                timeout=60,
            )
            for t in threads:
                t.join(30)
            took = time.monotonic() - t0
            assert unload.status_code == 200 and "removed successfully" in unload.text
            assert "[DONE]" not in events, events[-3:]
            error = json.loads(events[-1])["error"]
            assert "'chat-g0' was unloaded" in error["message"] and error["code"] == "model_not_found"
            assert took < 1.5  # the rows left their batch at once, not after decoding
            assert any(
                json.loads(e).get("choices", [{}])[0].get("delta", {}).get("content") for e in events[:-1]
            )
            assert plain["status"] == 404, plain
            assert "'chat-g0' was unloaded" in plain["body"]["error"]["message"]
            other = httpx.post(engine.url + "/v1/chat/completions", json={**body, "model": "agent-g0",
                               "max_tokens": 4}, headers=auth, timeout=60)  # fmt: skip
            assert other.status_code == 200
    finally:
        slow.remove()
