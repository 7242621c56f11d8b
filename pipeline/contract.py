"""The HCP (Harness Context Protocol) contract: the external, versioned definition of "better".

A contract says what a harness must provide (the context protocol), how each specialist's turns are
scored (scorers, weights, aggregation), which experience may become training data, when a successor
may replace its parent (promotion gates) and which held-out suites measure that. The loop never edits
a contract; a new version is a new file (and a new registry row).

``load_contract(path)`` validates a YAML file (every error at once, ``file:line: field: message``);
``verify_suites(contract, contract_path)`` checks the held-out files exist with the declared sha256.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from pipeline.errors import NotFoundError, RatchetError
from pipeline.scorers.config import (  # noqa: F401 - re-exported: the contract's public vocabulary
    DEFAULT_SCOPE,
    NAME_RE,
    SCORER_KINDS,
    ExactMatchScorer,
    FeedbackScorer,
    JsonSchema,
    JsonSchemaScorer,
    JudgeScorer,
    LengthScorer,
    Name,
    PythonTestsScorer,
    Regex,
    RegexScorer,
    Scorer,
    ScorerBase,
    ScorerConfig,
    StrictModel,
    ToolCallScorer,
    Version,
)
from pipeline.spec import content_hash, file_sha256, load_spec

ToolCallFormat = Literal["openai", "json", "compact"]
"""How a model writes tool calls (traces always store them in OpenAI's shape, whatever the format):

- ``openai``: the serving stack's native ``tool_calls`` (JSON-string arguments);
- ``json``: content that is a JSON object ``{"name": ..., "arguments": {...}}`` (or a list of them);
- ``compact``: content ``name(key=value,...)``, one call per line (``pipeline.environment.toolcalls``):
  arguments in the tool schema's order, digit-only values are integers, anything else a string, values
  never contain ``,`` ``=`` ``(`` ``)``. Built for tiny models that cannot write JSON reliably.
"""


def _quoted_hash(value: Any) -> Any:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        raise ValueError("YAML read the hash as a number; put it in quotes")
    return value


# --------------------------------------------------------------------------------------------- protocol
class ContextBudget(StrictModel):
    """How much context a harness may use."""

    max_tokens: int = Field(ge=1, description="Upper bound of the harness's context window (tokens).")
    chars_per_token: float = Field(
        default=4.0,
        gt=0,
        description="Estimate used to turn characters into tokens (1.0 for a char vocabulary).",
    )
    max_system_chars: int | None = Field(
        default=None,
        ge=1,
        description="Upper bound of one rendered system prompt plus exemplars (characters).",
    )


class ContextProtocol(StrictModel):
    """What every harness must provide to be served under this contract."""

    roles: list[Literal["system", "user", "assistant", "tool", "developer"]] = Field(
        default_factory=lambda: ["system", "user", "assistant", "tool"],
        description="Message roles a harness may use (in prompts and exemplars).",
    )
    required_slots: list[Name] = Field(
        default_factory=list, description="Prompt slots every specialist's system prompt must fill."
    )
    tool_call_format: ToolCallFormat = Field(
        default="openai",
        description="How the model writes tool calls: `openai`: `tool_calls` with JSON-string arguments; "
        "`json`: a `{name, arguments}` JSON content; `compact`: `name(key=value,...)` text, one call per "
        "line. Traces store every format as OpenAI `tool_calls`.",
    )
    context_budget: ContextBudget = Field(description="Context size limits.")


class SpecialistScoring(StrictModel):
    """One specialist: its scorers and how they combine into a turn score."""

    description: str = Field(default="", description="What this specialist is for.")
    required_slots: list[Name] = Field(
        default_factory=list, description="Extra prompt slots this specialist's system prompt must fill."
    )
    scorers: list[Scorer] = Field(min_length=1, description="Scorers applied to this specialist's turns.")
    aggregate: Literal["weighted_mean", "min"] = Field(
        default="weighted_mean",
        description="Turn score: weighted mean of the applicable scorer values, or their minimum (strict).",
    )

    @model_validator(mode="after")
    def _scorers(self) -> SpecialistScoring:
        keys = [s.key for s in self.scorers]
        dupes = sorted({k for k in keys if keys.count(k) > 1})
        if dupes:
            raise ValueError(f"scorer names must be unique; repeated: {', '.join(dupes)} (set `name:`)")
        if "total" in keys:
            raise ValueError("`total` is reserved for the trace total; rename that scorer")
        if not any(s.weight > 0 or s.required for s in self.scorers):
            raise ValueError(
                "every scorer has weight 0 and none is required: the turn score would be undefined"
            )
        return self


class SelectionRules(StrictModel):
    """Which scored experience becomes training data (used by curation)."""

    min_score: float = Field(default=0.8, ge=0.0, le=1.0, description="Minimum trace total to be selected.")
    dedup: Literal["none", "prompt", "content"] = Field(
        default="prompt",
        description="`prompt`: keep the best trace per prompt; `content`: drop exact duplicates only.",
    )
    max_examples_per_specialist: int | None = Field(
        default=None, ge=1, description="Cap per specialist (highest scores kept); null: no cap."
    )
    max_examples: dict[str, int] = Field(
        default_factory=dict, description="Per-specialist caps overriding the above."
    )
    use_corrections: bool = Field(
        default=True, description="Turn a user's `feedback.correction` into a training example for that turn."
    )
    sources: list[Literal["deployment", "simulation", "import"]] | None = Field(
        default=None,
        description="Only experience from these sources (`deployment`: served traffic, `simulation`: the "
        "task environment, `import`: ingested files); null: all. `evaluation` traces are never selected.",
    )


class PromotionGates(StrictModel):
    """When a candidate generation may replace its parent (compared on the held-out suites)."""

    min_improvement: float = Field(
        default=0.0,
        description="The candidate's overall held-out mean must exceed the parent's by at least this (delta).",
    )
    require_significant: bool = Field(
        default=True,
        description="Also require the lower end of the delta's bootstrap interval (at `confidence`) to be above 0.",
    )
    max_regression: float = Field(
        default=0.02, ge=0.0, description="Largest allowed drop of any specialist's mean score."
    )
    max_regression_per_specialist: dict[str, float] = Field(
        default_factory=dict, description="Per-specialist tolerances overriding `max_regression`."
    )
    min_heldout_samples: int = Field(default=20, ge=1, description="Minimum held-out items per specialist.")
    confidence: float = Field(
        default=0.95, gt=0.5, lt=1.0, description="Confidence level of the bootstrap interval."
    )
    bootstrap_samples: int = Field(default=1000, ge=100, description="Bootstrap resamples for the interval.")
    seed: int = Field(default=0, description="Seed of the bootstrap resampling (reproducible decisions).")

    def tolerance(self, specialist: str) -> float:
        """The regression tolerance of ``specialist``."""
        return self.max_regression_per_specialist.get(specialist, self.max_regression)


class HeldoutSuite(StrictModel):
    """One specialist's held-out suite: a JSONL file with its sha256, or a deterministic generator."""

    specialist: Name = Field(description="The specialist this suite evaluates.")
    path: str | None = Field(default=None, description="JSONL file of traces; relative to the contract file.")
    sha256: Annotated[str | None, BeforeValidator(_quoted_hash)] = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="sha256 (64 lowercase hex digits) of the JSONL file.",
    )
    generator: Name | None = Field(default=None, description="Name of a registered task environment.")
    seed: int | None = Field(default=None, description="Generator seed (the suite is a pure function of it).")
    size: int | None = Field(default=None, ge=1, description="Number of generated items.")

    @model_validator(mode="after")
    def _one_source(self) -> HeldoutSuite:
        by_file = self.path is not None or self.sha256 is not None
        by_gen = self.generator is not None or self.seed is not None or self.size is not None
        if by_file == by_gen:
            raise ValueError("give either `path` + `sha256` or `generator` + `seed` + `size`")
        if by_file and (self.path is None or self.sha256 is None):
            raise ValueError("a file suite needs both `path` and `sha256`")
        if by_gen and (self.generator is None or self.seed is None or self.size is None):
            raise ValueError("a generated suite needs `generator`, `seed` and `size`")
        return self


