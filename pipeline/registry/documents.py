"""The JSON documents a generation keeps in the registry, as pydantic models: its ``state`` (what each step of its
advancement did) and its ``evaluation`` (the held-out comparison, the gates' verdict and what was measured beside
it), and an adapter's training ``metrics``; read and written only through these models (``state_of``,
``evaluation_of``, ``Document.read``; ``as_stored`` for the column). Of the other JSON columns, the specs have
models of their own (``pipeline.specs``) and traces are validated at ingest (``pipeline.experience.ingest``); a
score's ``details`` and an audit row's ``details`` are free-form records, not modelled here.

A document written by this version has exactly these keys (``extra="forbid"``: an unknown key is refused). One
written by an older version loads too: what it lacks takes the field's default (an evaluation stored before the
spending ledger has ``attempt`` but no ``attempts``; a comparison stored before the item-level differences has
no ``diffs``), and ``as_stored`` writes back only the keys a document holds, so reading and writing a stored
document changes nothing in it (``exclude_unset``).

What a lineage looks like to its readers (``ratchet lineage --json`` and the dashboard's ``/api/lineage``) is
one model, ``LineageSummary``, in ``pipeline.registry.summaries``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Self

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from pipeline.registry.models import Generation

Scores = dict[str, float | None]


class Document(BaseModel):
    """A stored JSON document: exactly its keys, written back as read."""

    model_config = ConfigDict(extra="forbid")

    @classmethod
    def read(cls, data: dict[str, Any] | None) -> Self:
        """The document stored as ``data`` (None or ``{}``: an empty one, every field at its default)."""
        return cls.model_validate(data or {})

    def as_stored(self) -> dict[str, Any]:
        """The document as the registry stores it: the keys it holds (read or set), as JSON data."""
        return self.model_dump(mode="json", exclude_unset=True)


# ------------------------------------------------------------------------------------------------ step outcomes
class StepOutcome(Document):
    """What one advancement step did (``pipeline.loop.candidate.mark_step``)."""

    skipped: str | None = Field(None, description="Why the step did nothing (switched off, built by hand).")


class DiscoveredSpecialist(Document):
    """Discovery's result for one specialist."""

    tried: int = Field(description="Variants of training prompts tried.")
    found: int = Field(description="Variants the champion solved in more than none and fewer than half.")
    held_out_left_out: int = Field(0, description="Variants the held-out predicate stopped.")
    path: str | None = Field(None, description="JSONL file of the found variants (when any were found).")
    sha256: str | None = Field(None, description="sha256 of that file's text, checked when it is read.")


class DiscoverOutcome(StepOutcome):
    """What the ``discover`` step did."""

    samples: int | None = Field(None, description="Samples drawn per variant.")
    specialists: dict[str, DiscoveredSpecialist] = Field(
        default_factory=dict, description="Per specialist with a task source: what discovery tried and found."
    )


class CollectOutcome(StepOutcome):
    """What the ``collect`` step did."""

    attempts: int = Field(0, description="Attempts answered by the champion (every sample of every prompt).")
    stored: int = Field(0, description="Attempts stored as experience (duplicates of stored traces are not).")
    prompts: int = Field(0, description="Prompts practised, over all specialists.")
    specialists: list[str] = Field(default_factory=list, description="Specialists that practised.")
    without_tasks: list[str] = Field(
        default_factory=list, description="Specialists of the lineage with no task source to practise on."
    )
    held_out_left_out: dict[str, int] = Field(
        default_factory=dict, description="Per specialist: drawn prompts the held-out predicate stopped."
    )
    discovered_variants: dict[str, int] = Field(
        default_factory=dict, description="Per specialist: discovered variants practised among the prompts."
    )


class ScoreOutcome(StepOutcome):
    """What the ``score`` step did."""

    scored: int = Field(0, description="Traces scored under the generation's contract version.")
    unverified: int = Field(0, description="Traces scored with no verifying check.")
    errors: int = Field(0, description="Traces a scorer failed on.")
    by_specialist: dict[str, int] = Field(default_factory=dict, description="Traces scored, per specialist.")


