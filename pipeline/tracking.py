"""Experiment tracking behind a small protocol, with an MLflow implementation.

``Tracker`` is what training and evaluation call; ``MLflowTracker`` talks to an MLflow store (default:
``sqlite:///<home>/mlflow.db`` with artifacts under ``<home>/mlartifacts``; see ``Settings``). Adapters are
registered as MLflow model versions (``create_registered_model`` / ``create_model_version``) and promoted
with aliases (``set_registered_model_alias``), e.g. ``champion``. mlflow is imported inside the methods.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger(__name__)


@runtime_checkable
class Tracker(Protocol):
    """What the pipeline needs from experiment tracking."""

    def start_run(self, name: str, tags: dict[str, str] | None = None) -> Any:
        """Context manager yielding the run id; the run ends FINISHED, or FAILED on an exception."""
        ...

    def log_params(self, params: dict[str, Any]) -> None: ...

    def log_metric(self, key: str, value: float, step: int | None = None) -> None: ...

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None: ...

    def register_adapter(self, name: str, run_id: str, path: str) -> str:
        """Register the adapter logged under ``path`` (artifact path) of ``run_id``; return the version."""
        ...

    def set_alias(self, name: str, alias: str, version: str) -> None: ...

    def delete_alias(self, name: str, alias: str) -> None: ...


class MLflowTracker:
    """``Tracker`` over an MLflow tracking store (one experiment)."""

    def __init__(self, *, tracking_uri: str, artifact_root: Path | None = None, experiment: str = "ratchet"):
        from mlflow import MlflowClient

        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        if found is not None:
            self.experiment_id = found.experiment_id
        else:
            location = Path(artifact_root).resolve().as_uri() if artifact_root is not None else None
            self.experiment_id = self.client.create_experiment(experiment, artifact_location=location)
        self.run_id: str | None = None
        self._pending: list[Any] = []

    @classmethod
    def from_settings(cls, settings: Any = None, experiment: str = "ratchet") -> MLflowTracker:
        """The tracker for ``Settings`` (``tracking_uri``; artifacts under ``home/mlartifacts``)."""
        from pipeline.settings import get_settings

        settings = settings or get_settings()
        settings.ensure_home()
        return cls(
            tracking_uri=settings.tracking_uri,
            artifact_root=settings.home / "mlartifacts",
            experiment=experiment,
        )

    @contextmanager
    def start_run(self, name: str, tags: dict[str, str] | None = None) -> Iterator[str]:
        run = self.client.create_run(self.experiment_id, run_name=name, tags=tags or {})
        previous, self.run_id = self.run_id, run.info.run_id
        status = "FAILED"
        try:
            yield run.info.run_id
            status = "FINISHED"
        finally:
            self.flush()
            self.client.set_terminated(run.info.run_id, status=status)
            self.run_id = previous

    def _run(self) -> str:
        if self.run_id is None:
            raise RuntimeError("no active run: call inside `with tracker.start_run(...)`")
        return self.run_id

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        run_id = self._run()
        items = [Param(str(k), str(v)[:6000]) for k, v in params.items()]
        for at in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[at : at + 100])

    def log_metric(self, key: str, value: float, step: int | None = None) -> None:
        """Buffered: per-step metrics go to the store in batches (one transaction per 200), not one by one."""
        import time

        from mlflow.entities import Metric

        self._run()  # outside a run this is a bug: say so now, not at the flush
        self._pending.append(Metric(key, float(value), int(time.time() * 1000), step or 0))
        if len(self._pending) >= 200:
            self.flush()

    def flush(self) -> None:
        """Write buffered metrics of the active run."""
        if self._pending and self.run_id is not None:
            pending, self._pending = self._pending, []
            for at in range(0, len(pending), 1000):
                self.client.log_batch(self.run_id, metrics=pending[at : at + 1000])

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self.client.log_artifacts(self._run(), str(path), artifact_path=artifact_path)
        else:
            self.client.log_artifact(self._run(), str(path), artifact_path=artifact_path)

    def register_adapter(self, name: str, run_id: str, path: str) -> str:
        from mlflow.exceptions import MlflowException

        try:
            self.client.create_registered_model(name)
        except MlflowException as exc:
            if "RESOURCE_ALREADY_EXISTS" not in str(exc.error_code):
                raise
        source = f"{self.client.get_run(run_id).info.artifact_uri.rstrip('/')}/{path}"
        return str(self.client.create_model_version(name, source=source, run_id=run_id).version)

    def set_alias(self, name: str, alias: str, version: str) -> None:
        self.client.set_registered_model_alias(name, alias, str(version))

    def delete_alias(self, name: str, alias: str) -> None:
        """Remove an alias (no-op when the model or the alias does not exist)."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.delete_registered_model_alias(name, alias)
        except MlflowException as exc:
            if "RESOURCE_DOES_NOT_EXIST" not in str(exc.error_code) and "INVALID_PARAMETER_VALUE" not in str(
                exc.error_code
            ):
                raise

    def alias_version(self, name: str, alias: str) -> str:
        """The version an alias points to (raises mlflow's error when unset)."""
        return str(self.client.get_model_version_by_alias(name, alias).version)


def registered_model_name(lineage: str, specialist: str) -> str:
    """The MLflow registered model holding a lineage's adapters for one specialist."""
    return f"ratchet-{lineage}-{specialist}"
