"""The in-sandbox end of egress: an HTTP proxy on 127.0.0.1:3128 whose upstream is the host.

A sandbox has loopback only. Every process gets HTTP_PROXY/HTTPS_PROXY pointing here; each
connection (CONNECT host:port for TLS, or a plain absolute-URI HTTP request) becomes one
``egress.connect`` stream to the host, which applies the sandbox's network policy, makes the
TCP connection and relays bytes. A refusal comes back at once as an HTTP error that says why.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from aenv.channel import END, MAX_GUEST_STREAMS, Channel, ChannelClosed, StreamError
from aenv.guest.sockets import on_loop, relay

T = TypeVar("T")

PROXY_PORT = 3128
PROXY_URL = f"http://127.0.0.1:{PROXY_PORT}"
NO_PROXY = "localhost,127.0.0.1,::1"
HEAD_LIMIT = 64 * 1024
HEAD_TIMEOUT = 30.0
ANSWER_TIMEOUT = 60.0  # the host resolves and connects within its own deadlines; this is a backstop
DROPPED = {b"proxy-connection", b"proxy-authorization", b"connection", b"keep-alive"}
LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
NAME = re.compile(rf"(?=.{{1,253}}$)(?:{LABEL}\.)*{LABEL}\.?")
AUTHORITY = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.]{2,45})\]|(?P<name>[^\[\]:]+))(?::(?P<port>[0-9]{1,5}))?")
CONTROL = re.compile(r"[\x00-\x20\x7f]")
REASONS = {400: "Bad Request", 403: "Forbidden", 502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}


# What every process gets so proxy-aware tools (curl, pip, git, requests, npm) find the way out.
PROXY_ENV = {
    **{name: PROXY_URL for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")},
    **{name: NO_PROXY for name in ("no_proxy", "NO_PROXY")},
}


def valid_name(host: str) -> bool:
    """A DNS name: ASCII labels of 1-63 letters, digits, '-' or '_', 253 characters at most; an
    IDN label is punycode (``xn--``) that decodes."""
    if not NAME.fullmatch(host):
        return False
    for label in host.split("."):
        if label[:4].lower() == "xn--":
            try:
                if not label[4:].encode().decode("punycode"):
                    return False
            except UnicodeError:
                return False
    return True


def destination(authority: str, default_port: int | None = None) -> tuple[str, int] | None:
    """(host, port) of ``host:port`` or ``[v6]:port``, or None unless it is exactly that: a
    :func:`valid_name` or an IP literal, no userinfo, no zone id, no port outside 1-65535."""
    m = AUTHORITY.fullmatch(authority)
    if m is None:
        return None
    host = m["v6"] or m["name"]
    if m["v6"] is not None:
        try:
            socket.inet_pton(socket.AF_INET6, host)
        except OSError:
            return None
    elif not valid_name(host):
        return None
    port = int(m["port"]) if m["port"] is not None else default_port
    if port is None or not 0 < port < 65536:
        return None
    return host, port


def split_url(target: str) -> tuple[tuple[str, int] | None, str]:
    """(destination, origin-form path) of an absolute ``http://`` URI."""
    scheme, sep, rest = target.partition("://")
    if not sep or scheme.lower() != "http":
        return None, ""
    cut = min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    path = rest[cut:].partition("#")[0]
    return destination(rest[:cut], 80), path if path.startswith("/") else "/" + path


class Refusal(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class EgressProxy:
    """Blocking sockets and threads, not asyncio (see aenv/guest/sockets.py for why).

    At most MAX_GUEST_STREAMS connections go out at once (the host allows no more streams); the
    rest get a 503 at once."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.listener: socket.socket | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._slots = threading.BoundedSemaphore(MAX_GUEST_STREAMS)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(("127.0.0.1", PROXY_PORT))
            listener.listen(128)
        except OSError:
            listener.close()
            return  # the port is taken inside this image: processes then have no way out
        self.listener = listener
        threading.Thread(target=self._accept, name="egress-accept", daemon=True).start()

    def _accept(self) -> None:
        assert self.listener is not None
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                continue
            threading.Thread(target=self._client, args=(conn,), name="egress-conn", daemon=True).start()

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        assert self.loop is not None
        return on_loop(self.loop, coro, timeout)

    def _client(self, conn: socket.socket) -> None:
        try:
            self._serve(conn)
        except Refusal as exc:
            _refuse(conn, exc.status, exc.message)
        except (OSError, ChannelClosed, StreamError):
            pass
        finally:
            conn.close()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(HEAD_TIMEOUT)
        head = b""
        while b"\r\n\r\n" not in head:
            part = conn.recv(4096)
            if not part:
                return
            if len(head) > HEAD_LIMIT:
                raise Refusal(400, f"a request head larger than {HEAD_LIMIT} bytes")
            head += part
        conn.settimeout(None)
        head, _, early = head.partition(b"\r\n\r\n")  # early: body bytes sent right behind the head
        request_line, _, header_block = head.partition(b"\r\n")
        parts = request_line.decode("latin-1").split(" ")
        if len(parts) != 3 or any(CONTROL.search(part) for part in parts):
            raise Refusal(400, "malformed request line")
        method, target, version = parts
        forward = early
        if method == "CONNECT":
            dest = destination(target)
        else:
            dest, path = split_url(target)
            kept = [
                line
                for line in header_block.split(b"\r\n")
                if line and line.split(b":", 1)[0].strip().lower() not in DROPPED
            ]
            lines = [f"{method} {path} {version}".encode("latin-1"), *kept, b"Connection: close"]
            forward = b"\r\n".join(lines) + b"\r\n\r\n" + early
        if dest is None:
            raise Refusal(400, f"bad destination {target[:300]!r}: this proxy takes CONNECT host:port or http:// URLs")
        if not self._slots.acquire(blocking=False):
            raise Refusal(503, f"more than {MAX_GUEST_STREAMS} connections through the proxy at once")
        try:
            self._tunnel(conn, method, dest, forward, early)
        finally:
            self._slots.release()

    def _tunnel(self, conn: socket.socket, method: str, dest: tuple[str, int], forward: bytes, early: bytes) -> None:
        host, port = dest
        assert self.loop is not None
        stream = self._run(self.channel.open("egress.connect", {"host": host, "port": port}))
        try:
            try:
                first = self._run(stream.recv(), ANSWER_TIMEOUT)
            except TimeoutError:
                raise Refusal(504, f"no answer about {host}:{port} within {ANSWER_TIMEOUT:.0f}s") from None
            if first.kind == END:
                error: dict[str, Any] = (first.msg or {}).get("error") or {}
                status = 403 if error.get("code") == "permission_denied" else 502
                raise Refusal(status, str(error.get("message", "egress failed")))
            if method == "CONNECT":
                conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                if early:
                    self._run(stream.send_data(early))
            else:
                self._run(stream.send_data(forward))
            relay(self.loop, conn, stream)
        finally:
            self._run(stream.end())


def _refuse(conn: socket.socket, status: int, message: str) -> None:
    body = f"aenv egress: {message}\n".encode()
    head = (
        f"HTTP/1.1 {status} {REASONS[status]}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
        "X-Aenv-Egress: refused\r\nConnection: close\r\n\r\n"
    )
    try:
        conn.sendall(head.encode() + body)
    except OSError:
        pass