class CuratedDataset(Document):
    """The training data curation made (or did not make) for one specialist."""

    method: str | None = Field(
        None, description="Training method: `sft`, `dpo` or `grpo` (practises online)."
    )
    rows: int = Field(0, description="Rows (examples or pairs) in the dataset.")
    skipped: str | None = Field(None, description="Why no dataset was written, when none was.")
    sha256: str | None = Field(None, description="Content hash of the written dataset.")
    path: str | None = Field(None, description="Where the dataset was written (`datasets.save_to_disk`).")


class CurateOutcome(StepOutcome):
    """What the ``curate`` step did: the curation report."""

    datasets: dict[str, CuratedDataset] = Field(
        default_factory=dict, description="Per specialist: its dataset."
    )
    dropped: dict[str, dict[str, int]] = Field(
        default_factory=dict, description="Turns left out: specialist -> reason -> count."
    )
    dropped_by_principal: dict[str, dict[str, int]] | None = Field(
        None,
        description="Turns left out: principal -> reason -> count (None: curated before it was recorded).",
    )


class TrainedAdapter(Document):
    """One adapter the ``train`` step made."""

    adapter_id: int = Field(description="The adapter's registry id.")
    method: str = Field("sft", description="Training method: `sft`, `dpo` or `grpo`.")
    steps: int | None = Field(None, description="Optimizer steps taken.")
    loss: float | None = Field(None, description="Final training loss (sft, dpo).")
    reward: float | None = Field(None, description="Final mean reward (grpo).")
    resumed_from_step: int | None = Field(None, description="Checkpoint step the job resumed from, if any.")
    dropped: dict[str, int] = Field(
        default_factory=dict, description="Rows (examples, pairs, episodes) left out, by reason."
    )
    token_ids: dict[str, int] = Field(
        default_factory=dict,
        description="Examples (DPO: each side) by where their ids came from: `served` (the ids the server "
        "decoded), `re-rendered`, `re-rendered: <why>`.",
    )


class TrainOutcome(StepOutcome):
    """What the ``train`` step did."""

    adapters: dict[str, TrainedAdapter] = Field(default_factory=dict, description="Per specialist trained.")


class CodesignOutcome(Document):
    """What the ``codesign`` step did."""

    chosen: str | None = Field(
        None, description="The harness version chosen (the parent's when none was better)."
    )
    variants: dict[str, float] = Field(
        default_factory=dict, description="Validation score of each harness variant tried, by label."
    )
    operators: dict[str, str] = Field(
        default_factory=dict, description="The operator that made each variant."
    )
    refused: dict[str, str] = Field(
        default_factory=dict, description="Variants the model cannot use, with why (e.g. a template refusal)."
    )
    skipped: dict[str, int] | str = Field(
        default_factory=dict, description="Traces and items left out, by reason (or: why it did not run)."
    )


class EvaluateOutcome(StepOutcome):
    """What the ``evaluate`` step did (the evaluation itself is the generation's ``evaluation``)."""

    overall: float | None = Field(None, description="The candidate's overall held-out score.")
    parent_overall: float | None = Field(None, description="The champion's overall held-out score.")
    attempt: int | None = Field(None, description="The improvement test's attempt number.")


class DecideOutcome(Document):
    """What the ``decide`` step did."""

    status: str = Field(description="`promoted` or `rejected`.")


class Steps(Document):
    """The outcome of each advancement step done, by step (``pipeline.loop.candidate.STEPS``)."""

    discover: DiscoverOutcome | None = Field(None, description="Discovery's outcome.")
    collect: CollectOutcome | None = Field(None, description="Collection's outcome.")
    score: ScoreOutcome | None = Field(None, description="Scoring's outcome.")
    curate: CurateOutcome | None = Field(None, description="Curation's report.")
    train: TrainOutcome | None = Field(None, description="Training's outcome.")
    codesign: CodesignOutcome | None = Field(None, description="Co-design's outcome.")
    evaluate: EvaluateOutcome | None = Field(None, description="Evaluation's outcome.")
    decide: DecideOutcome | None = Field(None, description="The decision.")


