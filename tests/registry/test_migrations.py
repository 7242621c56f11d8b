"""Alembic is the only way the schema is made: round trips and drift against the ORM models."""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime, timedelta

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Column, MetaData, insert, inspect, select, text

from pipeline.registry import Base, current_revision, downgrade_db, make_engine, upgrade_db
from pipeline.registry.db import head_revision
from pipeline.registry.models import JSONText, UTCDateTime

TABLES = {
    "base_models",
    "harness_versions",
    "contract_versions",
    "adapters",
    "generations",
    "generation_adapters",
    "experience",
    "scores",
    "score_history",
    "stored_files",
    "quarantine",
    "datasets",
    "dataset_examples",
    "evaluation_items",
    "audit_log",
    "api_keys",
    "suite_attempts",
    "suite_items",
}


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def empty_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'm.db'}"
    return request.getfixturevalue("postgres_url")


def _tables(url):
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade(empty_url):
    upgrade_db(empty_url)
    assert _tables(empty_url) == TABLES
    head = current_revision(empty_url)
    downgrade_db(empty_url, "0001")
    upgrade_db(empty_url)
    downgrade_db(empty_url, "base")
    assert _tables(empty_url) == set() and current_revision(empty_url) is None
    upgrade_db(empty_url)
    assert _tables(empty_url) == TABLES and current_revision(empty_url) == head
    engine = make_engine(empty_url)
    try:
        indexes = {ix["name"]: ix for ix in inspect(engine).get_indexes("generations")}
    finally:
        engine.dispose()
    for name in ("uq_generations_one_champion", "uq_generations_one_in_flight"):
        options = indexes[name].get("dialect_options", {})
        assert indexes[name]["unique"] and any("where" in k for k in options), indexes[name]


def _compare_type(context, inspected_column, metadata_column, inspected_type, metadata_type):
    # Our TypeDecorators store plain TEXT / TIMESTAMP; compare what they store.
    if isinstance(metadata_type, JSONText | UTCDateTime):
        return context.impl.compare_type(inspected_column, Column(metadata_column.name, metadata_type.impl))
    return None


def test_models_and_migrations_agree(empty_url):
    """Fails when a model changes without a migration (what `alembic check` reports)."""
    upgrade_db(empty_url)
    engine = make_engine(empty_url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": _compare_type})
            diff = compare_metadata(ctx, Base.metadata)
    finally:
        engine.dispose()
    assert diff == [], f"models and migrations disagree; run `alembic revision --autogenerate`: {diff}"


def test_drift_check_can_fail(empty_url):
    """The drift check really detects a difference (guards against a test that cannot fail)."""
    from sqlalchemy import Column, Integer, MetaData, Table

    upgrade_db(empty_url)
    extra = MetaData()
    for table in Base.metadata.tables.values():
        table.to_metadata(extra)
    Table("not_migrated", extra, Column("id", Integer, primary_key=True))
    engine = make_engine(empty_url)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(
                MigrationContext.configure(conn, opts={"compare_type": _compare_type}), extra
            )
    finally:
        engine.dispose()
    assert any(d[0] == "add_table" and d[1].name == "not_migrated" for d in diff)


def test_cli_db_commands(tmp_path, monkeypatch, capsys):
    from pipeline.cli import main
    from pipeline.settings import get_settings

    monkeypatch.setenv("RATCHET_DATABASE_URL", f"sqlite:///{tmp_path / 'cli.db'}")
    get_settings.cache_clear()
    main(["db", "upgrade"])
    assert "revision 0011" in capsys.readouterr().out
    main(["db", "downgrade", "base"])
    assert "revision base" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["db", "downgrade", "nonsense"])
    assert exc.value.code == 1
    assert "cannot downgrade to 'nonsense'" in capsys.readouterr().err


