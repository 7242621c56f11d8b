"""Wrong admin tokens are throttled per client, never for everyone: an attacker's failures cannot lock the
admin out (form and bearer), the attacker itself is throttled, and the table of clients stays bounded."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from pipeline.dashboard import create_app
from pipeline.dashboard.security import Access
from pipeline.settings import Settings

TOKEN = "s3cret-token-0123456789"
ADMIN, ATTACKER = ("198.51.100.7", 41000), ("203.0.113.66", 52000)


@pytest.fixture
def dashboard(tmp_path):
    from pipeline.registry import upgrade_db

    settings = Settings(home=tmp_path / "home", admin_token=TOKEN)
    settings.ensure_home()
    upgrade_db(settings.registry_url)
    return create_app(settings, allowed_hosts=["testserver"])


def client(app, address):
    return TestClient(app, base_url="https://testserver", follow_redirects=False, client=address)


def test_an_attackers_wrong_tokens_never_lock_the_admin_out(dashboard):
    with client(dashboard, ATTACKER) as attacker, client(dashboard, ADMIN) as admin:
        wrong = {"Authorization": "Bearer wrong-guess-0000000000"}
        codes = [
            attacker.post("/login", data={"token": "wrong-guess-0000000000"}).status_code for _ in range(3)
        ]
        codes += [attacker.post("/api/rollback", headers=wrong).status_code for _ in range(97)]
        assert codes[:20] == [401] * 20 and set(codes[20:]) == {429}  # the attacker is throttled
        # ... also with the right token, from its address: guessing on after the limit gains nothing
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        assert attacker.post("/api/rollback", headers=bearer).status_code == 429
        assert attacker.post("/login", data={"token": TOKEN}).status_code == 429

        # the admin, from another address, signs in both ways meanwhile
        signed_in = admin.post("/login", data={"token": TOKEN})
        assert signed_in.status_code == 303 and admin.cookies.get("ratchet_session")
        acted = admin.post("/api/rollback", headers=bearer)  # authorised: the registry answers (no champion)
        assert acted.status_code == 409 and "no champion" in acted.json()["detail"], acted.text
        admin.cookies.clear()
        assert admin.post("/api/rollback", headers=wrong).status_code == 401


def test_forwarded_for_is_believed_only_from_a_trusted_proxy():
    from pipeline.dashboard.security import client_key

    class Req:
        def __init__(self, peer, forwarded):
            self.client = type("C", (), {"host": peer})()
            self.headers = type("H", (), {"getlist": lambda _self, _name: forwarded})()

    plain = Access(TOKEN)
    assert plain.client(Req("203.0.113.66", ["198.51.100.7"])) == "203.0.113.66"  # spoofed header ignored
    proxied = Access(TOKEN, trusted_proxies=["127.0.0.1", "10.0.0.0/8"])
    assert proxied.client(Req("127.0.0.1", ["203.0.113.66, 10.1.2.3"])) == "203.0.113.66"
    assert proxied.client(Req("127.0.0.1", ["198.51.100.7", "203.0.113.66"])) == "203.0.113.66"
    assert proxied.client(Req("203.0.113.66", ["127.0.0.1"])) == "203.0.113.66"  # untrusted peer
    assert client_key("2001:db8:1:2:aaaa::1") == client_key("2001:db8:1:2:bbbb::9") == "2001:db8:1:2::/64"
    assert client_key("::ffff:203.0.113.66") == "203.0.113.66"


def test_the_table_of_failing_clients_is_bounded(monkeypatch):
    access = Access(TOKEN)
    monkeypatch.setattr(Access, "MAX_CLIENTS", 100)
    for i in range(1000):
        assert access.token_matches("wrong-guess-0000000000", client=f"10.0.{i // 256}.{i % 256}") is False
    assert len(access._failures) == 100
    for _ in range(Access.MAX_FAILURES):  # the newest clients are still counted
        access.token_matches("wrong-guess-0000000000", client="192.0.2.1")
    assert access.throttled("192.0.2.1") and not access.throttled("192.0.2.2")
