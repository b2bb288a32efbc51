"""Secrets resolved at egress (aenv/node/intercept.py): a sandbox's request to a host with a
``network.rules`` transform leaves this node with the rule's headers, the team's secrets filled in.

The host side is driven directly: a guest channel opens ``egress.connect`` as the in-sandbox proxy
does, and a local client speaks TLS through it, trusting the node's egress CA as a sandbox would.
"The host" is an HTTPS server on this host's own non-loopback address (loopback is never
reachable) with a self-signed certificate the node trusts through AENV_EGRESS_EXTRA_CA.
"""

from __future__ import annotations

import asyncio
import datetime
import http.server
import json
import ssl
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import h11
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from aenv.channel import MAX_GUEST_STREAMS, Channel, splice
from aenv.node import egress
from aenv.node.egress import Address, EgressPolicy, Guest
from aenv.node.intercept import EXTRA_CA_ENV, EgressCA, Interceptor
from tests.channel.test_channel import pipe_pair
from tests.node.test_egress import host_address

pytestmark = [pytest.mark.sandbox, pytest.mark.fast]
HOST = "api.secret-egress.test"
SECRETS = {("team-a", "api_key"): "s3cr3t-VALUE"}


def self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "upstream.pem", directory / "upstream.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


class Echo(http.server.BaseHTTPRequestHandler):
    """Answers with the request's method, path, headers and body, as it arrived."""

    protocol_version = "HTTP/1.1"

    def _answer(self) -> None:
        if self.path == "/early":  # a host that refuses before reading the body (a 413, a 401)
            self.send_response(413)
            self.send_header("Content-Length", "0")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            return
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length).decode()
        out = json.dumps(
            {"method": self.command, "path": self.path, "headers": dict(self.headers.items()), "body": body}
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """(port, its certificate) of an HTTPS echo server on this host's non-loopback address."""
    cert, key = self_signed(tmp_path_factory.mktemp("upstream"), HOST)
    server = http.server.ThreadingHTTPServer((host_address(), 0), Echo)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], cert
    server.shutdown()


class Node:
    """A node's egress for one sandbox of team-a, and a loopback port that stands for its proxy:
    each connection to it becomes an egress.connect to HOST on the upstream's port."""

    def __init__(self, ca: EgressCA, policy: EgressPolicy, port: int) -> None:
        async def lookup(team: str, name: str) -> str | None:
            return SECRETS.get((team, name))

        async def resolver(host: str, port: int) -> list[Address]:
            import ipaddress

            return [ipaddress.ip_address(host_address())]

        self.ca, self.port = ca, port
        self.handler = Guest("sbx", lambda: policy, Interceptor(ca, lookup, lambda: "team-a"))
        self.handler._resolve = resolver  # type: ignore[method-assign]
        self.answers: list[Any] = []

    async def start(self) -> None:
        host_end, guest_end = await pipe_pair()
        self.host = Channel(on_open=self.handler, max_peer_streams=MAX_GUEST_STREAMS)
        self.guest = Channel(first_stream_id=2)
        self.host.attach(*host_end)
        self.guest.attach(*guest_end)
        self.server = await asyncio.start_server(self._bridge, "127.0.0.1", 0)
        self.local = self.server.sockets[0].getsockname()[1]

    async def _bridge(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stream = await self.guest.open("egress.connect", {"host": HOST, "port": self.port})
        first = await stream.recv()
        self.answers.append(first.msg)
        if first.msg and first.msg.get("ok"):
            await splice(stream, reader, writer)
        writer.close()

    async def stop(self) -> None:
        self.server.close()
        self.host.close()
        self.guest.close()

    async def client(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        trust = ssl.create_default_context(cadata=self.ca.pem())
        return await asyncio.open_connection("127.0.0.1", self.local, ssl=trust, server_hostname=HOST)


async def exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: h11.Connection, request: h11.Request, body: bytes
) -> tuple[int, dict[str, str], bytes]:
    writer.write(conn.send(request) + (conn.send(h11.Data(data=body)) if body else b"") + conn.send(h11.EndOfMessage()))
    await writer.drain()
    status, headers, out = 0, {}, b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await asyncio.wait_for(reader.read(65536), 10))
        elif isinstance(event, h11.Response):
            status, headers = event.status_code, {k.decode(): v.decode() for k, v in event.headers}
        elif isinstance(event, h11.Data):
            out += event.data
        elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
            return status, headers, out