def test_adapters_trained_before_0006_read_as_sft(empty_url):
    """Migration 0006 adds adapters.method; every adapter that existed before was trained by filtered SFT."""
    from sqlalchemy import text

    upgrade_db(empty_url, "0005")
    engine = make_engine(empty_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO base_models (name, path, spec, content_hash, created_at) "
                              "VALUES ('b', '/b', '{}', 'h', CURRENT_TIMESTAMP)"))  # fmt: skip
            conn.execute(text(
                "INSERT INTO adapters (specialist, version, base_model_id, rank, alpha, target_modules, "
                "artifact_uri, sha256, metrics, created_at) "
                "VALUES ('chat', 1, (SELECT id FROM base_models), 4, 8, '[]', '/a', 's', '{}', CURRENT_TIMESTAMP)"
            ))  # fmt: skip
        upgrade_db(empty_url)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT method FROM adapters")).scalar_one() == "sft"
    finally:
        engine.dispose()


def test_served_turns_before_0007_keep_what_their_clients_sent_apart(empty_url):
    """Before 0007 any client of `ratchet serve` could put `expected` into a turn's metadata and rate or
    correct it, and all of it counted. Migration 0007 keeps what those clients sent under `claimed` (never
    scored) and names the principals it knows: the loop's own practice and the operator's ingest."""
    import json

    from sqlalchemy import text

    upgrade_db(empty_url, "0006")
    engine = make_engine(empty_url)
    insert = text(
        "INSERT INTO experience (content_hash, completion_id, messages, metadata, feedback, routes, specialist, "
        "source, created_at) VALUES (:h, :c, '[]', :m, :f, '[]', 'chat', :s, CURRENT_TIMESTAMP)"
    )
    served_meta = {"specialist": "chat", "generation": 1, "latency_ms": 3.0, "expected": "99", "tests": "x"}
    try:
        with engine.begin() as conn:
            conn.execute(
                insert,
                {
                    "h": "served",
                    "c": "chatcmpl-1",
                    "m": json.dumps(served_meta),
                    "f": json.dumps({"rating": 5, "correction": "EVIL 99"}),
                    "s": "deployment",
                },
            )
            conn.execute(
                insert,
                {
                    "h": "plain",
                    "c": "chatcmpl-2",
                    "m": json.dumps({"specialist": "chat"}),
                    "f": None,
                    "s": "deployment",
                },
            )
            conn.execute(
                insert,
                {
                    "h": "ingested",
                    "c": None,
                    "m": json.dumps({"expected": "4"}),
                    "f": json.dumps({"rating": 4}),
                    "s": "import",
                },
            )
            conn.execute(insert, {"h": "practice", "c": None, "m": json.dumps({"expected": "5"}), "f": None,
                                  "s": "simulation"})  # fmt: skip
        upgrade_db(empty_url)
        with engine.connect() as conn:
            rows = {
                r.content_hash: r
                for r in conn.execute(
                    text("SELECT content_hash, metadata, feedback, principal FROM experience")
                )
            }
    finally:
        engine.dispose()
    served = rows["served"]
    meta = json.loads(served.metadata)
    assert meta["claimed"] == {"expected": "99", "tests": "x"}
    assert "expected" not in meta and meta["specialist"] == "chat" and meta["latency_ms"] == 3.0
    assert json.loads(served.feedback) == {"claimed": {"rating": 5, "correction": "EVIL 99"}}
    assert served.principal is None  # nobody knows who sent it
    assert json.loads(rows["plain"].metadata) == {"specialist": "chat"} and rows["plain"].feedback is None
    assert (
        json.loads(rows["ingested"].metadata) == {"expected": "4"}
        and rows["ingested"].principal == "operator"
    )
    assert json.loads(rows["ingested"].feedback) == {"rating": 4}
    assert rows["practice"].principal == "ratchet"


# ---- every step up and down with rows in every table ---------------------------------------------------------
REVISIONS = [f"{n:04d}" for n in range(1, 12)]
T0 = datetime(2026, 12, 1, 9, 30, tzinfo=UTC)


