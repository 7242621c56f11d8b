"""The dashboard in a real browser: Debian's headless Chromium driven by Playwright (never a downloaded
browser). Opens the lineage, clicks through a generation to its item comparison and one item's answers,
filters experience, opens a served trace with its route decision and an anonymous one with what its client
claimed, follows a conversation (an id with markup in it) to its page and a turn's offered tools, checks that
injected script never ran, signs in and promotes through the form. Screenshots go to the test's temp dir."""

from __future__ import annotations

import os
import shutil
from urllib.parse import quote

import pytest
from serving.support import ServerThread

from dashboard.conftest import CONVERSATION_ID, served_trace_ids
from pipeline.dashboard import create_app
from pipeline.settings import Settings

CHROMIUM = os.environ.get("RATCHET_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture
def browser():
    if CHROMIUM is None:
        if os.environ.get("RATCHET_REQUIRE_BROWSER"):
            raise RuntimeError("RATCHET_REQUIRE_BROWSER is set but Debian's chromium is not installed")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            yield b
        finally:
            b.close()


def test_click_through_the_dashboard(browser, acting_home, tmp_path):
    settings = Settings(home=acting_home, admin_token="browser-token-0123456789")
    ids = served_trace_ids(settings)
    shots = tmp_path / "screenshots"
    shots.mkdir()
    errors: list[str] = []
    with ServerThread(create_app(settings)) as srv:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)

        page.goto(srv.url + "/")
        assert page.locator("svg.lineage a.node").count() == 3
        assert page.locator("#champion-score").inner_text() != "–"
        page.screenshot(path=str(shots / "lineage.png"), full_page=True)

        page.locator('svg.lineage a.node[data-generation="1"]').click()  # a node of the picture opens it
        page.wait_for_url("**/generations/1")
        assert page.locator("#heldout tr").count() == 6  # header, four specialists, overall
        assert page.locator("#verdict").inner_text() in ("promote", "reject")
        assert page.locator("#dropped-by-principal tr").count() >= 2  # a header and a principal at least
        page.screenshot(path=str(shots / "generation.png"), full_page=True)

        page.get_by_text("Item-level comparison").click()
        page.wait_for_url("**/generations/1/items**")
        assert page.locator("#changes tr").count() == 5
        page.locator("#items a").first.click()
        page.wait_for_url("**/generations/1/items/*/*")
        answers = page.locator("#answers h2")
        assert answers.nth(0).inner_text().startswith("Parent (generation 0)")
        assert answers.nth(1).inner_text().startswith("Generation 1")
        page.screenshot(path=str(shots / "item.png"), full_page=True)

        page.get_by_role("link", name="Experience").click()
        page.fill('#filters input[name="specialist"]', "chat")
        page.select_option('#filters select[name="source"]', "simulation")
        page.click('#filters button[type="submit"]')
        page.wait_for_url("**/experience?**specialist=chat**")
        cells = page.locator("#experience tr td:nth-child(4)").all_inner_texts()
        assert cells and set(cells) == {"chat"}
        assert set(page.locator("#experience tr td:nth-child(3)").all_inner_texts()) == {"simulation"}
        page.screenshot(path=str(shots / "experience.png"), full_page=True)

        page.goto(f"{srv.url}/experience/{ids['two_turns']}")
        routes = page.locator(".turn.assistant .route").all_inner_texts()
        assert any(r.startswith("routed to") for r in routes)
        page.locator("details summary", has_text="was shown").last.click()
        page.screenshot(path=str(shots / "trace.png"), full_page=True)

        page.goto(f"{srv.url}/experience/{ids['claimed']}")
        assert page.locator("#final-turn").inner_text().startswith("Final turn")
        assert "not verified" in page.locator("#final-turn").inner_text()
        assert "claimed by the client" in page.locator("#claimed-metadata").inner_text()
        page.screenshot(path=str(shots / "claimed.png"), full_page=True)

        for hostile in (ids["hostile"], ids["ingested_hostile"], ids["claimed"]):
            page.goto(f"{srv.url}/experience/{hostile}")
            assert page.evaluate("typeof window.__pwned") == "undefined"
            assert (
                page.locator("img[src='x']").count() == 0
                and page.locator("a[href^='javascript:']").count() == 0
            )
            assert "window.__pwned" in page.locator("main").inner_text()  # shown, as text
        page.goto(f"{srv.url}/experience?conversation={quote(CONVERSATION_ID, safe='')}")
        page.locator("#experience a.conversation").first.click()
        page.wait_for_url("**/conversations/**")
        assert page.locator("#conversation-id").inner_text() == CONVERSATION_ID
        assert page.locator("#turns section").count() == 2
        page.screenshot(path=str(shots / "conversation.png"), full_page=True)
        page.locator("#turns section h2 a").last.click()
        page.wait_for_url("**/experience/*")
        assert page.locator("#tools td code").first.inner_text() == "add"
        assert "window.__pwned" in page.locator("#tools").inner_text()
        assert (
            page.evaluate("typeof window.__pwned") == "undefined"
            and page.locator("img[src='x']").count() == 0
        )
        page.get_by_role("link", name="Quarantine").click()
        assert page.evaluate("typeof window.__pwned") == "undefined"
        assert "window.__pwned = 4" in page.locator("#quarantine").inner_text()
        page.screenshot(path=str(shots / "hostile.png"), full_page=True)

        page.get_by_role("link", name="sign in").click()
        page.fill('input[name="token"]', "browser-token-0123456789")
        page.click('button[type="submit"]')
        page.wait_for_url(srv.url + "/")
        cookie = next(c for c in page.context.cookies() if c["name"] == "ratchet_session")
        assert cookie["httpOnly"] and cookie["secure"] and cookie["sameSite"] == "Strict"
        page.goto(srv.url + "/generations/1")
        page.get_by_role("button", name="Make generation 1 the champion").click()
        page.wait_for_url("**/generations/1**")
        assert "(champion)" in page.locator("h1").inner_text()
        page.goto(srv.url + "/audit")
        assert "dashboard:session" in page.locator("#audit").inner_text()
        page.screenshot(path=str(shots / "audit.png"), full_page=True)
    assert not [e for e in errors if "Content Security Policy" not in e], errors
    assert len(list(shots.glob("*.png"))) == 9


