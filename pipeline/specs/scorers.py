"""Spec building blocks shared by every YAML kind, and the contract's scorer configurations.

``StrictModel`` (unknown fields are errors) and the annotated field types (``Name``, ``Version``,
``Regex``, ``JsonSchema``) are used by contracts, harnesses and model specs; they live here, below
``pipeline.specs.contract``, so the scorer implementations can import their configs without a cycle.
``pipeline.specs.contract`` re-exports all of them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from pipeline.experience.principals import LOOP

NAME_RE = r"^[A-Za-z][A-Za-z0-9_.-]*$"


def _version_str(value: Any) -> Any:
    # ``version: 1`` or ``version: 1.2`` in YAML is a number; a version is a label, keep it as text.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return value


def _check_regex(value: str) -> str:
    from pipeline.scoring.patterns import (  # lazy: import cycle via pipeline.scoring
        PatternError,
        compile_pattern,
    )

    try:  # RE2, the engine that runs it (``pipeline.scoring.patterns``): what it cannot run is refused here
        compile_pattern(value)
    except PatternError as exc:
        raise ValueError(str(exc)) from None
    return value


def _check_json_schema(value: dict[str, Any]) -> dict[str, Any]:
    import jsonschema

    from pipeline.scoring.patterns import check_schema  # lazy: import cycle via pipeline.scoring

    try:
        check_schema(jsonschema.validators.validator_for(value), value)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "<root>"
        raise ValueError(f"not a valid JSON Schema at {where}: {exc.message}") from None
    return value


Version = Annotated[str, BeforeValidator(_version_str), Field(min_length=1, max_length=100)]
Name = Annotated[str, Field(pattern=NAME_RE, max_length=100)]
Regex = Annotated[str, AfterValidator(_check_regex)]
JsonSchema = Annotated[dict[str, Any], AfterValidator(_check_json_schema)]


class StrictModel(BaseModel):
    """Base of every spec model: unknown fields are errors, values are re-validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# ---------------------------------------------------------------------------------------------- scorers
class ScorerBase(StrictModel):
    """Fields shared by every scorer."""

    name: Name | None = Field(
        default=None, description="Name of this scorer's value in results and the registry; default: `kind`."
    )
    weight: float = Field(
        default=1.0, ge=0.0, description="Weight of this scorer in the turn's weighted mean."
    )
    required: bool = Field(
        default=False,
        description="A gate: when this scorer applies and its value is below `pass_threshold`, the turn scores 0.",
    )
    pass_threshold: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="Values below this count as failures (for `required` gates and the failure counts).",
    )
    verifies: bool | None = Field(
        default=None,
        description="Whether this scorer's value verifies the turn's outcome (only turns that a verifying "
        "scorer checked are learned from, used as exemplars or as router data). Default: the kind decides "
        "per turn: exact_match (a reference answer), python_tests (tests ran), feedback (a user's rating) "
        "and judge (a verdict) verify whenever they apply, json_schema only with a schema, tool_call only "
        "against an expected call; length and regex grade form and never do. `false`: never; `true`: "
        "whenever it applies (e.g. a regex that pins the answer).",
    )
    scope: Literal["final", "each"] | None = Field(
        default=None,
        description="`final`: only the trace's last assistant turn; `each`: every assistant turn of the "
        "specialist. Default depends on the kind (outcome checks: final; style checks: each).",
    )
    trusted: list[str] | None = Field(
        default=None,
        description="Principals whose material this scorer may verify with: the rater of a `feedback` rating; "
        "for scorers that read the trace's metadata (`exact_match`, `json_schema` without an inline schema, "
        "`python_tests`, `tool_call`), the principal that certified it. Material of anyone else does not "
        "apply. null: every principal the operator granted the scope (`rate`, `certify`) and the operator's "
        "ingest. The loop's own practice (`ratchet`) is always trusted.",
    )

    @model_validator(mode="after")
    def _trusted_applies(self) -> ScorerBase:
        if self.trusted is not None and self.kind in ("length", "regex", "judge"):  # type: ignore[attr-defined]
            raise ValueError(f"`trusted` does not apply to {self.kind}: it reads no principal's material")  # type: ignore[attr-defined]
        return self

    def trusts(self, principal: str | None) -> bool:
        """Whether material from ``principal`` may verify under this scorer (None: nobody known)."""
        if principal == LOOP:
            return True
        if principal is None:
            return False
        return self.trusted is None or principal in self.trusted

    @property
    def key(self) -> str:
        """The scorer's result name."""
        return self.name or self.kind  # type: ignore[attr-defined]

    def verifies_outcome(self, value: float | None, verified: bool) -> bool:
        """Whether an outcome of this scorer (its value, and what the kind said) verifies the turn."""
        if value is None or self.verifies is False:
            return False
        return True if self.verifies else verified

    @property
    def effective_scope(self) -> str:
        """``scope`` or the kind's default."""
        return self.scope or DEFAULT_SCOPE[self.kind]  # type: ignore[attr-defined]


