"""Experiment tracking behind a small protocol, with an MLflow implementation.

``Tracker`` is what training and evaluation call; ``MLflowTracker`` talks to an MLflow store (default:
``sqlite:///<home>/mlflow.db`` with artifacts under ``<home>/mlartifacts``; see ``Settings``). Adapters are
registered as MLflow model versions (``create_registered_model`` / ``create_model_version``) and promoted
with aliases (``set_registered_model_alias``), e.g. ``champion``. mlflow is imported inside the methods.

What a user opens in MLflow says what each thing is: a training run and its model version carry the
adapter's ``lineage``, ``generation``, ``specialist`` and ``method`` tags (``identity_tags``; the version
copies its run's). Once a generation is decided (``pipeline.loop.publication``), its scores are metrics of its
runs and its ``decision`` and ``status`` are tags of its runs and model versions; a rejected version also
says so in its description (``tag_version``). The adapters are registered from their runs' artifacts (the
run's ``adapter/`` directory as the version's source), not as MLflow 3 logged models: a version's figures are
its run's metrics and its own tags.

Against a tracking server (an ``http(s)://`` URI) the client gives up after a few seconds instead of
MLflow's default of about four minutes of retries (``HTTP_CLIENT_DEFAULTS``; a variable already set in the
environment wins), experiments keep the server's artifact location (``--artifacts-destination``), and a
server that does not answer is a ``TrackingUnavailable``: one line naming the server and the call. Nothing
is buffered for later: the step that needed MLflow stops, the registry keeps what was recorded before it
(each record is written only after its MLflow counterpart exists), and running the command again once the
server is back continues the same candidate.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from pipeline.errors import RatchetError
from pipeline.registry.locations import follow_moved_store
from pipeline.settings import get_settings

log = logging.getLogger(__name__)


@runtime_checkable
class Tracker(Protocol):
    """What the pipeline needs from experiment tracking."""

    def start_run(self, name: str, tags: dict[str, str] | None = None) -> Any:
        """Context manager yielding the run id; the run ends FINISHED, or FAILED on an exception."""
        ...

    def log_params(self, params: dict[str, Any]) -> None: ...

    def set_tags(self, tags: dict[str, str]) -> None:
        """Tag the active run."""
        ...

    def log_metric(self, key: str, value: float, step: int | None = None) -> None: ...

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None: ...

    def register_adapter(self, name: str, run_id: str, path: str) -> str:
        """Register the adapter logged under ``path`` (artifact path) of ``run_id``; return the version."""
        ...

    def set_alias(self, name: str, alias: str, version: str) -> None: ...

    def delete_alias(self, name: str, alias: str) -> None: ...


# MLflow's HTTP client defaults are 7 retries with backoff factor 2 (a dead server: about 4 minutes per
# call) and a 120 s timeout; a training job should say "MLflow is down" in seconds. 3 retries at factor 1
# wait 0 + 2 + 4 s (plus jitter) on a refused connection; 20 s is per socket read (not per upload), so a hung
# server costs 4 x 20 s.
HTTP_CLIENT_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}


class _QuietRetries(logging.Filter):
    """Drop urllib3's "Retrying ..." warnings for MLflow's REST calls: the outcome is one line of our own."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (
            message.startswith("Retrying") and ("/api/2.0/mlflow" in message or "mlflow-artifacts" in message)
        )


QUIET_RETRIES = _QuietRetries()


class TrackingUnavailable(RatchetError):
    """The MLflow tracking server did not answer (refused, timed out, or kept failing with 5xx)."""


def is_remote(tracking_uri: str) -> bool:
    return tracking_uri.startswith(("http://", "https://"))


def unreachable(exc: BaseException) -> str | None:
    """Why MLflow could not reach its server, in a few words, when that is what ``exc`` is; else None."""
    import requests
    import urllib3

    chain, seen = [], exc
    while seen is not None and len(chain) < 20:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    if not any(isinstance(e, requests.exceptions.RequestException) for e in chain):
        return None
    refused = [e.strerror for e in chain if isinstance(e, OSError) and e.strerror]
    if refused:  # first: urllib3's NewConnectionError is, oddly, a subclass of its TimeoutError
        return refused[-1]  # e.g. "Connection refused", "Name or service not known"
    if any(isinstance(e, requests.exceptions.Timeout | urllib3.exceptions.TimeoutError) for e in chain):
        return f"no answer within {os.environ.get('MLFLOW_HTTP_REQUEST_TIMEOUT', '120')} s"
    if any(isinstance(e, requests.exceptions.RetryError | urllib3.exceptions.ResponseError) for e in chain):
        return "it kept answering with server errors"
    return str(chain[-1])[:200]


