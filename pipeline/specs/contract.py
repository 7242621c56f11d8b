"""The HCP (Harness Context Protocol) contract: the external, versioned definition of "better".

A contract says what a harness must provide (the context protocol), how each specialist's turns are
scored (scorers, weights, aggregation), which experience may become training data, when a successor
may replace its parent (promotion gates) and which held-out suites measure that. The loop never edits
a contract; a new version is a new file (and a new registry row).

``load_contract(path)`` validates a YAML file (every error at once, ``file:line: field: message``);
``verify_files(contract, contract_path)`` checks the files it names (held-out suites, task files) exist with
the declared sha256; ``file_reader`` reads them from there or, once registered, from the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from pipeline.errors import NotFoundError, RatchetError
from pipeline.registry import get_engine, load_stored_file, session_scope
from pipeline.specs.loading import content_hash, file_sha256, load_spec
from pipeline.specs.scorers import (  # noqa: F401 - re-exported: the contract's public vocabulary
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

ToolCallFormat = Literal["openai", "json", "compact"]
"""How a model writes tool calls (traces always store them in OpenAI's shape, whatever the format):

- ``openai``: the serving stack's native ``tool_calls`` (JSON-string arguments);
- ``json``: content that is a JSON object ``{"name": ..., "arguments": {...}}`` (or a list of them);
- ``compact``: content ``name(key=value,...)``, one call per line (``pipeline.environment.toolbox``):
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


class TaskSourceSpec(StrictModel):
    """Where a specialist's practice prompts come from (``pipeline.specs.tasksource``): a JSONL file of task items
    with its sha256, or a registered generator."""

    path: str | None = Field(
        default=None,
        description="JSONL file of task items (a conversation without its final assistant turn, plus the "
        "metadata the scorers read); relative to the contract file.",
    )
    sha256: Annotated[str | None, BeforeValidator(_quoted_hash)] = Field(
        default=None, pattern=r"^[0-9a-f]{64}$", description="sha256 (64 lowercase hex digits) of the file."
    )
    generator: Name | None = Field(
        default=None,
        description="A registered task source: `demo` (built in) or one of the entry-point group `ratchet.tasks`.",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword options passed to the generator (e.g. `family` for `demo`).",
    )
    validation_share: float = Field(
        default=0.1,
        gt=0.0,
        lt=1.0,
        description="Share of a task file's items (chosen by a hash of each prompt) kept for co-design's "
        "validation and never practised on. Generators have their own validation split.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> TaskSourceSpec:
        by_file = self.path is not None or self.sha256 is not None
        if by_file == (self.generator is not None):
            raise ValueError("give either `path` + `sha256` or `generator`")
        if by_file and (self.path is None or self.sha256 is None):
            raise ValueError("a task file needs both `path` and `sha256`")
        if by_file and self.options:
            raise ValueError("`options` are for a generator; a task file takes none")
        return self


class SpecialistScoring(StrictModel):
    """One specialist: its scorers and how they combine into a turn score."""

    description: str = Field(default="", description="What this specialist is for.")
    tasks: TaskSourceSpec | None = Field(
        default=None,
        description="Where its practice prompts come from; null: it learns only from deployment and "
        "ingested experience (validated on a fixed slice of it kept out of training).",
    )
    required_slots: list[Name] = Field(
        default_factory=list, description="Extra prompt slots this specialist's system prompt must fill."
    )
    scorers: list[Scorer] = Field(min_length=1, description="Scorers applied to this specialist's turns.")
    aggregate: Literal["weighted_mean", "min"] = Field(
        default="weighted_mean",
        description="Turn score: weighted mean of the applicable scorer values, or their minimum (strict).",
    )
    ungated: bool = Field(
        default=False,
        description="True: this specialist has no held-out suite and is trained and promoted with no gate of "
        "its own (only the other specialists' suites judge a candidate). A specialist without a held-out suite "
        "must say so; the dashboard shows it as ungated.",
    )

    @model_validator(mode="after")
    def _scorers(self) -> SpecialistScoring:
        keys = [s.key for s in self.scorers]
        dupes = sorted({k for k in keys if keys.count(k) > 1})
        if dupes:
            raise ValueError(f"scorer names must be unique; repeated: {', '.join(dupes)} (set `name:`)")
        for reserved in ("total", "final"):
            if reserved in keys:
                raise ValueError(
                    f"`{reserved}` is reserved for the trace's {reserved} score; rename that scorer"
                )
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
        default=None,
        ge=1,
        description="Cap per specialist (highest scores kept, the newest among equal scores); null: no cap.",
    )
    max_examples: dict[str, int] = Field(
        default_factory=dict, description="Per-specialist caps overriding the above."
    )
    use_corrections: bool = Field(
        default=True, description="Turn a user's `feedback.correction` into a training example for that turn."
    )
    validation_share: float = Field(
        default=0.1,
        gt=0.0,
        lt=1.0,
        description="For a specialist without `tasks`: the share of its verified experience (chosen by a "
        "hash of each prompt, the same slice every generation) that co-design validates harness variants "
        "on and that is never trained on.",
    )
    min_preference_margin: float = Field(
        default=0.3,
        gt=0.0,
        le=1.0,
        description="For `method: dpo`: a preference pair needs its preferred reply to score at least this much "
        "above the other (both verified, same prompt); an accepted user correction always beats the reply "
        "it corrects.",
    )
    max_share_per_principal: float = Field(
        default=0.25,
        gt=0.0,
        le=1.0,
        description="No single outside principal (an API key, `anonymous`, the principal an import was "
        "ingested as) may fill more than this share of a specialist's dataset; its lowest-ranked rows are "
        "dropped (`over principal share`). The loop's own practice (`ratchet`) and the operator's own "
        "ingest (`operator`) are not outside principals. 1.0: no cap.",
    )
    trusted_corrections: list[str] | None = Field(
        default=None,
        description="Principals whose corrections may be learned (when the contract's scorers verify them); "
        "null: every principal the operator granted the `correct` scope, and the operator's ingest.",
    )
    sources: list[Literal["deployment", "simulation", "import"]] | None = Field(
        default=None,
        description="Only experience from these sources (`deployment`: served traffic, `simulation`: the "
        "task environment, `import`: ingested files); null: all. `evaluation` traces are never selected.",
    )


class PromotionGates(StrictModel):
    """When a candidate generation may replace its parent (compared on the held-out suites, in one run).

    The improvement test is one-sided on the paired per-item differences (the overall delta is the mean of
    the specialists' mean differences), an exact sign-flip permutation test (``pipeline.gates.inference``). Its
    error rate is spent per held-out suite over every test that ever used it (the registry's spending
    ledger, whatever the champion, lineage or contract version): the ``j``-th test on a suite is made at
    ``false_promotion_rate * 6 / (pi**2 * j**2)``, which sums to ``false_promotion_rate``, so a candidate
    no better than its parent is promoted with at most that probability over everything that reuses the
    suite (the bound does not need the attempts to be independent). Non-inferiority (per specialist, and
    per retention suite) is spent the same way at its own rate."""

    min_improvement: float = Field(
        default=0.0,
        ge=0.0,
        description="The candidate's overall held-out mean must exceed the parent's by more than this (delta).",
    )
    false_promotion_rate: float = Field(
        default=0.05,
        gt=0.0,
        lt=0.5,
        description="Bound on the chance that any promotion judged on a held-out suite is of a candidate no "
        "better than its parent, over every test that ever used that suite (alpha spent per suite).",
    )
    max_regression: float = Field(
        default=0.02, ge=0.0, description="Largest allowed drop of any specialist's mean score."
    )
    max_regression_per_specialist: dict[str, float] = Field(
        default_factory=dict, description="Per-specialist tolerances overriding `max_regression`."
    )
    regression_error_rate: float = Field(
        default=0.05,
        gt=0.0,
        lt=0.5,
        description="Bound on the chance that a specialist truly worse than its parent by more than its "
        "tolerance ever passes the regression rule (a one-sided non-inferiority test, spent over every test "
        "on its suite like `false_promotion_rate`).",
    )
    min_heldout_samples: int = Field(default=20, ge=2, description="Minimum held-out items per specialist.")
    max_kl_to_base: float | None = Field(
        default=None,
        gt=0.0,
        description="Largest mean per-token KL divergence (nats) of a candidate specialist from the base model "
        "on its held-out prompts; a candidate above it is not promoted (null: measured and recorded only).",
    )
    max_unscored_share: float = Field(
        default=0.02,
        ge=0.0,
        lt=1.0,
        description="Evaluation scores both pairs item by item; an item a scorer could not score on either pair "
        "(a judge unreachable, a grade missing) is left out of the comparison and counted. More than this share "
        "of all held-out items left out fails the evaluation step.",
    )

    def tolerance(self, specialist: str) -> float:
        """The regression tolerance of ``specialist``."""
        return self.max_regression_per_specialist.get(specialist, self.max_regression)

    def attempt_rate(self, attempt: int, sample: int | None = None) -> float:
        """The error rate the improvement test may use at attempt ``attempt`` on its held-out suites (the
        spending ledger's count): ``false_promotion_rate * 6 / (pi**2 * attempt**2)``. On the ``sample``-th
        fresh sample of suites that draw one per champion (``fresh: true``), that times ``6 / (pi**2 *
        sample**2)``: the shares sum to ``false_promotion_rate`` over every attempt on every sample, so fresh
        samples keep the lineage-wide bound (they restore the power attempts on one sample use up, not the
        budget)."""
        import math

        share = 6 / math.pi**2
        rate = self.false_promotion_rate * share / max(1, attempt) ** 2
        return rate if sample is None else rate * share / max(1, sample) ** 2


class Decontamination(StrictModel):
    """How a text is found to contain a held-out item (the check LLM evaluations use to decontaminate)."""

    ngram: int = Field(
        default=8,
        ge=2,
        le=64,
        description="Word n-gram size. Texts are compared as words and punctuation after Unicode NFKC "
        "normalisation and case folding, whatever the whitespace or content-part layout.",
    )
    threshold: float = Field(
        default=0.5,
        gt=0.0,
        le=1.0,
        description="A text contains a held-out prompt when at least this share of the prompt's n-grams "
        "occur in it; a prompt shorter than `ngram` words (but of 3 or more) must occur in it whole, and a "
        "shorter one must be a whole message. Lower is stricter (more is excluded).",
    )


class RoutingSuite(StrictModel):
    """Labelled requests that measure the router: written differently from the harness's signal patterns."""

    prompts: dict[Name, list[Annotated[str, Field(min_length=1)]]] = Field(
        min_length=1,
        description="Per specialist, user requests it should serve (paraphrases, other wording, mixed "
        "requests). Held out: never trained on, never an exemplar.",
    )
    max_accuracy_drop: float = Field(
        default=0.05,
        ge=0.0,
        le=1.0,
        description="A candidate whose router accuracy on this suite is lower than its parent's by more than "
        "this is not promoted.",
    )


class HeldoutSuite(StrictModel):
    """One specialist's held-out suite: a JSONL file with its sha256, or a deterministic generator."""

    specialist: Name = Field(description="The specialist this suite evaluates.")
    path: str | None = Field(default=None, description="JSONL file of traces; relative to the contract file.")
    sha256: Annotated[str | None, BeforeValidator(_quoted_hash)] = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="sha256 (64 lowercase hex digits) of the JSONL file.",
    )
    generator: Name | None = Field(
        default=None,
        description="A registered task source (`demo`, or an entry point of `ratchet.tasks`): its `heldout` split.",
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword options passed to the generator."
    )
    seed: int | None = Field(default=None, description="Generator seed (the suite is a pure function of it).")
    size: int | None = Field(default=None, ge=1, description="Number of generated items.")
    fresh: bool = Field(
        default=False,
        description="Generated suites only: draw a fresh sample for each champion (the seed is combined with "
        "the champion's generation number, and each sample is its own suite in the spending ledger), which "
        "restores the gate's power after promotions. The generator must have a canonical form, so that the "
        "exclusion predicate covers every sample it could draw.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> HeldoutSuite:
        check_one_source(self)
        if self.fresh and self.generator is None:
            raise ValueError("`fresh` draws a new sample of a generated suite; a file suite cannot")
        return self


def check_one_source(suite: HeldoutSuite | RetentionSuite) -> None:
    """A suite is a file (``path`` + ``sha256``) or a generator (``generator`` + ``seed`` + ``size``)."""
    by_file = suite.path is not None or suite.sha256 is not None
    by_gen = suite.generator is not None or suite.seed is not None or suite.size is not None
    if by_file == by_gen:
        raise ValueError("give either `path` + `sha256` or `generator` + `seed` + `size`")
    if by_file and (suite.path is None or suite.sha256 is None):
        raise ValueError("a file suite needs both `path` and `sha256`")
    if by_gen and (suite.generator is None or suite.seed is None or suite.size is None):
        raise ValueError("a generated suite needs `generator`, `seed` and `size`")


class RetentionSuite(StrictModel):
    """A capability the lineage must keep: items a specialist answers, evaluated for champion and candidate
    every generation and gated by non-inferiority (held out like the held-out suites: never trained on)."""

    name: Name = Field(description="The suite's name (unique among the contract's retention suites).")
    specialist: Name = Field(description="The specialist that answers the items.")
    scored_as: Name | None = Field(
        default=None,
        description="Whose scorers score the answers (a declared specialist); null: `specialist`'s own.",
    )
    path: str | None = Field(default=None, description="JSONL file of traces; relative to the contract file.")
    sha256: Annotated[str | None, BeforeValidator(_quoted_hash)] = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="sha256 (64 lowercase hex digits) of the JSONL file.",
    )
    generator: Name | None = Field(
        default=None,
        description="A registered task source (`demo`, or an entry point of `ratchet.tasks`): its `heldout` split.",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword options passed to the generator (e.g. `family` for `demo`).",
    )
    seed: int | None = Field(default=None, description="Generator seed (the suite is a pure function of it).")
    size: int | None = Field(default=None, ge=1, description="Number of generated items.")
    max_regression: float = Field(
        default=0.05,
        ge=0.0,
        description="Largest allowed drop of the suite's mean score from the champion's to the candidate's.",
    )
    error_rate: float = Field(
        default=0.05,
        gt=0.0,
        lt=0.5,
        description="Bound on the chance that a candidate truly worse than the champion on this suite by more "
        "than `max_regression` is ever promoted (a non-inferiority test spent over every test on the suite).",
    )

    @model_validator(mode="after")
    def _one_source(self) -> RetentionSuite:
        check_one_source(self)
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
    retention: list[RetentionSuite] = Field(
        default_factory=list,
        description="Capabilities the lineage must keep (gated by non-inferiority every generation). The suites "
        "of a contract version the lineage adopted before are added to these automatically.",
    )
    decontamination: Decontamination = Field(
        default_factory=Decontamination,
        description="How experience is found to contain a held-out item (it is then never learned from).",
    )
    routing: RoutingSuite | None = Field(
        default=None, description="The labelled routing suite the router is measured and gated on."
    )

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
        for i, r in enumerate(self.retention):
            problems += [
                f"retention[{i}].{key} {name!r} is not a declared specialist"
                for key, name in (("specialist", r.specialist), ("scored_as", r.scored_as))
                if name is not None and name not in self.specialists
            ]
        names = [r.name for r in self.retention]
        problems += [
            f"retention: the name {n!r} is used twice" for n in sorted(set(names)) if names.count(n) > 1
        ]
        problems += [
            f"specialists.{n}: `ungated: true` but a held-out suite judges it; remove one of the two"
            for n, spec in self.specialists.items()
            if spec.ungated and any(h.specialist == n for h in self.heldout)
        ]
        if self.routing is not None:
            problems += [
                f"routing.prompts: {n!r} is not a declared specialist"
                for n in self.routing.prompts
                if n not in self.specialists
            ]
        if problems:
            raise ValueError("; ".join(problems) + f" (declared: {', '.join(known)})")
        return self

    def ungated_problems(self) -> list[str]:
        """One line per specialist that no held-out suite judges and that does not say ``ungated: true`` (a
        contract a lineage is started on or adopts must have none; scoring alone does not need suites)."""
        suited = {h.specialist for h in self.heldout}
        return [
            f"specialists.{n}: no held-out suite judges it: add one under `heldout`, or say `ungated: true` "
            "(it is then trained and promoted with no gate of its own)"
            for n, spec in self.specialists.items()
            if n not in suited and not spec.ungated
        ]

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


