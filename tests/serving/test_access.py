"""Trust at the deployment boundary (issue 21): who may chat, certify, rate, correct and administer, and what
the server stores of what a client could not certify. Attacks of an anonymous client kept as tests."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from pipeline.serving.served import ServeConfig
from pipeline.serving.server import create_app
from serving.support import api_keys, experience_rows

ASK = {"model": "ratchet", "messages": [{"role": "user", "content": "12+35=?"}]}
# (tools well formed: malformed ones are refused with a 400 whoever sends them, tests/test_unstuck.py)
CLAIM = {"expected": "47", "tests": "assert True", "split": "train",
         "tools": [{"type": "function", "function": {"name": "transfer_funds"}}]}  # fmt: skip


def _row(url: str, cid: str):
    return next(e for e in experience_rows(url) if e.completion_id == cid)


def _app(url: str, **config) -> TestClient:
    cfg = ServeConfig(registry_url=url, poll_seconds=0, device="cpu", flush_seconds=0.05, **config)
    return TestClient(create_app(cfg))


def test_an_anonymous_client_certifies_nothing(registry):
    """Found on main: with no key (the default) a chat turn sent with `metadata.expected` equal to the model's
    own reply, a 5-star rating and a correction "EVIL 99" all counted as verification. Now the client's
    metadata is kept as `claimed`, its feedback under `feedback.claimed`, and nothing is re-scored."""
    with _app(registry) as c:
        r = c.post("/v1/chat/completions", json={**ASK, "metadata": CLAIM})
        assert r.status_code == 200
        cid = r.json()["id"]
        fb = c.post("/v1/feedback", json={"completion_id": cid, "rating": 5, "correction": "EVIL 99"})
        assert fb.json()["counted"] == {"rating": False, "correction": False} and fb.json()["rescored"] == 0
    row = _row(registry, cid)
    assert row.principal == "anonymous"
    assert row.meta["claimed"] == CLAIM
    assert not {"expected", "tests", "split", "tools"} & set(row.meta)  # nothing a scorer reads
    assert row.meta["specialist"] == "chat"  # the server's own fields
    assert row.feedback == {
        "claimed": {
            "rating": 5,
            "rating_by": "anonymous",
            "correction": "EVIL 99",
            "correction_by": "anonymous",
        }
    }


def test_scoped_keys_certify_rate_and_correct(registry):
    """The same turn and feedback from keys the operator granted `certify`, `rate` and `correct` count, and
    each is stored with its principal."""
    keys = api_keys(registry, crm="chat,certify", raters="chat,rate", editors="chat,correct", plain="chat")
    with _app(registry) as c:
        cid = c.post(
            "/v1/chat/completions", json={**ASK, "metadata": {"expected": "47"}}, headers=keys["crm"]
        ).json()["id"]
        rated = c.post(
            "/v1/feedback", json={"completion_id": cid, "rating": 5}, headers=keys["raters"]
        ).json()
        fixed = c.post(
            "/v1/feedback", json={"completion_id": cid, "correction": "47"}, headers=keys["editors"]
        ).json()
        mixed = c.post(
            "/v1/feedback",
            json={"completion_id": cid, "rating": 1, "correction": "EVIL"},
            headers=keys["plain"],
        ).json()
        plain = c.post(
            "/v1/chat/completions", json={**ASK, "metadata": {"expected": "47"}}, headers=keys["plain"]
        )
    assert rated["counted"] == {"rating": True} and rated["rescored"] >= 0
    assert fixed["counted"] == {"correction": True}
    assert mixed["counted"] == {"rating": False, "correction": False}
    row = _row(registry, cid)
    assert row.principal == "crm" and row.meta["expected"] == "47" and "claimed" not in row.meta
    assert row.feedback == {
        "rating": 5,
        "rating_by": "raters",
        "correction": "47",
        "correction_by": "editors",
        "claimed": {"rating": 1, "rating_by": "plain", "correction": "EVIL", "correction_by": "plain"},
    }
    other = _row(registry, plain.json()["id"])
    assert other.principal == "plain" and other.meta["claimed"] == {"expected": "47"}


def test_keys_are_required_once_they_exist_and_scopes_are_enforced(registry):
    keys = api_keys(registry, app="chat", ops="chat,admin")
    with _app(registry) as c:
        assert c.get("/health").status_code == 200
        no_key = c.post("/v1/chat/completions", json=ASK)
        assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
        wrong = c.post("/v1/chat/completions", json=ASK, headers={"Authorization": "Bearer rk_wrong"})
        assert wrong.status_code == 401
        assert c.post("/v1/chat/completions", json=ASK, headers=keys["app"]).status_code == 200
        denied = c.post("/admin/reload", headers=keys["app"])
        assert denied.status_code == 403 and "admin" in denied.json()["error"]["message"]
        assert c.post("/admin/reload", headers=keys["ops"]).status_code == 200
    with _app(registry, allow_anonymous=True) as c:  # --allow-anonymous: chat without a key, nothing more
        assert c.post("/v1/chat/completions", json=ASK).status_code == 200
        # an SDK's placeholder key is anonymous too where anonymous chat is served: it gains nothing
        unused = c.post(
            "/v1/chat/completions",
            json={**ASK, "metadata": CLAIM},
            headers={"Authorization": "Bearer unused"},
        )
        assert unused.status_code == 200
        assert c.post("/admin/reload").status_code == 403
    assert _row(registry, unused.json()["id"]).principal == "anonymous"


def test_admin_manages_keys_by_name_and_a_revoked_key_stops_working(registry):
    keys = api_keys(registry, ops="admin")
    with _app(registry) as c:
        made = c.post("/admin/keys", json={"name": "crm", "scopes": ["chat", "certify"]}, headers=keys["ops"])
        assert made.status_code == 200 and made.json()["key"].startswith("rk_")
        crm = {"Authorization": f"Bearer {made.json()['key']}"}
        listed = c.get("/admin/keys", headers=keys["ops"]).json()
        assert [k["name"] for k in listed] == ["ops", "crm"] and all(k["key"] is None for k in listed)
        assert made.json()["key"] not in str(listed)
        assert (
            c.post("/admin/keys", json={"name": "crm", "scopes": ["chat"]}, headers=keys["ops"]).status_code
            == 400
        )
        assert (
            c.post(
                "/admin/keys", json={"name": "anonymous", "scopes": ["chat"]}, headers=keys["ops"]
            ).status_code
            == 400
        )
        assert (
            c.post("/admin/keys", json={"name": "x", "scopes": ["root"]}, headers=keys["ops"]).status_code
            == 400
        )
        assert c.post("/v1/chat/completions", json=ASK, headers=crm).status_code == 200
        assert c.post("/admin/keys/crm/revoke", headers=keys["ops"]).json()["revoked_at"]
        assert c.post("/v1/chat/completions", json=ASK, headers=crm).status_code == 401
        # a key created elsewhere (`ratchet keys create`) is seen within the refresh interval
        late = api_keys(registry, late="chat")["late"]
        deadline = time.monotonic() + 5
        while c.post("/v1/chat/completions", json=ASK, headers=late).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.2)


def test_ratchet_api_key_is_the_operator(registry):
    with _app(registry, api_key="operator-secret-123") as c:
        op = {"Authorization": "Bearer operator-secret-123"}
        cid = c.post("/v1/chat/completions", json={**ASK, "metadata": {"expected": "47"}}, headers=op).json()[
            "id"
        ]
        assert c.post("/v1/chat/completions", json=ASK).status_code == 401
        assert c.post("/admin/reload", headers=op).status_code == 200
    row = _row(registry, cid)
    assert row.principal == "operator" and row.meta["expected"] == "47"


def test_keys_cli_creates_lists_and_revokes(tmp_path, monkeypatch, capsys):
    from pipeline.cli import main
    from pipeline.settings import get_settings

    monkeypatch.setenv("RATCHET_DATABASE_URL", f"sqlite:///{tmp_path / 'keys.db'}")
    get_settings.cache_clear()
    main(["keys", "create", "--name", "crm-backend", "--scope", "chat,certify"])
    out = capsys.readouterr().out.splitlines()
    assert "crm-backend" in out[0] and "chat, certify" in out[0] and out[1].startswith("rk_")
    main(["keys", "list"])
    listed = capsys.readouterr().out
    assert "crm-backend" in listed and "chat,certify" in listed and out[1] not in listed
    for argv, message in (
        (["keys", "create", "--name", "crm-backend"], "already exists"),
        (["keys", "create", "--name", "x", "--scope", "chat,root"], "unknown scope 'root'"),
        (["keys", "create", "--name", "ratchet"], "reserved"),
        (["keys", "revoke", "nobody"], "no key named 'nobody'"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 1 and message in err and len(err.strip().splitlines()) == 1, err
    main(["keys", "revoke", "crm-backend"])
    main(["keys", "list", "--json"])
    assert '"revoked_at": null' not in capsys.readouterr().out


def test_serving_off_loopback_without_any_key_is_refused(tmp_path, monkeypatch, capsys):
    """An open server on the network would let anyone chat, and nobody could be told apart: refused with one
    line (on loopback it serves anonymously with the chat scope only)."""
    from pipeline.cli import main
    from pipeline.cli.serve import is_loopback
    from pipeline.settings import get_settings

    monkeypatch.setenv("RATCHET_DATABASE_URL", f"sqlite:///{tmp_path / 'open.db'}")
    get_settings.cache_clear()
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--host", "0.0.0.0", "--port", "1"])
    err = capsys.readouterr().err
    assert exc.value.code == 1 and "refusing to serve on 0.0.0.0 without an API key" in err
    assert len(err.strip().splitlines()) == 1
    assert all(is_loopback(h) for h in ("127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "192.168.1.2", "example.com"))


def _request(header: dict[str, str]):
    from starlette.requests import Request

    headers = [(k.lower().encode(), v.encode()) for k, v in header.items()]
    return Request({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers})


def test_a_registry_outage_keeps_the_keys_read_before_and_never_opens_to_anonymous(registry, tmp_path):
    """Found while spooling (issue 22): during a registry outage the key refresh raised and requests got 500.
    Now the keys read before keep working; a server that never read its keys answers 503 and never falls back
    to serving anonymous clients (with no keys known, "no key exists" would have let anyone in)."""
    import asyncio

    from sqlalchemy import create_engine

    from pipeline.registry import get_engine
    from pipeline.serving.access import Access
    from pipeline.serving.protocol import ApiError

    crm = api_keys(registry, crm="chat,certify")["crm"]
    down = create_engine(f"sqlite:///{tmp_path / 'missing' / 'registry.db'}")  # cannot be opened
    access = Access(db=get_engine(registry), refresh_s=0.0)

    async def run() -> None:
        assert (await access.principal(_request(crm))).name == "crm"
        access.db = down
        assert (await access.principal(_request(crm))).name == "crm"  # the keys read before
        with pytest.raises(ApiError) as refused:
            await access.principal(_request({}))
        assert refused.value.status == 401  # keys exist: no key is still refused
        cold = Access(db=down, refresh_s=0.0)
        with pytest.raises(ApiError) as unavailable:
            await cold.principal(_request({}))
        assert unavailable.value.status == 503

    asyncio.run(run())