class ExactMatchScorer(ScorerBase):
    """The assistant's answer equals the expected text after normalisation."""

    kind: Literal["exact_match"] = Field(description="Compare the answer to an expected text.")
    field: str = Field(
        default="expected", description="Metadata key holding the expected answer (or a list of them)."
    )
    case_sensitive: bool = Field(default=False, description="Compare letter case.")
    strip: bool = Field(default=True, description="Ignore leading/trailing whitespace.")
    collapse_whitespace: bool = Field(default=True, description="Treat runs of whitespace as one space.")
    strip_punctuation: bool = Field(
        default=False, description="Drop trailing `.`, `!`, `?` and surrounding quotes."
    )
    numeric: bool = Field(
        default=True, description="When both sides parse as numbers, compare numerically (`4.0` equals `4`)."
    )
    contains: bool = Field(
        default=False, description="Pass when the expected text occurs anywhere in the answer."
    )


class RegexScorer(ScorerBase):
    """The assistant's content matches (or must not match) a regular expression."""

    kind: Literal["regex"] = Field(description="Search the answer with a regular expression.")
    pattern: Regex = Field(
        description="Regular expression searched in the assistant content, in RE2 syntax (linear time: no "
        "look-around or back-references)."
    )
    flags: list[Literal["IGNORECASE", "MULTILINE", "DOTALL"]] = Field(
        default_factory=list, description="Flags (RE2's inline (?i), (?m), (?s))."
    )
    full_match: bool = Field(
        default=False, description="Require the whole content to match instead of a search."
    )
    negate: bool = Field(
        default=False, description="Pass when the pattern does NOT match (a forbidden pattern)."
    )


class JsonSchemaScorer(ScorerBase):
    """The assistant content is JSON (optionally inside a ```json fence) valid against a JSON Schema."""

    kind: Literal["json_schema"] = Field(description="Parse the answer as JSON and validate it.")
    json_schema: JsonSchema | None = Field(
        default=None,
        alias="schema",
        description="Inline JSON Schema; when absent, `metadata.<schema_field>` of the trace is used.",
    )
    schema_field: str = Field(
        default="schema", description="Metadata key holding the schema when none is inline."
    )
    partial_credit: bool = Field(
        default=False,
        description="Parsed-but-invalid JSON scores 0.5 instead of 0 (a softer training signal).",
    )
    # Dumped (and hashed) as `schema`, the name users write; `json_schema` avoids shadowing BaseModel.schema.
    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
    )


class PythonTestsScorer(ScorerBase):
    """Runs the model's Python code against `metadata.tests` in the sandbox (`RATCHET_SANDBOX`)."""

    kind: Literal["python_tests"] = Field(description="Execute the answer's code against tests.")
    tests_field: str = Field(
        default="tests",
        description="Metadata key holding the tests: Python test code (assertions; each `test*` function "
        "is one test), or a list of `{stdin, stdout}` cases (the code runs as a program per case).",
    )
    io_match: Literal["lines", "exact", "tokens"] = Field(
        default="lines",
        description="How an I/O case's output is compared: `lines` (trailing spaces and empty lines "
        "ignored), `exact`, or `tokens` (whitespace-separated).",
    )
    timeout_s: float = Field(default=5.0, gt=0, le=600, description="Wall-clock limit of one run (seconds).")
    memory_mb: int = Field(default=256, ge=32, le=65536, description="Address-space limit of the run (MiB).")
    partial_credit: bool = Field(
        default=True,
        description="Value = fraction of `test_*` functions passed; false: 1 only when all pass.",
    )


class ToolCallScorer(ScorerBase):
    """The assistant's tool call names a harness tool with arguments valid against its JSON Schema."""

    kind: Literal["tool_call"] = Field(description="Validate the assistant's tool call(s).")
    expected_field: str = Field(
        default="expected_call", description="Metadata key of `{name, arguments}` the call should match."
    )
    match_expected: bool = Field(
        default=True, description="When the metadata has an expected call, require a match."
    )
    require_call: bool = Field(
        default=True,
        description="A trace whose specialist never calls a tool scores 0 on its final turn "
        "(when false: not applicable).",
    )
    accept_content_json: bool = Field(
        default=True,
        description='Also accept a call written as JSON content `{"name": ..., "arguments": {...}}`.',
    )
    accept_content_compact: bool = Field(
        default=True,
        description="Also accept content that is only compact calls `name(key=value,...)`, one per line "
        "(the `compact` tool-call format; digit-only values are integers).",
    )


