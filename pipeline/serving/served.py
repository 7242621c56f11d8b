"""What a server serves: a generation from the registry, loaded behind an engine (``load_served``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pipeline.errors import NotFoundError, RatchetError

if TYPE_CHECKING:  # imported where used: the CLI reads ServeConfig without loading the harness or torch
    from pipeline.serving.adapters import AdapterSource
    from pipeline.serving.engines import Engine
    from pipeline.serving.router import TokenClassifier
    from pipeline.serving.scheduler import MicroBatchScheduler
    from pipeline.specs.harness import HarnessSpec

log = logging.getLogger(__name__)


@dataclass
class ServeConfig:
    """How ``ratchet serve`` runs (CLI options map one to one; their defaults are these)."""

    registry_url: str | None = None
    lineage: str = "main"
    generation: str = "champion"  # "champion" (follows promotions) or a generation number
    engine: Literal["embedded", "external"] = "embedded"
    engine_url: str | None = None
    engine_api_key: str | None = None
    engine_model_template: str = "{specialist}"  # external engine's model name for an adapter
    max_batch_size: int = 32
    max_wait_ms: float = 5.0
    poll_seconds: float = 5.0  # 0: only POST /admin/reload switches generations
    api_key: str | None = None
    # Serve requests without a key (`anonymous`, chat scope only) even when keys exist; with no key at all
    # anonymous requests are served anyway (on loopback: the CLI refuses another host without a key).
    allow_anonymous: bool = False
    device: str = "auto"
    model_name: str = "ratchet"
    flush_seconds: float = 0.5
    summary_tokens: int = 24
    threads: int = 0  # torch intra-op threads for the embedded engine; 0: torch's default
    # Request limits. A body is counted while it is read: a larger one is refused (413) before it is
    # buffered. 4 MiB holds a 128k-token conversation of ordinary text with room for tools.
    max_body_bytes: int = 4 << 20
    # Chat requests admitted at once (waiting for a batch or decoding); one more gets 429 with Retry-After
    # (503 while the server is stopping or loading a new generation). 0: no limit.
    max_queue: int = 256
    request_timeout_s: float = 300.0  # a turn still decoding after this is stopped (504); 0: none
    max_lora_rank: int = 64  # adapters of a higher rank are refused when loaded
    # Adapters kept attached at once (least recently used evicted, attached again on demand); 0: all.
    max_loaded_adapters: int = 0
    # Directories besides the artifact store that --expose-adapters' /v1/load_lora_adapter loads from
    # (any other path is refused, 400).
    adapter_roots: tuple[str, ...] = ()
    # Slow and hostile clients (issue 22); 0 turns each off. A request's headers must arrive within
    # header_timeout_s of the connection (or of the previous answer on a kept-alive one), its body within
    # body_timeout_s in all and with no gap of body_idle_s: else 408 and the connection is closed. Chat
    # turns are admitted only once their body is in, so a slow client holds no turn's place.
    header_timeout_s: float = 20.0
    body_timeout_s: float = 60.0
    body_idle_s: float = 15.0
    # Open connections of one client address (one more: 429 and closed; behind a reverse proxy every client
    # shares its address) and requests in flight per API key (one more: 429 before its body is read).
    max_connections_per_client: int = 1024
    max_requests_per_key: int = 256
    # POST /v1/feedback at once (each holds a body and may score its turn again; one more: 429), and how
    # long re-scoring one turn may take: a scoring still running then is stored as not verified.
    max_feedback: int = 8
    rescore_timeout_s: float = 10.0
    # Served turns not in the registry yet (a registry outage or lock) are kept in the write-ahead spool
    # (``pipeline.serving.spool``, and in memory) up to this many bytes; past it new chat turns get 503
    # with Retry-After instead of being answered and lost. 0: no limit.
    spool_max_bytes: int = 64 << 20
    spool_dir: str | None = None  # None: <home>/spool/<registry key>
    # False: turns wait for the registry in memory only (a crash or a kill loses them); benchmarks compare.
    spool: bool = True

    def follows_champion(self) -> bool:
        return self.generation == "champion"


@dataclass
class Served:
    """A loaded generation: ids for experience records, its harness, and the engine that decodes it."""

    generation_id: int
    number: int
    harness_version_id: int
    harness: HarnessSpec
    engine: Engine
    specialists: list[str]
    classifier: TokenClassifier | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # external engine: its model name -> the sha256 of the adapter it must serve under that name
    engine_adapters: dict[str, str] = field(default_factory=dict)
    plan: GenerationPlan | None = None


@dataclass(frozen=True)
class GenerationPlan:
    """Everything ``load_served`` needs, read from the registry in one session."""

    generation_id: int
    number: int
    harness_version_id: int
    harness_spec: dict[str, Any]
    base_model_id: int
    base_path: str
    specialists: list[str]
    adapters: list[AdapterSource]
    state: dict[str, Any]
    model_spec: dict[str, Any] | None = None  # the base's model spec (dtype, tokenizer)


def plan_generation(db: Any, lineage: str, which: str) -> GenerationPlan:
    """Read the generation to serve (``champion`` or a number) from the registry (``db``: an engine)."""
    from pipeline.registry import get_champion, get_generation, session_scope
    from pipeline.serving.adapters import AdapterSource

    with session_scope(db) as session:
        if which == "champion":
            gen = get_champion(session=session, lineage=lineage)
            if gen is None:
                raise NotFoundError(
                    f"lineage {lineage!r} has no champion to serve: promote a generation or pass --generation N"
                )
        else:
            try:
                number = int(which)
            except ValueError:
                raise RatchetError(f"--generation must be `champion` or a number, not {which!r}") from None
            gen = get_generation(session=session, number=number, lineage=lineage)
        adapters = [
            AdapterSource(
                specialist=slot.specialist,
                path=Path(slot.adapter.artifact_uri),
                sha256=slot.adapter.sha256,
                rank=slot.adapter.rank,
                target_modules=tuple(slot.adapter.target_modules),
                base_model_id=slot.adapter.base_model_id,
            )
            for slot in gen.adapters
            if slot.adapter is not None
        ]
        return GenerationPlan(
            generation_id=gen.id,
            number=gen.number,
            harness_version_id=gen.harness_version_id,
            harness_spec=dict(gen.harness_version.spec),
            base_model_id=gen.base_model_id,
            base_path=gen.base_model.path,
            specialists=[slot.specialist for slot in gen.adapters],
            adapters=adapters,
            state=dict(gen.state or {}),
            model_spec=dict(gen.base_model.spec or {}),
        )


def champion_id(db: Any, lineage: str) -> int | None:
    from pipeline.registry import get_champion, session_scope

    with session_scope(db) as session:
        gen = get_champion(session=session, lineage=lineage)
        return gen.id if gen is not None else None


def load_served(plan: GenerationPlan, config: ServeConfig, scheduler: MicroBatchScheduler) -> Served:
    """Load ``plan`` behind the configured engine (blocking: call it in a thread from async code)."""
    from pipeline.serving.engines import EmbeddedEngine, ExternalEngine
    from pipeline.serving.router import TokenClassifier
    from pipeline.serving.runtime import load_runtime
    from pipeline.specs.harness import HarnessSpec

    try:
        harness = HarnessSpec.model_validate(plan.harness_spec)
    except ValueError as exc:
        raise RatchetError(f"generation {plan.number}: its harness does not validate: {exc}") from None
    missing = [s for s in harness.specialists if s not in plan.specialists]
    specialists = plan.specialists + missing  # harness-only specialists are served by the base model
    classifier = None
    if isinstance(plan.state.get("router_classifier"), dict):
        classifier = TokenClassifier.from_dict(plan.state["router_classifier"])
    if config.engine == "embedded":
        if config.threads > 0:
            import torch

            torch.set_num_threads(config.threads)
        from pipeline.modeling.placement import placement, tokenizer_dir
        from pipeline.specs.modelspec import ModelSpec

        spec = ModelSpec.model_validate(plan.model_spec) if plan.model_spec else None
        runtime = load_runtime(
            plan.base_path,
            plan.adapters,
            specialists=specialists,
            base_model_id=plan.base_model_id,
            where=placement(dtype=spec.dtype if spec else "auto", device=config.device),
            tokenizer_dir=tokenizer_dir(spec.tokenizer if spec else "same_as_base", plan.base_path),
            tool_call_format=harness.tool_call_format,
            max_rank=config.max_lora_rank,
            max_loaded=config.max_loaded_adapters or None,
        )
        engine: Engine = EmbeddedEngine(runtime, scheduler)
    else:
        if not config.engine_url:
            raise RatchetError(
                "--engine external needs --engine-url (the OpenAI-compatible multi-LoRA server)"
            )
        from pipeline.modeling.placement import tokenizer_dir

        tokenizer, limit = None, None
        tok_dir = tokenizer_dir(str((plan.model_spec or {}).get("tokenizer", "same_as_base")), plan.base_path)
        if (tok_dir / "tokenizer.json").is_file() or (tok_dir / "tokenizer_config.json").is_file():
            from transformers import AutoConfig, AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tok_dir)
            limit = getattr(AutoConfig.from_pretrained(plan.base_path), "max_position_embeddings", None)
        engine = ExternalEngine(
            config.engine_url,
            model_names=engine_model_names(config, specialists, plan.number),
            api_key=config.engine_api_key,
            context_limit=limit,
            tokenizer=tokenizer,
        )
    log.info("serving generation %d (%s) with %s engine", plan.number, ", ".join(specialists), config.engine)
    names = getattr(engine, "model_names", {})
    return Served(
        generation_id=plan.generation_id,
        number=plan.number,
        harness_version_id=plan.harness_version_id,
        harness=harness,
        engine=engine,
        specialists=specialists,
        classifier=classifier,
        engine_adapters={names[a.specialist]: a.sha256 for a in plan.adapters if a.specialist in names},
        plan=plan,
    )


def engine_model_names(config: ServeConfig, specialists: list[str], number: int) -> dict[str, str]:
    """Each specialist's model name on the external engine (``--engine-model``)."""
    try:
        return {s: config.engine_model_template.format(specialist=s, generation=number) for s in specialists}
    except (KeyError, IndexError, ValueError) as exc:
        raise RatchetError(
            f"--engine-model {config.engine_model_template!r}: {exc!r}; the fields are {{specialist}} and "
            "{generation}"
        ) from None