def _seed_rows(k: int) -> dict[str, list[dict]]:
    """Realistic rows for every table (what the loop, serving and ingest write), round ``k``: ids and unique
    names of their own. Columns a revision does not have yet are left out when the rows are inserted."""
    i = 100 * k
    at = T0 + timedelta(hours=k)
    h = lambda what: hashlib.sha256(f"{what}-{k}".encode()).hexdigest()  # noqa: E731
    spec = json.dumps({"name": f"tiny-{k}", "specialists": {"chat": {"method": "sft"}}})
    served = {"specialist": "chat", "generation": 1, "latency_ms": 12.5, "expected": "42"}
    feedback = {"rating": 5}
    if k >= REVISIONS.index("0007") + 1:  # what a client sent, as ``ratchet serve`` keeps it from 0007 on
        served = {"specialist": "chat", "generation": 1, "latency_ms": 12.5, "claimed": {"expected": "42"}}
        feedback = {"claimed": {"rating": 5}}
    return {
        "base_models": [dict(id=i, name=f"tiny-{k}", content_hash=h("base"), path=f"/models/tiny-{k}", spec=spec,
                             created_at=at)],
        "harness_versions": [
            dict(id=i, name="demo", version=f"1.{k}", content_hash=h("harness"), spec='{"prompts": {}}',
                 parent_id=None, created_at=at),
            dict(id=i + 1, name="demo", version=f"1.{k}.1", content_hash=h("harness2"), spec='{"prompts": {}}',
                 parent_id=i, created_at=at),
        ],
        "contract_versions": [dict(id=i, name="demo", version=f"{k}", content_hash=h("contract"),
                                   spec='{"specialists": {}}', created_at=at)],
        "adapters": [
            dict(id=i, specialist="chat", version=1, base_model_id=i, rank=4, alpha=8.0, target_modules='["q_proj"]',
                 artifact_uri=f"/artifacts/{k}/chat-1", sha256=h("a1"), mlflow_run_id=h("run")[:32],
                 mlflow_model_version="1", dataset_sha256=h("ds"), parent_adapter_id=None, method="dpo",
                 metrics='{"final_loss": 0.5, "steps": 6}', created_at=at),
            dict(id=i + 1, specialist="chat", version=2, base_model_id=i, rank=4, alpha=8.0,
                 target_modules='["q_proj"]', artifact_uri=f"/artifacts/{k}/chat-2", sha256=h("a2"),
                 mlflow_run_id=None, mlflow_model_version=None, dataset_sha256=None, parent_adapter_id=i,
                 method="sft", metrics="{}", created_at=at),
        ],
        "generations": [
            dict(id=i, lineage=f"l{k}", number=0, parent_id=None, base_model_id=i, harness_version_id=i,
                 contract_version_id=i, status="promoted", step=None, decision="initial champion",
                 evaluation="{}", state="{}", lease_owner=None, lease_expires_at=None, created_at=at, updated_at=at),
            dict(id=i + 1, lineage=f"l{k}", number=1, parent_id=i, base_model_id=i, harness_version_id=i + 1,
                 contract_version_id=i, status="training", step="curate", decision=None,
                 evaluation='{"chat": {"delta": 0.1}}', state='{"trained": {}}', lease_owner="host:4242",
                 lease_expires_at=at + timedelta(minutes=5), created_at=at, updated_at=at),
        ],
        "generation_adapters": [dict(generation_id=i, specialist="chat", adapter_id=i),
                                dict(generation_id=i + 1, specialist="chat", adapter_id=i + 1)],
        "experience": [
            dict(id=i, content_hash=h("served"), completion_id=f"chatcmpl-{k}",
                 messages='[{"role": "user", "content": "6*7?"}, {"role": "assistant", "content": "42"}]',
                 metadata=json.dumps(served), feedback=json.dumps(feedback), routes='[{"specialist": "chat"}]',
                 specialist="chat", source="deployment", principal="anonymous", generation_id=i,
                 harness_version_id=i, created_at=at),
            dict(id=i + 1, content_hash=h("imported"), completion_id=None,
                 messages='[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]',
                 metadata='{"expected": "hello"}', feedback=None, routes="[]", specialist="chat",
                 source="import", principal="operator", generation_id=None, harness_version_id=None,
                 created_at=at),
        ],
        "scores": [dict(id=i, experience_id=i, contract_version_id=i, scorer="total", value=1.0, verified=True,
                        specialist="chat", details='{"checks": []}', created_at=at)],
        "score_history": [dict(id=i, experience_id=i, contract_version_id=i, scorer="total", value=0.0,
                               verified=False, specialist="chat", details="{}", created_at=at,
                               superseded_at=at + timedelta(minutes=1), reason="feedback arrived")],
        "stored_files": [dict(sha256=h("file"), size=11, content=b'{"q": "1"}\n', created_at=at)],
        "quarantine": [dict(id=i, source_file=f"/data/import/{k}.jsonl", line_number=3,
                            reason="invalid JSON: Expecting value", raw='{"messages": [\n', created_at=at,
                            line_sha256=hashlib.sha256(b'{"messages": [\n').hexdigest())],
        "datasets": [dict(id=i, generation_id=i + 1, specialist="chat", path=f"/artifacts/{k}/datasets/chat",
                          sha256=h("dataset"), num_rows=2, created_at=at)],
        "dataset_examples": [dict(dataset_id=i, experience_id=i), dict(dataset_id=i, experience_id=i + 1)],
        "evaluation_items": [dict(id=i, generation_id=i + 1, specialist="chat", position=0,
                                  messages='[{"role": "user", "content": "2+2?"}]',
                                  parent_answer='{"content": "5"}', candidate_answer='{"content": "4"}',
                                  parent_value=0.0, candidate_value=1.0)],
        "audit_log": [dict(id=i, at=at, actor="advance", entity="generation", entity_id=i + 1, action="status",
                           details='{"to": "training"}', message=None)],
        "api_keys": [dict(id=i, name=f"client-{k}", key_sha256=h("key"), scopes='["chat", "rate"]', created_at=at,
                          revoked_at=None)],
        "suite_attempts": [dict(id=row, suite_sha256=h("suite"), test=test, generation_id=i + 1, lineage=f"l{k}",
                                generation_number=1, contract_version_id=i, attempt=1, created_at=at,
                                family=h("suite"), sample=1)
                           for row, test in ((i, "improvement"), (i + 1, "noninferiority:chat"))],
        "suite_items": [dict(suite_sha256=h("suite"), item_key=h(f"item{n}")) for n in range(3)],
    }  # fmt: skip