class LengthScorer(ScorerBase):
    """A soft penalty for answers outside a length range."""

    kind: Literal["length"] = Field(description="Penalise too short / too long answers.")
    min_chars: int = Field(default=0, ge=0, description="Shorter answers are penalised.")
    max_chars: int | None = Field(
        default=None, ge=1, description="Longer answers are penalised; null: no maximum."
    )
    softness: float = Field(
        default=0.5,
        gt=0,
        description="How fast the value falls outside the range: 1 at the bound, 0 at a relative "
        "distance of `softness` (0.5 = half the bound away).",
    )

    @model_validator(mode="after")
    def _range(self) -> LengthScorer:
        if self.max_chars is not None and self.max_chars < self.min_chars:
            raise ValueError(f"max_chars ({self.max_chars}) is below min_chars ({self.min_chars})")
        return self


class FeedbackScorer(ScorerBase):
    """The user's rating normalised to 0..1; not applicable when the trace has no feedback."""

    kind: Literal["feedback"] = Field(description="Use the user's rating.")
    min_rating: float = Field(default=0.0, description="Rating that maps to 0.")
    max_rating: float = Field(default=1.0, description="Rating that maps to 1.")

    @model_validator(mode="after")
    def _range(self) -> FeedbackScorer:
        if self.max_rating <= self.min_rating:
            raise ValueError(f"max_rating ({self.max_rating}) must exceed min_rating ({self.min_rating})")
        return self


class JudgeScorer(ScorerBase):
    """An LLM judge behind an OpenAI-compatible endpoint grades the answer against a rubric."""

    kind: Literal["judge"] = Field(description="Ask a judge model to grade the answer.")
    base_url: str = Field(description="OpenAI-compatible API root, e.g. `http://localhost:8000/v1`.")
    model: str = Field(description="Model name sent to the endpoint.")
    model_version: str = Field(
        min_length=1,
        description="Which weights serve `model` (a snapshot date, a hash): part of the contract version, so "
        "a judge that changed makes a new contract version and earlier verdicts stay comparable.",
    )
    rubric: str = Field(min_length=1, description="What a good answer is; the judge replies with a grade.")
    max_grade: float = Field(
        default=10.0, gt=0, description="The judge grades 0..max_grade; value = grade / max."
    )
    api_key_env: str | None = Field(
        default=None, description="Environment variable holding the API key, if any."
    )
    timeout_s: float = Field(default=30.0, gt=0, description="HTTP timeout (seconds).")
    max_tokens: int = Field(
        default=128,
        ge=1,
        le=4096,
        description="Most tokens the judge may answer with (sent as `max_tokens`): its reply must be only a "
        'number or `{"grade": N}`, optionally with a short `"reason"` (300 characters in all); the default '
        "fits that whole. A reply cut short is not a grade.",
    )


ScorerConfig = Annotated[
    ExactMatchScorer
    | RegexScorer
    | JsonSchemaScorer
    | PythonTestsScorer
    | ToolCallScorer
    | LengthScorer
    | FeedbackScorer
    | JudgeScorer,
    Field(discriminator="kind"),
]
SCORER_KINDS = (
    "exact_match",
    "regex",
    "json_schema",
    "python_tests",
    "tool_call",
    "length",
    "feedback",
    "judge",
)
DEFAULT_SCOPE = {
    "exact_match": "final",
    "regex": "each",
    "json_schema": "final",
    "python_tests": "final",
    "tool_call": "each",
    "length": "each",
    "feedback": "final",
    "judge": "final",
}


def _known_kind(value: Any) -> Any:
    # Give the unknown-kind error ourselves: one line listing the known kinds.
    if isinstance(value, dict) and "kind" in value and value["kind"] not in SCORER_KINDS:
        raise ValueError(f"unknown scorer kind {value['kind']!r}; known kinds: {', '.join(SCORER_KINDS)}")
    if isinstance(value, dict) and "kind" not in value:
        raise ValueError(f"missing `kind`; known kinds: {', '.join(SCORER_KINDS)}")
    return value


Scorer = Annotated[ScorerConfig, BeforeValidator(_known_kind)]
