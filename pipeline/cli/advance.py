"""Generation commands: advance, lineage, promote, rollback, demo."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from pipeline.cli.app import app
from pipeline.cli.options import with_config
from pipeline.environment import training_corpus
from pipeline.environment.tinymodel import build_tiny_model
from pipeline.errors import RatchetError
from pipeline.loop.candidate import AdvanceConfig
from pipeline.loop.founding import init_lineage
from pipeline.loop.promotion import sync_champion_aliases
from pipeline.registry import (
    get_champion,
    get_engine,
    get_generation,
    promote_generation,
    rollback_champion,
    session_scope,
)
from pipeline.registry.generations import abandon_generation
from pipeline.registry.summaries import DiscoverySummary, LineageSummary
from pipeline.registry.tracking import MLflowTracker
from pipeline.settings import apply_torch_threads, get_settings
from pipeline.shipped import demo_specs
from pipeline.specs.modelspec import ModelSpec

LineageOpt = Annotated[str, typer.Option(help="Lineage name.")]
# `advance` and `demo` take every AdvanceConfig field as an option (pipeline.cli.options); these two by
# their short names
ADVANCE_FLAGS = {"prompts_per_specialist": "--prompts", "samples_per_prompt": "--samples"}
MAX_REASON = 500  # an operator's reason, as the dashboard's form takes it


def lineage_summary(lineage: str) -> LineageSummary:
    """The lineage as `ratchet lineage --json` prints it and the dashboard's `/api/lineage` returns it (one
    model, ``pipeline.registry.summaries.LineageSummary``)."""
    from pipeline.dashboard.overview import lineage_summary as summarise  # lazy: imports fastapi

    with session_scope(get_engine()) as session:
        return summarise(session=session, lineage=lineage)


def lineage_rows(lineage: str) -> list[dict[str, Any]]:
    """Every generation of the lineage as plain data (``GenerationSummary``; `ratchet lineage --json`'s
    ``generations``)."""
    return [g.model_dump(mode="json") for g in lineage_summary(lineage).generations]


def describe_discovery(found: dict[str, DiscoverySummary]) -> str:
    """One line: per specialist, the variants discovery found and how champion and candidate answer them."""
    parts = []
    for s, d in sorted(found.items()):
        if d.found:
            scores = (
                f" ({d.champion:.2f} -> {d.candidate:.2f})"
                if d.champion is not None and d.candidate is not None
                else ""
            )
            parts.append(f"{s} {d.found}/{d.tried}{scores}")
    return "variants found (champion -> candidate, greedy): " + ", ".join(parts)


def print_lineage(lineage: str) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = lineage_summary(lineage).generations  # refused with one line when the lineage has none
    specialists = sorted({s for r in rows for s in r.adapters})
    table = Table(title=f"lineage {lineage}", show_lines=False)
    for col in ("gen", "parent", "status", "harness", *specialists, "overall", "router", "decision"):
        table.add_column(
            col, overflow="fold", max_width=56 if col == "decision" else None, no_wrap=col != "decision"
        )
    for r in rows:
        cells = []
        for s in specialists:
            score = r.scores.get(s)
            adapter = r.adapters.get(s) or "-"
            if r.methods.get(s) not in (None, "sft"):
                adapter += f" {r.methods[s]}"
            cells.append(f"{adapter} {score:.3f}" if score is not None else adapter)
        overall = f"{r.overall:.3f}" if r.overall is not None else "-"
        router = f"{r.router_accuracy:.2f}" if r.router_accuracy is not None else "-"
        style = "bold green" if r.champion else None
        table.add_row(
            str(r.number),
            "-" if r.parent is None else str(r.parent),
            r.status,
            r.harness,
            *cells,
            overall,
            router,
            r.decision or "",
            style=style,
        )
    console = Console()
    if not console.is_terminal:  # a log or a pipe: do not squeeze the table into 80 columns
        console = Console(width=160)
    console.print(table)
    champion = next((r for r in rows if r.champion), None)
    if champion is not None and champion.backward_transfer:  # pipeline.gates.transfer
        console.print(
            f"champion (generation {champion.number}) per suite, backward transfer since the suite was "
            "first measured on its line: "
            + ", ".join(
                f"{suite} {champion.accuracy[suite]:.3f} ({value:+.3f})"
                for suite, value in sorted(champion.backward_transfer.items())
            ),
            highlight=False,
        )
    kl = {s: d.kl_to_base for s, d in champion.divergence.items()} if champion is not None else {}
    if kl:  # pipeline.gates.divergence
        console.print(
            "champion's mean per-token KL to the base model (nats, on its held-out answers): "
            + ", ".join(f"{s} {v:.4f}" if v is not None else f"{s} -" for s, v in sorted(kl.items())),
            highlight=False,
        )


@app.command("lineage")
def lineage_cmd(
    lineage: LineageOpt = "main",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Show every generation: parent, status, harness, adapters, held-out scores and the decision."""
    if as_json:  # the same document as the dashboard's /api/lineage
        typer.echo(json.dumps(lineage_summary(lineage).model_dump(mode="json"), indent=2))
    else:
        print_lineage(lineage)


