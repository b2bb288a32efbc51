"""Egress through the in-sandbox proxy, enforced by the host: real sandboxes, a real host server.

"The internet" here is a file server on this host's own non-loopback address. That address is
private, so the default policy refuses it and an allowOut entry opens it: both directions of the
policy are exercised without depending on the outside world.
"""

from __future__ import annotations

import hashlib
import http.server
import os
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox

from tests.conftest import Server
from tests.node.test_isolation import run

pytestmark = pytest.mark.sandbox
PROXY = "http://127.0.0.1:3128"


def host_address() -> str:
    """This host's primary non-loopback address (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.123", 9))
        return str(s.getsockname()[0])


@pytest.fixture(scope="module")
def outside(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(base URL, sha256 of /blob) of a file server outside every sandbox."""
    root = tmp_path_factory.mktemp("outside")
    blob = os.urandom(5 * 1024 * 1024)
    (root / "blob").write_bytes(blob)
    (root / "hello.txt").write_text("hello from outside")
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(root))  # noqa: E731
    http.server.SimpleHTTPRequestHandler.log_message = lambda *a: None  # type: ignore[method-assign]
    server = http.server.ThreadingHTTPServer((host_address(), 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://{host_address()}:{server.server_address[1]}", hashlib.sha256(blob).hexdigest()
    server.shutdown()


def test_default_policy_refuses_private_and_host_addresses(e2b_env: Server, outside: tuple[str, str]) -> None:
    url, _ = outside
    sbx = Sandbox.create(timeout=120)
    try:
        assert sbx.commands.run("echo $HTTPS_PROXY").stdout.strip() == PROXY
        code, out = run(sbx, f"curl -sS {url}/hello.txt")
        assert "private address" in out and "hello from outside" not in out
        # Forcing the proxy at this host's own services gets nowhere, whatever the spelling.
        port = e2b_env.port
        for target in (
            f"http://127.0.0.1:{port}/health",
            f"http://localhost:{port}/health",
            f"http://[::ffff:127.0.0.1]:{port}/health",
            f"http://[::1]:{port}/health",
            "http://169.254.169.254/latest/meta-data/",
            f"http://0.0.0.0:{port}/health",
        ):
            code, out = run(sbx, f"curl -sS --noproxy '' -x {PROXY} -w ' %{{http_code}}' '{target}'")
            assert "never reachable" in out and out.rstrip().endswith("403"), (target, out)
        code, out = run(sbx, f"curl -sS --noproxy '' -p -x {PROXY} 'http://127.0.0.1:{port}/health'")  # CONNECT
        assert code != 0 and "403" in out, out
    finally:
        sbx.kill()


def test_allow_out_opens_an_address_through_pause_and_fork(
    e2b_env: Server, api: httpx.Client, outside: tuple[str, str]
) -> None:
    url, digest = outside
    ip = url.split("//")[1].split(":")[0]
    sbx = Sandbox.create(timeout=300, network={"allow_out": [f"{ip}/32"]})
    try:
        assert api.get(f"/sandboxes/{sbx.sandbox_id}").json()["network"] == {"allowOut": [f"{ip}/32"]}
        assert sbx.commands.run(f"curl -sS {url}/hello.txt").stdout == "hello from outside"
        got = sbx.commands.run(f"curl -sS {url}/blob | sha256sum").stdout.split()[0]
        assert got == digest  # 5 MiB through the proxy, intact
        got = sbx.commands.run(f"curl -sS -p {url}/blob | sha256sum").stdout.split()[0]
        assert got == digest  # and through a CONNECT tunnel
        assert sbx.pause() is True
        again = Sandbox.connect(sbx.sandbox_id)
        assert again.commands.run(f"curl -sS {url}/hello.txt").stdout == "hello from outside"
        r = api.post(f"/sandboxes/{sbx.sandbox_id}/fork", json={"count": 1})
        child = Sandbox.connect(r.json()[0]["sandbox"]["sandboxID"])
        try:
            assert child.commands.run(f"curl -sS {url}/hello.txt").stdout == "hello from outside"
        finally:
            child.kill()
    finally:
        Sandbox.kill(sbx.sandbox_id)


def test_no_internet_and_update_network(e2b_env: Server, api: httpx.Client, outside: tuple[str, str]) -> None:
    url, _ = outside
    ip = url.split("//")[1].split(":")[0]
    sbx = Sandbox.create(timeout=120, allow_internet_access=False)
    try:
        code, out = run(sbx, f"curl -sS {url}/hello.txt")
        assert "no internet access" in out
        sbx.update_network({"allow_out": [ip]})  # replaces the rules; new connections follow them
        assert sbx.commands.run(f"curl -sS {url}/hello.txt").stdout == "hello from outside"
        sbx.update_network({"deny_out": [f"{ip}/32"]})
        code, out = run(sbx, f"curl -sS {url}/hello.txt")
        assert "denyOut" in out or "no internet access" in out
        bad = api.put(f"/sandboxes/{sbx.sandbox_id}/network", json={"denyOut": ["example.com"]})
        assert bad.status_code == 400 and "denyOut" in bad.json()["message"]
        assert api.put("/sandboxes/nosuchsandbox/network", json={}).status_code == 404
    finally:
        sbx.kill()


def test_bad_network_rules_are_400(api: httpx.Client) -> None:
    bad_rule = {"x.example": [{"transform": {"headers": {"Bad Header": "v"}}}]}
    networks = [{"allowOut": ["not a domain!"]}, {"denyOut": ["example.com"]}]
    networks += [{"rules": bad_rule}, {"rules": {"*": []}}]
    for network in networks:
        r = api.post("/v2/sandboxes", json={"templateID": "base", "network": network})
        assert r.status_code == 400 and r.json()["code"] == 400, r.text
    assert not [s for s in api.get("/v2/sandboxes").json() if s.get("network") == {"allowOut": ["not a domain!"]}]


def test_egress_counts_on_metrics(server: Server) -> None:
    text = httpx.get(f"{server.url}/metrics").text
    assert 'aenv_egress_connections_total{outcome="denied"}' in text
