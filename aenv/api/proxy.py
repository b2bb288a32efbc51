"""The sandbox port proxy: HTTP and WebSockets to any port a process in a sandbox listens on (get_host).

The sandbox has no network; each request rides a TCP tunnel that the guest agent opens to
127.0.0.1:<port> inside the sandbox. HTTP/1.1 framing on the tunnel is done with h11,
WebSocket framing with the sans-I/O protocol objects of `websockets`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import h11
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from websockets.client import ClientProtocol
from websockets.frames import Opcode
from websockets.protocol import State
from websockets.typing import Subprotocol
from websockets.uri import parse_uri

from aenv.channel import DATA, END, EOF, Item, Stream
from aenv.errors import AenvError, AgentTimeout
from aenv.node.orchestrator import Node

HOP_BY_HOP = {
    b"connection",
    b"keep-alive",
    b"proxy-authenticate",
    b"proxy-authorization",
    b"te",
    b"trailer",
    b"transfer-encoding",
    b"upgrade",
    b"content-length",
}
ROUTING = {b"e2b-sandbox-id", b"e2b-sandbox-port"}
WS_MAX_MESSAGE = 16 * 2**20  # a message from a sandbox port, whole (as uvicorn bounds the client's)


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
    try:
        first = await sb.link.within(stream.recv(), "tunnel.open")
    except AgentTimeout as exc:
        stream.cancel()
        body = {"sandboxId": sandbox_id, "message": exc.message, "code": 504}
        return JSONResponse(body, status_code=504, media_type="application/json; charset=utf-8")
    if first.kind == END:
        return port_closed(sandbox_id, port)
    return stream


async def proxy_http(request: Request, node: Node, sandbox_id: str, port: int) -> Response:
    tunnel = await open_tunnel(node, sandbox_id, port)
    if isinstance(tunnel, Response):
        return tunnel
    conn = h11.Connection(our_role=h11.CLIENT)
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    headers = [(k, v) for k, v in request.headers.raw if k.lower() not in HOP_BY_HOP | ROUTING]
    # The body is streamed through as it arrives, framed as the client framed it.
    length = request.headers.get("content-length")
    if length is not None:
        headers.append((b"content-length", length.encode()))
    elif "chunked" in request.headers.get("transfer-encoding", "").lower():
        headers.append((b"transfer-encoding", b"chunked"))
    headers.append((b"connection", b"close"))
    try:
        await tunnel.send_data(conn.send(h11.Request(method=request.method, target=target, headers=headers)) or b"")
        async for chunk in request.stream():
            if chunk:
                await tunnel.send_data(conn.send(h11.Data(data=chunk)) or b"")
        await tunnel.send_data(conn.send(h11.EndOfMessage()) or b"")
        response = await _read_head(conn, tunnel)
    except (h11.ProtocolError, ConnectionError) as exc:
        await tunnel.end()
        return JSONResponse({"code": 502, "message": f"bad response from port {port}: {exc}"}, status_code=502)
    if response is None:
        await tunnel.end()
        return port_closed(sandbox_id, port)
    streaming = StreamingResponse(_body(conn, tunnel), status_code=response.status_code)
    # Raw pairs keep repeated headers (Set-Cookie); h11 has already decoded any chunking, so a
    # length the port sent is still true for the body as passed on.
    streaming.raw_headers = [(k, v) for k, v in response.headers if k.lower() not in HOP_BY_HOP - {b"content-length"}]
    return streaming


async def proxy_websocket(scope: Any, receive: Any, send: Any, node: Node, sandbox_id: str, port: int) -> None:
    """Bridge a client WebSocket to a WebSocket server on a sandbox port.

    Both ends are terminated here: the upstream handshake is made first over the tunnel (with
    the client's headers and subprotocols), then the client is accepted with what the port
    agreed to, and messages, pings and close codes are relayed each way.
    """
    tunnel = await open_tunnel(node, sandbox_id, port)
    if isinstance(tunnel, Response):
        await _refuse_websocket(scope, send, tunnel)
        return
    path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
    query = (scope.get("query_string") or b"").decode("latin-1")
    uri = parse_uri(f"ws://127.0.0.1:{port}{path}" + (f"?{query}" if query else ""))
    offered = [Subprotocol(p) for p in scope.get("subprotocols", [])] or None  # [] would send an empty header
    upstream = ClientProtocol(uri, subprotocols=offered, max_size=WS_MAX_MESSAGE)
    handshake = upstream.connect()
    for key, value in scope["headers"]:
        name = key.decode("latin-1").lower()
        if name not in WS_OWN_HEADERS and key not in ROUTING:
            handshake.headers[name] = value.decode("latin-1")
    upstream.send_request(handshake)
    try:
        await _flush(upstream, tunnel)
        answer = await _upstream_handshake(upstream, tunnel)
    except ConnectionError:
        answer = None
    if answer is None or upstream.handshake_exc is not None:
        if not tunnel.remote_ended:
            await tunnel.end()
        refusal: Response = port_closed(sandbox_id, port)
        if answer is not None and answer.status_code != 101:  # the port refused the upgrade: pass that on
            refusal = Response(answer.body or b"", status_code=answer.status_code)
        elif answer is not None:  # it agreed, but to something the client did not ask for
            message = f"bad WebSocket handshake from port {port}: {upstream.handshake_exc}"
            refusal = JSONResponse({"code": 502, "message": message}, status_code=502)
        await _refuse_websocket(scope, send, refusal)
        return
    if (await receive())["type"] != "websocket.connect":
        await tunnel.end()
        return
    await send({"type": "websocket.accept", "subprotocol": answer.headers.get("Sec-WebSocket-Protocol")})
    to_port = asyncio.ensure_future(_client_to_port(receive, upstream, tunnel))
    try:
        await _port_to_client(send, upstream, tunnel)
    finally:
        to_port.cancel()
        if not tunnel.remote_ended:
            await tunnel.end()


WS_OWN_HEADERS = {
    "host",
    "connection",
    "upgrade",
    "sec-websocket-key",
    "sec-websocket-version",
    "sec-websocket-extensions",
    "sec-websocket-protocol",
    "sec-websocket-accept",
}


async def _refuse_websocket(scope: Any, send: Any, response: Response) -> None:
    """Answer a refused upgrade with an HTTP response where the server can send one."""
    if "websocket.http.response" in scope.get("extensions", {}):
        await send(
            {"type": "websocket.http.response.start", "status": response.status_code, "headers": response.raw_headers}
        )
        await send({"type": "websocket.http.response.body", "body": response.body})
    else:
        await send({"type": "websocket.close", "code": 1011})


async def _flush(upstream: ClientProtocol, tunnel: Stream) -> None:
    for data in upstream.data_to_send():
        if data:
            await tunnel.send_data(data)
        elif not tunnel.remote_ended:
            await tunnel.send_eof()  # the protocol asks for the TCP half-close


async def _feed(upstream: ClientProtocol, tunnel: Stream) -> Item:
    """Hand the next thing from the port to the protocol object (anything but data is the end)."""
    item = await tunnel.recv()
    if item.kind == DATA:
        upstream.receive_data(item.data)
    else:
        upstream.receive_eof()
    return item


async def _upstream_handshake(upstream: ClientProtocol, tunnel: Stream) -> Any:
    """The port's handshake response, or None if it closed without one."""
    while True:
        item = await _feed(upstream, tunnel)
        events = upstream.events_received()
        if events:
            return events[0]
        if item.kind != DATA:
            return None


async def _client_to_port(receive: Any, upstream: ClientProtocol, tunnel: Stream) -> None:
    while True:
        message = await receive()
        if message["type"] == "websocket.disconnect":
            if upstream.state is State.OPEN:
                upstream.send_close(message.get("code") or 1000, message.get("reason") or "")
                await _flush(upstream, tunnel)
            return
        if message.get("text") is not None:
            upstream.send_text(message["text"].encode())
        elif message.get("bytes") is not None:
            upstream.send_binary(message["bytes"])
        await _flush(upstream, tunnel)


async def _port_to_client(send: Any, upstream: ClientProtocol, tunnel: Stream) -> None:
    parts: list[bytes] = []
    text = False
    while True:
        item = await _feed(upstream, tunnel)
        for frame in upstream.events_received():
            if frame.opcode is Opcode.CLOSE:
                close = upstream.close_rcvd
                code, reason = (close.code, close.reason) if close else (1000, "")
                await send({"type": "websocket.close", "code": code, "reason": reason})
                continue
            if frame.opcode in (Opcode.TEXT, Opcode.BINARY):
                parts, text = [frame.data], frame.opcode is Opcode.TEXT
            elif frame.opcode is Opcode.CONT:
                parts.append(frame.data)
            else:
                continue  # pings are answered by the protocol object; pongs need nothing
            if frame.fin:
                data = b"".join(parts)
                await send({"type": "websocket.send", **({"text": data.decode()} if text else {"bytes": data})})
                parts = []
        await _flush(upstream, tunnel)
        if upstream.parser_exc is not None:  # a message too large or bad framing: we have closed on the port
            close = upstream.close_sent
            await send({"type": "websocket.close", "code": close.code if close else 1011})
            return
        if item.kind != DATA or upstream.state is State.CLOSED:
            if upstream.close_rcvd is None:
                await send({"type": "websocket.close", "code": 1011})  # the port went away without a close
            return


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
