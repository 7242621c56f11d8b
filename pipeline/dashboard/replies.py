"""The dashboard API's replies: what each ``/api/...`` route returns, field by field (its OpenAPI schema).

The data functions (``records``, ``comparison``, ``provenance``, ``experience``, ``trace``, ``actions``) build
these (``conversation`` builds its own, as ``evidence`` does); the pages render the same data (``model_dump``). What a trace or a stored document holds is untrusted
and of no fixed shape: it is ``JsonValue`` (any JSON), never ``Any``. A generation's evidence and the trends are
in ``evidence``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

__all__ = [
    "AbandonResult",
    "AdapterDetail",
    "ArtifactDirectory",
    "AuditPage",
    "ChampionMove",
    "GenerationUse",
    "HeldOutItem",
    "ItemComparison",
    "QuarantinePage",
    "Reply",
    "RescoreResult",
    "VersionDetail",
    "VersionDiff",
    "VersionList",
]

Kind = Literal["contracts", "harnesses"]
Change = Literal["newly solved", "newly failed", "better", "worse", "unchanged"]


class Reply(BaseModel):
    """A JSON response of the dashboard: exactly the fields it declares."""

    model_config = ConfigDict(extra="forbid")


class GenerationUse(Reply):
    lineage: str = Field(description="Lineage of the generation.")
    number: int = Field(description="Generation number within its lineage.")
    status: str = Field(description="The generation's status (promoted, retired, rejected, failed, ...).")


# ----------------------------------------------------------------------------------------------- records
class VersionRow(Reply):
    id: int = Field(description="Version id (registry row).")
    name: str = Field(description="The contract's or harness's name.")
    version: str = Field(description="Version under that name.")
    sha256: str = Field(description="Hash of the stored spec.")
    created_at: str = Field(description="When it was registered (ISO 8601).")
    parent_id: int | None = Field(
        default=None,
        description="The harness version it was derived from (co-design); always null for contracts.",
    )


class VersionList(Reply):
    kind: Kind = Field(description="Which records: contracts or harnesses.")
    versions: list[VersionRow] = Field(description="Every version, by name then id.")


class VersionDetail(Reply):
    kind: Kind = Field(description="Which records: contracts or harnesses.")
    id: int = Field(description="Version id.")
    name: str = Field(description="The contract's or harness's name.")
    version: str = Field(description="Version under that name.")
    sha256: str = Field(description="Hash of the stored spec.")
    created_at: str = Field(description="When it was registered (ISO 8601).")
    spec: dict[str, JsonValue] = Field(description="The stored spec as a document.")
    yaml: str = Field(description="The spec as YAML text.")
    used_by: list[GenerationUse] = Field(description="The generations built under this version.")


class VersionRef(Reply):
    id: int = Field(description="Version id.")
    name: str = Field(description="Name.")
    version: str = Field(description="Version under that name.")
    sha256: str = Field(description="Hash of the stored spec.")


class DiffRow(Reply):
    op: Literal["equal", "replace", "delete", "insert"] = Field(description="difflib's opcode of this row.")
    left_no: int | None = Field(description="Line number in version a (null: no line on that side).")
    left: str | None = Field(description="The line of version a.")
    right_no: int | None = Field(description="Line number in version b.")
    right: str | None = Field(description="The line of version b.")


class VersionDiff(Reply):
    kind: Kind = Field(description="Which records: contracts or harnesses.")
    a: VersionRef = Field(description="The left version.")
    b: VersionRef = Field(description="The right version.")
    rows: list[DiffRow] = Field(description="The two specs' YAML as aligned rows.")
    changed_lines: int = Field(description="Rows that are not equal.")


class QuarantineEntry(Reply):
    id: int = Field(description="Entry id (the next page's `before`).")
    source_file: str = Field(description="The file the line came from.")
    line: int = Field(description="Its line number.")
    reason: str = Field(description="Why it was refused.")
    raw: str = Field(description="The raw line (first 4000 characters), shown as text.")
    truncated: bool = Field(description="Whether `raw` was cut.")
    created_at: str = Field(description="When it was refused (ISO 8601).")


class QuarantinePage(Reply):
    entries: list[QuarantineEntry] = Field(description="Refused lines, newest first.")
    older: int | None = Field(description="`before` of the next (older) page; null on the last.")
    filters: dict[str, str] = Field(description="The filters in use (`source_file`).")


class AuditEntry(Reply):
    id: int = Field(description="Entry id (the next page's `before`).")
    at: str = Field(description="When (ISO 8601).")
    actor: str = Field(description="Who acted (`operator`, `dashboard:bearer`, `ratchet`, ...).")
    entity: str = Field(description="The kind of record changed.")
    entity_id: int | None = Field(description="Its id.")
    action: str = Field(description="What was done.")
    details: JsonValue = Field(description="The action's details as stored.")
    message: str | None = Field(description="A message, where one was written.")


class AuditPage(Reply):
    entries: list[AuditEntry] = Field(description="State changes, newest first.")
    older: int | None = Field(description="`before` of the next (older) page; null on the last.")
    filters: dict[str, str] = Field(description="The filters in use (entity, action, actor).")


# -------------------------------------------------------------------------------------------- comparison
class ItemRow(Reply):
    specialist: str = Field(description="The held-out suite's specialist.")
    position: int = Field(description="The item's position in the suite.")
    parent: float = Field(description="The parent's score on it.")
    candidate: float = Field(description="The candidate's score on it.")
    change: Change = Field(description="What changed from parent to candidate.")
    prompt: str = Field(description="The item's last user message (first 240 characters).")


class ItemFilters(Reply):
    specialist: str | None = Field(description="Only this specialist's items.")
    change: Change | None = Field(description="Only items with this change.")


class ItemComparison(Reply):
    lineage: str = Field(description="Lineage.")
    number: int = Field(description="The candidate generation's number.")
    parent: int | None = Field(description="Its parent's number.")
    solved_at: float = Field(
        description="The contract's `selection.min_score`: an item at or above it is solved."
    )
    counts: dict[str, dict[Change, int]] = Field(
        description="Per specialist, items per change (all, unfiltered)."
    )
    rows: list[ItemRow] = Field(description="The matching items of this page.")
    matching: int = Field(description="Items matching the filters.")
    offset: int = Field(description="This page's first row among the matching.")
    next_offset: int | None = Field(description="The next page's `offset`; null on the last.")
    filters: ItemFilters = Field(description="The filters in use.")


class HeldOutItem(Reply):
    lineage: str = Field(description="Lineage.")
    number: int = Field(description="The candidate generation's number.")
    parent: int | None = Field(description="Its parent's number.")
    specialist: str = Field(description="The suite's specialist.")
    position: int = Field(description="The item's position in the suite.")
    messages: JsonValue = Field(description="The item's conversation (chat messages).")
    parent_answer: JsonValue = Field(
        description="The parent's answer as stored (message, tool calls, score)."
    )
    candidate_answer: JsonValue = Field(description="The candidate's answer as stored.")
    parent_value: float = Field(description="The parent's score.")
    candidate_value: float = Field(description="The candidate's score.")


# -------------------------------------------------------------------------------------------- provenance
class DatasetRef(Reply):
    id: int = Field(description="Training dataset id.")
    sha256: str = Field(description="Hash of its rows.")
    rows: int = Field(description="Rows (training examples).")


class AdapterTrace(Reply):
    id: int = Field(description="Trace id.")
    source: str = Field(description="deployment, simulation, import, ...")
    specialist: str | None = Field(description="The specialist that served it.")
    principal: str | None = Field(description="Who sent it (null: served before principals were recorded).")
    created_at: str = Field(description="When it was recorded (ISO 8601).")


class AdapterDetail(Reply):
    id: int = Field(description="Adapter id.")
    lineage: str = Field(description="The lineage the page links into.")
    specialist: str = Field(description="The specialist it serves.")
    version: int = Field(description="Its version among the specialist's adapters.")
    rank: int = Field(description="LoRA rank.")
    alpha: float = Field(description="LoRA alpha.")
    target_modules: JsonValue = Field(description="The modules LoRA adapts, as stored.")
    sha256: str = Field(description="Hash of its weights.")
    method: str = Field(description="Training method (sft, dpo, grpo, ...).")
    metrics: dict[str, JsonValue] = Field(description="Training metrics as stored (without the loss curve).")
    loss_curve: JsonValue = Field(description="(step, loss or reward) pairs as stored.")
    mlflow_run_id: str | None = Field(description="Its MLflow run.")
    mlflow_model_version: str | None = Field(description="Its MLflow model version.")
    parent_adapter_id: int | None = Field(description="The adapter it was trained from.")
    artifact_path: str | None = Field(
        description="Its files, relative to the artifact store (null: elsewhere)."
    )
    created_at: str = Field(description="When it was registered (ISO 8601).")
    used_by: list[GenerationUse] = Field(description="The generations that use it.")
    dataset: DatasetRef | None = Field(description="The dataset it was trained on (null: trained online).")
    dataset_path: str | None = Field(description="The dataset's file, relative to the artifact store.")
    traces: list[AdapterTrace] = Field(description="Traces in its dataset, newest first (one page).")
    next_before: int | None = Field(description="`before` of the next page of traces; null on the last.")


# ----------------------------------------------------------------------------------------------- actions
class ChampionMove(Reply):
    champion: int = Field(description="The champion's generation number after the move.")
    lineage: str = Field(description="Lineage.")
    aliases: str | None = Field(
        default=None,
        description="Set when MLflow's champion aliases could not follow: what failed and how to repair it.",
    )


class AbandonResult(Reply):
    abandoned: int = Field(description="The abandoned candidate's generation number.")
    lineage: str = Field(description="Lineage.")
    status: str = Field(description="Its status now (failed).")
    reason: str = Field(description="The reason given.")


class RescoreResult(Reply):
    experience_id: int = Field(description="The re-scored trace.")
    contract_versions: list[int] = Field(description="The contract versions it was scored under.")


# --------------------------------------------------------------------------------------------- artifacts
class ArtifactEntry(Reply):
    name: str = Field(description="File or directory name.")
    path: str = Field(description="Its path in the artifact store.")
    dir: bool = Field(description="Whether it is a directory.")
    size: int | None = Field(description="Bytes (null for a directory).")


class ArtifactDirectory(Reply):
    path: str = Field(description="The directory requested.")
    entries: list[ArtifactEntry] = Field(
        description="Its entries (at most 500; links out of the store left out)."
    )


# -------------------------------------------------------------------------------------------- experience
Status = Literal["passed", "failed", "not verified", "not scored"]


class TraceRow(Reply):
    id: int = Field(description="Trace id.")
    created_at: str = Field(description="When it was recorded (ISO 8601).")
    source: str = Field(description="deployment, simulation, import, ...")
    specialist: str | None = Field(description="The specialist that served it.")
    principal: str | None = Field(description="Who sent it (null: served before principals were recorded).")
    generation: int | None = Field(description="The generation that served it (in this lineage).")
    prompt: str = Field(description="Its first user message (a preview).")
    answer: str = Field(description="Its last message, or last tool call (a preview).")
    score: float | None = Field(
        description="The final turn's score under the champion's contract: read `status`."
    )
    status: Status = Field(description="The final turn's verdict under the champion's contract.")
    verified: bool | None = Field(description="Whether it passed (null: not scored).")
    failed: list[str] = Field(description="The verifying checks that failed on the final turn.")
    feedback: bool = Field(description="Whether it has feedback.")
    feedback_counted: bool = Field(description="Whether its feedback has a counted rating or correction.")
    feedback_claimed: bool = Field(description="Whether its feedback has a claimed part (never scored).")
    conversation_id: str | None = Field(description="The conversation it is a turn of (null: none recorded).")


class ExperiencePage(Reply):
    lineage: str = Field(description="Lineage of the generations and the champion's contract.")
    filters: dict[str, str | int | float] = Field(description="The filters in use (no cursor).")
    traces: list[TraceRow] = Field(description="One page of traces, newest first.")
    older: int | None = Field(description="`before` of the next older page; null when none.")
    newer: int | None = Field(description="`after` of the next newer page; null when none.")
    searched_to: int | None = Field(
        description="Set when the page stopped early (its time budget spent): ids beyond it are not searched yet."
    )
    direction: Literal["older", "newer"] = Field(description="Which way this page walked.")
    scanned: bool = Field(
        description="Whether the filters needed a windowed scan (no single index serves them)."
    )
    contract_version_id: int | None = Field(
        description="The champion's contract version the verdicts are under."
    )
    newest_id: int | None = Field(description="The newest trace id (null: no traces).")


# ------------------------------------------------------------------------------------------------- trace
class ServedTokenCounts(Reply):
    tokenizer: str = Field(description="Fingerprint of the tokenizer that served it (as stored).")
    prompt_tokens: int = Field(description="Prompt token ids stored.")
    completion_tokens: int = Field(description="Completion token ids stored.")
    prompt_ids: list[int] | None = Field(description="The prompt's token ids (null unless `token_ids=true`).")
    completion_ids: list[int] | None = Field(
        description="The completion's token ids (null unless `token_ids=true`)."
    )


class OfferedTool(Reply):
    type: str = Field(description="The tool's type as the client sent it (`function`, ...).")
    name: str = Field(description="Its name (untrusted client text).")
    description: str = Field(description="Its description (untrusted client text).")
    parameters: JsonValue = Field(description="Its parameters' JSON schema as sent (null: none).")


class RouteDecision(Reply):
    turn: int = Field(description="The message index it routed.")
    specialist: str = Field(description="The specialist chosen.")
    reason: str = Field(description="Why.")
    scores: dict[str, dict[str, float | str]] = Field(description="Signal -> label -> score (text when odd).")


class Turn(Reply):
    index: int = Field(description="Message index in the trace.")
    role: str = Field(description="user, assistant, tool, system.")
    text: str = Field(description="Its text.")
    tool_calls: list[JsonValue] = Field(description="Its tool calls as stored.")
    tool_call_id: JsonValue = Field(description="The tool call a tool message answers.")
    route: RouteDecision | None = Field(description="The route decision of this turn, where served.")
    summary: str | None = Field(description="Its hidden summary, where one was written.")
    view: list[dict[str, JsonValue]] | str | None = Field(
        description="The messages the specialist answered from, rebuilt (text: why it cannot be); null when not shown."
    )
    tokens: ServedTokenCounts | None = Field(
        description="The token ids served for this assistant message, where stored: counts and tokenizer."
    )


class FeedbackEntry(Reply):
    field: str = Field(description="rating, correction, or another claimed field.")
    value: JsonValue = Field(description="Its value as sent.")
    by: str | None = Field(description="Who gave it, where named.")


class Verdict(Reply):
    status: Status = Field(description="The final turn's verdict.")
    verified: bool = Field(description="Whether it passed (the only verdict that may be learned from).")
    value: float | None = Field(description="The final turn's score.")
    failed: list[str] = Field(description="The verifying checks that failed.")
    verified_by: list[str] = Field(description="The verifying checks that applied.")
    turn: int | None = Field(description="The final assistant turn's message index.")
    total: float | None = Field(description="The mean over the scored turns (shown, never selected on).")
    legacy: bool = Field(
        description="Scored before final-turn rows were recorded (`ratchet score` redoes it)."
    )


class ChampionVerdict(Verdict):
    contract: str | None = Field(
        description="The champion's contract (`name version`); null without a champion."
    )


class ScoreLine(Reply):
    scorer: str = Field(description="The scorer (`final`, `total` or a contract scorer).")
    value: float | None = Field(description="Its score (null: none computed).")
    verified: bool | None = Field(description="Whether a verifying check applied.")
    details: JsonValue = Field(description="Its details as stored.")
    label: str = Field(description="What the row is.")
    check: str = Field(description="What it says of the final turn.")


class ScoreChange(Reply):
    scorer: str = Field(description="The scorer.")
    value: float | None = Field(description="The replaced score.")
    verified: bool | None = Field(description="Whether it was verified.")
    reason: str | None = Field(description="Why it was replaced.")
    superseded_at: str = Field(description="When (ISO 8601).")


class TrainedAdapter(Reply):
    lineage: str = Field(description="Lineage of the generation.")
    generation: int = Field(description="The generation whose dataset held the trace.")
    specialist: str = Field(description="The specialist trained.")
    adapter_id: int | None = Field(description="The adapter trained on it.")


class TraceDetail(Reply):
    id: int = Field(description="Trace id.")
    lineage: str = Field(description="The lineage whose champion's contract gives `verdict`.")
    source: str = Field(description="deployment, simulation, import, ...")
    specialist: str | None = Field(description="The specialist that served it.")
    generation: int | None = Field(description="The generation that served it.")
    generation_lineage: str | None = Field(description="That generation's lineage.")
    harness: str | None = Field(description="The harness that served it (`name version`).")
    created_at: str = Field(description="When it was recorded (ISO 8601).")
    completion_id: str | None = Field(description="The server's completion id.")
    principal: str | None = Field(description="Who sent it (null: served before principals were recorded).")
    principal_note: str = Field(description="What that principal is.")
    turns: list[Turn] = Field(description="This page's messages.")
    turn_count: int = Field(description="Messages in the trace.")
    turn_offset: int = Field(description="This page's first message.")
    next_turns: int | None = Field(description="`turns_from` of the next page; null on the last.")
    previous_turns: int | None = Field(description="`turns_from` of the previous page; null on the first.")
    metadata: dict[str, JsonValue] = Field(description="Its metadata (without summaries and claims).")
    claimed_metadata: JsonValue = Field(description="What its client sent without `certify`: never scored.")
    feedback: JsonValue = Field(description="Its feedback document as stored.")
    counted_feedback: list[FeedbackEntry] = Field(description="Feedback the contract's scorers read.")
    claimed_feedback: list[FeedbackEntry] = Field(description="Feedback kept as claimed: never read.")
    verdict: ChampionVerdict = Field(description="The final turn's verdict under the champion's contract.")
    finals: dict[str, Verdict] = Field(description="Its verdict under each contract version that scored it.")
    scores: dict[str, list[ScoreLine]] = Field(description="Contract version -> its score rows, labelled.")
    score_history: list[ScoreChange] = Field(description="Replaced scores, oldest first.")
    trained: list[TrainedAdapter] = Field(description="The adapters trained on it.")
    conversation_id: str | None = Field(description="The conversation it is a turn of (null: none recorded).")
    conversation_previous: int | None = Field(description="The conversation's turn before it (trace id).")
    conversation_next: int | None = Field(description="The conversation's turn after it (trace id).")
    tools: list[OfferedTool] | None = Field(
        description="The tools its client offered on the turn (null: none recorded; untrusted text)."
    )
