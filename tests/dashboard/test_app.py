"""The dashboard's pages and JSON API over a registry built by real advancement cycles and real serving."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from dashboard.conftest import (
    CERTIFIED_METADATA,
    CERTIFIED_RATING,
    CLAIMED_FEEDBACK,
    CLAIMED_METADATA,
    HOSTILE,
    KEY_NAME,
    SERVED_HOSTILE,
    served_trace_ids,
)
from pipeline.dashboard import create_app
from pipeline.registry import (
    Adapter,
    AuditLog,
    Experience,
    Generation,
    Score,
    TrainingDataset,
    get_engine,
    session_scope,
)
from pipeline.settings import Settings


@pytest.fixture
def client(read_settings):
    with TestClient(
        create_app(read_settings, allowed_hosts=["testserver"]), base_url="https://testserver"
    ) as c:
        yield c


def _rows(settings, stmt):
    with session_scope(get_engine(settings.registry_url)) as s:
        return s.execute(stmt).all()


def test_lineage_page_and_api_show_every_generation(client, read_settings):
    data = client.get("/api/lineage").json()
    gens = {g["number"]: g for g in data["generations"]}
    stored = dict(_rows(read_settings, select(Generation.number, Generation.status)))
    assert {n: g["status"] for n, g in gens.items()} == stored and len(stored) == 3
    assert data["champion"] == 0 and gens[0]["champion"] and gens[1]["parent"] == 0
    assert gens[1]["overall"] is not None and gens[1]["method"].startswith("grpo+sft")
    page = client.get("/")
    assert page.status_code == 200 and "<svg" in page.text
    for n in gens:  # every node of the tree links to its generation page
        assert f'href="/generations/{n}"' in page.text
    assert page.headers["content-security-policy"].startswith("default-src 'none'")


def test_generation_detail_has_the_decision_evidence(client, read_settings):
    data = client.get("/api/generations/1").json()
    with session_scope(get_engine(read_settings.registry_url)) as s:
        gen = s.scalar(select(Generation).where(Generation.number == 1))
        ev, decision = gen.evaluation, gen.decision
        datasets = {
            d.specialist: d.num_rows
            for d in s.scalars(select(TrainingDataset).where(TrainingDataset.generation_id == gen.id))
        }
    held = {r["specialist"]: r for r in data["heldout"]["specialists"]}
    assert set(held) == set(ev["comparison"]["specialists"]) == {"chat", "agent", "coding", "genui"}
    for s, r in held.items():
        stored = ev["comparison"]["specialists"][s]
        assert r["delta"] == pytest.approx(stored["delta"]) and r["n"] == 20
        assert r["interval"][0] <= r["delta"] <= r["interval"][1]
    assert data["verdict"]["decision"] == decision and data["verdict"]["reasons"]
    assert data["verdict"]["reasons"][0].startswith("overall ")  # a reason keeps its parenthesis whole
    # the gate's own tests, as judged: the improvement test and one non-inferiority test per specialist (and
    # the demo's retention suite), each with its p-value, the rate its attempt could spend and the outcome;
    # the table's non-inferiority column says what the gate decided, not a t bound beside it
    tests = {t["test"]: t for t in data["verdict"]["tests"]}
    assert tests.keys() >= {"improvement", *(f"noninferiority:{s}" for s in held)}
    assert tests["improvement"] == ev["verdict"]["tests"][0] and all(0 <= t["p"] <= 1 for t in tests.values())
    assert all(r["passes_tolerance"] == tests[f"noninferiority:{s}"]["passed"] for s, r in held.items())
    page = client.get("/generations/1").text
    assert 'id="gate-tests"' in page and all(name in page for name in tests)
    adapters = {a["specialist"]: a for a in data["adapters"]}
    for s, rows in datasets.items():
        a = adapters[s]
        assert a["new"] and a["dataset"]["rows"] == rows and len(a["loss_curve"]) == a["steps"] > 1
        assert all(step >= 1 and loss > 0 for step, loss in a["loss_curve"]) and a["method"] == "sft"
    rl = adapters["genui"]  # trained online: no dataset, a reward curve, the method said
    assert rl["method"] == "grpo" and rl["dataset"] is None and len(rl["loss_curve"]) == rl["steps"] == 2
    assert rl["final_reward"] is not None and rl["final_loss"] is None
    router = data["router"]
    assert sum(sum(row.values()) for row in router["confusion"].values()) == router["total"]
    kept = data["curation"]["kept"]
    assert {s: n for s, n in kept.items() if n} == datasets and "below threshold" in data["curation"][
        "reasons"
    ]
    found = data["discovery"]
    assert set(found) == {"chat", "agent", "coding", "genui"} and all(d["tried"] > 0 for d in found.values())
    page = client.get("/generations/1").text
    assert "training loss" in page and "router confusion" in page and "non-inferiority" in page
    assert "GRPO: mean contract reward" in page and "<h2>Discovery</h2>" in page
    nodes = {g["number"]: g for g in client.get("/api/lineage").json()["generations"]}
    assert nodes[1]["method"].startswith("grpo+sft")  # the tree labels a node with the methods that built it
    assert "grpo+sft" in client.get("/").text


def test_item_comparison_matches_the_stored_evaluation(client, read_settings):
    data = client.get("/api/generations/1/items").json()
    (ev,) = _rows(read_settings, select(Generation.evaluation).where(Generation.number == 1))[0]
    for s, counts in data["counts"].items():
        assert sum(counts.values()) == 20
        mine = [r for r in data["rows"] if r["specialist"] == s]
        assert [r["candidate"] for r in mine] == pytest.approx(ev["items"][s]["candidate"], abs=1e-4)
        assert [r["parent"] for r in mine] == pytest.approx(ev["items"][s]["parent"], abs=1e-4)
    solved = data["solved_at"]
    for r in data["rows"]:
        if r["change"] == "newly solved":
            assert r["parent"] < solved <= r["candidate"]
        if r["change"] == "unchanged":
            assert r["parent"] == r["candidate"]
    changed = [r for r in data["rows"] if r["change"] != "unchanged"]
    assert changed, "the fixture's candidates differ from their parent on some item"
    first = changed[0]
    only = client.get(f"/api/generations/1/items?change={first['change']}").json()["rows"]
    assert only and all(r["change"] == first["change"] for r in only)
    item = client.get(f"/api/generations/1/items/{first['specialist']}/{first['position']}").json()
    assert item["parent_value"] == first["parent"] and item["candidate_answer"]["role"] == "assistant"
    page = client.get(f"/generations/1/items/{first['specialist']}/{first['position']}").text
    assert "Parent (generation 0)" in page and "Generation 1 ·" in page
    assert client.get("/api/generations/1/items?change=sideways").status_code == 400
    tail = client.get("/api/generations/1/items", params={"offset": 70}).json()
    assert tail["matching"] == 80 and tail["rows"] == data["rows"][70:] and tail["next_offset"] is None


def test_provenance_both_ways(client, read_settings):
    import datasets

    data = client.get("/api/generations/1").json()
    adapter = next(a for a in data["adapters"] if a["new"])
    (path,) = _rows(
        read_settings, select(TrainingDataset.path).where(TrainingDataset.id == adapter["dataset"]["id"])
    )[0]
    in_file = set(datasets.load_from_disk(path)["experience_id"])
    seen, before = [], None
    while True:  # keyset pages over the adapter's traces
        page = client.get(
            f"/api/adapters/{adapter['adapter_id']}" + (f"?before={before}" if before else "")
        ).json()
        seen += [t["id"] for t in page["traces"]]
        before = page["next_before"]
        if before is None:
            break
    assert set(seen) == in_file and len(seen) == len(in_file) and seen == sorted(seen, reverse=True)
    principals = {
        t["principal"] for t in page["traces"]
    }  # who taught it: the loop's practice, the operator's
    assert principals and principals <= {"ratchet", "operator"}
    assert page["dataset"]["sha256"] == adapter["dataset"]["sha256"]
    trace = client.get(f"/api/experience/{seen[0]}").json()
    assert any(t["adapter_id"] == adapter["adapter_id"] and t["generation"] == 1 for t in trace["trained"])
    lineage_json = client.get(f"/artifacts/{page['artifact_path']}/lineage.json")
    assert lineage_json.status_code == 200 and lineage_json.headers["content-type"].startswith("text/plain")
    assert json.loads(lineage_json.text)["dataset_sha256"] == adapter["dataset"]["sha256"]


def test_trends_have_a_point_per_evaluated_generation(client):
    data = client.get("/api/trends").json()
    for points in data["scores"].values():
        assert [p["generation"] for p in points] == [0, 1, 2]
        assert all(p["low"] <= p["score"] <= p["high"] for p in points)
    assert [p["generation"] for p in data["router"]] == [0, 1, 2]
    assert client.get("/trends").text.count("<svg") == 2


def test_experience_keyset_pages_cover_every_trace_once(client, read_settings):
    ids = [r[0] for r in _rows(read_settings, select(Experience.id).order_by(Experience.id.desc()))]
    seen, before = [], None
    while True:
        page = client.get(
            "/api/experience", params={"limit": 97, **({"before": before} if before else {})}
        ).json()
        seen += [t["id"] for t in page["traces"]]
        before = page["older"]
        if before is None:
            break
    assert seen == ids
    middle = client.get("/api/experience", params={"limit": 5, "before": ids[10]}).json()
    newer = client.get("/api/experience", params={"limit": 5, "after": middle["newer"]}).json()
    assert [t["id"] for t in newer["traces"]] == ids[6:11]


@pytest.mark.parametrize(
    "params, check",
    [
        ({"specialist": "chat"}, lambda t, row: t["specialist"] == "chat"),
        ({"source": "deployment"}, lambda t, row: t["source"] == "deployment"),
        ({"generation": 0}, lambda t, row: t["generation"] == 0),
        ({"verified": "yes"}, lambda t, row: t["verified"] is True),
        ({"verified": "unscored"}, lambda t, row: t["score"] is None),
        ({"score_min": 0.5, "score_max": 1.0}, lambda t, row: 0.5 <= t["score"] <= 1.0),
        ({"feedback": "correction"}, lambda t, row: "correction" in (row.feedback or {})),
        ({"q": "f adds", "specialist": "coding"}, lambda t, row: "f adds" in json.dumps(row.messages)),
    ],
)
def test_experience_filters(client, read_settings, params, check):
    page = client.get("/api/experience", params={**params, "limit": 200}).json()
    assert page["traces"], params
    rows = {
        r.id: r for r in _rows(read_settings, select(Experience.id, Experience.messages, Experience.feedback))
    }
    assert all(check(t, rows[t["id"]]) for t in page["traces"])
    html = client.get("/experience", params=params)
    assert html.status_code == 200 and f"#{page['traces'][0]['id']}" in html.text


def test_trace_shows_routes_views_summaries_and_scores(client, read_settings):
    ids = served_trace_ids(read_settings)
    data = client.get(f"/api/experience/{ids['two_turns']}").json()
    assistant = [t for t in data["turns"] if t["role"] == "assistant"]
    assert len(assistant) == 2 and all(t["route"] and t["route"]["specialist"] for t in assistant)
    assert assistant[-1]["route"]["reason"] and assistant[-1]["route"]["scores"]
    assert all(t["summary"] for t in assistant)
    view = assistant[-1]["view"]  # what the second turn's specialist answered from
    assert isinstance(view, list) and view[-1] == {"role": "user", "content": "f adds 1 2"}
    assert "total" in {r["scorer"] for rows in data["scores"].values() for r in rows}
    page = client.get(f"/experience/{ids['two_turns']}").text
    assert "routed to" in page and "hidden summary" in page and "signal scores" in page


def test_hostile_text_is_shown_as_text(client, read_settings):
    ids = served_trace_ids(read_settings)
    page = client.get(f"/experience/{ids['hostile']}")
    assert "<script>window.__pwned" not in page.text
    assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in page.text
    ingested = client.get(f"/experience/{ids['ingested_hostile']}").text
    assert (
        "<img src=x" not in ingested
        and 'href="javascript:' not in ingested
        and "&lt;img src=x onerror=" in ingested
    )
    listing = client.get("/experience", params={"q": "pwned"}).text
    assert "<img src=x" not in listing and "<script>window" not in listing
    claimed = client.get(f"/experience/{ids['claimed']}").text  # claimed metadata and feedback: text too
    assert "<script>window.__pwned" not in claimed and "<img src=x" not in claimed
    assert SERVED_HOSTILE.replace("<", "&lt;").replace(">", "&gt;") in claimed
    assert "&lt;img src=x onerror=" in claimed and HOSTILE not in claimed
    quarantine = client.get("/quarantine").text
    assert "&lt;script&gt;window.__pwned = 4" in quarantine and "<script>window.__pwned" not in quarantine
    assert "script-src" not in page.headers["content-security-policy"]  # default-src 'none': no script at all


def _element(html: str, element_id: str) -> str:
    """The text of the element with ``element_id`` (tags dropped, entities kept)."""
    found = re.search(rf'<(\w+)[^>]*\bid="{element_id}"[^>]*>(.*?)</\1>', html, re.S)
    assert found, f"no #{element_id} on the page"
    return re.sub(r"<[^>]+>", "", found.group(2))


def _list_row(html: str, trace_id: int) -> str:
    """The text of the experience list's row of ``trace_id``."""
    found = re.search(rf"<tr>(?:(?!</tr>).)*>#{trace_id}</a>.*?</tr>", html, re.S)
    assert found, f"no row of trace {trace_id}"
    return re.sub(r"<[^>]+>", " ", found.group(0))


