"""Loading YAML specs into pydantic models, reporting every error at once with file:line and field path.

One YAML kind = one pydantic model (``extra="forbid"``). ``load_spec`` parses the file, keeps the
line of every node, validates, and on failure raises ``SpecError`` listing each problem as
``file:line: field.path: what is expected``.
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


def _node_to_python(node: yaml.Node, lines: dict[tuple, int], path: tuple) -> Any:
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = _resolve_scalar(key_node) if isinstance(key_node, yaml.ScalarNode) else str(key_node.value)
            if key in out:
                raise _DuplicateKey(key_node.start_mark.line + 1, path + (key,))
            lines[path + (key,)] = key_node.start_mark.line + 1
            out[key] = _node_to_python(value_node, lines, path + (key,))
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_node_to_python(item, lines, path + (i,)) for i, item in enumerate(node.value)]
    return _resolve_scalar(node)


def _resolve_scalar(node: yaml.Node) -> Any:
    # Let PyYAML's safe resolver decide the type (int, float, bool, null, str, ...).
    return yaml.safe_load(yaml.serialize(node)) if node.tag != "tag:yaml.org,2002:str" else node.value


class _DuplicateKey(Exception):
    def __init__(self, line: int, path: tuple):
        self.line, self.path = line, path


def parse_yaml(text: str, *, file: str) -> tuple[Any, dict[tuple, int]]:
    """Parse YAML text; return the data and a map from field path (tuple) to 1-based line."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark else 0
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError([SpecIssue(file, line, "", f"bad YAML: {problem}")]) from None
    if node is None:
        raise SpecError([SpecIssue(file, 1, "", "empty file: expected a YAML mapping")])
    lines: dict[tuple, int] = {}
    try:
        data = _node_to_python(node, lines, ())
    except _DuplicateKey as dup:
        raise SpecError([SpecIssue(file, dup.line, _dotted(dup.path), "duplicate key")]) from None
    return data, lines


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


def load_spec(path: str | Path, model: type[M], *, context: dict[str, Any] | None = None) -> M:
    """Read ``path`` and validate it as ``model``; raise ``SpecError`` with every problem found."""
    path = Path(path)
    if not path.is_file():
        raise SpecError([SpecIssue(str(path), 0, "", "file not found")])
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError([SpecIssue(str(path), 0, "", f"not UTF-8 text ({exc.reason})")]) from None
    return validate_spec_text(text, model, file=str(path), context=context)


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
