"""E2B's network update replaces the whole egress configuration, internet access included, as
Harbor's e2b environment relies on between an agent phase and a verifier phase: `{}` after a
no-network phase is public again, `{"allow_internet_access": False}` closes it, an allowlist
opens only what it names. Seen failing before the fix: the update ignored
`allow_internet_access` (extra field) and kept the create's `False` through `{}`."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import httpx
import pytest
from e2b import ALL_TRAFFIC, Sandbox

from tests.conftest import Server
from tests.node.test_egress import host_address

pytestmark = [pytest.mark.sandbox, pytest.mark.fast]  # the fast tier runs it on the fake runtime


@pytest.fixture(scope="module")
def outside() -> Iterator[str]:
    """A server on this host's own address: private, so only an allowOut entry naming it opens it."""

    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "5")
            self.end_headers()
            self.wfile.write(b"hello")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer((host_address(), 0), Hello)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://{host_address()}:{server.server_address[1]}/"
    server.shutdown()


def fetch(sbx: Sandbox, url: str) -> str:
    return sbx.commands.run(f"curl -sS --max-time 20 {url} 2>&1 || true", timeout=60).stdout.strip()


def test_an_update_replaces_internet_access_too(e2b_env: Server, outside: str) -> None:
    sbx = Sandbox.create(allow_internet_access=False, timeout=120)
    try:
        assert sbx.get_info().allow_internet_access is False
        assert "no internet access" in fetch(sbx, outside)
        # Harbor's allowlist phase: only the named address
        sbx.update_network({"allow_out": [host_address()], "deny_out": [ALL_TRAFFIC]})
        assert fetch(sbx, outside) == "hello"
        # Harbor's public phase after a no-network one: internet access is the default again
        sbx.update_network({})
        assert sbx.get_info().allow_internet_access is True
        assert "private address" in fetch(sbx, outside)  # public only: the host's address stays closed
        sbx.update_network({"allow_internet_access": False})
        assert sbx.get_info().allow_internet_access is False
        assert "no internet access" in fetch(sbx, outside)
    finally:
        sbx.kill()


def test_a_bad_internet_flag_in_an_update_is_400(e2b_env: Server, api: httpx.Client) -> None:
    sbx = Sandbox.create(timeout=60)
    try:
        for bad in ("no", 0, None, [False]):
            r = api.put(f"/sandboxes/{sbx.sandbox_id}/network", json={"allow_internet_access": bad})
            if bad is None:  # JSON null: left out
                assert r.status_code == 204, r.text
                continue
            assert r.status_code == 400, r.text
            assert r.json()["code"] == 400
        assert sbx.get_info().allow_internet_access is True
    finally:
        sbx.kill()