def test_an_anonymous_turn_shows_its_claims_as_claimed_and_is_not_verified(client, read_settings):
    """An anonymous client's metadata and feedback are shown under labels that say they were claimed and never
    scored; its final turn, which no verifying check applied to, reads "not verified" where a pass would be
    (never its form score), and every score stays shown, labelled."""
    trace = served_trace_ids(read_settings)["claimed"]
    data = client.get(f"/api/experience/{trace}").json()
    assert data["principal"] == "anonymous"
    assert data["claimed_metadata"] == CLAIMED_METADATA and "expected" not in data["metadata"]
    assert data["counted_feedback"] == []
    assert data["claimed_feedback"] == [
        {"field": "rating", "value": CLAIMED_FEEDBACK["rating"], "by": "anonymous"},
        {"field": "correction", "value": CLAIMED_FEEDBACK["correction"], "by": "anonymous"},
    ]
    verdict = data["verdict"]
    assert (
        verdict["status"] == "not verified" and verdict["verified"] is False and verdict["value"] is not None
    )
    scorers = {r["scorer"] for rows in data["scores"].values() for r in rows}
    assert {"total", "final", "length"} <= scorers
    page = client.get(f"/experience/{trace}").text
    shown = _element(page, "final-turn")
    assert "not verified" in shown and f"{verdict['value']:.3f}" not in shown
    assert "anonymous" in _element(page, "principal")
    claimed = _element(page, "claimed-metadata")
    assert "claimed by the client" in claimed and "never scored" in claimed and "expected" in claimed
    assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in claimed
    claimed_feedback = _element(page, "claimed-feedback")
    assert "never scored" in claimed_feedback and "&lt;img src=x onerror=" in claimed_feedback
    assert "<script>window.__pwned" not in page and "<img src=x" not in page
    assert "mean over the scored turns" in page and "final assistant turn" in page  # both scores, labelled
    listing = client.get("/api/experience", params={"principal": "anonymous", "limit": 200}).json()["traces"]
    mine = next(t for t in listing if t["id"] == trace)
    assert (mine["status"], mine["verified"], mine["principal"]) == ("not verified", False, "anonymous")
    row = _list_row(client.get("/experience", params={"principal": "anonymous"}).text, trace)
    assert "not verified" in row and f"{mine['score']:.3f}" not in row and "claimed" in row


