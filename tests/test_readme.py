"""The README and docs/ stay true to the code: every ``ratchet`` command they show parses, every command the CLI
has is shown in the README, every local link leads somewhere, and ``make test`` is described as the Makefile runs it.

A command is parsed by the CLI's own parser (``make_context``: option names, types, required arguments), never
run. The walkthrough in docs/own-model.md is run for real by ``tests/test_walkthrough.py``.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

from pipeline.cli import _register_commands, app

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"```(\w*)\n(.*?)```", flags=re.DOTALL)


def fenced_commands(text: str) -> list[str]:
    """``ratchet ...`` lines of the shell blocks, without their comments."""
    found = []
    for lang, body in FENCE.findall(text):
        if lang not in {"bash", "sh", "console"}:
            continue
        for line in body.splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("ratchet "):
                found.append(line)
    return found


def inline_commands(text: str) -> list[str]:
    """``ratchet ...`` code spans of the prose and tables (a bare command name there names it: not a call)."""
    return re.findall(r"`(ratchet(?: [^`]*)?)`", FENCE.sub("", text))


def cli() -> typer.core.TyperGroup:
    _register_commands()
    return typer.main.get_command(app)


def parse(command: str, *, named: bool = False) -> str:
    """Parse ``command`` as ``ratchet`` would; return its command path (``contract lint``). ``named``: a bare
    command name is only looked up (prose names commands without their arguments)."""
    words = shlex.split(command)
    assert words[0] == "ratchet", command
    group, path, rest = cli(), [], words[1:]
    while hasattr(group, "commands"):
        if not rest or rest[0] == "--help":
            return " ".join(path)
        assert rest[0] in group.commands, (
            f"{command!r}: no command {rest[0]!r} under 'ratchet {' '.join(path)}'"
        )
        group, path, rest = group.commands[rest[0]], [*path, rest[0]], rest[1:]
    if named and not rest:
        return " ".join(path)
    group.make_context(" ".join(["ratchet", *path]), rest)
    return " ".join(path)


def leaf_commands() -> list[str]:
    paths, todo = [], [((), cli())]
    while todo:
        path, command = todo.pop()
        if hasattr(command, "commands"):
            todo += [((*path, name), sub) for name, sub in command.commands.items()]
        else:
            paths.append(" ".join(path))
    return sorted(paths)


def shown(text: str) -> list[tuple[str, bool]]:
    """Each command shown, and whether it is only named (a prose span) rather than given to run."""
    return [(c, False) for c in fenced_commands(text)] + [(c, True) for c in inline_commands(text)]


def test_the_readme_shows_commands():
    """The extraction itself: a README without these would make the tests below pass on nothing."""
    commands = [command for command, _ in shown(README.read_text(encoding="utf-8"))]
    assert "ratchet demo" in commands and len(commands) >= 20


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.name)
def test_every_command_shown_parses(doc):
    failed = {}
    for command, named in shown(doc.read_text(encoding="utf-8")):
        try:
            parse(command, named=named)
        except Exception as exc:  # noqa: BLE001 - typer's copy of click and click raise unrelated classes
            failed[command] = f"{type(exc).__name__}: {exc}"
    assert not failed, f"{doc.name}: commands that do not parse:\n" + "\n".join(
        f"  {c}\n    {why}" for c, why in failed.items()
    )


def test_a_wrong_command_does_not_parse():
    """The parser check can fail: a misspelt option, a missing argument, a word where a number goes."""
    for wrong in [
        "ratchet lineage --jsn",
        "ratchet ingest --from",
        "ratchet promote GEN",
        "ratchet contract lnt x.yaml",
    ]:
        with pytest.raises(Exception):  # noqa: B017 - typer's copy of click and click raise unrelated classes
            parse(wrong)
    with pytest.raises(AssertionError):
        parse("ratchet contract lnt", named=True)


def test_the_readme_lists_every_command():
    listed = {parse(command, named=named) for command, named in shown(README.read_text(encoding="utf-8"))}
    missing = [path for path in leaf_commands() if path not in listed]
    assert not missing, f"commands of the CLI the README never shows: {missing}"


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a file's headings (lower case, punctuation dropped, spaces to hyphens)."""
    headings = re.findall(r"^#+ (.+)$", FENCE.sub("", markdown), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.name)
def test_every_local_link_leads_to_a_file_and_heading(doc):
    text = FENCE.sub("", doc.read_text(encoding="utf-8"))
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, fragment = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file.read_text(encoding="utf-8")):
            broken.append(f"{target}: no heading #{fragment} in {file.name}")
    assert not broken, f"{doc.name}: " + "; ".join(broken)


def test_the_readme_links_every_doc():
    linked = {
        (ROOT / target.partition("#")[0]).resolve()
        for target in re.findall(r"\]\((docs/[^)\s]+)\)", README.read_text(encoding="utf-8"))
    }
    orphans = [doc.name for doc in DOCS if doc.resolve() not in linked]
    assert not orphans, f"docs the README never links to: {orphans}"


def test_make_test_is_described_as_the_makefile_runs_it():
    """The README says which markers `make test` leaves out and that `make test-all` runs the slow ones."""
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    recipes = dict(re.findall(r"^([\w-]+):.*\n\t(.*)$", makefile, flags=re.M))
    excluded = set(re.findall(r"not (\w+)", re.search(r'-m "([^"]+)"', recipes["test"]).group(1)))
    assert excluded == {"slow", "gpu"}, recipes["test"]
    assert "not slow" not in recipes["test-all"], recipes["test-all"]
    readme = README.read_text(encoding="utf-8")
    line = next(line for line in readme.splitlines() if line.startswith("make test "))
    for marker in excluded:
        assert f"`{marker}`" in line, f"the README's `make test` line does not say it skips {marker}: {line}"
    assert any(line.startswith("make test-all") and "slow" in line for line in readme.splitlines())
