"""The package's layering: no import cycles between modules (function-level imports included), and core
modules do not depend on the demo environment. Imports sit at the top of modules: a module imports the package's
own code inside a function only to break a real cost, said on that line (``# lazy: ...``) -- it would import a
heavy library (torch, transformers, peft, datasets, prefect, mlflow) the module does not import already, or make
an import-time cycle. ``ratchet --help`` lists every command without importing the commands' modules."""

from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pipeline"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the pipeline modules it imports anywhere in its body (``from pkg import mod`` counts as mod)."""
    modules = _modules()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" for a in node.names]
            for target in targets:
                if target.startswith("pipeline"):
                    found = owner(target)
                    if found and found != name:
                        graph[name].add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_core_modules_do_not_import_the_demo_environment():
    graph = import_graph()
    core = [
        m
        for m in graph
        if m.startswith(("pipeline.modeling.packing", "pipeline.scoring.scorers", "pipeline.serving"))
    ]
    leaks = {m: sorted(t for t in graph[m] if t.startswith("pipeline.environment")) for m in core}
    assert {m: t for m, t in leaks.items() if t} == {}


# ------------------------------------------------------------------- imports at import time (top level)
HEAVY = frozenset({"torch", "transformers", "peft", "datasets", "prefect", "mlflow", "trl", "accelerate"})
# worth a function-level import too: the web stack (about a second; ``pipeline.dashboard``'s __init__ loads it)
COSTLY = HEAVY | {"fastapi", "uvicorn"}
# the modules ``ratchet --help`` imports: anything else they import inside a function keeps it fast
CLI_ENTRY = frozenset({"pipeline.cli", "pipeline.cli.app"})
# looked up when called because a test replaces it (monkeypatch): (module, imported from, name) -> the test
PER_CALL = {
    ("pipeline.loop.advance", "pipeline.codesign", "codesign_step"): "tests/test_advance.py",
    ("pipeline.codesign.step", "pipeline.codesign.operators", "propose_variants"): "tests/test_heldout.py",
}


def _all_modules() -> dict[str, Path]:
    """The package's modules and ``flows`` (first-party, outside the package)."""
    return {**_modules(), "flows": ROOT / "flows.py"}


def _parents(module: str) -> set[str]:
    """The packages Python imports before ``module``."""
    out = set()
    while "." in module:
        module = module.rpartition(".")[0]
        out.add(module)
    return out


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def split_imports(tree: ast.Module) -> tuple[list[ast.stmt], list[ast.stmt]]:
    """(imports run when the module is imported, imports inside functions); ``if TYPE_CHECKING`` ones in neither."""
    top: list[ast.stmt] = []
    inner: list[ast.stmt] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                (inner if in_function else top).append(child)
            elif isinstance(child, ast.If) and _is_type_checking(child):
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), in_function)
            else:
                visit(
                    child,
                    in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)),
                )

    visit(tree, False)
    return top, inner


