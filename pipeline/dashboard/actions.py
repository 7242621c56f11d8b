"""The dashboard's actions: sign in and out, promote a generation, roll the champion back, abandon the candidate
in flight, re-score a trace.

Each action is allowed by ``security.Access.require`` (bearer token, or session cookie plus CSRF token and
a same-origin check) and changes the registry through its data functions, which write the audit log with
the dashboard as the actor. Pages post forms and are redirected back (303); the API answers JSON.
"""

import asyncio
import logging
from collections.abc import Callable
from typing import Annotated
from urllib.parse import quote

from fastapi import FastAPI, Form, Header, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from sqlalchemy.orm import sessionmaker

from pipeline.dashboard.replies import AbandonResult, ChampionMove, RescoreResult
from pipeline.dashboard.security import COOKIE, SESSION_SECONDS, Access, Id
from pipeline.errors import ConflictError, NotFoundError, RatchetError
from pipeline.loop.promotion import sync_champion_aliases
from pipeline.registry import (
    Experience,
    audit,
    get_champion,
    get_generation,
    promote_generation,
    rollback_champion,
)
from pipeline.registry.generations import abandon_generation
from pipeline.registry.tracking import MLflowTracker
from pipeline.scoring import rescore_experience
from pipeline.settings import Settings

__all__ = ["abandon", "action_routes", "promote", "rescore", "rollback"]

log = logging.getLogger(__name__)


def promote(
    *, factory: sessionmaker, settings: Settings, lineage: str, number: int, actor: str, reason: str
) -> ChampionMove:
    """Make generation ``number`` the champion (refused while it is being built); MLflow aliases follow."""

    with factory.begin() as session:
        gen = get_generation(session=session, number=number, lineage=lineage)
        if gen.status in ("candidate", "training", "evaluating"):
            raise ConflictError(
                f"generation {number} is still being built ({gen.status}): let `ratchet advance` finish it"
            )
        promote_generation(session=session, generation=gen, reason=f"manual: {reason}", actor=actor)
    return _with_aliases(ChampionMove(champion=number, lineage=lineage), factory=factory, settings=settings)


def rollback(*, factory: sessionmaker, settings: Settings, lineage: str, actor: str) -> ChampionMove:
    """Retire the champion and restore its parent; MLflow aliases follow."""

    with factory.begin() as session:
        number = rollback_champion(session=session, lineage=lineage, actor=actor).number
    return _with_aliases(ChampionMove(champion=number, lineage=lineage), factory=factory, settings=settings)


def abandon(*, factory: sessionmaker, lineage: str, actor: str, reason: str) -> AbandonResult:
    """Fail the lineage's in-flight candidate for ``reason``; the next advance starts a new one."""

    with factory.begin() as session:
        gen = abandon_generation(session=session, lineage=lineage, reason=reason, actor=actor)
        return AbandonResult(abandoned=gen.number, lineage=lineage, status=gen.status, reason=reason)


def _with_aliases(move: ChampionMove, *, factory: sessionmaker, settings: Settings) -> ChampionMove:
    """MLflow's champion aliases follow the committed move; where MLflow fails the move stands (the registry
    is the truth) and the answer says how the aliases get repaired."""

    try:
        sync_champion_aliases(
            lineage=move.lineage,
            tracker=lambda: MLflowTracker.from_settings(settings),
            engine=factory.kw["bind"],
        )
    except RatchetError as exc:
        log.warning("%s", exc)
        return move.model_copy(update={"aliases": str(exc)})
    return move


def rescore(*, factory: sessionmaker, lineage: str, experience_id: int, actor: str) -> RescoreResult:
    """Score one trace again under every contract version that scored it and the champion's."""

    with factory() as session:  # scoring commits as it goes (its batches); the audit entry follows it
        if session.get(Experience, experience_id) is None:
            raise NotFoundError(f"no trace {experience_id}")
        champion = get_champion(session=session, lineage=lineage)
        results = rescore_experience(
            session=session,
            experience_ids=[experience_id],
            reason=f"re-scored from the dashboard by {actor}",
            also_under=champion.contract_version_id if champion else None,
        )
        audit(
            session=session,
            actor=actor,
            entity="experience",
            entity_id=experience_id,
            action="rescore",
            details={"contract_versions": [r.contract_version_id for r in results]},
        )
        session.commit()
        return RescoreResult(
            experience_id=experience_id, contract_versions=[r.contract_version_id for r in results]
        )


