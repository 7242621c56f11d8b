"""Alembic is the only way the schema is made: round trips and drift against the ORM models."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Column, inspect

from pipeline.registry import Base, current_revision, downgrade_db, make_engine, upgrade_db
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
    assert "revision 0008" in capsys.readouterr().out
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
