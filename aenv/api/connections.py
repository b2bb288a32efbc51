"""The node's and gateway's HTTP/1.1 connections: uvicorn's httptools protocol, plus what uvicorn has not.

- Bounds on each request head. A client that sent half a head, or a byte now and then, kept
  its connection and a file descriptor for as long as it liked, without an API key (enough of them
  leave the node without descriptors): a head has a deadline, from a connection's start (a client
  connects to send a request) and from the first byte of each later head; an idle kept-alive
  connection between requests is bounded by uvicorn's keep-alive timeout instead, which clients'
  pools rely on. A head is bounded in bytes and in header lines while it arrives (httptools buffers
  a header, and uvicorn the URL and every header, until the head is complete: one connection
  grew a node by 900 MB with header lines): past either, 431 and the connection is closed.
- Bounds on the connections waiting for a head, per client address and in all, and on those idle
  between requests: a flood of half-sent heads (thousands per client) closes the flood's own
  oldest connections, so a new one (a health check from the same address) is still served.
- The header names as the client wrote them (uvicorn lowercases the scope's), for the port proxy
  and the gateway to pass on: a sandbox's server sees the request as it was sent.
- One ``date`` and one ``server`` header per answer: uvicorn's are added only where the app's
  answer (a sandbox's server's, relayed) has none.
- The connection a request came on, so that an answer can be dropped as a reset. E2B's edge speaks
  HTTP/2 and drops the stream of a sandbox that went away with a stream reset; the SDKs take a
  reset (a read error), not a body that merely stops, as "the connection was lost" and then ask
  the sandbox's health. Over HTTP/1.1 the closest is a TCP reset of the connection.
"""

from __future__ import annotations

import asyncio
import contextvars
import fcntl
import json
import logging
import resource
import socket
import ssl
import struct
import termios
import time
from collections.abc import Iterable
from dataclasses import dataclass
from email.utils import formatdate
from pathlib import Path
from typing import ClassVar

import httptools
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from aenv.config import Settings
from aenv.errors import InvalidRequest

log = logging.getLogger("aenv.http")

_TRANSPORT: contextvars.ContextVar[asyncio.Transport | None] = contextvars.ContextVar(
    "aenv_client_transport", default=None
)


# Feeding the parser at most this much of a head at a time: a head is counted to within these bytes
# when it shares a read with the end of the request before it (pipelining).
HEAD_STEP = 4096
HEADER_NAMES = "aenv.header_names"  # scope["extensions"]: lowercased name -> the name as sent
# A connection that has sent nothing is not closed for a bound on waiting connections for this
# long (its client may be busy opening thousands), unless they number HARD_FACTOR times the bound.
SILENT_GRACE = 10.0
HARD_FACTOR = 4
# A connection whose last bytes came this recently is working (a head arriving in pieces, a request
# on a kept-alive connection): never closed for a bound.
STALL = 1.0
SWEEP_EVERY = 0.5  # seconds between two thinnings of waiting connections past their bound
LINGER = 1.0  # seconds a refused connection is still read from (and what comes dropped) before it is closed


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """What a client's connections may hold before a request reaches the app (AENV_HTTP_*)."""

    head_timeout: float = 30.0  # seconds to send a request's head, from the connection or the head's first byte
    max_head_bytes: int = 64 * 1024  # request line and header lines together
    max_headers: int = 256  # header lines (a chunked body's trailer lines count too)
    max_pending: int = 1024  # connections waiting for a head, in all ...
    max_pending_per_ip: int = 256  # ... and from one client address
    max_idle: int = 4096  # kept-alive connections idle between requests

    @classmethod
    def of(cls, settings: Settings) -> HttpLimits:
        return cls(
            head_timeout=settings.http_head_timeout,
            max_head_bytes=settings.http_max_head_kb * 1024,
            max_headers=settings.http_max_headers,
            max_pending=settings.http_max_pending,
            max_pending_per_ip=settings.http_max_pending_per_ip,
            max_idle=settings.http_max_idle,
        )


class _TooLarge(InvalidRequest):
    """Raised in a parser callback: the head (or a body's trailers) went past a bound."""


