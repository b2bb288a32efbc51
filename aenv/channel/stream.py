"""One stream of the channel: its queue of received items, its credit both ways, and its END.

A :class:`Stream` is what a handler or a caller holds; the :class:`~aenv.channel.connection.Channel`
feeds it the peer's frames and writes its frames to the pipe. Kept apart from the connection so that
the flow control (credit, queue bounds, coalescing small frames) reads as one piece. Stdlib only.
"""

from __future__ import annotations

import asyncio
from array import array
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aenv.channel.frames import (
    CREDIT,
    DATA,
    END,
    EOF,
    GRANT,
    MAX_JSON,
    MAX_PAYLOAD,
    MSG,
    ChannelClosed,
    ProtocolViolation,
    Unsendable,
    _result_of,
    _sendable,
    dumps,
    encode,
    loads,
)

if TYPE_CHECKING:
    from aenv.channel.connection import Channel

ITEM_FLOOR = 8  # a stream queues at most window // ITEM_FLOOR items: no real message is smaller
COALESCE_BELOW = 16 * 1024  # smaller frames queue back to back in one buffer (see _Run)


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
            self._items.popleft()
            item = head
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