def _seed(url: str, k: int) -> None:
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            tables = MetaData()
            tables.reflect(conn)
            for name, rows in _seed_rows(k).items():  # dict order: parents before children
                if name in tables.tables:
                    table = tables.tables[name]
                    conn.execute(insert(table), [{c: v for c, v in r.items() if c in table.c} for r in rows])
            if conn.dialect.name == "postgresql":  # explicit ids: move each sequence past them
                for table in tables.sorted_tables:
                    if "id" in table.c and table.c.id.autoincrement is not False:
                        conn.execute(text(f"SELECT setval(pg_get_serial_sequence('{table.name}', 'id'), "
                                          f"(SELECT COALESCE(MAX(id), 1) FROM {table.name}))"))  # fmt: skip
    finally:
        engine.dispose()


def _snapshot(url: str) -> dict[str, dict[tuple, dict]]:
    """Every row of every table, by primary key, column by column; and no dangling reference (SQLite)."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            if conn.dialect.name == "sqlite":
                assert conn.exec_driver_sql("PRAGMA foreign_key_check").all() == []
            tables = MetaData()
            tables.reflect(conn)
            out = {}
            for name, table in tables.tables.items():
                if name == "alembic_version":
                    continue
                key = [c.name for c in table.primary_key.columns]
                out[name] = {
                    tuple(r[c] for c in key): dict(r) for r in conn.execute(select(table)).mappings()
                }
            return out
    finally:
        engine.dispose()


def _assert_kept(
    before: dict, after: dict, *, step: str, changed: set[tuple[str, str]] = frozenset()
) -> None:
    """Every row of a table the schema keeps is still there, with every column it keeps unchanged (``changed``:
    (table, column) a data migration rewrites on this step)."""
    for name, rows in before.items():
        if name not in after:
            continue
        assert after[name].keys() == rows.keys(), f"{step}: rows of {name} lost or added"
        for pk, row in rows.items():
            for column, value in row.items():
                if column in after[name][pk] and (name, column) not in changed:
                    assert after[name][pk][column] == value, f"{step}: {name} {pk} {column}"


def test_every_step_up_and_down_keeps_the_rows_of_every_table(empty_url):
    """Seeded rows in every table at every revision; then down one step at a time to 0001 and up again to the
    head: nothing the schema keeps is lost, nothing dangles. On SQLite, 0007's and 0006's downgrades rebuild
    ``experience`` and ``adapters``, which other tables reference: that used to fail with "FOREIGN KEY
    constraint failed" (or, with ON DELETE CASCADE, delete the scores and provenance of every trace)."""
    assert REVISIONS[-1] == head_revision()
    for k, revision in enumerate(REVISIONS, start=1):
        upgrade_db(empty_url, revision)
        _seed(empty_url, k)
    seeded = _snapshot(empty_url)
    assert set(seeded) == TABLES and all(seeded.values()), {n: len(r) for n, r in seeded.items()}
    for down_to in reversed(REVISIONS[:-1]):
        before = _snapshot(empty_url)
        downgrade_db(empty_url, down_to)
        assert current_revision(empty_url) == down_to
        _assert_kept(before, _snapshot(empty_url), step=f"downgrade to {down_to}")
    at_first = _snapshot(empty_url)
    for up_to in REVISIONS[1:]:
        before = _snapshot(empty_url)
        upgrade_db(empty_url, up_to)
        assert current_revision(empty_url) == up_to
        _assert_kept(before, _snapshot(empty_url), step=f"upgrade to {up_to}")
    after = _snapshot(empty_url)
    for name in at_first:  # back at the head: every row of a table 0001 made is there, as seeded
        assert after[name].keys() == seeded[name].keys(), name
    served = {pk: r for pk, r in after["experience"].items() if r["completion_id"]}
    for pk, row in served.items():  # 0007 twice (once per climb) claims what a client sent once, not twice
        assert json.loads(row["metadata"])["claimed"] == {"expected": "42"}, pk
        assert json.loads(row["feedback"]) == {"claimed": {"rating": 5}}, pk


