"""What the node talks to on a client's behalf is hostile too: registries (their token realms,
redirects and answers), the servers a sandbox runs on its ports, and the sandbox's file system.

Registries here are real HTTP servers on real sockets, scripted to misbehave; a second server
plays the cloud metadata service or a node-local service and records whether it was reached."""

from __future__ import annotations

import base64
import hashlib
import io
import json
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
