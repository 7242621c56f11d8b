"""The JSON API's OpenAPI schema lists the fields of every response, and what the routes return on a real
registry is exactly what their response models declare."""

from __future__ import annotations

from urllib.parse import quote

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from dashboard.conftest import CONVERSATION_ID, served_trace_ids
from pipeline.dashboard import create_app
from pipeline.settings import Settings

TOKEN = "t" * 32


def _resolve(spec: dict, schema: dict) -> dict:
    while "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def _refs(schema: object) -> set[str]:
    """The component names ``schema`` refers to, at any depth."""
    if isinstance(schema, dict):
        own = {schema["$ref"].rsplit("/", 1)[1]} if "$ref" in schema else set()
        return own.union(*(_refs(v) for v in schema.values()))
    if isinstance(schema, list):
        return set().union(*(_refs(v) for v in schema))
    return set()


def test_every_json_route_declares_its_fields(tmp_path):
    """Each ``/api/`` GET and POST answers 200 with an object schema that lists its properties, forbids any
    other, and describes each one; so does every model those responses contain."""
    spec = create_app(Settings(home=tmp_path)).openapi()
    routes = [(path, method, op) for path, ops in spec["paths"].items() for method, op in ops.items()
              if path.startswith("/api/") and method in ("get", "post")]  # fmt: skip
    assert len(routes) >= 20
    bare, components = [], set()
    for path, method, op in routes:
        schema = (
            op["responses"].get("200", {}).get("content", {}).get("application/json", {}).get("schema", {})
        )
        body = _resolve(spec, schema)
        if (
            body.get("type") != "object"
            or not body.get("properties")
            or body.get("additionalProperties") is not False
        ):
            bare.append(f"{method.upper()} {path}")
        components |= _refs(schema)
    assert not bare, f"JSON routes without a response model: {bare}"
    seen: set[str] = set()
    while components - seen:  # every model reachable from a response
        name = (components - seen).pop()
        seen.add(name)
        model = spec["components"]["schemas"][name]
        if model.get("type") == "object" and "properties" in model:
            undescribed = [p for p, s in model["properties"].items() if not s.get("description")]
            assert not undescribed, f"{name}: fields without a description: {undescribed}"
            assert model.get("additionalProperties") is False, f"{name} allows fields it does not declare"
        components |= _refs(model)
    assert {"GenerationDetail", "TraceDetail", "ExperiencePage", "Verdict", "GateTestRecord"} <= seen
    assert {"ConversationDetail", "ConversationTurn", "OfferedTool", "ServedTokenCounts"} <= seen


def _models(app) -> dict[str, type]:
    return {
        r.path_format: r.response_model for r in app.routes if isinstance(r, APIRoute) and r.response_model
    }


def _exactly(models: dict[str, type], route: str, response) -> dict:
    """The response validates against ``route``'s model, and has exactly its fields (no more, none missing)."""
    assert response.status_code == 200, (route, response.text)
    model = models[route]
    model.model_validate_json(response.content)
    data = response.json()
    assert set(data) == set(model.model_fields), route
    return data


def test_real_responses_are_what_their_models_declare(read_settings):
    app = create_app(read_settings, allowed_hosts=["testserver"])
    models = _models(app)
    with TestClient(app, base_url="https://testserver") as c:
        gen = _exactly(models, "/api/generations/{number}", c.get("/api/generations/1"))
        assert gen["adapters"] and gen["verdict"]["tests"] and gen["router"]["confusion"]
        items = _exactly(models, "/api/generations/{number}/items", c.get("/api/generations/1/items"))
        row = items["rows"][0]
        item = c.get(f"/api/generations/1/items/{row['specialist']}/{row['position']}")
        assert _exactly(models, "/api/generations/{number}/items/{specialist}/{position}", item)["messages"]
        trends = _exactly(models, "/api/trends", c.get("/api/trends"))
        assert trends["scores"] and trends["router"]
        adapter_id = next(a["adapter_id"] for a in gen["adapters"] if a["new"] and a["dataset"])
        adapter = _exactly(models, "/api/adapters/{adapter_id}", c.get(f"/api/adapters/{adapter_id}"))
        assert adapter["traces"] and adapter["dataset"]["rows"] > 0
        page = _exactly(models, "/api/experience", c.get("/api/experience", params={"limit": 200}))
        assert page["traces"]
        for kind, trace_id in served_trace_ids(read_settings).items():
            detail = _exactly(models, "/api/experience/{experience_id}", c.get(f"/api/experience/{trace_id}"))
            assert detail["turns"] and detail["verdict"]["status"], kind
        chat = c.get(f"/api/conversations/{quote(CONVERSATION_ID, safe='')}")
        turns = _exactly(models, "/api/conversations/{conversation_id}", chat)["turns"]
        assert len(turns) == 2 and turns[1]["added"] and turns[1]["shared"] == 2
        detail = _exactly(
            models, "/api/experience/{experience_id}", c.get(f"/api/experience/{turns[1]['id']}")
        )
        assert detail["tools"] and detail["conversation_previous"] == turns[0]["id"]
        for kind in ("contracts", "harnesses"):
            versions = _exactly(models, f"/api/{kind}", c.get(f"/api/{kind}"))["versions"]
            first, last = versions[0]["id"], versions[-1]["id"]
            _exactly(models, f"/api/{kind}/{{version_id}}", c.get(f"/api/{kind}/{first}"))
            diff = c.get(f"/api/{kind}/diff", params={"a": first, "b": last})
            assert _exactly(models, f"/api/{kind}/diff", diff)["rows"]
        assert _exactly(models, "/api/quarantine", c.get("/api/quarantine"))["entries"]
        assert _exactly(models, "/api/audit", c.get("/api/audit"))["entries"]
        assert _exactly(models, "/api/artifacts/{path}", c.get("/api/artifacts/"))["entries"]


@pytest.mark.parametrize("action", ["rescore", "rollback"])
def test_action_responses_are_what_their_models_declare(acting_home, action):
    app = create_app(Settings(home=acting_home, admin_token=TOKEN), allowed_hosts=["testserver"])
    models = _models(app)
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    with TestClient(app, base_url="https://testserver") as c:
        if action == "rescore":
            trace_id = served_trace_ids(Settings(home=acting_home))["two_turns"]
            path, route = f"/api/experience/{trace_id}/rescore", "/api/experience/{experience_id}/rescore"
        else:
            path, route = "/api/rollback", "/api/rollback"
            assert c.post("/api/generations/2/promote", headers=bearer).status_code == 200
        data = _exactly(models, route, c.post(path, headers=bearer))
    if action == "rescore":
        assert data["experience_id"] == trace_id and data["contract_versions"]
    else:
        assert data["lineage"] == "main" and data["champion"] != 2


def test_the_reference_page_shows_what_each_route_returns(tmp_path):
    """``/api/docs`` (rendered by the app: no Swagger UI) links each route to its response model and lists the
    model's fields with their types and descriptions."""
    app = create_app(Settings(home=tmp_path), allowed_hosts=["testserver"])
    with TestClient(app, base_url="https://testserver") as c:
        page = c.get("/api/docs")
    assert page.status_code == 200
    assert '<a href="#TraceDetail">TraceDetail</a>' in page.text and 'id="TraceDetail"' in page.text
    assert "<code>list[TraceRow]</code>" in page.text and "One page of traces, newest first." in page.text
    assert "<code>dict[str, list[TrendPoint]]</code>" in page.text