class AdapterMetrics(Document):
    """An adapter's training metrics (the ``metrics`` of an ``adapters`` row, ``pipeline.training.step``)."""

    final_loss: float | None = Field(None, description="The last training loss (sft, dpo).")
    final_reward: float | None = Field(None, description="The last mean reward (grpo).")
    steps: int | None = Field(None, description="Optimizer steps taken.")
    tokens_per_s: float | None = Field(None, description="Training throughput.")
    loss_curve: list[tuple[int, float]] = Field(default_factory=list, description="(step, loss or reward).")
    mlflow_experiment_id: str | None = Field(None, description="The MLflow experiment of its run.")


class Crash(Document):
    """A run of the generation that stopped and was taken over."""

    owner: str | None = Field(None, description="The lease owner that stopped.")
    step: str | None = Field(None, description="The last step it had done.")
    why: str = Field(description="How it was seen to have stopped.")
    at: str = Field(description="When it was taken over (UTC).")


class GenerationState(Document):
    """A generation's ``state``: what its advancement did, step by step."""

    steps: Steps = Field(default_factory=Steps, description="Each done step's outcome.")
    config: dict[str, Any] | None = Field(
        None, description="The `AdvanceConfig` the candidate was begun with (its fields at the time)."
    )
    seconds: dict[str, float] = Field(default_factory=dict, description="Seconds each step took, by step.")
    trained: dict[str, TrainedAdapter] = Field(
        default_factory=dict,
        description="Adapters trained so far (kept as each finishes: a resumed step skips them).",
    )
    router_classifier: dict[str, Any] | None = Field(
        None, description="The learned router's classifier (`TokenClassifier.to_dict`), when fitted."
    )
    crashes: list[Crash] = Field(default_factory=list, description="Runs that stopped and were taken over.")


# -------------------------------------------------------------------------------------------------- evaluation
class SpecialistComparisonRecord(Document):
    """One specialist's paired held-out comparison (``pipeline.gates.inference.SpecialistComparison``)."""

    specialist: str = Field(description="The specialist.")
    n: int = Field(description="Items compared.")
    champion: float = Field(description="The champion's mean score.")
    candidate: float = Field(description="The candidate's mean score.")
    delta: float = Field(description="Mean paired difference (candidate - champion).")
    se: float = Field(description="Standard error of the mean difference.")
    diffs: list[float] = Field(
        default_factory=list, description="Item-level differences (older records: none)."
    )
    groups: list[str | None] | None = Field(None, description="Each item's group (None: its own unit).")


class ComparisonRecord(Document):
    """The paired comparison of champion and candidate (``pipeline.gates.inference.Comparison.to_dict``)."""

    specialists: dict[str, SpecialistComparisonRecord] = Field(description="Per specialist.")
    champion_overall: float = Field(description="The champion's overall score (mean of specialists' means).")
    candidate_overall: float = Field(description="The candidate's overall score.")
    delta: float = Field(description="Overall difference.")
    se: float = Field(description="Standard error of the overall difference.")
    df: float | None = Field(description="Welch-Satterthwaite degrees of freedom (None: infinite).")


class ItemScores(Document):
    """The item scores a comparison is made of, both sides, in item order."""

    parent: list[float] = Field(default_factory=list, description="The champion's score per compared item.")
    candidate: list[float] = Field(
        default_factory=list, description="The candidate's score per compared item."
    )
    groups: list[str | None] | None = Field(
        None, description="`metadata.group` of each item, when any has one."
    )


class RetentionRecord(ItemScores):
    """One retention suite's paired scores (``pipeline.gates.retention.evaluate_suite``)."""

    specialist: str = Field(description="The specialist that answers the suite.")
    scored_as: str | None = Field(None, description="Whose scorers apply (the specialist's when None).")
    max_regression: float | None = Field(None, description="The loss the suite tolerates.")
    error_rate: float | None = Field(None, description="The suite's non-inferiority error rate.")
    sha256: str | None = Field(None, description="The suite's content hash, as the spending ledger knows it.")
    unscored: int | None = Field(None, description="Items unscored on either side (left out of both).")


class Attempts(Document):
    """The attempt number of each test, from the registry's spending ledger."""

    improvement: int | None = Field(None, description="The improvement test's attempt on its suites.")
    improvement_sample: int | None = Field(
        None, description="Which sample of a fresh suite's family this is."
    )
    noninferiority: dict[str, int] = Field(default_factory=dict, description="Per specialist: its attempt.")
    retention: dict[str, int] = Field(default_factory=dict, description="Per retention suite: its attempt.")