def test_a_failed_check_is_not_shown_as_verified(client, read_settings):
    """A turn whose certified reference answer the model missed: a verifying scorer applied to it (the total
    row says so), but the check failed -- the pages say "failed: <checks>", never verified, and its counted
    rating says who gave it."""
    trace = served_trace_ids(read_settings)["certified"]
    (total_verified,) = _rows(
        read_settings, select(Score.verified).where(Score.experience_id == trace, Score.scorer == "total")
    )[0]
    assert total_verified is True  # what the pages read before: "verified"
    data = client.get(f"/api/experience/{trace}").json()
    assert data["principal"] == KEY_NAME and data["claimed_metadata"] is None
    assert data["metadata"]["expected"] == CERTIFIED_METADATA["expected"]
    assert data["counted_feedback"] == [{"field": "rating", "value": CERTIFIED_RATING, "by": KEY_NAME}]
    assert data["claimed_feedback"] == []
    verdict = data["verdict"]
    assert (
        verdict["status"] == "failed" and verdict["verified"] is False and "exact_match" in verdict["failed"]
    )
    page = client.get(f"/experience/{trace}").text
    shown = _element(page, "final-turn")
    assert "failed: " in shown and "exact_match" in shown and "passed" not in shown
    counted = _element(page, "counted-feedback")
    assert "rating" in counted and f"by {KEY_NAME}" in counted
    listing = client.get("/api/experience", params={"principal": KEY_NAME}).json()["traces"]
    assert [(t["id"], t["status"], t["verified"]) for t in listing] == [(trace, "failed", False)]
    assert "exact_match" in listing[0]["failed"]
    passed = client.get("/api/experience", params={"verified": "yes", "limit": 200}).json()["traces"]
    assert passed and trace not in {t["id"] for t in passed} and all(t["status"] == "passed" for t in passed)
    failed = client.get("/api/experience", params={"verified": "failed", "limit": 200}).json()["traces"]
    assert trace in {t["id"] for t in failed}
    row = _list_row(client.get("/experience", params={"principal": KEY_NAME}).text, trace)
    assert "failed: " in row and "exact_match" in row and KEY_NAME in row