class MLflowTracker:
    """``Tracker`` over an MLflow tracking store (one experiment)."""

    def __init__(self, *, tracking_uri: str, artifact_root: Path | None = None, experiment: str = "ratchet"):
        from mlflow import MlflowClient

        if is_remote(tracking_uri):
            for name, value in HTTP_CLIENT_DEFAULTS.items():
                os.environ.setdefault(name, value)  # MLflow reads these at every request
            logging.getLogger("urllib3.connectionpool").addFilter(QUIET_RETRIES)  # once: filters are a set
        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        self.run_id: str | None = None
        self._pending: list[Any] = []
        with self._reaching(f"opening experiment {experiment!r}"):
            found = self.client.get_experiment_by_name(experiment)
            location = Path(artifact_root).resolve().as_uri() if artifact_root is not None else None
            if found is not None:
                self.experiment_id = found.experiment_id
                if location is not None and found.artifact_location != location:  # the home moved?
                    follow_moved_store(tracking_uri=tracking_uri, artifact_location=location)
            else:
                self.experiment_id = self.client.create_experiment(experiment, artifact_location=location)

    @contextmanager
    def _reaching(self, what: str) -> Iterator[None]:
        """Turn "the server did not answer" during ``what`` into one ``TrackingUnavailable`` line."""
        try:
            yield
        except TrackingUnavailable:
            raise
        except Exception as exc:
            reason = unreachable(exc)
            if reason is None:
                raise
            raise TrackingUnavailable(
                f"MLflow tracking server {self.tracking_uri} is unreachable ({what}: {reason}); start it, or "
                "point MLFLOW_TRACKING_URI at a running one, and run the command again (an interrupted "
                "generation continues where it stopped)"
            ) from exc

    @classmethod
    def from_settings(cls, settings: Any = None, experiment: str = "ratchet") -> MLflowTracker:
        """The tracker for ``Settings`` (``tracking_uri``; artifacts under ``home/mlartifacts``)."""

        settings = settings or get_settings()
        settings.ensure_home()
        uri = settings.tracking_uri
        return cls(
            tracking_uri=uri,
            # a server stores artifacts where it was told to (--artifacts-destination), not on this machine
            artifact_root=None if is_remote(uri) else settings.home / "mlartifacts",
            experiment=experiment,
        )

    @contextmanager
    def start_run(self, name: str, tags: dict[str, str] | None = None) -> Iterator[str]:
        with self._reaching(f"creating run {name!r}"):
            run = self.client.create_run(self.experiment_id, run_name=name, tags=tags or {})
        previous, self.run_id = self.run_id, run.info.run_id
        try:
            yield run.info.run_id
        except TrackingUnavailable:
            # the server is gone: ending the run would only wait for it again; it stays RUNNING there
            self._pending, self.run_id = [], previous
            raise
        except BaseException:
            try:
                self.flush()
                self._terminate(run.info.run_id, "FAILED")
            except Exception as cleanup:  # keep the error that ended the run, not this one
                log.warning("could not mark MLflow run %s failed: %s", run.info.run_id, cleanup)
            self._pending, self.run_id = [], previous
            raise
        try:
            self.flush()
            self._terminate(run.info.run_id, "FINISHED")
        finally:
            self._pending, self.run_id = [], previous

    def _terminate(self, run_id: str, status: str) -> None:
        with self._reaching(f"ending run {run_id}"):
            self.client.set_terminated(run_id, status=status)

    def _run(self) -> str:
        if self.run_id is None:
            raise RuntimeError("no active run: call inside `with tracker.start_run(...)`")
        return self.run_id

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        run_id = self._run()
        items = [Param(str(k), str(v)[:6000]) for k, v in params.items()]
        with self._reaching(f"logging parameters of run {run_id}"):
            for at in range(0, len(items), 100):
                self.client.log_batch(run_id, params=items[at : at + 100])

    def set_tags(self, tags: dict[str, str]) -> None:
        self.tag_run(self._run(), tags)

    def tag_run(self, run_id: str, tags: dict[str, str]) -> None:
        """Set ``tags`` on a run (finished or not)."""
        from mlflow.entities import RunTag

        items = [RunTag(str(k), str(v)[:5000]) for k, v in sorted(tags.items())]
        with self._reaching(f"tagging run {run_id}"):
            for at in range(0, len(items), 100):
                self.client.log_batch(run_id, tags=items[at : at + 100])

    def log_run_metrics(self, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
        """Log ``metrics`` (at ``step``) to a run, finished or not; a key logged again adds a point."""
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in sorted(metrics.items())]
        with self._reaching(f"logging metrics of run {run_id}"):
            for at in range(0, len(batch), 1000):
                self.client.log_batch(run_id, metrics=batch[at : at + 1000])

    def log_run_artifact(self, run_id: str, path: Path, artifact_path: str | None = None) -> None:
        """Upload a file into a run's artifacts (finished or not), replacing one of the same name."""
        with self._reaching(f"uploading {Path(path).name} to run {run_id}"):
            self.client.log_artifact(run_id, str(path), artifact_path=artifact_path)

    def tag_version(
        self, name: str, version: str, tags: dict[str, str], description: str | None = None
    ) -> None:
        """Set ``tags`` (and the description, when given) on a registered model version."""
        with self._reaching(f"tagging version {version} of model {name!r}"):
            for key, value in sorted(tags.items()):
                self.client.set_model_version_tag(name, str(version), key, str(value)[:5000])
            if description is not None:
                self.client.update_model_version(name, str(version), description=description[:5000])

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
            with self._reaching(f"logging metrics of run {self.run_id}"):
                for at in range(0, len(pending), 1000):
                    self.client.log_batch(self.run_id, metrics=pending[at : at + 1000])

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        with self._reaching(f"uploading {path.name} to run {self._run()}"):
            if path.is_dir():
                self.client.log_artifacts(self._run(), str(path), artifact_path=artifact_path)
            else:
                self.client.log_artifact(self._run(), str(path), artifact_path=artifact_path)

    def register_adapter(self, name: str, run_id: str, path: str) -> str:
        """The model version of ``run_id``'s adapter: the one registered already (a training step that failed
        after registering it and runs again), else a new one. The version carries its run's identity tags
        (``identity_tags``)."""
        from mlflow.exceptions import MlflowException

        with self._reaching(f"registering a version of model {name!r}"):
            try:
                self.client.create_registered_model(name)
            except MlflowException as exc:
                if "RESOURCE_ALREADY_EXISTS" not in str(exc.error_code):
                    raise
            run = self.client.get_run(run_id)
            source = f"{run.info.artifact_uri.rstrip('/')}/{path}"
            tags = {k: v for k, v in run.data.tags.items() if k in IDENTITY}
            for known in self.client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'"):
                if known.source == source:
                    for key, value in sorted(tags.items()):
                        if known.tags.get(key) != value:
                            self.client.set_model_version_tag(name, str(known.version), key, value)
                    return str(known.version)
            made = self.client.create_model_version(name, source=source, run_id=run_id, tags=tags)
            return str(made.version)

    def set_alias(self, name: str, alias: str, version: str) -> None:
        with self._reaching(f"moving alias {alias!r} of model {name!r}"):
            self.client.set_registered_model_alias(name, alias, str(version))

    def delete_alias(self, name: str, alias: str) -> None:
        """Remove an alias (no-op when the model or the alias does not exist)."""
        from mlflow.exceptions import MlflowException

        try:
            with self._reaching(f"removing alias {alias!r} of model {name!r}"):
                self.client.delete_registered_model_alias(name, alias)
        except MlflowException as exc:
            if "RESOURCE_DOES_NOT_EXIST" not in str(exc.error_code) and "INVALID_PARAMETER_VALUE" not in str(
                exc.error_code
            ):
                raise

    def generation_run(self, lineage: str, number: int) -> str:
        """The run holding a generation's own metrics (tags ``kind=generation``, ``lineage``, ``generation``):
        the one made before, else a new one (finished at once; metrics are added to it later)."""
        tags = {"kind": "generation", "lineage": lineage, "generation": str(number)}
        query = " and ".join(f"tags.{k} = '{v}'" for k, v in tags.items())
        with self._reaching(f"finding the run of generation {number} of {lineage!r}"):
            found = self.client.search_runs([self.experiment_id], filter_string=query, max_results=1)
            if found:
                return found[0].info.run_id
            run = self.client.create_run(
                self.experiment_id, run_name=f"{lineage}-generation-{number}", tags=tags
            )
            self.client.set_terminated(run.info.run_id, status="FINISHED")
            return run.info.run_id

    def log_generation_metrics(self, lineage: str, number: int, metrics: dict[str, float]) -> str:
        """Log ``metrics`` (at step ``number``) to the generation's run; returns its id. A metric logged again
        adds a point to its history; its latest value is the current one."""
        import time

        from mlflow.entities import Metric

        run_id = self.generation_run(lineage, number)
        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, number) for k, v in sorted(metrics.items())]
        with self._reaching(f"logging the metrics of generation {number} of {lineage!r}"):
            for at in range(0, len(batch), 1000):
                self.client.log_batch(run_id, metrics=batch[at : at + 1000])
        return run_id

    def alias_version(self, name: str, alias: str) -> str:
        """The version an alias points to (raises mlflow's error when unset)."""
        with self._reaching(f"reading alias {alias!r} of model {name!r}"):
            return str(self.client.get_model_version_by_alias(name, alias).version)


IDENTITY = ("lineage", "generation", "specialist", "method")


def identity_tags(record: dict[str, Any]) -> dict[str, str]:
    """What an adapter is, as MLflow tags of its training run and model version: the lineage, generation,
    specialist and training method that ``record`` (its ``lineage.json``) names."""
    return {key: str(record[key]) for key in IDENTITY if record.get(key) is not None}


def registered_model_name(lineage: str, specialist: str) -> str:
    """The MLflow registered model holding a lineage's adapters for one specialist."""
    return f"ratchet-{lineage}-{specialist}"
