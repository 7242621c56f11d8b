"""The package's house: every layer is a folder, every module lives in one, and a module name has one meaning.

A name may appear in more than one folder only where it is the same noun seen from another layer (the
``advance`` command and the ``advance`` step); a new reuse fails here until it is added to ``SAME_NOUN`` with
the meaning it shares, so two meanings never hide behind one name again (three ``experience.py`` once meant
"ingest a file", "the experience table" and "the experience pages").
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pipeline"

LAYERS = {
    "specs",
    "experience",
    "modeling",
    "gates",
    "loop",
    "scoring",
    "training",
    "codesign",
    "serving",
    "dashboard",
    "registry",
    "sandbox",
    "environment",
    "cli",
}
# modules at the package's root: the foundation every layer imports
ROOT_MODULES = {"__init__", "settings", "errors", "shipped", "knobs"}

# name -> the one meaning its modules share (each is that noun as one layer sees it)
SAME_NOUN = {
    "advance": "advancing a lineage by one generation (cli: the command; loop: the step)",
    "contract": "the HCP contract (cli: its commands; specs: its YAML kind)",
    "experience": "stored traces (experience: the layer; registry: their tables; dashboard: their pages)",
    "keys": "API keys of principals (cli: their commands; registry: their table)",
    "scorers": "the contract's scorers (specs: their YAML kinds; scoring: running them)",
    "step": "a package's advancement step (training, codesign)",
    "trace": "one trace (scoring: scoring it; dashboard: its page)",
    "dashboard": "the registry dashboard (cli: the command; the package)",
    "zygote": "the sandbox's zygote (sandbox: its launcher side; programs: the program itself)",
}


def _modules() -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts]


def test_every_module_lives_in_a_layer_folder():
    loose = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in ROOT_MODULES)
    assert loose == []
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == LAYERS


def test_every_layer_says_what_it_holds():
    for layer in sorted(LAYERS):
        init = PACKAGE / layer / "__init__.py"
        assert init.exists(), f"pipeline/{layer} has no __init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, (
            f"pipeline/{layer}/__init__.py has no docstring saying what the layer holds"
        )


def test_a_module_name_has_one_meaning():
    places: dict[str, set[str]] = defaultdict(set)
    for path in _modules():
        name = path.parent.name if path.stem == "__init__" else path.stem
        if name in {"__init__", "pipeline"}:
            continue
        places[name].add(str(path.parent.relative_to(PACKAGE.parent)))
    reused = {name: sorted(where) for name, where in places.items() if len(where) > 1}
    unexplained = {name: where for name, where in reused.items() if name not in SAME_NOUN}
    assert unexplained == {}, (
        "a module name reused in another folder: add it to SAME_NOUN if it is the same noun"
    )
    stale = sorted(set(SAME_NOUN) - set(reused))
    assert stale == [], f"SAME_NOUN lists names no longer reused: {stale}"


def test_the_names_that_once_collided_are_gone():
    names = {p.stem for p in _modules()}
    # "start a lineage" was pipeline/lineage.py beside the dashboard's lineage page; tool-call formats and the
    # demo's tools were both toolcalls.py; preference pairs and the DPO job were preferences.py/preference.py
    assert "founding" in names and not (PACKAGE / "loop" / "lineage.py").exists()
    assert sorted(str(p.relative_to(PACKAGE)) for p in _modules() if p.stem == "toolcalls") == [
        "experience/toolcalls.py"
    ]
    assert "preference" not in names and "preferences" in names
    assert not (PACKAGE / "scorers").exists()
