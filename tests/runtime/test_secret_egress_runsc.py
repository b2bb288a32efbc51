"""Secrets at egress end to end on gVisor: commands inside a sandbox (curl, Python's urllib) call a
host that has a ``network.rules`` transform, over HTTPS and plain HTTP; a receiver on this host
gets the secret's value in the header, and the sandbox never holds it: not in its environment, its
files, nor its memory (all of which a pause's checkpoint holds, searched on the host), nor the
node's other files and logs. A fork's child gets the value sent for it the same way and holds it
no more than its source.

The receiver listens on this host's own non-loopback address at 443 and 80 (the ports the node
intercepts), its name given to the node by AENV_EGRESS_HOSTS, its self-signed certificate trusted
by the node through AENV_EGRESS_EXTRA_CA (the sandbox trusts only the node's egress CA)."""

from __future__ import annotations

import http.server
import os
import secrets
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from aenv.node.intercept import EXTRA_CA_ENV
from tests.api.test_secret_egress import self_signed
from tests.conftest import API_KEY, DATA_DIR, REPO_DIR, Server, start_server
from tests.node.test_egress import host_address

pytestmark = [pytest.mark.sandbox, pytest.mark.runsc]

HOST = "api.egress-e2e.test"
OTHER = "other.egress-e2e.test"  # the same receiver, under a name with no rule: sent bare

# Holds its argument's bytes in memory until killed.
HOLD = 'import sys, time; held = bytes.fromhex(sys.argv[1]); open("/tmp/held", "w").close(); time.sleep(3600)'
# One request with urllib over the proxy the sandbox is given, the body it got printed.
URLLIB_GET = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=30).read().decode())"


@dataclass
class Receiver:
    """HTTPS on :443 and HTTP on :80 of this host's address; records each request's path and
    headers, answers "ok" (never the headers: an echo would carry the value into the sandbox)."""

    cert: Path
    seen: list[tuple[str, dict[str, str]]] = field(default_factory=list)

    def by_path(self, path: str) -> dict[str, str]:
        found = [headers for got, headers in self.seen if got == path]
        assert len(found) == 1, f"{path}: {len(found)} requests arrived ({[p for p, _ in self.seen]})"
        return found[0]


@pytest.fixture(scope="module")
def receiver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Receiver]:
    cert, key = self_signed(tmp_path_factory.mktemp("receiver"), HOST)
    found = Receiver(cert)

    class Record(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            found.seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: Any) -> None:
            pass

    tls = http.server.ThreadingHTTPServer((host_address(), 443), Record)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    tls.socket = ctx.wrap_socket(tls.socket, server_side=True)
    plain = http.server.ThreadingHTTPServer((host_address(), 80), Record)
    for server in (tls, plain):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield found
    for server in (tls, plain):
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def egress_node(receiver: Receiver) -> Iterator[Server]:
    env = {
        "AENV_REPO": str(REPO_DIR),
        "AENV_REPO_GC_INTERVAL": "0",
        EXTRA_CA_ENV: str(receiver.cert),
        "AENV_EGRESS_HOSTS": f"{HOST}={host_address()},{OTHER}={host_address()}",
    }
    srv = start_server(Path(f"{DATA_DIR}-egress"), extra_env=env)
    yield srv
    srv.stop()


def occurrences(root: Path, needle: bytes, *, skip: tuple[Path, ...] = ()) -> list[str]:
    """Files under ``root`` (links not followed, ``skip`` left out) that hold ``needle``. The node
    runs meanwhile: what goes away during the walk (an instance's directory) is passed over."""
    hits = []
    for top, dirs, names in os.walk(root):  # errors (a directory gone) are ignored
        here = Path(top)
        dirs[:] = [d for d in dirs if not any((here / d).is_relative_to(s) for s in skip)]
        for name in names:
            path = here / name
            try:
                if path.is_file() and not path.is_symlink() and needle in path.read_bytes():
                    hits.append(str(path))
            except OSError:
                continue
    return hits


