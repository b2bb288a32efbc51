"""The node's HTTP/1.1 connections: uvicorn's httptools protocol, plus two things uvicorn has not.

- A deadline on each request head. A client that sent half a head, or a byte now and then, kept
  its connection and a file descriptor for as long as it liked, without an API key (enough of them
  leave the node without descriptors). The deadline runs from a connection's start (a client
  connects to send a request) and from the first byte of each later head; an idle kept-alive
  connection between requests is bounded by uvicorn's keep-alive timeout instead, which clients'
  pools rely on.
- The connection a request came on, so that an answer can be dropped as a reset. E2B's edge speaks
  HTTP/2 and drops the stream of a sandbox that went away with a stream reset; the SDKs take a
  reset (a read error), not a body that merely stops, as "the connection was lost" and then ask
  the sandbox's health. Over HTTP/1.1 the closest is a TCP reset of the connection.
"""

from __future__ import annotations

import asyncio
import contextvars
import socket
import ssl
import struct
from pathlib import Path

from starlette.responses import Response
from starlette.types import Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from aenv.errors import InvalidRequest

_TRANSPORT: contextvars.ContextVar[asyncio.BaseTransport | None] = contextvars.ContextVar(
    "aenv_client_transport", default=None
)


class NodeHTTPProtocol(HttpToolsProtocol):
    transport: asyncio.Transport
    head_timeout = 30.0  # seconds a client has to send a request's head, from its connection or its first byte
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def data_received(self, data: bytes) -> None:
        # A request's task copies the context it was created in, which is inside this call.
        token = _TRANSPORT.set(self.transport)
        try:
            super().data_received(data)
        finally:
            _TRANSPORT.reset(token)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._head_timer is None:
            self._await_head()

    def on_headers_complete(self) -> None:
        self._head_in()  # what follows (the body) is the route's to bound
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_in()
        super().connection_lost(exc)

    def _await_head(self) -> None:
        self._head_in()
        self._head_timer = self.loop.call_later(self.head_timeout, self.transport.close)

    def _head_in(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None


def protocol_with(head_timeout: float) -> type[NodeHTTPProtocol]:
    """The protocol class given to uvicorn, with this server's deadline on heads (AENV_HTTP_HEAD_TIMEOUT)."""
    return type("NodeHTTPProtocol", (NodeHTTPProtocol,), {"head_timeout": head_timeout})


def reset_on_close() -> None:
    """Make the current request's connection end with a reset when the server closes it."""
    transport = _TRANSPORT.get()
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def check_tls(cert: Path | None, key: Path | None) -> None:
    """A certificate and its key that serve HTTPS, or neither; checked before serving (uvicorn
    would fail on them only after the node or gateway had started)."""
    if cert is None and key is None:
        return
    if cert is None or key is None:
        raise InvalidRequest("a TLS certificate needs its key, and a key its certificate (both or neither)")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise InvalidRequest(f"cannot serve TLS with {cert} and {key}: {exc}") from None


async def refuse_websocket(scope: Scope, send: Send, response: Response) -> None:
    """Answer a refused upgrade with an HTTP response where the server can send one."""
    if "websocket.http.response" in scope.get("extensions", {}):
        await send(
            {"type": "websocket.http.response.start", "status": response.status_code, "headers": response.raw_headers}
        )
        await send({"type": "websocket.http.response.body", "body": response.body})
    else:
        await send({"type": "websocket.close", "code": 1011})
