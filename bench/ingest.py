"""Ingest throughput vs the floor: a bare sqlite3 executemany of the same rows.

Usage: python bench/ingest.py [--traces 100000]

Writes N synthetic traces to a JSONL file, ingests them into a fresh SQLite registry with
`pipeline.experience.ingest.ingest_file` (parse, validate, hash, batched insert), then inserts the very
same prepared rows with a bare `sqlite3` `executemany` into a fresh copy of the same schema, and
prints both rates and their ratio (target: >= 0.5). Also prints scoring throughput of the
rule-based scorers over the ingested traces.
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.experience.ingest import ingest_file, trace_row, validate_trace  # noqa: E402
from pipeline.registry import make_engine, session_scope, upgrade_db  # noqa: E402
from pipeline.registry.experience import SQLITE_INSERT, sqlite_params  # noqa: E402
from pipeline.registry.models import utcnow  # noqa: E402


def synthetic_trace(i: int, rng: random.Random) -> dict:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    kind = i % 4
    if kind == 0:
        msgs = [
            {"role": "user", "content": f"What is {a}+{b}?"},
            {"role": "assistant", "content": str(a + b)},
        ]
        meta = {"specialist": "chat", "expected": str(a + b), "task": "chat", "task_id": f"c{i}"}
    elif kind == 1:
        args = json.dumps({"minutes": a + b})
        msgs = [
            {"role": "user", "content": f"Set a timer for {a}+{b} minutes."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"call{i}",
                        "type": "function",
                        "function": {"name": "set_timer", "arguments": args},
                    }
                ],
            },
        ]
        meta = {
            "specialist": "agent",
            "expected_call": {"name": "set_timer", "arguments": {"minutes": a + b}},
        }
    elif kind == 2:
        msgs = [
            {"role": "user", "content": f"Write f(x) returning x*{a}."},
            {"role": "assistant", "content": f"def f(x):\n    return x*{a}"},
        ]
        meta = {"specialist": "coding", "tests": f"assert f(2) == {2 * a}"}
    else:
        msgs = [
            {"role": "user", "content": f"A button labelled n{a}."},
            {"role": "assistant", "content": json.dumps({"type": "button", "label": f"n{a}"})},
        ]
        meta = {"specialist": "genui"}
    meta["request"] = i
    return {
        "messages": [{"role": "system", "content": "You are a helpful assistant."}, *msgs],
        "metadata": meta,
        "feedback": rng.choice([None, 1, 0, {"rating": 1}]),
    }


def bare_rate(db: Path, rows: list) -> float:
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    params = sqlite_params(rows, utcnow())  # exactly what insert_traces sends
    sql = SQLITE_INSERT
    start = time.perf_counter()
    for i in range(0, len(params), 2000):
        conn.executemany(sql, params[i : i + 2000])
        conn.commit()
    elapsed = time.perf_counter() - start
    n = conn.execute("select count(*) from experience").fetchone()[0]
    conn.close()
    assert n == len(rows), (n, len(rows))
    return len(rows) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=int, default=100_000)
    parser.add_argument("--score", type=int, default=20_000, help="traces to score with rule-based scorers")
    args = parser.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src = tmp / "traces.jsonl"
        with open(src, "w") as fh:
            for i in range(args.traces):
                fh.write(json.dumps(synthetic_trace(i, rng)) + "\n")
        size_mb = src.stat().st_size / 1e6

        url = f"sqlite:///{tmp / 'registry.db'}"
        upgrade_db(url)
        engine = make_engine(url)
        start = time.perf_counter()
        result = ingest_file(src, session_factory=lambda: session_scope(engine), batch_size=2000)
        ours = result.stored / (time.perf_counter() - start)
        assert result.stored == args.traces, result

        # The floor: same schema, same rows already parsed and serialised, bare executemany.
        rows = []
        with open(src, "rb") as fh:
            import orjson

            rows = [trace_row(validate_trace(orjson.loads(line)), source="import") for line in fh]
        bare_db = tmp / "bare.db"
        upgrade_db(f"sqlite:///{bare_db}")
        floor = bare_rate(bare_db, rows)

        print(f"ingest: {args.traces} traces ({size_mb:.1f} MB JSONL)")
        print(f"  ratchet ingest        {ours:>10,.0f} traces/s  (parse + validate + hash + batched insert)")
        print(f"  bare sqlite3 executemany {floor:>7,.0f} traces/s  (same rows, already prepared)")
        print(f"  ratio                 {ours / floor:>10.2f}  (target >= 0.5)")

        try:
            from pipeline.scoring import score_trace
            from pipeline.specs.contract import load_contract
        except ImportError:
            print("scoring: pipeline.scoring not available")
            return
        contract = load_contract(Path(__file__).resolve().parent.parent / "contracts" / "demo.yaml")
        traces = [synthetic_trace(i, rng) for i in range(args.score)]
        traces = [t for t in traces if t["metadata"]["specialist"] != "coding"]  # rule-based scorers only
        start = time.perf_counter()
        for t in traces:
            score_trace(contract, t)
        rate = len(traces) / (time.perf_counter() - start)
        print(
            f"scoring (rule-based scorers, chat/agent/genui): {rate:,.0f} traces/s over {len(traces)} traces"
        )
        engine.dispose()


if __name__ == "__main__":
    main()