def test_the_lineage_page_shows_the_accuracy_matrix(browser, read_settings, tmp_path):
    """The accuracy matrix as a heat map on the lineage page: a row per measured generation, a column per
    held-out and retention suite (the demo contract's retention suite is in the test lineage's contract),
    each measured cell coloured and labelled with its score; the champion's backward transfer beside it; and
    the trends page draws the retention suite beside the held-out scores."""
    with ServerThread(create_app(read_settings)) as srv:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(srv.url + "/")
        matrix = page.locator("svg.matrix")
        assert matrix.is_visible()
        suites = matrix.locator("text.suite").all_text_contents()  # SVG: no innerText
        assert {s for s in suites if s.startswith("heldout:")} == {
            f"heldout:{s}" for s in ("agent", "chat", "coding", "genui")
        }
        retention = [s for s in suites if s.startswith("retention:")]
        assert retention, suites
        cells = matrix.locator("g.cell")
        generations = {cells.nth(i).get_attribute("data-generation") for i in range(cells.count())}
        assert generations == {"0", "1", "2"}  # generation 0 measured as the first candidate's parent
        cell = matrix.locator(f'g.cell[data-generation="0"][data-suite="{retention[0]}"]')
        score = float(cell.get_attribute("data-score"))
        assert 0.0 <= score <= 1.0 and cell.locator("text").text_content() == f"{score:.3f}"
        assert cell.locator("rect").get_attribute("fill").startswith("#")
        transfer = page.locator("#backward-transfer").inner_text()
        assert retention[0] in transfer and "generation 0" in transfer
        page.screenshot(path=str(tmp_path / "matrix.png"), full_page=True)
        page.goto(srv.url + "/trends")
        assert (
            f"retention: {retention[0].removeprefix('retention:')}"
            in page.locator("svg.chart").first.inner_html()
        )
