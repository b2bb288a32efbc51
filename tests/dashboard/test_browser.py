"""The dashboard in a real browser: Debian's chromium driven by Playwright (no browser download).

With AENV_DASHBOARD_SCREENSHOTS=1 the test writes a desktop-width screenshot of each page to
docs/images/dashboard-*.png (docs/dashboard.md's tour; the README shows the overview).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import API_KEY, Server

CHROMIUM = shutil.which("chromium")
IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"
SHOTS = os.environ.get("AENV_DASHBOARD_SCREENSHOTS") == "1"
WAIT_MS = 20_000


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("CI must run the browser test: pip install playwright (the test extra)")
        pytest.skip("needs the playwright package")
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("CI must run the browser test: apt-get install chromium (scripts/install)")
        pytest.skip("needs Debian's chromium")
    with sync_playwright() as p:
        # As root, chromium runs only without its own sandbox (the test machine's browser, local pages).
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture()
def page(browser: Any, server: Server) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.set_default_timeout(WAIT_MS)
    yield page
    context.close()
    assert not errors, f"the page raised: {errors}"


def log_in(page: Any, server: Server, key: str = API_KEY) -> None:
    page.goto(f"{server.url}/dashboard")
    page.fill("#key", key)
    page.click("button[type=submit]")


def shot(page: Any, name: str) -> None:
    if SHOTS:
        IMAGES.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(IMAGES / f"dashboard-{name}.png"), full_page=True)


def create(api: httpx.Client, **body: Any) -> str:
    r = api.post("/sandboxes", json={"templateID": "base", "timeout": 300, **body})
    assert r.status_code == 201, r.text
    return str(r.json()["sandboxID"])


def test_the_pages_need_the_key_for_data(page: Any, server: Server) -> None:
    page.goto(f"{server.url}/dashboard")
    page.wait_for_selector("#key")
    assert page.locator("[data-node-id]").count() == 0
    shot(page, "login")
    log_in(page, server, key="wrong")
    page.wait_for_selector("text=That key was refused.")
    assert page.locator("[data-node-id]").count() == 0
    assert "wrong" not in page.url
    log_in(page, server)
    page.wait_for_selector("[data-node-id]")
    assert API_KEY not in page.url
    # Kept for this tab only, and sent as a header, never in a URL.
    assert page.evaluate("sessionStorage.getItem('aenv-api-key')") == API_KEY
    page.click("#forget-key")
    page.wait_for_selector("#key")


def test_a_sandbox_appears_and_goes_when_killed(page: Any, server: Server, api: httpx.Client) -> None:
    log_in(page, server)
    page.wait_for_selector("[data-node-id]")
    sandbox_id = create(api, metadata={"run": "tour"})
    page.goto(f"{server.url}/dashboard#/sandboxes")
    row = page.locator(f"tr[data-sandbox-id='{sandbox_id}']")
    row.wait_for()
    assert "run=tour" in row.inner_text()
    # a filter that leaves it out, then one that keeps it
    page.goto(f"{server.url}/dashboard#/sandboxes?metadata=run%3Dother")
    page.wait_for_selector("text=0 sandboxes")
    page.goto(f"{server.url}/dashboard#/sandboxes?state=running&metadata=run%3Dtour")
    row.wait_for()
    assert api.delete(f"/sandboxes/{sandbox_id}").status_code == 204
    row.wait_for(state="detached")


def test_what_a_sandbox_shows(page: Any, server: Server, api: httpx.Client, e2b_env: Server) -> None:
    from e2b import CommandExitException, Sandbox

    hostile = "<img src=x onerror=\"document.body.dataset.pwned='1'\">"
    log_in(page, server)
    page.wait_for_selector("[data-node-id]")
    # activity while the overview is open: its live charts have something to show
    sbx = Sandbox.create(timeout=300, metadata={"team": "rl", "note": hostile})
    try:
        sbx.commands.run("echo ok")
        with pytest.raises(CommandExitException):
            sbx.commands.run("echo '<b>bold</b>'; exit 3")
        children = api.post(f"/sandboxes/{sbx.sandbox_id}/fork", json={"count": 2})
        assert children.status_code in (200, 201), children.text
        child_ids = [c["sandbox"]["sandboxID"] for c in children.json()]
        api.post(f"/sandboxes/{child_ids[0]}/pause")
        api.post(f"/sandboxes/{child_ids[0]}/resume", json={})
        time.sleep(6)
        # the commands run in sandboxes, by how they ended: one of each at least
        cells = page.locator("#commands tbody td").all_inner_texts()
        assert len(cells) == 9 and int(cells[1]) >= 1 and int(cells[2]) >= 1, cells  # exit 0, exit != 0
        shot(page, "overview")
        page.goto(f"{server.url}/dashboard#/sandboxes")
        page.locator(f"tr[data-sandbox-id='{sbx.sandbox_id}']").wait_for()
        shot(page, "sandboxes")
        page.click(f"a[href='#/sandbox/{sbx.sandbox_id}']")
        page.wait_for_selector("[data-exit-code='3']")
        commands = page.locator("table").first.inner_text()
        assert "echo '<b>bold</b>'; exit 3" in commands and "echo ok" in commands
        for child in child_ids:
            page.locator(f"a[href='#/sandbox/{child}']").wait_for()
        # hostile metadata is shown as text: no element made of it, no handler run
        page.wait_for_selector(f"text={hostile}")
        assert page.locator("img").count() == 0
        assert page.evaluate("document.body.dataset.pwned") is None
        time.sleep(2)
        shot(page, "sandbox")
        page.goto(f"{server.url}/dashboard#/templates")
        page.locator("tr[data-artifact-id]").first.wait_for()
        assert "base" in page.locator("table").inner_text()
        shot(page, "templates")
    finally:
        sbx.kill()
        for child in locals().get("child_ids", []):
            api.delete(f"/sandboxes/{child}")
