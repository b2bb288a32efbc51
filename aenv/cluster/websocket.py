"""WebSockets through a gateway: the client's upgrade is made again to the owning node (which
relays it to the sandbox's port), then messages, and close codes, go both ways.

Both ends are terminated here, so each side's bound holds at the gateway: uvicorn refuses a client
message past ``max_size`` (1009), and the node's connection does the same for what comes back.
When either side leaves, the other is closed: a client that goes (even without a close frame)
closes the node's connection, which closes the port's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.frames import EXTERNAL_CLOSE_CODES
from websockets.typing import Subprotocol

from aenv.api.connections import as_sent, dated_by, refuse_websocket
from aenv.cluster.entries import NodeEntry

log = logging.getLogger("aenv.gateway")

NODE_ID_HEADER = "x-aenv-node-id"  # on every answer about one sandbox: the node that has it
# What the upgrade to the node makes itself, or must not carry over (RFC 9110 7.6.1, RFC 6455).
NOT_FORWARDED = frozenset(
    {
        "host",
        "connection",
        "upgrade",
        "keep-alive",
        "te",
        "trailer",
        "transfer-encoding",
        "proxy-authorization",
        "sec-websocket-key",
        "sec-websocket-version",
        "sec-websocket-extensions",
        "sec-websocket-protocol",
        "sec-websocket-accept",
        "e2b-sandbox-id",
        "e2b-sandbox-port",
        "aenv-client-host",  # the gateway's own, in its routing headers
    }
)
# The node's proxy waits up to its port_response_timeout (300 s) for the port's handshake.
OPEN_TIMEOUT = 330.0
CLOSE_TIMEOUT = 10.0


async def relay_websocket(
    scope: Scope, receive: Receive, send: Send, node: NodeEntry, routing: dict[str, str], max_size: int
) -> None:
    """Relay an (already received) client upgrade to ``node``; ``routing`` names the sandbox's port."""
    path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
    query = (scope.get("query_string") or b"").decode("latin-1")
    uri = "ws" + node.address.removeprefix("http") + path + (f"?{query}" if query else "")
    headers = [
        (k.decode("latin-1"), v.decode("latin-1"))
        for k, v in as_sent(scope)  # names as the client wrote them
        if k.decode("latin-1").lower() not in NOT_FORWARDED
    ]
    offered = [Subprotocol(p) for p in scope.get("subprotocols", [])] or None
    try:
        upstream = await connect(
            uri,
            additional_headers=[*headers, *routing.items()],
            subprotocols=offered,
            compression=None,
            user_agent_header=None,
            proxy=None,
            open_timeout=OPEN_TIMEOUT,
            close_timeout=CLOSE_TIMEOUT,
            max_size=max_size,
        )
    except InvalidStatus as exc:  # the node (or the port behind it) refused the upgrade: pass that on
        answer = exc.response
        body = bytes(answer.body or b"")
        kept = [(k.lower(), v) for k, v in answer.headers.raw_items() if k.lower() in ("content-type", "should-retry")]
        refusal = Response(body, status_code=answer.status_code, headers={**dict(kept), NODE_ID_HEADER: node.node_id})
        await refuse_websocket(scope, send, refusal)
        return
    except (OSError, TimeoutError, InvalidHandshake) as exc:
        message = f"node {node.node_id} did not take the WebSocket: {exc!r}"[:300]
        refusal = JSONResponse(
            {"code": 502, "message": message}, status_code=502, headers={NODE_ID_HEADER: node.node_id}
        )
        await refuse_websocket(scope, send, refusal)
        return
    accept = [(NODE_ID_HEADER.encode(), node.node_id.encode())]
    if upstream.response is not None:  # the node's Date and Server (the port's): one of each
        accept += dated_by(upstream.response.headers.raw_items())
    await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol, "headers": accept})
    await _Bridge(receive, send, upstream).run()


class _Bridge:
    def __init__(self, receive: Receive, send: Send, upstream: ClientConnection) -> None:
        self.receive = receive
        self.send = send
        self.upstream = upstream
        self.client_closed = False

    async def run(self) -> None:
        to_node = asyncio.ensure_future(self._client_to_node())
        to_client = asyncio.ensure_future(self._node_to_client())
        try:
            await asyncio.wait({to_node, to_client}, return_when=asyncio.FIRST_COMPLETED)
            if to_node.done():  # the client left: what the node still sends has a moment, no more
                await asyncio.wait({to_client}, timeout=CLOSE_TIMEOUT)
        finally:
            for task in (to_node, to_client):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.upstream.close(1001), CLOSE_TIMEOUT)  # a no-op once closed
            await self._close_client(1011)

    async def _client_to_node(self) -> None:
        while True:
            message: Message = await self.receive()
            if message["type"] == "websocket.disconnect":
                self.client_closed = True
                # 1009 when uvicorn refused a message too big; a client that vanished (1005, 1006:
                # codes no frame may carry) is "going away" to the node.
                code = message.get("code") or 1000
                if code not in EXTERNAL_CLOSE_CODES and not 3000 <= code < 5000:
                    code = 1001
                with contextlib.suppress(ConnectionClosed):
                    await self.upstream.close(code, message.get("reason") or "")
                return
            try:
                if message.get("text") is not None:
                    await self.upstream.send(message["text"])
                elif message.get("bytes") is not None:
                    await self.upstream.send(message["bytes"])
            except ConnectionClosed:
                return  # the node's side ended: _node_to_client passes its close on

    async def _node_to_client(self) -> None:
        try:
            async for data in self.upstream:
                key = "text" if isinstance(data, str) else "bytes"
                await self.send({"type": "websocket.send", key: data})
        except ConnectionClosed:
            pass
        # The node's close (the port's), or the one this side sent for a message past the bound.
        close = self.upstream.protocol.close_rcvd or self.upstream.protocol.close_sent
        await self._close_client(*((close.code, close.reason) if close else (1011, "")))

    async def _close_client(self, code: int, reason: str = "") -> None:
        if self.client_closed:
            return
        self.client_closed = True
        if code not in EXTERNAL_CLOSE_CODES and not 3000 <= code < 5000:
            code = 1011
        with contextlib.suppress(Exception):
            await self.send({"type": "websocket.close", "code": code, "reason": reason})