def import_targets(node: ast.stmt, module: str, modules: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(first-party modules an import statement loads, their packages included; heavy libraries it loads)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = module.split(".")
            if modules[module].name != "__init__.py":
                parts = parts[:-1]
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join([*parts, *([node.module] if node.module else [])])
        names = [base] + [f"{base}.{a.name}" for a in node.names]
    first, heavy = set(), set()
    for name in names:
        root = name.split(".")[0]
        if root in COSTLY or name.startswith("safetensors.torch"):
            heavy.add(root if root in COSTLY else "torch")
        if root in ("pipeline", "flows"):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                first |= {name} | {p for p in _parents(name) if p in modules}
    return first, heavy


def top_level_graph(modules: dict[str, Path], trees: dict[str, ast.Module]):
    """Module -> the first-party modules importing it loads directly (its own packages apart), and module -> the
    heavy libraries it imports itself, both at import time."""
    edges: dict[str, set[str]] = {m: set() for m in modules}
    heavy: dict[str, set[str]] = {m: set() for m in modules}
    for name, tree in trees.items():
        for node in split_imports(tree)[0]:
            first, h = import_targets(node, name, modules)
            edges[name] |= first - {name} - _parents(name)
            heavy[name] |= h
    return edges, heavy


def reach(edges: dict[str, set[str]], start: set[str]) -> set[str]:
    seen, todo = set(start), list(start)
    while todo:
        for w in edges[todo.pop()]:
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def heavy_at_import(edges, heavy, module: str) -> set[str]:
    """The heavy libraries importing ``module`` loads (through its packages and everything it imports)."""
    loaded = reach(edges, {module} | {p for p in _parents(module) if p in edges})
    return set().union(*(heavy[m] for m in loaded))


def lazy_import_costs(modules: dict[str, Path], trees: dict[str, ast.Module]) -> dict[tuple[str, int], str]:
    """Each function-level import of first-party code in the package -> what hoisting it to the top of its module
    would cost ("" when nothing: it belongs at the top)."""
    edges, heavy = top_level_graph(modules, trees)
    entry = reach(edges, CLI_ENTRY & set(edges))
    costs = {}
    for name, tree in trees.items():
        if name == "flows":
            continue
        for node in split_imports(tree)[1]:
            first, h = import_targets(node, name, modules)
            first -= {name} | _parents(name)
            if not first:
                continue
            why = []
            gained = (h | set().union(*(heavy_at_import(edges, heavy, t) for t in first))) - heavy_at_import(
                edges, heavy, name
            )
            if gained:
                why.append("imports " + ", ".join(sorted(gained)))
            if name in reach(edges, first):
                why.append("import cycle")
            if name in CLI_ENTRY and first - entry:
                why.append("ratchet --help")
            if isinstance(node, ast.ImportFrom):
                why += [
                    f"{PER_CALL[(name, node.module, a.name)]} replaces it"
                    for a in node.names
                    if (name, node.module, a.name) in PER_CALL
                ]
            costs[(name, node.lineno)] = "; ".join(why)
    return costs


def _parsed() -> tuple[dict[str, Path], dict[str, ast.Module], dict[str, list[str]]]:
    modules = _all_modules()
    texts = {m: p.read_text() for m, p in modules.items()}
    return modules, {m: ast.parse(t) for m, t in texts.items()}, {m: t.splitlines() for m, t in texts.items()}


def _lazy_comment(lines: list[str], node: ast.stmt) -> bool:
    return any("# lazy:" in line for line in lines[node.lineno - 1 : node.end_lineno])


def test_the_package_imports_its_own_code_at_the_top_of_its_modules():
    modules, trees, lines = _parsed()
    costs = lazy_import_costs(modules, trees)
    unsaid, needless = [], []
    for name, tree in trees.items():
        for node in split_imports(tree)[1]:
            if (name, node.lineno) not in costs:
                continue
            where = f"{modules[name].relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"
            if not _lazy_comment(lines[name], node):
                unsaid.append(f"{where} (cost: {costs[(name, node.lineno)] or 'none'})")
            elif not costs[(name, node.lineno)]:
                needless.append(where)
    assert unsaid == [], "a function-level import of the package without a `# lazy:` reason on its line"
    assert needless == [], "marked `# lazy:` but it costs nothing at the top of its module: hoist it"


def test_the_cost_check_sees_heavy_chains_and_cycles():
    modules = {
        m: Path(f"/{m.replace('.', '/')}.py")
        for m in ("pipeline.a", "pipeline.b", "pipeline.c", "pipeline.d")
    }
    code = {
        "pipeline.a": "def f():\n    from pipeline.b import x\n",  # b -> c -> torch
        "pipeline.b": "from pipeline.c import y\n",
        "pipeline.c": "import torch\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pipeline.d\n",
        "pipeline.d": "import pipeline.a\ndef g():\n    from pipeline.a import f\n    import pipeline.c\n",
    }
    trees = {m: ast.parse(c) for m, c in code.items()}
    costs = lazy_import_costs(modules, trees)
    assert costs[("pipeline.a", 2)] == "imports torch"
    assert costs[("pipeline.d", 3)] == ""  # already imported at the top
    assert costs[("pipeline.d", 4)] == "imports torch"
    trees["pipeline.a"] = ast.parse("from pipeline.b import x\n")  # now a -> b -> c at the top
    trees["pipeline.d"] = ast.parse("")
    trees["pipeline.c"] = ast.parse("def h():\n    import pipeline.a\n")
    assert lazy_import_costs(modules, trees)[("pipeline.c", 2)] == "import cycle"


def test_no_module_of_the_package_imports_a_heavy_library_at_import_time():
    modules, trees, _ = _parsed()
    edges, heavy = top_level_graph(modules, trees)
    loaded = {m: sorted(heavy_at_import(edges, heavy, m) & HEAVY) for m in modules if m != "flows"}
    assert {m: h for m, h in loaded.items() if h and not m.startswith("pipeline.cli.")} == {}


# ------------------------------------------------------------------- ratchet --help
_PROBE = """
import contextlib, io, json, sys, time
start = time.perf_counter()
from pipeline.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        main(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code
    else:
        code = 0
print(json.dumps({"s": time.perf_counter() - start, "out": out.getvalue(), "code": code,
                  "modules": sorted(sys.modules)}))
"""


def _run_cli(*args: str, preload: bool = False) -> dict:
    code = ("from pipeline.cli import _register_commands; _register_commands()\n" if preload else "") + _PROBE
    env = {**os.environ, "COLUMNS": "100", "TERM": "dumb", "NO_COLOR": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def _command_modules() -> set[str]:
    return {m for m in _modules() if m.startswith("pipeline.cli.") and m not in CLI_ENTRY}


def test_ratchet_help_lists_every_command_without_importing_them():
    from pipeline.cli.app import COMMANDS

    shown = _run_cli("--help")
    assert shown["code"] == 0
    listed = [
        line.split()[1]
        for line in shown["out"].splitlines()
        if line.startswith("│ ") and len(line.split()) > 2
    ]
    assert set(COMMANDS) <= set(listed)
    forbidden = {"torch", "transformers", "peft", "datasets", "prefect", "mlflow", "sqlalchemy", "fastapi"}
    loaded = {m for m in shown["modules"] if m.split(".")[0] in forbidden}
    loaded |= {
        m
        for m in shown["modules"]
        if m.startswith(("pipeline.serving", "pipeline.loop", "pipeline.registry"))
    }
    loaded |= _command_modules() & set(shown["modules"])
    assert loaded == set()


def test_the_command_table_is_the_commands():
    """The lazy listing shows what the commands themselves say: the same help with every module imported."""
    import typer

    from pipeline.cli import _register_commands, app
    from pipeline.cli.app import COMMANDS

    for module in _command_modules():  # every command module, listed in the table or not
        __import__(module)
    _register_commands()
    group = typer.main.get_group(app)
    assert set(group.commands) == set(COMMANDS)
    for name, command in group.commands.items():
        assert COMMANDS[name][1] == inspect.cleandoc(command.help or "").split("\n\n")[0], name
    assert _run_cli("--help")["out"] == _run_cli("--help", preload=True)["out"]


def test_a_command_imports_its_module_only_when_it_is_asked_for():
    shown = _run_cli("contract", "--help")
    assert shown["code"] == 0 and "lint" in shown["out"]
    modules, trees, _ = _parsed()
    needed = reach(top_level_graph(modules, trees)[0], {"pipeline.cli.contract"})
    assert _command_modules() & set(shown["modules"]) == _command_modules() & needed
    assert "pipeline.cli.contract" in needed and "pipeline.cli.serve" not in needed


def test_a_mistyped_command_gets_the_nearest_names():
    done = subprocess.run(
        [sys.executable, "-c", "from pipeline.cli import main; main()", "lineag"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 2
    assert "Did you mean 'lineage'" in done.stderr


def test_importing_the_cli_loads_no_heavy_library():
    done = subprocess.run(
        [sys.executable, "-c", "import json, sys, pipeline.cli; print(json.dumps(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    loaded = set(json.loads(done.stdout))
    assert {m.split(".")[0] for m in loaded} & HEAVY == set()
    assert {m for m in loaded if m.startswith(("pipeline.serving", "pipeline.loop"))} == set()
