"""Server error handling (FastAPI TestClient): every client mistake is a 4xx OpenAI error object, the
server keeps serving, the API key is enforced, and served turns become experience with feedback."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from pipeline.serving.served import ServeConfig
from pipeline.serving.server import create_app
from serving.support import champion_registry, experience_rows

OK = {"model": "ratchet", "messages": [{"role": "user", "content": "12+35=?"}]}


@pytest.fixture(scope="module")
def shared_registry(tmp_path_factory, tiny_artifacts):
    return champion_registry(tmp_path_factory.mktemp("server"), tiny_artifacts)


@pytest.fixture(scope="module")
def client(shared_registry):
    app = create_app(  # anonymous clients stay served when a test of this module creates a key
        ServeConfig(
            registry_url=shared_registry,
            poll_seconds=0,
            device="cpu",
            flush_seconds=0.05,
            allow_anonymous=True,
        )
    )
    with TestClient(app) as c:
        yield c


def _bad(client, body=None, *, raw=None, status=400, code=None, param=None):
    r = (
        client.post("/v1/chat/completions", json=body)
        if raw is None
        else client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if code:
        assert err["code"] == code
    if param:
        assert err["param"] == param
    return err


@pytest.mark.parametrize(
    ("raw", "body", "status", "code", "param"),
    [
        (b"{not json", None, 400, "invalid_json", None),
        (b"[1, 2]", None, 400, "invalid_json", None),
        (None, {"model": "ratchet"}, 400, None, "messages"),
        (None, {"model": "ratchet", "messages": []}, 400, None, "messages"),
        (None, {"messages": OK["messages"]}, 400, None, "model"),
        (None, {**OK, "model": "gpt-4"}, 404, "model_not_found", "model"),
        (None, {**OK, "model": "coding"}, 404, "model_not_found", "model"),  # no adapter by name
        (None, {**OK, "temperature": "hot"}, 400, None, "temperature"),
        (None, {**OK, "temperature": 5}, 400, None, "temperature"),
        (None, {**OK, "max_tokens": "10"}, 400, None, "max_tokens"),
        (None, {**OK, "max_tokens": 0}, 400, None, "max_tokens"),
        (None, {**OK, "stream": "yes"}, 400, None, "stream"),
        (None, {**OK, "n": 9}, 400, None, "n"),
        (None, {**OK, "logit_bias": {"1": 5}}, 400, None, "logit_bias"),
        (None, {**OK, "tool_choice": "sometimes"}, 400, None, "tool_choice"),
        (None, {**OK, "stop": ["a", "b", "c", "d", "e"]}, 400, None, "stop"),
        (None, {**OK, "messages": "hello"}, 400, None, "messages"),
        (None, {**OK, "messages": [{"role": "wizard", "content": "x"}]}, 400, None, None),
        (None, {**OK, "messages": [{"role": "user"}]}, 400, None, None),
        (None, {**OK, "messages": [{"role": "user", "content": 5}]}, 400, None, None),
        (None, {**OK, "messages": [{"role": "assistant", "content": "hi"}]}, 400, None, "messages"),
        (None, {**OK, "messages": [{"role": "tool", "content": "x"}]}, 400, None, None),
        (None, {**OK, "max_tokens": 5000}, 400, "context_length_exceeded", "max_tokens"),
        (
            None,
            {**OK, "messages": [{"role": "user", "content": "x" * 500}]},
            400,
            "context_length_exceeded",
            "messages",
        ),
    ],
)
def test_client_mistakes_are_4xx_openai_errors(client, raw, body, status, code, param):
    _bad(client, body, raw=raw, status=status, code=code, param=param)
    assert client.post("/v1/chat/completions", json=OK).status_code == 200  # still serving


def test_unknown_paths_and_methods_are_openai_errors(client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert client.get("/v1/chat/completions").status_code == 405


def test_models_and_response_metadata(client):
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["ratchet"]
    r = client.post(
        "/v1/chat/completions", json={**OK, "messages": [{"role": "user", "content": "timer 3+4"}]}
    )
    body = r.json()
    assert r.headers["x-ratchet-specialist"] == "agent" == body["metadata"]["specialist"]
    assert body["metadata"]["generation"] == "0" and "strong signal" in body["metadata"]["route_reason"]
    assert "/" not in str(body["metadata"]) and "adapter" not in str(body).lower()  # no paths exposed
    assert (
        body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    )
    assert "summar" not in r.text


def test_feedback_attaches_and_errors(client, shared_registry):
    cid = client.post("/v1/chat/completions", json=OK).json()["id"]
    r = client.post("/v1/feedback", json={"completion_id": cid, "rating": 1, "correction": "47"})
    assert r.status_code == 200 and r.json()["ok"]
    # no key: the anonymous client's feedback is stored and shown, never counted (nothing is re-scored)
    assert r.json()["counted"] == {"rating": False, "correction": False} and r.json()["rescored"] == 0
    row = next(e for e in experience_rows(shared_registry) if e.completion_id == cid)
    assert row.feedback == {
        "claimed": {"rating": 1, "rating_by": "anonymous", "correction": "47", "correction_by": "anonymous"}
    }
    assert row.principal == "anonymous"
    assert client.post("/v1/feedback", json={"completion_id": "nope", "rating": 1}).status_code == 404
    assert client.post("/v1/feedback", json={"completion_id": cid}).status_code == 400
    assert client.post("/v1/feedback", json={"completion_id": cid, "rating": "good"}).status_code == 400
    assert client.post("/v1/feedback", content=b"{").status_code == 400


def test_api_key_protects_endpoints(registry):
    app = create_app(ServeConfig(registry_url=registry, poll_seconds=0, device="cpu", api_key="s3cret"))
    with TestClient(app) as c:
        assert c.get("/health").status_code == 200
        for call in (
            lambda h: c.get("/v1/models", headers=h),
            lambda h: c.post("/v1/chat/completions", json=OK, headers=h),
            lambda h: c.post("/v1/feedback", json={"completion_id": "x", "rating": 1}, headers=h),
            lambda h: c.post("/admin/reload", headers=h),
        ):
            assert call({}).status_code == 401
            assert call({"Authorization": "Bearer wrong"}).json()["error"]["code"] == "invalid_api_key"
        assert (
            c.post("/v1/chat/completions", json=OK, headers={"Authorization": "Bearer s3cret"}).status_code
            == 200
        )


def test_no_champion_is_a_clear_error(tmp_path, tiny_artifacts):
    from pipeline.errors import NotFoundError
    from pipeline.registry import upgrade_db

    url = f"sqlite:///{tmp_path / 'empty.db'}"
    upgrade_db(url)
    with (
        pytest.raises(NotFoundError, match="no champion"),
        TestClient(create_app(ServeConfig(registry_url=url))),
    ):
        pass


def _learned_app(tmp_path, tiny_artifacts, state=None):
    from pipeline.registry import upgrade_db
    from serving.support import HARNESS, register_generation

    url = f"sqlite:///{tmp_path / 'learned.db'}"
    upgrade_db(url)
    harness = {**HARNESS, "routing": {**HARNESS["routing"], "mode": "learned", "signals": {}}}
    register_generation(url, tiny_artifacts, harness=harness, state=state)
    return create_app(ServeConfig(registry_url=url, poll_seconds=0, device="cpu", flush_seconds=0.05)), url


def test_learned_router_from_the_entry_adapter_is_explained_and_stored(tmp_path, tiny_artifacts):
    app, url = _learned_app(tmp_path, tiny_artifacts)
    with TestClient(app) as c:
        r = c.post("/v1/chat/completions", json={**OK, "messages": [{"role": "user", "content": "hello"}]})
        meta = r.json()["metadata"]
        assert meta["route_reason"].startswith("learned router:")
        guarded = c.post(
            "/v1/chat/completions", json={**OK, "messages": [{"role": "user", "content": "```x```"}]}
        )
        assert guarded.json()["metadata"]["specialist"] == "coding"
        assert "guardrail" in guarded.json()["metadata"]["route_reason"]
    rows = experience_rows(url)
    scores = rows[0].meta["route_scores"]["learned"]
    assert set(scores) == {"chat", "agent", "coding", "genui"} and abs(sum(scores.values()) - 1) < 1e-4
    assert rows[0].routes[0]["scores"] == rows[0].meta["route_scores"]


def test_learned_router_from_a_trained_classifier(tmp_path, tiny_artifacts):
    from pipeline.serving.router import TokenClassifier

    clf = TokenClassifier.fit(
        [("hello", "genui"), ("timer", "agent")] * 5, ["chat", "agent", "coding", "genui"]
    )
    app, _url = _learned_app(tmp_path, tiny_artifacts, state={"router_classifier": clf.to_dict()})
    with TestClient(app) as c:
        r = c.post("/v1/chat/completions", json={**OK, "messages": [{"role": "user", "content": "hello"}]})
        assert r.json()["metadata"]["specialist"] == "genui"


def test_stop_sequences_and_seeded_sampling_over_http(client):
    body = {**OK, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
    full = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    text = full["message"]["content"]
    assert len(text) >= 4 and full["finish_reason"] == "length"
    stop = text[2:4]
    cut = client.post("/v1/chat/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert cut["message"]["content"] == text[: text.find(stop)] and cut["finish_reason"] == "stop"
    sampled = {**body, "temperature": 1.5, "top_p": 0.9, "seed": 5}
    a, b = (client.post("/v1/chat/completions", json=sampled).json() for _ in range(2))
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]


def test_request_metadata_is_kept_and_late_feedback_rescores_the_turn(client, shared_registry):
    """A deployment that knows the expected outcome says so in the request's metadata, with a key the operator
    granted `certify` (the server's own fields win); a rating from a key granted `rate` that arrives after
    scoring re-scores the turn, and the old scores stay."""
    from pathlib import Path

    from sqlalchemy import select

    from pipeline.experience.principals import OPERATOR, parse_scopes
    from pipeline.registry import (
        Score,
        ScoreHistory,
        create_api_key,
        get_engine,
        register_contract,
        session_scope,
    )
    from pipeline.scoring import score_experience
    from pipeline.specs.contract import load_contract

    with session_scope(get_engine(shared_registry)) as s:
        _, value = create_api_key(
            session=s, name="crm", scopes=parse_scopes("chat,certify,rate"), actor=OPERATOR
        )
    crm = {"Authorization": f"Bearer {value}"}
    meta = {"expected": "47", "specialist": "agent", "ticket": "T-1"}
    cid = client.post("/v1/chat/completions", json={**OK, "metadata": meta}, headers=crm).json()["id"]
    plain = client.post("/v1/chat/completions", json=OK, headers=crm).json()["id"]
    state = client.app.state.ratchet
    deadline = time.monotonic() + 10  # turns are written off the request path
    while (
        not ({cid, plain} <= {e.completion_id for e in experience_rows(shared_registry)})
        and time.monotonic() < deadline
    ):
        state.recorder.flush()
    rows = {e.completion_id: e for e in experience_rows(shared_registry)}
    assert rows[cid].meta["expected"] == "47" and rows[cid].meta["ticket"] == "T-1"
    assert rows[cid].meta["specialist"] == "chat"  # routed by the server, whatever the client claimed
    spec = load_contract(Path(__file__).resolve().parents[2] / "contracts" / "demo.yaml")
    with session_scope(get_engine(shared_registry)) as s:
        cv = register_contract(
            session=s, name=spec.name, version=spec.version, spec=spec.model_dump(mode="json")
        ).id
    with session_scope(get_engine(shared_registry)) as s:
        score_experience(session=s, contract_version_id=cv)

    def total(completion_id):
        with session_scope(get_engine(shared_registry)) as s:
            exp_id = next(e.id for e in experience_rows(shared_registry) if e.completion_id == completion_id)
            row = s.scalar(select(Score).where(Score.experience_id == exp_id, Score.scorer == "total",
                                               Score.contract_version_id == cv))  # fmt: skip
            history = s.scalars(select(ScoreHistory).where(ScoreHistory.experience_id == exp_id)).all()
            return (
                row.verified,
                row.details["verified_by"],
                [h.reason for h in history if h.scorer == "total"],
            )

    assert total(cid)[:2] == (True, ["exact_match"])  # checked against what the deployment said
    assert total(plain)[:2] == (False, [])  # nothing to check it against: never learned from
    r = client.post("/v1/feedback", json={"completion_id": plain, "rating": 5}, headers=crm)
    assert r.status_code == 200 and r.json()["rescored"] == 1
    assert total(plain) == (True, ["feedback"], ["feedback arrived after scoring"])