def test_a_trace_scored_before_final_rows_reads_not_scored(acting_home):
    """A trace whose scores under a contract were written before ``final`` rows existed (its ``total`` says
    verified) is not scored under the final-turn rules: the pages say so and never show it as verified."""
    from sqlalchemy import delete

    from pipeline.registry import dispose_engines

    settings = Settings(home=acting_home)
    trace = served_trace_ids(settings)["certified"]
    with session_scope(get_engine(settings.registry_url)) as s:
        s.execute(delete(Score).where(Score.experience_id == trace, Score.scorer == "final"))
    dispose_engines()
    with TestClient(create_app(settings, allowed_hosts=["testserver"])) as c:
        data = c.get(f"/api/experience/{trace}").json()
        assert data["verdict"]["status"] == "not scored" and data["verdict"]["legacy"] is True
        assert data["verdict"]["verified"] is False and data["verdict"]["total"] is not None
        shown = _element(c.get(f"/experience/{trace}").text, "final-turn")
        assert "not scored" in shown and "scored before final-turn scores were recorded" in shown
        (row,) = c.get("/api/experience", params={"principal": KEY_NAME}).json()["traces"]
        assert (row["status"], row["verified"], row["score"]) == ("not scored", None, None)
        unscored = c.get("/api/experience", params={"verified": "unscored", "limit": 200}).json()["traces"]
        assert trace in {t["id"] for t in unscored}


