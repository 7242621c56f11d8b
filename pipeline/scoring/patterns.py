"""Regular expressions that come from a trace or a contract, run by RE2 (linear time), never by Python's ``re``.

A pattern is untrusted input: Python's backtracking ``re`` (and jsonschema, which uses it for ``pattern``,
``patternProperties`` and ``format: regex``) holds the GIL for as long as a match takes, so one pattern can stall
the server. Measured on this project's 2-core machine (issue 22): ``^(a+)+$`` against ``"a" * 24 + "b"``
takes ``re`` 1.3 s and doubles with each ``a`` (34: ~20 min); the ``regex`` package solves that one at once,
but ``^(a|aa)+$`` on 26 characters takes it 0.2 s, growing like Fibonacci (40: minutes), and its per-match
timeout bounds no schema that matches many strings; google-re2 (``import re2``) takes 0.2 ms on both at 34
characters and 3 ms on a 1 MB string. So RE2 it is: a pattern it cannot compile (look-around,
back-references, too large) is refused with the reason (``PatternError``, or ``jsonschema.SchemaError`` for a
schema), and is never run on ``re`` instead.

- ``compile_pattern(pattern, flags)``: the compiled RE2 pattern (cached), or ``PatternError``.
- ``safe_validator(cls)``: ``cls`` (a jsonschema validator class) with ``pattern``, ``patternProperties`` and
  ``additionalProperties`` matched by RE2.
- ``check_schema(cls, schema)``: ``cls.check_schema`` with ``format: regex`` checked by RE2, refusing what the
  safe validator cannot run (``unevaluatedProperties`` beside ``patternProperties``: jsonschema matches those
  with ``re`` internally).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from typing import Any

import jsonschema
import re2
from jsonschema.exceptions import ValidationError

FLAGS = {"IGNORECASE": "i", "MULTILINE": "m", "DOTALL": "s"}  # the contract's `flags` as RE2 inline flags
MAX_MEM = 1 << 20  # RE2's memory budget per pattern (program and DFA cache); a larger pattern is refused


class PatternError(ValueError):
    """A regular expression RE2 cannot run, with the reason."""


@functools.lru_cache(maxsize=256)
def _compiled(pattern: str, inline: str) -> Any:
    options = re2.Options()
    options.log_errors = False  # the reason goes into the PatternError, not to stderr
    options.max_mem = MAX_MEM
    try:
        return re2.compile(f"(?{inline}){pattern}" if inline else pattern, options)
    except re2.error as exc:
        reason = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else exc
        raise PatternError(
            f"invalid regular expression {pattern[:200]!r} for the safe engine (RE2): {reason}"
        ) from None


def compile_pattern(pattern: str, flags: Iterable[str] = ()) -> Any:
    """``pattern`` compiled by RE2 with ``flags`` (names of ``FLAGS``); ``PatternError`` when RE2 cannot
    compile it. The result has ``search``, ``match`` and ``fullmatch`` like a ``re.Pattern``."""
    return _compiled(pattern, "".join(sorted(FLAGS[f] for f in flags)))


def _is_regex(instance: object) -> bool:
    if isinstance(instance, str):
        compile_pattern(instance)
    return True


def _schema_compile(pattern: str) -> Any:
    try:
        return compile_pattern(pattern)
    except PatternError as exc:  # a schema of draft 3/4 (no `format: regex` on patternProperties' keys)
        raise jsonschema.SchemaError(str(exc)) from None


def _pattern(validator: Any, pattern: str, instance: Any, schema: dict) -> Iterator[ValidationError]:
    if validator.is_type(instance, "string") and not _schema_compile(pattern).search(instance):
        yield ValidationError(f"{instance[:200]!r} does not match {pattern!r}")


def _pattern_properties(validator: Any, patterns: dict, instance: Any, schema: dict) -> Iterator[Any]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        compiled = _schema_compile(pattern)
        for key, value in instance.items():
            if compiled.search(key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties(validator: Any, extra: Any, instance: Any, schema: dict) -> Iterator[Any]:
    """jsonschema's ``additionalProperties`` with the ``patternProperties`` matched by RE2."""
    if not validator.is_type(instance, "object"):
        return
    known = schema.get("properties", {})
    patterns = [_schema_compile(p) for p in schema.get("patternProperties", {})]
    extras = [k for k in instance if k not in known and not any(p.search(k) for p in patterns)]
    if validator.is_type(extra, "object"):
        for key in extras:
            yield from validator.descend(instance[key], extra, path=key)
    elif not extra and extras:
        shown = ", ".join(repr(k) for k in sorted(extras)[:20])
        yield ValidationError(f"Additional properties are not allowed ({shown} unexpected)")


@functools.cache
def safe_validator(cls: type) -> type:
    """``cls`` with every regular expression of the schema matched by RE2 (built once per class)."""
    return jsonschema.validators.extend(
        cls,
        validators={
            "pattern": _pattern,
            "patternProperties": _pattern_properties,
            "additionalProperties": _additional_properties,
        },
    )


def _keys(schema: Any) -> set[str]:
    """Every key of every object in ``schema`` (iteratively: a schema may be nested deep)."""
    keys: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            keys.update(k for k in node if isinstance(k, str))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return keys


def check_schema(cls: type, schema: Any) -> None:
    """``cls.check_schema(schema)`` with ``format: regex`` (every ``pattern`` and, from draft 6 on, every
    ``patternProperties`` key) compiled by RE2. Raises ``jsonschema.SchemaError``."""
    checker = jsonschema.FormatChecker(formats=())
    checker.checkers = {**cls.FORMAT_CHECKER.checkers}
    checker.checks("regex", raises=PatternError)(_is_regex)
    try:
        cls.check_schema(schema, format_checker=checker)
    except jsonschema.SchemaError as exc:
        if isinstance(exc.cause, PatternError):  # say why RE2 refused it, not only "is not a 'regex'"
            raise jsonschema.SchemaError(str(exc.cause)) from None
        raise
    if {"patternProperties", "unevaluatedProperties"} <= _keys(schema):
        raise jsonschema.SchemaError(
            "unevaluatedProperties beside patternProperties is not supported: jsonschema would match "
            "those patterns with Python's backtracking engine"
        )
