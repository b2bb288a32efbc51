"""The channel itself: one pipe, its reader loop and its writer, and the streams on it.

:class:`Channel` owns the (reader, writer) pair: it numbers and opens streams, dispatches each
frame the peer sends to its stream, serves streams the peer opens, holds frames between freeze
and thaw, and fails every stream when the pipe is lost or the peer breaks the protocol. Stdlib only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aenv.channel.frames import (
    CREDIT,
    CTRL,
    DATA,
    END,
    EOF,
    GRANT,
    HEADER,
    MAX_CTRL,
    MAX_JSON,
    MAX_LENGTH,
    MSG,
    OPEN,
    PROTOCOL_VIOLATION,
    ChannelClosed,
    ProtocolViolation,
    _bad_header,
    _object,
    _sendable,
    encode,
    loads,
)
from aenv.channel.stream import _UNDECODED, Item, Stream

DEFAULT_WINDOW = 4 * 1024 * 1024
SHARE_BURST = 0.5  # seconds of the event loop a peer's frames may take at once (see _Share)
FRAME_COST = 3e-6  # what reading a frame's header and payload costs the loop, besides handling it

log = logging.getLogger("aenv.channel")


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