def rules(value: str) -> dict[str, Any]:
    return {HOST: [{"transform": {"headers": {"Authorization": value, "X-Fixed": "plain"}}}]}


@pytest.fixture
async def node(upstream: tuple[int, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Node]:
    port, cert = upstream
    monkeypatch.setenv(EXTRA_CA_ENV, str(cert))
    monkeypatch.setitem(egress.INTERCEPTED_PORTS, port, True)  # as if it were 443
    network = {"allowOut": [f"{host_address()}/32"], "rules": rules("Bearer ${e2b.secrets.API_KEY}")}
    found = Node(EgressCA(tmp_path / "egress-ca", "test"), EgressPolicy.of(False, network), port)
    await found.start()
    yield found
    await found.stop()


async def test_the_header_leaves_filled_and_keep_alive_carries_two_requests(node: Node) -> None:
    reader, writer = await node.client()
    conn = h11.Connection(h11.CLIENT)
    request = h11.Request(
        method="POST",
        target="/v1/things?x=1",
        headers=[("Host", HOST), ("Authorization", "Bearer guest-own"), ("Content-Length", "5")],
    )
    status, _, body = await exchange(reader, writer, conn, request, b"hello")
    seen = json.loads(body)
    assert status == 200 and seen["path"] == "/v1/things?x=1" and seen["body"] == "hello"
    assert seen["headers"]["Authorization"] == "Bearer s3cr3t-VALUE"  # the guest's own replaced
    assert seen["headers"]["X-Fixed"] == "plain"
    conn.start_next_cycle()
    status, _, body = await exchange(
        reader, writer, conn, h11.Request(method="GET", target="/2", headers=[("Host", HOST)]), b""
    )
    assert status == 200 and json.loads(body)["headers"]["Authorization"] == "Bearer s3cr3t-VALUE"
    writer.close()
    assert len(node.answers) == 1  # one connection for both


async def test_a_missing_secret_is_a_502_naming_it_and_nothing_is_sent(node: Node, tmp_path: Path) -> None:
    port = node.port
    network = {"allowOut": [f"{host_address()}/32"], "rules": rules("${e2b.secrets.nope}")}
    policy = EgressPolicy.of(False, network)
    node.handler.policy_of = lambda: policy
    reader, writer = await node.client()
    conn = h11.Connection(h11.CLIENT)
    status, headers, body = await exchange(
        reader, writer, conn, h11.Request(method="GET", target="/", headers=[("Host", HOST)]), b""
    )
    assert status == 502 and "'nope'" in body.decode() and headers["x-aenv-egress"] == "refused"
    assert port == node.port
    writer.close()


async def test_a_request_for_another_host_is_refused_unsent(node: Node) -> None:
    """A shared front end routes by Host: a secret for one host must not reach another through it."""
    for headers in ([("Host", "evil.example")], [("Host", f"{HOST}.evil.example")]):
        reader, writer = await node.client()
        conn = h11.Connection(h11.CLIENT)
        request = h11.Request(method="GET", target="/", headers=headers)
        status, _, body = await exchange(reader, writer, conn, request, b"")
        assert status == 421 and b"another host" in body
        writer.close()
    reader, writer = await node.client()
    request = h11.Request(method="GET", target="/", headers=[("Host", f"{HOST.upper()}:443")])
    status, _, body = await exchange(reader, writer, h11.Connection(h11.CLIENT), request, b"")
    assert status == 200 and "s3cr3t-VALUE" in body.decode()
    writer.close()


async def test_the_ca_is_kept_and_its_key_is_private(tmp_path: Path) -> None:
    ca = EgressCA(tmp_path / "ca", "node-1")
    pem = ca.pem()
    assert (tmp_path / "ca" / "ca.key").stat().st_mode & 0o777 == 0o600
    assert EgressCA(tmp_path / "ca", "node-1").pem() == pem  # made once
    cert = x509.load_pem_x509_certificate(pem.encode())
    assert cert.subject.rfc4514_string() == "CN=aenv egress CA node-1"
    assert ca.context_for(HOST) is ca.context_for(HOST)  # leaves are cached
    assert not [p for p in (tmp_path / "ca").iterdir() if p.name.startswith("leaf-")]


async def test_the_node_reads_a_teams_secret_and_no_other_teams(tmp_path: Path) -> None:
    import time
    from types import SimpleNamespace

    from aenv.config import Settings
    from aenv.secrets.model import Secret
    from aenv.secrets.routes import Secrets

    secrets = Secrets(SimpleNamespace(settings=Settings(data_dir=tmp_path)))  # type: ignore[arg-type]
    await secrets.start()
    try:
        sealer = secrets.sealer()
        sid = Secret.new_id()
        now = time.time()
        await secrets.store.add(Secret(sid, "api_key", "team-a", 1, sealer.seal("v1", sid, "team-a", 1), {}, now, now))
        assert await secrets.value_of("team-a", "api_key") == "v1"
        assert await secrets.value_of("team-b", "api_key") is None
        assert await secrets.value_of("team-a", "other") is None
    finally:
        await secrets.stop()


def test_the_agent_trusts_the_ca_beside_the_systems_roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from aenv.guest import agent

    system = tmp_path / "system.crt"
    system.write_text("-----BEGIN CERTIFICATE-----\nSYSTEM\n-----END CERTIFICATE-----\n")
    bundle = tmp_path / "run" / "ca-bundle.pem"
    monkeypatch.setattr(agent, "CA_BUNDLE_FILE", str(bundle))
    monkeypatch.setattr(agent, "SYSTEM_BUNDLES", (str(tmp_path / "absent"), str(system)))
    pem = EgressCA(tmp_path / "ca").pem()
    env = agent._trust_egress_ca(pem)
    assert set(env) == {"NODE_EXTRA_CA_CERTS", *agent.BUNDLE_ENV} and set(env.values()) == {str(bundle)}
    text = bundle.read_text()
    assert text.startswith(system.read_text()) and text.endswith(pem)
    monkeypatch.setattr(agent, "SYSTEM_BUNDLES", (str(tmp_path / "absent"),))
    assert agent._trust_egress_ca(pem) == {"NODE_EXTRA_CA_CERTS": str(bundle)}  # never the CA alone
    assert agent._trust_egress_ca(None) == {} and agent._trust_egress_ca("junk") == {}


async def test_plain_http_gets_the_header_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = http.server.ThreadingHTTPServer((host_address(), 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    monkeypatch.setitem(egress.INTERCEPTED_PORTS, port, False)  # as if it were 80
    network = {"allowOut": [f"{host_address()}/32"], "rules": rules("Bearer ${e2b.secrets.api_key}")}
    found = Node(EgressCA(tmp_path / "egress-ca"), EgressPolicy.of(False, network), port)
    await found.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", found.local)
        conn = h11.Connection(h11.CLIENT)
        request = h11.Request(method="GET", target="/plain", headers=[("Host", HOST), ("authorization", "x")])
        status, _, body = await exchange(reader, writer, conn, request, b"")
        headers = json.loads(body)["headers"]
        assert status == 200 and headers["Authorization"] == "Bearer s3cr3t-VALUE"
        assert [k for k in headers if k.lower() == "authorization"] == ["Authorization"]  # replaced, not added
        writer.close()
    finally:
        await found.stop()
        server.shutdown()


def test_a_sandbox_with_rules_trusts_the_ca_and_holds_no_value(e2b_env: Any, api: Any) -> None:
    """Through the API on the node's runtime: the rules are kept, the sandbox's commands point at the
    bundle with the node's CA, and the secret's value is nowhere in its environment or files."""
    from e2b import Sandbox

    value = "egress-only-" + "7" * 24
    r = api.post("/secrets", json={"name": "egress_probe", "value": value})
    assert r.status_code == 201, r.text
    network = {"rules": {HOST: [{"transform": {"headers": {"Authorization": "Bearer ${e2b.secrets.EGRESS_PROBE}"}}}]}}
    sbx = Sandbox.create(timeout=120, network=network)
    try:
        assert api.get(f"/sandboxes/{sbx.sandbox_id}").json()["network"]["rules"] == network["rules"]
        out = sbx.commands.run(
            "echo $SSL_CERT_FILE $NODE_EXTRA_CA_CERTS; grep -c 'BEGIN CERT' /run/aenv/ca-bundle.pem"
        ).stdout
        assert "/run/aenv/ca-bundle.pem" in out and int(out.split()[-1]) >= 1
        found = sbx.commands.run(
            f"env; grep -rl '{value}' /run /home /tmp /etc /root 2>/dev/null | head -3; true", timeout=60
        ).stdout
        assert value not in found
        # taken away: the next configuration leaves the default trust
        assert api.put(f"/sandboxes/{sbx.sandbox_id}/network", json={}).status_code == 204
        assert sbx.commands.run("echo x${SSL_CERT_FILE}x").stdout.strip() == "xx"
    finally:
        sbx.kill()
        api.delete("/secrets/egress_probe")


async def test_a_changed_rule_ends_the_connections_that_carried_it(node: Node) -> None:
    reader, writer = await node.client()
    request = h11.Request(method="GET", target="/", headers=[("Host", HOST)])
    status, _, _ = await exchange(reader, writer, h11.Connection(h11.CLIENT), request, b"")
    assert status == 200 and len(node.handler.connections) == 1
    same = EgressPolicy.of(
        False, {"allowOut": [f"{host_address()}/32"], "rules": rules("Bearer ${e2b.secrets.API_KEY}")}
    )
    node.handler.policy_of = lambda: same
    assert node.handler.recheck() == 0  # the same rule: kept
    changed = EgressPolicy.of(False, {"allowOut": [f"{host_address()}/32"]})
    node.handler.policy_of = lambda: changed
    assert node.handler.recheck() == 1
    assert await asyncio.wait_for(reader.read(), 10) == b"" or reader.at_eof()
    writer.close()


async def test_the_operators_fixed_names_answer_before_dns_and_the_policy_still_checks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ipaddress

    monkeypatch.setenv(egress.HOSTS_ENV, "Api.Example.Internal=10.1.2.3, other.test=fd00::5")
    egress.static_hosts.cache_clear()
    try:
        assert await egress.resolve("api.example.internal.", 443) == [ipaddress.ip_address("10.1.2.3")]
        assert await egress.resolve("OTHER.test", 80) == [ipaddress.ip_address("fd00::5")]
        # a private address named so is still one: only an allowOut entry naming it opens it
        with pytest.raises(egress.Refused, match="private address"):
            await egress.connect("api.example.internal", 443, EgressPolicy.of(True, None), node=())
        for bad in ("noequals", "=1.2.3.4", "name=not-an-address", "1.2.3.4=5.6.7.8"):
            with pytest.raises(ValueError, match=egress.HOSTS_ENV):
                egress.static_hosts(bad)
    finally:
        egress.static_hosts.cache_clear()


async def test_a_client_that_waits_for_100_continue_gets_it_from_the_host(node: Node) -> None:
    reader, writer = await node.client()
    conn = h11.Connection(h11.CLIENT)
    body = b"y" * 5000
    head = [("Host", HOST), ("Content-Length", str(len(body))), ("Expect", "100-continue")]
    writer.write(conn.send(h11.Request(method="POST", target="/upload", headers=head)))
    await writer.drain()
    event: object = h11.NEED_DATA
    while event is h11.NEED_DATA:  # no byte of the body before the host's 100, relayed by the node
        conn.receive_data(await asyncio.wait_for(reader.read(65536), 10))
        event = conn.next_event()
    assert isinstance(event, h11.InformationalResponse) and event.status_code == 100
    writer.write(conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
    status, out = 0, b""
    while not isinstance(event := conn.next_event(), h11.EndOfMessage):
        if event is h11.NEED_DATA:
            conn.receive_data(await asyncio.wait_for(reader.read(65536), 10))
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            out += event.data
    got = json.loads(out)
    assert status == 200 and got["body"] == body.decode() and got["headers"]["Authorization"] == "Bearer s3cr3t-VALUE"
    writer.close()


async def test_a_hosts_answer_before_the_body_is_read_reaches_the_sandbox(node: Node) -> None:
    reader, writer = await node.client()
    conn = h11.Connection(h11.CLIENT)
    size = 16 << 20  # far more than the sockets between hold: the host stops reading and closes
    writer.write(
        conn.send(h11.Request(method="POST", target="/early", headers=[("Host", HOST), ("Content-Length", str(size))]))
    )

    async def send_body() -> None:
        chunk = b"z" * 65536
        try:
            for _ in range(size // len(chunk)):
                writer.write(conn.send(h11.Data(data=chunk)))
                await writer.drain()
        except (OSError, h11.LocalProtocolError):
            pass

    sending = asyncio.ensure_future(send_body())
    try:
        status = 0
        while not status:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await asyncio.wait_for(reader.read(65536), 15)
                assert data, "the connection ended without the host's answer"
                conn.receive_data(data)
            elif isinstance(event, h11.Response):
                status = event.status_code
        assert status == 413
    finally:
        sending.cancel()
        writer.close()