class _Waiting:
    """Connections waiting for a request's head: those that have sent nothing yet, oldest first
    (dicts keep insertion order), and those with a head begun, the longest quiet first (moved to the
    end as bytes come)."""

    def __init__(self) -> None:
        self.silent: dict[NodeHTTPProtocol, float] = {}
        self.heard: dict[NodeHTTPProtocol, None] = {}

    def __len__(self) -> int:
        return len(self.silent) + len(self.heard)

    def add(self, conn: NodeHTTPProtocol, now: float) -> None:
        if conn.spoke_at is None:
            self.silent[conn] = now
        else:
            self.heard[conn] = None

    def spoke(self, conn: NodeHTTPProtocol) -> None:
        if conn in self.silent:
            del self.silent[conn]
        elif conn in self.heard:
            del self.heard[conn]  # to the end: quiet for the shortest time
        else:
            return
        self.heard[conn] = None

    def remove(self, conn: NodeHTTPProtocol) -> None:
        if self.silent.pop(conn, None) is None:
            self.heard.pop(conn, None)


class ConnectionGate:
    """One server's connections that wait for a request's head, and those idle between requests.

    Past a bound the gate closes connections of the address that holds the most (past an address's
    own bound, that address's own), never one that is working: a connection that sent bytes within
    STALL seconds, or has bytes unread in its socket, is about to be served (a kept-alive client's
    next request, a gateway's pooled connection). Of an address's connections those quiet longest go
    first: heads begun and stalled, then connections that have sent nothing. These may be a client
    opening thousands at once (6000 at once from one client lost 96% to a 2 s grace) and are spared
    for SILENT_GRACE, unless the connections waiting number HARD_FACTOR times their bound (or half
    the process's file descriptors). A flood from one address or many thus costs the flood, and a
    client elsewhere is served throughout."""

    def __init__(self, limits: HttpLimits) -> None:
        self.limits = limits
        self.pending: dict[str, _Waiting] = {}  # by client address
        self.pending_count = 0
        self.idle: dict[str, dict[NodeHTTPProtocol, None]] = {}  # by client address, longest idle first
        self.idle_count = 0
        self._sweep: asyncio.TimerHandle | None = None

    def waiting(self, conn: NodeHTTPProtocol) -> None:
        now = conn.loop.time()
        mine = self.pending.setdefault(conn.peer, _Waiting())
        mine.add(conn, now)
        self.pending_count += 1
        over = self._shed(mine, self.limits.max_pending_per_ip, now, most=2)
        over |= self._shed_heaviest(now, most=2)
        if over and self._sweep is None:
            self._sweep = conn.loop.call_later(SWEEP_EVERY, self._sweep_over, conn.loop)

    def spoke(self, conn: NodeHTTPProtocol) -> None:
        """Bytes came on ``conn`` (while it waits for a head: it is quiet since now)."""
        mine = self.pending.get(conn.peer)
        if mine is not None:
            mine.spoke(conn)

    def arrived(self, conn: NodeHTTPProtocol) -> None:
        mine = self.pending.get(conn.peer)
        if mine is None:
            return
        before = len(mine)
        mine.remove(conn)
        self.pending_count -= before - len(mine)
        if not mine:
            del self.pending[conn.peer]

    def resting(self, conn: NodeHTTPProtocol) -> None:
        self.idle.setdefault(conn.peer, {})[conn] = None
        self.idle_count += 1
        if self.idle_count > self.limits.max_idle:
            heaviest = max(self.idle.values(), key=len)  # the longest idle of the address idling most
            victim = next((c for c in heaviest if c is not conn and c.stalled()), None)
            if victim is not None:
                self.woke(victim)
                victim.transport.close()

    def woke(self, conn: NodeHTTPProtocol) -> None:
        mine = self.idle.get(conn.peer)
        if mine is not None and conn in mine:
            del mine[conn]
            self.idle_count -= 1
            if not mine:
                del self.idle[conn.peer]

    def _sweep_over(self, loop: asyncio.AbstractEventLoop) -> None:
        """Thin out the groups still past their bound (a flood that stopped: no newcomer thins it)."""
        self._sweep = None
        now, over = loop.time(), False
        for mine in list(self.pending.values()):
            over |= self._shed(mine, self.limits.max_pending_per_ip, now)
        over |= self._shed_heaviest(now)
        if over:
            self._sweep = loop.call_later(SWEEP_EVERY, self._sweep_over, loop)

    def _shed_heaviest(self, now: float, most: int | None = None) -> bool:
        """Bring all waiting connections down to their bound (or by ``most``), from the addresses
        that hold the most: whether they are still past it."""
        excess = self.pending_count - self.limits.max_pending
        if excess <= 0:
            return False
        goal = excess if most is None else min(excess, most)
        tried: set[str] = set()
        while goal > 0 and len(tried) < len(self.pending):
            peer, mine = max(((p, w) for p, w in self.pending.items() if p not in tried), key=lambda pw: len(pw[1]))
            tried.add(peer)
            goal -= self._close(self._victims(mine, now, goal))
        return self.pending_count > self.limits.max_pending

    def _shed(self, mine: _Waiting, bound: int, now: float, most: int | None = None) -> bool:
        """Bring one address's waiting connections down to ``bound`` (or by ``most``)."""
        excess = len(mine) - bound
        if excess <= 0:
            return False
        self._close(self._victims(mine, now, excess if most is None else min(excess, most)))
        return len(mine) > bound

    def _victims(self, mine: _Waiting, now: float, goal: int) -> list[NodeHTTPProtocol]:
        """Up to ``goal`` of one address's waiting connections that may go, quiet longest first."""
        out: list[NodeHTTPProtocol] = []
        for conn in mine.heard:  # heads begun, the longest quiet first
            if len(out) == goal or conn.spoke_at is None or now - conn.spoke_at < STALL:
                break
            if not conn.receiving and conn.stalled():
                out.append(conn)
        descriptors = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        hard = min(HARD_FACTOR * self.limits.max_pending, descriptors // 2)
        pressed = self.pending_count - len(out) - hard  # past it, silent ones go whatever their age
        for conn, since in mine.silent.items():  # then those that sent nothing, oldest first
            if len(out) == goal or (pressed <= 0 and now - since < SILENT_GRACE):
                break
            if conn.stalled():
                out.append(conn)
                pressed -= 1
        return out

    def _close(self, victims: list[NodeHTTPProtocol]) -> int:
        for conn in victims:
            self.arrived(conn)
            conn.transport.close()
        return len(victims)


class NodeHTTPProtocol(HttpToolsProtocol):
    transport: asyncio.Transport
    limits: ClassVar[HttpLimits] = HttpLimits()
    gate: ClassVar[ConnectionGate] = ConnectionGate(limits)
    peer = ""  # the client's address
    spoke_at: float | None = None  # when bytes last came on this connection (None: never)
    receiving = False  # its bytes are being parsed now (a head that just came whole is never shed)
    _head_timer: asyncio.TimerHandle | None = None
    # Bytes given to the parser that it or uvicorn may be holding: the head's so far, or a body's
    # framing (chunk lines, trailers) since its last data.
    _held = 0
    _fields = 0  # header lines of the current request
    _in_body = False
    _refusal: bytes | None = None  # the answer to a head past a bound, once the answers before it are out
    _cased: dict[bytes, bytes] | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.peer = self.client[0] if self.client else ""
        self._await_head()

    def data_received(self, data: bytes) -> None:
        # A request's task copies the context it was created in, which is inside this call.
        token = _TRANSPORT.set(self.transport)
        self.spoke_at = self.loop.time()
        self.receiving = True
        self.gate.spoke(self)
        try:
            if not self._dropping():
                self.gate.woke(self)
                self._unset_keepalive_if_required()
            self._take(memoryview(data))
        finally:
            self.receiving = False
            _TRANSPORT.reset(token)

    def _take(self, data: memoryview) -> None:
        """Give ``data`` to the parser in pieces no larger than the room left under the head bound."""
        while data:
            if self._refusal is not None or self.transport.is_closing() or self.transport.get_protocol() is not self:
                return  # refused, closing, or upgraded to a WebSocket
            room = self.limits.max_head_bytes - self._held
            if room <= 0:
                self._refuse(431, self._too_large_message())
                return
            step = room if self._in_body else min(room, HEAD_STEP)
            piece, data = data[:step], data[step:]
            self._held += len(piece)
            try:
                self.parser.feed_data(piece)
            except httptools.HttpParserUpgrade:
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                else:
                    self._unsupported_upgrade_warning()
                return  # what follows an upgrade's head is not read (as uvicorn does)
            except httptools.HttpParserError as exc:
                if isinstance(exc.__context__, _TooLarge):
                    self._refuse(431, str(exc.__context__))
                else:
                    self._refuse(400, "Invalid HTTP request received.")
                return

    def _dropping(self) -> bool:
        """Whether what arrives is the rest of a body whose request has been answered (and is
        dropped): the connection stays idle, under the keep-alive timeout and AENV_HTTP_MAX_IDLE
        (a byte of it now and then, stopping the timer, held a connection for good)."""
        return self._in_body and self.cycle is not None and self.cycle.response_complete

    def _too_large_message(self) -> str:
        if self._in_body:
            return f"the body's trailers are larger than {self.limits.max_head_bytes} bytes"
        return f"the request's head is larger than {self.limits.max_head_bytes} bytes"

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, msg)

    def handle_websocket_upgrade(self) -> None:
        cased = self._cased
        super().handle_websocket_upgrade()
        # uvicorn's WebSocket protocol (websockets' sans-I/O one) made the upgrade's scope from the
        # head just handed to it, whose names are lowercased; the app's task has not run yet
        scope = getattr(self.transport.get_protocol(), "scope", None)
        if cased and isinstance(scope, dict) and scope.get("type") == "websocket":
            scope.setdefault("extensions", {})[HEADER_NAMES] = cased

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` with a JSON error and close: at once if no answer of this connection is
        under way, else after the answers to the requests before this one."""
        self._head_in()
        self._refusal = answer = error_answer(status, message)  # nothing more is read
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if not self._in_body:
                return  # a new head, after requests still being answered (pipelined): after them
            if self.pipeline or cycle.response_started:
                self.transport.close()  # this request's answer is under way, or queued: no room for another
                return
            cycle.disconnected = True  # the app's answer to this request goes nowhere
        self._answer_and_close(answer)

    def _answer_and_close(self, answer: bytes) -> None:
        """Send ``answer`` and close, reading (and dropping) what the client still sends for a
        moment: closing with unread bytes resets the connection, and the client may lose the answer."""
        self.transport.write(answer)
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(LINGER, self.transport.close)
        else:
            self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self._refusal is not None:
            if not self.pipeline and (self.cycle is None or self.cycle.response_complete):
                self._unset_keepalive_if_required()
                self._answer_and_close(self._refusal)
        elif self.timeout_keep_alive_task is not None:
            self.gate.resting(self)  # idle until its next request

    # Parser callbacks
    def on_message_begin(self) -> None:
        self.gate.woke(self)  # a new request: no longer idle (a dropped body's end came with it)
        self._unset_keepalive_if_required()
        super().on_message_begin()
        self._fields = 0
        self._cased = None
        if self._head_timer is None:
            self._await_head()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields += 1
        if self._fields > self.limits.max_headers:
            raise _TooLarge(f"the request has more than {self.limits.max_headers} header lines")
        lower = name.lower()
        if lower != name:
            if self._cased is None:
                self._cased = {}
            self._cased.setdefault(lower, name)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_in()  # what follows (the body) is the route's to bound
        self._in_body = True
        self._held = 0
        if self._cased:
            extensions: dict[str, object] = self.scope.setdefault("extensions", {})  # type: ignore[assignment]
            extensions[HEADER_NAMES] = self._cased
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._held = 0
        super().on_body(body)

    def on_chunk_header(self) -> None:
        self._held = 0

    def on_chunk_complete(self) -> None:
        self._held = 0

    def on_message_complete(self) -> None:
        self._in_body = False
        self._held = 0
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_in()
        self.gate.woke(self)
        super().connection_lost(exc)

    def stalled(self) -> bool:
        """Nothing of this connection waits unread in its socket (a flood's half-sent head has been read)."""
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            return True
        try:
            unread = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
        except OSError:
            return True
        return bool(struct.unpack("i", unread)[0] == 0)

    def _await_head(self) -> None:
        self._head_in()
        self._head_timer = self.loop.call_later(self.limits.head_timeout, self.transport.close)
        self.gate.waiting(self)

    def _head_in(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
            self.gate.arrived(self)


def protocol_with(limits: HttpLimits) -> type[NodeHTTPProtocol]:
    """The protocol class given to uvicorn: this server's bounds, and its own gate."""
    return type("NodeHTTPProtocol", (NodeHTTPProtocol,), {"limits": limits, "gate": ConnectionGate(limits)})


def error_answer(status: int, message: str) -> bytes:
    """A whole HTTP answer with a JSON error, that closes the connection."""
    body = json.dumps({"code": status, "message": message}).encode()
    head = [STATUS_LINE[status], b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body)]
    head += [b"%s: %s\r\n" % pair for pair in _own_headers()]
    return b"".join([*head, b"connection: close\r\n\r\n", body])


_date: tuple[int, bytes] = (0, b"")
JSON_HEAD = [(b"content-type", b"application/json")]


def _own_headers() -> list[tuple[bytes, bytes]]:
    global _date
    now = int(time.time())
    if _date[0] != now:
        _date = (now, formatdate(now, usegmt=True).encode())
    return [(b"date", _date[1]), (b"server", b"uvicorn")]


class OwnHeaders:
    """Adds ``date`` and ``server`` to an answer that has none of its own. Given to uvicorn with its
    own turned off: it added both to every answer, and a sandbox's server's answer, relayed, then
    had two of each."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return

        answered = False

        async def with_own(message: Message) -> None:
            nonlocal answered
            kind = message["type"]
            if kind == "websocket.close" and not answered and "websocket.http.response" in scope.get("extensions", {}):
                # refused before any answer: JSON as every refusal, not uvicorn's empty 403
                body = json.dumps({"code": 403, "message": "the WebSocket was refused"}).encode()
                await send_headed({"type": "websocket.http.response.start", "status": 403, "headers": JSON_HEAD})
                await send({"type": "websocket.http.response.body", "body": body})
                return
            if kind in ("http.response.start", "websocket.http.response.start", "websocket.accept"):
                answered = True
                await send_headed(message)
                return
            await send(message)

        async def send_headed(message: Message) -> None:
            headers = list(message.get("headers", []))
            names = {name.lower() for name, _ in headers}
            headers += [(name, value) for name, value in _own_headers() if name not in names]
            await send({**message, "headers": headers})

        await self.app(scope, receive, with_own)


def dated_by(headers: Iterable[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    """The first Date and Server of an upstream's accepted upgrade (a port's 101, or a node's),
    for the client's: OwnHeaders adds the server's own only where these are missing."""
    kept: dict[bytes, bytes] = {}
    for name, value in headers:
        if name.lower() in ("date", "server"):
            kept.setdefault(name.lower().encode("latin-1"), value.encode("latin-1"))
    return list(kept.items())


def as_sent(scope: Scope) -> list[tuple[bytes, bytes]]:
    """A request's headers with their names as the client wrote them (the scope's are lowercased)."""
    cased: dict[bytes, bytes] | None = scope.get("extensions", {}).get(HEADER_NAMES)
    if not cased:
        return list(scope["headers"])
    return [(cased.get(name, name), value) for name, value in scope["headers"]]


def raise_open_files_limit() -> int:
    """The process's soft limit on open files raised to its hard limit (every connection is a file
    descriptor; systemd's default soft limit is 1024): the soft limit it then has."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            target = int(Path("/proc/sys/fs/nr_open").read_text())
        except (OSError, ValueError):
            return soft
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        log.warning("could not raise the open files limit from %d to %d", soft, target)
        return soft
    return target


async def drained() -> None:
    """Returns once the current request's connection holds little of its answer unsent (below
    uvicorn's low-water mark): the client has read the rest. At once if not served here."""
    transport = _TRANSPORT.get()
    flow = getattr(transport.get_protocol(), "flow", None) if transport is not None else None
    if transport is not None and flow is not None and not transport.is_closing():
        await flow.drain()


def drop_connection() -> None:
    """Reset the current request's connection at once, whatever it holds unsent: the transport's
    buffer and the kernel's go (uvloop's transports are no asyncio.Transport to isinstance)."""
    transport = _TRANSPORT.get()
    if transport is not None:
        reset_on_close()
        transport.abort()


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
