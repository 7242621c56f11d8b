"""The one ``Settings`` object: every knob that comes from the environment (prefix ``RATCHET_``)."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipeline.errors import RatchetError


class HomeMissing(RatchetError):
    """The home (``RATCHET_HOME``) holding the registry does not exist: ``ratchet init`` creates it."""


class Settings(BaseSettings):
    """Runtime settings, read from ``RATCHET_*`` environment variables (and ``MLFLOW_TRACKING_URI``)."""

    model_config = SettingsConfigDict(env_prefix="RATCHET_", extra="ignore")

    home: Path = Field(
        default=Path(".ratchet"),
        description="Working directory for the registry file, MLflow store, adapters, datasets and caches.",
    )
    database_url: str | None = Field(
        default=None,
        description="SQLAlchemy URL of the registry; default: a SQLite file under `home`.",
    )
    mlflow_tracking_uri: str | None = Field(
        default=None,
        validation_alias=AliasChoices("MLFLOW_TRACKING_URI", "RATCHET_MLFLOW_TRACKING_URI"),
        description="MLflow tracking URI; default: a SQLite store under `home`.",
    )
    api_key: str | None = Field(
        default=None, description="When set, `ratchet serve` requires this bearer key."
    )
    admin_token: str | None = Field(
        default=None,
        description="When set, `ratchet dashboard` allows actions (promote, rollback, re-score) to whoever "
        "presents it (bearer token, or the login form's session cookie); unset, the dashboard is read-only.",
    )
    engine_api_key: str | None = Field(
        default=None,
        description="Bearer key sent to an external OpenAI-compatible engine (`--engine external`).",
    )
    torch_threads: int = Field(
        default=0,
        ge=0,
        description="CPU threads for torch in training and generation (0: torch's default). On a small, busy "
        "machine 1 is often fastest: OpenMP threads that wait for each other cost more than they give.",
    )
    device: str = Field(default="auto", description="Torch device for training and serving: auto, cpu, cuda.")
    sandbox: Literal["bubblewrap", "process"] = Field(
        default="bubblewrap",
        description="How model-written code is run by the `python_tests` scorer: `bubblewrap` (kernel "
        "namespaces: no network, no view of the host's files or processes; needs Debian's `bubblewrap`) "
        "or `process` (plain processes with resource limits: no isolation, for trusted data only).",
    )

    rollout_engine: Literal["embedded", "openai"] = Field(
        default="embedded",
        description="Where the loop samples (collection, discovery, evaluation, GRPO rollouts): `embedded` "
        "(in this process, one copy of the base holding every specialist's adapter) or `openai` (a vLLM / "
        "SGLang server the operator started with LoRA and runtime adapter loading on, or `ratchet serve "
        "--expose-adapters`, at `rollout_engine_url`: adapters loaded by versioned name, prompts sent as "
        "token ids, each adapter checked by the parity probe before it samples).",
    )
    rollout_engine_url: str | None = Field(
        default=None,
        description="Base URL of the `openai` rollout engine (e.g. http://127.0.0.1:8000; `/v1` is added).",
    )
    rollout_engine_api_key: str | None = Field(
        default=None,
        description="Bearer key sent to the `openai` rollout engine; it must be allowed to load adapters "
        "(vLLM: `--api-key`; `ratchet serve --expose-adapters`: a key with the admin scope).",
    )
    parity_tolerance: float = Field(
        default=0.05,
        gt=0,
        description="The parity probe's limit: the largest mean absolute difference, over one probe "
        "prompt's tokens, between the prompt log-probabilities the `openai` engine reports for a loaded "
        "adapter and those of the trainer's own forward (base + adapter); above it the engine is refused "
        "for that adapter. 0.05 leaves room for a bf16 engine's kernels; a stale or wrong adapter differs "
        "by far more.",
    )

    @property
    def registry_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.home / 'registry.db').resolve()}"

    @property
    def tracking_uri(self) -> str:
        if self.mlflow_tracking_uri:
            return self.mlflow_tracking_uri
        return f"sqlite:///{(self.home / 'mlflow.db').resolve()}"

    @property
    def artifacts_dir(self) -> Path:
        return self.home / "artifacts"

    def ensure_home(self) -> Path:
        """The home, which must exist where the registry lives in it (the default SQLite file): a command run
        from another directory would otherwise start an empty registry in a new ``./.ratchet`` there. So a
        missing home is refused with one line (``HomeMissing``) naming where it would be; ``create_home``
        (``ratchet init``, ``ratchet demo``) makes it. With an external registry (``database_url``) the home
        only holds this machine's files (artifacts, caches) and is made when missing."""
        if self.database_url is None and not self.home.is_dir():
            raise HomeMissing(
                f"no Ratchet home at {self.home.absolute()} (RATCHET_HOME, default ./.ratchet): "
                "`ratchet init` creates it"
            )
        return self.create_home()

    def create_home(self) -> Path:
        """Make the home directory (and its parents) if it is missing; the home."""
        self.home.mkdir(parents=True, exist_ok=True)
        return self.home


def apply_torch_threads(settings: Settings | None = None) -> None:
    """Set torch's CPU thread count from the settings (no-op for 0)."""
    settings = settings or get_settings()
    if settings.torch_threads:
        import torch

        torch.set_num_threads(settings.torch_threads)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """Process-wide settings; tests call ``get_settings.cache_clear()`` after changing the environment."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    return Settings()
