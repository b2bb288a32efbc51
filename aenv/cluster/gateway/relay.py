"""Bodies and answers as they pass through the gateway: a client's body read within bounds, a
node's answer streamed back (``Relay``) or read whole, and the gateway's own errors, each naming
the node the request was for."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import httpx
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from aenv.api import connections
from aenv.api.proxy import sandbox_gone, sandbox_paused
from aenv.cluster.entries import NodeEntry
from aenv.cluster.gateway.settings import MAX_CREATE_BODY
from aenv.cluster.websocket import NODE_ID_HEADER
from aenv.errors import AenvError, PayloadTooLarge, SandboxNotFound, UpstreamError, error_body, error_headers

log = logging.getLogger("aenv.gateway")

# Keys of the ASGI scope the gateway fills as it routes: the node a request is for (its id goes on
# every answer, errors included) and the route's kind (a metrics label).
NODE_SCOPE = "aenv.node_id"
TAKEOVER_SCOPE = "aenv.takeover"  # a resume sent to another node than the sandbox's lost one
ROUTE_SCOPE = "aenv.route"
# Not forwarded either way (RFC 9110 7.6.1), plus what the forwarding sets itself.
HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
    }
)


class NodeSilent(UpstreamError):
    """A node did not answer a request sent to it (refused, reset, cut off mid-way or too slow):
    dead, perhaps, while its lease has not run out yet."""

    def __init__(self, message: str, node_id: str) -> None:
        super().__init__(message)
        self.node_id = node_id


class Relay:
    """A node's response streamed to the client as it comes. The node's connection is closed
    however the relay ends: the body done, the client gone (even while the node is quiet, as
    during a long command), or the node failing mid-way (the client's response is cut short)."""

    def __init__(self, upstream: httpx.Response, node: NodeEntry) -> None:
        self.upstream = upstream
        self.node = node

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            start = {"status": self.upstream.status_code, "headers": response_headers(self.upstream, self.node)}
            await send({"type": "http.response.start", **start})
            relay = asyncio.ensure_future(self._relay(send))
            gone = asyncio.ensure_future(_client_gone(receive))
            try:
                await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                relay.cancel()
                # A cancelled task is done only once it has run its cancellation: wait for both.
                await asyncio.gather(relay, gone, return_exceptions=True)
            if not relay.cancelled():
                relay.result()
        finally:
            await self.upstream.aclose()

    async def _relay(self, send: Send) -> None:
        try:
            async for chunk in self.upstream.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.TransportError as exc:
            log.warning("node %s broke off a response: %r", self.node.node_id, exc)
            # No final body message: the server ends the connection, with a reset as the node's
            # (the SDKs read a reset, not a cut body, as a connection lost with the sandbox).
            connections.reset_on_close()
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _client_gone(receive: Receive) -> None:
    """Returns once the client disconnects (the request's body has been read by then)."""
    while (await receive())["type"] != "http.disconnect":
        pass


# -- the client's body ----------------------------------------------------------------------------
def small_body(request: Request, limit: int = MAX_CREATE_BODY) -> bool:
    """Whether the request's body (if any) says it is small enough to keep for sending again."""
    declared = request.headers.get("content-length", "")
    return "transfer-encoding" not in request.headers and (
        not declared or (declared.isdecimal() and int(declared) <= limit)
    )


async def kept_body(request: Request, limit: int, within: float) -> tuple[bytes | None, AsyncIterator[bytes] | None]:
    """A streamed body (no length given) read whole, if it ends within ``limit`` bytes and
    ``within`` seconds: (it, None). Else (None, the body as a stream: what was read, then the
    rest), for a client that streams for longer (its request goes once, as it comes)."""
    data = bytearray()
    more = True
    deadline = time.monotonic() + within
    while more and len(data) <= limit:
        try:  # a receive given up on keeps what arrives for the next one (uvicorn's cycle)
            message = await asyncio.wait_for(request.receive(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            break
        if message["type"] != "http.request":
            raise ClientDisconnect()
        data += message.get("body", b"")
        more = bool(message.get("more_body", False))
    if not more:
        return bytes(data), None

    async def rest() -> AsyncIterator[bytes]:
        if data:
            yield bytes(data)
        while True:
            message = await request.receive()
            if message["type"] != "http.request":
                raise ClientDisconnect()
            if message.get("body"):
                yield message["body"]
            if not message.get("more_body", False):
                return

    return None, rest()


async def body_stream(request: Request) -> AsyncIterator[bytes]:
    async for chunk in request.stream():
        if chunk:
            yield chunk


async def read_bounded(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdecimal() and int(declared) > limit:
        raise PayloadTooLarge(f"the request body is larger than {limit // 1024} KiB")
    data = bytearray()
    async with asyncio.timeout(60):
        async for chunk in request.stream():
            data += chunk
            if len(data) > limit:
                raise PayloadTooLarge(f"the request body is larger than {limit // 1024} KiB")
    return bytes(data)


# -- a node's answer ------------------------------------------------------------------------------
async def read_upstream(upstream: httpx.Response, limit: int, node: NodeEntry) -> bytes:
    """A node's whole (small) answer; one that breaks off or runs past ``limit`` is a 502."""
    data = bytearray()
    try:
        async for chunk in upstream.aiter_raw():
            data += chunk
            if len(data) > limit:
                raise UpstreamError(f"node {node.node_id} answered with more than {limit // 1024} KiB")
    except httpx.TransportError as exc:
        raise UpstreamError(f"node {node.node_id} broke off its answer: {exc!r}"[:300]) from None
    return bytes(data)


def replay(upstream: httpx.Response, content: bytes) -> httpx.Response:
    """A node's answer already read whole, as a response to stream (relay or read) again."""
    return httpx.Response(upstream.status_code, headers=upstream.headers, stream=httpx.ByteStream(content))


def buffered(upstream: httpx.Response, node: NodeEntry, content: bytes) -> Response:
    """A node's answer, read whole (and maybe changed), with its headers."""
    response = Response(content, upstream.status_code)
    headers = [(k, v) for k, v in response_headers(upstream, node) if k.lower() != b"content-length"]
    response.raw_headers = [*headers, (b"content-length", str(len(content)).encode())]
    return response


def response_headers(upstream: httpx.Response, node: NodeEntry) -> list[tuple[bytes, bytes]]:
    """The node's headers, repeated ones kept (Set-Cookie), and which node answered."""
    headers = [(k, v) for k, v in upstream.headers.raw if k.lower().decode("latin-1") not in HOP_HEADERS]
    headers.append((NODE_ID_HEADER.encode(), node.node_id.encode()))
    return headers


# -- the gateway's own answers --------------------------------------------------------------------
def traffic_gone(scope: Scope, sandbox_id: str, exc: SandboxNotFound, *, paused: bool = False) -> JSONResponse:
    """Sandbox traffic for a sandbox the cluster does not have running: the node's answer (E2B's
    edge's: 502, which the SDKs read as "not running"), naming the node when it was on one that
    left; for a durable pause it does not wake, that it is paused and how to resume it (as a
    node says of its own pauses)."""
    response = sandbox_gone(sandbox_id[:80])
    node_id = scope.get(NODE_SCOPE)
    if paused:
        response = sandbox_paused(sandbox_id[:80], headers={NODE_ID_HEADER: node_id} if node_id else None)
    elif node_id:
        response = JSONResponse(
            {"sandboxId": sandbox_id, "message": f"The sandbox was not found: {exc.message}", "code": 502},
            status_code=502,
            headers={NODE_ID_HEADER: node_id},
        )
    return response


def error_response(scope: Scope, exc: AenvError) -> JSONResponse:
    """An error as JSON, naming the node the request was for when the gateway got that far."""
    headers = error_headers(exc)
    node_id = scope.get(NODE_SCOPE)
    if node_id:
        headers[NODE_ID_HEADER] = node_id
    return JSONResponse(error_body(exc), status_code=exc.status, headers=headers)