class ContractSpec(StrictModel):
    """An HCP contract (one YAML file under ``contracts/``)."""

    name: Name = Field(description="Contract name (a lineage is tied to one name).")
    version: Version = Field(description="Version label; a changed contract gets a new version.")
    description: str = Field(default="", description="What this contract optimises for.")
    protocol: ContextProtocol = Field(description="The context protocol a harness must satisfy.")
    default_specialist: Name = Field(description="Specialist assumed for traces that name none.")
    specialists: dict[Name, SpecialistScoring] = Field(
        min_length=1, description="Scored specialists and their scorers."
    )
    selection: SelectionRules = Field(default_factory=SelectionRules, description="Training-data selection.")
    promotion: PromotionGates = Field(default_factory=PromotionGates, description="Promotion gates.")
    heldout: list[HeldoutSuite] = Field(default_factory=list, description="Held-out evaluation suites.")

    @model_validator(mode="after")
    def _names(self) -> ContractSpec:
        known = sorted(self.specialists)
        problems = []
        if self.default_specialist not in self.specialists:
            problems.append(f"default_specialist {self.default_specialist!r} is not a declared specialist")
        for where, names in (
            ("selection.max_examples", self.selection.max_examples),
            ("promotion.max_regression_per_specialist", self.promotion.max_regression_per_specialist),
        ):
            problems += [
                f"{where}: {n!r} is not a declared specialist" for n in names if n not in self.specialists
            ]
        problems += [
            f"heldout[{i}].specialist {s.specialist!r} is not a declared specialist"
            for i, s in enumerate(self.heldout)
            if s.specialist not in self.specialists
        ]
        if problems:
            raise ValueError("; ".join(problems) + f" (declared: {', '.join(known)})")
        return self

    def scorers_for(self, specialist: str) -> list[Any]:
        """The scorer configs of ``specialist`` (the default specialist's when it is not declared)."""
        entry = self.specialists.get(specialist) or self.specialists[self.default_specialist]
        return list(entry.scorers)

    def required_slots_for(self, specialist: str) -> list[str]:
        """Global plus per-specialist required slots."""
        extra = self.specialists[specialist].required_slots if specialist in self.specialists else []
        return list(dict.fromkeys([*self.protocol.required_slots, *extra]))


