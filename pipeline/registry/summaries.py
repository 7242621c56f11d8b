"""A lineage as its readers see it: one model, ``LineageSummary``, behind both ``ratchet lineage --json`` and the
dashboard's ``/api/lineage`` (same keys, same values for the same registry). Built by
``pipeline.dashboard.lineage.lineage_summary`` from the generations' stored documents
(``pipeline.registry.documents``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from pipeline.registry.documents import DivergenceRecord


class Summary(BaseModel):
    """A response document: exactly its keys."""

    model_config = ConfigDict(extra="forbid")


class CurationSummary(Summary):
    """What curation kept and left out for a generation."""

    kept: dict[str, int] = Field(default_factory=dict, description="Rows curated per specialist.")
    dropped: dict[str, dict[str, int]] = Field(
        default_factory=dict, description="Turns left out: specialist -> reason -> count."
    )
    dropped_by_principal: dict[str, dict[str, int]] = Field(
        default_factory=dict, description="Turns left out: principal -> reason -> count."
    )


class DiscoverySummary(Summary):
    """One specialist's discovery: variants tried and found, and how both pairs answer the found ones."""

    tried: int | None = Field(None, description="Variants tried.")
    found: int | None = Field(None, description="Variants found (solved in more than none, fewer than half).")
    champion: float | None = Field(
        None, description="The champion's mean score on the found variants (greedy)."
    )
    candidate: float | None = Field(
        None, description="The candidate's mean score on the found variants (greedy)."
    )


class GenerationSummary(Summary):
    """One generation of a lineage: versions, adapters, held-out scores, what was measured and decided."""

    number: int = Field(description="The generation's number in its lineage (0: the base).")
    parent: int | None = Field(description="The parent generation's number (None for generation 0).")
    status: str = Field(description="candidate, training, evaluating, promoted, rejected, failed or retired.")
    champion: bool = Field(description="Whether it is the lineage's champion (status promoted).")
    method: str = Field(
        description="How it was built: its new adapters' training methods, `+ harness` if co-designed."
    )
    harness: str = Field(description="Its harness, `name version`.")
    contract: str = Field(description="The contract version it is judged under, `name version`.")
    adapters: dict[str, str | None] = Field(
        description="Per specialist: its adapter version (`vN`), None if none."
    )
    methods: dict[str, str | None] = Field(description="Per specialist: its adapter's training method.")
    scores: dict[str, float | None] = Field(description="Held-out mean score per specialist.")
    overall: float | None = Field(description="Overall held-out score (mean of the specialists' means).")
    parent_overall: float | None = Field(description="The parent's overall score in the same evaluation.")
    router_accuracy: float | None = Field(description="Router accuracy on the contract's routing suite.")
    parent_router_accuracy: float | None = Field(
        description="The parent's router accuracy in the same evaluation."
    )
    attempt: int | None = Field(description="The improvement test's attempt number.")
    unscored: dict[str, int] = Field(
        description="Held-out items left out per specialist (unscored on a pair)."
    )
    accuracy: dict[str, float | None] = Field(
        description="The accuracy matrix's row: score per suite (`heldout:<s>`, `retention:<name>`)."
    )
    backward_transfer: dict[str, float] = Field(
        description="Per suite: score minus that of the earliest generation of its line measured on it."
    )
    divergence: dict[str, DivergenceRecord] = Field(
        description="Per specialist: KL to the base and to the parent."
    )
    curation: CurationSummary = Field(description="What curation kept and left out.")
    discovery: dict[str, DiscoverySummary] = Field(description="Per specialist: discovery's variants.")
    decision: str | None = Field(description="The decision, in words.")
    step: str | None = Field(description="The last advancement step done.")
    seconds: dict[str, float] = Field(description="Seconds each step took.")
    created_at: str = Field(description="When the generation was created (UTC, ISO 8601).")


class MatrixRow(Summary):
    """One measured generation's row of the accuracy matrix."""

    generation: int = Field(description="The generation's number.")
    status: str = Field(description="Its status.")
    champion: bool = Field(description="Whether it is the champion.")
    scores: list[float | None] = Field(
        description="Its score per suite, in `suites` order (None: not measured)."
    )
    transfer: list[float | None] = Field(description="Its backward transfer per suite, in `suites` order.")


class TransferCell(Summary):
    """The champion's backward transfer on one suite, and what it is measured against."""

    suite: str = Field(description="The suite.")
    first: int = Field(description="The earliest generation of the champion's line measured on it.")
    first_score: float | None = Field(description="That generation's score.")
    champion_score: float | None = Field(description="The champion's score.")
    transfer: float = Field(description="The difference (negative: forgotten).")


class MatrixView(Summary):
    """The accuracy matrix (``pipeline.gates.transfer``): every generation's score on every suite."""

    suites: list[str] = Field(description="Columns: held-out suites first, then retention suites.")
    retention: list[str] = Field(description="The retention suites among them.")
    rows: list[MatrixRow] = Field(description="One row per measured generation.")
    champion: int | None = Field(description="The champion's number.")
    transfer: list[TransferCell] = Field(description="The champion's backward transfer per suite.")
    definition: str = Field(description="What backward transfer means here.")


class LineageSummary(Summary):
    """A lineage: every generation, the accuracy matrix and the improvement at a glance."""

    lineage: str = Field(description="The lineage's name.")
    lineages: list[str] = Field(description="Every lineage in the registry.")
    generations: list[GenerationSummary] = Field(description="Its generations in number order.")
    matrix: MatrixView = Field(description="The accuracy matrix and the champion's backward transfer.")
    champion: int | None = Field(description="The champion's number (None: none).")
    first_overall: float | None = Field(description="Generation 0's overall held-out score.")
    champion_overall: float | None = Field(description="The champion's overall held-out score.")
    promotions: int = Field(description="Generations promoted (now champion or retired), generation 0 aside.")
    rejections: int = Field(description="Generations rejected.")
