"""The host<->guest channel: framed, multiplexed streams over one byte pipe (stdlib only).

Both the node (host side) and the guest agent import this module, so it must run on a bare
CPython standard library.

Wire format: every frame is a 9-byte header ``kind:u8 stream:u32 length:u32`` (big endian)
followed by ``length`` payload bytes. Stream 0 is the control stream.

    OPEN    both          JSON {"m": method, "p": params}; starts stream N (the host numbers its
                          streams odd, the guest even: the guest opens egress connections)
    MSG     both          one JSON message on stream N
    DATA    both          raw bytes on stream N
    EOF     both          the sender will send no more MSG/DATA on stream N
    END     both          stream N is over; JSON {"result": ...} or {"error": {"code", "message"}}
                          (host->guest END means "cancel": the host lost interest)
    CREDIT  both          u32: the receiver grants that many more payload bytes on stream N
    CTRL    both          JSON on stream 0: hello / freeze / frozen / thaw

Flow control is per stream and per direction: a sender may have at most ``window`` payload bytes
(MSG + DATA) unacknowledged; the receiver grants credit as its consumer takes items. A stalled
consumer therefore stalls only its own stream, never the pipe.

Every frame is untrusted input (root in a sandbox can write to the agent's pipe): a frame of an
unknown kind or larger than its kind allows, JSON that is not strict UTF-8 JSON, data beyond the
credit granted, more credit than was ever spent, an OPEN of a stream id in use (or past
``max_peer_streams``), more queued items than a window's worth: each is a
:class:`ProtocolViolation`, which closes the channel (the node then removes the sandbox). Nothing
the peer sends makes this side hold more than a window (plus one frame) per stream.

Checkpoint safety: before the runtime checkpoints a sandbox the host sends CTRL freeze; the
guest answers CTRL frozen and then writes nothing until CTRL thaw. The host writes nothing
between freeze and thaw. Both directions of the pipe are therefore on a frame boundary inside
the checkpoint image, and a restored guest can be attached to a brand new pipe.
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
import time
from array import array
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

HEADER = struct.Struct("!BII")
GRANT = struct.Struct("!I")
MAX_PAYLOAD = 256 * 1024  # one DATA frame
MAX_JSON = 4 * 1024 * 1024  # one OPEN, MSG or END frame: a request, an event, a result
MAX_CTRL = 1024 * 1024  # one CTRL frame (a thaw carries the sandbox's env)
MAX_GUEST_STREAMS = 256  # streams the guest may have open at once (its egress connections)
ITEM_FLOOR = 8  # a stream queues at most window // ITEM_FLOOR items: no real message is smaller
COALESCE_BELOW = 16 * 1024  # smaller frames queue back to back in one buffer (see _Run)
SPLICE_CHUNK = 256 * 1024
SPLICE_LINGER = 30.0  # after one direction ends, how long the other may go on
END_LINGER = 2.0  # after the peer ends a spliced stream, how long its last data has to reach the socket
DEFAULT_WINDOW = 4 * 1024 * 1024
SHARE_BURST = 0.5  # seconds of the event loop a peer's frames may take at once (see _Share)
FRAME_COST = 3e-6  # what reading a frame's header and payload costs the loop, besides handling it

OPEN, MSG, DATA, EOF, END, CREDIT, CTRL = 1, 2, 3, 4, 5, 6, 7
# The largest payload of each kind of frame; a kind not listed is a protocol violation.
MAX_LENGTH = {
    OPEN: MAX_JSON,
    MSG: MAX_JSON,
    DATA: MAX_PAYLOAD,
    EOF: 0,
    END: MAX_JSON,
    CREDIT: GRANT.size,
    CTRL: MAX_CTRL,
}

PROTOCOL_VIOLATION = "protocol violation"  # how the close reason of a channel the peer broke begins

log = logging.getLogger("aenv.channel")


class ChannelClosed(ConnectionError):
    """The pipe under the channel is gone (sandbox stopped, paused or killed)."""


class ProtocolViolation(Exception):
    """The peer sent something the protocol does not allow: nothing more from it can be trusted."""


class StreamError(Exception):
    """The far side ended a stream with an error; ``code`` is a Connect-style code string."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class Unsendable(StreamError):
    """A message this side refused to send: not strict JSON, or larger than its frame allows."""


