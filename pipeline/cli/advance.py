"""Generation commands: advance, lineage, promote, rollback, demo."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from pipeline.cli.app import app
from pipeline.errors import RatchetError
from pipeline.loop.candidate import AdvanceConfig

LineageOpt = Annotated[str, typer.Option(help="Lineage name.")]
PromptsOpt = Annotated[
    int, typer.Option(min=1, help="Practice prompts per specialist per cycle, from its contract task source.")
]
SamplesOpt = Annotated[int, typer.Option(min=1, help="Sampled attempts per prompt.")]
MAX_REASON = 500  # an operator's reason, as the dashboard's form takes it


def lineage_rows(lineage: str) -> list[dict[str, Any]]:
    """The lineage as plain data (what `ratchet lineage --json` prints)."""
    from pipeline.gates.transfer import lineage_matrix
    from pipeline.loop.discovery import discovery_summary
    from pipeline.registry import get_engine, list_generations, session_scope

    rows = []
    with session_scope(get_engine()) as session:
        gens = list_generations(session=session, lineage=lineage)
        numbers = {g.id: g.number for g in gens}
        matrix = lineage_matrix(session, lineage, gens)
        for g in gens:
            ev = g.evaluation or {}
            steps = (g.state or {}).get("steps") or {}
            curate = steps.get("curate") or {}
            rows.append(
                {
                    "generation": g.number,
                    "parent": numbers.get(g.parent_id),
                    "status": g.status,
                    "harness": g.harness_version.version,
                    "adapters": {
                        a.specialist: (f"v{a.adapter.version}" if a.adapter else None) for a in g.adapters
                    },
                    "methods": {a.specialist: (a.adapter.method if a.adapter else None) for a in g.adapters},
                    "scores": ev.get("scores", {}),
                    "overall": ev.get("overall"),
                    "router_accuracy": (ev.get("router") or {}).get("accuracy"),
                    "attempt": ev.get("attempt"),
                    "unscored": ev.get("unscored") or {},  # held-out items left out: unscored on a pair
                    # the accuracy matrix's row (held-out and retention suites) and backward transfer
                    # (pipeline.gates.transfer), and the KL of each specialist to the base and to its parent
                    "accuracy": matrix["rows"][g.number],
                    "backward_transfer": matrix["backward_transfer"][g.number],
                    "divergence": ev.get("divergence") or {},
                    "curation": {
                        "kept": {s: d.get("rows", 0) for s, d in (curate.get("datasets") or {}).items()},
                        "dropped": curate.get("dropped") or {},
                        "dropped_by_principal": curate.get("dropped_by_principal") or {},
                    },
                    "discovery": discovery_summary(steps.get("discover"), ev.get("discovery")),
                    "decision": g.decision,
                    "step": g.step,
                    "seconds": (g.state or {}).get("seconds") or {},
                    "created_at": g.created_at.isoformat(),
                }
            )
    return rows


def describe_discovery(found: dict[str, dict[str, Any]]) -> str:
    """One line: per specialist, the variants discovery found and how champion and candidate answer them."""
    parts = []
    for s, d in sorted(found.items()):
        if d.get("found"):
            scores = (
                f" ({d['champion']:.2f} -> {d['candidate']:.2f})"
                if d.get("champion") is not None and d.get("candidate") is not None
                else ""
            )
            parts.append(f"{s} {d['found']}/{d['tried']}{scores}")
    return "variants found (champion -> candidate, greedy): " + ", ".join(parts)


def print_lineage(lineage: str) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = lineage_rows(lineage)
    if not rows:
        raise RatchetError(f"lineage {lineage!r} has no generations: run `ratchet init`")
    specialists = sorted({s for r in rows for s in r["adapters"]})
    table = Table(title=f"lineage {lineage}", show_lines=False)
    for col in ("gen", "parent", "status", "harness", *specialists, "overall", "router", "decision"):
        table.add_column(
            col, overflow="fold", max_width=56 if col == "decision" else None, no_wrap=col != "decision"
        )
    for r in rows:
        cells = []
        for s in specialists:
            score = r["scores"].get(s)
            adapter = r["adapters"].get(s) or "-"
            if r["methods"].get(s) not in (None, "sft"):
                adapter += f" {r['methods'][s]}"
            cells.append(f"{adapter} {score:.3f}" if score is not None else adapter)
        overall = f"{r['overall']:.3f}" if r["overall"] is not None else "-"
        router = f"{r['router_accuracy']:.2f}" if r["router_accuracy"] is not None else "-"
        style = "bold green" if r["status"] == "promoted" else None
        table.add_row(
            str(r["generation"]),
            "-" if r["parent"] is None else str(r["parent"]),
            r["status"],
            r["harness"],
            *cells,
            overall,
            router,
            r["decision"] or "",
            style=style,
        )
    console = Console()
    if not console.is_terminal:  # a log or a pipe: do not squeeze the table into 80 columns
        console = Console(width=160)
    console.print(table)
    champion = next((r for r in rows if r["status"] == "promoted"), None)
    if champion is not None and champion["backward_transfer"]:  # pipeline.gates.transfer
        console.print(
            f"champion (generation {champion['generation']}) per suite, backward transfer since the suite was "
            "first measured on its line: "
            + ", ".join(
                f"{suite} {champion['accuracy'][suite]:.3f} ({value:+.3f})"
                for suite, value in sorted(champion["backward_transfer"].items())
            ),
            highlight=False,
        )
    if champion is not None and champion["divergence"]:  # pipeline.gates.divergence
        console.print(
            "champion's mean per-token KL to the base model (nats, on its held-out answers): "
            + ", ".join(f"{s} {d['kl_to_base']:.4f}" for s, d in sorted(champion["divergence"].items())),
            highlight=False,
        )


@app.command("lineage")
def lineage_cmd(
    lineage: LineageOpt = "main",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Show every generation: parent, status, harness, adapters, held-out scores and the decision."""
    if as_json:
        typer.echo(json.dumps(lineage_rows(lineage), indent=2))
    else:
        print_lineage(lineage)