def test_quarantined_lines_from_before_0009_are_known_by_their_content_where_it_was_kept(empty_url):
    """0009 recovers the line hash of a row whose kept text is the whole line; a cut or altered one stays
    NULL (it matches any content at its number, as before)."""
    upgrade_db(empty_url, "0008")
    whole, cut = '{"messages": 3}\n', "x" * 4096
    engine = make_engine(empty_url)
    try:
        with engine.begin() as conn:
            for n, raw in enumerate([whole, cut, "", "caf\ufffd\n"], start=1):
                conn.execute(text("INSERT INTO quarantine (source_file, line_number, reason, raw, created_at) "
                                  "VALUES ('f.jsonl', :n, 'bad', :raw, CURRENT_TIMESTAMP)"), {"n": n, "raw": raw})  # fmt: skip
        upgrade_db(empty_url)
        with engine.connect() as conn:
            got = dict(conn.execute(text("SELECT line_number, line_sha256 FROM quarantine")).all())
    finally:
        engine.dispose()
    assert got == {1: hashlib.sha256(whole.encode()).hexdigest(), 2: None, 3: None, 4: None}


def test_the_spending_ledger_outlives_nothing_it_counts(empty_url):
    """0010's ledger rows name the generation that spent: that generation cannot be deleted from under them
    (the spending would silently restart), a suite's items are kept once per item, and a downgrade past
    0010 drops the ledger and its items alone."""
    from sqlalchemy.exc import IntegrityError

    upgrade_db(empty_url, "0009")
    _seed(empty_url, 1)
    upgrade_db(empty_url)
    _seed(empty_url, 2)
    engine = make_engine(empty_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text("SELECT generation_id, test, attempt FROM suite_attempts ORDER BY id")
            ).all()
        assert [tuple(r) for r in rows] == [(201, "improvement", 1), (201, "noninferiority:chat", 1)]
        with pytest.raises(IntegrityError), engine.begin() as conn:
            conn.execute(text("DELETE FROM generations WHERE id = 201"))
        with engine.connect() as conn:
            items = conn.execute(text("SELECT suite_sha256, item_key FROM suite_items")).all()
        suite = _seed_rows(2)["suite_attempts"][0]["suite_sha256"]
        assert len(items) == 3 and {r[0] for r in items} == {suite}
        with pytest.raises(IntegrityError), engine.begin() as conn:  # one row per item of a suite
            conn.execute(text("INSERT INTO suite_items (suite_sha256, item_key) VALUES (:s, :k)"),
                         {"s": items[0][0], "k": items[0][1]})  # fmt: skip
    finally:
        engine.dispose()
    before = _snapshot(empty_url)
    downgrade_db(empty_url, "0009")
    after = _snapshot(empty_url)
    assert {"suite_attempts", "suite_items"}.isdisjoint(after)
    assert after["generations"] == before["generations"]
    upgrade_db(empty_url)  # and up again: empty, ready to count
    assert _snapshot(empty_url)["suite_items"] == {}


