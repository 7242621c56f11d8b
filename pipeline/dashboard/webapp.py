"""The dashboard's web app: server-rendered pages and the JSON API that mirrors them.

Each view is one function that returns data (``lineage``, ``experience``, ``records`` compute it); it is
served twice, as JSON under ``/api/...`` and as a page rendered by a Jinja2 template with autoescaping.
Nothing is loaded from elsewhere: the style sheet is served by the app, charts are SVG drawn on the server
(``charts``), and there is no script. ``/api/openapi.json`` is the OpenAPI schema and ``/api/docs`` its
reference rendered here (FastAPI's own docs page loads Swagger UI from a CDN, so it is off).

No ``from __future__ import annotations`` here: FastAPI reads the handlers' annotations at run time.
"""

import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Annotated, TypeVar
from urllib.parse import quote

from fastapi import Depends, FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from jinja2 import Environment, FileSystemLoader, select_autoescape
from pydantic import BaseModel
from sqlalchemy.orm import Session, sessionmaker
from starlette.middleware.trustedhost import TrustedHostMiddleware

from pipeline.dashboard import (
    charts,
    comparison,
    conversation,
    experience,
    overview,
    provenance,
    records,
    reference,
    trace,
)
from pipeline.dashboard import lineage as lineage_data
from pipeline.dashboard.actions import action_routes
from pipeline.dashboard.evidence import GenerationDetail, Trends
from pipeline.dashboard.replies import (
    AdapterDetail,
    ArtifactDirectory,
    ArtifactEntry,
    AuditPage,
    ExperiencePage,
    HeldOutItem,
    ItemComparison,
    QuarantinePage,
    TraceDetail,
    VersionDetail,
    VersionDiff,
    VersionList,
)
from pipeline.dashboard.security import (
    COOKIE,
    HEADERS,
    MAX_BYTES,
    MAX_ID,
    TEXT_SUFFIXES,
    Access,
    ForbiddenError,
    Id,
    artifact_file,
)
from pipeline.errors import ConflictError, NotFoundError, RatchetError
from pipeline.registry import get_engine
from pipeline.registry.summaries import LineageSummary
from pipeline.settings import Settings, get_settings

log = logging.getLogger(__name__)
HERE = Path(__file__).resolve().parent

__all__ = ["create_app"]

View = TypeVar("View", bound=Callable[..., object])


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def conversation_url(conversation_id: str, lineage: str | None = None) -> str:
    """The conversation page of ``conversation_id`` (in ``lineage``), every character of the id quoted; the id
    ``.`` or ``..`` (a path segment a browser would resolve away) links to the experience list filtered by it."""
    cid = quote(conversation_id, safe="")
    url = f"/experience?conversation={cid}&" if conversation_id in (".", "..") else f"/conversations/{cid}?"
    return url + (f"lineage={quote(lineage, safe='')}" if lineage else "")