def test_a_sandbox_sends_the_secret_it_never_holds(
    egress_node: Server, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    from e2b import Sandbox

    monkeypatch.setenv("E2B_API_KEY", API_KEY)
    monkeypatch.setenv("E2B_API_URL", egress_node.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", egress_node.url)
    value = "e2e-" + secrets.token_hex(20)
    needle = value.encode()
    api = egress_node.client()
    assert api.post("/secrets", json={"name": "e2e_token", "value": value}).status_code == 201
    rule = {"transform": {"headers": {"Authorization": "Bearer ${e2b.secrets.E2E_TOKEN}", "X-Plain": "fixed"}}}
    network = {"allow_out": [f"{host_address()}/32"], "rules": {HOST: [rule]}}
    sbx = Sandbox.create(timeout=300, network=network, allow_internet_access=False)
    child = None
    try:
        # curl over HTTPS (through the proxy every command gets, trusting the node's CA), with an
        # Authorization of its own that the rule replaces; urllib over HTTPS and over plain HTTP
        out = sbx.commands.run(f"curl -sS -H 'Authorization: Bearer mine' https://{HOST}/curl-https", timeout=60)
        assert out.stdout == "ok", out
        for url in (f"https://{HOST}/urllib-https", f"http://{HOST}/urllib-http"):
            assert sbx.commands.run(f"python3 -c '{URLLIB_GET}' {url}", timeout=60).stdout.strip() == "ok"
        # the same receiver under a name without a rule: nothing added
        assert sbx.commands.run(f"curl -sS http://{OTHER}/bare", timeout=60).stdout == "ok"
        for path in ("/curl-https", "/urllib-https", "/urllib-http"):
            headers = receiver.by_path(path)
            assert headers["authorization"] == f"Bearer {value}" and headers["x-plain"] == "fixed", path
            assert headers["host"] == HOST
        assert "authorization" not in receiver.by_path("/bare") and "x-plain" not in receiver.by_path("/bare")

        def holds_nothing(box: Any) -> None:
            env = box.commands.run("env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'", user="root").stdout
            assert "PATH=" in env and value not in env
            files = box.commands.run(
                f"grep -rlsF --exclude-dir=proc --exclude-dir=sys '{value[:12]}' / | head -5; true",
                user="root",
                timeout=180,
            ).stdout
            assert files.strip() == "", files

        images = egress_node.data_dir / "fs" / "images"

        def memory_holds_nothing(box: Any) -> None:
            """A pause writes all of the sandbox's memory (every process's, its kernel's buffers)
            uncompressed into its checkpoint image on the node's disk: the value is nowhere in it,
            while a marker a process inside holds in memory is found there (so the search sees
            memory); nor is it in the node's other files (its logs included: the value exists only
            encrypted at rest). The sandbox's own files (fs/layers) were searched from inside."""
            before = set(images.iterdir())
            box.beta_pause()
            (image,) = set(images.iterdir()) - before
            assert occurrences(image, marker) != [], "the search does not reach the sandbox's memory"
            assert occurrences(image, needle) == []
            layers = egress_node.data_dir / "fs" / "layers"
            assert occurrences(egress_node.data_dir, needle, skip=(images, layers)) == []
            assert needle not in egress_node.log.read_bytes()

        holds_nothing(sbx)
        marker = secrets.token_bytes(24)  # given as hex: only the process's memory holds these bytes
        sbx.commands.run(f"python3 -c '{HOLD}' {marker.hex()}", background=True)
        sbx.commands.run("for i in $(seq 300); do [ -e /tmp/held ] && exit 0; sleep 0.1; done; exit 1")
        memory_holds_nothing(sbx)
        sbx = Sandbox.connect(sbx.sandbox_id)
        assert sbx.commands.run(f"curl -sS https://{HOST}/after-resume", timeout=60).stdout == "ok"
        assert receiver.by_path("/after-resume")["authorization"] == f"Bearer {value}"
        # a fork's child: restored from its source's image, its own requests filled in the same way
        r = api.post(f"/sandboxes/{sbx.sandbox_id}/fork", json={"count": 1})
        assert r.status_code == 201, r.text
        child = Sandbox.connect(r.json()[0]["sandbox"]["sandboxID"])
        assert child.commands.run(f"curl -sS https://{HOST}/from-child", timeout=60).stdout == "ok"
        assert receiver.by_path("/from-child")["authorization"] == f"Bearer {value}"
        holds_nothing(child)
        memory_holds_nothing(child)
    finally:
        for box in (child, sbx):
            if box is not None:
                box.kill()
        api.delete("/secrets/e2e_token")
        api.close()
