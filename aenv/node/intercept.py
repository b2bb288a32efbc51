"""The node's end of a connection to a host with a ``network.rules`` transform: HTTP/1.1 relayed
request by request, each request's rule headers set with the team's secrets filled in, here on the
host, so a secret's value never enters the sandbox (nor its snapshots or forks).

For HTTPS (port 443) the sandbox's TLS ends here, with a certificate for the host made by this
node's egress CA (which the sandbox trusts for this alone), and a new TLS connection to the checked
address verifies the real host as any client would. Plain HTTP (port 80) is relayed the same way
without TLS. Anything but HTTP/1.1 (HTTP/2 is never offered, CONNECT, garbage) ends the connection;
an upgrade (a WebSocket) is relayed as bytes once the host accepts it. Values are never logged.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import logging
import os
import socket
import ssl
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import h11
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from aenv.channel import Stream, splice
from aenv.node.transforms import MissingSecret, Rule, SecretLookup

log = logging.getLogger("aenv.egress")

CA_DAYS = 3650
LEAF_DAYS = 7
LEAF_RENEW = 24 * 3600.0  # a cached leaf is made again this long before it expires
MAX_LEAVES = 1024  # cached leaf contexts (hosts are at most 10 per sandbox, but many sandboxes)
HANDSHAKE_TIMEOUT = 10.0
IDLE_TIMEOUT = 300.0  # no byte either way for this long ends the connection
READ_CHUNK = 64 * 1024
MAX_HEAD = 64 * 1024  # a request's or response's head (h11 holds it whole)
EXTRA_CA_ENV = "AENV_EGRESS_EXTRA_CA"  # a PEM file trusted for upstream hosts besides the system's


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common[:64])])


class EgressCA:
    """This node's CA for intercepted hosts: made once (an EC P-256 key, 10 years), kept in
    ``directory`` (the key 0600); leaf certificates are made per host on demand and cached."""

    def __init__(self, directory: Path, node: str = "") -> None:
        self.directory = directory
        self.node = node
        self._key: ec.EllipticCurvePrivateKey | None = None
        self._cert: x509.Certificate | None = None
        self._leaf_key = ec.generate_private_key(ec.SECP256R1())  # in memory only, one for all leaves
        self._leaves: dict[str, tuple[float, ssl.SSLContext]] = {}

    def _load(self) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        if self._key is not None and self._cert is not None:
            return self._key, self._cert
        key_path, cert_path = self.directory / "ca.key", self.directory / "ca.pem"
        if not key_path.exists():
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            key = ec.generate_private_key(ec.SECP256R1())
            now = datetime.datetime.now(datetime.UTC)
            name = _name(f"aenv egress CA {self.node}".strip())
            cert = (
                x509.CertificateBuilder()
                .subject_name(name)
                .issuer_name(name)
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(
                    x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
                )
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256())
            )
            pem = key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
            # the key first, then the certificate: a certificate on disk always has its key
            _write_private(key_path, pem)
            _write_private(cert_path, cert.public_bytes(serialization.Encoding.PEM))  # owner-only, as the data dir
        loaded = serialization.load_pem_private_key(key_path.read_bytes(), None)
        if not isinstance(loaded, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{key_path} is not an EC key")
        self._key, self._cert = loaded, x509.load_pem_x509_certificate(cert_path.read_bytes())
        return self._key, self._cert

    def pem(self) -> str:
        """The CA certificate a sandbox with rules trusts."""
        return self._load()[1].public_bytes(serialization.Encoding.PEM).decode()

    def context_for(self, host: str) -> ssl.SSLContext:
        """A server context presenting a leaf certificate for ``host`` (HTTP/1.1 only)."""
        now = time.time()
        cached = self._leaves.get(host)
        if cached is not None and cached[0] > now:
            return cached[1]
        ca_key, ca_cert = self._load()
        start = datetime.datetime.now(datetime.UTC)
        try:
            alt: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            alt = x509.DNSName(host)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(host))
            .issuer_name(ca_cert.subject)
            .public_key(self._leaf_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start - datetime.timedelta(hours=1))
            .not_valid_after(start + datetime.timedelta(days=LEAF_DAYS))
            .add_extension(x509.SubjectAlternativeName([alt]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_alpn_protocols(["http/1.1"])
        key_pem = self._leaf_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        chain = cert.public_bytes(serialization.Encoding.PEM) + key_pem
        # ssl loads a chain only from a file: a private one, gone as soon as it is read
        fd, path = tempfile.mkstemp(prefix="leaf-", dir=self.directory)
        try:
            os.write(fd, chain)
            os.close(fd)
            ctx.load_cert_chain(path)
        finally:
            os.unlink(path)
        if len(self._leaves) >= MAX_LEAVES:
            self._leaves.clear()
        self._leaves[host] = (now + LEAF_DAYS * 86400 - LEAF_RENEW, ctx)
        return ctx


def _write_private(path: Path, data: bytes, mode: int = 0o600) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


_upstream: dict[str, ssl.SSLContext] = {}


def upstream_context() -> ssl.SSLContext:
    """Verifies hosts as any client: the system's roots (and AENV_EGRESS_EXTRA_CA's, for tests);
    made once (loading the roots costs milliseconds)."""
    extra = os.environ.get(EXTRA_CA_ENV, "")
    if extra not in _upstream:
        _upstream.clear()
        _upstream[extra] = _new_upstream_context(extra)
    return _upstream[extra]


def _new_upstream_context(extra: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    if extra:
        ctx.load_verify_locations(extra)
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


class Closed(ConnectionError):
    """The relay is over (a side closed, broke HTTP/1.1 or went quiet)."""


async def _event(conn: h11.Connection, reader: asyncio.StreamReader) -> object:
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            raise Closed(f"not HTTP/1.1: {exc}") from None
        if event is not h11.NEED_DATA:
            return event
        try:
            data = await asyncio.wait_for(reader.read(READ_CHUNK), IDLE_TIMEOUT)
        except (OSError, TimeoutError) as exc:
            raise Closed(str(exc) or type(exc).__name__) from None
        conn.receive_data(data)


async def _send(conn: h11.Connection, writer: asyncio.StreamWriter, event: h11._events.Event) -> None:
    data = conn.send(event)
    if data:
        writer.write(data)
        await asyncio.wait_for(writer.drain(), IDLE_TIMEOUT)


async def _forward_body(
    guest: h11.Connection, g_reader: asyncio.StreamReader, up: h11.Connection, u_writer: asyncio.StreamWriter
) -> str:
    """A request's body from the sandbox to the host: "sent", "guest ended" (half-sent) or "host
    stopped" (it closed or reset while reading: its answer may still be there to relay)."""
    while True:
        body = await _event(guest, g_reader)
        if not isinstance(body, (h11.Data, h11.EndOfMessage)):
            return "guest ended"
        try:
            await _send(up, u_writer, body)
        except (OSError, TimeoutError):
            return "host stopped"
        if isinstance(body, h11.EndOfMessage):
            return "sent"


