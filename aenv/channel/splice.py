"""Splicing a stream to a TCP connection: the bytes of a proxied port or an egress connection.

Both sides use it (the host for a sandbox's ports, the guest for egress), so it lives with the
channel; apart from the connection because it is a user of streams, not part of them. Stdlib only.
"""

from __future__ import annotations

import asyncio

from aenv.channel.frames import DATA, END, EOF
from aenv.channel.stream import Stream

SPLICE_CHUNK = 256 * 1024
SPLICE_LINGER = 30.0  # after one direction ends, how long the other may go on
END_LINGER = 2.0  # after the peer ends a spliced stream, how long its last data has to reach the socket


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
