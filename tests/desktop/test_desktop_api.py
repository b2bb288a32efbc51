"""The built-in `desktop` template's API: built on request (admin key, one build at a time),
started by its first use (503 with Retry-After meanwhile), a name no team can take. On the fake
runtime the build itself fails at once (it has no Debian `base`): what is tested is the API.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.conftest import Server

pytestmark = [pytest.mark.sandbox, pytest.mark.fast]


def _fake_only(server: Server) -> None:
    if server.env.get("AENV_DRIVER") != "fake":
        pytest.skip("on runsc a create from `desktop` builds it for real (tests/desktop/test_desktop_sdk.py)")


def test_an_unknown_builtin_or_browser_is_a_clear_4xx(api: httpx.Client) -> None:
    r = api.post("/templates/builtin/office")
    assert r.status_code == 404 and "desktop" in r.json()["message"]
    r = api.post("/templates/builtin/desktop", params={"browser": "opera"})
    assert r.status_code == 400 and "firefox-esr" in r.json()["message"]


def test_a_build_streams_its_log_and_says_why_it_failed(server: Server, api: httpx.Client) -> None:
    _fake_only(server)
    with api.stream("POST", "/templates/builtin/desktop", params={"browser": "none"}) as r:
        assert r.status_code == 200
        lines = [json.loads(line) for line in r.iter_lines() if line.strip()]
    assert "error" in lines[-1] and "Debian" in lines[-1]["error"]["message"], lines


def test_the_first_create_from_desktop_starts_its_build_and_gets_a_503(server: Server, api: httpx.Client) -> None:
    _fake_only(server)
    r = api.post("/sandboxes", json={"templateID": "desktop"})
    assert r.status_code == 503, r.text
    body = r.json()
    assert body["code"] == 503 and body["error_code"] == "template_building"
    assert "being built" in body["message"] and "aenv template build desktop" in body["message"]
    assert int(r.headers["retry-after"]) >= 1
    # The build fails on this runtime; the next create says so (and starts another).
    deadline = time.monotonic() + 30
    while True:
        again = api.post("/sandboxes", json={"templateID": "desktop:latest"})
        assert again.status_code == 503
        if "the last one failed" in again.json()["message"]:
            break
        assert time.monotonic() < deadline, again.text
        time.sleep(0.2)
    assert "Debian" in again.json()["message"]
    assert "desktop" not in api.get("/health").json()["templates"]


def test_a_team_key_neither_builds_it_nor_takes_its_name(api: httpx.Client) -> None:
    r = api.post("/teams", json={"name": f"desk-{time.monotonic_ns()}"})
    assert r.status_code == 201, r.text
    team = r.json()
    try:
        key = {"X-API-Key": team["apiKey"]}
        r = api.post("/templates/builtin/desktop", headers=key)
        assert r.status_code == 403 and "admin" in r.json()["message"]
        r = api.post("/templates/from-image", json={"name": "desktop", "image": "oci:/nowhere:v1"}, headers=key)
        assert r.status_code == 409 and "built-in" in r.json()["message"]
    finally:
        api.delete(f"/teams/{team['teamID']}")
