"""Helpers for serving tests (fixtures in conftest.py): a tiny random Llama with the project's char tokenizer, four random LoRA
adapters (nonzero B, so each really changes the output), a harness, and a registry with a champion."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

SPECIALISTS = ("chat", "agent", "coding", "genui")
RANK = 8
TARGETS = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")
# The agent adapter is trained to answer this view with a compact tool call (see ``build_adapter``).
TOOL_VIEW = [{"role": "system", "content": "agent"}, {"role": "user", "content": "timer 3+4"}]
TOOL_ANSWER = "set_timer(minutes=7)"

HARNESS = {
    "name": "serve-test",
    "version": "1",
    "tool_call_format": "openai",
    "specialists": {
        "chat": {"system_prompt": "chat", "decoding": {"max_new_tokens": 8}},
        "agent": {"system_prompt": "agent", "decoding": {"max_new_tokens": 8}, "tools": ["set_timer"]},
        "coding": {"system_prompt": "code", "decoding": {"max_new_tokens": 8}},
        "genui": {"system_prompt": "ui", "decoding": {"max_new_tokens": 8}},
    },
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "set_timer",
                "description": "Start a timer.",
                "parameters": {"type": "object", "properties": {"minutes": {"type": "integer"}}},
            },
        }
    ],
    "context": {"max_context_tokens": 128, "keep_turns": 4, "other_specialists": "summary"},
    "routing": {
        "default": "chat",
        "entry": "chat",
        "mode": "signals",
        "signals": {
            "agent": {"strong": ["^timer\\b"], "positive": [{"pattern": "\\badd\\b", "weight": 1.0}]},
            "coding": {"strong": ["\\bdef\\b"], "positive": [{"pattern": "\\bf adds\\b", "weight": 2.0}]},
            "genui": {"positive": [{"pattern": "counter|progress", "weight": 1.5}]},
        },
        "guardrails": [{"pattern": "```", "route": "coding", "description": "code fences go to coding"}],
    },
}


# what the OpenAI-surface tests send: a bounded schema (a random model's free string would never end), and
# two client tools whose arguments are a lamp's state
ASK = [{"role": "user", "content": "12+35=?"}]
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["s", "m", "l"]}},
    "required": ["ok", "size"],
    "additionalProperties": False,
}
LAMP = {
    "type": "object",
    "properties": {"on": {"type": "boolean"}},
    "required": ["on"],
    "additionalProperties": False,
}
CLIENT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "set_timer", "description": "Start a timer.", "parameters": LAMP},
    },
    {"type": "function", "function": {"name": "lamp", "description": "Switch the lamp.", "parameters": LAMP}},
]
# a tool whose arguments are bounded (constrained decoding tests)
TIMER_TOOL = {
    "type": "function",
    "function": {
        "name": "set_timer",
        "parameters": {
            "type": "object",
            "properties": {"minutes": {"type": "integer", "minimum": 0, "maximum": 60}},
            "required": ["minutes"],
        },
    },
}


def build_base(path: Path, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.environment.tinymodel import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # large weights: logits sharp enough for a LoRA to steer
        model.model.embed_tokens.weight.mul_(30.0)
        model.lm_head.weight.mul_(30.0)
        model.lm_head.weight[tok.all_special_ids].mul_(0.3)  # random text is not cut at once
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def build_adapter(
    base: Path, path: Path, seed: int, *, train: list[dict] | None = None, rank: int = RANK
) -> Path:
    """A random LoRA (nonzero B) of ``rank``, or one overfit on the single conversation ``train``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.modeling.packing import encode_chat

    model = AutoModelForCausalLM.from_pretrained(base)
    torch.manual_seed(seed)
    cfg = LoraConfig(r=rank, lora_alpha=16, target_modules=list(TARGETS), init_lora_weights=train is not None)
    peft_model = get_peft_model(model, cfg)
    if train is None:
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)
    else:
        ids, labels = encode_chat(AutoTokenizer.from_pretrained(base), train, 128)
        x, y = torch.tensor([ids]), torch.tensor([labels])
        opt = torch.optim.Adam([p for p in peft_model.parameters() if p.requires_grad], lr=2e-2)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # one tiny sequence: threads only add overhead
        for _step in range(800):
            loss = peft_model(input_ids=x, labels=y).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            if loss.item() < 0.005:
                break
        torch.set_num_threads(threads)
        assert loss.item() < 0.05, f"tool-call adapter did not fit (loss {loss.item():.3f})"
    peft_model.save_pretrained(path)
    (path / "lineage.json").write_text(json.dumps({"seed": seed}))
    return path


def build_artifacts(root: Path) -> dict:
    """The tiny base model and one random adapter per specialist under ``root`` (the agent's fit to answer
    ``TOOL_VIEW`` with ``TOOL_ANSWER``), as ``register_generation`` takes them."""
    base = build_base(root / "base")
    adapters = {}
    for i, s in enumerate(SPECIALISTS):
        train = [*TOOL_VIEW, {"role": "assistant", "content": TOOL_ANSWER}] if s == "agent" else None
        adapters[s] = build_adapter(base, root / f"adapter-{s}", seed=10 + i, train=train)
    return {"base": base, "adapters": adapters, "root": root}