class DivergenceRecord(Document):
    """One specialist's mean per-token KL divergence (``pipeline.gates.divergence``)."""

    kl_to_base: float | None = Field(None, description="KL to the base model (nats/token).")
    kl_to_parent: float | None = Field(None, description="KL to the parent pair (nats/token).")
    tokens: int | None = Field(None, description="Tokens measured.")
    items: int | None = Field(None, description="Answers measured.")
    seconds: float | None = Field(None, description="Seconds the measurement took.")


class DiscoveryScores(Document):
    """How both pairs answer the variants discovery found (greedy, a report, never a gate)."""

    variants: int = Field(description="Variants answered.")
    champion: float | None = Field(None, description="The champion's mean score on them.")
    candidate: float | None = Field(None, description="The candidate's mean score on them.")


class RouterRecord(Document):
    """The router's accuracy on the contract's routing suite (``pipeline.serving.routereval.measure_router``)."""

    accuracy: float | None = Field(None, description="Share of turns routed to their labelled specialist.")
    total: int = Field(0, description="Turns in the suite.")
    correct: int = Field(0, description="Turns routed right.")
    per_label: dict[str, float | None] = Field(default_factory=dict, description="Accuracy per label.")
    confusion: dict[str, dict[str, int]] = Field(
        default_factory=dict, description="label -> routed to -> turns."
    )
    by_method: dict[str, int] = Field(
        default_factory=dict, description="Turns decided by each routing method."
    )
    mode: str | None = Field(None, description="The harness's routing mode.")
    harness: str | None = Field(None, description="The harness's name.")
    harness_version: str | None = Field(None, description="The harness's version.")


class GateTestRecord(Document):
    """One test the gates made (``pipeline.loop.promotion._row``)."""

    test: str = Field(description="`improvement`, `noninferiority:<specialist>` or `retention:<suite>`.")
    p: float | None = Field(None, description="Its p-value.")
    method: str | None = Field(None, description="The test (sign flip, betting, ...).")
    units: int | None = Field(None, description="Units with a non-zero difference.")
    draws: int | None = Field(None, description="Monte Carlo draws (0: exact).")
    mc_error: float | None = Field(None, description="Monte Carlo error of the p-value.")
    rate: float | None = Field(None, description="The error rate this attempt could spend.")
    attempt: int | None = Field(None, description="The attempt on its suite.")
    margin: float | None = Field(None, description="The margin tested against.")
    passed: bool | None = Field(None, description="Whether the test passed.")


class VerdictRecord(Document):
    """The gates' verdict (``pipeline.loop.promotion.Verdict.to_dict``)."""

    promote: bool = Field(description="Whether the gates promote the candidate.")
    rate: float = Field(description="The error rate the improvement test used at its attempt.")
    lower: float = Field(
        description="The overall delta's one-sided t lower bound at that rate (descriptive)."
    )
    p: float | None = Field(None, description="The improvement test's p-value.")
    tests: list[GateTestRecord] = Field(default_factory=list, description="Every test the gates made.")
    reasons: list[str] = Field(default_factory=list, description="The reasons of the decision.")


class VersionRef(Document):
    """A contract version, by id, name and version."""

    id: int = Field(description="Registry id.")
    name: str = Field(description="Contract name.")
    version: str = Field(description="Contract version.")


class Adoption(Document):
    """The champion re-evaluated under a new contract version (``pipeline.loop.adoption``)."""

    # ``from`` is a Python keyword: the field is ``from_``, stored as ``from``
    model_config = ConfigDict(
        extra="forbid", validate_by_name=True, validate_by_alias=True, serialize_by_alias=True
    )

    from_: VersionRef = Field(alias="from", description="The contract version adopted from.")
    to: VersionRef = Field(description="The contract version adopted.")
    file_sha256: str | None = Field(None, description="sha256 of the contract file given.")
    stored_sha256: str | None = Field(None, description="Content hash of the stored contract.")
    retention_added: list[str] = Field(default_factory=list, description="Retention suites carried over.")
    retention_released: list[str] = Field(default_factory=list, description="Retention suites released.")
    kept: list[str] = Field(
        default_factory=list, description="Held-out suites of the old version the new one keeps."
    )
    previous_scores: Scores = Field(default_factory=dict, description="Held-out scores before the adoption.")
    previous_overall: float | None = Field(None, description="Overall held-out score before the adoption.")
    at: str = Field(description="When (UTC, ISO 8601).")
    actor: str = Field(description="Who adopted.")
    reason: str | None = Field(None, description="Why.")
    retention: dict[str, float | None] = Field(
        default_factory=dict, description="The champion's mean per retention suite at the adoption."
    )
    unscored: dict[str, int] = Field(default_factory=dict, description="Items unscored at the adoption.")