def make_tracker():
    """The MLflow tracker on the configured store (None if tracking is disabled)."""

    return MLflowTracker.from_settings()


def run_advance(generations: int, config: Any) -> list[dict[str, Any]]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from flows import advance_generation  # lazy: imports prefect

    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        transient=True,
    ) as bar:
        tasks: dict[str, Any] = {}

        def progress(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=total or None)
            bar.update(tasks[phase], completed=done, total=total or None)

        outcomes = []
        for _ in range(generations):
            outcome = advance_generation(
                generations=1, config=config, tracker=make_tracker(), progress=progress
            )[0]
            for task_id in tasks.values():
                bar.remove_task(task_id)
            tasks.clear()
            typer.echo(f"generation {outcome['generation']}: {outcome['status']} — {outcome['decision']}")
            found = next(
                (
                    g.discovery
                    for g in lineage_summary(config.lineage).generations
                    if g.number == outcome["generation"]
                ),
                {},
            )
            if any(d.found for d in found.values()):
                typer.echo("  discovery: " + describe_discovery(found))
            outcomes.append(outcome)
    return outcomes


@app.command("advance")
@with_config(AdvanceConfig, names=ADVANCE_FLAGS)
def advance_cmd(
    config: AdvanceConfig,
    generations: Annotated[int, typer.Option(min=1, help="Advancement cycles to run.")] = 1,
) -> None:
    """Build the next generation(s) from the champion; promote each only if it beats its parent."""
    ensure_base_model(config.lineage)
    run_advance(generations, config)
    print_lineage(config.lineage)


def ensure_base_model(lineage: str) -> None:
    """Build the lineage's tiny base model if it is not there yet (real bases must already exist)."""
    from pathlib import Path

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    apply_torch_threads()

    with session_scope(get_engine()) as session:
        champion = get_champion(session=session, lineage=lineage)
        if champion is None:
            raise RatchetError(f"lineage {lineage!r} has no champion: run `ratchet init` first")
        spec = ModelSpec.model_validate(champion.base_model.spec)
        path = Path(champion.base_model.path)
    if (path / "config.json").is_file():  # never rebuilt in place: the lineage's adapters were trained on it
        return
    if spec.base.tiny is None:
        raise RatchetError(f"base model directory {path} is missing (no config.json)")

    config = spec.base.tiny.to_tiny_model_config()
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("loss {task.fields[loss]:.3f}"),
        transient=True,
    ) as bar:
        task = bar.add_task("bootstrap the tiny base model", total=config.bootstrap_steps, loss=float("nan"))
        build_tiny_model(
            config=config,
            corpus_texts=training_corpus(config.corpus_size, config.seed),
            output_dir=path,
            progress=lambda step, total, loss: bar.update(task, completed=step, loss=loss),
        )
    typer.echo(f"built the tiny base model at {path}")