def register_generation(
    url: str,
    artifacts: dict,
    *,
    harness: dict | None = None,
    promote: bool = True,
    specialists=SPECIALISTS,
    harness_version: str | None = None,
    state: dict | None = None,
) -> int:
    """Register base, harness, contract, adapters and a generation; returns the generation number."""
    from pipeline.registry import (
        create_adapter,
        create_generation,
        get_engine,
        promote_generation,
        register_base_model,
        register_contract,
        register_harness,
        session_scope,
    )
    from pipeline.specs.loading import file_sha256

    harness = dict(harness or HARNESS)
    if harness_version:
        harness["version"] = harness_version
    with session_scope(get_engine(url)) as s:
        spec = {
            "name": "tiny",
            "base": {"path": str(artifacts["base"])},
            "specialists": {sp: {} for sp in specialists},
        }
        base = register_base_model(session=s, name="tiny", path=str(artifacts["base"]), spec=spec)
        hv = register_harness(session=s, name=harness["name"], version=harness["version"], spec=harness)
        cv = register_contract(session=s, name="c", version="1", spec={"name": "c"})
        ids = {}
        # the test's adapters live in pytest's temporary directories: that is their artifact store
        store = Path(os.path.commonpath([artifacts["adapters"][sp] for sp in specialists]))
        for sp in specialists:
            path = artifacts["adapters"][sp]
            ids[sp] = create_adapter(
                session=s,
                specialist=sp,
                base_model_id=base.id,
                rank=RANK,
                alpha=16,
                target_modules=list(TARGETS),
                artifact_uri=str(path),
                sha256=file_sha256(path / "adapter_model.safetensors"),
                artifact_root=store,
            ).id
        gen = create_generation(
            session=s,
            base_model_id=base.id,
            harness_version_id=hv.id,
            contract_version_id=cv.id,
            specialists=list(SPECIALISTS),
            adapters=ids,
            state=state,
        )
        if promote:
            promote_generation(session=s, generation=gen)
        return gen.number


def champion_registry(directory: Path, artifacts: dict, **options) -> str:
    """A SQLite registry in ``directory`` whose promoted generation serves ``artifacts`` (``options``: as
    ``register_generation`` takes them); its URL."""
    from pipeline.registry import upgrade_db

    url = f"sqlite:///{directory / 'serve.db'}"
    upgrade_db(url)
    register_generation(url, artifacts, **options)
    return url


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_process(
    url: str, home: Path, *, api_key: str, stdout=subprocess.PIPE
) -> tuple[subprocess.Popen, int]:
    """``ratchet serve`` as a process on 127.0.0.1 (a free port) over the registry ``url``, on the CPU with
    one torch thread and no polling, its output (and errors) to ``stdout``; the process and its port."""
    port = free_port()
    env = {
        **os.environ,
        "RATCHET_DATABASE_URL": url,
        "RATCHET_HOME": str(home),
        "RATCHET_DEVICE": "cpu",
        "RATCHET_API_KEY": api_key,
    }
    cmd = [sys.executable, "-c", "from pipeline.cli import main; main()", "serve", "--port", str(port)]
    cmd += ["--poll-seconds", "0", "--threads", "1"]
    proc = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=subprocess.STDOUT, text=True)
    return proc, port


def wait_healthy(proc: subprocess.Popen, port: int, *, seconds: float = 60, output=None) -> None:
    """Until the server ``proc`` on ``port`` answers ``/health``; it failing first fails with ``output()``
    (default: what it wrote to its pipe)."""
    deadline = time.monotonic() + seconds
    while True:
        assert proc.poll() is None, output() if output else proc.stdout.read()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.1)


def grammar_rows(
    rt, n: int, grammar, *, prompt: str = "answer {k}", new_tokens: int = 96, logprobs=None
) -> list:
    """``n`` rows of the base model under ``grammar`` (None: free), the ``k``-th asking ``prompt``: row 0
    greedy, the others sampled with their seeds."""
    from pipeline.serving.runtime import BASE, GenerationRequest

    return [
        GenerationRequest(
            BASE,
            tuple(rt.encode([{"role": "user", "content": prompt.format(k=k)}])),
            new_tokens,
            temperature=0.0 if k == 0 else 1.0,
            seed=k,
            grammar=grammar,
            logprobs=logprobs,
        )
        for k in range(n)
    ]


class ServerThread:
    """A real uvicorn server on 127.0.0.1 (random free port) in a background thread."""

    def __init__(self, app):
        import threading

        import uvicorn

        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def experience_rows(url: str) -> list:
    from sqlalchemy import select

    from pipeline.registry import Experience, get_engine, session_scope

    with session_scope(get_engine(url)) as s:
        return list(s.scalars(select(Experience).order_by(Experience.id)))


def rows_by_id(url: str, *ids: str) -> dict:
    """The stored turns by completion id, once ``ids`` are among them (a turn is spooled before it is
    answered and stored within ``flush_seconds``; at most 10 s)."""
    deadline = time.monotonic() + 10
    while True:
        rows = {e.completion_id: e for e in experience_rows(url)}
        if all(i in rows for i in ids) or time.monotonic() > deadline:
            return rows
        time.sleep(0.05)


def api_keys(url: str, **scopes: str) -> dict[str, dict[str, str]]:
    """Create one key per name with its comma-separated scopes; name -> its Authorization header."""
    from pipeline.experience.principals import OPERATOR, parse_scopes
    from pipeline.registry import create_api_key, get_engine, session_scope

    out = {}
    with session_scope(get_engine(url)) as session:
        for name, scope in scopes.items():
            _row, value = create_api_key(
                session=session, name=name, scopes=parse_scopes(scope), actor=OPERATOR
            )
            out[name] = {"Authorization": f"Bearer {value}"}
    return out
