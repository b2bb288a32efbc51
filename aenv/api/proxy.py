"""The sandbox port proxy: HTTP to any port a process inside a sandbox listens on (E2B's get_host).

The sandbox has no network; each request rides a TCP tunnel that the guest agent opens to
127.0.0.1:<port> inside the sandbox. HTTP/1.1 framing on the tunnel is done with h11.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import h11
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from aenv.channel import DATA, END, EOF, Stream
from aenv.errors import AenvError
from aenv.node.orchestrator import Node

HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
}
ROUTING = {"e2b-sandbox-id", "e2b-sandbox-port"}


def sandbox_gone(sandbox_id: str) -> JSONResponse:
    return JSONResponse(
        {"sandboxId": sandbox_id, "message": "The sandbox was not found", "code": 502},
        status_code=502,
        media_type="application/json; charset=utf-8",
    )


def port_closed(sandbox_id: str, port: int) -> JSONResponse:
    return JSONResponse(
        {"sandboxId": sandbox_id, "message": "The sandbox is running but port is not open", "port": port, "code": 502},
        status_code=502,
        media_type="application/json; charset=utf-8",
    )


async def open_tunnel(node: Node, sandbox_id: str, port: int) -> Stream | Response:
    """A tunnel stream to the port, or the 502 answer E2B's SDKs understand."""
    try:
        sb = await node.ensure_running(sandbox_id)
        assert sb.link is not None
        stream = await sb.link.open("tunnel.open", {"port": port})
    except AenvError:
        return sandbox_gone(sandbox_id)
    first = await stream.recv()
    if first.kind == END:
        return port_closed(sandbox_id, port)
    return stream


async def proxy_http(request: Request, node: Node, sandbox_id: str, port: int) -> Response:
    tunnel = await open_tunnel(node, sandbox_id, port)
    if isinstance(tunnel, Response):
        return tunnel
    body = await request.body()
    conn = h11.Connection(our_role=h11.CLIENT)
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP | ROUTING]
    headers.append(("content-length", str(len(body))))
    headers.append(("connection", "close"))
    try:
        out = conn.send(h11.Request(method=request.method, target=target, headers=headers)) or b""
        if body:
            out += conn.send(h11.Data(data=body)) or b""
        out += conn.send(h11.EndOfMessage()) or b""
        await tunnel.send_data(out)
        response = await _read_head(conn, tunnel)
    except (h11.ProtocolError, ConnectionError) as exc:
        await tunnel.end()
        return JSONResponse({"code": 502, "message": f"bad response from port {port}: {exc}"}, status_code=502)
    if response is None:
        await tunnel.end()
        return port_closed(sandbox_id, port)
    passed = {k.decode(): v.decode("latin-1") for k, v in response.headers if k.decode().lower() not in HOP_BY_HOP}
    return StreamingResponse(_body(conn, tunnel), status_code=response.status_code, headers=passed)


async def proxy_websocket(scope: Any, receive: Any, send: Any, node: Node, sandbox_id: str, port: int) -> None:
    """WebSocket upgrades to sandbox ports are not carried yet: refuse them cleanly."""
    await send({"type": "websocket.close", "code": 1011})


async def _read_head(conn: h11.Connection, tunnel: Stream) -> h11.Response | None:
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            item = await tunnel.recv()
            conn.receive_data(item.data if item.kind == DATA else b"")
            continue
        if isinstance(event, h11.Response):
            return event
        if isinstance(event, h11.ConnectionClosed):
            return None


async def _body(conn: h11.Connection, tunnel: Stream) -> AsyncIterator[bytes]:
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                item = await tunnel.recv()
                if item.kind == DATA:
                    conn.receive_data(item.data)
                elif item.kind in (EOF, END):
                    conn.receive_data(b"")
                continue
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                return
    except h11.ProtocolError:
        return
    finally:
        if not tunnel.remote_ended:
            await tunnel.end()