def load_contract(path: str | Path) -> ContractSpec:
    """Load and validate a contract YAML file (raises ``SpecError`` listing every problem)."""
    return load_spec(path, ContractSpec)


def contract_hash(spec: ContractSpec) -> str:
    """The contract's content address (sha256 of its canonical JSON)."""
    return content_hash(spec)


def verify_suites(contract: ContractSpec, contract_path: str | Path) -> list[Path]:
    """Check every file suite exists and has its declared sha256; return their resolved paths.

    Generated suites are not checked here (they are produced on demand by their environment).
    Raises ``NotFoundError`` / ``RatchetError`` naming the first bad suite.
    """
    base = Path(contract_path).resolve().parent
    out = []
    for i, suite in enumerate(contract.heldout):
        if suite.path is None:
            continue
        path = Path(suite.path)
        path = path if path.is_absolute() else base / path
        if not path.is_file():
            raise NotFoundError(
                f"{contract_path}: heldout[{i}] ({suite.specialist}): suite file {path} not found"
            )
        actual = file_sha256(path)
        if actual != suite.sha256:
            raise RatchetError(
                f"{contract_path}: heldout[{i}] ({suite.specialist}): sha256 of {path} is {actual}, "
                f"the contract declares {suite.sha256}"
            )
        out.append(path)
    return out


def stored_contract(spec: dict[str, Any]) -> ContractSpec:
    """A contract as the registry stores it (its validated JSON), read back."""
    return ContractSpec.model_validate(spec)