def _templates() -> Environment:
    env = Environment(
        loader=FileSystemLoader(HERE / "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    # numbers from the registry, or whatever an untrusted trace put where a number belongs (shown as text)
    env.filters["num"] = lambda v, d=3: f"{v:.{d}f}" if _number(v) else ("–" if v is None else str(v))
    env.filters["signed"] = lambda v, d=3: f"{v:+.{d}f}" if _number(v) else ("–" if v is None else str(v))
    env.filters["pct"] = lambda v: f"{100 * v:.1f}%" if _number(v) else ("–" if v is None else str(v))
    env.filters["short"] = lambda v, n=12: "" if v is None else str(v)[:n]
    env.filters["pretty"] = lambda v: __import__("json").dumps(v, indent=2, ensure_ascii=False, default=str)
    env.filters["conversation_url"] = conversation_url
    return env


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def create_app(
    settings: Settings | None = None,
    *,
    lineage_name: str = "main",
    allowed_hosts: Sequence[str] = LOOPBACK_HOSTS,
    trusted_proxies: Sequence[str] = (),
) -> FastAPI:
    """The dashboard over the registry of ``settings`` (default: the environment's). Requests whose ``Host``
    is not in ``allowed_hosts`` are refused (400), so a web page cannot read the dashboard through DNS
    rebinding. ``trusted_proxies``: peers whose ``X-Forwarded-For`` names the client (wrong admin tokens are
    throttled per client)."""

    settings = settings or get_settings()
    engine = get_engine(settings.registry_url)
    import scipy.stats  # noqa: F401 - the intervals need it; imported now, not on the first page view

    factory = sessionmaker(bind=engine, expire_on_commit=False)
    access = Access(settings.admin_token, trusted_proxies=trusted_proxies)
    env = _templates()
    artifacts = settings.artifacts_dir
    app = FastAPI(
        title="Ratchet dashboard",
        description="The lineage, its generations' evidence and the experience behind them. Read-only "
        "without credentials; actions need RATCHET_ADMIN_TOKEN.",
        docs_url=None,
        redoc_url=None,
        openapi_url="/api/openapi.json",
    )
    app.state.access, app.state.settings, app.state.lineage = access, settings, lineage_name
    with factory() as session:  # the lineage's summaries parsed now, not on the first page view
        try:
            overview.lineage_summary(session=session, lineage=lineage_name)
        except NotFoundError:
            pass

    def db() -> Iterator[Session]:
        session = factory()
        try:
            yield session
        finally:
            session.rollback()  # reading only: nothing to keep
            session.close()

    DB = Annotated[Session, Depends(db)]
    Lineage = Annotated[str, Query(max_length=100, description="Lineage name.")]

    def context(request: Request) -> dict[str, object]:
        cookie = request.cookies.get(COOKIE)
        return {
            "request": request,
            "auth": {
                "enabled": access.enabled,
                "signed_in": access.session_valid(cookie),
                "csrf": access.csrf_token(cookie),
            },
            "default_lineage": lineage_name,
        }

    def render(
        request: Request,
        template: str,
        data: BaseModel | Mapping[str, object],
        status: int = 200,
        **extra: str,
    ) -> HTMLResponse:
        """``template`` over ``data``: a response model is rendered as the JSON API returns it (its dump)."""
        doc = data.model_dump() if isinstance(data, BaseModel) else data
        html = env.get_template(template).render(**context(request), data=doc, **extra)
        return HTMLResponse(html, status_code=status)

    def both(path: str, template: str, *, charts_for: Callable[..., dict[str, str]] | None = None):
        """Serve ``fn`` at ``/api{path}`` as JSON (its return annotation, a response model, is the route's
        ``response_model``) and at ``path`` as the rendered ``template``."""

        def register(fn: View) -> View:
            app.get("/api" + (path if path != "/" else "/lineage"), tags=["read"], summary=fn.__doc__)(fn)

            @functools.wraps(fn)
            def page(request: Request, **kwargs: object) -> HTMLResponse:
                data = fn(**kwargs)
                return render(request, template, data, **(charts_for(data) if charts_for else {}))  # type: ignore[arg-type]

            sig = inspect.signature(fn)
            request_param = inspect.Parameter("request", inspect.Parameter.KEYWORD_ONLY, annotation=Request)
            params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in sig.parameters.values()]
            page.__signature__ = sig.replace(  # type: ignore[attr-defined]
                parameters=[request_param, *params], return_annotation=HTMLResponse
            )
            app.get(path, response_class=HTMLResponse, include_in_schema=False)(page)
            return fn

        return register

    def lineage_charts(data: LineageSummary) -> dict[str, str]:
        return {
            "tree": charts.lineage_svg([g.model_dump() for g in data.generations]),
            "matrix_chart": charts.matrix_svg(data.matrix.suites, [r.model_dump() for r in data.matrix.rows]),
        }

    @both("/", "lineage.html", charts_for=lineage_charts)
    def lineage_view(db: DB, lineage: Lineage = lineage_name) -> LineageSummary:
        """The lineage: every generation with its status, overall held-out score and method (the route's
        response model is ``LineageSummary``: what ``ratchet lineage --json`` prints too)."""
        return overview.lineage_summary(session=db, lineage=lineage)

    def generation_charts(data: GenerationDetail) -> dict[str, str]:
        def curves(rl: bool) -> list[charts.Series]:
            return [
                charts.Series(
                    f"{a.specialist} v{a.version} ({a.method})",
                    [charts.LinePoint(s, v) for s, v in a.loss_curve],  # type: ignore[union-attr,misc]
                )
                for a in data.adapters
                if a.new and a.loss_curve and (a.method == "grpo") == rl
            ]

        loss, reward = curves(False), curves(True)
        router = data.router.confusion if data.router else None
        return {
            "loss_chart": charts.line_chart_svg(loss, title="training loss", x_label="step", y_label="loss")
            if loss
            else "",
            "reward_chart": charts.line_chart_svg(
                reward,
                title="GRPO: mean contract reward of each step's rollouts",
                x_label="step",
                y_label="reward",
            )
            if reward
            else "",
            "confusion": charts.confusion_svg(router or {}),
        }

    @both("/generations/{number}", "generation.html", charts_for=generation_charts)
    def generation_view(db: DB, number: Id, lineage: Lineage = lineage_name) -> GenerationDetail:
        """One generation: versions, adapters, loss curves, held-out scores vs its parent, the verdict."""
        return GenerationDetail.model_validate(
            lineage_data.generation_detail(
                session=db, lineage=lineage, number=number, tracking_uri=settings.mlflow_tracking_uri
            )
        )

    @both("/generations/{number}/items", "items.html")
    def items_view(
        db: DB,
        number: Id,
        lineage: Lineage = lineage_name,
        specialist: Annotated[str | None, Query(max_length=100)] = None,
        change: Annotated[str | None, Query(max_length=20)] = None,
        offset: Annotated[int, Query(ge=0, le=MAX_ID)] = 0,
    ) -> ItemComparison:
        """The generation against its parent item by item on the held-out suites."""
        if change and change not in comparison.CHANGES:
            raise RatchetError(f"unknown change {change!r}: expected one of {', '.join(comparison.CHANGES)}")
        return comparison.item_comparison(
            session=db, lineage=lineage, number=number, specialist=specialist or None, change=change or None,
            offset=offset,
        )  # fmt: skip

    @both("/generations/{number}/items/{specialist}/{position}", "item.html")
    def item_view(
        db: DB, number: Id, specialist: str, position: Id, lineage: Lineage = lineage_name
    ) -> HeldOutItem:
        """One held-out item: the parent's and the candidate's answers side by side."""
        return comparison.held_out_item(
            session=db, lineage=lineage, number=number, specialist=specialist, position=position
        )

    def trend_charts(data: Trends) -> dict[str, str]:
        series = [
            charts.Series(
                s,
                [
                    charts.LinePoint(
                        p.generation,
                        p.score,
                        p.low,
                        p.high,
                        f"{s} gen {p.generation} ({p.status}): {p.score:.3f}",
                    )
                    for p in points
                ],
            )
            for s, points in sorted(data.scores.items())
        ] + [  # retention suites beside the held-out ones (pipeline.gates.retention)
            charts.Series(
                f"retention: {name}",
                [
                    charts.LinePoint(
                        p.generation,
                        p.score,
                        p.low,
                        p.high,
                        f"retention {name} gen {p.generation} ({p.status}): {p.score:.3f}",
                    )
                    for p in points
                ],
            )  # fmt: skip
            for name, points in sorted(data.retention.items())
        ]
        router = [
            charts.Series(
                "router accuracy", [charts.LinePoint(p.generation, p.accuracy) for p in data.router]
            )
        ]
        return {
            "score_chart": charts.line_chart_svg(
                series,
                title="held-out score per specialist, and retention suites (95% intervals)",
                x_label="generation",
                y_label="score",
                y_range=(0.0, 1.0),
            ),  # fmt: skip
            "router_chart": charts.line_chart_svg(
                router,
                title="router accuracy on the routing suite",
                x_label="generation",
                y_label="accuracy",
                y_range=(0.0, 1.0),
            ),  # fmt: skip
        }

    @both("/trends", "trends.html", charts_for=trend_charts)
    def trends_view(db: DB, lineage: Lineage = lineage_name) -> Trends:
        """Held-out score per specialist over generations, and router accuracy."""
        return Trends.model_validate(lineage_data.trends(session=db, lineage=lineage))

    @both("/adapters/{adapter_id}", "adapter.html")
    def adapter_view(
        db: DB,
        adapter_id: Id,
        before: Annotated[int | None, Query(ge=1, le=MAX_ID)] = None,
        lineage: Lineage = lineage_name,
    ) -> AdapterDetail:
        """An adapter's provenance: its dataset and the traces in it, its parent, where it is used."""
        return provenance.adapter_detail(
            session=db, adapter_id=adapter_id, artifacts=artifacts, lineage=lineage, before=before
        )

    @both("/experience", "experience.html")
    def experience_view(db: DB, query: Annotated[experience.ExperienceQuery, Query()]) -> ExperiencePage:
        """Traces, newest first, filtered; keyset pages (``older``/``newer`` are the next cursors)."""
        return experience.list_experience(session=db, lineage=query.lineage or lineage_name, query=query)

    @both("/experience/{experience_id}", "trace.html")
    def trace_view(
        db: DB,
        experience_id: Id,
        lineage: Lineage = lineage_name,
        turns_from: Annotated[int, Query(ge=0, le=MAX_ID)] = 0,
        token_ids: Annotated[bool, Query(description="Include the served token ids themselves.")] = False,
    ) -> TraceDetail:
        """One trace turn by turn, with routes, views, summaries, its principal and what its client claimed, its
        final turn's verdict beside every score, feedback (counted and claimed), what it trained, its
        conversation, the tools its client offered and the token ids it was served (counts)."""
        return trace.trace_detail(
            session=db, experience_id=experience_id, lineage=lineage, turn_offset=turns_from,
            token_ids=token_ids,
        )  # fmt: skip

    @both("/conversations/{conversation_id:path}", "conversation.html")
    def conversation_view(
        db: DB,
        conversation_id: Annotated[str, PathParam(max_length=100, description="The conversation's id.")],
        lineage: Lineage = lineage_name,
        after: Annotated[int | None, Query(ge=0, le=MAX_ID, description="Turns after this trace.")] = None,
        before: Annotated[int | None, Query(ge=1, le=MAX_ID, description="Turns before this trace.")] = None,
        limit: Annotated[int, Query(ge=1, le=conversation.MAX_TURNS_PER_PAGE)] = conversation.TURNS_PER_PAGE,
    ) -> conversation.ConversationDetail:
        """A conversation's turns in order, each with what it added, who sent it, what served it and its
        final turn's verdict; keyset pages (``next``/``previous`` are the cursors)."""
        return conversation.conversation_detail(
            session=db, conversation_id=conversation_id, lineage=lineage, after=after, before=before,
            limit=limit,
        )  # fmt: skip

    for kind in ("contracts", "harnesses"):
        _version_routes(both, kind, DB)

    @both("/quarantine", "quarantine.html")
    def quarantine_view(
        db: DB,
        before: Annotated[int | None, Query(ge=1, le=MAX_ID)] = None,
        source_file: Annotated[str | None, Query(max_length=1000)] = None,
        limit: Annotated[int, Query(ge=1, le=500)] = 50,
    ) -> QuarantinePage:
        """Refused input lines, newest first."""
        return records.quarantine_page(
            session=db, before=before, limit=limit, source_file=source_file or None
        )

    @both("/audit", "audit.html")
    def audit_view(
        db: DB,
        before: Annotated[int | None, Query(ge=1, le=MAX_ID)] = None,
        entity: Annotated[str | None, Query(max_length=50)] = None,
        action: Annotated[str | None, Query(max_length=50)] = None,
        actor: Annotated[str | None, Query(max_length=100)] = None,
        limit: Annotated[int, Query(ge=1, le=500)] = 50,
    ) -> AuditPage:
        """Every state change, newest first."""
        return records.audit_page(
            session=db,
            before=before,
            limit=limit,
            entity=entity or None,
            action=action or None,
            actor=actor or None,
        )

    @app.get(
        "/api/artifacts/{path:path}",
        tags=["read"],
        response_model=ArtifactDirectory,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                         "description": "A directory's entries as JSON, or a text file as text/plain."}},
    )  # fmt: skip
    def artifact_api(path: str) -> ArtifactDirectory | Response:
        """A file of the artifact store as text, or a directory's entries (nothing outside the store)."""
        target = artifact_file(artifacts, path)
        if target.is_dir():
            return ArtifactDirectory(path=path, entries=_entries(artifacts, target))
        return _file_response(target)

    @app.get("/artifacts/{path:path}", response_class=HTMLResponse, include_in_schema=False)
    def artifact_page(request: Request, path: str) -> Response:
        target = artifact_file(artifacts, path)
        if target.is_dir():
            return render(
                request, "artifacts.html", ArtifactDirectory(path=path, entries=_entries(artifacts, target))
            )
        return _file_response(target)

    @app.get("/api/docs", response_class=HTMLResponse, include_in_schema=False)
    def api_docs(request: Request) -> HTMLResponse:
        spec = app.openapi()
        returns = {
            f"{m} {p}": reference.returns(op) for p, ops in spec["paths"].items() for m, op in ops.items()
        }
        return render(
            request, "apidocs.html", {"spec": spec, "returns": returns, "models": reference.models(spec)}
        )

    action_routes(
        app, factory=factory, access=access, settings=settings, render=render, lineage_name=lineage_name
    )
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
    _errors(app, render)

    app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts))

    @app.middleware("http")
    async def headers(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        response = await call_next(request)
        for key, value in HEADERS.items():
            response.headers.setdefault(key, value)
        return response

    return app


def _version_routes(both: Callable[..., Callable[[View], View]], kind: records.Kind, DB: object) -> None:
    @both(f"/{kind}", "versions.html")
    def versions(db: DB) -> VersionList:  # type: ignore[valid-type]
        return records.list_versions(session=db, kind=kind)

    @both(f"/{kind}/diff", "diff.html")
    def diff(
        db: DB, a: Annotated[int, Query(ge=1, le=MAX_ID)], b: Annotated[int, Query(ge=1, le=MAX_ID)]
    ) -> VersionDiff:  # type: ignore[valid-type]
        return records.diff_versions(session=db, kind=kind, a=a, b=b)

    @both(f"/{kind}/{{version_id}}", "version.html")
    def version(db: DB, version_id: Id) -> VersionDetail:  # type: ignore[valid-type]
        return records.version_detail(session=db, kind=kind, version_id=version_id)

    versions.__doc__ = f"Every {kind[:-1]} version."
    diff.__doc__ = f"Two {kind[:-1]} versions side by side (ids ``a`` and ``b``)."
    version.__doc__ = f"One {kind[:-1]} version as YAML, and the generations that use it."


def _entries(root: Path, directory: Path) -> list[ArtifactEntry]:
    base = root.resolve()
    out = []
    for child in sorted(directory.iterdir())[:500]:
        resolved = child.resolve()
        if not resolved.is_relative_to(base):
            continue  # a link that leads out of the store is not shown
        out.append(
            ArtifactEntry(
                name=child.name,
                path=resolved.relative_to(base).as_posix(),
                dir=resolved.is_dir(),
                size=None if resolved.is_dir() else resolved.stat().st_size,
            )
        )
    return out


def _file_response(target: Path) -> Response:

    if target.suffix.lower() not in TEXT_SUFFIXES:
        raise RatchetError(
            f"{target.name} is not a text artifact (shown: {', '.join(sorted(TEXT_SUFFIXES))})"
        )
    size = target.stat().st_size
    if size > MAX_BYTES:
        raise RatchetError(f"{target.name} is {size} bytes, more than the {MAX_BYTES} shown")
    # text/plain and a sandbox: a stored file is never rendered as a page
    return PlainTextResponse(
        target.read_text(errors="replace"), headers={"Content-Security-Policy": "sandbox; default-src 'none'"}
    )


def _errors(app: FastAPI, render: Callable[..., HTMLResponse]) -> None:
    def reply(request: Request, status: int, message: str) -> Response:
        if request.url.path.startswith("/api/"):
            return JSONResponse({"detail": message}, status_code=status)
        return render(request, "error.html", {"status": status, "message": message}, status=status)

    @app.exception_handler(NotFoundError)
    async def not_found(request: Request, exc: NotFoundError) -> Response:
        return reply(request, 404, str(exc))

    @app.exception_handler(ForbiddenError)
    async def forbidden(request: Request, exc: ForbiddenError) -> Response:
        return reply(request, exc.status, str(exc))

    @app.exception_handler(ConflictError)
    async def conflict(request: Request, exc: ConflictError) -> Response:
        return reply(request, 409, str(exc))

    @app.exception_handler(RatchetError)
    async def bad_request(request: Request, exc: RatchetError) -> Response:
        return reply(request, 400, str(exc))
