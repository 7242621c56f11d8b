"""The home (RATCHET_HOME) is a self-contained folder: the registry keeps the paths inside it relative to it, and
MLflow's store follows its artifacts, so a home moved whole keeps working from its new place. And a command
run where there is no home says so instead of starting an empty one: only `ratchet init` (and `ratchet demo`)
make it."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

from conftest import run_cli
from fastapi.testclient import TestClient
from smalllineage import ADVANCE_ARGS, write_small_specs

from pipeline.registry import BaseModelRow, dispose_engines, get_engine, session_scope
from pipeline.registry.locations import home_path, stored_path
from pipeline.settings import get_settings


def use_home(monkeypatch, home: Path) -> None:
    dispose_engines()
    monkeypatch.setenv("RATCHET_HOME", str(home))
    get_settings.cache_clear()


def stored_rows(db: Path) -> dict[str, list[str]]:
    """The path columns as stored (plain SQLite, not through the models)."""
    with sqlite3.connect(db) as conn:
        return {
            "base": [r[0] for r in conn.execute("SELECT path FROM base_models")],
            "adapters": [r[0] for r in conn.execute("SELECT artifact_uri FROM adapters")],
            "datasets": [r[0] for r in conn.execute("SELECT path FROM datasets")],
        }


def mlflow_locations(db: Path) -> list[str]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT artifact_location FROM experiments WHERE name = 'ratchet'").fetchall()
        rows += conn.execute("SELECT artifact_uri FROM runs").fetchall()
        rows += conn.execute("SELECT source FROM model_versions").fetchall()
    return [r[0] for r in rows]


def test_a_moved_home_keeps_working(tmp_path, monkeypatch, capsys):
    old = tmp_path / "first" / "home"
    use_home(monkeypatch, old)
    specs = write_small_specs(tmp_path / "specs")
    assert run_cli(["init", "--model", str(specs["model"]), "--contract", str(specs["contract"])]) == 0
    assert run_cli(["ingest", str(specs["feedback"]), "--source", "deployment"]) == 0
    assert run_cli(["advance", *ADVANCE_ARGS]) == 0
    stored = stored_rows(old / "registry.db")
    # inside the home: stored relative to it
    assert not [p for paths in stored.values() for p in paths if Path(p).is_absolute()], stored
    assert stored["adapters"] and stored["datasets"] and stored["base"]
    assert all(loc.startswith(f"file://{old}/mlartifacts") for loc in mlflow_locations(old / "mlflow.db"))

    new = tmp_path / "elsewhere" / "moved"
    dispose_engines()
    new.parent.mkdir()
    shutil.move(old, new)
    shutil.rmtree(tmp_path / "first")
    use_home(monkeypatch, new)
    capsys.readouterr()

    # the registry reads every path against the new home
    assert run_cli(["lineage", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert json.dumps(shown).count(str(old)) == 0
    from pipeline.modeling.pair import pair_for_generation
    from pipeline.registry import Generation

    with session_scope(get_engine()) as session:
        gen = session.query(Generation).filter_by(number=1).one()
        pair = pair_for_generation(gen)  # checks the adapter files against their sha256
        assert pair.base_dir.is_relative_to(new) and (pair.base_dir / "config.json").is_file()
        assert pair.adapters["chat"].is_relative_to(new)

    # serving loads the trained generation from the new place and answers
    from pipeline.serving.served import ServeConfig
    from pipeline.serving.server import create_app

    config = ServeConfig(
        registry_url=get_settings().registry_url,
        generation="1",
        poll_seconds=0,
        device="cpu",
        allow_anonymous=True,
        flush_seconds=0.05,
    )
    with TestClient(create_app(config)) as client:
        answer = client.post(
            "/v1/chat/completions",
            json={"model": "ratchet", "messages": [{"role": "user", "content": "12+35=?"}], "max_tokens": 4},
        )
    assert answer.status_code == 200, answer.text

    # the next generation is built from what the moved home holds (base, champion, experience, MLflow store)
    assert run_cli(["advance", *ADVANCE_ARGS]) == 0
    assert [r for r in stored_rows(new / "registry.db")["adapters"] if not Path(r).is_absolute()]
    locations = mlflow_locations(new / "mlflow.db")
    assert locations and all(loc.startswith(f"file://{new}/mlartifacts") for loc in locations), locations
    assert not (tmp_path / "first").exists()  # nothing was written to (or read from) the old place


def test_paths_outside_the_home_and_those_of_older_registries_stay_absolute(tmp_path):
    home = get_settings().home
    inside, outside = home / "models" / "m", tmp_path / "mine" / "model"
    assert stored_path(inside) == "models/m" and home_path("models/m") == str(home.absolute() / "models/m")
    assert stored_path(outside) == str(outside) and home_path(str(outside)) == str(outside)
    assert stored_path(home / "models" / ".." / ".." / "x") == str(tmp_path / "x")  # no climbing out
    # a row an older registry wrote with an absolute path inside the home reads back as written
    with session_scope(get_engine()) as session:
        session.add(BaseModelRow(name="b", content_hash="0" * 64, path=str(outside), spec={}))
    with sqlite3.connect(home / "registry.db") as conn:
        conn.execute("UPDATE base_models SET path = ? WHERE name = 'b'", (str(inside.absolute()),))
    with session_scope(get_engine()) as session:
        assert session.query(BaseModelRow).filter_by(name="b").one().path == str(inside.absolute())


def test_a_command_without_a_home_says_how_to_make_one(tmp_path, monkeypatch, capsys):
    where = tmp_path / "project"
    where.mkdir()
    monkeypatch.chdir(where)
    monkeypatch.delenv("RATCHET_HOME")
    dispose_engines()
    get_settings.cache_clear()
    for command in (["lineage"], ["db", "upgrade"], ["score"], ["advance"]):
        assert run_cli(command) == 1, command
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "`ratchet init` creates it" in err, (command, err)
        assert str(where / ".ratchet") in err
        assert not (where / ".ratchet").exists()
    assert run_cli(["init"]) == 0  # the shipped demo specs
    assert (where / ".ratchet" / "registry.db").is_file()
    assert run_cli(["lineage"]) == 0
