"""The declared dependencies are the imported ones.

Every third-party module that the shipped code (``pipeline/``, ``flows.py``, the Alembic ``migrations/``) imports
must come from a distribution named in ``[project].dependencies`` of ``pyproject.toml``: one that is only there
because another dependency happens to pull it in breaks the day that dependency drops it (typer 0.20 stopped
installing click, which ``pipeline.cli`` imports). And every declared distribution must be imported, or be in
``NOT_IMPORTED`` below with the reason it is needed all the same, so nothing is installed for nobody.

Imports are read with ``ast`` (every ``import``, at any depth, lazy ones included), the standard library is
``sys.stdlib_module_names``, and an import name is mapped to its distributions by
``importlib.metadata.packages_distributions()`` of the installed environment.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = [
    *sorted((ROOT / "pipeline").rglob("*.py")),
    ROOT / "flows.py",
    *sorted((ROOT / "migrations").rglob("*.py")),
]
FIRST_PARTY = {"pipeline", "flows"}

# Declared but never imported by name, each for a reason the shipped code shows (the evidence must occur in it).
NOT_IMPORTED = {
    # SQLAlchemy loads the driver from the URL scheme postgresql+psycopg://; [binary] brings libpq with it
    "psycopg": "postgresql+psycopg",
    # FastAPI parses the dashboard's login and action forms (Form(...)) with it, and refuses Form without it
    "python-multipart": "Form(",
}


def canonical(name: str) -> str:
    """A distribution's name as PEP 503 compares names."""
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    names = set()
    for requirement in project["dependencies"]:
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
        assert match, f"cannot read the distribution name of {requirement!r}"
        names.add(canonical(match.group(1)))
    return names


def imported() -> dict[str, set[str]]:
    """Third-party top-level import names -> the shipped files that import them."""
    found: dict[str, set[str]] = {}
    for path in SHIPPED:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in FIRST_PARTY:
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def distributions() -> dict[str, set[str]]:
    return {
        module: {canonical(d) for d in dists}
        for module, dists in importlib.metadata.packages_distributions().items()
    }


def test_the_scan_sees_the_imports_it_must():
    """The scan reads imports inside functions too (torch and transformers are imported lazily) and leaves out
    the standard library and the project itself."""
    found = imported()
    assert {"torch", "transformers", "sqlalchemy", "typer"} <= set(found)
    assert not {"json", "asyncio", "__future__", "pipeline", "flows"} & set(found)


def test_every_imported_package_is_declared():
    have, names = declared(), distributions()
    missing = {}
    for module, files in sorted(imported().items()):
        dists = names.get(module)
        if not dists:
            missing[module] = f"installed by no distribution (imported in {', '.join(sorted(files))})"
        elif not dists & have:
            missing[module] = f"from {', '.join(sorted(dists))}, imported in {', '.join(sorted(files))}"
    assert not missing, "imported but not in [project].dependencies:\n" + "\n".join(
        f"  {module}: {why}" for module, why in missing.items()
    )


def test_every_declared_package_is_imported_or_says_why_not():
    names = distributions()
    used = set().union(*(names.get(module, set()) for module in imported()))
    unused = declared() - used - set(NOT_IMPORTED)
    assert not unused, f"in [project].dependencies but imported nowhere in the shipped code: {sorted(unused)}"


def test_each_reason_for_an_unimported_dependency_still_holds():
    shipped = "\n".join(path.read_text(encoding="utf-8") for path in SHIPPED)
    have = declared()
    for dist, evidence in NOT_IMPORTED.items():
        assert dist in have, (
            f"{dist} is allowed unimported but is no longer declared: drop it from NOT_IMPORTED"
        )
        assert evidence in shipped, (
            f"{dist} is declared for {evidence!r}, which the shipped code no longer has"
        )