class GenerationEvaluation(Document):
    """A generation's ``evaluation``: the candidate against its champion on the held-out suites, and what was
    measured beside it. Generation 0 holds only ``scores``, ``overall`` and ``router`` (from its first child's
    evaluation) and the contract ``adoptions`` of its lineage's champions."""

    scores: Scores = Field(default_factory=dict, description="The candidate's held-out mean per specialist.")
    overall: float | None = Field(None, description="The candidate's overall held-out score.")
    parent_scores: Scores = Field(
        default_factory=dict, description="The champion's held-out mean per specialist."
    )
    parent_overall: float | None = Field(None, description="The champion's overall held-out score.")
    comparison: ComparisonRecord | None = Field(
        None, description="The paired comparison (None: not evaluated)."
    )
    suites: dict[str, str] = Field(
        default_factory=dict, description="Each specialist's held-out suite sha256."
    )
    attempts: Attempts | None = Field(
        None, description="Each test's attempt (None: stored before the ledger)."
    )
    attempt: int | None = Field(None, description="The improvement test's attempt (what older readers read).")
    items: dict[str, ItemScores] = Field(
        default_factory=dict, description="Per specialist: compared item scores."
    )
    unscored: dict[str, int] = Field(
        default_factory=dict, description="Items unscored on either pair, per specialist."
    )
    unscored_errors: dict[str, str | None] = Field(
        default_factory=dict, description="The first unscored item's reason, per specialist."
    )
    discovery: dict[str, DiscoveryScores] = Field(
        default_factory=dict, description="Per specialist: both pairs on the variants discovery found."
    )
    router: RouterRecord | None = Field(None, description="The candidate's router on the routing suite.")
    parent_router: RouterRecord | None = Field(
        None, description="The champion's router on the routing suite."
    )
    retention: dict[str, RetentionRecord] = Field(default_factory=dict, description="Per retention suite.")
    divergence: dict[str, DivergenceRecord] = Field(default_factory=dict, description="KL per specialist.")
    verdict: VerdictRecord | None = Field(
        None, description="The gates' verdict (None: not decided by the gates)."
    )
    adoptions: list[Adoption] = Field(default_factory=list, description="Contract adoptions, oldest first.")

    def improvement_attempt(self) -> int:
        """The improvement test's attempt: the ledger's, else (stored before the ledger) ``attempt``, else 1."""
        if self.attempts is not None and self.attempts.improvement is not None:
            return int(self.attempts.improvement)
        return int(self.attempt if self.attempt is not None else 1)


def state_of(gen: Generation) -> GenerationState:
    """The generation's ``state`` document."""
    return GenerationState.read(gen.state)


def evaluation_of(gen: Generation) -> GenerationEvaluation:
    """The generation's ``evaluation`` document."""
    return GenerationEvaluation.read(gen.evaluation)


# ------------------------------------------------------------------------------------------------ served turns
class ServedTokens(Document):
    """The token ids of one assistant message the server decoded (``Experience.served_tokens``, by the message's
    index in ``messages``): training uses them instead of re-rendering the message when its tokenizer matches."""

    tokenizer: str = Field(description="The tokenizer's fingerprint (`templating.tokenizer_fingerprint`).")
    prompt_ids: list[int] = Field(
        description="Exactly the ids the model was given: the harness's view, rendered."
    )
    completion_ids: list[int] = Field(
        description="Exactly the ids it decoded, the end-of-turn token included when it stopped on one."
    )


def served_tokens_of(data: dict[str, Any] | None) -> dict[str, ServedTokens]:
    """An experience row's ``served_tokens`` column as models (None: no message was decoded by this server)."""
    return {index: ServedTokens.read(entry) for index, entry in (data or {}).items()}
