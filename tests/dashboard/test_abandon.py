"""The dashboard's abandon action: admin only (bearer token, or a session with its CSRF token from our own
origin), audited; the candidate in flight fails with the reason and the next advance starts a new one."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient
from sqlalchemy import select

from pipeline.dashboard import create_app
from pipeline.loop.advance import begin_candidate, release_candidate
from pipeline.loop.candidate import AdvanceConfig
from pipeline.registry import AuditLog, get_engine, list_generations, session_scope
from pipeline.settings import Settings

TOKEN = "s3cret-token-0123456789"


def candidate() -> int:
    """A candidate in flight, as `ratchet advance` leaves it between two runs; its number."""
    config = AdvanceConfig()
    generation_id = begin_candidate(config=config, owner="test-run")
    release_candidate(generation_id=generation_id, owner="test-run")
    with session_scope(get_engine()) as s:
        return next(g.number for g in list_generations(session=s) if g.id == generation_id)


def statuses() -> list[str]:
    with session_scope(get_engine()) as s:
        return [g.status for g in list_generations(session=s)]


def audited() -> list[tuple[str, str | None]]:
    with session_scope(get_engine()) as s:
        rows = s.execute(select(AuditLog.actor, AuditLog.message).where(AuditLog.action == "abandon")).all()
    return [tuple(r) for r in rows]


def test_abandon_from_the_dashboard(lineage, ratchet_home):
    number = candidate()
    settings = Settings(home=ratchet_home, admin_token=TOKEN)
    with TestClient(
        create_app(settings, allowed_hosts=["testserver"]),
        base_url="https://testserver",
        follow_redirects=False,
    ) as c:
        assert c.post("/abandon", data={"lineage": "main"}).status_code in (401, 403)  # not signed in
        assert c.post("/api/abandon", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.post("/login", data={"token": TOKEN}).status_code == 303
        page = c.get(f"/generations/{number}").text
        assert 'action="/abandon"' in page  # the button, on the candidate's page
        csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page).group(1)
        assert c.post("/abandon", data={"lineage": "main", "reason": "x"}).status_code == 403  # no CSRF
        forged = c.post(
            "/abandon", data={"csrf": csrf, "reason": "x"}, headers={"Origin": "https://evil.example"}
        )
        assert forged.status_code == 403 and statuses() == ["promoted", "candidate"] and not audited()
        done = c.post("/abandon", data={"csrf": csrf, "lineage": "main", "reason": "bad data in chat"},
                      headers={"Origin": "https://testserver"})  # fmt: skip
        assert done.status_code == 303 and statuses() == ["promoted", "failed"]
        assert audited() == [("dashboard:session", "bad data in chat")]
        assert 'action="/abandon"' not in c.get(f"/generations/{number}").text  # nothing in flight now
        again = c.post("/api/abandon", headers={"Authorization": f"Bearer {TOKEN}"})
        assert again.status_code == 409 and "nothing to abandon" in again.json()["detail"]
        assert candidate() == number + 1  # the next advance starts a new candidate
        by_api = c.post(
            "/api/abandon", params={"reason": "by the API"}, headers={"Authorization": f"Bearer {TOKEN}"}
        )
        assert by_api.status_code == 200 and by_api.json()["abandoned"] == number + 1
        assert audited()[-1] == ("dashboard:bearer", "by the API")
    assert statuses() == ["promoted", "failed", "failed"]
