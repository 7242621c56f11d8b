"""Dashboard list pages at scale vs a bare indexed SELECT of the same rows, measured in the same run.

Usage: python bench/dashboard.py [--backend sqlite|postgresql|all] [--rows 1000000] [--generations 100]
       [--requests 40] [--cache DIR] [--reseed]

Seeds a registry: the demo contract, harness and base model; a lineage of N generations (a chain of
promotions with rejected siblings, each with its evaluation, adapters, datasets with their examples and
held-out items); ROWS traces over 4 specialists and 4 sources and 5 principals (NULL among them), some with
counted or claimed feedback, each with its `total`, its `final` (one in ten not checked, some with a failed
check) and one scorer row (the newest 0.2% unscored); quarantine and audit rows. Then serves `create_app` with
uvicorn on 127.0.0.1 and times every list page and API over real HTTP (httpx, after a warm-up), each
against the bare indexed SELECT of the rows it shows (the ids it returned, by primary key; for a page that
found nothing, the same predicate over the ids it searched) on a connection of the same engine; the
first request of each page after the server started is printed too (cold in-process caches).
Target: p95 < 300 ms on every page. SQLite is seeded through the registry's own bulk inserts
(`insert_traces`, `insert_scores`), PostgreSQL through COPY. `--cache DIR` keeps the seeded SQLite file;
PostgreSQL keeps its database `ratchet_bench`; either is reused while it holds exactly this seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from array import array
from datetime import UTC, datetime, timedelta
from operator import attrgetter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import uvicorn  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402
from sqlalchemy import bindparam, create_engine, insert, text  # noqa: E402

from pipeline import registry as reg  # noqa: E402
from pipeline.dashboard import create_app  # noqa: E402
from pipeline.loop.evaluation import compare_scores  # noqa: E402
from pipeline.registry import ScoreRow, TraceRow, make_engine, session_scope  # noqa: E402
from pipeline.registry.models import dump_json  # noqa: E402
from pipeline.settings import Settings  # noqa: E402
from pipeline.specs.contract import load_contract  # noqa: E402
from pipeline.specs.harness import load_harness  # noqa: E402
from pipeline.specs.loading import file_sha256  # noqa: E402
from pipeline.specs.modelspec import load_model_spec  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ADAPTERS = Path(tempfile.gettempdir()) / "ratchet-bench-adapters"  # real files the seeded rows name
PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/ratchet_bench"
SPECIALISTS = ("agent", "chat", "coding", "genui")
SCORER = {"agent": "tool_call", "chat": "exact_match", "coding": "python_tests", "genui": "json_schema"}
SOURCES, SOURCE_WEIGHTS = ("deployment", "simulation", "import", "evaluation"), (0.5, 0.3, 0.15, 0.05)
RARE, ABSENT = "zephyr", "xylophonequartz"  # in ~1% of the traces / in none
QUARANTINED, AUDITED, EXAMPLES, ITEMS, BATCH = 5000, 5000, 2000, 300, 20_000
EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
BUDGET_MS = 300.0
SYSTEM = (
    "You are a helpful assistant. Answer precisely and briefly; use the tools provided when an action is "
    "requested, and never invent tool results."
)
FILLER = (
    "Please keep the answer short.", "I need this for a report due tomorrow morning.", "Thanks in advance!",
    "Earlier you helped me with something similar and it worked well.", "Explain only if it is needed.",
    "The previous attempt gave the wrong result, so double-check it.", "Use the format we agreed on before.",
    "This is part of a larger workflow that runs every night.", "No need for a long explanation here.",
    "My colleague asked me to forward this question to you.",
)  # fmt: skip
TRACE_FIELDS = tuple(f.name for f in dataclasses.fields(TraceRow))  # the experience columns they fill
SCORE_FIELDS = tuple(f.name for f in dataclasses.fields(ScoreRow))


def trace(i: int, rng: random.Random, s: str, gen_id: int | None, source: str, hv: int) -> TraceRow:
    """Trace ``i`` of specialist ``s``: about 300-700 bytes of message JSON, as the ingest path stores it."""
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    pad = " ".join(rng.sample(FILLER, rng.randint(1, 5)))
    pad += f" Try the {RARE} variant." if rng.random() < 0.01 else ""
    meta: dict = {"specialist": s, "task": s, "task_id": f"{s[0]}{i}"}
    if s == "chat":
        user, answer = f"What is {a}+{b}? {pad}", {"role": "assistant", "content": f"{a} + {b} = {a + b}."}
        meta["expected"] = str(a + b)
    elif s == "agent":
        user = f"Set a timer for {a % 90 + 1} minutes called t{b}. {pad}"
        args = dump_json({"minutes": a % 90 + 1, "label": f"t{b}"})
        call = {"id": f"c{i}", "type": "function", "function": {"name": "set_timer", "arguments": args}}
        answer = {"role": "assistant", "content": None, "tool_calls": [call]}
        meta["expected_call"] = {"name": "set_timer", "arguments": {"minutes": a % 90 + 1}}
    elif s == "coding":
        user = f"Write a Python function f(x) that returns x*{a}+{b}. {pad}"
        answer = {"role": "assistant", "content": f"def f(x):\n    return x * {a} + {b}\n"}
        meta["tests"] = f"assert f(1) == {a + b}"
    else:
        user = f"Render a button labelled n{a} that opens panel {b}. {pad}"
        answer = {"role": "assistant", "content": dump_json({"type": "button", "label": f"n{a}", "panel": b})}
    feedback, roll = None, rng.random()
    if roll < 0.04:  # 3% rated, 1% corrected
        feedback = dump_json(
            {"rating": rng.randint(1, 5)}
            if roll < 0.02
            else {"claimed": {"rating": 1, "rating_by": "anonymous"}}
            if roll < 0.03
            else {"correction": f"It is {a * b}."}
        )
    convo = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}, answer]
    route = {"turn": 2, "specialist": s, "reason": "signals", "scores": {s: {"keyword": 1.0}}}
    return TraceRow(
        content_hash=hashlib.sha256(f"bench-{i}".encode()).hexdigest(),
        messages=dump_json(convo),
        metadata=dump_json(meta),
        feedback=feedback,
        routes=dump_json([route]),
        specialist=s,
        source=source,
        generation_id=gen_id,
        harness_version_id=hv,
        completion_id=f"cmpl-{i}" if source == "deployment" else None,
        principal=rng.choice(("anonymous", "crm", "operator", "ratchet", None)),
    )


def bulk(session, table: str, columns: tuple[str, ...], rows: list[tuple]) -> None:
    """COPY on PostgreSQL, one executemany on SQLite, inside the session's transaction."""
    conn, names = session.connection(), ", ".join(columns)
    if conn.dialect.name == "postgresql":
        with conn.connection.cursor().copy(f"COPY {table} ({names}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)
    else:
        conn.exec_driver_sql(f"INSERT INTO {table} ({names}) VALUES ({', '.join('?' * len(columns))})", rows)


def router(rng: random.Random) -> dict:
    """A routing-suite result shaped as ``measure_routing`` stores it (50 prompts per specialist)."""
    correct = {s: rng.randint(35, 50) for s in SPECIALISTS}
    return {
        "accuracy": sum(correct.values()) / 200,
        "total": 200,
        "correct": sum(correct.values()),
        "per_label": {s: c / 50 for s, c in correct.items()},
        "confusion": {s: {s: c, ("agent" if s == "chat" else "chat"): 50 - c} for s, c in correct.items()},
        "by_method": {"signals": 170, "default": 30},
        "mode": "signals",
    }


def evaluation(rng: random.Random, level: float, gain: float, attempt: int, promote: bool) -> dict:
    """A candidate's evaluation shaped as ``evaluate_step`` and the decision write it (300 items each)."""
    clip = lambda v: min(1.0, max(0.0, round(v, 4)))  # noqa: E731
    parent = {s: [clip(rng.gauss(level, 0.25)) for _ in range(ITEMS)] for s in SPECIALISTS}
    cand = {s: [clip(v + rng.gauss(gain, 0.1)) for v in parent[s]] for s in SPECIALISTS}
    c = compare_scores(parent, cand)
    reason = "overall improves" if promote else "no overall improvement at the gate's confidence"
    return {
        "scores": {s: round(x.candidate, 4) for s, x in c.specialists.items()},
        "overall": round(c.candidate_overall, 4),
        "parent_scores": {s: round(x.champion, 4) for s, x in c.specialists.items()},
        "parent_overall": round(c.champion_overall, 4),
        "comparison": c.to_dict(),
        "attempt": attempt,
        "items": {s: {"parent": parent[s], "candidate": cand[s]} for s in SPECIALISTS},
        "router": router(rng),
        "parent_router": router(rng),
        "verdict": {"promote": promote, "rate": 0.05, "lower": c.delta - 2 * c.se, "reasons": [reason]},
    }


def stored_adapter(path: Path) -> tuple[str, str]:
    """A real (zero) rank-8 LoRA adapter directory at ``path``: the registry accepts only stored adapters."""
    path.mkdir(parents=True, exist_ok=True)
    key = "base_model.model.model.layers.0.self_attn.{}.lora_{}.weight"
    save_file(
        {key.format(m, ab): np.zeros((8, 64) if ab == "A" else (64, 8), np.float32)
         for m in ("q_proj", "v_proj") for ab in "AB"},
        str(path / "adapter_model.safetensors"),
    )  # fmt: skip
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return str(path), file_sha256(path / "adapter_model.safetensors")


def seed_lineage(session, n_gens: int, rng: random.Random) -> tuple[list[int], int, int]:
    """The specs and a lineage of ``n_gens`` generations; returns (generation ids, contract id, harness id)."""
    contract, harness = (
        load_contract(ROOT / "contracts/demo.yaml"),
        load_harness(ROOT / "harnesses/demo.yaml"),
    )
    model = load_model_spec(ROOT / "models/tiny.yaml")
    base = reg.register_base_model(
        session=session, name=model.name, path="/bench/base", spec=model.model_dump(mode="json")
    )
    hv = reg.register_harness(
        session=session, name=harness.name, version=harness.version, spec=harness.model_dump(mode="json")
    )
    cv = reg.register_contract(
        session=session, name=contract.name, version=contract.version, spec=contract.model_dump(mode="json")
    )
    common = {"base_model_id": base.id, "harness_version_id": hv.id, "contract_version_id": cv.id}
    champion = reg.create_generation(session=session, specialists=list(SPECIALISTS), **common)
    reg.promote_generation(session=session, generation=champion, reason="initial champion")
    level, attempt, ids, champion_adapters = 0.3, 0, [champion.id], dict.fromkeys(SPECIALISTS)
    for number in range(1, n_gens):
        promote, attempt = number == n_gens - 1 or rng.random() < 0.45, attempt + 1
        adapters, digests = {}, {}
        for s in SPECIALISTS:
            digests[s] = hashlib.sha256(f"ds-{number}-{s}".encode()).hexdigest()
            curve = [[k * 10, round(2.5 * 0.97**k + rng.random() * 0.05, 4)] for k in range(30)]
            uri, sha = stored_adapter(ADAPTERS / str(number) / s)
            adapters[s] = reg.create_adapter(
                session=session, specialist=s, base_model_id=base.id, rank=8, alpha=16.0,
                target_modules=["q_proj", "v_proj"], artifact_uri=uri, sha256=sha, artifact_root=ADAPTERS,
                parent_adapter_id=champion_adapters[s], mlflow_run_id=f"run{number:04d}{s}",
                dataset_sha256=digests[s],
                method="sft", metrics={"final_loss": curve[-1][1], "steps": 300, "loss_curve": curve},
            ).id  # fmt: skip
        dropped = {
            s: {"unverified": rng.randint(50, 400), "duplicate": rng.randint(0, 40)} for s in SPECIALISTS
        }
        steps = {
            "collect": {"prompts": 400, "samples": 4, "traces": 6400},
            "curate": {"datasets": {s: {"rows": EXAMPLES} for s in SPECIALISTS}, "dropped": dropped},
            "train": {"adapters": {s: {"adapter_id": a} for s, a in adapters.items()}},
        }
        gen = reg.create_generation(
            session=session, parent_id=champion.id, specialists=list(SPECIALISTS), adapters=adapters,
            state={"steps": steps}, **common,
        )  # fmt: skip
        for s in SPECIALISTS:
            path = f"/bench/datasets/{number}/{s}"
            session.add(reg.TrainingDataset(generation_id=gen.id, specialist=s, path=path, sha256=digests[s], num_rows=EXAMPLES))  # fmt: skip
        gain = rng.uniform(0.005, 0.03) if promote else rng.uniform(-0.03, 0.004)
        gen.evaluation = ev = evaluation(rng, level, gain, attempt, promote)
        items = [
            {
                "generation_id": gen.id,
                "specialist": s,
                "position": k,
                "parent_value": p,
                "candidate_value": v,
                "messages": [{"role": "user", "content": f"Held-out {s} item {k}: what is {k}+{number}?"}],
                "parent_answer": {"role": "assistant", "content": str(k + number)},
                "candidate_answer": {"role": "assistant", "content": str(k + number + (v < p))},
            }  # fmt: skip
            for s in SPECIALISTS
            for k, (p, v) in enumerate(
                zip(ev["items"][s]["parent"], ev["items"][s]["candidate"], strict=True)
            )
        ]
        session.execute(insert(reg.EvaluationItem), items)  # as evaluation.store_items does
        decision = ("promote: " if promote else "reject: ") + ev["verdict"]["reasons"][0]
        if promote:
            reg.promote_generation(session=session, generation=gen, reason=decision, actor="advance")
            champion, champion_adapters, level, attempt = gen, dict(adapters), level + gain, 0
        else:
            reg.set_generation_status(session=session, generation=gen, status="rejected", reason=decision)
        ids.append(gen.id)
    return ids, cv.id, hv.id


def seed(url: str, n_rows: int, n_gens: int) -> None:
    rng, engine, started = random.Random(0), make_engine(url), time.perf_counter()
    pg = engine.dialect.name == "postgresql"
    with session_scope(engine) as session:
        gen_ids, cv, hv = seed_lineage(session, n_gens, rng)
    print(f"  lineage: {n_gens} generations, their adapters and items: {time.perf_counter() - started:.1f} s")
    kinds, scored = array("b"), n_rows - max(1, n_rows // 500)  # the newest 0.2% are not scored yet
    for lo in range(0, n_rows, BATCH):
        rows, scores, now = [], [], EPOCH + timedelta(seconds=30 * lo)
        for i in range(lo, min(n_rows, lo + BATCH)):
            kinds.append(k := rng.randrange(4))
            source = rng.choices(SOURCES, SOURCE_WEIGHTS)[0]
            gen = None if source == "import" else gen_ids[i * n_gens // n_rows]  # served by then
            rows.append(trace(i, rng, SPECIALISTS[k], gen, source, hv))
        for i in range(lo + 1, min(scored, lo + BATCH) + 1):  # a fresh table: the ids are 1..n in order
            s, value = SPECIALISTS[kinds[i - 1]], round(rng.betavariate(2, 1.2), 4)
            ok = value >= 0.8  # the demo contract's selection.min_score
            details = {"specialist": s, "verified": ok, "verified_by": [SCORER[s]] * ok}
            checked = (i % 10) != 0
            final = {
                "turn": 2,
                "verified_by": [SCORER[s]] * checked,
                "failed": [SCORER[s]] * (checked and not ok),
            }
            scores += [
                ScoreRow(i, cv, "total", value, details, ok, s),
                ScoreRow(i, cv, SCORER[s], float(ok), {}, ok, s),
                ScoreRow(i, cv, "final", value, final, checked, s),
            ]
        with session_scope(engine) as session:
            if pg:  # the same rows, by COPY
                trace_of, score_of = attrgetter(*TRACE_FIELDS), attrgetter(*SCORE_FIELDS)
                bulk(
                    session, "experience", (*TRACE_FIELDS, "created_at"), [(*trace_of(r), now) for r in rows]
                )
                scores = [(*score_of(r)[:4], dump_json(r.details), *score_of(r)[5:], now) for r in scores]
                bulk(session, "scores", (*SCORE_FIELDS, "created_at"), scores)
            else:
                reg.insert_traces(session=session, rows=rows, now=now)
                reg.insert_scores(session=session, rows=scores, now=now)
        if (lo // BATCH) % 10 == 9 or lo + BATCH >= n_rows:
            done = min(n_rows, lo + BATCH)
            print(f"  experience: {done:>9,} traces, {time.perf_counter() - started:6.1f} s", flush=True)
    with session_scope(engine) as session:
        assert session.execute(text("SELECT max(id) FROM experience")).scalar() == n_rows
        datasets = session.execute(
            text(
                "SELECT d.id, d.specialist, g.number FROM datasets d JOIN generations g ON g.id = d.generation_id"
            )
        ).all()
        pairs = []
        for ds_id, s, number in datasets:  # traces of the dataset's specialist from before its generation
            bound, want, chosen = max(8, number * n_rows // n_gens), SPECIALISTS.index(s), set()
            while len(chosen) < min(EXAMPLES, bound // 8):
                if kinds[(i := rng.randrange(1, bound + 1)) - 1] == want:
                    chosen.add(i)
            pairs += [(ds_id, i) for i in sorted(chosen)]
        bulk(session, "dataset_examples", ("dataset_id", "experience_id"), pairs)
        for f in range(10):
            raw = '{"messages": [{"role": "user", "content": "' + "y" * rng.randint(0, 300)
            digest = hashlib.sha256(raw.encode()).hexdigest()
            entries = [
                (n, "invalid JSON: Expecting ',' delimiter", raw, digest)
                for n in range(1, QUARANTINED // 10 + 1)
            ]
            reg.quarantine_lines(session=session, source_file=f"/data/import/{f:02d}.jsonl", entries=entries)
        for k in range(AUDITED):
            details = {"completion_id": f"cmpl-{k}", "rating": 4, "has_correction": False}
            reg.audit(session=session, actor="user", entity="experience", entity_id=k + 1, action="feedback", details=details)  # fmt: skip
    if pg:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("VACUUM ANALYZE")  # what autovacuum does after a bulk load
    engine.dispose()
    print(f"  seeded in {time.perf_counter() - started:.1f} s ({len(pairs):,} dataset examples)")


def prepare(backend: str, args: argparse.Namespace, tmp: Path) -> str:
    """The registry URL, seeded (or reused when it already holds exactly this seed)."""
    if backend == "sqlite":
        path = (args.cache or tmp) / f"dashboard-{args.rows}r-{args.generations}g.db"
        url = f"sqlite:///{path}"
    else:
        with create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT").connect() as conn:
            exists = conn.exec_driver_sql("SELECT 1 FROM pg_database WHERE datname = 'ratchet_bench'").first()
            if exists is None:
                conn.exec_driver_sql("CREATE DATABASE ratchet_bench")
        url = PG_URL
    engine, seeded = make_engine(url), None
    try:
        with engine.connect() as conn:
            seeded = (
                conn.exec_driver_sql(  # (a seed from before `final` rows and principals has no 'final' row)
                    "SELECT (SELECT max(id) FROM experience), (SELECT count(*) FROM generations), "
                    "(SELECT count(*) FROM quarantine), "
                    "(SELECT count(*) FROM scores WHERE scorer = 'final' AND experience_id = 1)"
                ).one()
            )
    except Exception:  # no registry there yet
        pass
    engine.dispose()
    if (
        not args.reseed
        and seeded is not None
        and tuple(seeded) == (args.rows, args.generations, QUARANTINED, 1)
    ):
        print(f"  reusing the seeded registry at {url}")
    else:
        if backend == "sqlite":
            for p in path.parent.glob(path.name + "*"):
                p.unlink()
        else:
            with create_engine(url, isolation_level="AUTOCOMMIT").connect() as conn:
                conn.exec_driver_sql("DROP SCHEMA public CASCADE; CREATE SCHEMA public")
        reg.upgrade_db(url)
        seed(url, args.rows, args.generations)
    reg.upgrade_db(url)  # a registry kept from an older schema gets the current one
    return url


def pct(values: list[float]) -> tuple[float, float]:
    s = sorted(values)
    return statistics.median(s), s[min(len(s) - 1, round(0.95 * (len(s) - 1)))]


def timed(fn, n: int) -> list[float]:
    """Milliseconds of ``n`` calls of ``fn`` after 3 untimed ones."""
    for _ in range(3):
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


# The rows an experience page shows, by primary key: the floor under any filter that found them.
BARE_EXPERIENCE = (
    "SELECT e.id, e.created_at, e.source, e.specialist, e.principal, e.generation_id, e.messages, e.feedback, "
    "s.value, s.verified, s.details FROM experience e LEFT JOIN scores s ON s.experience_id = e.id AND "
    "s.contract_version_id = :c AND s.scorer = 'final' WHERE e.id IN :ids ORDER BY e.id DESC"
)


def cases(conn, n_gens: int) -> tuple[list, list, int, int]:
    """(experience filter cases, other pages with their bare SELECT, max id, champion's contract id)."""
    one = lambda sql, **p: conn.execute(text(sql), p).first()  # noqa: E731
    n = one("SELECT max(id) FROM experience")[0]
    cv = one("SELECT contract_version_id FROM generations WHERE status = 'promoted'")[0]
    g = min(50, n_gens - 1)
    gid = one("SELECT id FROM generations WHERE lineage = 'main' AND number = :n", n=g)[0]
    ds, adapter = one(
        "SELECT d.id, ga.adapter_id FROM datasets d JOIN generation_adapters ga ON ga.generation_id = "
        "d.generation_id AND ga.specialist = d.specialist WHERE d.generation_id = :g ORDER BY d.id",
        g=gid,
    )
    deep = n // 10
    experience = [
        ("none", {}), ("limit=200", {"limit": 200}), ("specialist=coding", {"specialist": "coding"}),
        ("source=import", {"source": "import"}), (f"generation={g}", {"generation": g}),
        ("specialist+source", {"specialist": "coding", "source": "import"}), ("verified=yes", {"verified": "yes"}),
        ("verified=failed", {"verified": "failed"}), ("verified=no", {"verified": "no"}),
        ("principal=crm", {"principal": "crm"}), ("principal=(unknown)", {"principal": "(unknown)"}),
        ("principal+specialist", {"principal": "crm", "specialist": "chat"}),
        ("feedback=claimed", {"feedback": "claimed"}),
        ("verified=unscored", {"verified": "unscored"}), ("score 0.2..0.3", {"score_min": 0.2, "score_max": 0.3}),
        ("feedback=correction", {"feedback": "correction"}), (f"q={RARE} (~1%)", {"q": RARE}),
        (f"q={ABSENT} (none)", {"q": ABSENT}), (f"before={deep}", {"before": deep}),
        (f"after={deep}", {"after": deep}), (f"q={RARE}, before={deep}", {"q": RARE, "before": deep}),
    ]  # fmt: skip
    gens = "SELECT * FROM generations WHERE lineage = 'main' ORDER BY number"
    latest = "SELECT * FROM {} ORDER BY id DESC LIMIT 51"
    api = [
        ("/api/lineage", gens, {}),
        ("/api/trends", gens, {}),
        (
            f"/api/generations/{g}",
            "SELECT * FROM generations WHERE lineage = 'main' AND number = :n",
            {"n": g},
        ),
        (
            f"/api/generations/{g}/items",
            "SELECT specialist, position, parent_value, candidate_value, messages FROM evaluation_items "
            "WHERE generation_id = :g ORDER BY specialist, position",
            {"g": gid},
        ),
        (
            f"/api/adapters/{adapter}",
            "SELECT e.id, e.source, e.specialist, e.created_at FROM experience e JOIN dataset_examples d "
            "ON d.experience_id = e.id WHERE d.dataset_id = :d ORDER BY e.id DESC LIMIT 51",
            {"d": ds},
        ),
        ("/api/quarantine", latest.format("quarantine"), {}),
        ("/api/audit", latest.format("audit_log"), {}),
        ("/api/contracts", "SELECT * FROM contract_versions ORDER BY name, id", {}),
        ("/api/harnesses", "SELECT * FROM harness_versions ORDER BY name, id", {}),
    ]
    extra = [
        ("/api/audit?entity=generations", latest.format("audit_log WHERE entity = 'generations'"), {}),
        (f"/api/experience/{n // 2}", "SELECT * FROM experience WHERE id = :i", {"i": n // 2}),
    ]
    html = [("/" if p == "/api/lineage" else p.removeprefix("/api"), sql, params) for p, sql, params in api]
    return experience, api + extra + html, n, cv


def measure(url: str, args: argparse.Namespace, home: Path) -> None:
    engine = make_engine(url)
    pg = engine.dialect.name == "postgresql"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    app = create_app(Settings(home=home, database_url=url), lineage_name="main")
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    results, floors, first = [], {}, {}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client, engine.connect() as conn:
        experience, pages, n, cv = cases(conn, args.generations)

        def get(path: str, params: dict | None = None) -> httpx.Response:
            r = client.get(path, params=params)
            if r.status_code != 200:
                raise SystemExit(f"{path} {params}: HTTP {r.status_code}: {r.text[:300]}")
            return r

        def bare(sql: str, params: dict):
            stmt = text(sql).bindparams(bindparam("ids", expanding=True)) if "ids" in params else text(sql)
            return lambda: conn.execute(stmt, params).all()

        html = ("none", f"q={ABSENT} (none)")  # the experience cases also timed as the HTML page
        warm = [(p, {}) for p, _, _ in pages] + [("/api/experience", c) for _, c in experience]
        for path, params in warm + [("/experience", dict(experience)[label]) for label in html]:
            t0 = (
                time.perf_counter()
            )  # one pass over everything first: its caches, first-use imports, templates
            get(path, params)
            first[path, repr(params)] = (time.perf_counter() - t0) * 1000
        for label, params in experience:
            data = get("/api/experience", params).json()
            ids, note = [t["id"] for t in data["traces"]], f"{len(data['traces'])} rows"
            if data["searched_to"] is not None:
                note += f", searched down to id {data['searched_to']}"
            if ids:
                fn = bare(BARE_EXPERIENCE, {"c": cv, "ids": ids})
            else:  # nothing found: the same text predicate over the ids the page searched
                where = f"id >= :lo AND id < :hi AND messages {'ILIKE' if pg else 'LIKE'} :p"
                span = {
                    "lo": data["searched_to"] or 0,
                    "hi": params.get("before", n + 1),
                    "p": f"%{params['q']}%",
                }
                fn = bare(f"SELECT id FROM experience WHERE {where} ORDER BY id DESC LIMIT 51", span)
            page = timed(lambda p=params: get("/api/experience", p), args.requests)
            floors[label] = timed(fn, args.requests)
            cold = first["/api/experience", repr(params)]
            results.append((f"/api/experience {label}", cold, page, floors[label], note))
        for label in html:  # same query, same floor
            params = dict(experience)[label]
            page = timed(lambda p=params: get("/experience", p), args.requests)
            results.append(
                (f"/experience {label} (html)", first["/experience", repr(params)], page, floors[label], "")
            )
        for path, sql, params in pages:
            page = timed(lambda p=path: get(p), args.requests)
            label = path + ("" if path.startswith("/api/") else " (html)")
            floor = timed(bare(sql, params), args.requests)
            results.append((label, first[path, repr({})], page, floor, ""))
    server.should_exit = True
    thread.join()
    engine.dispose()
    reg.dispose_engines()
    head = (
        f"{'page':<44} {'1st ms':>7} {'p50 ms':>7} {'p95 ms':>7} {'bare p50':>8} {'bare p95':>8} {'ratio':>7}"
    )
    print(f"\n  {head}  <300ms  note")
    misses = 0
    for label, cold, page, floor, note in results:
        (p50, p95), (b50, b95) = pct(page), pct(floor)
        misses += p95 >= BUDGET_MS
        verdict = "PASS" if p95 < BUDGET_MS else "MISS"
        print(
            f"  {label:<44} {cold:7.1f} {p50:7.1f} {p95:7.1f} {b50:8.2f} {b95:8.2f} {p50 / b50:6.1f}x  {verdict:>6}  {note}"
        )
    print(
        f"  {len(results) - misses}/{len(results)} pages under {BUDGET_MS:.0f} ms at p95 ({args.requests} "
        "requests each after 3 warm-up; 1st: the page's first request after the server started; ratio = page "
        "p50 / bare SELECT p50, same run, same engine)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("sqlite", "postgresql", "all"), default="all")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--generations", type=int, default=100)
    parser.add_argument("--requests", type=int, default=40, help="timed requests per page (after 3 warm-up)")
    parser.add_argument("--cache", type=Path, default=None, help="keep the seeded SQLite registry here")
    parser.add_argument(
        "--reseed", action="store_true", help="seed again even when a matching registry exists"
    )
    args = parser.parse_args()
    if args.generations < 2 or args.rows < 1000:
        parser.error("need at least 2 generations and 1000 rows")
    with tempfile.TemporaryDirectory() as tmp:
        for backend in ("sqlite", "postgresql") if args.backend == "all" else (args.backend,):
            print(f"{backend}: {args.rows:,} experience rows, {args.generations} generations")
            url = prepare(backend, args, Path(tmp))
            measure(url, args, Path(tmp) / "home")


if __name__ == "__main__":
    main()