def declared_files(contract: ContractSpec) -> list[tuple[str, str, str]]:
    """``(where, path, sha256)`` of every file the contract names: held-out suites, retention suites, then task
    files."""
    out = [
        (f"heldout[{i}] ({suite.specialist})", suite.path, suite.sha256)
        for i, suite in enumerate(contract.heldout)
        if suite.path is not None and suite.sha256 is not None
    ]
    out += [
        (f"retention[{i}] ({suite.name})", suite.path, suite.sha256)
        for i, suite in enumerate(contract.retention)
        if suite.path is not None and suite.sha256 is not None
    ]
    out += [
        (f"specialists.{name}.tasks", entry.tasks.path, entry.tasks.sha256)
        for name, entry in contract.specialists.items()
        if entry.tasks is not None and entry.tasks.path is not None and entry.tasks.sha256 is not None
    ]
    return out


def verify_files(contract: ContractSpec, contract_path: str | Path) -> dict[str, Path]:
    """Check every file the contract names exists and has its declared sha256; return ``{sha256: path}``.

    Generated suites and task generators are not checked here (they produce items on demand).
    Raises ``NotFoundError`` / ``RatchetError`` naming the first bad file.
    """
    base = Path(contract_path).resolve().parent
    out = {}
    for where, name, digest in declared_files(contract):
        path = Path(name)
        path = path if path.is_absolute() else base / path
        if not path.is_file():
            raise NotFoundError(f"{contract_path}: {where}: file {path} not found")
        actual = file_sha256(path)
        if actual != digest:
            raise RatchetError(
                f"{contract_path}: {where}: sha256 of {path} is {actual}, the contract declares {digest}"
            )
        out[digest] = path
    return out


