"""Loading YAML specs into pydantic models, reporting every error at once with file:line and field path.

One YAML kind = one pydantic model (``extra="forbid"``). ``load_spec`` parses the file, keeps the
line of every node, validates, and on failure raises ``SpecError`` listing each problem as
``file:line: field.path: what is expected``.

A spec is plain data, read with limits so that a hostile file costs little: at most ``MAX_SPEC_BYTES``,
nested at most ``MAX_DEPTH`` levels, aliases expanding to at most ``MAX_ALIAS_NODES`` nodes beyond the
file's own (an anchor reused a few times is fine; a "billion laughs" is refused), no recursive aliases
and no tags beyond YAML's plain types. Mapping keys are text as written (``1:`` and ``on:`` are the keys
``"1"`` and ``"on"``; JSON, which a spec's content hash is computed over, has only text keys), dates stay
text, and merge keys (``<<: *base``) are supported.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from pipeline.errors import RatchetError

M = TypeVar("M", bound=BaseModel)

MAX_SPEC_BYTES = 1 << 20  # the shipped specs are under 10 KB
MAX_DEPTH = 64
MAX_ALIAS_NODES = 10_000


@dataclass(frozen=True)
class SpecIssue:
    """One problem in one file: where it is and what was expected."""

    file: str
    line: int
    path: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        field = f" {self.path}:" if self.path else ""
        return f"{where}:{field} {self.message}"


class SpecError(RatchetError):
    """A spec file failed to load; ``issues`` lists every problem found."""

    def __init__(self, issues: list[SpecIssue]):
        self.issues = issues
        first = str(issues[0]) if issues else "invalid spec"
        more = f" (and {len(issues) - 1} more)" if len(issues) > 1 else ""
        super().__init__(first + more)


_CORE = "tag:yaml.org,2002:"
# kept as the text written (``<<`` is a merge only as a key)
_TEXT_TAGS = frozenset(_CORE + t for t in ("str", "timestamp", "value", "merge"))
_TYPED_TAGS = frozenset(_CORE + t for t in ("int", "float", "bool", "null"))
_MERGE = _CORE + "merge"


class _SpecLoader(yaml.SafeLoader):
    """PyYAML's safe loader with a nesting limit while composing (its composer recurses per level) and a
    count of the nodes the file itself holds (the alias budget is on top of those)."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self.depth = 0
        self.nodes = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            return super().compose_node(parent, index)
        self.depth += 1
        self.nodes += 1
        try:
            if self.depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels", mark)
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def _tag_problem(tag: str) -> str:
    short = "!!" + tag.removeprefix(_CORE) if tag.startswith(_CORE) else tag
    return (
        f"unsupported YAML tag {short}: a spec is plain data (mappings, lists, text, numbers, booleans, null)"
    )


