"""Starting a lineage: register the contract, harness and base model, and create generation 0."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.errors import ConflictError, NotFoundError, RatchetError
from pipeline.gates.suites import require_counted
from pipeline.modeling.probes import check_template, spec_tokenizer
from pipeline.modeling.prompting import exemplar_messages
from pipeline.registry import (
    create_generation,
    get_engine,
    list_generations,
    promote_generation,
    register_base_model,
    register_contract,
    register_harness,
    session_scope,
    store_file,
)
from pipeline.registry.documents import evaluation_of
from pipeline.settings import get_settings
from pipeline.specs.compatibility import require_compatible
from pipeline.specs.contract import file_reader, load_contract, verify_files
from pipeline.specs.harness import load_harness
from pipeline.specs.heldout import heldout_index
from pipeline.specs.modelspec import base_hash, load_model_spec
from pipeline.specs.tasksource import FileTasks, task_sources

if TYPE_CHECKING:
    from pipeline.specs.contract import ContractSpec
    from pipeline.specs.harness import HarnessSpec
    from pipeline.specs.modelspec import ModelSpec


@dataclass(frozen=True)
class InitResult:
    """What ``init_lineage`` registered."""

    lineage: str
    generation: int
    created: bool
    contract: str
    harness: str
    base_model: str
    base_path: str
    specialists: list[str]

    def describe(self) -> str:
        verb = "created" if self.created else "already initialised:"
        return (
            f"lineage {self.lineage!r} {verb} generation {self.generation} (champion); contract {self.contract}, "
            f"harness {self.harness}, base {self.base_model} at {self.base_path}; "
            f"specialists: {', '.join(self.specialists)}"
        )


def require_clean_exemplars(
    harness: HarnessSpec, contract: ContractSpec, *, where: str, contract_path: Path | None = None
) -> None:
    """Refuse a harness whose few-shot exemplars contain a held-out prompt: the model would be prompted
    with it on every turn (and see its answer)."""

    index = heldout_index(contract, contract_path=contract_path)
    for name in harness.specialists:
        for i, messages in enumerate(exemplar_messages(harness, name)):
            found = index.exclusion(messages=messages)
            if found:
                raise RatchetError(
                    f"{where}: specialists.{name}.exemplars[{i}] {found} of contract {contract.name} "
                    f"{contract.version}: held-out items may never be shown to the model"
                )


def require_clean_tasks(contract: ContractSpec, *, contract_path: Path) -> dict[str, int]:
    """Build every specialist's task source (an unknown generator, bad options or a malformed task file stop
    here) and refuse task items that contain a held-out prompt: the model would practise on them. Every item
    of a task file is checked; a generator is checked on 200 items per split. Returns the number of items
    checked per specialist."""

    index = heldout_index(contract, contract_path=contract_path)
    counts = {}
    for name, source in task_sources(contract, read=file_reader(contract, contract_path)).items():
        seen = 0
        for split in ("train", "validation"):
            # a file is checked whole; a generator on a sample (collection checks every item it draws)
            drawn = source.splits[split] if isinstance(source, FileTasks) else source.items(split, 200, 0)
            for i, item in enumerate(drawn):
                found = index.exclusion(messages=item.get("messages") or [], metadata=item.get("metadata"))
                if found:
                    raise RatchetError(
                        f"{contract_path}: specialists.{name}.tasks: {split} item {i} {found}: held-out items "
                        "may never be practised on"
                    )
                seen += 1
        counts[name] = seen
    return counts


def require_template(
    model: ModelSpec, harness: HarnessSpec, *, model_path: Path, base_path: Path, specialists: list[str]
) -> list[str]:
    """Refuse a model whose chat template rejects a feature the harness uses (``probes.check_template``:
    a system prompt, a tool result, the exemplars, an exemplar's several calls in one reply), with one line
    naming it; returns the warnings (several calls in one reply, where no exemplar needs them)."""

    try:
        tokenizer = spec_tokenizer(
            model,
            base_dir=base_path if model.base.path is not None else None,
            tokenizer_dir=Path(model.tokenizer) if model.tokenizer != "same_as_base" else None,
        )
    except RatchetError as exc:
        raise RatchetError(f"{model_path}: {exc}") from None
    return check_template(
        tokenizer, harness, specialists=specialists, model=model.name, where=str(model_path)
    )


def base_model_dir(*, home: Path, name: str, spec_hash: str) -> Path:
    """Where the built tiny base model of a model spec lives (built on first use)."""
    return (home / "models" / f"{name}-{spec_hash[:12]}").resolve()


def init_lineage(
    *,
    contract_path: Path,
    harness_path: Path,
    model_path: Path,
    lineage: str = "main",
    actor: str = "user",
) -> InitResult:
    """Register the three specs (content-addressed) and create generation 0 as the lineage's champion.

    It makes the home (``RATCHET_HOME``) when it is missing (other commands refuse a missing home). Running it
    again with the same files is a no-op; with different files for an existing lineage it is refused (start
    another lineage with ``--lineage``). A model whose chat template rejects a feature the
    harness uses is refused (``require_template``), and so is a contract with a trained specialist that no
    held-out suite judges and that does not say ``ungated: true``, or a suite that repeats an item
    (``pipeline.gates.suites.require_counted``).
    """

    contract = load_contract(contract_path)
    harness = load_harness(harness_path)
    model = load_model_spec(model_path)
    require_compatible(harness, contract)
    require_clean_exemplars(harness, contract, where=str(harness_path), contract_path=contract_path)
    files = verify_files(contract, contract_path)  # a missing or changed file stops here, named
    require_clean_tasks(contract, contract_path=contract_path)
    specialists = sorted(model.specialists)
    for what, names in (("harness", harness.specialists), ("contract", contract.specialists)):
        missing = [s for s in specialists if s not in names]
        if missing:
            raise RatchetError(
                f"{model_path}: specialists {missing} have no entry in the {what} ({what} declares "
                f"{', '.join(sorted(names))})"
            )
    # every trained specialist judged by a held-out suite (or ungated, said), no suite repeating an item
    require_counted(contract, where=str(contract_path), contract_path=contract_path, specialists=specialists)
    untasked = [
        s
        for s in specialists
        if model.specialists[s].method == "grpo" and contract.specialists[s].tasks is None
    ]
    if untasked:
        raise RatchetError(
            f"{model_path}: specialists {untasked} train with method grpo, but the contract names no task source "
            "(`tasks`) for them: GRPO practises on a task source's training prompts"
        )
    home = get_settings().create_home()  # starting a lineage makes the home; other commands require it
    if model.base.path is not None:
        base_path = Path(model.base.path).expanduser()
        if not base_path.is_absolute():
            base_path = (Path(model_path).resolve().parent / base_path).resolve()
        if not (base_path / "config.json").is_file():
            raise NotFoundError(
                f"{model_path}: base.path {str(base_path)!r} is not a Hugging Face model directory (no config.json)"
            )
    else:
        base_path = base_model_dir(home=home, name=model.name, spec_hash=base_hash(model))
    if model.tokenizer != "same_as_base":  # stored resolved: later steps run from anywhere
        tok = Path(model.tokenizer).expanduser()
        tok = tok if tok.is_absolute() else (Path(model_path).resolve().parent / tok).resolve()
        if not (tok / "tokenizer_config.json").is_file() and not (tok / "tokenizer.json").is_file():
            raise NotFoundError(
                f"{model_path}: tokenizer {str(tok)!r} is not a tokenizer directory (no tokenizer.json or "
                "tokenizer_config.json)"
            )
        model = model.model_copy(update={"tokenizer": str(tok)})
    require_template(model, harness, model_path=model_path, base_path=base_path, specialists=specialists)

    with session_scope(get_engine()) as session:
        base = register_base_model(
            session=session,
            name=model.name,
            path=str(base_path),
            spec=model.model_dump(mode="json"),
            actor=actor,
        )
        hv = register_harness(
            session=session,
            name=harness.name,
            version=harness.version,
            spec=harness.model_dump(mode="json"),
            actor=actor,
        )
        cv = register_contract(
            session=session,
            name=contract.name,
            version=contract.version,
            spec=contract.model_dump(mode="json"),
            actor=actor,
        )
        for path in files.values():  # kept whole: nothing later needs the original files
            store_file(session=session, content=path.read_bytes())
        existing = list_generations(session=session, lineage=lineage)
        if existing:
            first = existing[0]
            # A champion moved by `ratchet contract adopt` keeps the version it started under in its record
            adopted = evaluation_of(first).adoptions
            started = adopted[0].from_.id if adopted else first.contract_version_id
            if (first.base_model_id, first.harness_version_id, started) != (
                base.id,
                hv.id,
                cv.id,
            ):
                raise ConflictError(
                    f"lineage {lineage!r} already exists with {len(existing)} generation(s) started from other "
                    "specs: start a new lineage with --lineage NAME"
                )
            created, number = False, first.number
        else:
            gen = create_generation(
                session=session,
                lineage=lineage,
                base_model_id=base.id,
                harness_version_id=hv.id,
                contract_version_id=cv.id,
                specialists=specialists,
                actor=actor,
            )
            promote_generation(
                session=session,
                generation=gen,
                actor=actor,
                reason="generation 0: the base model under the initial harness",
            )
            created, number = True, gen.number
    return InitResult(
        lineage=lineage,
        generation=number,
        created=created,
        contract=f"{contract.name} {contract.version}",
        harness=f"{harness.name} {harness.version}",
        base_model=model.name,
        base_path=str(base_path),
        specialists=specialists,
    )
