"""``ratchet contract ...``: lint spec files, print their JSON Schemas, dry-run scoring."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from pipeline.cli.advance import ensure_base_model
from pipeline.cli.app import app
from pipeline.errors import NotFoundError, RatchetError
from pipeline.gates.suites import suite_problems
from pipeline.loop.adoption import adopt_contract
from pipeline.loop.founding import require_clean_tasks
from pipeline.modeling.probes import check_template, spec_dirs, spec_tokenizer
from pipeline.scoring import TOTAL, score_trace, summarise_results
from pipeline.specs.compatibility import check_harness
from pipeline.specs.contract import ContractSpec, load_contract, verify_files
from pipeline.specs.harness import HarnessSpec, load_harness
from pipeline.specs.loading import (
    SpecError,
    SpecIssue,
    content_hash,
    parse_yaml,
    read_spec_text,
    validate_spec_text,
)
from pipeline.specs.modelspec import ModelSpec, load_model_spec

contract_app = typer.Typer(
    help="HCP contracts, harnesses and model specs: lint, JSON Schemas, dry-run scoring.",
    no_args_is_help=True,
)
app.add_typer(contract_app, name="contract")

KINDS = ("contract", "harness", "model")
_KEYS = {
    "contract": ("protocol", "promotion", "selection", "heldout", "default_specialist"),
    "harness": ("routing", "tools", "context", "tool_call_format"),
    "model": ("base", "tokenizer", "dtype"),
}
_DIRS = {"contracts": "contract", "harnesses": "harness", "models": "model"}


def _model_for(kind: str) -> type:

    return {"contract": ContractSpec, "harness": HarnessSpec, "model": ModelSpec}[kind]


def detect_kind(path: Path, data: Any) -> str | None:
    """Guess a spec file's kind from its top-level keys, then from its folder name."""
    if isinstance(data, dict):
        for kind, keys in _KEYS.items():
            if any(k in data for k in keys):
                return kind
    return _DIRS.get(path.resolve().parent.name)


def lint_file(path: Path, *, kind: str = "auto", contract: Any = None) -> tuple[list[str], Any, str | None]:
    """Lint one file: (issues as printable lines, the loaded spec or None, the kind)."""

    try:
        text = read_spec_text(path)  # bounded: a huge file is refused before it is read whole
        data, _ = parse_yaml(text, file=str(path))
    except SpecError as exc:
        return [str(i) for i in exc.issues], None, None
    if kind == "auto":
        detected = detect_kind(path, data)
        if detected is None:
            keys = "; ".join(f"{k}: {', '.join(v)}" for k, v in _KEYS.items())
            msg = f"cannot tell the spec kind (pass --kind; top-level keys that decide it: {keys})"
            return [str(SpecIssue(str(path), 1, "", msg))], None, None
        kind = detected
    try:
        spec = validate_spec_text(text, _model_for(kind), file=str(path))
    except SpecError as exc:
        return [str(i) for i in exc.issues], None, kind
    issues: list[str] = []
    if kind == "contract":
        # linted as a contract a lineage starts on: every specialist is judged by a suite or says it is not
        issues += [f"{path}: {problem}" for problem in spec.ungated_problems()]
        try:
            verify_files(spec, path)

            require_clean_tasks(spec, contract_path=path)  # generators exist, task files parse, none held out
            issues += [f"{path}: {problem}" for problem in suite_problems(spec, contract_path=path)]
        except RatchetError as exc:
            issues.append(str(exc))
    if kind == "harness" and contract is not None:
        issues += [f"{path}: {problem}" for problem in check_harness(spec, contract)]
    return issues, spec, kind


