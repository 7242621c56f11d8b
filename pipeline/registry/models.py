"""The registry's tables as SQLAlchemy 2 typed models.

The schema is made only by Alembic migrations (``migrations/``); a drift test compares these
models with the migrations. JSON documents are stored as text (``JSONText``) so that SQLite and
PostgreSQL behave the same and bulk ingest can pass pre-serialised JSON.
"""

from __future__ import annotations

import enum
import json
import re
from datetime import UTC, datetime
from typing import Any

import orjson
from sqlalchemy import (
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

from pipeline.registry.locations import HomePath

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


def dump_json(value: Any) -> str:
    """The stored text of a JSON document: compact, keys sorted, non-ASCII kept as is. orjson (NaN and
    infinities become ``null``: JSON has none), or the standard encoder for what orjson refuses (integers
    beyond 64 bits; NaN is then written as Python writes it)."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS).decode()
    except orjson.JSONEncodeError:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def load_json(text: str) -> Any:
    """Parse a stored JSON document: orjson, several times faster, unless the text holds an integer of 19
    or more digits (orjson would round one beyond 64 bits to a float) or something orjson refuses but Python
    wrote (NaN); those go to the standard parser, which is exact."""
    if _LONG_NUMBER.search(text) is None:
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass
    return json.loads(text)


# an integer of 19 or more digits (a float's long fraction or exponent is not one: orjson parses those exactly)
_LONG_NUMBER = re.compile(r"(?<![\d.eE])-?\d{19,}(?![\d.eE])")


def sqlite_timestamp(value: datetime) -> str:
    """A timestamp as ``UTCDateTime`` stores it on SQLite (UTC wall clock; naive means UTC), for
    statements sent to the driver directly."""
    return _as_utc(value).strftime("%Y-%m-%d %H:%M:%S.%f")


def _as_utc(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class JSONText(TypeDecorator):
    """A JSON document stored as TEXT (same on SQLite and PostgreSQL)."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Any) -> str | None:
        return None if value is None else dump_json(value)

    def process_result_value(self, value: str | None, dialect: Any) -> Any:
        return None if value is None else load_json(value)


class UTCDateTime(TypeDecorator):
    """Timezone-aware UTC timestamps on both backends (SQLite drops the zone; we put it back)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        return None if value is None else _as_utc(value)  # SQLite keeps the wall clock only: make it UTC

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value


class GenerationStatus(enum.StrEnum):
    candidate = "candidate"
    training = "training"
    evaluating = "evaluating"
    promoted = "promoted"
    rejected = "rejected"
    failed = "failed"
    retired = "retired"


IN_FLIGHT = (GenerationStatus.candidate, GenerationStatus.training, GenerationStatus.evaluating)
STATUS_LEN = 16


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class BaseModelRow(Base):
    """A frozen base model (a local Hugging Face causal-LM directory or the built tiny model)."""

    __tablename__ = "base_models"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    content_hash: Mapped[str] = mapped_column(String(64))
    path: Mapped[str] = mapped_column(HomePath)  # relative to RATCHET_HOME when inside it (locations.py)
    spec: Mapped[dict] = mapped_column(JSONText)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class HarnessVersion(Base):
    """A content-addressed harness: prompts, tools, context and routing policy."""

    __tablename__ = "harness_versions"
    __table_args__ = (UniqueConstraint("name", "version"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    version: Mapped[str] = mapped_column(String(100))
    content_hash: Mapped[str] = mapped_column(String(64), index=True)
    spec: Mapped[dict] = mapped_column(JSONText)
    parent_id: Mapped[int | None] = mapped_column(ForeignKey("harness_versions.id"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ContractVersion(Base):
    """A content-addressed HCP contract. The loop never edits one; a new version is a new row."""

    __tablename__ = "contract_versions"
    __table_args__ = (UniqueConstraint("name", "version"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    version: Mapped[str] = mapped_column(String(100))
    content_hash: Mapped[str] = mapped_column(String(64), index=True)
    spec: Mapped[dict] = mapped_column(JSONText)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Adapter(Base):
    """One trained LoRA adapter for one specialist; the files live at ``artifact_uri``."""

    __tablename__ = "adapters"
    __table_args__ = (UniqueConstraint("base_model_id", "specialist", "version"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    specialist: Mapped[str] = mapped_column(String(100))
    version: Mapped[int] = mapped_column(Integer)
    base_model_id: Mapped[int] = mapped_column(ForeignKey("base_models.id"))
    rank: Mapped[int] = mapped_column(Integer)
    alpha: Mapped[float] = mapped_column(Float)
    target_modules: Mapped[list] = mapped_column(JSONText)
    artifact_uri: Mapped[str] = mapped_column(HomePath)  # relative to RATCHET_HOME when inside it
    sha256: Mapped[str] = mapped_column(String(64))
    mlflow_run_id: Mapped[str | None] = mapped_column(String(64))
    mlflow_model_version: Mapped[str | None] = mapped_column(String(32))
    dataset_sha256: Mapped[str | None] = mapped_column(String(64))
    parent_adapter_id: Mapped[int | None] = mapped_column(ForeignKey("adapters.id"))
    # how it was trained: ``sft`` (filtered SFT), ``dpo`` (preference pairs), ``grpo`` (online RL)
    method: Mapped[str] = mapped_column(String(16), default="sft", server_default="sft")
    metrics: Mapped[dict] = mapped_column(JSONText, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Generation(Base):
    """A model-harness pair in a lineage. At most one is ``promoted`` (the champion) per lineage and
    at most one is in flight (candidate/training/evaluating); both are enforced by partial indexes."""

    __tablename__ = "generations"
    __table_args__ = (
        UniqueConstraint("lineage", "number"),
        Index(
            "uq_generations_one_champion",
            "lineage",
            unique=True,
            sqlite_where=text("status = 'promoted'"),
            postgresql_where=text("status = 'promoted'"),
        ),
        Index(
            "uq_generations_one_in_flight",
            "lineage",
            unique=True,
            sqlite_where=text("status IN ('candidate', 'training', 'evaluating')"),
            postgresql_where=text("status IN ('candidate', 'training', 'evaluating')"),
        ),
    )
    id: Mapped[int] = mapped_column(primary_key=True)
    lineage: Mapped[str] = mapped_column(String(100), default="main")
    number: Mapped[int] = mapped_column(Integer)
    parent_id: Mapped[int | None] = mapped_column(ForeignKey("generations.id"))
    base_model_id: Mapped[int] = mapped_column(ForeignKey("base_models.id"))
    harness_version_id: Mapped[int] = mapped_column(ForeignKey("harness_versions.id"))
    contract_version_id: Mapped[int] = mapped_column(ForeignKey("contract_versions.id"))
    status: Mapped[str] = mapped_column(String(STATUS_LEN))
    step: Mapped[str | None] = mapped_column(String(32))
    decision: Mapped[str | None] = mapped_column(Text)
    evaluation: Mapped[dict] = mapped_column(JSONText, default=dict)
    state: Mapped[dict] = mapped_column(JSONText, default=dict)
    lease_owner: Mapped[str | None] = mapped_column(String(200))
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)

    adapters: Mapped[list[GenerationAdapter]] = relationship(
        back_populates="generation", cascade="all, delete-orphan", order_by="GenerationAdapter.specialist"
    )
    harness_version: Mapped[HarnessVersion] = relationship()
    contract_version: Mapped[ContractVersion] = relationship()
    base_model: Mapped[BaseModelRow] = relationship()


class GenerationAdapter(Base):
    """Exactly one row per specialist of a generation; ``adapter_id`` is NULL for "none yet"."""

    __tablename__ = "generation_adapters"
    generation_id: Mapped[int] = mapped_column(
        ForeignKey("generations.id", ondelete="CASCADE"), primary_key=True
    )
    specialist: Mapped[str] = mapped_column(String(100), primary_key=True)
    adapter_id: Mapped[int | None] = mapped_column(ForeignKey("adapters.id"))

    generation: Mapped[Generation] = relationship(back_populates="adapters")
    adapter: Mapped[Adapter | None] = relationship()


class Experience(Base):
    """One trace: a conversation in OpenAI chat format with its per-turn routing and feedback.

    The composite indexes serve the dashboard's keyset pages (newest first within a filter) on PostgreSQL,
    where a single-column index does not carry the row order; SQLite's already end in the rowid."""

    __tablename__ = "experience"
    __table_args__ = (
        Index("ix_experience_specialist_id", "specialist", "id"),
        Index("ix_experience_source_id", "source", "id"),
        Index("ix_experience_generation_id_id", "generation_id", "id"),
        Index("ix_experience_principal_id", "principal", "id"),
        Index("ix_experience_conversation_id_id", "conversation_id", "id"),
    )
    id: Mapped[int] = mapped_column(primary_key=True)
    content_hash: Mapped[str] = mapped_column(String(64), unique=True)
    completion_id: Mapped[str | None] = mapped_column(String(100), unique=True)
    messages: Mapped[list] = mapped_column(JSONText)
    meta: Mapped[dict] = mapped_column("metadata", JSONText, default=dict)
    feedback: Mapped[Any | None] = mapped_column(JSONText)
    routes: Mapped[list] = mapped_column(JSONText, default=list)
    specialist: Mapped[str | None] = mapped_column(String(100), index=True)
    source: Mapped[str] = mapped_column(String(32), index=True)
    # who sent it (``pipeline.experience.principals``): an API key's name, ``anonymous``, ``operator``, ``ratchet``;
    # NULL for served traces stored before principals were recorded
    principal: Mapped[str | None] = mapped_column(String(100))
    generation_id: Mapped[int | None] = mapped_column(ForeignKey("generations.id"), index=True)
    harness_version_id: Mapped[int | None] = mapped_column(ForeignKey("harness_versions.id"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    # the conversation the turn belongs to: a Responses ``previous_response_id`` chain's first response, or the
    # conversation / session id a client or an imported trace gave; NULL when none is known
    conversation_id: Mapped[str | None] = mapped_column(String(100))
    tools: Mapped[list | None] = mapped_column(
        JSONText
    )  # the client's tools offered on the turn (OpenAI shape)
    # ``documents.ServedTokens`` by the index (a string) of each assistant message the server decoded: the
    # exact ids the model was given and wrote, so training need not re-render them
    served_tokens: Mapped[dict | None] = mapped_column(JSONText)

    harness_version: Mapped[HarnessVersion | None] = relationship()


class Score(Base):
    """One scorer's value for one trace under one contract version (the ``total`` row: the trace's).

    ``verified``: the value checked the outcome (for ``total``: the trace's final turn was verified, so it
    may be learned from); NULL for rows scored before that was recorded. ``specialist``: the trace's."""

    __tablename__ = "scores"
    __table_args__ = (
        UniqueConstraint("experience_id", "contract_version_id", "scorer"),
        # experience pages filtered by score or verification walk this one newest first
        Index("ix_scores_contract_scorer_experience", "contract_version_id", "scorer", "experience_id"),
    )
    id: Mapped[int] = mapped_column(primary_key=True)
    experience_id: Mapped[int] = mapped_column(ForeignKey("experience.id", ondelete="CASCADE"))
    contract_version_id: Mapped[int] = mapped_column(ForeignKey("contract_versions.id"), index=True)
    scorer: Mapped[str] = mapped_column(String(100))
    value: Mapped[float | None] = mapped_column(Float)
    verified: Mapped[bool | None] = mapped_column(Boolean)
    specialist: Mapped[str | None] = mapped_column(String(100))
    details: Mapped[dict] = mapped_column(JSONText, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ScoreHistory(Base):
    """A score row replaced by a re-score (e.g. feedback that arrived after scoring), kept for audit."""

    __tablename__ = "score_history"
    id: Mapped[int] = mapped_column(primary_key=True)
    experience_id: Mapped[int] = mapped_column(ForeignKey("experience.id", ondelete="CASCADE"), index=True)
    contract_version_id: Mapped[int] = mapped_column(ForeignKey("contract_versions.id"))
    scorer: Mapped[str] = mapped_column(String(100))
    value: Mapped[float | None] = mapped_column(Float)
    verified: Mapped[bool | None] = mapped_column(Boolean)
    specialist: Mapped[str | None] = mapped_column(String(100))
    details: Mapped[dict] = mapped_column(JSONText, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    superseded_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    reason: Mapped[str] = mapped_column(Text)


class Quarantine(Base):
    """A malformed input line, kept with its line number and the reason it was refused."""

    __tablename__ = "quarantine"
    __table_args__ = (Index("ix_quarantine_by_source_file", "source_file", "id"),)  # the dashboard's filter
    id: Mapped[int] = mapped_column(primary_key=True)
    source_file: Mapped[str] = mapped_column(Text)
    line_number: Mapped[int] = mapped_column(Integer)
    reason: Mapped[str] = mapped_column(Text)
    raw: Mapped[str] = mapped_column(Text)
    # sha256 of the whole line: a line is "already quarantined" by file, number and content (a rotated log
    # reuses names and numbers); NULL for lines quarantined before 0009 whose kept text was not the whole line
    line_sha256: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class StoredFile(Base):
    """A file a spec names by sha256 (a held-out suite, a task file), kept whole in the registry at
    registration, so nothing later needs the original file; content-addressed, stored once."""

    __tablename__ = "stored_files"
    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    size: Mapped[int] = mapped_column(Integer)
    content: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class TrainingDataset(Base):
    """A curated SFT dataset (``datasets.save_to_disk``) for one specialist of one generation."""

    __tablename__ = "datasets"
    __table_args__ = (UniqueConstraint("generation_id", "specialist"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    generation_id: Mapped[int] = mapped_column(ForeignKey("generations.id", ondelete="CASCADE"))
    specialist: Mapped[str] = mapped_column(String(100))
    path: Mapped[str] = mapped_column(HomePath)  # relative to RATCHET_HOME when inside it
    sha256: Mapped[str] = mapped_column(String(64))
    num_rows: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class DatasetExample(Base):
    """Which trace went into which training dataset: provenance in both directions (an adapter's traces,
    a trace's adapters) without opening the dataset files."""

    __tablename__ = "dataset_examples"
    dataset_id: Mapped[int] = mapped_column(ForeignKey("datasets.id", ondelete="CASCADE"), primary_key=True)
    experience_id: Mapped[int] = mapped_column(
        ForeignKey("experience.id", ondelete="CASCADE"), primary_key=True, index=True
    )


class EvaluationItem(Base):
    """One held-out item of a candidate's evaluation: the item's conversation and both pairs' answers and
    scores, from the same run (what the dashboard's item-level comparison shows). Never read by curation,
    collection or co-design: these rows are held-out material."""

    __tablename__ = "evaluation_items"
    __table_args__ = (UniqueConstraint("generation_id", "specialist", "position"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    generation_id: Mapped[int] = mapped_column(ForeignKey("generations.id", ondelete="CASCADE"))
    specialist: Mapped[str] = mapped_column(String(100))
    position: Mapped[int] = mapped_column(Integer)
    messages: Mapped[list] = mapped_column(JSONText)
    parent_answer: Mapped[dict | None] = mapped_column(JSONText)
    candidate_answer: Mapped[dict | None] = mapped_column(JSONText)
    parent_value: Mapped[float] = mapped_column(Float)
    candidate_value: Mapped[float] = mapped_column(Float)


class SuiteAttempt(Base):
    """The spending ledger: one test a generation's evaluation made on one suite (by the content hash of its
    resolved items), whatever the lineage, champion or contract version. A test's ``attempt`` counts the
    earlier tests of its kind on any suite sharing an item with it (``SuiteItem``), and it is made at its
    rate ``* 6 / (pi**2 * attempt**2)``, so the rate holds per item over every test that ever used it
    (``pipeline.registry.ledger``). Rows are written once and never changed by a later promotion, rollback
    or contract adoption: that is what keeps the error rate from being reset."""

    __tablename__ = "suite_attempts"
    __table_args__ = (UniqueConstraint("suite_sha256", "test", "generation_id"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    suite_sha256: Mapped[str] = mapped_column(String(64))
    # ``improvement``, ``noninferiority:<specialist>`` or ``retention:<suite name>``
    test: Mapped[str] = mapped_column(String(150))
    generation_id: Mapped[int] = mapped_column(ForeignKey("generations.id"), index=True)
    lineage: Mapped[str] = mapped_column(String(100))
    generation_number: Mapped[int] = mapped_column(Integer)
    # the contract version the generation was evaluated under (a lineage may adopt another one later)
    contract_version_id: Mapped[int] = mapped_column(ForeignKey("contract_versions.id"))
    attempt: Mapped[int] = mapped_column(Integer)  # j: the test's attempt number (the same on all its suites)
    # A fresh suite's samples are one family (the hash of its declaration; otherwise the suite's own hash), and
    # ``sample`` is this suite's number e in it: the improvement test on the e-th sample spends 6/(pi^2 e^2) of
    # the rate, so drawing new samples keeps the lineage-wide bound
    family: Mapped[str] = mapped_column(String(64))
    sample: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class SuiteItem(Base):
    """One item of a suite the ledger has seen, by its item key (``pipeline.registry.ledger.item_key``: the
    hash of the item's prompts as the duplicate check compares them, so metadata, whitespace, case and NFKC
    differences are the same item). Written once per suite, when a test first spends on it: the ledger counts
    tests per item, so a suite that shares items with one tested before (a bigger ``size``, a suite added
    beside it, a ``metadata.group`` added) continues their count instead of starting a fresh budget."""

    __tablename__ = "suite_items"
    suite_sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    item_key: Mapped[str] = mapped_column(String(64), primary_key=True, index=True)


class ApiKey(Base):
    """An API key of ``ratchet serve``: its name (the principal), scopes and sha256; never its value."""

    __tablename__ = "api_keys"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    key_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    scopes: Mapped[list] = mapped_column(JSONText)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class AuditLog(Base):
    """Append-only record of every state change (never updated or deleted by product code)."""

    __tablename__ = "audit_log"
    __table_args__ = (  # the dashboard's filters, newest first
        Index("ix_audit_log_by_entity", "entity", "id"),
        Index("ix_audit_log_by_action", "action", "id"),
        Index("ix_audit_log_by_actor", "actor", "id"),
    )
    id: Mapped[int] = mapped_column(primary_key=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    actor: Mapped[str] = mapped_column(String(100))
    entity: Mapped[str] = mapped_column(String(50))
    entity_id: Mapped[int | None] = mapped_column(Integer)
    action: Mapped[str] = mapped_column(String(50))
    details: Mapped[dict] = mapped_column(JSONText, default=dict)
    message: Mapped[str | None] = mapped_column(Text)