async def sync_engine_adapters(served: Served, *, previous: Served | None) -> set[str]:
    """Make the external engine serve ``served``'s adapters under their model names before any turn goes
    to them: a name the engine lacks is loaded (``ExternalEngine.load_adapter``, vLLM's runtime LoRA
    loading). A name it has is taken as is, unless ``previous`` (the generation served now) has a different
    adapter under it: the engine would serve the old weights. Returns the names loaded; on a failure the
    ones loaded here are unloaded again and ``RatchetError`` says why."""
    engine: Any = served.engine
    plan = served.plan
    assert plan is not None
    present = await engine.model_ids()
    before = previous.engine_adapters if previous is not None else {}
    loaded: list[str] = []
    try:
        for src in plan.adapters:
            name = engine.model_names[src.specialist]
            if name in present:
                if before.get(name, src.sha256) != src.sha256:
                    raise RatchetError(
                        f"the external engine serves generation {previous.number}'s {src.specialist} adapter "  # type: ignore[union-attr]
                        f"as {name!r}, and generation {served.number}'s differs: put {{generation}} in "
                        "--engine-model so both can be loaded side by side"
                    )
                continue
            await engine.load_adapter(name, src)
            loaded.append(name)
            log.info("external engine loaded %s from %s", name, src.path)
    except BaseException:
        for name in loaded:
            try:
                await engine.unload_adapter(name)
            except Exception as exc:  # the engine is gone: nothing more to undo
                log.warning("could not unload %s again: %s", name, exc)
        raise
    return set(loaded)
