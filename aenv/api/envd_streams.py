"""How an answer the guest agent streams reaches an envd client, and what it becomes when the
sandbox goes away.

Every envd endpoint (aenv/api/envd.py) reaches the sandbox's agent through its link and turns the
agent's errors into Connect errors; the streamed ones (a command's output, a directory watch, a
download) also forward the agent's messages as Connect envelopes with keepalives, ping a quiet
agent, and are dropped rather than ended when the sandbox is killed or paused under them, as E2B's
proxy drops them (the SDKs then report the sandbox gone instead of an error).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Send

from aenv.api import connect, connections
from aenv.api.connect import ConnectError
from aenv.channel import END, MSG, ChannelClosed, Stream, StreamError, end_error
from aenv.errors import AenvError, AgentTimeout, AgentUnavailable
from aenv.node.service import AgentLink, CommandRecord, LiveSandbox

KEEPALIVE_DEFAULT = 90.0
UNFINISHED = "ASGI callable returned without completing response."  # uvicorn's words for a dropped one


class StreamDropped(AgentUnavailable):
    """The sandbox went away (killed, paused, died) while an answer streamed."""


class DroppableStream(StreamingResponse):
    """A streamed answer that, when its sandbox goes away, is dropped rather than ended: the body
    is left unfinished and the connection reset, as E2B's proxy resets the stream of a sandbox that
    is gone. The SDKs read that as a lost connection, probe the sandbox's health and report it
    killed ("killed or reached its end of life"); an error message ending the stream would be
    reported as that error instead."""

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        except StreamDropped:
            connections.reset_on_close()


class DroppedStreamsAreNotErrors(logging.Filter):
    """uvicorn logs an unfinished response as an error; a dropped stream is one on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != UNFINISHED


def connect_error(exc: BaseException) -> ConnectError:
    if isinstance(exc, ConnectError):
        return exc
    if isinstance(exc, StreamError):
        return ConnectError(exc.code, exc.message)
    if isinstance(exc, AgentTimeout):
        return ConnectError("deadline_exceeded", exc.message)
    if isinstance(exc, ChannelClosed | AenvError):
        return ConnectError("unavailable", f"The sandbox was not found: {exc}")
    return ConnectError("internal", str(exc))


async def stream_events(
    request: Request, link: AgentLink, stream: Stream, *, first: Any = None, record: CommandRecord | None = None
) -> AsyncIterator[bytes]:
    """Forward a guest stream of JSON messages as Connect envelopes, with keepalives.

    A quiet stream is normal (a command that prints nothing); a quiet agent is not: at each
    keepalive the agent is pinged, and a ping it has not answered ends the stream with an error."""
    interval = connect.keepalive_interval(request, KEEPALIVE_DEFAULT)
    finished = False
    ping: asyncio.Future[None] | None = None
    try:
        if first is not None:
            yield connect.message_envelope(first)
        while True:
            try:
                item = await asyncio.wait_for(stream.recv(), timeout=interval)
            except TimeoutError:
                if ping is not None and ping.done() and ping.exception() is not None:
                    if record is not None:
                        record.failed(str(ping.exception()))
                    yield connect.end_stream(connect_error(ping.exception()))  # type: ignore[arg-type]
                    return
                yield connect.message_envelope({"event": {"keepalive": {}}})
                if ping is None or ping.done():
                    ping = asyncio.ensure_future(link.ping())
                    ping.add_done_callback(lambda t: t.cancelled() or t.exception())  # read above, or dropped
                continue
            if item.kind == MSG:
                if record is not None:
                    record.message(item.data)
                yield connect.envelope(item.data)
            elif item.kind == END:
                finished = True
                error = end_error(item.msg)
                if record is not None:
                    record.ended(error)
                if error is not None and link.channel.closed.is_set():
                    raise StreamDropped(error.message)
                yield connect.end_stream(connect_error(error) if error else None)
                return
    finally:
        if ping is not None:
            ping.cancel()
        if not finished:  # the client left (or the agent is gone): stop following, the process keeps running
            stream.cancel()
            if record is not None:
                record.detached()


def agent_link(sb: LiveSandbox) -> AgentLink:
    if sb.link is None:  # paused or killed since the request was routed
        raise AgentUnavailable(f"sandbox {sb.id} is {sb.state.value}", sandbox_id=sb.id)
    return sb.link


async def open_first(link: AgentLink, method: str, params: dict[str, Any]) -> tuple[Stream, Any]:
    """Open a stream and wait (within the agent deadline) for its first message, so errors
    before it become a proper error answer."""
    stream = await link.open(method, params)
    try:
        item = await link.within(stream.recv(), method)
    except BaseException:
        stream.cancel()
        raise
    if item.kind == END:
        raise connect_error(end_error(item.msg) or StreamError("internal", "stream ended early"))
    return stream, item.msg


async def server_stream(
    request: Request, sb: LiveSandbox, method: str, params: dict[str, Any], record: CommandRecord | None = None
) -> Response:
    try:
        link = agent_link(sb)
        stream, first = await open_first(link, method, params)
    except Exception as exc:
        error = connect_error(exc)
        if record is not None:
            record.failed(error.message)
        return Response(connect.end_stream(error), media_type=connect.STREAM_CONTENT_TYPE)
    if record is not None:
        record.started(first)
    sb.streams.add(stream)
    events = stream_events(request, link, stream, first=first, record=record)
    return DroppableStream(events, media_type=connect.STREAM_CONTENT_TYPE)