def file_reader(contract: ContractSpec, contract_path: str | Path | None = None) -> Callable[[str], str]:
    """``read(sha256) -> text`` of the contract's files: from beside ``contract_path`` (checked first), or
    without one from the registry, which stored them whole at registration."""
    if contract_path is not None:
        paths = verify_files(contract, contract_path)
        return lambda digest: paths[digest].read_text(encoding="utf-8")

    def stored(digest: str) -> str:

        with session_scope(get_engine()) as session:
            return load_stored_file(session=session, sha256=digest).decode("utf-8")

    return stored


# Promotion settings of the first contract schema, replaced by the attempt-aware test; a stored contract
# that has them still reads (they are dropped: the gate they configured no longer exists).
LEGACY_PROMOTION_KEYS = ("require_significant", "confidence", "bootstrap_samples", "seed")


def stored_contract(spec: dict[str, Any]) -> ContractSpec:
    """A contract as the registry stores it (its validated JSON), read back."""
    promotion = spec.get("promotion")
    if isinstance(promotion, dict) and any(k in promotion for k in LEGACY_PROMOTION_KEYS):
        spec = {**spec, "promotion": {k: v for k, v in promotion.items() if k not in LEGACY_PROMOTION_KEYS}}
    return ContractSpec.model_validate(spec)
