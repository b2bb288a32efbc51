"""The sandbox port proxy: HTTP and WebSockets to any port a process in a sandbox listens on (get_host).

The sandbox has no network; each request rides a TCP tunnel that the guest agent opens to
127.0.0.1:<port> inside the sandbox. HTTP/1.1 framing on the tunnel is done with h11,
WebSocket framing with the sans-I/O protocol objects of `websockets`.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import h11
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Send
from websockets.client import ClientProtocol
from websockets.frames import EXTERNAL_CLOSE_CODES, Frame, Opcode
from websockets.http11 import Response as Handshake
from websockets.protocol import State
from websockets.typing import Subprotocol
from websockets.uri import parse_uri

from aenv.api.connections import as_sent, dated_by, refuse_websocket
from aenv.channel import DATA, END, EOF, Item, Stream
from aenv.errors import AenvError, AgentTimeout, ClusterUnavailable, RequestTimeout, error_body, error_headers, snippet
from aenv.node.service import NodeService, SandboxRecord

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
TRAFFIC_TOKEN_HEADER = "e2b-traffic-access-token"
# A gateway relaying an upgrade opens its own WebSocket to the node (Host: the node's address) and
# names the client's Host in this: what the port sees is what the client sent
CLIENT_HOST_HEADER = "aenv-client-host"
# Headers for the proxy, never passed on to the port: routing, and the traffic token (a credential
# of the proxy's, which E2B's proxy forwards; a port has no use for it).
ROUTING = {b"e2b-sandbox-id", b"e2b-sandbox-port", TRAFFIC_TOKEN_HEADER.encode(), CLIENT_HOST_HEADER.encode()}
PORT_PLACEHOLDER = "${PORT}"


def sandbox_gone(sandbox_id: str) -> JSONResponse:
    return JSONResponse(
        {"sandboxId": sandbox_id, "message": "The sandbox was not found", "code": 502},
        status_code=502,
        media_type="application/json; charset=utf-8",
    )


def sandbox_paused(
    sandbox_id: str, why: str = "", how: str = "", headers: dict[str, str] | None = None
) -> JSONResponse:
    """A paused sandbox that traffic does not resume: E2B's 502 "was not found" (the SDKs' cue for
    "not running"), saying it is paused and how to resume it, and ``state: paused`` for clients
    that tell the two apart (aenv's SDK)."""
    message = (
        f"The sandbox was not found running: it is paused{why}; resume it with a connect "
        f"(POST /sandboxes/{sandbox_id}/connect, the SDKs' connect or resume, aenv resume){how}"
    )
    body = {"sandboxId": sandbox_id, "message": message, "code": 502, "state": "paused", "canAutoResume": False}
    return JSONResponse(body, status_code=502, headers=headers, media_type="application/json; charset=utf-8")


def port_closed(sandbox_id: str, port: int) -> JSONResponse:
    return JSONResponse(
        {"sandboxId": sandbox_id, "message": "The sandbox is running but port is not open", "port": port, "code": 502},
        status_code=502,
        media_type="application/json; charset=utf-8",
    )


def _record(node: NodeService, sandbox_id: str) -> SandboxRecord | None:
    try:
        return node.get(sandbox_id).rec
    except AenvError:
        return None  # the tunnel's answer says so


def traffic_refusal(
    node: NodeService, rec: SandboxRecord | None, headers: list[tuple[bytes, bytes]]
) -> JSONResponse | None:
    """E2B's 403 when a sandbox created without public traffic is asked without its traffic token
    (its first ``e2b-traffic-access-token`` header, as Go's Header.Get), or with another. Decided on
    the record, before anything resumes the sandbox: a caller without the token cannot wake it."""
    if rec is None or rec.public_traffic:
        return None
    given = next((v for k, v in headers if k.lower() == TRAFFIC_TOKEN_HEADER.encode()), b"")
    secured = "Sandbox is secured with traffic access token."
    if not given:
        message = f"{secured} Token header '{TRAFFIC_TOKEN_HEADER}' is missing"
    elif not hmac.compare_digest(given, node.traffic_token(rec.id).encode()):
        message = f"{secured} Provided token in header '{TRAFFIC_TOKEN_HEADER}' is invalid"
    else:
        return None
    return JSONResponse(
        {"sandboxId": rec.id, "message": message, "code": 403},
        status_code=403,
        media_type="application/json; charset=utf-8",
    )


def masked_host(rec: SandboxRecord | None, port: int) -> str | None:
    """The Host the port sees when the sandbox was created with ``maskRequestHost`` (its
    ``${PORT}`` made the port's number), as E2B's proxy rewrites it; None to pass the client's on."""
    if rec is None or not rec.mask_request_host:
        return None
    return rec.mask_request_host.replace(PORT_PLACEHOLDER, str(port))


def _host_headers(headers: list[tuple[bytes, bytes]], mask: str | None) -> list[tuple[bytes, bytes]]:
    """The client's headers with the masked Host, and the client's Host as X-Forwarded-Host (named
    as E2B's proxy names them: ports that read the raw request see `Host:`)."""
    if mask is None:
        return headers
    original = next((v for k, v in headers if k.lower() == b"host"), b"")
    kept = [(k, v) for k, v in headers if k.lower() not in (b"host", b"x-forwarded-host")]
    return [(b"Host", mask.encode()), *kept, *([(b"X-Forwarded-Host", original)] if original else [])]


def not_woken(sandbox_id: str, exc: AenvError) -> JSONResponse:
    """The answer to traffic for a sandbox that is not running and was not woken: 503
    ``cluster_unavailable`` where the cluster must say first (a gateway sends it again once the
    sandbox is where it can run), else the 502 E2B's SDKs understand."""
    if isinstance(exc, ClusterUnavailable):
        return JSONResponse(error_body(exc), status_code=exc.status, headers=error_headers(exc))
    return sandbox_gone(sandbox_id)


async def open_tunnel(node: NodeService, sandbox_id: str, port: int, *, exchange: bool = False) -> Stream | Response:
    """A tunnel stream to the port, or the answer E2B's SDKs understand. An ``exchange`` (one
    HTTP request) is waited for by a pause that starts from the moment the sandbox was found
    running, for a while (``LiveSandbox.exchanges``)."""
    try:
        sb = await node.ensure_running(sandbox_id)
    except AenvError as exc:
        return not_woken(sandbox_id, exc)
    assert sb.link is not None
    if exchange:
        sb.opening += 1  # no await since it was found running: a pause from now on waits for it
    try:
        try:
            stream = await sb.link.open("tunnel.open", {"port": port})
        except AenvError:
            return sandbox_gone(sandbox_id)
        if exchange:
            sb.exchanges.add(stream)
        try:
            first = await sb.link.within(stream.recv(), "tunnel.open")
        except AgentTimeout as exc:
            stream.cancel()
            body = {"sandboxId": sandbox_id, "message": exc.message, "code": 504}
            return JSONResponse(body, status_code=504, media_type="application/json; charset=utf-8")
    finally:
        if exchange:
            sb.opening -= 1
    if first.kind == END:
        return port_closed(sandbox_id, port)
    return stream


async def proxy_http(request: Request, node: NodeService, sandbox_id: str, port: int) -> Response:
    rec = _record(node, sandbox_id)
    refusal = traffic_refusal(node, rec, request.headers.raw)
    if refusal is not None:
        return refusal
    tunnel = await open_tunnel(node, sandbox_id, port, exchange=True)
    if isinstance(tunnel, Response):
        return tunnel
    patience = node.settings.port_response_timeout
    # h11 bounds what it buffers of an incomplete response head (16 KiB): a longer head is an error.
    conn = h11.Connection(our_role=h11.CLIENT)
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    # Header names as the client wrote them (h11 sends names as given): the port sees the request as sent.
    client_headers = [(k, v) for k, v in as_sent(request.scope) if k.lower() not in HOP_BY_HOP | ROUTING]
    headers = _host_headers(client_headers, masked_host(rec, port))
    # The body is streamed through as it arrives, framed as the client framed it.
    length = request.headers.get("content-length")
    if length is not None:
        headers.append((b"Content-Length", length.encode()))
    elif "chunked" in request.headers.get("transfer-encoding", "").lower():
        headers.append((b"Transfer-Encoding", b"chunked"))
    headers.append((b"Connection", b"close"))
    head = h11.Request(method=request.method, target=target, headers=headers)
    try:
        response = await _exchange(request, conn, tunnel, head, patience)
    except BaseException as exc:
        # Whatever ended the exchange (the port, the client leaving, a cancellation), the tunnel goes
        # with it: nothing on the host or in the sandbox waits for it any more.
        if not tunnel.remote_ended:
            await tunnel.end()
        if isinstance(exc, RequestTimeout):  # the client's body stopped coming, not the port
            return JSONResponse(error_body(exc), status_code=exc.status)
        if isinstance(exc, TimeoutError):
            message = f"port {port} did not take the request or answer it within {patience:g}s"
            return JSONResponse({"code": 504, "message": message}, status_code=504)
        if isinstance(exc, h11.ProtocolError | ConnectionError):
            message = f"bad response from port {port}: {snippet(str(exc))}"
            return JSONResponse({"code": 502, "message": message}, status_code=502)
        if isinstance(exc, ClientDisconnect):
            return Response(status_code=499)  # nobody reads it
        raise
    if response is None:
        await tunnel.end()
        return port_closed(sandbox_id, port)
    streaming = StreamingResponse(_body(conn, tunnel), status_code=response.status_code)
    # Raw pairs keep repeated headers (Set-Cookie); h11 has already decoded any chunking, so a
    # length the port sent is still true for the body as passed on.
    streaming.raw_headers = [(k, v) for k, v in response.headers if k.lower() not in HOP_BY_HOP - {b"content-length"}]
    return streaming


async def _exchange(
    request: Request, conn: h11.Connection, tunnel: Stream, head: h11.Request, patience: float
) -> h11.Response | None:
    """Send the request to the port and read the head of its answer. Every step must move within
    ``patience`` seconds (a port that stops reading, or never answers, times out), and the
    answer is awaited only while the client is still there."""
    await _to_port(tunnel, conn.send(head), patience)
    async for chunk in request.stream():  # ClientDisconnect if the client leaves meanwhile
        if chunk:
            await _to_port(tunnel, conn.send(h11.Data(data=chunk)), patience)
    await _to_port(tunnel, conn.send(h11.EndOfMessage()), patience)
    return await _unless_client_leaves(request.receive, asyncio.wait_for(_read_head(conn, tunnel), patience))


async def _to_port(tunnel: Stream, data: bytes | None, patience: float) -> None:
    if data:
        await asyncio.wait_for(tunnel.send_data(data), patience)


T = TypeVar("T")


async def _unless_client_leaves(receive: Receive, work: Awaitable[T]) -> T:
    """``work``'s result, or ClientDisconnect as soon as the client is gone (then ``work`` is cancelled).
    Only for when the request's own messages have all been read: this reads the next one."""
    task = asyncio.ensure_future(work)
    left = asyncio.ensure_future(_disconnected(receive))
    try:
        done, _ = await asyncio.wait({task, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, left):
            pending.cancel()
    if task in done:
        return task.result()
    raise ClientDisconnect()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] not in ("http.disconnect", "websocket.disconnect"):
        pass


async def proxy_websocket(scope: Any, receive: Any, send: Any, node: NodeService, sandbox_id: str, port: int) -> None:
    """Bridge a client WebSocket to a WebSocket server on a sandbox port.

    Both ends are terminated here: the upstream handshake is made first over the tunnel (with
    the client's headers and subprotocols), then the client is accepted with what the port
    agreed to, and messages, pings and close codes are relayed each way. A message larger than
    ``port_ws_max_message_mb`` closes both sides with 1009 (uvicorn bounds the client's side).
    """
    if (await receive())["type"] != "websocket.connect":
        return
    rec = _record(node, sandbox_id)
    denied = traffic_refusal(node, rec, scope["headers"])
    if denied is not None:
        await refuse_websocket(scope, send, denied)
        return
    tunnel = await open_tunnel(node, sandbox_id, port)
    if isinstance(tunnel, Response):
        await refuse_websocket(scope, send, tunnel)
        return
    patience = node.settings.port_response_timeout
    path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
    query = (scope.get("query_string") or b"").decode("latin-1")
    uri = parse_uri(f"ws://127.0.0.1:{port}{path}" + (f"?{query}" if query else ""))
    offered = [Subprotocol(p) for p in scope.get("subprotocols", [])] or None  # [] would send an empty header
    upstream = ClientProtocol(uri, subprotocols=offered, max_size=node.settings.port_ws_max_message_mb * 2**20)
    handshake = upstream.connect()
    mask = masked_host(rec, port)
    own = WS_OWN_HEADERS | ({"x-forwarded-host"} if mask is not None else set())
    for key, value in as_sent(scope):  # names as the client wrote them
        name = key.decode("latin-1")
        if name.lower() not in own and key.lower() not in ROUTING:
            handshake.headers[name] = value.decode("latin-1")
    # In place of the protocol object's own Host (127.0.0.1:<port>): the client's, as an HTTP
    # request's is passed on, or the sandbox's mask of it
    hosts: dict[bytes, bytes] = {k: v for k, v in scope["headers"] if k in (b"host", CLIENT_HOST_HEADER.encode())}
    original = hosts.get(CLIENT_HOST_HEADER.encode(), hosts.get(b"host", b""))
    if mask is not None or original:
        del handshake.headers["Host"]
        handshake.headers["Host"] = mask if mask is not None else original.decode("latin-1")
    if mask is not None and original:
        handshake.headers["X-Forwarded-Host"] = original.decode("latin-1")
    upstream.send_request(handshake)
    bridge = _Bridge(send, upstream, tunnel, patience)
    try:
        await bridge.flush()
        handshake_answer = asyncio.wait_for(_upstream_handshake(upstream, tunnel, bridge), patience)
        answer = await _unless_client_leaves(receive, handshake_answer)
    except ConnectionError:
        answer = None
    except BaseException as exc:
        await bridge.release()
        if isinstance(exc, TimeoutError):
            message = f"port {port} did not answer the WebSocket handshake within {patience:g}s"
            await refuse_websocket(scope, send, JSONResponse({"code": 504, "message": message}, status_code=504))
            return
        if isinstance(exc, ClientDisconnect):
            return
        raise
    if answer is None or upstream.handshake_exc is not None:
        await bridge.release()
        refusal: Response = port_closed(sandbox_id, port)
        if answer is not None and answer.status_code != 101:  # the port refused the upgrade: pass that on
            kept = {k: v for k, v in answer.headers.raw_items() if k.lower() == "content-type"}
            refusal = Response(bytes(answer.body or b""), status_code=answer.status_code, headers=kept)
        elif answer is not None:  # it agreed, but to something the client did not ask for
            message = f"bad WebSocket handshake from port {port}: {snippet(str(upstream.handshake_exc))}"
            refusal = JSONResponse({"code": 502, "message": message}, status_code=502)
        await refuse_websocket(scope, send, refusal)
        return
    subprotocol = answer.headers.get("Sec-WebSocket-Protocol")
    dated = dated_by(answer.headers.raw_items())  # the port's Date and Server, as for an HTTP answer
    await send({"type": "websocket.accept", "subprotocol": subprotocol, "headers": dated})
    await bridge.run(receive)


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


async def _feed(upstream: ClientProtocol, tunnel: Stream) -> Item:
    """Hand the next thing from the port to the protocol object (anything but data is the end)."""
    item = await tunnel.recv()
    if item.kind == DATA:
        upstream.receive_data(item.data)
    else:
        upstream.receive_eof()
    return item


async def _upstream_handshake(upstream: ClientProtocol, tunnel: Stream, bridge: _Bridge) -> Handshake | None:
    """The port's handshake response, or None if it closed without one. Frames the port sent in
    the same read as its 101 (a greeting right after the upgrade) are the bridge's first."""
    while True:
        item = await _feed(upstream, tunnel)
        events = upstream.events_received()
        if events:
            # a client's parser makes the response its first event
            bridge.early = [e for e in events[1:] if isinstance(e, Frame)]
            return events[0] if isinstance(events[0], Handshake) else None
        if item.kind != DATA:
            return None


class _Bridge:
    """An accepted client WebSocket and the port's, relayed both ways until either side ends."""

    CLOSE_TIMEOUT = 10.0  # how long the port has to answer a close the client started

    def __init__(self, send: Send, upstream: ClientProtocol, tunnel: Stream, patience: float) -> None:
        self.send = send
        self.upstream = upstream
        self.tunnel = tunnel
        self.patience = patience
        self.client_closed = False
        self.early: list[Frame] = []  # frames that came with the port's handshake

    async def flush(self) -> None:
        """Send what the protocol object has for the port; a port that takes nothing for
        ``patience`` seconds times out (the channel's credit holds the rest back)."""
        for data in self.upstream.data_to_send():
            if data:
                await asyncio.wait_for(self.tunnel.send_data(data), self.patience)
            elif not self.tunnel.remote_ended:
                await self.tunnel.send_eof()  # the protocol asks for the TCP half-close

    async def release(self) -> None:
        if not self.tunnel.remote_ended:
            await self.tunnel.end()

    async def close_client(self, code: int, reason: str = "") -> None:
        if not self.client_closed:
            self.client_closed = True
            try:
                await self.send({"type": "websocket.close", "code": code, "reason": reason})
            except OSError:
                pass  # the client is already gone

    async def run(self, receive: Receive) -> None:
        to_port = asyncio.ensure_future(self._client_to_port(receive))
        to_client = asyncio.ensure_future(self._port_to_client())
        try:
            await asyncio.wait({to_port, to_client}, return_when=asyncio.FIRST_COMPLETED)
            if to_port.done() and isinstance(to_port.exception(), TimeoutError):
                await self.close_client(1011, "the sandbox's port stopped reading")
            elif to_port.done():
                # The client left (its close went to the port) or the port's end went away: what
                # the port still sends has a moment to arrive, and no more.
                await asyncio.wait({to_client}, timeout=self.CLOSE_TIMEOUT)
        finally:
            for task in (to_port, to_client):
                task.cancel()
                if task.done() and not task.cancelled():
                    task.exception()  # a gone port or client just ends the relay
            await self.release()

    async def _client_to_port(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                # 1009 when the client's message was too big for uvicorn's ws_max_size; a client that
                # vanished (1005, 1006: codes no frame may carry) is "going away" to the port.
                code = message.get("code") or 1000
                if code not in EXTERNAL_CLOSE_CODES and not 3000 <= code < 5000:
                    code = 1001
                if self.upstream.state is State.OPEN:
                    self.upstream.send_close(code, message.get("reason") or "")
                    await self.flush()
                return
            if message.get("text") is not None:
                self.upstream.send_text(message["text"].encode())
            elif message.get("bytes") is not None:
                self.upstream.send_binary(message["bytes"])
            await self.flush()

    async def _port_to_client(self) -> None:
        upstream = self.upstream
        # bounded: the protocol object refuses a message past its max_size
        parts: list[bytes | bytearray | memoryview] = []
        text = False
        early, self.early = self.early, []
        while True:
            item: Item | None = None
            if early:
                events: list[object] = list(early)
                early = []
            else:
                item = await _feed(upstream, self.tunnel)
                events = list(upstream.events_received())
            for frame in events:
                if not isinstance(frame, Frame):
                    continue  # after the handshake a client receives only frames
                if frame.opcode is Opcode.CLOSE:
                    close = upstream.close_rcvd
                    await self.close_client(*((close.code, close.reason) if close else (1000, "")))
                    continue
                if frame.opcode in (Opcode.TEXT, Opcode.BINARY):
                    parts, text = [frame.data], frame.opcode is Opcode.TEXT
                elif frame.opcode is Opcode.CONT:
                    parts.append(frame.data)
                else:
                    continue  # pings are answered by the protocol object; pongs need nothing
                if frame.fin:
                    data = b"".join(parts)
                    await self.send(
                        {"type": "websocket.send", **({"text": data.decode()} if text else {"bytes": data})}
                    )
                    parts = []
            await self.flush()
            if upstream.parser_exc is not None:
                # The port broke the protocol: a message past the bound (1009), bad framing (1002),
                # bad UTF-8 (1007). Its close is sent; the client gets the same code, and the port
                # no longer matters.
                failed = upstream.close_sent
                await self.close_client(*((failed.code, failed.reason) if failed else (1011, "")))
                return
            if (item is not None and item.kind != DATA) or upstream.state is State.CLOSED:
                if upstream.close_rcvd is None:
                    await self.close_client(1011)  # the port went away without a close
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
            # Shielded: when the client leaves, Starlette cancels this body, and the END must
            # still reach the agent, or its relay threads would wait on the port for good.
            await asyncio.shield(tunnel.end())
