"""The client connection a request came on, so that an answer can be dropped as a reset.

E2B's edge speaks HTTP/2 and drops the stream of a sandbox that went away with a stream reset; the
SDKs take a reset (a read error), not a body that merely stops, as "the connection was lost" and
then ask the sandbox's health. Over HTTP/1.1 the closest is a TCP reset of the connection.
"""

from __future__ import annotations

import asyncio
import contextvars
import socket
import struct

from uvicorn.protocols.http.auto import AutoHTTPProtocol

_TRANSPORT: contextvars.ContextVar[asyncio.BaseTransport | None] = contextvars.ContextVar(
    "aenv_client_transport", default=None
)


class TrackedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    """uvicorn's HTTP protocol, which makes its transport known to the requests it starts: a
    request's task copies the context it was created in, inside data_received."""

    transport: asyncio.BaseTransport

    def data_received(self, data: bytes) -> None:
        token = _TRANSPORT.set(self.transport)
        try:
            super().data_received(data)
        finally:
            _TRANSPORT.reset(token)


def reset_on_close() -> None:
    """Make the current request's connection end with a reset when the server closes it."""
    transport = _TRANSPORT.get()
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