@app.command("promote")
def promote_cmd(
    generation: Annotated[int, typer.Argument(help="Generation number.")],
    lineage: LineageOpt = "main",
    reason: Annotated[str, typer.Option(help="Why (kept in the audit log).")] = "manual override",
) -> None:
    """Make GENERATION the champion by hand (audited); refused when it makes no sense."""

    with session_scope(get_engine()) as session:
        gen = get_generation(session=session, number=generation, lineage=lineage)
        if gen.status in ("candidate", "evaluating"):
            raise RatchetError(
                f"generation {generation} is still being built ({gen.status}): let `ratchet advance` "
                "finish it first"
            )
        promote_generation(session=session, generation=gen, reason=f"manual: {reason}", actor="cli")
    sync_champion_aliases(lineage=lineage, tracker=make_tracker)  # after the commit: the registry decides
    typer.echo(f"generation {generation} is now the champion of {lineage!r}")


@app.command("rollback")
def rollback_cmd(lineage: LineageOpt = "main") -> None:
    """Retire the champion and restore its parent (audited)."""

    with session_scope(get_engine()) as session:
        number = rollback_champion(session=session, lineage=lineage, actor="cli").number
    sync_champion_aliases(lineage=lineage, tracker=make_tracker)
    typer.echo(f"rolled back: generation {number} is the champion of {lineage!r} again")


@app.command("abandon")
def abandon_cmd(
    lineage: LineageOpt = "main",
    reason: Annotated[
        str, typer.Option(help="Why (kept with the generation and in the audit log).")
    ] = "abandoned by the operator",
) -> None:
    """Fail the lineage's in-flight candidate (audited); the next `ratchet advance` starts a new one."""

    if not reason.strip() or len(reason) > MAX_REASON:
        raise RatchetError(f"--reason: give one, of at most {MAX_REASON} characters")

    with session_scope(get_engine()) as session:
        gen = abandon_generation(session=session, lineage=lineage, reason=reason, actor="cli")
        number, step = gen.number, gen.step
    done = f" (its last step done: {step})" if step else ""
    typer.echo(
        f"generation {number} of {lineage!r} is abandoned{done}: the next `ratchet advance` starts anew"
    )


@app.command("sync-aliases")
def sync_aliases_cmd(lineage: LineageOpt = "main") -> None:
    """Point MLflow's `champion` aliases at the registry's champion (after MLflow was unreachable)."""

    count = sync_champion_aliases(lineage=lineage, tracker=make_tracker)
    typer.echo(f"{count} champion alias(es) of {lineage!r} match the registry")


@app.command("demo")
@with_config(AdvanceConfig, names=ADVANCE_FLAGS)
def demo_cmd(
    config: AdvanceConfig,
    generations: Annotated[int, typer.Option(min=1, help="Advancement cycles.")] = 5,
) -> None:
    """The whole loop on embedded defaults: build the tiny base, register generation 0, advance, show the lineage."""
    import time

    lineage = config.lineage

    started = time.perf_counter()
    settings = get_settings()
    demo = demo_specs()
    result = init_lineage(
        contract_path=demo["contract"],
        harness_path=demo["harness"],
        model_path=demo["model"],
        lineage=lineage,
    )
    typer.echo(result.describe())
    ensure_base_model(lineage)
    run_advance(generations, config)
    print_lineage(lineage)
    rows = [r for r in lineage_summary(lineage).generations if r.overall is not None]
    if rows:
        first, best = rows[0], max(rows, key=lambda r: r.overall if r.status == "promoted" else -1)
        typer.echo(
            f"held-out contract score: generation {first.number} {first.overall:.3f} -> "
            f"champion (generation {best.number}) {best.overall:.3f}"
        )
    typer.echo(f"demo finished in {time.perf_counter() - started:.0f}s. Next:")
    typer.echo("  ratchet lineage --json                       # the lineage as JSON")
    typer.echo(f"  mlflow ui --backend-store-uri {settings.tracking_uri}   # runs, loss curves, adapters")
    typer.echo(
        "  ratchet serve                                # the champion behind an OpenAI-compatible API"
    )
    typer.echo(
        "  ratchet dashboard                            # the lineage and why it moved: http://127.0.0.1:8100/"
    )