class _Reader:
    """Turns composed nodes into plain data, recording each field path's line and every problem."""

    def __init__(self, file: str, budget: int):
        self.file = file
        self.budget = budget
        self.lines: dict[tuple, int] = {}
        self.issues: list[SpecIssue] = []
        self.active: set[int] = set()  # ids of the nodes being read (a node inside itself is recursion)
        self.constructor = yaml.constructor.SafeConstructor()

    def issue(self, node: yaml.Node, path: tuple, message: str) -> None:
        self.issues.append(SpecIssue(self.file, node.start_mark.line + 1, _dotted(path), message))

    def fatal(self, node: yaml.Node, path: tuple, message: str) -> SpecError:
        self.issue(node, path, message)
        return SpecError(self.issues)

    def value(self, node: yaml.Node, path: tuple, depth: int) -> Any:
        self.lines[path] = node.start_mark.line + 1
        if isinstance(node, yaml.ScalarNode):
            self.spend(node, path, depth)
            return self.scalar(node, path)
        expected = _CORE + ("map" if isinstance(node, yaml.MappingNode) else "seq")
        if node.tag != expected:
            self.issue(node, path, _tag_problem(node.tag))
            return None
        self.enter(node, path, depth)
        try:
            if isinstance(node, yaml.SequenceNode):
                return [self.value(item, (*path, i), depth + 1) for i, item in enumerate(node.value)]
            return self.mapping(node, path, depth)
        finally:
            self.active.discard(id(node))

    def spend(self, node: yaml.Node, path: tuple, depth: int) -> None:
        self.budget -= 1
        if self.budget < 0:
            raise self.fatal(
                node, path, f"aliases expand to more than {MAX_ALIAS_NODES} nodes beyond the file's own "
                "(an alias bomb?): reuse an anchor a few times at most",
            )  # fmt: skip
        if depth > MAX_DEPTH:
            raise self.fatal(node, path, f"nested deeper than {MAX_DEPTH} levels (through aliases)")

    def enter(self, node: yaml.Node, path: tuple, depth: int) -> None:
        self.spend(node, path, depth)
        if id(node) in self.active:
            raise self.fatal(node, path, "recursive alias: an anchored node contains an alias to itself")
        self.active.add(id(node))

    def scalar(self, node: yaml.ScalarNode, path: tuple) -> Any:
        if node.tag in _TEXT_TAGS:
            return node.value
        if node.tag not in _TYPED_TAGS:
            self.issue(node, path, _tag_problem(node.tag))
            return None
        try:
            return self.constructor.yaml_constructors[node.tag](self.constructor, node)
        except (ValueError, KeyError, IndexError, OverflowError, yaml.YAMLError) as exc:  # e.g. `!!int ''`
            reason = str(exc).split(":")[0] if isinstance(exc, ValueError) else "not a valid value"
            kind = node.tag.removeprefix(_CORE)
            self.issue(node, path, f"cannot read {node.value[:40]!r} as {kind}: {reason}")
            return None

    def mapping(self, node: yaml.MappingNode, path: tuple, depth: int) -> dict[str, Any]:
        # Merged mappings first (the first listed wins), so the explicit keys' values and lines win over them.
        merges = [(k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.tag == _MERGE]
        merged: dict[str, Any] = {}
        for key_node, value_node in merges:
            for source in reversed(self.merge_sources(key_node, value_node, path)):
                self.enter(source, path, depth)
                try:
                    merged.update(self.mapping(source, path, depth))
                finally:
                    self.active.discard(id(source))
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag == _MERGE:
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                self.issue(key_node, path, "a mapping key must be plain text, not a list or mapping")
                continue
            if key_node.tag not in _TEXT_TAGS | _TYPED_TAGS:
                self.issue(key_node, path, _tag_problem(key_node.tag))
                continue
            key = key_node.value
            if key in out:
                self.issue(key_node, (*path, key), "duplicate key")
                continue
            self.spend(key_node, path, depth + 1)
            self.lines[(*path, key)] = key_node.start_mark.line + 1
            out[key] = self.value(value_node, (*path, key), depth + 1)
        out.update((k, v) for k, v in merged.items() if k not in out)
        return out

    def merge_sources(self, key: yaml.Node, value: yaml.Node, path: tuple) -> list[yaml.MappingNode]:
        items = value.value if isinstance(value, yaml.SequenceNode) else [value]
        if all(isinstance(i, yaml.MappingNode) and i.tag == _CORE + "map" for i in items):
            return items
        self.issue(key, path, "`<<` merges a mapping (an alias like *base) or a list of them")
        return []


def _bad_yaml(exc: yaml.YAMLError, text: str) -> tuple[int, str]:
    if isinstance(exc, yaml.reader.ReaderError):
        line = text.count("\n", 0, max(exc.position, 0)) + 1
        char = exc.character if isinstance(exc.character, int) else ord(exc.character[:1] or "\0")
        return line, f"character U+{char:04X} is not allowed in YAML"
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context, first = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if isinstance(exc, yaml.composer.ComposerError) and context and first:  # e.g. a duplicate anchor
        problem = f"{context} at line {first.line + 1}, {problem}"
    return (mark.line + 1 if mark else 0), problem


def parse_yaml(text: str, *, file: str) -> tuple[Any, dict[tuple, int]]:
    """Parse YAML text; return the data and a map from field path (tuple) to 1-based line."""
    if len(text) > MAX_SPEC_BYTES:
        message = f"too large ({len(text)} characters, over {MAX_SPEC_BYTES}; a spec is a few KB)"
        raise SpecError([SpecIssue(file, 0, "", message)])
    try:
        loader = _SpecLoader(text)  # the reader checks the characters already
        try:
            node = loader.get_single_node()
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        line, problem = _bad_yaml(exc, text)
        raise SpecError([SpecIssue(file, line, "", f"bad YAML: {problem}")]) from None
    if node is None:
        raise SpecError([SpecIssue(file, 1, "", "empty file: expected a YAML mapping")])
    reader = _Reader(file, loader.nodes + MAX_ALIAS_NODES)
    data = reader.value(node, (), 0)
    if reader.issues:
        raise SpecError(reader.issues)
    return data, reader.lines


def _dotted(path: Iterable[Any]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _line_for(loc: tuple, lines: dict[tuple, int]) -> int:
    loc = tuple(loc)
    while loc:
        if loc in lines:
            return lines[loc]
        loc = loc[:-1]
    return lines.get((), 1)


def validation_issues(exc: ValidationError, *, file: str, lines: dict[tuple, int]) -> list[SpecIssue]:
    """Turn a pydantic ``ValidationError`` into located issues, one per error."""
    issues = []
    for err in exc.errors(include_url=False):
        # pydantic puts union member names into loc; keep only the parts that exist in the data,
        # plus the final key of a missing field so the path says what is missing.
        loc = tuple(err["loc"])
        clean: list[Any] = []
        for i, part in enumerate(loc):
            if (*clean, part) in lines or (i == len(loc) - 1 and err["type"] == "missing"):
                clean.append(part)
        msg = err["msg"]
        if err["type"] == "value_error":  # our validators' own messages, without pydantic's prefix
            msg = msg.removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field (not allowed here)"
        elif err["type"] == "missing":
            msg = "missing required field"
        elif (
            "input" in err
            and err["type"] not in ("value_error", "assertion_error")
            and not isinstance(err["input"], (dict, list))
        ):
            msg = f"{msg} (got {err['input']!r})"
        issues.append(SpecIssue(file, _line_for(tuple(clean), lines), _dotted(clean), msg))
    return issues


def read_spec_text(path: str | Path) -> str:
    """A spec file's text, read no further than ``MAX_SPEC_BYTES`` (raises ``SpecError``)."""
    path = Path(path)
    if not path.is_file():
        raise SpecError([SpecIssue(str(path), 0, "", "file not found")])
    with open(path, "rb") as fh:
        data = fh.read(MAX_SPEC_BYTES + 1)  # bounded: the size on disk may lie (a growing or /proc file)
    if len(data) > MAX_SPEC_BYTES:
        message = f"too large (over {MAX_SPEC_BYTES} bytes; a spec is a few KB)"
        raise SpecError([SpecIssue(str(path), 0, "", message)])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise SpecError([SpecIssue(str(path), line, "", f"not UTF-8 text ({exc.reason})")]) from None


def load_spec(path: str | Path, model: type[M], *, context: dict[str, Any] | None = None) -> M:
    """Read ``path`` and validate it as ``model``; raise ``SpecError`` with every problem found."""
    return validate_spec_text(read_spec_text(path), model, file=str(path), context=context)


def validate_spec_text(text: str, model: type[M], *, file: str, context: dict[str, Any] | None = None) -> M:
    """Validate YAML ``text`` as ``model`` (see ``load_spec``)."""
    data, lines = parse_yaml(text, file=file)
    if not isinstance(data, dict):
        raise SpecError(
            [SpecIssue(file, 1, "", f"expected a YAML mapping at the top level, got {type(data).__name__}")]
        )
    try:
        return model.model_validate(data, context=context)
    except ValidationError as exc:
        raise SpecError(validation_issues(exc, file=file, lines=lines)) from None


def content_hash(data: Any) -> str:
    """sha256 of the canonical JSON form of ``data`` (a spec's content address)."""
    if isinstance(data, BaseModel):
        data = data.model_dump(mode="json")
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def file_sha256(path: str | Path, *, chunk: int = 1 << 20) -> str:
    """sha256 of a file's bytes, streamed."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def weights_sha256(model_dir: str | Path) -> str:
    """sha256 of a saved model's weights: the file's for one ``model.safetensors``; for a sharded checkpoint
    (``model.safetensors.index.json``), of the index and each shard's sha256 in name order."""
    model_dir = Path(model_dir)
    single, index = model_dir / "model.safetensors", model_dir / "model.safetensors.index.json"
    if single.is_file():
        return file_sha256(single)
    if not index.is_file():
        raise SpecError(
            [
                f"{model_dir}: no model.safetensors or model.safetensors.index.json (weights must be safetensors)"
            ]
        )
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    missing = [name for name in shards if not (model_dir / name).is_file()]
    if missing:
        raise RatchetError(f"{model_dir}: shard(s) named by the index are missing: {', '.join(missing)}")
    digest = hashlib.sha256(f"index {file_sha256(index)}\n".encode())
    for name in shards:
        digest.update(f"{name} {file_sha256(model_dir / name)}\n".encode())
    return digest.hexdigest()