def action_routes(
    app: FastAPI,
    *,
    factory: sessionmaker,
    access: Access,
    settings: Settings,
    render: Callable[..., HTMLResponse],
    lineage_name: str,
) -> None:
    """Add the login form and the actions (page forms and API) to ``app``."""

    def actor(request: Request, authorization: str | None, csrf: str | None) -> str:
        own = f"{request.url.scheme}://{request.url.netloc}"
        return access.require(
            authorization=authorization,
            cookie=request.cookies.get(COOKIE),
            csrf=csrf or request.headers.get("x-csrf-token"),
            origin=request.headers.get("origin"),
            own_origin=own,
            client=access.client(request),
        )

    Auth = Annotated[str | None, Header(description="`Bearer <RATCHET_ADMIN_TOKEN>`")]
    Csrf = Annotated[str | None, Form(max_length=200)]
    Lineage = Annotated[str, Form(max_length=100)]

    @app.get("/login", response_class=HTMLResponse, include_in_schema=False)
    def login_page(request: Request) -> HTMLResponse:
        return render(request, "login.html", {"error": None})

    @app.post("/login", response_class=HTMLResponse, include_in_schema=False)
    async def login(request: Request, token: Annotated[str, Form(max_length=500)]) -> Response:
        if not access.enabled:
            return render(
                request,
                "login.html",
                {"error": "actions are disabled: RATCHET_ADMIN_TOKEN is not set"},
                status=403,
            )
        if not access.token_matches(token, client=access.client(request)):
            await asyncio.sleep(0.5)  # a wrong guess costs time (and each client's are throttled)
            return render(request, "login.html", {"error": "wrong token"}, status=401)
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(
            COOKIE,
            access.new_session(),
            max_age=SESSION_SECONDS,
            secure=True,
            httponly=True,
            samesite="strict",
            path="/",
        )
        return response

    @app.post("/logout", include_in_schema=False)
    def logout(request: Request, csrf: Csrf = None) -> Response:
        actor(request, None, csrf)  # a cross-site form cannot sign anyone out
        access.revoke(request.cookies.get(COOKIE))
        response = RedirectResponse("/", status_code=303)
        response.delete_cookie(COOKIE, path="/", secure=True, httponly=True, samesite="strict")
        return response

    def back(path: str, lineage: str) -> RedirectResponse:
        """Back to a page of this app (``path`` is ours; the lineage from the form is only a query value)."""
        return RedirectResponse(f"{path}?lineage={quote(lineage, safe='')}", status_code=303)

    @app.post("/generations/{number}/promote", include_in_schema=False)
    def promote_form(
        request: Request, number: Id, csrf: Csrf = None, lineage: Lineage = lineage_name,
        reason: Annotated[str, Form(max_length=500)] = "promoted from the dashboard", authorization: Auth = None,
    ) -> Response:  # fmt: skip
        promote(
            factory=factory,
            settings=settings,
            lineage=lineage,
            number=number,
            actor=actor(request, authorization, csrf),
            reason=reason,
        )
        return back(f"/generations/{number}", lineage)

    @app.post("/rollback", include_in_schema=False)
    def rollback_form(
        request: Request, csrf: Csrf = None, lineage: Lineage = lineage_name, authorization: Auth = None
    ) -> Response:
        rollback(
            factory=factory, settings=settings, lineage=lineage, actor=actor(request, authorization, csrf)
        )
        return back("/", lineage)

    Reason = Annotated[str, Form(min_length=1, max_length=500)]

    @app.post("/abandon", include_in_schema=False)
    def abandon_form(
        request: Request, csrf: Csrf = None, lineage: Lineage = lineage_name,
        reason: Reason = "abandoned from the dashboard", authorization: Auth = None,
    ) -> Response:  # fmt: skip
        abandon(factory=factory, lineage=lineage, actor=actor(request, authorization, csrf), reason=reason)
        return back("/", lineage)

    @app.post("/experience/{experience_id}/rescore", include_in_schema=False)
    def rescore_form(
        request: Request,
        experience_id: Id,
        csrf: Csrf = None,
        lineage: Lineage = lineage_name,
        authorization: Auth = None,
    ) -> Response:
        rescore(
            factory=factory,
            lineage=lineage,
            experience_id=experience_id,
            actor=actor(request, authorization, csrf),
        )
        return back(f"/experience/{experience_id}", lineage)

    @app.post("/api/generations/{number}/promote", tags=["actions"])
    def promote_api(request: Request, number: Id, lineage: str = lineage_name, reason: str = "promoted through the API",
                    authorization: Auth = None) -> ChampionMove:  # fmt: skip
        """Make a generation the champion (admin token; audited)."""
        who = actor(request, authorization, None)
        return promote(
            factory=factory, settings=settings, lineage=lineage, number=number, actor=who, reason=reason
        )

    @app.post("/api/rollback", tags=["actions"])
    def rollback_api(
        request: Request, lineage: str = lineage_name, authorization: Auth = None
    ) -> ChampionMove:
        """Retire the champion and restore its parent (admin token; audited)."""
        return rollback(
            factory=factory, settings=settings, lineage=lineage, actor=actor(request, authorization, None)
        )

    @app.post("/api/abandon", tags=["actions"])
    def abandon_api(
        request: Request,
        lineage: str = lineage_name,
        reason: Annotated[str, Query(min_length=1, max_length=500)] = "abandoned through the API",
        authorization: Auth = None,
    ) -> AbandonResult:
        """Fail the candidate in flight, with a reason; the next advance starts anew (admin token; audited)."""
        who = actor(request, authorization, None)
        return abandon(factory=factory, lineage=lineage, actor=who, reason=reason)

    @app.post("/api/experience/{experience_id}/rescore", tags=["actions"])
    def rescore_api(
        request: Request, experience_id: Id, lineage: str = lineage_name, authorization: Auth = None
    ) -> RescoreResult:
        """Score one trace again under its contract versions and the champion's (admin token; audited)."""
        who = actor(request, authorization, None)
        return rescore(factory=factory, lineage=lineage, experience_id=experience_id, actor=who)