def test_generation_page_shows_curation_drops_by_principal(client, read_settings):
    (state,) = _rows(read_settings, select(Generation.state).where(Generation.number == 1))[0]
    stored = state["steps"]["curate"]["dropped_by_principal"]
    assert stored  # the loop's own practice below the threshold, at least
    data = client.get("/api/generations/1").json()
    assert data["curation"]["dropped_by_principal"] == stored
    page = client.get("/generations/1").text
    table = re.search(r'<table id="dropped-by-principal">(.*?)</table>', page, re.S)
    assert table, "no table of drops by principal"
    rows = [
        re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", r)
        for r in re.findall(r"<tr>(.*?)</tr>", table.group(1), re.S)
    ]
    header, body = rows[0], rows[1:]
    shown = {
        r[0]: {reason: int(n) for reason, n in zip(header[1:], r[1:], strict=True) if n != "0"} for r in body
    }
    assert shown == stored


@pytest.mark.parametrize(
    "path",
    [
        "/artifacts/../../../../etc/passwd",
        "/artifacts/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
        "/artifacts/%252e%252e/%252e%252e/etc/passwd",
        "/artifacts/..%2f..%2f..%2fetc%2fpasswd",
        "/artifacts//etc/passwd",
        "/artifacts/%2fetc%2fpasswd",
        "/artifacts/C:/Windows/win.ini",
        "/artifacts/..%5c..%5cetc%5cpasswd",
        "/artifacts/main/%00/passwd",
        "/api/artifacts/../../../../etc/passwd",
        "/api/artifacts/%2e%2e%2f%2e%2e%2fetc%2fpasswd",
    ],
)
def test_no_path_leaves_the_artifact_store(client, path):
    reply = client.get(path)
    assert 400 <= reply.status_code < 500, (path, reply.status_code)
    assert "root:" not in reply.text


def test_a_link_out_of_the_store_is_refused(acting_home, tmp_path):
    outside = tmp_path / "secret.json"
    outside.write_text('{"secret": true}')
    (acting_home / "artifacts" / "leak.json").symlink_to(outside)
    with TestClient(create_app(Settings(home=acting_home), allowed_hosts=["testserver"])) as c:
        assert c.get("/artifacts/leak.json").status_code == 400
        assert "leak.json" not in c.get("/api/artifacts/").text


def test_unknown_records_are_404_and_bad_ids_422(client):
    for path in (
        "/generations/99",
        "/experience/99999999",
        "/adapters/99999",
        "/contracts/999",
        "/api/generations/99",
    ):
        assert client.get(path).status_code == 404, path
    assert client.get("/api/generations/1?lineage=nope").status_code == 404
    assert client.get("/api/generations/abc").status_code == 422
    assert client.get("/api/experience", params={"limit": 100000}).status_code == 422


def test_versions_and_side_by_side_diff(client):
    harnesses = client.get("/api/harnesses").json()["versions"]
    contracts = client.get("/api/contracts").json()["versions"]
    assert contracts and harnesses
    one = client.get(f"/api/contracts/{contracts[0]['id']}").json()
    assert one["yaml"].startswith("name:") or "name:" in one["yaml"]
    same = client.get("/api/contracts/diff", params={"a": contracts[0]["id"], "b": contracts[0]["id"]}).json()
    assert same["changed_lines"] == 0 and all(r["op"] == "equal" for r in same["rows"])
    if len(harnesses) > 1:  # co-design registered a variant: the diff shows what it changed
        diff = client.get(
            "/api/harnesses/diff", params={"a": harnesses[0]["id"], "b": harnesses[-1]["id"]}
        ).json()
        assert diff["changed_lines"] > 0
    assert (
        '<table class="diff"'
        in client.get("/contracts/diff", params={"a": contracts[0]["id"], "b": contracts[0]["id"]}).text
    )