def encode(kind: int, stream: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(kind, stream, len(payload)) + payload


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def _sendable(obj: Any, limit: int, what: str) -> bytes:
    try:
        payload = dumps(obj)
    except ValueError as exc:  # NaN or Infinity: the peer would refuse it
        raise Unsendable("invalid_argument", f"{what} is not JSON: {exc}") from exc
    if len(payload) > limit:
        # out_of_range, not resource_exhausted: what was asked for is too large (a listing of a whole
        # tree), not a resource running out (the SDKs read resource_exhausted as rate limiting).
        raise Unsendable("out_of_range", f"{what} is {len(payload)} bytes, more than the limit of {limit}")
    return payload


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_no_constants)


def loads(payload: bytes, what: str = "a message") -> Any:
    """Strict JSON: UTF-8 only, no NaN/Infinity, nesting within the recursion limit."""
    try:
        return _DECODER.decode(payload.decode())
    except (ValueError, RecursionError) as exc:
        raise ProtocolViolation(f"{what} is not JSON: {str(exc)[:200]}") from None


def _object(payload: bytes, what: str) -> dict[str, Any]:
    body = loads(payload, what)
    if not isinstance(body, dict):
        raise ProtocolViolation(f"{what} is not a JSON object")
    return body


_UNDECODED: Any = object()


@dataclass(slots=True)
class Item:
    """One thing received on a stream."""

    kind: int  # MSG, DATA, EOF or END
    _msg: Any = None  # decoded JSON for MSG and END (a MSG is decoded when first asked for)
    data: bytes = b""

    @property
    def msg(self) -> Any:
        if self._msg is _UNDECODED:
            self._msg = loads(self.data)  # checked when it arrived: this cannot fail
        return self._msg


class _Run:
    """Small frames queued back to back: their bytes in one buffer and four bytes of bookkeeping
    each (length and kind), not an object each (~100 bytes: a window of one-byte messages would
    cost a hundred windows). Consecutive small DATA frames join into one item."""

    __slots__ = ("buf", "marks", "start", "next")

    def __init__(self) -> None:
        self.buf = bytearray()
        self.marks = array("I")  # length << 1 | (1 for MSG)
        self.start = 0  # where the next item's bytes begin in buf
        self.next = 0  # the next item's index in marks

    def add(self, kind: int, payload: bytes) -> bool:
        """Queue ``payload``; False when it joined the DATA item queued last (no new item)."""
        self.buf += payload
        marks = self.marks
        if kind == DATA and self.next < len(marks) and not marks[-1] & 1 and marks[-1] >> 1 < COALESCE_BELOW:
            marks[-1] += len(payload) << 1
            return False
        marks.append(len(payload) << 1 | (kind == MSG))
        return True

    def take(self) -> Item:
        mark = self.marks[self.next]
        end = self.start + (mark >> 1)
        data = bytes(self.buf[self.start : end])
        self.next += 1
        if self.next == len(self.marks):  # all taken: start over
            del self.buf[:], self.marks[:]
            self.start = self.next = 0
        elif end >= COALESCE_BELOW and end * 2 >= len(self.buf):  # drop what was taken (amortised)
            del self.buf[:end], self.marks[: self.next]
            self.start = self.next = 0
        else:
            self.start = end
        return Item(MSG, _UNDECODED, data) if mark & 1 else Item(DATA, None, data)

    def empty(self) -> bool:
        return self.next == len(self.marks)


