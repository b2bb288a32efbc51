"""The host<->guest channel: framed, multiplexed streams over one byte pipe (stdlib only).

Both the node (host side) and the guest agent import this module, so it must run on a bare
CPython standard library.

Wire format: every frame is a 9-byte header ``kind:u8 stream:u32 length:u32`` (big endian)
followed by ``length`` payload bytes. Stream 0 is the control stream.

    OPEN    host->guest   JSON {"m": method, "p": params}; starts stream N
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

Checkpoint safety: before the runtime checkpoints a sandbox the host sends CTRL freeze; the
guest answers CTRL frozen and then writes nothing until CTRL thaw. The host writes nothing
between freeze and thaw. Both directions of the pipe are therefore on a frame boundary inside
the checkpoint image, and a restored guest can be attached to a brand new pipe.
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

HEADER = struct.Struct("!BII")
MAX_PAYLOAD = 256 * 1024
SPLICE_CHUNK = 256 * 1024
SPLICE_LINGER = 30.0  # after one direction ends, how long the other may go on
DEFAULT_WINDOW = 4 * 1024 * 1024

OPEN, MSG, DATA, EOF, END, CREDIT, CTRL = 1, 2, 3, 4, 5, 6, 7


class ChannelClosed(ConnectionError):
    """The pipe under the channel is gone (sandbox stopped, paused or killed)."""


class StreamError(Exception):
    """The far side ended a stream with an error; ``code`` is a Connect-style code string."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def encode(kind: int, stream: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(kind, stream, len(payload)) + payload


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


@dataclass(slots=True)
class Item:
    """One thing received on a stream."""

    kind: int  # MSG, DATA, EOF or END
    msg: Any = None  # decoded JSON for MSG and END
    data: bytes = b""


class Stream:
    """One logical stream. Items arrive in order through :meth:`recv`."""

    def __init__(self, channel: Channel, sid: int, method: str = "", params: Any = None) -> None:
        self.channel = channel
        self.id = sid
        self.method = method
        self.params = params if params is not None else {}
        self._items: asyncio.Queue[Item] = asyncio.Queue()
        self._send_credit = channel.window
        self._credit_event = asyncio.Event()
        self._unacked = 0
        self.ended = False  # we sent END (or received one)
        self.remote_ended = False
        self.peer_end = asyncio.Event()  # set with remote_ended, for whoever must react to it

    # -- receiving ---------------------------------------------------------------------------
    async def recv(self) -> Item:
        item = await self._items.get()
        self._consumed(item)
        return item

    def _consumed(self, item: Item) -> None:
        n = len(item.data) if item.kind in (MSG, DATA) else 0
        if not n:
            return
        self._unacked += n
        if self._unacked >= self.channel.window // 4 and not self.remote_ended:
            grant, self._unacked = self._unacked, 0
            self.channel._write_nowait(encode(CREDIT, self.id, struct.pack("!I", grant)))

    async def result(self) -> Any:
        """Wait for END; return its result or raise :class:`StreamError`."""
        while True:
            item = await self.recv()
            if item.kind == END:
                return _result_of(item.msg)

    # -- sending -----------------------------------------------------------------------------
    async def _send(self, kind: int, payload: bytes) -> None:
        # Send while any credit is left (it may go negative): a frame larger than the window must
        # not wait for credit that only its own delivery would bring.
        while self._send_credit <= 0 and not self.remote_ended:
            self._credit_event.clear()
            await self._credit_event.wait()
        if self.remote_ended:
            raise ChannelClosed(f"stream {self.id} was ended by the peer")
        self._send_credit -= len(payload)
        await self.channel._write(encode(kind, self.id, payload))

    async def send(self, msg: Any) -> None:
        await self._send(MSG, dumps(msg))

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
        self.channel._streams.pop(self.id, None)  # sending END is our last word on it
        try:
            await self.channel._write(encode(END, self.id, dumps(body)))
        except ChannelClosed:
            pass

    # -- called by the channel's reader ----------------------------------------------------------
    def _deliver(self, item: Item) -> None:
        if item.kind == END:  # the peer's last word: nothing more will arrive
            self.remote_ended = True
            self.peer_end.set()
            self._credit_event.set()
            self.channel._streams.pop(self.id, None)
        self._items.put_nowait(item)

    def _grant(self, n: int) -> None:
        self._send_credit += n
        self._credit_event.set()


def _result_of(body: Any) -> Any:
    if isinstance(body, dict) and body.get("error"):
        err = body["error"]
        raise StreamError(str(err.get("code", "unknown")), str(err.get("message", "")))
    return body.get("result") if isinstance(body, dict) else None


OpenHandler = Callable[[Stream], Awaitable[None]]


async def _refuse_open(stream: Stream) -> None:
    await stream.end(error=("unimplemented", f"nothing here serves {stream.method!r}"))


