"""The gateway's relay of a node's streamed response, on its own (no cluster): a client that goes
away while the node is quiet ends the relay cleanly and closes the node's connection."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from aenv.cluster.entries import NodeEntry
from aenv.cluster.gateway import Relay

pytestmark = pytest.mark.fast  # the fast tier (./scripts/test --fast)


class QuietStream(httpx.AsyncByteStream):
    """A node's body that sends one chunk and then nothing (a long command's output)."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b"first"
        await asyncio.Event().wait()

    async def aclose(self) -> None:
        self.closed.set()


async def test_a_client_gone_while_the_node_is_quiet_ends_the_relay_without_an_error() -> None:
    stream = QuietStream()
    upstream = httpx.Response(200, stream=stream, request=httpx.Request("GET", "http://node/x"))
    sent: list[dict[str, object]] = []
    disconnect = asyncio.Event()

    async def receive() -> dict[str, object]:
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, object]) -> None:
        sent.append(message)
        if message.get("body") == b"first":
            disconnect.set()  # the client leaves once it has the first chunk

    node = NodeEntry(node_id="n1", address="http://node", driver="gvisor", version="test")
    await asyncio.wait_for(Relay(upstream, node)({"type": "http"}, receive, send), 5)  # used to raise InvalidStateError
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert stream.closed.is_set()