def make_tracker():
    """The MLflow tracker on the configured store (None if tracking is disabled)."""
    from pipeline.registry.tracking import MLflowTracker

    return MLflowTracker.from_settings()


def run_advance(generations: int, config: Any) -> list[dict[str, Any]]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from flows import advance_generation

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
                    r["discovery"]
                    for r in lineage_rows(config.lineage)
                    if r["generation"] == outcome["generation"]
                ),
                {},
            )
            if any(d.get("found") for d in found.values()):
                typer.echo("  discovery: " + describe_discovery(found))
            outcomes.append(outcome)
    return outcomes


@app.command("advance")
def advance_cmd(
    generations: Annotated[int, typer.Option(min=1, help="Advancement cycles to run.")] = 1,
    lineage: LineageOpt = "main",
    prompts: PromptsOpt = AdvanceConfig.prompts_per_specialist,
    samples: SamplesOpt = AdvanceConfig.samples_per_prompt,
    collect: Annotated[
        bool,
        typer.Option(
            help="Practise on the task source; --no-collect learns from served and ingested experience only."
        ),
    ] = AdvanceConfig.collect,
    codesign: Annotated[
        bool, typer.Option(help="Try harness variants with the new adapters.")
    ] = AdvanceConfig.codesign,
    seed: Annotated[
        int, typer.Option(help="Seed of sampling, data order and initialisation.")
    ] = AdvanceConfig.seed,
) -> None:
    """Build the next generation(s) from the champion; promote each only if it beats its parent."""
    config = AdvanceConfig(
        lineage=lineage,
        prompts_per_specialist=prompts,
        samples_per_prompt=samples,
        collect=collect,
        codesign=codesign,
        seed=seed,
    )
    ensure_base_model(lineage)
    run_advance(generations, config)
    print_lineage(lineage)


def ensure_base_model(lineage: str) -> None:
    """Build the lineage's tiny base model if it is not there yet (real bases must already exist)."""
    from pathlib import Path

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from pipeline.registry import get_champion, get_engine, session_scope
    from pipeline.settings import apply_torch_threads
    from pipeline.specs.modelspec import ModelSpec

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
    from pipeline.environment import training_corpus
    from pipeline.environment.tinymodel import build_tiny_model

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
    from pipeline.loop.promotion import sync_champion_aliases
    from pipeline.registry import get_engine, get_generation, promote_generation, session_scope

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
    from pipeline.loop.promotion import sync_champion_aliases
    from pipeline.registry import get_engine, rollback_champion, session_scope

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
    from pipeline.registry import get_engine, session_scope
    from pipeline.registry.generations import abandon_generation

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
    from pipeline.loop.promotion import sync_champion_aliases

    count = sync_champion_aliases(lineage=lineage, tracker=make_tracker)
    typer.echo(f"{count} champion alias(es) of {lineage!r} match the registry")


@app.command("demo")
def demo_cmd(
    generations: Annotated[int, typer.Option(min=1, help="Advancement cycles.")] = 5,
    prompts: PromptsOpt = AdvanceConfig.prompts_per_specialist,
    samples: SamplesOpt = AdvanceConfig.samples_per_prompt,
    seed: Annotated[int, typer.Option(help="Seed of the run.")] = AdvanceConfig.seed,
    lineage: LineageOpt = "main",
) -> None:
    """The whole loop on embedded defaults: build the tiny base, register generation 0, advance, show the lineage."""
    import time

    from pipeline.cli.core import REPO_ROOT as root
    from pipeline.loop.founding import init_lineage
    from pipeline.settings import get_settings

    started = time.perf_counter()
    settings = get_settings()
    result = init_lineage(
        contract_path=root / "contracts" / "demo.yaml",
        harness_path=root / "harnesses" / "demo.yaml",
        model_path=root / "models" / "tiny.yaml",
        lineage=lineage,
    )
    typer.echo(result.describe())
    ensure_base_model(lineage)
    config = AdvanceConfig(
        lineage=lineage, prompts_per_specialist=prompts, samples_per_prompt=samples, seed=seed
    )
    run_advance(generations, config)
    print_lineage(lineage)
    rows = [r for r in lineage_rows(lineage) if r["overall"] is not None]
    if rows:
        first, best = rows[0], max(rows, key=lambda r: r["overall"] if r["status"] == "promoted" else -1)
        typer.echo(
            f"held-out contract score: generation {first['generation']} {first['overall']:.3f} -> "
            f"champion (generation {best['generation']}) {best['overall']:.3f}"
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