def test_openapi_lists_every_page_as_json(client):
    schema = client.get("/api/openapi.json").json()
    paths = set(schema["paths"])
    for page in ("/lineage", "/generations/{number}", "/generations/{number}/items", "/trends", "/experience",
                 "/experience/{experience_id}", "/adapters/{adapter_id}", "/contracts", "/harnesses/diff",
                 "/quarantine", "/audit"):  # fmt: skip
        assert "/api" + page in paths, page
    assert {"/api/generations/{number}/promote", "/api/rollback"} <= paths
    docs = client.get("/api/docs")
    assert docs.status_code == 200 and "/api/experience" in docs.text and "cdn" not in docs.text.lower()


def test_read_only_without_a_token(client, read_settings):
    before = len(_rows(read_settings, select(AuditLog.id)))
    reply = client.post("/api/generations/1/promote", headers={"Authorization": "Bearer anything"})
    assert reply.status_code == 403 and "RATCHET_ADMIN_TOKEN" in reply.json()["detail"]
    assert client.post("/rollback", data={"lineage": "main"}).status_code == 403
    assert "actions disabled" in client.get("/").text
    assert len(_rows(read_settings, select(AuditLog.id))) == before


def _audit(settings, action):
    return _rows(
        settings,
        select(AuditLog.actor, AuditLog.entity_id).where(AuditLog.action == action).order_by(AuditLog.id),
    )


def test_bearer_actions_are_allowed_and_audited(acting_home):
    from mlflow import MlflowClient

    settings = Settings(home=acting_home, admin_token="s3cret-token-0123456789")
    with TestClient(create_app(settings, allowed_hosts=["testserver"])) as c:
        assert (
            c.post("/api/generations/1/promote", headers={"Authorization": "Bearer wrong"}).status_code == 401
        )
        ok = c.post("/api/generations/1/promote", headers={"Authorization": "Bearer s3cret-token-0123456789"})
        assert ok.status_code == 200 and ok.json()["champion"] == 1
        assert c.get("/api/lineage").json()["champion"] == 1
        assert _audit(settings, "promote")[-1][0] == "dashboard:bearer"
        mlflow = MlflowClient(tracking_uri=settings.tracking_uri)
        adapters = c.get("/api/generations/1").json()["adapters"]
        for a in adapters:
            if a["new"]:
                version = mlflow.get_model_version_by_alias(
                    f"ratchet-main-{a['specialist']}", "champion"
                ).version
                stored = _rows(
                    settings, select(Adapter.mlflow_model_version).where(Adapter.id == a["adapter_id"])
                )
                assert str(version) == str(stored[0][0])
        again = c.post(
            "/api/generations/1/promote", headers={"Authorization": "Bearer s3cret-token-0123456789"}
        )
        assert again.status_code == 409 and "already the champion" in again.json()["detail"]
        back = c.post("/api/rollback", headers={"Authorization": "Bearer s3cret-token-0123456789"})
        assert back.status_code == 200 and back.json()["champion"] == 0
        assert _audit(settings, "rollback")[-1][0] == "dashboard:bearer"


def test_login_session_cookie_and_csrf(acting_home):
    import re

    settings = Settings(home=acting_home, admin_token="s3cret-token-0123456789")
    trace = served_trace_ids(settings)["two_turns"]
    with TestClient(
        create_app(settings, allowed_hosts=["testserver"]),
        base_url="https://testserver",
        follow_redirects=False,
    ) as c:
        assert c.post("/login", data={"token": "nope"}).status_code == 401
        login = c.post("/login", data={"token": "s3cret-token-0123456789"})
        assert login.status_code == 303
        cookie = login.headers["set-cookie"].lower()
        assert "secure" in cookie and "httponly" in cookie and "samesite=strict" in cookie
        page = c.get(f"/experience/{trace}").text
        csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page).group(1)
        assert c.post(f"/experience/{trace}/rescore", data={}).status_code == 403  # no CSRF token
        assert c.post(f"/experience/{trace}/rescore", data={"csrf": "0" * 64}).status_code == 403
        forged = c.post(
            f"/experience/{trace}/rescore", data={"csrf": csrf}, headers={"Origin": "https://evil.example"}
        )
        assert forged.status_code == 403 and "cross-site" in forged.text
        history_before = len(_rows(settings, select(Score.id).where(Score.experience_id == trace)))
        done = c.post(
            f"/experience/{trace}/rescore", data={"csrf": csrf}, headers={"Origin": "https://testserver"}
        )
        assert done.status_code == 303 and done.headers["location"].startswith(f"/experience/{trace}")
        assert _audit(settings, "rescore")[-1] == ("dashboard:session", trace)
        assert len(_rows(settings, select(Score.id).where(Score.experience_id == trace))) == history_before
        promote = c.post("/generations/2/promote", data={"csrf": csrf, "reason": "looks better"})
        assert promote.status_code == 303 and c.get("/api/lineage").json()["champion"] == 2
        c.post("/logout")
        c.cookies.clear()
        assert c.post("/rollback", data={"csrf": csrf}).status_code == 401


