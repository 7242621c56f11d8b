"""A registry the dashboard tests read: the demo contract on the small base, two real advancement cycles,
conversations served by the real server (two turns, a tool call, hostile text; an anonymous client's claimed
metadata and feedback; a keyed client's certified reference answer that the model misses, with its counted
rating), and a quarantined line. Built once per session; a test that acts (promote, rollback, re-score)
works on a copy (``acting_home``)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import httpx
import pytest
import yaml

from pipeline.settings import Settings, get_settings

ROOT = Path(__file__).resolve().parent.parent.parent
# served (the tiny model's window is 64 characters) and ingested: text a browser would run if it were markup
SERVED_HOSTILE = "<script>window.__pwned=1</script>"
HOSTILE = '<img src=x onerror="window.__pwned = 2"><a href="javascript:window.__pwned=3">open</a>'
# an anonymous client's turn: what it attaches is kept as `claimed` (shown, never scored)
CLAIMED_PROMPT, CLAIMED_METADATA = "2+2=?", {"expected": "4", "note": SERVED_HOSTILE}
CLAIMED_FEEDBACK = {"rating": 1.0, "correction": HOSTILE}
# a client whose key may certify, rate and correct: its reference answer counts, and the model misses it
KEY_NAME, KEY_SCOPES = "crm-backend", frozenset({"chat", "certify", "rate", "correct"})
CERTIFIED_PROMPT, CERTIFIED_METADATA, CERTIFIED_RATING = "7+8=?", {"expected": "no digit answers this"}, 0.0
# a conversation a client linked by its own session id (markup in it), with the tools it offered
CONVERSATION_ID = "session-" + SERVED_HOSTILE
CONVERSATION_TOOLS = [
    {"type": "function", "function": {"name": "add", "description": HOSTILE, "parameters": {}}}
]


def _served(url: str) -> list[str]:
    """Conversations through the real Mixture-of-LoRA server, anonymous and with a key the operator granted
    ``certify``, ``rate`` and ``correct``; returns their completion ids."""
    from serving.support import ServerThread

    from pipeline.registry import create_api_key, get_engine, session_scope
    from pipeline.serving.served import ServeConfig
    from pipeline.serving.server import create_app

    with session_scope(get_engine(url)) as session:
        _, key = create_api_key(session=session, name=KEY_NAME, scopes=KEY_SCOPES, actor="operator")
    config = ServeConfig(
        registry_url=url, device="cpu", poll_seconds=0, flush_seconds=0.05, allow_anonymous=True
    )
    ids = []
    with ServerThread(create_app(config)) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:

        def ask(messages: list[dict], headers: dict | None = None, **extra) -> dict:
            body = {"model": "ratchet", "messages": messages, "max_tokens": 8, "temperature": 0, **extra}
            reply = client.post("/v1/chat/completions", json=body, headers=headers)
            assert reply.status_code == 200, (messages, reply.text)
            ids.append(reply.json()["id"])
            return reply.json()["choices"][0]["message"]

        def rate(headers: dict | None = None, **feedback) -> dict:
            reply = client.post("/v1/feedback", json={"completion_id": ids[-1], **feedback}, headers=headers)
            assert reply.status_code == 200, reply.text
            return reply.json()["counted"]

        first = [{"role": "user", "content": "12+35=?"}]
        answer = ask(first)
        ask(
            [
                *first,
                {"role": "assistant", "content": answer["content"]},
                {"role": "user", "content": "f adds 1 2"},
            ]
        )
        ask([{"role": "user", "content": SERVED_HOSTILE}])
        ask([{"role": "user", "content": CLAIMED_PROMPT}], metadata=CLAIMED_METADATA)
        assert rate(**CLAIMED_FEEDBACK) == {"rating": False, "correction": False}
        keyed = {"Authorization": f"Bearer {key}"}
        ask([{"role": "user", "content": CERTIFIED_PROMPT}], headers=keyed, metadata=CERTIFIED_METADATA)
        assert rate(headers=keyed, rating=CERTIFIED_RATING) == {"rating": True}
    return ids


def _conversation(url: str) -> list[int]:
    """Two turns of one conversation (``CONVERSATION_ID``), recorded through the registry's insert path as the
    server records them: the tools offered, and the token ids served for each answer. Returns their ids."""
    from sqlalchemy import select

    from pipeline.registry import Experience, TraceRow, get_engine, insert_traces, session_scope

    first = [{"role": "user", "content": "3+4=?"}, {"role": "assistant", "content": "7"}]
    second = [*first, {"role": "user", "content": "and 5+5?"}, {"role": "assistant", "content": "10"}]
    with session_scope(get_engine(url)) as session:
        for messages in (first, second):
            served = {
                str(len(messages) - 1): {
                    "tokenizer": "0" * 64,
                    "prompt_ids": [1, 2, 3],
                    "completion_ids": [4],
                }
            }
            text = json.dumps(messages, sort_keys=True)
            row = TraceRow(content_hash=hashlib.sha256(text.encode()).hexdigest(), messages=text,
                           metadata=json.dumps({"specialist": "chat"}), feedback=None, routes="[]", specialist="chat",
                           source="deployment", principal="anonymous", conversation_id=CONVERSATION_ID,
                           tools=json.dumps(CONVERSATION_TOOLS), served_tokens=json.dumps(served))  # fmt: skip
            insert_traces(session=session, rows=[row])
        return list(
            session.scalars(select(Experience.id).where(Experience.conversation_id == CONVERSATION_ID))
        )


@pytest.fixture(scope="session")
def dashboard_home(tmp_path_factory, small_base) -> Path:
    from conftest import METHODS, ingest_corrections, write_specs

    from pipeline.cli.advance import make_tracker
    from pipeline.experience.ingest import ingest_file
    from pipeline.loop.advance import advance_once
    from pipeline.loop.candidate import AdvanceConfig
    from pipeline.loop.founding import init_lineage
    from pipeline.registry import dispose_engines, get_champion, get_engine, session_scope
    from pipeline.scoring import score_experience
    from pipeline.settings import get_settings

    root = tmp_path_factory.mktemp("dashboard")
    home = root / "home"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RATCHET_HOME", str(home))
        for name in ("RATCHET_DATABASE_URL", "MLFLOW_TRACKING_URI", "RATCHET_ADMIN_TOKEN"):
            mp.delenv(name, raising=False)
        get_settings.cache_clear()
        specs = write_specs(root, small_base, methods={"genui": METHODS["genui"]})  # genui trains by grpo
        model = yaml.safe_load(specs["model"].read_text())
        for spec in model["specialists"].values():  # enough steps that candidates differ from their parent
            spec["training"] = {"epochs": 30, "batch_size": 4, "lr": 0.003}
        specs["model"].write_text(yaml.safe_dump(model))
        # fixed held-out samples: the items on which this fixture's candidates are known to differ from their
        # parent (the pages under test show changed items); fresh samples are tested in tests/test_ledger.py
        contract = yaml.safe_load(specs["contract"].read_text())
        for suite in contract["heldout"]:
            suite["fresh"] = False
        specs["contract"].write_text(yaml.safe_dump(contract))
        init_lineage(
            contract_path=specs["contract"],
            harness_path=ROOT / "harnesses" / "demo.yaml",
            model_path=specs["model"],
        )
        ingest_corrections(root / "feedback.jsonl")
        fast = AdvanceConfig(
            prompts_per_specialist=24, samples_per_prompt=2, min_examples=2, validation_items=6, seed=1
        )
        for _ in range(2):
            advance_once(config=fast, tracker=make_tracker())
        _served(get_settings().registry_url)
        _conversation(get_settings().registry_url)
        with session_scope(
            get_engine()
        ) as session:  # the served traces get their scores, as `ratchet score` does
            champion = get_champion(session=session)
            score_experience(session=session, contract_version_id=champion.contract_version_id)
        hostile = {"messages": [{"role": "user", "content": HOSTILE}, {"role": "assistant", "content": HOSTILE}],
                   "metadata": {"specialist": "genui", "note": SERVED_HOSTILE}}  # fmt: skip
        (root / "hostile.jsonl").write_text(json.dumps(hostile) + "\n")
        ingest_file(
            root / "hostile.jsonl", session_factory=lambda: session_scope(get_engine()), source="import"
        )
        bad = root / "bad.jsonl"
        bad.write_text(
            '{"messages": "<script>window.__pwned = 4</script>"\n' + json.dumps({"messages": []}) + "\n"
        )
        engine = get_engine()
        ingest_file(bad, session_factory=lambda: session_scope(engine), source="import")
        dispose_engines()
        get_settings.cache_clear()
    return home


def use_home(monkeypatch, home: Path) -> None:
    """Make ``home`` this process's RATCHET_HOME, as `ratchet dashboard` has it: the registry's paths are stored
    relative to the home and read against the process's (pipeline.registry.locations)."""
    monkeypatch.setenv("RATCHET_HOME", str(home))
    get_settings.cache_clear()