def test_a_lineage_tested_before_0010_does_not_start_its_spending_again(empty_url):
    """0010 enters no ledger rows for generations evaluated before it; after the upgrade, the lineage's next
    evaluation counts each of them (a comparison, no ``suites``) as one earlier test on its suites."""
    from pipeline.registry import Generation, session_scope, spend

    upgrade_db(empty_url, "0009")
    _seed(empty_url, 1)  # lineage l1: champion 100, candidate 101
    engine = make_engine(empty_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("UPDATE generations SET evaluation = :ev, status = 'rejected' WHERE id = 101"),
                         {"ev": json.dumps({"comparison": {"specialists": {}}, "attempt": 1})})  # fmt: skip
        upgrade_db(empty_url)
        with session_scope(engine) as s:
            gen = Generation(lineage="l1", number=2, parent_id=100, base_model_id=100, harness_version_id=100,
                             contract_version_id=100, status="evaluating")  # fmt: skip
            s.add(gen)
            s.flush()
            got = spend(s, generation_id=gen.id, lineage="l1", tests={"improvement": ["s" * 64]},
                        items={"s" * 64: ["an item"]})  # fmt: skip
    finally:
        engine.dispose()
    assert got == {"improvement": 2}


# ---- pytest-alembic's own checks: one head, every step up and down, models match the migrations ---------------
@pytest.fixture
def alembic_config():
    from pipeline.registry.db import _alembic_config

    return _alembic_config("sqlite://")


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def alembic_engine(request, tmp_path):
    url = (
        f"sqlite:///{tmp_path / 'pa.db'}"
        if request.param == "sqlite"
        else request.getfixturevalue("postgres_url")
    )
    engine = make_engine(url)
    yield engine
    engine.dispose()


from pytest_alembic.tests import (  # noqa: E402  (pytest-alembic's tests, collected here)
    test_model_definitions_match_ddl,
    test_single_head_revision,
    test_up_down_consistency,
    test_upgrade,
)

__all__ = [
    "test_model_definitions_match_ddl",
    "test_single_head_revision",
    "test_up_down_consistency",
    "test_upgrade",
]