def test_cli_dashboard_serves_the_registry(dashboard_home):
    import os
    import socket
    import subprocess
    import sys
    import time

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "RATCHET_HOME": str(dashboard_home)}
    env.pop("RATCHET_ADMIN_TOKEN", None)
    exe = Path(sys.executable).parent / "ratchet"
    proc = subprocess.Popen(
        [str(exe), "dashboard", "--port", str(port)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert "read-only" in proc.stdout.readline()
        deadline = time.monotonic() + 60
        while True:
            try:
                reply = httpx.get(f"http://127.0.0.1:{port}/api/lineage", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.2)
        assert reply.status_code == 200 and reply.json()["lineage"] == "main"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_hostile_shapes_render_as_text_and_long_traces_are_paged(acting_home, tmp_path):
    from pipeline.experience.ingest import ingest_file
    from pipeline.registry import dispose_engines

    settings = Settings(home=acting_home)
    odd = [
        {"turn": "x", "specialist": "chat"},
        {"turn": 1, "specialist": "chat", "scores": [1, 2]},
        {"turn": 1, "specialist": "chat", "scores": {"chat": {"a": "notnum"}, "b": 3}},
        {"turn": 1, "specialist": {"x": 1}, "reason": {"r": "<b>"}},
    ]
    long_turns = [
        m
        for i in range(3000)
        for m in ({"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"})
    ]
    lines = [
        {
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
            "routes": [r],
            "metadata": {"summaries": "<i>not a dict</i>"},
        }  # fmt: skip
        for r in odd
    ]
    lines.append(
        {"messages": long_turns, "routes": [{"turn": 2 * i + 1, "specialist": "chat"} for i in range(3000)]}
    )
    path = tmp_path / "odd.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    engine = get_engine(settings.registry_url)
    result = ingest_file(path, session_factory=lambda: session_scope(engine), source="deployment",
                         harness_version_id=1)  # fmt: skip
    assert (result.stored, result.quarantined) == (1, 4)  # ingest refuses the odd shapes now ...
    from pipeline.registry import TraceRow, insert_traces

    with session_scope(engine) as s:  # ... but rows stored before it did (or by another writer) still render
        insert_traces(session=s, rows=[
            TraceRow(content_hash=f"odd-{i}", messages=json.dumps(x["messages"]), metadata=json.dumps(x["metadata"]),
                     feedback=None, routes=json.dumps(x["routes"]), specialist="chat", source="deployment",
                     harness_version_id=1)
            for i, x in enumerate(lines[:4])
        ])  # fmt: skip
    dispose_engines()
    with TestClient(create_app(settings, allowed_hosts=["testserver"])) as c:
        ids = [
            t["id"]
            for t in c.get("/api/experience", params={"source": "deployment", "limit": 200}).json()["traces"]
        ]
        assert len(ids) >= 5
        for i in ids[:5]:
            page = c.get(f"/experience/{i}")
            assert page.status_code == 200, (i, page.text[:300])
            assert "'<b>'" not in page.text and "<i>not" not in page.text
        big = c.get(f"/api/experience/{ids[4]}").json()
        assert big["turn_count"] == 6000 and len(big["turns"]) == 200 and big["next_turns"] == 200
        assert sum(1 for t in big["turns"] if t["view"] is not None) == 10
        later = c.get(f"/api/experience/{ids[4]}", params={"turns_from": 5900}).json()
        assert (
            later["turns"][0]["index"] == 5900
            and later["next_turns"] is None
            and later["previous_turns"] == 5700
        )


def test_hostile_principals_claims_and_drops_render_as_text(acting_home):
    """Principals, claims, counted feedback and curation's drops by principal of any shape (as another writer
    might have stored them) render as escaped text on every page that shows them, and the API answers."""
    from pipeline.registry import TraceRow, dispose_engines, insert_traces

    settings = Settings(home=acting_home)
    engine = get_engine(settings.registry_url)
    marks = ["<b>who</b>", "<i>not a dict</i>", "<b>5</b>", "<i>by</i>", "<b>k</b>", "<i>v</i>", "<i>list</i>",
             "<i>nor an object</i>", "<b>mallory</b>", "<i>why</i>", "<b>n</b>", "<i>eve</i>"]  # fmt: skip
    odd = [  # (principal, metadata, feedback)
        ("<b>who</b>", {"claimed": "<i>not a dict</i>"}, {"claimed": "<i>not a dict</i>", "rating": "<b>5</b>",
                                                          "rating_by": {"x": "<i>by</i>"}}),
        ("x", {"claimed": {"<b>k</b>": "<i>v</i>"}}, {"claimed": {"correction": ["<i>list</i>"], "correction_by": 7}}),
        (None, {"claimed": None}, "<i>nor an object</i>"),
    ]  # fmt: skip
    messages = json.dumps([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    with session_scope(engine) as s:
        insert_traces(session=s, rows=[
            TraceRow(content_hash=f"claims-{i}", messages=messages, metadata=json.dumps(m), feedback=json.dumps(f),
                     routes="[]", specialist="chat", source="deployment", principal=who)
            for i, (who, m, f) in enumerate(odd)
        ])  # fmt: skip
        ids = list(s.scalars(select(Experience.id).where(Experience.content_hash.like("claims-%"))))
        gen = s.scalar(select(Generation).where(Generation.number == 1))
        state = json.loads(json.dumps(gen.state))
        state["steps"]["curate"][
            "dropped_by_principal"
        ] = {  # counts by principal and reason: only names are text
            "<b>mallory</b>": {"<i>why</i>": 3, "over cap": 1},
            "<i>eve</i>": {"<b>n</b>": 2},
        }
        gen.state = state
    dispose_engines()
    with TestClient(create_app(settings, allowed_hosts=["testserver"])) as c:
        pages = [c.get(f"/experience/{i}") for i in ids]
        pages += [c.get("/experience", params={"principal": "<b>who</b>"}), c.get("/experience"),
                  c.get("/generations/1")]  # fmt: skip
        for page in pages:
            assert page.status_code == 200, page.text[:300]
            assert not [m for m in marks if m in page.text], page.url
        assert "&lt;b&gt;who&lt;/b&gt;" in pages[0].text and "&lt;b&gt;who&lt;/b&gt;" in pages[3].text
        assert "&lt;b&gt;mallory&lt;/b&gt;" in pages[-1].text
        for i in ids:
            assert c.get(f"/api/experience/{i}").status_code == 200
        assert c.get("/api/generations/1").json()["curation"]["dropped_by_principal"]["<b>mallory</b>"]


def test_other_hosts_huge_ids_short_tokens(read_settings):
    from pipeline.errors import RatchetError

    with TestClient(create_app(read_settings), base_url="http://127.0.0.1:8100") as c:
        assert c.get("/api/lineage").status_code == 200
        assert (
            c.get("/api/lineage", headers={"Host": "rebind.attacker.example"}).status_code == 400
        )  # DNS rebinding
        for path in ("/experience/999999999999999999999999999999", "/api/generations/99999999999999999999",
                     "/api/experience?before=9223372036854775808", "/api/audit?before=9223372036854775808"):  # fmt: skip
            assert c.get(path).status_code == 422, path
    with pytest.raises(RatchetError, match="at least 16"):
        create_app(Settings(home=read_settings.home, admin_token="short"))


def test_sign_out_ends_the_session_and_wrong_tokens_are_throttled(acting_home):
    import re

    settings = Settings(home=acting_home, admin_token="s3cret-token-0123456789")
    with TestClient(
        create_app(settings, allowed_hosts=["testserver"]),
        base_url="https://testserver",
        follow_redirects=False,
    ) as c:
        c.post("/login", data={"token": "s3cret-token-0123456789"})
        cookie = c.cookies.get("ratchet_session")
        csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', c.get("/").text).group(1)
        assert c.post("/logout", data={}).status_code == 403  # a cross-site form cannot sign anyone out
        assert c.post("/logout", data={"csrf": csrf}).status_code == 303
        c.cookies.set("ratchet_session", cookie)  # the old cookie, replayed
        assert c.post("/rollback", data={"csrf": csrf}).status_code == 401
        for _ in range(20):
            assert (
                c.post(
                    "/api/rollback", headers={"Authorization": "Bearer wrong-guess-0000000000"}
                ).status_code
                == 401
            )
        throttled = c.post("/api/rollback", headers={"Authorization": "Bearer s3cret-token-0123456789"})
        assert throttled.status_code == 429 and "too many" in throttled.json()["detail"]