@contract_app.command("lint")
def lint(
    files: list[Path] = typer.Argument(..., help="YAML files (contracts, harnesses, model specs)."),
    kind: str = typer.Option(
        "auto", "--kind", help="contract | harness | model | auto (from keys / folder)."
    ),
    contract_file: Path | None = typer.Option(
        None, "--contract", help="Also check every harness against this contract's context protocol."
    ),
    model_file: Path | None = typer.Option(
        None,
        "--model",
        help="Also render every harness's probe conversations through this model's chat template.",
    ),
) -> None:
    """Validate spec files; print every problem as `file:line: field: message`. With a model spec among the
    files (or `--model`), every harness among them is probed through the model's chat template as `ratchet
    init` does (a system prompt, a tool result, the exemplars, several calls in one reply)."""

    if kind not in (*KINDS, "auto"):
        raise RatchetError(f"--kind must be one of contract, harness, model, auto (got {kind!r})")
    contract = load_contract(contract_file) if contract_file is not None else None
    failed, loaded = 0, []
    for path in files:
        issues, spec, found = lint_file(path, kind=kind, contract=contract)
        for issue in issues:
            typer.echo(issue)
        if issues:
            failed += 1
            continue
        loaded.append((path, spec, found))
        version = getattr(spec, "version", None)
        label = f"{spec.name} {version}" if version is not None else spec.name
        typer.echo(f"ok {path} ({label} {content_hash(spec)[:12]})")
    if model_file is not None:
        loaded.append((model_file, load_model_spec(model_file), "model"))
    failed += probe_templates(
        [(p, s) for p, s, k in loaded if k == "model"], [s for _, s, k in loaded if k == "harness"]
    )
    if failed:
        # A RatchetError, not typer.Exit: main() runs click in non-standalone mode, where Exit codes are lost.
        raise RatchetError(f"{failed} of {len(files)} file(s) failed lint")


def probe_templates(models: list[tuple[Path, Any]], harnesses: list[Any]) -> int:
    """Probe every harness through every model's chat template (``probes.check_template``); print one line
    per refusal or warning and an ``ok`` line per pair that passes; return the number of refusals."""

    refused = 0
    for path, model in models if harnesses else []:
        try:
            base_dir, tokenizer_dir = spec_dirs(model, path)
            tokenizer = spec_tokenizer(model, base_dir=base_dir, tokenizer_dir=tokenizer_dir)
        except RatchetError as exc:
            typer.echo(f"{path}: {exc}")
            refused += 1
            continue
        for harness in harnesses:
            specialists = sorted(set(model.specialists) & set(harness.specialists))
            try:
                warnings = check_template(tokenizer, harness, specialists=specialists, model=model.name,
                                          where=str(path))  # fmt: skip
            except RatchetError as exc:
                typer.echo(str(exc))
                refused += 1
                continue
            for warning in warnings:
                typer.echo(f"warning: {warning}")
            typer.echo(
                f"ok {path}: the chat template of {model.name} takes harness {harness.name} {harness.version}"
            )
    return refused


@contract_app.command("schema")
def schema(
    kind: str = typer.Option("contract", "--kind", help="contract | harness | model."),
) -> None:
    """Print the JSON Schema of a spec kind (for editor completion and validation)."""

    if kind not in KINDS:
        raise RatchetError(f"--kind must be one of {', '.join(KINDS)} (got {kind!r})")
    typer.echo(json.dumps(_model_for(kind).model_json_schema(by_alias=True), indent=2))