class Stream:
    """One logical stream. Items arrive in order through :meth:`recv`."""

    def __init__(self, channel: Channel, sid: int, method: str = "", params: Any = None) -> None:
        self.channel = channel
        self.id = sid
        self.method = method
        self.params = params if params is not None else {}
        self._items: deque[Item | _Run] = deque()
        self._queued = 0  # items received and not taken (a run holds several)
        self._arrived = asyncio.Event()
        self._send_credit = channel.window
        self._credit_event = asyncio.Event()
        self._recv_credit = channel.window  # what the peer may still send: the window + grants - received
        self._unacked = 0
        self._eof = False  # the peer sent EOF
        self.ended = False  # we sent END (or received one)
        self.remote_ended = False
        self.opened_by_peer = False
        self.peer_end = asyncio.Event()  # set with remote_ended, for whoever must react to it

    # -- receiving ---------------------------------------------------------------------------
    async def recv(self) -> Item:
        while not self._items:
            self._arrived.clear()
            await self._arrived.wait()
        head = self._items[0]
        if isinstance(head, _Run):
            item = head.take()
            if head.empty():
                self._items.popleft()
        else:
            item = self._items.popleft()
        self._queued -= 1
        self._consumed(item)
        return item

    def _consumed(self, item: Item) -> None:
        n = len(item.data) if item.kind in (MSG, DATA) else 0
        if not n:
            return
        self._unacked += n
        if self._unacked >= self.channel.window // 4 and not self.remote_ended:
            grant, self._unacked = self._unacked, 0
            self._recv_credit += grant
            self.channel._write_nowait(encode(CREDIT, self.id, GRANT.pack(grant)))

    async def result(self) -> Any:
        """Wait for END; return its result or raise :class:`StreamError`."""
        while True:
            item = await self.recv()
            if item.kind == END:
                return _result_of(item.msg)

    # -- sending -----------------------------------------------------------------------------
    async def _send(self, kind: int, payload: bytes) -> None:
        # Send while any credit is left (it may go negative): a frame larger than the window must
        # not wait for credit that only its own delivery would bring. The receiver checks the same.
        while self._send_credit <= 0 and not self.remote_ended:
            self._credit_event.clear()
            await self._credit_event.wait()
        if self.remote_ended:
            raise ChannelClosed(f"stream {self.id} was ended by the peer")
        self._send_credit -= len(payload)
        await self.channel._write(encode(kind, self.id, payload))

    async def send(self, msg: Any) -> None:
        await self._send(MSG, _sendable(msg, MAX_JSON, "a message"))

    async def send_data(self, data: bytes) -> None:
        view = memoryview(data)
        step = max(1, min(MAX_PAYLOAD, self.channel.window // 4))
        for off in range(0, len(view), step):
            await self._send(DATA, bytes(view[off : off + step]))

    async def send_eof(self) -> None:
        await self.channel._write(encode(EOF, self.id))

    async def end(self, result: Any = None, error: tuple[str, str] | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        body: dict[str, Any] = {}
        if error is not None:
            body["error"] = {"code": error[0], "message": error[1]}
        elif result is not None:
            body["result"] = result
        try:
            payload = _sendable(body, MAX_JSON, "the answer")
        except Unsendable as exc:  # the peer still hears that the stream is over, and why
            payload = dumps({"error": {"code": exc.code, "message": exc.message}})
        self.channel._streams.pop(self.id, None)  # sending END is our last word on it
        try:
            await self.channel._write(encode(END, self.id, payload))
        except ChannelClosed:
            pass

    async def withdraw(self) -> None:
        """END the stream and wait for the peer's END: once this returns, the peer has undone its
        side (a write the host gave up on is removed before the client hears it failed). The
        caller bounds the wait and calls :meth:`cancel` if the peer does not answer."""
        if not self.ended:
            self.ended = True
            self.channel._write_nowait(encode(END, self.id, dumps({})))
        while not self.remote_ended:
            await self.recv()

    def cancel(self) -> None:
        """Like :meth:`end` without a result, but never waits: cleanup must not hang on a peer
        that has stopped reading."""
        self.channel._streams.pop(self.id, None)
        if self.ended:
            return
        self.ended = True
        self.channel._write_nowait(encode(END, self.id, dumps({})))

    # -- called by the channel's reader ----------------------------------------------------------
    def _take(self, kind: int, payload: bytes) -> None:
        """A MSG or DATA frame from the peer, within the credit it was given. What a stalled
        consumer leaves queued costs its bytes: a frame of 16 KiB or more as it came (never
        copied), smaller ones in a :class:`_Run`."""
        if self._recv_credit <= 0:
            raise ProtocolViolation(f"stream {self.id}: {len(payload)} bytes sent beyond the credit granted")
        self._recv_credit -= len(payload)
        if kind == MSG:
            loads(payload)  # checked now, decoded when used: a queued message costs its bytes only
        elif not payload:
            raise ProtocolViolation(f"stream {self.id}: an empty DATA frame")
        if self._queued >= self.channel.window // ITEM_FLOOR:
            raise ProtocolViolation(f"stream {self.id}: more than {self._queued} items queued")
        if len(payload) >= COALESCE_BELOW:
            self._deliver(Item(kind, _UNDECODED if kind == MSG else None, payload))
            return
        tail = self._items[-1] if self._items else None
        if not isinstance(tail, _Run):
            tail = _Run()
            self._items.append(tail)
        if tail.add(kind, payload):
            self._queued += 1
        self._arrived.set()

    def _got_eof(self) -> None:
        if not self._eof:  # a repeated EOF says nothing new
            self._eof = True
            self._deliver(Item(EOF))

    def _deliver(self, item: Item) -> None:
        if item.kind == END:  # the peer's last word: nothing more will arrive
            self.remote_ended = True
            self.peer_end.set()
            self._credit_event.set()
            self.channel._streams.pop(self.id, None)
        self._items.append(item)
        self._queued += 1
        self._arrived.set()

    def _grant(self, n: int) -> None:
        if self._send_credit + n > self.channel.window:  # a peer grants only what it received
            raise ProtocolViolation(f"stream {self.id}: credit beyond the window")
        self._send_credit += n
        self._credit_event.set()


def end_error(body: Any) -> StreamError | None:
    """The error an END's body carries, if any, whatever shape the peer gave it."""
    err = body.get("error") if isinstance(body, dict) else None
    if not err:
        return None
    if not isinstance(err, dict):
        return StreamError("unknown", str(err)[:1000])
    return StreamError(str(err.get("code", "unknown"))[:100], str(err.get("message", ""))[:10_000])


def _result_of(body: Any) -> Any:
    error = end_error(body)
    if error is not None:
        raise error
    return body.get("result") if isinstance(body, dict) else None


OpenHandler = Callable[[Stream], Awaitable[None]]


async def _refuse_open(stream: Stream) -> None:
    await stream.end(error=("unimplemented", f"nothing here serves {stream.method!r}"))


CtrlHandler = Callable[[dict[str, Any]], Awaitable[None]]


class _Share:
    """A token bucket of the event loop's time: what taking a peer's frames in may use of it.

    Each frame costs what its handling took (JSON is the dear part: 4 MiB of nested empty lists
    took 280 ms to check); past the share, the reader pauses, the pipe fills and the peer waits.
    One peer flooding frames then slows only itself, not the node's other sandboxes and its API."""

    def __init__(self, share: float, burst: float = SHARE_BURST) -> None:
        self.share, self.burst = share, burst
        self.tokens = burst
        self.at = time.monotonic()

    async def spent(self, seconds: float) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.share) - seconds
        self.at = now
        if self.tokens < 0:
            await asyncio.sleep(-self.tokens / self.share)


class Channel:
    """A multiplexed channel over a (reader, writer) pair of asyncio streams.

    ``on_open`` serves streams the peer opens; ``on_ctrl`` receives control messages. Streams
    this side opens are numbered from ``first_stream_id`` in steps of two, the peer's have the
    other parity; ``max_peer_streams`` caps how many of the peer's may be open at once and
    ``cpu_share`` what fraction of the event loop's time reading the peer's frames may take. The host
    side may swap the underlying pipe with :meth:`attach` after a checkpoint without losing its
    streams.
    """

    def __init__(
        self,
        *,
        on_open: OpenHandler | None = None,
        on_ctrl: CtrlHandler | None = None,
        window: int = DEFAULT_WINDOW,
        first_stream_id: int = 1,
        max_peer_streams: int | None = None,
        cpu_share: float | None = None,
    ) -> None:
        self.window = window
        self._on_open = on_open
        self._on_ctrl = on_ctrl
        self._streams: dict[int, Stream] = {}
        self._next_id = first_stream_id
        self._max_peer_streams = max_peer_streams
        self._cpu_share = cpu_share
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._write_lock = asyncio.Lock()
        self._held = False  # between freeze and thaw nothing is written
        self._held_frames: list[bytes] = []
        self._read_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.closed = asyncio.Event()
        self.close_reason = ""
        # Frames written and read so far: the host's doze watch tells a quiet channel by it not
        # moving. ``on_write`` runs before every write (the host wakes a dozing sandbox there).
        self.frames = 0
        self.on_write: Callable[[], None] | None = None

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    # -- transport -----------------------------------------------------------------------------
    def attach(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Start (or restart) reading and writing on a pipe pair."""
        self._reader, self._writer = reader, writer
        self.closed.clear()
        self._read_task = asyncio.ensure_future(self._read_loop(reader))

    def suspend_reading(self) -> None:
        """Stop reading (the peer is frozen and sends nothing); the pipe stays attached."""
        if self._read_task is not None:
            self._read_task.cancel()
            self._read_task = None

    def resume_reading(self) -> None:
        if self._read_task is None and self._reader is not None:
            self._read_task = asyncio.ensure_future(self._read_loop(self._reader))

    def detach(self) -> None:
        """Stop using the current pipe; streams stay open (used around a checkpoint)."""
        if self._read_task is not None:
            self._read_task.cancel()
            self._read_task = None
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None

    def close(self, reason: str = "channel closed") -> None:
        """Drop the pipe and fail every stream. Frames not yet written are dropped: a peer that
        stopped reading must not keep writers waiting."""
        transport = getattr(self._writer, "transport", None)
        if transport is not None and not transport.is_closing():
            transport.abort()
        self.detach()
        self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        self.close_reason = reason
        for stream in list(self._streams.values()):
            stream._deliver(Item(END, {"error": {"code": "unavailable", "message": reason}}))
        self._streams.clear()
        self.closed.set()

    # -- writing --------------------------------------------------------------------------------
    def _writing(self) -> None:
        self.frames += 1
        if self.on_write is not None:
            self.on_write()

    async def _write(self, frame: bytes) -> None:
        if self._held:
            self._held_frames.append(frame)
            return
        self._writing()
        writer = self._writer
        if writer is None:
            raise ChannelClosed(self.close_reason or "channel is not attached")
        async with self._write_lock:
            try:
                writer.write(frame)
                await writer.drain()
            except (ConnectionError, RuntimeError, OSError) as exc:
                raise ChannelClosed(str(exc)) from exc

    def _write_nowait(self, frame: bytes) -> None:
        if self._held:
            self._held_frames.append(frame)
        elif self._writer is not None and not self._writer.is_closing():
            self._writing()
            self._writer.write(frame)

    def hold(self) -> None:
        """Queue frames instead of writing them (between freeze and thaw)."""
        self._held = True

    async def release(self, *, replay: bool = True) -> None:
        frames, self._held_frames = self._held_frames, []
        self._held = False
        if replay:
            for frame in frames:
                await self._write(frame)

    async def ctrl(self, msg: dict[str, Any], *, force: bool = False) -> None:
        frame = encode(CTRL, 0, _sendable(msg, MAX_CTRL, "a control message"))
        if not force:
            await self._write(frame)
            return
        if self._writer is None:
            raise ChannelClosed(self.close_reason or "channel is not attached")
        self._writing()
        async with self._write_lock:  # written even while frames are held
            try:
                self._writer.write(frame)
                await self._writer.drain()
            except (ConnectionError, RuntimeError, OSError) as exc:
                raise ChannelClosed(str(exc)) from exc

    # -- streams --------------------------------------------------------------------------------
    async def open(self, method: str, params: Any = None) -> Stream:
        payload = _sendable({"m": method, "p": params if params is not None else {}}, MAX_JSON, f"{method!r}")
        while self._next_id in self._streams:  # a peer that numbers its streams as we do
            self._next_id += 2
        sid = self._next_id
        self._next_id += 2
        stream = Stream(self, sid, method, params)
        self._streams[sid] = stream
        try:
            await self._write(encode(OPEN, sid, payload))
        except BaseException:  # closed, or the caller gave up waiting for room in the pipe
            self._streams.pop(sid, None)
            raise
        return stream

    def streams(self) -> list[Stream]:
        return list(self._streams.values())

    async def call(self, method: str, params: Any = None) -> Any:
        """Open a stream, wait for its END and return the result (a unary call)."""
        stream = await self.open(method, params)
        try:
            return await stream.result()
        finally:
            self._streams.pop(stream.id, None)

    def drop_streams(self) -> None:
        """Forget every stream without telling the peer (the peer's copy is a new instance).

        Local readers still get an END, so nothing waits forever on a stream that has no peer."""
        for stream in list(self._streams.values()):
            stream._deliver(Item(END, {"error": {"code": "unavailable", "message": "the sandbox was restored"}}))
        self._streams.clear()

    # -- reading ------------------------------------------------------------------------------
    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        share = _Share(self._cpu_share) if self._cpu_share is not None else None
        try:
            while True:
                header = await reader.readexactly(HEADER.size)
                kind, sid, length = HEADER.unpack(header)
                self.frames += 1
                if length > MAX_LENGTH.get(kind, -1):  # checked before a byte of it is buffered
                    raise ProtocolViolation(_bad_header(kind, sid, length))
                payload = await reader.readexactly(length) if length else b""
                started = time.perf_counter()
                then = self._dispatch(kind, sid, payload)
                if share is not None:
                    await share.spent(FRAME_COST + time.perf_counter() - started)
                if then is not None:
                    await then
        except asyncio.IncompleteReadError:
            self._lost(reader, "the peer closed the channel")
        except asyncio.CancelledError:
            raise
        except ProtocolViolation as exc:
            self._lost(reader, f"{PROTOCOL_VIOLATION}: {exc}")
        except Exception as exc:  # a corrupt frame: nothing on this pipe can be trusted any more
            self._lost(reader, f"channel protocol error: {exc!r}")

    def _lost(self, reader: asyncio.StreamReader, reason: str) -> None:
        if reader is not self._reader:
            return  # an old pipe, replaced after a checkpoint
        self._read_task = None  # this task is ending; detach must not cancel it
        self.detach()
        self._fail_all(reason)

    def _dispatch(self, kind: int, sid: int, payload: bytes) -> Awaitable[None] | None:
        """Take one frame in; what must be awaited after it (the control handler, or letting an
        OPEN's handler start), if anything."""
        if kind == CTRL:
            if sid:
                raise ProtocolViolation(f"a control frame on stream {sid}")
            msg = _object(payload, "a control message")
            return self._on_ctrl(msg) if self._on_ctrl is not None else None
        if not sid:
            raise ProtocolViolation(f"a frame of kind {kind} on the control stream")
        if kind == OPEN:
            self._serve_peer(sid, payload)
            return asyncio.sleep(0)  # let its handler start: a flood of OPENs must not pile up tasks
        if kind == CREDIT and len(payload) != GRANT.size:
            raise ProtocolViolation(f"a CREDIT of {len(payload)} bytes on stream {sid}")
        stream = self._streams.get(sid)
        if stream is None:
            self._check_late(kind, sid, payload)
        elif kind == MSG or kind == DATA:
            stream._take(kind, payload)
        elif kind == CREDIT:
            stream._grant(GRANT.unpack(payload)[0])
        elif kind == EOF:
            stream._got_eof()
        else:  # checked now, decoded when used: held, it costs its bytes, not a tree of objects
            _object(payload or b"{}", "an END")
            stream._deliver(Item(END, _UNDECODED, payload or b"{}"))
        return None

    def _serve_peer(self, sid: int, payload: bytes) -> None:
        if sid in self._streams or (sid % 2 == self._next_id % 2 and sid < self._next_id):
            raise ProtocolViolation(f"an OPEN of stream {sid}, which is open already or was this side's")
        limit = self._max_peer_streams
        if limit is not None and sum(1 for s in self._streams.values() if s.opened_by_peer) >= limit:
            raise ProtocolViolation(f"more than {limit} streams opened at once")
        body = _object(payload, "an OPEN")
        method, params = body.get("m", ""), body.get("p", {})
        if not isinstance(method, str) or not isinstance(params, dict):
            raise ProtocolViolation("an OPEN without a method name and a params object")
        stream = Stream(self, sid, method, params)
        stream.opened_by_peer = True
        self._streams[sid] = stream
        task = asyncio.ensure_future(self._serve(stream))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, stream: Stream) -> None:
        """Run the handler; a stream the peer opened always gets its END, whatever the handler did."""
        try:
            await (self._on_open or _refuse_open)(stream)
        except ChannelClosed:
            pass  # the peer ended the stream or the pipe is gone: its doing, not worth a traceback in the log
        except Exception:
            log.exception("serving %r on stream %d failed", stream.method, stream.id)
            await stream.end(error=("internal", f"serving {stream.method!r} failed"))
        if not stream.remote_ended:
            await stream.end(error=("internal", f"{stream.method!r} ended without an answer"))

    def _check_late(self, kind: int, sid: int, payload: bytes) -> None:
        """A frame for a stream already forgotten (ended while it was on its way): checked, dropped."""
        if kind == MSG or (kind == END and payload):
            loads(payload)
        elif kind == DATA and not payload:
            raise ProtocolViolation(f"stream {sid}: an empty DATA frame")


def _bad_header(kind: int, sid: int, length: int) -> str:
    if kind not in MAX_LENGTH:
        return f"a frame of unknown kind {kind} on stream {sid}"
    return f"a frame of kind {kind} on stream {sid} with {length} bytes, more than the {MAX_LENGTH[kind]} it may have"


async def splice(
    stream: Stream, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, until: asyncio.Event | None = None
) -> None:
    """Copy bytes both ways between a stream and a TCP connection until the exchange is over.

    Half-closes pass through (EOF each way); the caller ends the stream afterwards. Once the peer
    has ended the stream, what it queued has END_LINGER to reach the socket: a connection whose far
    end never reads must not hold the peer's data (and a socket) after the stream is gone, or a
    peer could end and reopen streams past any limit on how many it may have open. ``until``
    cuts the exchange short when it is set (the connection is no longer allowed)."""

    async def inbound() -> None:  # stream -> socket
        while True:
            item = await stream.recv()
            if item.kind == DATA:
                writer.write(item.data)
                await writer.drain()
            elif item.kind == EOF:
                if writer.can_write_eof():
                    writer.write_eof()
            elif item.kind == END:
                return

    async def outbound() -> None:  # socket -> stream
        while chunk := await reader.read(SPLICE_CHUNK):
            await stream.send_data(chunk)
        await stream.send_eof()

    into = asyncio.ensure_future(inbound())
    out = asyncio.ensure_future(outbound())
    ended = asyncio.ensure_future(stream.peer_end.wait())
    cut = asyncio.ensure_future((until or asyncio.Event()).wait())
    try:
        await asyncio.wait({into, out, ended, cut}, return_when=asyncio.FIRST_COMPLETED)
        if out.done() and not into.done() and not cut.done():  # the other side may still be talking
            await asyncio.wait({into, ended, cut}, timeout=SPLICE_LINGER, return_when=asyncio.FIRST_COMPLETED)
        if ended.done() and not into.done() and not cut.done():
            await asyncio.wait({into, cut}, timeout=END_LINGER, return_when=asyncio.FIRST_COMPLETED)
    finally:
        ended.cancel()
        cut.cancel()
        delivered = into.done()
        for task in (into, out):
            task.cancel()
            if task.done() and not task.cancelled():
                task.exception()  # a reset connection or a closed channel just ends the exchange
        # A far end that never reads would keep a closing transport (its buffer, its socket) for good.
        if delivered:
            writer.close()
            asyncio.get_running_loop().call_later(END_LINGER, writer.transport.abort)
        else:
            writer.transport.abort()
