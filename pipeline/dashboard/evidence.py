"""Response models of a generation's evidence (``/api/generations/{number}``) and of the trends (``/api/trends``).

``lineage.generation_detail`` and ``lineage.trends`` compute the data; the routes validate it against these
models. The parts copied from a stored evaluation (the gates' tests, the router's accuracy) are the registry's
own models of those documents (``pipeline.registry.documents``), and discovery's counts are the lineage
summary's (``pipeline.registry.summaries``): one model for each shape.
"""

from __future__ import annotations

from pydantic import Field, JsonValue

from pipeline.dashboard.replies import Reply
from pipeline.registry.documents import GateTestRecord, RouterRecord
from pipeline.registry.summaries import DiscoverySummary

__all__ = ["GenerationDetail", "Trends"]


class VersionName(Reply):
    id: int = Field(description="Version id.")
    name: str = Field(description="Name.")
    version: str = Field(description="Version under that name.")


class DatasetSummary(Reply):
    id: int = Field(description="Training dataset id.")
    sha256: str = Field(description="Hash of its rows.")
    rows: int = Field(description="Rows (training examples).")


class AdapterSlot(Reply):
    specialist: str = Field(description="The specialist this slot serves.")
    adapter_id: int | None = Field(description="Its adapter (null: the base model).")
    version: int | None = Field(description="The adapter's version.")
    new: bool = Field(description="Whether this generation trained it.")
    ungated: bool = Field(
        description="Whether the contract says `ungated: true` (no held-out gate of its own)."
    )
    rank: int | None = Field(description="LoRA rank.")
    sha256: str | None = Field(description="Hash of its weights.")
    method: str | None = Field(description="Training method (sft, dpo, grpo, ...).")
    mlflow_run_id: str | None = Field(description="Its MLflow run.")
    mlflow_link: str | None = Field(description="The MLflow UI's page of that run (a tracking server only).")
    final_loss: float | None = Field(description="The last training loss.")
    final_reward: float | None = Field(description="The last mean reward (GRPO).")
    steps: int | None = Field(description="Training steps.")
    loss_curve: JsonValue = Field(description="(step, loss or reward) pairs as stored.")
    dataset: DatasetSummary | None = Field(
        description="Its training dataset (null: trained online, or none)."
    )


class SpecialistComparison(Reply):
    specialist: str = Field(description="The held-out suite's specialist.")
    n: int = Field(description="Items in the suite.")
    parent: float = Field(description="The parent's mean score.")
    candidate: float = Field(description="The candidate's mean score.")
    delta: float = Field(description="candidate - parent.")
    se: float = Field(description="Standard error of the paired delta.")
    interval: tuple[float, float] = Field(description="95% interval of the delta.")
    floor: float = Field(description="The one-sided lower bound the non-inferiority gate reads.")
    tolerance: float = Field(description="The regression the contract tolerates on this suite.")
    passes_tolerance: bool = Field(description="Whether the gate's non-inferiority test passed.")


class HeldOut(Reply):
    specialists: list[SpecialistComparison] = Field(description="Per specialist, candidate against parent.")
    overall: float | None = Field(description="The candidate's overall held-out score.")
    parent_overall: float | None = Field(description="The parent's.")
    delta: float | None = Field(description="The overall paired delta.")
    se: float | None = Field(description="Its standard error.")
    attempt: int | None = Field(description="Which attempt on these suites this evaluation was.")
    ungated: list[str] = Field(description="Specialists of this generation with no held-out gate.")


class GateVerdict(Reply):
    decision: str | None = Field(description="The decision as recorded.")
    promote: bool | None = Field(description="Whether the gate promoted.")
    rate: float | None = Field(description="The false-promotion rate spent.")
    lower: float | None = Field(description="The improvement's lower bound (older verdicts).")
    tests: list[GateTestRecord] = Field(description="The gates' tests, as judged.")
    min_improvement: float = Field(description="The contract's minimum improvement.")
    false_promotion_rate: float = Field(description="The contract's false-promotion rate.")
    reasons: list[str] = Field(description="The decision's reasons.")


class Curation(Reply):
    kept: dict[str, int] = Field(description="Rows kept per specialist.")
    dropped: dict[str, dict[str, int]] = Field(description="Specialist -> reason -> turns dropped.")
    reasons: list[str] = Field(description="Every drop reason.")
    dropped_by_principal: JsonValue = Field(
        description="Principal -> reason -> turns dropped (null: curated before principals were recorded)."
    )
    principal_reasons: list[str] = Field(description="Every drop reason by principal.")
    skipped: dict[str, JsonValue] = Field(description="Specialists whose dataset was skipped, and why.")


class GenerationDetail(Reply):
    lineage: str = Field(description="Lineage.")
    number: int = Field(description="Generation number.")
    status: str = Field(description="Its status.")
    step: str | None = Field(description="The step it is at or stopped at.")
    parent: int | None = Field(description="Its parent's number.")
    harness: VersionName = Field(description="Its harness version.")
    contract: VersionName = Field(description="Its contract version.")
    base_model: str = Field(description="The base model.")
    created_at: str = Field(description="When it was started (ISO 8601).")
    method: str = Field(description="How it was built, in a few words.")
    adapters: list[AdapterSlot] = Field(description="Its adapter per specialist.")
    heldout: HeldOut = Field(description="Held-out scores against the parent.")
    verdict: GateVerdict = Field(description="The promotion gate's verdict.")
    router: RouterRecord | None = Field(description="The candidate's router accuracy.")
    parent_router: RouterRecord | None = Field(description="The parent's router accuracy.")
    curation: Curation = Field(description="What curation kept and dropped.")
    collection: dict[str, JsonValue] = Field(description="The collection step's counts.")
    discovery: dict[str, DiscoverySummary] = Field(description="Per specialist, what discovery found.")


class TrendPoint(Reply):
    generation: int = Field(description="Generation number.")
    score: float = Field(description="Mean held-out score.")
    low: float = Field(description="95% interval, low end.")
    high: float = Field(description="95% interval, high end.")
    status: str = Field(description="The generation's status (`base`/`parent`: measured as a parent).")


class RouterPoint(Reply):
    generation: int = Field(description="Generation number.")
    accuracy: float = Field(description="Router accuracy on the routing suite.")
    status: str = Field(description="The generation's status.")


class Trends(Reply):
    lineage: str = Field(description="Lineage.")
    scores: dict[str, list[TrendPoint]] = Field(description="Held-out score per specialist over generations.")
    router: list[RouterPoint] = Field(description="Router accuracy over generations.")
    retention: dict[str, list[TrendPoint]] = Field(description="Retention suites' scores over generations.")