def read_traces(path: Path) -> list[dict[str, Any]]:
    """Read a JSONL file of traces; a bad line raises ``RatchetError`` naming its line number."""

    if not path.is_file():
        raise NotFoundError(f"{path}: traces file not found")
    traces = []
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                trace = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RatchetError(f"{path}:{n}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(trace, dict) or not isinstance(trace.get("messages"), list):
                raise RatchetError(f"{path}:{n}: expected an object with a `messages` list")
            traces.append(trace)
    return traces


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


@contract_app.command("score")
def score(
    contract_file: Path = typer.Argument(..., help="The contract YAML."),
    traces_file: Path = typer.Argument(..., help="Traces, one JSON object per line."),
    harness_file: Path | None = typer.Option(
        None,
        "--harness",
        help="Harness whose tools `tool_call` checks against (else only the expected call).",
    ),
    specialist: str | None = typer.Option(None, "--specialist", help="Score every turn as this specialist."),
    workers: int = typer.Option(4, "--workers", min=1, help="Traces scored concurrently."),
) -> None:
    """Dry run: score a JSONL file under a contract (no registry) and print per-scorer statistics."""
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    contract = load_contract(contract_file)
    harness = load_harness(harness_file) if harness_file is not None else None
    if specialist is not None and specialist not in contract.specialists:
        raise RatchetError(
            f"--specialist {specialist!r} is not in the contract ({', '.join(contract.specialists)})"
        )
    traces = read_traces(traces_file)
    console = Console()
    from concurrent.futures import ThreadPoolExecutor

    results = []
    with Progress(console=console, transient=True) as progress, ThreadPoolExecutor(workers) as pool:
        task = progress.add_task("scoring", total=len(traces))
        for res in pool.map(
            lambda t: score_trace(contract, t, harness=harness, specialist=specialist), traces
        ):
            results.append(res)
            progress.advance(task)
    stats = summarise_results(contract, results)
    table = Table(title=f"{contract.name} {contract.version}: {len(traces)} traces from {traces_file}")
    for col in ("scorer", "specialist", "n", "mean", "min", "max", "failures"):
        table.add_column(col, justify="right" if col not in ("scorer", "specialist") else "left")
    for s in stats:
        if s.scorer != TOTAL:
            table.add_row(
                s.scorer, s.specialist, str(s.n), _fmt(s.mean), _fmt(s.min), _fmt(s.max), str(s.failures)
            )
    console.print(table)
    threshold = contract.selection.min_score
    totals = Table(
        title=f"per specialist (learnable: final turn verified, no check failed, >= {threshold:g})"
    )
    for col in ("specialist", "traces", "scored", "mean total", "verified", "learnable"):
        totals.add_column(col, justify="left" if col == "specialist" else "right")
    for s in stats:
        if s.scorer == TOTAL:
            mine = [r for r in results if r.specialist == s.specialist]
            verified = [r for r in mine if r.verified]
            learnable = sum(1 for r in verified if r.learnable(threshold))
            totals.add_row(
                s.specialist, str(len(mine)), str(s.n), _fmt(s.mean), str(len(verified)), str(learnable)
            )
    console.print(totals)
    errors = [
        f"trace {i + 1} turn {t.turn} {k}: {e}"
        for i, r in enumerate(results)
        for t in r.turns
        for k, e in t.errors.items()
    ]
    if errors:
        console.print(f"[dim]{len(errors)} scorer messages; first: {errors[0]}[/dim]", highlight=False)


@contract_app.command("adopt")
def adopt(
    contract_file: Path = typer.Argument(..., help="The new version of the lineage's contract (YAML)."),
    lineage: str = typer.Option("main", "--lineage", help="The lineage that moves to it."),
    reason: str = typer.Option("contract adopted", "--reason", help="Why (kept in the audit log)."),
    release: list[str] = typer.Option(
        [],
        "--release",
        help="A retention suite of the current version to give up instead of carrying it (repeatable).",
    ),
) -> None:
    """Move a lineage to a new version of its contract without starting over: the suites the new version drops
    become retention suites, experience is scored under it, the champion is re-evaluated on its suites and
    moves to it (audited); the next `ratchet advance` builds and judges candidates under it."""
    from rich.progress import Progress

    if not reason.strip() or len(reason) > 500:
        raise RatchetError("--reason: give one, of at most 500 characters")
    ensure_base_model(lineage)  # the champion answers its new suites
    with Progress(transient=True) as bar:
        tasks: dict[str, Any] = {}

        def progress(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=total or None)
            bar.update(tasks[phase], completed=done, total=total or None)

        result = adopt_contract(
            contract_path=contract_file, lineage=lineage, actor="cli", reason=reason, release=release,
            progress=progress,
        )  # fmt: skip
    for line in result.describe():
        typer.echo(line)
