"""The in-sandbox end of egress: an HTTP proxy on 127.0.0.1:3128 whose upstream is the host.

A sandbox has loopback only. Every process gets HTTP_PROXY/HTTPS_PROXY pointing here; each
connection (CONNECT host:port for TLS, or a plain absolute-URI HTTP request) becomes one
``egress.connect`` stream to the host, which applies the sandbox's network policy, makes the
TCP connection and relays bytes. A refusal comes back at once as an HTTP error that says why.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from aenv.channel import END, Channel, ChannelClosed
from aenv.guest.sockets import on_loop, relay

T = TypeVar("T")

PROXY_PORT = 3128
PROXY_URL = f"http://127.0.0.1:{PROXY_PORT}"
NO_PROXY = "localhost,127.0.0.1,::1"
HEAD_LIMIT = 64 * 1024
HEAD_TIMEOUT = 30.0
DROPPED = {b"proxy-connection", b"proxy-authorization", b"connection", b"keep-alive"}


# What every process gets so proxy-aware tools (curl, pip, git, requests, npm) find the way out.
PROXY_ENV = {
    **{name: PROXY_URL for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")},
    **{name: NO_PROXY for name in ("no_proxy", "NO_PROXY")},
}


class EgressProxy:
    """Blocking sockets and threads, not asyncio (see aenv/guest/sockets.py for why)."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.listener: socket.socket | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

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

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        assert self.loop is not None
        return on_loop(self.loop, coro)

    def _client(self, conn: socket.socket) -> None:
        try:
            self._serve(conn)
        except (OSError, ChannelClosed, ValueError):
            pass
        finally:
            conn.close()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(HEAD_TIMEOUT)
        head = b""
        while b"\r\n\r\n" not in head:
            part = conn.recv(4096)
            if not part or len(head) > HEAD_LIMIT:
                return
            head += part
        conn.settimeout(None)
        head, _, early = head.partition(b"\r\n\r\n")  # early: body bytes sent right behind the head
        request_line, _, header_block = head.partition(b"\r\n")
        parts = request_line.decode("latin-1").split(" ")
        if len(parts) != 3:
            return _refuse(conn, 400, "malformed request line")
        method, target, version = parts
        forward = early
        if method == "CONNECT":
            host, _, port_text = target.rpartition(":")
            host = host.strip("[]")
        else:
            from urllib.parse import urlsplit  # plain-HTTP proxying only: see aenv/guest/__main__.py

            url = urlsplit(target)
            if url.scheme != "http" or not url.hostname:
                return _refuse(conn, 400, f"this proxy takes CONNECT or http:// URLs, not {target!r}")
            host, port_text = url.hostname, str(url.port or 80)
            path = (url.path or "/") + (f"?{url.query}" if url.query else "")
            kept = [
                line
                for line in header_block.split(b"\r\n")
                if line and line.split(b":", 1)[0].strip().lower() not in DROPPED
            ]
            lines = [f"{method} {path} {version}".encode("latin-1"), *kept, b"Connection: close"]
            forward = b"\r\n".join(lines) + b"\r\n\r\n" + early
        if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
            return _refuse(conn, 400, f"bad destination {target!r}")
        stream = self._run(self.channel.open("egress.connect", {"host": host, "port": int(port_text)}))
        try:
            first = self._run(stream.recv())
            if first.kind == END:
                error: dict[str, Any] = (first.msg or {}).get("error") or {}
                status = 403 if error.get("code") == "permission_denied" else 502
                return _refuse(conn, status, str(error.get("message", "egress failed")))
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
    reason = {400: "Bad Request", 403: "Forbidden", 502: "Bad Gateway"}[status]
    body = f"aenv egress: {message}\n".encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
        "X-Aenv-Egress: refused\r\nConnection: close\r\n\r\n"
    )
    conn.sendall(head.encode() + body)
