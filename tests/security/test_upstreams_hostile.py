"""What the node talks to on a client's behalf is hostile too: registries (their token realms,
redirects and answers), the servers a sandbox runs on its ports, and the sandbox's file system.

Registries here are real HTTP servers on real sockets, scripted to misbehave; a second server
plays the cloud metadata service or a node-local service and records whether it was reached."""

from __future__ import annotations

import base64
import hashlib
import io
import ipaddress
import json
import re
import select
import socket
import ssl
import subprocess
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect as ws_connect

from aenv.errors import AenvError, InvalidRequest, UpstreamError
from aenv.images import guard
from aenv.images.reference import ImageRef
from aenv.images.registry import MAX_DOCUMENT, MAX_TOKEN_ANSWER, RegistryClient
from tests.conftest import Server

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MiB = 2**20
ENDLESS = 512 * MiB  # far past any bound; what a client that reads it all would take


# -- scripted upstream servers ---------------------------------------------------------------------
Route = Callable[[BaseHTTPRequestHandler], None]


class Upstream:
    """An HTTP server on a real socket that answers each path with a scripted route (the longest
    matching prefix) and records every request and how many body bytes it managed to send."""

    def __init__(self, host: str = "127.0.0.1", tls: tuple[Path, Path] | None = None) -> None:
        self.routes: dict[str, Route] = {}
        self.hits: list[tuple[str, str]] = []  # (path, Authorization)
        self.sent = 0
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                upstream.hits.append((self.path, self.headers.get("Authorization", "")))
                prefix = max((p for p in upstream.routes if self.path.startswith(p)), key=len, default=None)
                if prefix is None:
                    reply(self, 404, b"{}")
                    return
                try:
                    upstream.routes[prefix](self)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client stopped reading: what a bounded reader does

            do_HEAD = do_GET  # noqa: N815

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        if tls is not None:  # (certificate, key)
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.scheme = "https" if tls else "http"
        self.host = host
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def netloc(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def origin(self) -> str:
        return f"{self.scheme}://{self.netloc}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def stream(self, handler: BaseHTTPRequestHandler, total: int = ENDLESS, status: int = 200, **headers: str) -> None:
        """Send ``total`` body bytes without a length, counting what the client took."""
        handler.send_response(status)
        for name, value in headers.items():
            handler.send_header(name, value)
        handler.send_header("Connection", "close")
        handler.end_headers()
        block = b"a" * 65536
        for _ in range(total // len(block)):
            handler.wfile.write(block)
            self.sent += len(block)


def reply(
    handler: BaseHTTPRequestHandler, status: int, body: bytes = b"", headers: dict[str, str] | None = None
) -> None:
    handler.send_response(status)
    for name, value in (headers or {}).items():
        handler.send_header(name, value)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(body)


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class FakeImage:
    """A one-layer linux image (a file in a directory), as a registry serves it."""

    def __init__(self, layer_size: int | None = None) -> None:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            data = b"hello from a hostile registry\n"
            info = tarfile.TarInfo("etc/hostile")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        self.layer = buf.getvalue()
        rootfs = {"type": "layers", "diff_ids": [sha(self.layer)]}
        self.config = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": rootfs}).encode()
        layer_desc = {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": sha(self.layer)}
        layer_desc["size"] = len(self.layer) if layer_size is None else layer_size
        config_desc = {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": sha(self.config)}
        config_desc["size"] = len(self.config)
        manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": config_desc, "layers": [layer_desc]}
        self.manifest = json.dumps(manifest).encode()

    def serve(self, registry: Upstream, repo: str = "evil/img") -> None:
        """Serve the image honestly (routes may then be replaced one by one)."""
        base = f"/v2/{repo}"
        registry.routes[f"{base}/manifests/"] = lambda h: reply(h, 200, self.manifest, {"Content-Type": OCI_MANIFEST})
        registry.routes[f"{base}/blobs/{sha(self.config)}"] = lambda h: reply(h, 200, self.config)
        registry.routes[f"{base}/blobs/{sha(self.layer)}"] = lambda h: reply(h, 200, self.layer)


def challenge(realm: str) -> Route:
    """A registry route that asks for a bearer token from ``realm`` (and refuses any it gets)."""

    def route(handler: BaseHTTPRequestHandler) -> None:
        header = f'Bearer realm="{realm}",service="evil",scope="repository:evil/img:pull"'
        reply(handler, 401, b'{"errors":[]}', {"WWW-Authenticate": header})

    return route


def redirect(location: str) -> Route:
    return lambda h: reply(h, 302, b"", {"Location": location})


@pytest.fixture()
def metadata() -> Iterator[Upstream]:
    """Plays the cloud metadata service / a node-local service: it answers with secrets."""
    server = Upstream()
    secret = json.dumps({"token": "SECRET-CREDENTIALS", "AccessKeyId": "SECRET-KEY"}).encode()
    server.routes["/"] = lambda h: reply(h, 200, secret, {"Content-Type": "application/json"})
    yield server
    server.close()


@pytest.fixture()
def registry() -> Iterator[Upstream]:
    server = Upstream()
    yield server
    server.close()


def outward_address() -> str | None:
    """An address of this machine that is not loopback (where a LAN or internet registry would be)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
        except OSError:
            return None
        addr = str(s.getsockname()[0])
    return None if addr.startswith("127.") else addr


@pytest.fixture()
def lan_registry() -> Iterator[Upstream]:
    """A registry on a non-loopback address of this machine (private or public, not this node's loopback)."""
    addr = outward_address()
    if addr is None:
        pytest.skip("this machine has no non-loopback address")
    server = Upstream(addr)
    yield server
    server.close()


async def pull_image(registry: Upstream, dest: Path | None = None) -> None:
    """What a pull does with the registry: resolve the image, then fetch its layers."""
    ref = ImageRef.parse(f"{registry.netloc}/evil/img:latest")
    client = RegistryClient(ref.registry, insecure={ref.registry})
    try:
        image = await client.resolve(ref, ("linux", "amd64"))
        with tempfile.TemporaryDirectory() as scratch:
            for i, desc in enumerate(image.layers):
                await client.fetch_blob(ref, desc, (dest or Path(scratch)) / f"layer-{i}")
    finally:
        await client.close()


async def refused(registry: Upstream, within: float = 20.0, **kw: Any) -> AenvError:
    started = time.monotonic()
    with pytest.raises(AenvError) as caught:
        await pull_image(registry, **kw)
    assert time.monotonic() - started < within, "the refusal must not wait on a connection"
    assert len(caught.value.message) < 600, caught.value.message  # no upstream text quoted at length
    assert "SECRET" not in caught.value.message
    return caught.value


# -- registries: where a realm or a redirect may send the node -------------------------------------
@pytest.mark.parametrize(
    "target",
    [
        "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
        "http://[::ffff:169.254.169.254]/computeMetadata/v1/",  # the same address, IPv4-mapped
        "http://2852039166/latest/meta-data/",  # 169.254.169.254 as one number: resolved, then judged
        "http://[fe80::1]:8080/",
        "http://224.0.0.1/",
        "http://0.0.0.0:2379/v2/keys",
    ],
)
@pytest.mark.parametrize("how", ["realm", "redirect"])
async def test_registry_never_sends_the_node_to_link_local_or_reserved_addresses(
    registry: Upstream, target: str, how: str
) -> None:
    """The node's cloud metadata endpoint is one realm or one redirect away from any registry."""
    FakeImage().serve(registry)
    registry.routes["/v2/evil/img/manifests/"] = challenge(target) if how == "realm" else redirect(target)
    err = await refused(registry)
    assert isinstance(err, UpstreamError) and err.status == 502, err
    assert "refused" in err.message and "link-local, multicast or reserved" in err.message, err.message


async def test_a_name_resolving_to_link_local_is_refused_before_any_connection(
    registry: Upstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Names are judged by what they resolve to (here a DNS answer naming the metadata service)."""
    real_resolve = guard.resolve

    async def resolve(host: str, port: int) -> list[Any]:
        if host == "metadata.attacker.example":
            return await real_resolve("169.254.169.254", port)
        return await real_resolve(host, port)

    monkeypatch.setattr(guard, "resolve", resolve)
    FakeImage().serve(registry)
    registry.routes["/v2/evil/img/manifests/"] = challenge("http://metadata.attacker.example/token")
    err = await refused(registry)
    assert "metadata.attacker.example (169.254.169.254)" in err.message, err.message


async def test_names_are_resolved_once_per_pull(registry: Upstream, monkeypatch: pytest.MonkeyPatch) -> None:
    """DNS rebinding: a name that answers harmlessly when checked and then with the metadata
    service is never asked twice; every connection goes to the address that was checked."""
    image = FakeImage()
    image.serve(registry)
    storage = Upstream()
    closing = {"Connection": "close"}  # every request a new connection, so a new chance to re-resolve
    storage.routes["/token"] = lambda h: reply(h, 200, b'{"token": "t"}', closing)
    storage.routes["/layer"] = lambda h: reply(h, 200, image.layer, closing)
    answers = iter([["127.0.0.1"], ["169.254.169.254"], ["169.254.169.254"]])
    asked: list[str] = []
    real_resolve = guard.resolve

    async def resolve(host: str, port: int) -> list[Any]:
        if host != "rebind.attacker.example":
            return await real_resolve(host, port)
        asked.append(host)
        return [ipaddress.ip_address(a) for a in next(answers)]

    monkeypatch.setattr(guard, "resolve", resolve)
    real_manifest = registry.routes["/v2/evil/img/manifests/"]
    origin = f"http://rebind.attacker.example:{storage.port}"
    registry.routes["/v2/evil/img/manifests/"] = lambda h: (
        real_manifest(h) if h.headers.get("Authorization") == "Bearer t" else challenge(f"{origin}/token")(h)
    )
    registry.routes[f"/v2/evil/img/blobs/{sha(image.layer)}"] = redirect(f"{origin}/layer")
    try:
        await pull_image(registry)
    finally:
        storage.close()
    assert asked == ["rebind.attacker.example"]
    assert [path.split("?")[0] for path, _ in storage.hits] == ["/token", "/layer"]


@pytest.mark.parametrize("how", ["realm", "redirect"])
async def test_an_outside_registry_cannot_send_the_node_to_its_own_loopback(
    lan_registry: Upstream, metadata: Upstream, how: str
) -> None:
    """A registry that is not on this node may not name this node's loopback services (its own API,
    etcd, ...): the realm or redirect is refused and the local service never sees a request."""
    FakeImage().serve(lan_registry)
    target = f"{metadata.origin}/latest/meta-data/"
    lan_registry.routes["/v2/evil/img/manifests/"] = challenge(target) if how == "realm" else redirect(target)
    err = await refused(lan_registry)
    assert "loopback" in err.message and "refused" in err.message, err.message
    assert metadata.hits == []


async def test_an_internal_registry_may_use_its_token_service_beside_it(lan_registry: Upstream) -> None:
    """The same rule lets an operator's internal registry send the node to its token service on
    the same network, and a redirect of a blob stay there too."""
    image = FakeImage()
    image.serve(lan_registry)
    tokens = Upstream(lan_registry.host)
    try:
        tokens.routes["/token"] = lambda h: reply(h, 200, b'{"token": "good-token"}')
        real_manifest = lan_registry.routes["/v2/evil/img/manifests/"]

        def manifest(handler: BaseHTTPRequestHandler) -> None:
            if handler.headers.get("Authorization") == "Bearer good-token":
                real_manifest(handler)
            else:
                challenge(f"{tokens.origin}/token")(handler)

        lan_registry.routes["/v2/evil/img/manifests/"] = manifest
        lan_registry.routes[f"/v2/evil/img/blobs/{sha(image.layer)}"] = redirect(f"{tokens.origin}/storage/layer")
        tokens.routes["/storage/layer"] = lambda h: reply(h, 200, image.layer)
        await pull_image(lan_registry)
        assert [path.split("?")[0] for path, _ in tokens.hits] == ["/token", "/storage/layer"]
        assert tokens.hits[1][1] == "", "the registry's token is not sent to another origin"
    finally:
        tokens.close()


@pytest.fixture()
def tls_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Upstream]:
    """A registry over https (on 127.0.0.2, which is not spoken to over plain http), its
    certificate trusted through SSL_CERT_FILE."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.2"]
        + ["-addext", "subjectAltName=IP:127.0.0.2", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    server = Upstream("127.0.0.2", tls=(cert, key))
    yield server
    server.close()


async def pull_over_tls(registry: Upstream) -> None:
    ref = ImageRef.parse(f"{registry.netloc}/evil/img:latest")
    client = RegistryClient(ref.registry)
    try:
        await client.resolve(ref, ("linux", "amd64"))
    finally:
        await client.close()


@pytest.mark.parametrize("how", ["realm", "redirect"])
async def test_an_https_registry_cannot_send_the_node_to_plain_http(
    tls_registry: Upstream, metadata: Upstream, how: str
) -> None:
    """The token request carries the registry login: from an https registry it never goes out in
    the clear (nor does a redirect), even to an address the registry could otherwise name."""
    FakeImage().serve(tls_registry)
    await pull_over_tls(tls_registry)  # the registry itself is fine
    target = f"{metadata.origin}/token"
    tls_registry.routes["/v2/evil/img/manifests/"] = challenge(target) if how == "realm" else redirect(target)
    with pytest.raises(UpstreamError, match="only https") as caught:
        await pull_over_tls(tls_registry)
    assert caught.value.status == 502
    assert metadata.hits == []


@pytest.mark.parametrize("target", ["file:///etc/passwd", "ftp://127.0.0.1/x", "gopher://127.0.0.1:2379/x"])
async def test_realms_and_redirects_lead_to_http_or_https_only(tls_registry: Upstream, target: str) -> None:
    FakeImage().serve(tls_registry)
    tls_registry.routes["/v2/evil/img/manifests/"] = challenge(target)
    with pytest.raises(UpstreamError):
        await pull_over_tls(tls_registry)


async def test_redirects_are_bounded(registry: Upstream) -> None:
    """A redirect loop ends, and no redirect's body is read (a redirect may carry an endless one)."""
    FakeImage().serve(registry)

    def loop(handler: BaseHTTPRequestHandler) -> None:  # each redirect with an endless body
        registry.stream(handler, status=302, Location=handler.path + "x")

    registry.routes["/v2/evil/img/manifests/"] = loop
    err = await refused(registry)
    assert "redirect" in err.message, err.message
    assert len(registry.hits) <= guard.MAX_REDIRECTS + 1
    # what socket buffers take before the node closes each redirect unread, and no more
    assert registry.sent < len(registry.hits) * 16 * MiB, f"{registry.sent} bytes of redirect bodies were read"


# -- registries: how much of an answer is read ------------------------------------------------------
@pytest.mark.parametrize("what", ["token", "manifest", "config"])
async def test_registry_answers_read_whole_are_bounded(registry: Upstream, what: str) -> None:
    """An endless token answer, manifest or config is refused once past its bound, while it streams."""
    image = FakeImage()
    image.serve(registry)
    endless: Route = lambda h: registry.stream(h)  # noqa: E731
    if what == "token":
        registry.routes["/v2/evil/img/manifests/"] = challenge(f"{registry.origin}/token")
        registry.routes["/token"] = endless
        bound = MAX_TOKEN_ANSWER
    elif what == "manifest":
        registry.routes["/v2/evil/img/manifests/"] = endless
        bound = MAX_DOCUMENT
    else:
        registry.routes[f"/v2/evil/img/blobs/{sha(image.config)}"] = endless
        bound = len(image.config)
    err = await refused(registry)
    assert "bytes" in err.message, err.message
    assert registry.sent < bound + 32 * MiB, f"{registry.sent} bytes read for a bound of {bound}"


async def test_a_blob_larger_than_its_descriptor_is_refused_while_it_streams(
    registry: Upstream, tmp_path: Path
) -> None:
    image = FakeImage()
    image.serve(registry)
    registry.routes[f"/v2/evil/img/blobs/{sha(image.layer)}"] = lambda h: registry.stream(h)
    err = await refused(registry, dest=tmp_path)
    assert "larger than" in err.message, err.message
    assert registry.sent < 32 * MiB, f"{registry.sent} bytes read of a {len(image.layer)}-byte blob"
    assert list(tmp_path.iterdir()) == [], "nothing of a refused blob is left"


async def test_a_blob_whose_length_exceeds_its_descriptor_is_refused_unread(registry: Upstream) -> None:
    image = FakeImage(layer_size=10)  # the descriptor understates the blob
    image.serve(registry)
    err = await refused(registry)
    assert "larger than" in err.message, err.message


async def test_error_messages_quote_upstream_text_only_briefly(registry: Upstream) -> None:
    """An auth challenge, a status line or a reason the registry made up is quoted short and printable."""
    FakeImage().serve(registry)
    long_header = "Negotiate " + "x" * 200 + "SECRET-" * 2000
    registry.routes["/v2/evil/img/manifests/"] = lambda h: reply(h, 401, b"", {"WWW-Authenticate": long_header})
    err = await refused(registry)
    assert "unsupported auth challenge" in err.message


async def test_a_registry_that_never_answers_times_out(registry: Upstream, monkeypatch: pytest.MonkeyPatch) -> None:
    """A registry that accepts and then trickles a manifest forever cannot hold the pull."""
    from aenv.images import registry as registry_module

    monkeypatch.setattr(registry_module, "DOCUMENT_DEADLINE", 2.0)
    FakeImage().serve(registry)

    def trickle(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.end_headers()
        for _ in range(60):
            handler.wfile.write(b" ")
            handler.wfile.flush()
            time.sleep(0.5)

    registry.routes["/v2/evil/img/manifests/"] = trickle
    err = await refused(registry, within=10)
    assert "did not answer" in err.message, err.message


async def test_a_registry_on_a_link_local_address_is_a_client_mistake() -> None:
    ref = ImageRef.parse("169.254.169.254:80/latest/meta-data")
    client = RegistryClient(ref.registry, insecure={ref.registry})
    try:
        with pytest.raises(InvalidRequest, match="never reached"):
            await client.resolve(ref)
    finally:
        await client.close()


@pytest.mark.parametrize("reference", ["evil.com#.169.254.169.254/x", "a.b?c/x", "host:port:9/x", "a.b\\c/x"])
def test_image_references_name_a_registry_host_and_nothing_else(reference: str) -> None:
    with pytest.raises(InvalidRequest):
        ImageRef.parse(reference)


# -- registries, through the API ---------------------------------------------------------------------
@pytest.mark.sandbox
@pytest.mark.parametrize(
    ("route", "says"),
    [
        (challenge("http://169.254.169.254/latest/meta-data/"), "link-local"),
        (redirect("http://169.254.169.254/latest/meta-data/"), "link-local"),
        (lambda h: reply(h, 401, b"", {"WWW-Authenticate": "Negotiate " + "x" * 200 + "SECRET-" * 2000}), "challenge"),
    ],
    ids=["realm", "redirect", "long-challenge"],
)
def test_templates_from_hostile_registries_are_a_short_error(
    api: httpx.Client, registry: Upstream, route: Route, says: str, server: Server
) -> None:
    """Through the API: the metadata service is refused by rule (not merely found unreachable),
    and what the caller reads of the registry's text is short."""
    FakeImage().serve(registry)
    registry.routes["/v2/evil/img/manifests/"] = route
    started = time.monotonic()
    r = api.post("/templates/from-image", json={"name": "hostile-upstream", "image": f"{registry.netloc}/evil/img"})
    assert time.monotonic() - started < 30
    assert r.status_code in (403, 502), r.text
    body = r.json()
    assert body["code"] == r.status_code and len(body["message"]) < 600 and "SECRET" not in body["message"], body
    assert says in body["message"], body
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


async def test_ecr_logins_never_fall_back_to_the_nodes_own_aws_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without keys of its own, an E2B `fromImageRegistry: {type: aws}` would be answered with an
    ECR token of the node's instance role, which the registry the caller names then receives."""
    import boto3

    from aenv.api.e2b_templates import registry_login

    used: list[dict[str, Any]] = []

    class Session:
        def client(self, service: str, **kw: Any) -> Any:
            used.append(kw)
            token = base64.b64encode(b"AWS:node-role-token").decode()
            data = {"authorizationData": [{"authorizationToken": token}]}
            return type("Ecr", (), {"get_authorization_token": lambda self: data})()

    monkeypatch.setattr(boto3.session, "Session", Session)
    for config in ({"type": "aws", "awsRegion": "us-east-1"}, {"type": "aws", "awsAccessKeyId": "AKIA"}):
        with pytest.raises(InvalidRequest, match="awsAccessKeyId and awsSecretAccessKey"):
            await registry_login(config)
    assert used == []
    given = {"type": "aws", "awsAccessKeyId": "AKIA", "awsSecretAccessKey": "s", "awsRegion": "eu-west-1"}
    assert await registry_login(given) == ("AWS", "node-role-token")
    assert used[0]["aws_access_key_id"] == "AKIA"


# -- the port proxy: what a sandbox's server sends back is hostile -----------------------------------
# One script, two ports: on PORT the behaviour is chosen by the request path; on PORT+1 nothing is
# ever read. WebSocket paths write the close code they got from the proxy to /tmp/ws-<name>.
HOSTILE_PORT_SERVER = r"""
import base64, hashlib, socket, struct, sys, threading, time
GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
def read_exact(conn, n):
    buf = b""
    while len(buf) < n:
        part = conn.recv(n - len(buf))
        if not part: raise EOFError
        buf += part
    return buf
def frame(opcode, data, fin=True):
    n = len(data)
    head = bytes([(0x80 if fin else 0) | opcode])
    if n < 126: head += bytes([n])
    elif n < 65536: head += bytes([126]) + struct.pack("!H", n)
    else: head += bytes([127]) + struct.pack("!Q", n)
    return head + data
def record(name, what):
    with open(f"/tmp/ws-{name}", "w") as f: f.write(what)
def close_code(conn, name):
    try:
        while True:
            b1, b2 = read_exact(conn, 2)
            n = b2 & 0x7F
            if n == 126: n = struct.unpack("!H", read_exact(conn, 2))[0]
            elif n == 127: n = struct.unpack("!Q", read_exact(conn, 8))[0]
            mask = read_exact(conn, 4) if b2 & 0x80 else b"\0\0\0\0"
            data = read_exact(conn, n)
            if b1 & 0x0F == 8:
                code = bytes(c ^ m for c, m in zip(data[:2], mask))
                return record(name, str(struct.unpack("!H", code)[0]) if len(code) == 2 else "none")
    except (EOFError, OSError):
        record(name, "eof")
def quietly(fn, *args):
    try: fn(*args)
    except OSError: pass
def serve(conn):
    request = b""
    while b"\r\n\r\n" not in request:
        part = conn.recv(4096)
        if not part: return
        request += part
    path = request.split(b" ")[1].decode()
    lines = [l.split(": ", 1) for l in request.decode().split("\r\n")[1:] if ": " in l]
    headers = {k.lower(): v for k, v in lines}
    if path == "/silent" or path == "/ws/silent":
        time.sleep(3600); return
    if path == "/headonly":  # the head, then a body that never comes
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"); time.sleep(3600); return
    if path == "/bighead":
        conn.sendall(b"HTTP/1.1 200 OK\r\n")
        for _ in range(1000): conn.sendall(b"X-Pad: " + b"a" * 1000 + b"\r\n")
        conn.sendall(b"Content-Length: 2\r\n\r\nok"); return
    if "sec-websocket-key" not in headers:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"); return
    accept = base64.b64encode(hashlib.sha1(headers["sec-websocket-key"].encode() + GUID).digest()).decode()
    conn.sendall(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  f"Sec-WebSocket-Accept: {accept}\r\n\r\n").encode())
    name = path.rsplit("/", 1)[1]
    if name == "big":  # one message of 2 MiB
        threading.Thread(target=quietly, args=(conn.sendall, frame(2, b"b" * (2 << 20))), daemon=True).start()
    elif name == "fragments":  # a message that never ends, 64 KiB at a time
        def fragments():
            conn.sendall(frame(1, b"f" * 65536, fin=False))
            for _ in range(1024): conn.sendall(frame(0, b"f" * 65536, fin=False))
        threading.Thread(target=quietly, args=(fragments,), daemon=True).start()
    close_code(conn, name)
    time.sleep(3600)
def deaf(port):
    listener = socket.create_server(("127.0.0.1", port))
    held = []
    while True:
        held.append(listener.accept()[0])
port = int(sys.argv[1])
threading.Thread(target=deaf, args=(port + 1,), daemon=True).start()
listener = socket.create_server(("127.0.0.1", port))
while True:
    conn, _ = listener.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""
HOSTILE = 8700


@pytest.fixture(scope="module")
def tight_server(server: Server) -> Iterator[Server]:
    """The session's server with a 3 s port deadline and a 1 MiB WebSocket message bound."""
    saved = server.extra_env
    server.extra_env = {**(saved or {}), "AENV_PORT_RESPONSE_TIMEOUT": "3", "AENV_PORT_WS_MAX_MESSAGE_MB": "1"}
    server.restart()
    yield server
    server.extra_env = saved
    server.restart()


@pytest.fixture()
def hostile_sandbox(tight_server: Server, e2b_env: Server) -> Iterator[Any]:
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=300)
    try:
        sbx.files.write("/home/user/hostile.py", HOSTILE_PORT_SERVER)
        sbx.commands.run(f"python3 /home/user/hostile.py {HOSTILE}", background=True, timeout=0)
        deadline = time.monotonic() + 20
        while httpx.get(f"{tight_server.url}/", headers=routed(sbx.sandbox_id)).status_code == 502:
            assert time.monotonic() < deadline, "the hostile server did not come up"
            time.sleep(0.2)
        yield sbx
    finally:
        sbx.kill()


def routed(sandbox_id: str, port: int = HOSTILE) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(port)}


def tunnels(server: Server) -> int:
    """Streams the node holds open to agents for proxied connections (the debug metric)."""
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith('aenv_channel_streams{method="tunnel.open"}'):
            return int(float(line.split()[-1]))
    return 0


def agent_threads(sbx: Any) -> int:
    """Threads of the sandbox's agent (PID 1): each proxied connection holds two while it lasts."""
    return int(sbx.commands.run("ls /proc/1/task | wc -l").stdout)


def settle(probe: Callable[[], int], want: int, within: float = 20.0) -> int:
    deadline = time.monotonic() + within
    while (value := probe()) > want and time.monotonic() < deadline:
        time.sleep(0.3)
    return value


@pytest.mark.sandbox
@pytest.mark.parametrize("path", ["/silent", "/headonly"])
def test_clients_that_leave_release_the_tunnel_on_both_sides(
    hostile_sandbox: Any, tight_server: Server, path: str
) -> None:
    """A port that never answers, or never sends the body it announced, and clients that give up:
    the node's tunnel streams and the agent's relay threads go with the clients, not with the port.

    Twice: the first round also grows the agent's thread pools (the connects to the port run on its
    default executor, which keeps its threads); relay threads must not outlast either round."""
    baseline, pool = agent_threads(hostile_sandbox), 3
    for _ in range(2):
        clients = [socket.create_connection(("127.0.0.1", tight_server.port)) for _ in range(3)]
        for client in clients:
            head = f"GET {path} HTTP/1.1\r\nHost: x\r\nE2b-Sandbox-Id: {hostile_sandbox.sandbox_id}\r\n"
            client.sendall(f"{head}E2b-Sandbox-Port: {HOSTILE}\r\n\r\n".encode())
        assert settle(lambda: -tunnels(tight_server), -3, within=10) <= -3, "the requests reached the port"
        assert agent_threads(hostile_sandbox) >= baseline + 6
        for client in clients:
            client.close()
        assert settle(lambda: tunnels(tight_server), 0) == 0, "a client left and its tunnel stayed open on the host"
        time.sleep(3)  # the relays' linger
        kept = agent_threads(hostile_sandbox)
        assert kept <= baseline + pool, "relay threads stayed in the agent"
        baseline, pool = kept, 0  # the pool has grown: the next round leaves no thread at all


@pytest.mark.sandbox
def test_a_port_that_never_answers_is_a_504_after_the_deadline(hostile_sandbox: Any, tight_server: Server) -> None:
    started = time.monotonic()
    r = httpx.get(f"{tight_server.url}/silent", headers=routed(hostile_sandbox.sandbox_id), timeout=60)
    assert r.status_code == 504 and "within 3s" in r.json()["message"], r.text
    assert time.monotonic() - started < 20
    assert settle(lambda: tunnels(tight_server), 0) == 0


@pytest.mark.sandbox
def test_a_response_head_past_h11s_bound_is_a_502(hostile_sandbox: Any, tight_server: Server) -> None:
    r = httpx.get(f"{tight_server.url}/bighead", headers=routed(hostile_sandbox.sandbox_id), timeout=60)
    assert r.status_code == 502 and len(r.json()["message"]) < 400, r.text
    assert settle(lambda: tunnels(tight_server), 0) == 0


@pytest.mark.sandbox
def test_an_endless_body_to_a_port_that_never_reads_is_held_back_then_cut(
    hostile_sandbox: Any, tight_server: Server
) -> None:
    """Flow control holds (the node buffers a credit window, not the body) and the port's deadline
    ends the request with a 504 the client can read while it is still sending."""
    rss_before, threads_before = rss_kib(tight_server.proc.pid), agent_threads(hostile_sandbox)
    client = socket.create_connection(("127.0.0.1", tight_server.port))
    head = f"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: {1 << 40}\r\n"
    head += f"E2b-Sandbox-Id: {hostile_sandbox.sandbox_id}\r\nE2b-Sandbox-Port: {HOSTILE + 1}\r\n\r\n"
    client.sendall(head.encode())
    client.setblocking(False)
    sent, answer, started = 0, b"", time.monotonic()
    block = b"x" * 65536
    while time.monotonic() - started < 60 and b"\r\n\r\n" not in answer:
        readable, writable, _ = select.select([client], [client], [], 1)
        if readable:
            answer += client.recv(65536) or b"\r\n\r\n"
        elif writable:
            try:
                sent += client.send(block)
            except (BlockingIOError, OSError):
                pass
    client.close()
    assert answer.startswith(b"HTTP/1.1 504"), answer[:200]
    assert sent < 256 * MiB, f"the node took {sent} bytes of a body the port never read"
    assert rss_kib(tight_server.proc.pid) - rss_before < 128 * 1024
    assert settle(lambda: tunnels(tight_server), 0) == 0
    # the agent's relay was blocked writing to a port that never reads: it is woken and gone too
    assert settle(lambda: agent_threads(hostile_sandbox), threads_before) <= threads_before


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.sandbox
@pytest.mark.parametrize("name", ["big", "fragments"])
def test_websocket_messages_from_a_port_are_bounded(hostile_sandbox: Any, tight_server: Server, name: str) -> None:
    """One oversized message, or a fragmented one that never ends: the client and the port both
    get 1009 and the node buffers no more than the bound."""
    url = tight_server.url.replace("http", "ws", 1) + f"/ws/{name}"
    headers = routed(hostile_sandbox.sandbox_id)
    with ws_connect(url, additional_headers=headers, open_timeout=30, max_size=None) as ws:  # the proxy's bound
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=30)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009, closed.value
    assert settle(lambda: 0 if port_saw(hostile_sandbox, name) else 1, 0) == 0
    assert port_saw(hostile_sandbox, name) == "1009"
    assert settle(lambda: tunnels(tight_server), 0) == 0


@pytest.mark.sandbox
def test_websocket_messages_to_a_port_are_bounded(hostile_sandbox: Any, tight_server: Server) -> None:
    url = tight_server.url.replace("http", "ws", 1) + "/ws/record"
    with ws_connect(url, additional_headers=routed(hostile_sandbox.sandbox_id), open_timeout=30) as ws:
        ws.send(b"x" * (2 * MiB))
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=30)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009, closed.value
    assert settle(lambda: 0 if port_saw(hostile_sandbox, "record") else 1, 0) == 0
    assert port_saw(hostile_sandbox, "record") == "1009"


@pytest.mark.sandbox
def test_a_port_that_never_answers_the_websocket_handshake_is_a_504(hostile_sandbox: Any, tight_server: Server) -> None:
    url = tight_server.url.replace("http", "ws", 1) + "/ws/silent"
    with pytest.raises(InvalidStatus) as refused:
        with ws_connect(url, additional_headers=routed(hostile_sandbox.sandbox_id), open_timeout=30):
            pass
    assert refused.value.response.status_code == 504
    assert settle(lambda: tunnels(tight_server), 0) == 0


def port_saw(sbx: Any, name: str) -> str:
    """The close code the hostile port got from the proxy ('' if none yet)."""
    return str(sbx.commands.run(f"cat /tmp/ws-{name} 2>/dev/null || true").stdout).strip()


@pytest.mark.sandbox
def test_a_websocket_client_that_vanishes_releases_the_tunnel(hostile_sandbox: Any, tight_server: Server) -> None:
    """The client's TCP connection just drops and the port never answers the close it is sent:
    the port hears "going away" and the node lets the tunnel go after a short close timeout."""
    baseline = agent_threads(hostile_sandbox)
    url = tight_server.url.replace("http", "ws", 1) + "/ws/record"
    ws = ws_connect(url, additional_headers=routed(hostile_sandbox.sandbox_id), open_timeout=30)
    assert tunnels(tight_server) == 1
    ws.socket.shutdown(socket.SHUT_RDWR)  # no closing handshake
    ws.socket.close()
    assert settle(lambda: 0 if port_saw(hostile_sandbox, "record") else 1, 0) == 0
    assert port_saw(hostile_sandbox, "record") == "1001"
    assert settle(lambda: tunnels(tight_server), 0, within=30) == 0, "the tunnel outlived its client"
    assert settle(lambda: agent_threads(hostile_sandbox), baseline, within=30) <= baseline


# -- what the sandbox's file system and process table answer -------------------------------------------
ENVD_PORT = 49983


@pytest.mark.sandbox
@pytest.mark.parametrize(
    ("op", "path", "reason"),
    [
        ("write", "/proc/version", r"\(EIO\)"),
        ("write", "/proc/sys/kernel/hostname", r"\(EIO\)"),
        ("write", "/dev/net/tun", "not a regular file"),  # a device is never opened (it could block)
        ("read", "/proc/self/mem", r"\(EIO\)"),  # on the first read
    ],
)
def test_what_the_sandbox_file_system_refuses_is_the_clients_4xx(sandbox: Any, op: str, path: str, reason: str) -> None:
    """Errors the sandbox's file system returns for a client's request are the client's: a 4xx
    naming the errno (or why the file was not opened), never a 500 (and never an empty 200 for a
    file that cannot be read)."""
    from e2b import InvalidArgumentException

    with pytest.raises(InvalidArgumentException, match=reason):
        if op == "write":
            sandbox.files.write(path, "x")
        else:
            sandbox.files.read(path)
    if op == "write":  # the SDK's signed URLs, as a browser would use them
        r = httpx.post(sandbox.upload_url(path), content=b"x", headers={"content-type": "application/octet-stream"})
    else:
        r = httpx.get(sandbox.download_url(path))
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert r.json()["code"] == r.status_code and re.search(reason, r.json()["message"]), r.text


@pytest.mark.sandbox
def test_a_full_disk_met_by_a_filesystem_rpc_is_what_envd_answers(api: httpx.Client, e2b_env: Server) -> None:
    """envd answers MakeDir/Move on a full disk with `internal`; `resource_exhausted` (HTTP 429)
    would make the E2B SDKs report rate limiting. The message names the errno and the quota."""
    from e2b import RateLimitException, Sandbox, SandboxException

    r = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300, "limits": {"diskSizeMB": 64}})
    assert r.status_code == 201, r.text
    sid, token = r.json()["sandboxID"], r.json()["envdAccessToken"]
    try:
        sbx = Sandbox.connect(sid)
        fill = "dd if=/dev/zero of=/home/user/fill{} bs={} 2>/dev/null"  # MiBs, then the last KiBs
        sbx.commands.run(f"mkdir /home/user/src; {fill.format(1, '1M')}; {fill.format(2, '1k')}; true")
        for attempt in (
            lambda: sbx.files.make_dir("/home/user/a/b/c"),
            lambda: sbx.files.rename("/home/user/src", "/home/user/new/dir/src"),
        ):
            with pytest.raises(SandboxException) as caught:
                attempt()
            assert not isinstance(caught.value, RateLimitException), caught.value
            assert "ENOSPC" in str(caught.value) and "64 MiB" in str(caught.value), caught.value
        headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(ENVD_PORT), "X-Access-Token": token}
        r = httpx.post(f"{e2b_env.url}/filesystem.Filesystem/MakeDir", json={"path": "/home/user/x/y"}, headers=headers)
        assert (r.status_code, r.json()["code"]) == (500, "internal"), r.text
        sbx.commands.run("rm /home/user/fill1 /home/user/fill2")
        sbx.files.make_dir("/home/user/a/b/c")  # space back, all well
    finally:
        api.delete(f"/sandboxes/{sid}")


@pytest.mark.sandbox
@pytest.mark.parametrize("cwd", ["/root", "/home/user/locked"])
def test_a_cwd_the_user_cannot_enter_fails_the_start_as_envd_does(sandbox: Any, cwd: str) -> None:
    """envd's exec fails a start whose chdir fails (invalid_argument: the SDK's
    InvalidArgumentException); the command must not run, in or out of a PTY."""
    from e2b import InvalidArgumentException
    from e2b.sandbox.commands.command_handle import PtySize

    sandbox.commands.run("mkdir -p /home/user/locked && chmod 000 /home/user/locked", user="root")
    with pytest.raises(InvalidArgumentException, match="chdir.*EACCES"):
        sandbox.commands.run("touch /tmp/ran-anyway", cwd=cwd)
    with pytest.raises(InvalidArgumentException, match="chdir.*EACCES"):
        sandbox.pty.create(PtySize(rows=24, cols=80), cwd=cwd)
    assert sandbox.commands.run("ls /tmp/ran-anyway 2>&1 || true").stdout.strip().endswith("No such file or directory")
    assert sandbox.commands.run("pwd", cwd="/home/user").stdout == "/home/user\n"