def _authority_host(authority: bytes) -> str:
    text = authority.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:].partition("]")[0]
    return text.rpartition(":")[0] if text.count(":") == 1 else text


def _same_host(request: h11.Request, host: str) -> bool:
    """The request's Host (and an absolute-form target's authority) is the connection's host."""
    host = host.lower().rstrip(".")
    names = [_authority_host(v) for k, v in request.headers if k == b"host"]
    target = request.target
    if b"://" in target:
        names.append(_authority_host(target.split(b"://", 1)[1].split(b"/", 1)[0].rsplit(b"@", 1)[-1]))
    return bool(names) and all(name.rstrip(".") == host for name in names)


def _bad_value(value: str) -> bool:
    return any(ch in value for ch in "\r\n\x00")


class Interceptor:
    """Relays one sandbox's connections to hosts with rules. ``team`` reads the sandbox's team when
    a request is made (the secrets are its own team's and nobody else's)."""

    def __init__(self, ca: EgressCA, lookup: SecretLookup, team: Callable[[], str]) -> None:
        self.ca, self.lookup, self.team = ca, lookup, team

    async def run(
        self,
        stream: Stream,
        up_reader: asyncio.StreamReader,
        up_writer: asyncio.StreamWriter,
        host: str,
        rule: Rule,
        *,
        tls: bool,
        until: asyncio.Event | None = None,
    ) -> None:
        """Relay ``stream`` (the sandbox's bytes) with the open connection to ``host``."""
        ours, theirs = socket.socketpair()
        loop = asyncio.get_running_loop()
        reader, writer = await asyncio.open_connection(sock=ours)
        spliced = asyncio.ensure_future(splice(stream, reader, writer, until=until))
        guest_writer: asyncio.StreamWriter | None = None
        try:
            guest_reader = asyncio.StreamReader(limit=MAX_HEAD)
            protocol = asyncio.StreamReaderProtocol(guest_reader)
            if tls:
                transport, _ = await loop.connect_accepted_socket(
                    lambda: protocol,
                    theirs,
                    ssl=self.ca.context_for(host),
                    ssl_handshake_timeout=HANDSHAKE_TIMEOUT,
                )
                await up_writer.start_tls(
                    upstream_context(), server_hostname=host, ssl_handshake_timeout=HANDSHAKE_TIMEOUT
                )
            else:
                transport, _ = await loop.connect_accepted_socket(lambda: protocol, theirs)
            guest_writer = asyncio.StreamWriter(transport, protocol, guest_reader, loop)
            relay = asyncio.ensure_future(self._relay(guest_reader, guest_writer, up_reader, up_writer, host, rule))
            cut = asyncio.ensure_future((until or asyncio.Event()).wait())
            try:
                await asyncio.wait({relay, spliced, cut}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                cut.cancel()
                relay.cancel()
                await asyncio.wait({relay})
            if relay.done() and not relay.cancelled() and relay.exception() is not None:
                log.debug("egress relay to %s ended: %s", host, type(relay.exception()).__name__)
        except (OSError, ssl.SSLError, TimeoutError, ConnectionError) as exc:
            log.debug("egress relay to %s failed: %s", host, type(exc).__name__)  # the sandbox decides how often
        finally:
            if guest_writer is not None:
                guest_writer.close()
            else:
                theirs.close()
            up_writer.close()
            await asyncio.wait({spliced}, timeout=5.0)
            if not spliced.done():
                spliced.cancel()
            writer.close()

    async def _relay(
        self,
        g_reader: asyncio.StreamReader,
        g_writer: asyncio.StreamWriter,
        u_reader: asyncio.StreamReader,
        u_writer: asyncio.StreamWriter,
        host: str,
        rule: Rule,
    ) -> None:
        guest = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        up = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        try:
            while True:
                event = await _event(guest, g_reader)
                if not isinstance(event, h11.Request):
                    return  # the sandbox closed (or sent nothing HTTP)
                if event.method == b"CONNECT":
                    await self._refuse(guest, g_writer, 405, "CONNECT through an intercepted host is not relayed")
                    return
                if not _same_host(event, host):
                    # a shared front end (a CDN) routes by Host: the secret must go where the rule says
                    await self._refuse(
                        guest, g_writer, 421, f"network.rules for {host}: the request names another host"
                    )
                    return
                try:
                    headers = await self._filled(event.headers, rule)
                except MissingSecret as exc:
                    await self._refuse(
                        guest, g_writer, 502, f"network.rules for {host}: this team has no secret named {exc.name!r}"
                    )
                    return
                except ValueError:
                    await self._refuse(
                        guest, g_writer, 502, f"network.rules for {host}: a secret is not a header value"
                    )
                    return
                await _send(up, u_writer, h11.Request(method=event.method, target=event.target, headers=headers))
                if not await self._exchange(guest, g_reader, g_writer, up, u_reader, u_writer):
                    return
                if guest.our_state is not h11.DONE or up.their_state is not h11.DONE:
                    return
                try:
                    guest.start_next_cycle()
                    up.start_next_cycle()
                except h11.LocalProtocolError:
                    return
        except (Closed, h11.LocalProtocolError):
            return

    async def _exchange(
        self,
        guest: h11.Connection,
        g_reader: asyncio.StreamReader,
        g_writer: asyncio.StreamWriter,
        up: h11.Connection,
        u_reader: asyncio.StreamReader,
        u_writer: asyncio.StreamWriter,
    ) -> bool:
        """The request's body up and the answer down at once, as a proxy must: a client that sent
        ``Expect: 100-continue`` waits for the host's 100 before its body, and a host may answer (a
        401, a 413) before it has read the body; True if the connection may carry another request."""
        sending = asyncio.ensure_future(_forward_body(guest, g_reader, up, u_writer))
        answering = asyncio.ensure_future(self._response(guest, g_reader, g_writer, up, u_reader, u_writer))
        try:
            await asyncio.wait({sending, answering}, return_when=asyncio.FIRST_COMPLETED)
            if not sending.done():  # answered before the body was all sent: the connection ends after it
                answering.result()
                return False
            sent = sending.result()
            if sent == "guest ended":
                return False
            answered = await answering  # the host's answer, also when it stopped reading the body
            return answered and sent == "sent"
        finally:
            for task in (sending, answering):
                task.cancel()
            await asyncio.wait({sending, answering})

    async def _response(
        self,
        guest: h11.Connection,
        g_reader: asyncio.StreamReader,
        g_writer: asyncio.StreamWriter,
        up: h11.Connection,
        u_reader: asyncio.StreamReader,
        u_writer: asyncio.StreamWriter,
    ) -> bool:
        """The host's answer to the sandbox; False once the connection goes on as bytes or ends."""
        while True:
            event = await _event(up, u_reader)
            if isinstance(event, h11.InformationalResponse):
                await _send(guest, g_writer, event)
                if event.status_code == 101:  # switched (a WebSocket): bytes from here on
                    await self._pipe(guest, g_reader, g_writer, up, u_reader, u_writer)
                    return False
                continue
            if not isinstance(event, h11.Response):
                return False
            await _send(guest, g_writer, event)
            break
        while True:
            event = await _event(up, u_reader)
            if isinstance(event, h11.Data):
                await _send(guest, g_writer, event)
            elif isinstance(event, h11.EndOfMessage):
                await _send(guest, g_writer, event)
                return True
            else:
                return False

    async def _pipe(
        self,
        guest: h11.Connection,
        g_reader: asyncio.StreamReader,
        g_writer: asyncio.StreamWriter,
        up: h11.Connection,
        u_reader: asyncio.StreamReader,
        u_writer: asyncio.StreamWriter,
    ) -> None:
        """Both ways as bytes (what each side sent past the switch first), until one side ends."""

        async def copy(first: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if first:
                writer.write(first)
            while True:
                await asyncio.wait_for(writer.drain(), IDLE_TIMEOUT)
                data = await asyncio.wait_for(reader.read(READ_CHUNK), IDLE_TIMEOUT)
                if not data:
                    return
                writer.write(data)

        ways = {
            asyncio.ensure_future(copy(guest.trailing_data[0], g_reader, u_writer)),
            asyncio.ensure_future(copy(up.trailing_data[0], u_reader, g_writer)),
        }
        try:
            await asyncio.wait(ways, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for way in ways:
                way.cancel()
            await asyncio.wait(ways)

    async def _filled(self, given: Iterable[tuple[bytes, bytes]], rule: Rule) -> list[tuple[bytes, bytes]]:
        """The request's headers with the rule's set: same-named ones replaced, values filled."""
        names = {name.lower().encode() for name, _ in rule.headers}
        out = [(k, v) for k, v in given if k.lower() not in names]
        team = self.team()
        for name, template in rule.headers:
            value = await template.fill(self.lookup, team)
            if _bad_value(value):
                raise ValueError("not a header value")
            out.append((name.encode(), value.encode()))
        return out

    async def _refuse(self, guest: h11.Connection, writer: asyncio.StreamWriter, status: int, message: str) -> None:
        """An answer of the node's own, then the connection's end."""
        body = (message + "\n").encode()
        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            (b"x-aenv-egress", b"refused"),
        ]
        try:
            await _send(guest, writer, h11.Response(status_code=status, headers=headers))
            await _send(guest, writer, h11.Data(data=body))
            await _send(guest, writer, h11.EndOfMessage())
        except (h11.LocalProtocolError, OSError, TimeoutError):
            pass
