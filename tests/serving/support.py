"""Helpers for serving tests (fixtures in conftest.py): a tiny random Llama with the project's char tokenizer, four random LoRA
adapters (nonzero B, so each really changes the output), a harness, and a registry with a champion."""

from __future__ import annotations

import json
import os
from pathlib import Path

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


class ServerThread:
    """A real uvicorn server on 127.0.0.1 (random free port) in a background thread."""

    def __init__(self, app):
        import socket
        import threading

        import uvicorn

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        import time

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
