"""Core commands: database, init, ingest, score."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli.app import app
from pipeline.errors import NotFoundError, RatchetError
from pipeline.experience.ingest import IngestResult, ingest_file
from pipeline.experience.principals import OPERATOR
from pipeline.experience.sources.intake import import_turns
from pipeline.experience.sources.langfusetraces import langfuse_turns
from pipeline.experience.sources.mlflowtraces import mlflow_turns
from pipeline.experience.sources.otlpspans import otlp_turns
from pipeline.experience.sources.storedcompletions import stored_completion_turns
from pipeline.loop.founding import init_lineage
from pipeline.registry import (
    current_revision,
    downgrade_db,
    get_champion,
    get_contract_version,
    get_engine,
    get_generation,
    session_scope,
    upgrade_db,
)
from pipeline.scoring import score_experience
from pipeline.settings import get_settings
from pipeline.shipped import demo_specs

db_app = typer.Typer(
    help="Create, upgrade or downgrade the registry's schema (Alembic migrations).", no_args_is_help=True
)
app.add_typer(db_app, name="db")


def _settings():

    settings = get_settings()
    settings.ensure_home()
    return settings


@db_app.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument(help="Target revision.")] = "head") -> None:
    """Apply migrations up to REVISION (default: head)."""

    url = _settings().registry_url
    upgrade_db(url, revision)
    typer.echo(f"registry at revision {current_revision(url)}")


@db_app.command("downgrade")
def db_downgrade(
    revision: Annotated[str, typer.Argument(help="Target revision, or 'base' to drop every table.")],
) -> None:
    """Revert migrations down to REVISION."""

    url = _settings().registry_url
    downgrade_db(url, revision)
    typer.echo(f"registry at revision {current_revision(url) or 'base'}")


@db_app.command("current")
def db_current() -> None:
    """Print the registry's URL and schema revision."""
    from sqlalchemy.engine import make_url

    url = _settings().registry_url
    typer.echo(
        f"{make_url(url).render_as_string(hide_password=True)} at revision {current_revision(url) or 'base'}"
    )


@app.command("init")
def init(
    contract: Annotated[
        Path | None, typer.Option(help="HCP contract YAML (default: the shipped demo contract).")
    ] = None,
    harness: Annotated[
        Path | None, typer.Option(help="Harness YAML (default: the shipped demo harness).")
    ] = None,
    model: Annotated[
        Path | None, typer.Option(help="Model spec YAML (default: the shipped tiny model spec).")
    ] = None,
    lineage: Annotated[str, typer.Option(help="Lineage name.")] = "main",
) -> None:
    """Create the home (RATCHET_HOME) if needed, register a contract, harness and base model, and create
    generation 0 (the first champion)."""

    demo = demo_specs()
    result = init_lineage(
        contract_path=contract or demo["contract"],
        harness_path=harness or demo["harness"],
        model_path=model or demo["model"],
        lineage=lineage,
    )
    typer.echo(result.describe())


FORMATS = ("jsonl", "mlflow", "otel", "langfuse", "openai")


def _turns(
    fmt: str,
    path: Path | None,
    *,
    experiment: str | None,
    filter_string: str | None,
    tracking_uri: str | None,
):  # noqa: ANN202 - an iterator of intake.Turn
    if fmt == "mlflow":
        return mlflow_turns(experiment or "", filter_string=filter_string, tracking_uri=tracking_uri)
    assert path is not None
    return {"otel": otlp_turns, "langfuse": langfuse_turns, "openai": stored_completion_turns}[fmt](path)


