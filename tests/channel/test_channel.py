"""The channel protocol over real pipes, with a tiny in-process guest (no sandbox needed)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from aenv.channel import DATA, END, EOF, MSG, Channel, ChannelClosed, Stream, StreamError

pytestmark = pytest.mark.fast  # the fast tier (./scripts/test --fast)


async def pipe_pair() -> tuple[
    tuple[asyncio.StreamReader, asyncio.StreamWriter], tuple[asyncio.StreamReader, asyncio.StreamWriter]
]:
    loop = asyncio.get_running_loop()

    async def one_way() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        r, w = os.pipe()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(r, "rb", 0))
        transport, protocol = await loop.connect_write_pipe(
            lambda: asyncio.StreamReaderProtocol(asyncio.StreamReader()), os.fdopen(w, "wb", 0)
        )
        return reader, asyncio.StreamWriter(transport, protocol, None, loop)

    a_to_b = await one_way()
    b_to_a = await one_way()
    return (b_to_a[0], a_to_b[1]), (a_to_b[0], b_to_a[1])


async def serve(stream: Stream) -> None:
    if stream.method == "echo":
        await stream.end(result=stream.params)
    elif stream.method == "fail":
        await stream.end(error=("not_found", "nothing here"))
    elif stream.method == "count":
        for i in range(int(stream.params["n"])):
            await stream.send({"i": i})
        await stream.end(result={})
    elif stream.method == "upload":
        total = 0
        while (item := await stream.recv()).kind == DATA:
            total += len(item.data)
        assert item.kind == EOF
        await stream.end(result={"bytes": total})
    elif stream.method == "blob":
        await stream.send_data(os.urandom(int(stream.params["size"])))
        await stream.end(result={})


@pytest.fixture()
async def link() -> Any:
    host_end, guest_end = await pipe_pair()
    host = Channel(window=64 * 1024)
    guest = Channel(on_open=serve, window=64 * 1024)
    host.attach(*host_end)
    guest.attach(*guest_end)
    yield host, guest
    host.close()
    guest.close()


async def test_unary_results_and_errors(link: Any) -> None:
    host, _ = link
    assert await host.call("echo", {"a": [1, 2]}) == {"a": [1, 2]}
    with pytest.raises(StreamError) as exc:
        await host.call("fail")
    assert exc.value.code == "not_found"


async def test_many_streams_interleave(link: Any) -> None:
    host, _ = link

    async def collect(n: int) -> list[int]:
        stream = await host.open("count", {"n": n})
        out = []
        while (item := await stream.recv()).kind == MSG:
            out.append(item.msg["i"])
        assert item.kind == END
        return out

    results = await asyncio.gather(*(collect(n) for n in (5, 500, 50)))
    assert results == [list(range(5)), list(range(500)), list(range(50))]


async def test_flow_control_moves_more_than_a_window(link: Any) -> None:
    host, _ = link
    stream = await host.open("upload", {})
    await stream.send_data(b"x" * (1024 * 1024))  # 16 windows' worth
    await stream.send_eof()
    assert (await stream.result()) == {"bytes": 1024 * 1024}
    blob = await host.open("blob", {"size": 700_000})
    got = 0
    while (item := await blob.recv()).kind == DATA:
        got += len(item.data)
    assert got == 700_000


async def test_held_frames_replay_or_drop(link: Any) -> None:
    host, _ = link
    host.hold()
    call = asyncio.ensure_future(host.call("echo", {"x": 1}))
    await asyncio.sleep(0.05)
    assert not call.done()  # nothing was written while held
    await host.release(replay=True)
    assert await asyncio.wait_for(call, 2) == {"x": 1}


async def test_closing_fails_open_streams(link: Any) -> None:
    host, guest = link
    stream = await host.open("upload", {})
    guest.close("gone")
    item = await asyncio.wait_for(stream.recv(), 2)
    assert item.kind == END and item.msg["error"]["code"] == "unavailable"
    with pytest.raises(ChannelClosed):
        await asyncio.wait_for(host.call("echo", {}), 2)