CtrlHandler = Callable[[dict[str, Any]], Awaitable[None]]


class Channel:
    """A multiplexed channel over a (reader, writer) pair of asyncio streams.

    ``on_open`` serves streams the peer opens (the guest side); ``on_ctrl`` receives control
    messages. The host side opens streams with :meth:`open` and may swap the underlying pipe
    with :meth:`attach` after a checkpoint without losing its streams.
    """

    def __init__(
        self,
        *,
        on_open: OpenHandler | None = None,
        on_ctrl: CtrlHandler | None = None,
        window: int = DEFAULT_WINDOW,
        first_stream_id: int = 1,
    ) -> None:
        self.window = window
        self._on_open = on_open
        self._on_ctrl = on_ctrl
        self._streams: dict[int, Stream] = {}
        self._next_id = first_stream_id
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._write_lock = asyncio.Lock()
        self._held = False  # between freeze and thaw nothing is written
        self._held_frames: list[bytes] = []
        self._read_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.closed = asyncio.Event()
        self.close_reason = ""

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
        """Drop the pipe and fail every stream."""
        self.detach()
        self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        self.close_reason = reason
        for stream in list(self._streams.values()):
            stream._deliver(Item(END, {"error": {"code": "unavailable", "message": reason}}))
        self._streams.clear()
        self.closed.set()

    # -- writing --------------------------------------------------------------------------------
    async def _write(self, frame: bytes) -> None:
        if self._held:
            self._held_frames.append(frame)
            return
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
        frame = encode(CTRL, 0, dumps(msg))
        if not force:
            await self._write(frame)
            return
        if self._writer is None:
            raise ChannelClosed(self.close_reason or "channel is not attached")
        async with self._write_lock:  # written even while frames are held
            try:
                self._writer.write(frame)
                await self._writer.drain()
            except (ConnectionError, RuntimeError, OSError) as exc:
                raise ChannelClosed(str(exc)) from exc

    # -- streams --------------------------------------------------------------------------------
    async def open(self, method: str, params: Any = None) -> Stream:
        sid = self._next_id
        self._next_id += 2
        stream = Stream(self, sid, method, params)
        self._streams[sid] = stream
        try:
            await self._write(encode(OPEN, sid, dumps({"m": method, "p": stream.params})))
        except ChannelClosed:
            self._streams.pop(sid, None)
            raise
        return stream

    def open_streams(self) -> list[Stream]:
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
        try:
            while True:
                header = await reader.readexactly(HEADER.size)
                kind, sid, length = HEADER.unpack(header)
                payload = await reader.readexactly(length) if length else b""
                await self._dispatch(kind, sid, payload)
        except asyncio.IncompleteReadError:
            self._lost(reader, "the peer closed the channel")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a corrupt frame: nothing on this pipe can be trusted any more
            self._lost(reader, f"channel protocol error: {exc!r}")

    def _lost(self, reader: asyncio.StreamReader, reason: str) -> None:
        if reader is not self._reader:
            return  # an old pipe, replaced after a checkpoint
        self._read_task = None  # this task is ending; detach must not cancel it
        self.detach()
        self._fail_all(reason)

    async def _dispatch(self, kind: int, sid: int, payload: bytes) -> None:
        if kind == CTRL:
            if self._on_ctrl is not None:
                await self._on_ctrl(json.loads(payload))
            return
        if kind == OPEN:
            body = json.loads(payload)
            stream = Stream(self, sid, body.get("m", ""), body.get("p"))
            self._streams[sid] = stream
            handle = self._on_open or _refuse_open
            task = asyncio.ensure_future(handle(stream))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        stream = self._streams.get(sid)
        if stream is None:
            return  # late frame for a stream we already forgot
        if kind == CREDIT:
            stream._grant(struct.unpack("!I", payload)[0])
        elif kind == MSG:
            stream._deliver(Item(MSG, json.loads(payload), payload))
        elif kind == DATA:
            stream._deliver(Item(DATA, None, payload))
        elif kind == EOF:
            stream._deliver(Item(EOF))
        elif kind == END:
            stream._deliver(Item(END, json.loads(payload) if payload else {}))


async def splice(stream: Stream, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy bytes both ways between a stream and a TCP connection until the exchange is over.

    Half-closes pass through (EOF each way); the caller ends the stream afterwards."""

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
    try:
        await asyncio.wait({into, out}, return_when=asyncio.FIRST_COMPLETED)
        if out.done() and not into.done():
            await asyncio.wait({into}, timeout=SPLICE_LINGER)  # the other side may still be talking
    finally:
        for task in (into, out):
            task.cancel()
            if task.done() and not task.cancelled():
                task.exception()  # a reset connection or a closed channel just ends the exchange
        writer.close()