@pytest.fixture
def read_settings(dashboard_home, monkeypatch) -> Settings:
    use_home(monkeypatch, dashboard_home)
    return Settings(home=dashboard_home)


@pytest.fixture
def acting_home(dashboard_home, tmp_path, monkeypatch) -> Path:
    copy = tmp_path / "acting"
    shutil.copytree(dashboard_home, copy)
    use_home(monkeypatch, copy)
    return copy


def served_trace_ids(settings: Settings) -> dict[str, int]:
    """The served traces by kind: the two-turn conversation, the hostile one, the anonymous one with claims
    (``claimed``), the keyed one whose certified check failed (``certified``), and the ingested hostile one."""
    from sqlalchemy import select

    from pipeline.registry import Experience, get_engine, session_scope

    with session_scope(get_engine(settings.registry_url)) as s:
        rows = s.execute(select(Experience.id, Experience.messages).where(Experience.source == "deployment",
                                                                          Experience.completion_id.is_not(None))).all()  # fmt: skip
    out = {}
    with session_scope(get_engine(settings.registry_url)) as s:
        out["ingested_hostile"] = s.scalar(select(Experience.id).where(Experience.source == "import"))
    for i, messages in rows:
        if "window.__pwned" in messages[0]["content"]:
            out["hostile"] = i
        elif messages[0]["content"] == CLAIMED_PROMPT:
            out["claimed"] = i
        elif messages[0]["content"] == CERTIFIED_PROMPT:
            out["certified"] = i
        elif len(messages) > 2:
            out["two_turns"] = i
    return out
