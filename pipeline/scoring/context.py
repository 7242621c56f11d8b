"""What a scorer sees (``TurnContext``) and returns (``ScorerOutcome``), plus message helpers."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipeline.experience.texts import message_text
from pipeline.scoring.patterns import check_schema, safe_validator

__all__ = ["NOT_APPLICABLE", "ScorerOutcome", "TurnContext", "message_text"]

if TYPE_CHECKING:
    from pipeline.specs.harness import HarnessSpec


@dataclass(frozen=True)
class ScorerOutcome:
    """One scorer's verdict on one turn: ``value`` in 0..1, or None when the scorer does not apply.

    ``verified``: the value checked the outcome against something outside the model's answer (a reference
    answer, tests that ran, a schema, an expected call, a judge's verdict, a user's rating). A value that
    only grades form (a length, a parse without a schema, a call that fits some tool) is not verified.
    """

    value: float | None
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    verified: bool = False


NOT_APPLICABLE = ScorerOutcome(None)


@dataclass(frozen=True)
class TurnContext:
    """One assistant turn in its trace, with everything a scorer may look at."""

    messages: list[dict[str, Any]]
    index: int
    specialist: str
    metadata: dict[str, Any]
    feedback: Any = None
    harness: HarnessSpec | None = None
    is_final: bool = False
    specialist_called_tool: bool = False
    principal: str | None = None  # who certified the trace's metadata (``pipeline.experience.principals``)

    def certified(self, cfg: Any, key: str) -> Any:
        """``metadata[key]`` when the principal that certified it is one ``cfg`` trusts, else None."""
        return self.metadata.get(key) if cfg.trusts(self.principal) else None

    @property
    def message(self) -> dict[str, Any]:
        """The assistant message being scored."""
        return self.messages[self.index]

    @property
    def text(self) -> str:
        """The assistant message's text content ('' for a pure tool call)."""
        return message_text(self.message)

    @property
    def prompt(self) -> str:
        """The last user message before this turn."""
        for msg in reversed(self.messages[: self.index]):
            if msg.get("role") == "user":
                return message_text(msg)
        return ""


_TAG = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_+-"  # what a fence's tag is made of


def fenced_blocks(text: str, languages: tuple[str, ...] = ()) -> list[str]:
    """Bodies of the ``` fenced blocks in ``text`` (only those tagged with one of ``languages``, or untagged).

    A scan with ``str.find``, linear in the text (and, being Python, letting other threads run): the regular
    expression it replaces, with ``findall``, tried every ``` as an opening and read on to the end of the
    text from each, holding the GIL, so an answer or correction of many unclosed fences took minutes
    (issue 22)."""
    out, pos = [], 0
    while (start := text.find("```", pos)) >= 0:
        eol = text.find("\n", start + 3)
        end = text.find("```", eol + 1) if eol >= 0 else -1
        if end < 0:  # no later fence can be closed either
            break
        header = text[start + 3 : eol].lstrip(" \t")
        lang = header[: len(header) - len(header.lstrip(_TAG))]
        if not languages or not lang or lang.lower() in languages:
            out.append(text[eol + 1 : end])
        pos = end + 3
    return out


def parse_json_content(text: str) -> Any:
    """Parse a JSON answer, accepting a ```json fence around it. Raises ``ValueError``."""
    stripped = text.strip()
    try:
        return json.loads(stripped)
    except json.JSONDecodeError as first:
        blocks = fenced_blocks(stripped, ("json",))
        if blocks:
            return json.loads(blocks[0])
        raise ValueError(f"not JSON: {first.msg} at line {first.lineno} column {first.colno}") from None


_VALIDATORS: dict[str, Any] = {}


def schema_validator(schema: dict[str, Any]) -> Any:
    """A checked, compiled JSON Schema validator, built once per distinct schema (the meta-schema check and
    the validator's construction cost far more than validating a small document). Raises
    ``jsonschema.SchemaError`` for an invalid schema, and for a regular expression in it that RE2 cannot run
    (``pipeline.scoring.patterns``): such a schema verifies nothing."""
    import json

    import jsonschema

    key = json.dumps(schema, sort_keys=True, separators=(",", ":"))
    found = _VALIDATORS.get(key)
    if found is None:
        cls = jsonschema.validators.validator_for(schema)
        try:
            check_schema(cls, schema)
        except jsonschema.SchemaError as exc:
            found = exc
        else:
            found = safe_validator(cls)(schema)  # its regular expressions run on RE2 (``patterns``)
        if len(_VALIDATORS) >= 4096:
            _VALIDATORS.pop(next(iter(_VALIDATORS)))
        _VALIDATORS[key] = found
    if isinstance(found, Exception):
        raise found
    return found