@app.command("ingest")
def ingest(
    files: Annotated[
        list[Path] | None,
        typer.Argument(
            help="Files to read: JSONL traces (--from jsonl), an OTLP JSON file (otel), a Langfuse trace export "
            "(langfuse), OpenAI stored completions as JSONL (openai). None with --from mlflow."
        ),
    ] = None,
    from_: Annotated[
        str,
        typer.Option(
            "--from",
            help="What the traces are: jsonl (Ratchet's own, one trace per line), mlflow (MLflow Tracing: "
            "--experiment), otel (OTLP JSON spans with the GenAI semantic conventions), langfuse (a Langfuse "
            "trace export with its scores) or openai (stored chat completions with their messages).",
        ),
    ] = "jsonl",
    experiment: Annotated[
        str | None, typer.Option(help="--from mlflow: the MLflow experiment's name or id.")
    ] = None,
    filter_: Annotated[
        str | None,
        typer.Option("--filter", help="--from mlflow: an MLflow search_traces filter string."),
    ] = None,
    tracking_uri: Annotated[
        str | None,
        typer.Option(
            help="--from mlflow: the MLflow tracking URI (default: MLFLOW_TRACKING_URI, else the home's)."
        ),
    ] = None,
    source: Annotated[str, typer.Option(help="deployment, simulation, import or evaluation.")] = "import",
    generation: Annotated[
        int | None, typer.Option(help="Generation that served these traces (default: the champion).")
    ] = None,
    lineage: Annotated[str, typer.Option(help="Lineage of --generation.")] = "main",
    batch_size: Annotated[int, typer.Option(min=1, help="Rows per insert batch.")] = 2000,
    principal: Annotated[
        str,
        typer.Option(
            help="Whose traces these are: `operator` (your own) or the outside party they came from, whose "
            "share of a dataset the contract caps (selection.max_share_per_principal). With --from mlflow, "
            "otel, langfuse or openai, the ratings, corrections and expectations found count only as this "
            "principal may make them count (operator: all; a key's name: the key's scopes; else none)."
        ),
    ] = OPERATOR,
) -> None:
    """Stream traces into the registry; malformed lines are quarantined with their line number and reason.
    Ingest is the operator's trusted path: the traces' metadata, ratings and corrections count as given.

    --from mlflow, otel, langfuse or openai reads what other systems logged:
    one turn per chat call, with its tools and its conversation. Importing the
    same traces twice adds nothing; a record that cannot be read is quarantined
    with its reason. Their ratings, corrections and expectations count only as
    --principal may make them count."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    if from_ not in FORMATS:
        raise RatchetError(f"--from {from_!r}: expected one of {', '.join(FORMATS)}")
    files = files or []
    if from_ == "mlflow":
        if files:
            raise RatchetError("--from mlflow reads an experiment (--experiment NAME|ID), not files")
        if not experiment:
            raise RatchetError("--from mlflow needs --experiment NAME|ID")
    elif experiment is not None or filter_ is not None or tracking_uri is not None:
        raise RatchetError("--experiment, --filter and --tracking-uri go with --from mlflow")
    elif not files:
        other = " (or --from mlflow --experiment NAME|ID)" if from_ == "jsonl" else ""
        raise RatchetError(f"--from {from_} needs at least one file{other}")
    if from_ == "mlflow" and tracking_uri is None:
        tracking_uri = _settings().tracking_uri
    engine = get_engine()
    gen_id = harness_id = None
    with session_scope(engine) as session:
        gen = (
            get_generation(session=session, number=generation, lineage=lineage)
            if generation is not None
            else get_champion(session=session, lineage=lineage)
        )
        if gen is not None:
            gen_id, harness_id = gen.id, gen.harness_version_id
    stored_as = {
        "session_factory": lambda: session_scope(engine),
        "source": source,
        "principal": principal,
        "generation_id": gen_id,
        "harness_version_id": harness_id,
        "batch_size": batch_size,
    }
    failed = False
    if from_ != "jsonl":
        for path in files or [None]:
            if path is not None and not path.is_file():
                raise NotFoundError(f"{path}: {'is a directory' if path.is_dir() else 'no such file'}")
            label = f"mlflow:{experiment}" if path is None else str(path)
            turns = _turns(
                from_, path, experiment=experiment, filter_string=filter_, tracking_uri=tracking_uri
            )
            _report(import_turns(turns, label=label, **stored_as), "turns")
        return
    for path in files:
        with Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            transient=True,
        ) as bar:
            task = bar.add_task(f"ingest {path.name}", total=None)
            result = ingest_file(
                path,
                **stored_as,
                progress=lambda done, total, task=task: bar.update(task, completed=done, total=total),
            )
        _report(result, "lines")
        failed |= result.lines == 0
    if failed:
        raise RatchetError("no traces found in at least one file (expected one JSON object per line)")


def _report(result: IngestResult, unit: str) -> None:
    """One line: what an ingest or import of one source stored, found again and quarantined (and why)."""
    reasons = ", ".join(f"{k}: {v}" for k, v in sorted(result.reasons.items()))
    typer.echo(
        f"{result.file}: {result.lines} {unit}: {result.stored} stored, {result.duplicate} duplicate, "
        f"{result.quarantined} quarantined" + (f" ({reasons})" if reasons else "")
    )


@app.command("score")
def score(
    contract: Annotated[
        str | None, typer.Option(help="Contract name (default: the champion's contract).")
    ] = None,
    version: Annotated[str | None, typer.Option(help="Contract version (default: the newest).")] = None,
    lineage: Annotated[str, typer.Option(help="Lineage whose champion's contract is the default.")] = "main",
) -> None:
    """Score every unscored trace under a contract version; earlier versions' scores are kept."""
    from rich.progress import Progress

    engine = get_engine()
    with session_scope(engine) as session:
        if contract is None:
            champion = get_champion(session=session, lineage=lineage)
            if champion is None:
                raise RatchetError("no champion yet: run `ratchet init`, or name a registered --contract")
            cv = champion.contract_version
        else:
            cv = get_contract_version(session=session, name=contract, version=version)
        cv_id, label = cv.id, f"{cv.name} {cv.version}"
    with Progress(transient=True) as bar:
        task = bar.add_task(f"score under {label}", total=None)
        with session_scope(engine) as session:
            result = score_experience(
                session=session,
                contract_version_id=cv_id,
                progress=lambda n: bar.update(task, advance=n),
            )
    per = ", ".join(f"{k}: {v}" for k, v in sorted(result.by_specialist.items()))
    typer.echo(
        f"scored under {label}: {result.scored} traces ({result.rows} score rows), {result.already_scored} "
        f"already scored, {result.unscorable} unscorable, {result.errors} scorer errors"
        + (f"; {per}" if per else "")
    )
