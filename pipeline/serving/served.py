"""What a server serves: a generation from the registry, loaded behind an engine (``load_served``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pipeline.errors import NotFoundError, RatchetError
from pipeline.knobs import described
from pipeline.modeling.placement import placement, tokenizer_dir
from pipeline.registry import get_champion, get_generation, session_scope
from pipeline.registry.documents import state_of
from pipeline.serving.adapters import AdapterSource
from pipeline.serving.engines import EmbeddedEngine, ExternalEngine
from pipeline.serving.router import TokenClassifier
from pipeline.serving.runtime import load_runtime
from pipeline.specs.harness import HarnessSpec
from pipeline.specs.modelspec import ModelSpec

if TYPE_CHECKING:  # imported where used: the CLI reads ServeConfig without loading the harness or torch
    from pipeline.registry.documents import GenerationState
    from pipeline.serving.engines import Engine
    from pipeline.serving.scheduler import MicroBatchScheduler

log = logging.getLogger(__name__)


@dataclass
class ServeConfig:
    """How ``ratchet serve`` runs. Each field's description and default are its option's help and default
    (``pipeline.cli.options``); ``SETTINGS_FIELDS`` come from ``pipeline.settings`` (environment), not options."""

    registry_url: str | None = described(None, "Registry database URL (RATCHET_DATABASE_URL).")
    lineage: str = described("main", "Lineage whose generation is served.")
    generation: str = described("champion", "`champion` (follows promotions live) or a generation number.")
    engine: Literal["embedded", "external"] = described(
        "embedded", "`embedded` (transformers + peft in this process) or `external`."
    )
    engine_url: str | None = described(None, "External OpenAI-compatible multi-LoRA server (vLLM, SGLang).")
    engine_api_key: str | None = described(
        None, "Key the external engine is called with (RATCHET_ENGINE_API_KEY)."
    )
    engine_model_template: str = described(
        "{specialist}",
        "Model name per adapter on the external engine (and of --expose-adapters); fields {specialist} "
        "{generation}. With {generation}, a new champion's adapters are loaded into the engine "
        "(/v1/load_lora_adapter) before turns go to them.",
    )
    max_batch_size: int = described(32, "Rows per mixed-adapter batch.", ge=1)
    max_wait_ms: float = described(5.0, "How long a batch waits to fill.", ge=0)
    poll_seconds: float = described(
        5.0, "Registry poll for a new champion; 0: only POST /admin/reload.", ge=0
    )
    api_key: str | None = described(None, "The operator's API key (RATCHET_API_KEY).")
    allow_anonymous: bool = described(
        False,
        "Serve requests without a key (as `anonymous`, chat scope only) even when keys exist. Without any "
        "key they are served anyway, on loopback only (the CLI refuses another host without a key).",
    )
    device: str = described("auto", "Torch device of the embedded engine (RATCHET_DEVICE).")
    model_name: str = described("ratchet", "The model name clients ask for (the routed pair).")
    flush_seconds: float = described(
        0.5, "Served turns are written to the registry in batches this often.", ge=0
    )
    summary_tokens: int = described(
        24, "Longest model-written summary of a reply (kept for later views).", ge=1
    )
    threads: int = described(
        0, "Torch CPU threads; 0: torch's default. A tiny model is fastest with 1.", ge=0
    )
    # Request limits. A body is counted while it is read: a larger one is refused (413) before it is
    # buffered. 4 MiB holds a 128k-token conversation of ordinary text with room for tools.
    max_body_bytes: int = described(
        4 << 20, "Largest request body; a larger one gets 413 while it is read. 0: none.", ge=0
    )
    max_queue: int = described(
        256,
        "Chat requests in flight at once (waiting for a batch or decoding); one more gets 429 with "
        "Retry-After (503 while the server stops or loads a generation). 0: none.",
        ge=0,
    )
    request_timeout_s: float = described(
        300.0, "A turn still decoding after this many seconds is stopped (504). 0: none.", ge=0
    )
    max_lora_rank: int = described(64, "Adapters of a higher rank are refused at load.", ge=1)
    max_loaded_adapters: int = described(
        0, "Adapters attached at once; the others are attached on demand (LRU). 0: all.", ge=0
    )
    adapter_roots: tuple[str, ...] = described(
        (),
        "Directory besides the artifact store that /v1/load_lora_adapter may load adapters from "
        "(--expose-adapters; repeatable). Any other path is refused.",
    )
    # Slow and hostile clients (issue 22); 0 turns each off. Chat turns are admitted only once their body
    # is in, so a slow client holds no turn's place.
    header_timeout_s: float = described(
        20.0,
        "A request's headers must arrive within this many seconds of the connection (or of the previous "
        "answer); else the connection is closed (408). 0: none.",
        ge=0,
    )
    body_timeout_s: float = described(
        60.0, "A request body must arrive within this many seconds (else 408). 0: none.", ge=0
    )
    body_idle_s: float = described(
        15.0, "Longest gap without a byte of a request body (else 408). 0: none.", ge=0
    )
    max_connections_per_client: int = described(
        1024,
        "Open connections from one client address; one more is answered 429 and closed (behind a reverse "
        "proxy every client shares its address). 0: none.",
        ge=0,
    )
    max_requests_per_key: int = described(
        256, "Requests in flight per API key; one more gets 429. 0: none.", ge=0
    )
    max_feedback: int = described(8, "POST /v1/feedback requests at once; one more gets 429. 0: none.", ge=0)
    rescore_timeout_s: float = described(
        10.0, "Re-scoring a turn after feedback that takes longer is stored as not verified. 0: none.", ge=0
    )
    spool_max_bytes: int = described(
        64 << 20,
        "Bytes of served turns kept in the write-ahead spool (pipeline.serving.spool) while the registry does "
        "not take them; past it new chat requests get 503 with Retry-After. 0: no limit.",
        ge=0,
    )
    spool_dir: str | None = described(
        None, "Directory of the write-ahead spool; default <home>/spool/<registry key>."
    )
    spool: bool = described(
        True,
        "Keep served turns in the write-ahead spool until the registry has them; --no-spool: in memory only "
        "(a crash or a kill loses them; benchmarks compare).",
    )

    def follows_champion(self) -> bool:
        return self.generation == "champion"


SETTINGS_FIELDS = ("registry_url", "api_key", "engine_api_key", "device")
"""The fields ``ratchet serve`` takes from ``pipeline.settings.Settings`` (the environment; a key is no option)."""


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
    state: GenerationState  # its stored state document (the learned router's classifier, if fitted)
    model_spec: dict[str, Any] | None = None  # the base's model spec (dtype, tokenizer)


def plan_generation(db: Any, lineage: str, which: str) -> GenerationPlan:
    """Read the generation to serve (``champion`` or a number) from the registry (``db``: an engine)."""

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
            state=state_of(gen),
            model_spec=dict(gen.base_model.spec or {}),
        )


def champion_id(db: Any, lineage: str) -> int | None:

    with session_scope(db) as session:
        gen = get_champion(session=session, lineage=lineage)
        return gen.id if gen is not None else None


def load_served(plan: GenerationPlan, config: ServeConfig, scheduler: MicroBatchScheduler) -> Served:
    """Load ``plan`` behind the configured engine (blocking: call it in a thread from async code)."""

    try:
        harness = HarnessSpec.model_validate(plan.harness_spec)
    except ValueError as exc:
        raise RatchetError(f"generation {plan.number}: its harness does not validate: {exc}") from None
    missing = [s for s in harness.specialists if s not in plan.specialists]
    specialists = plan.specialists + missing  # harness-only specialists are served by the base model
    classifier = None
    if plan.state.router_classifier is not None:
        classifier = TokenClassifier.from_dict(plan.state.router_classifier)
    if config.engine == "embedded":
        if config.threads > 0:
            import torch

            torch.set_num_threads(config.threads)

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
