"""The channel as untrusted input: root in a sandbox can write anything to its agent's pipe.

First the Channel class against a raw peer on real pipes (each protocol violation closes the
channel; nothing the peer sends makes the host buffer more than a window per stream), then the
real thing: hostile frames written into the agent's pipe from inside a sandbox as root, and the
node removes that sandbox and nothing else.
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
import tracemalloc
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from aenv.channel import CREDIT, CTRL, DATA, DEFAULT_WINDOW, END, EOF, HEADER, MSG, OPEN, Channel, Stream
from aenv.node.agentlink import AgentLink
from tests.channel.test_channel import pipe_pair
from tests.conftest import Server
from tests.node.test_egress import host_address

GIB = 2**30


def frame(kind: int, sid: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(kind, sid, len(payload)) + payload


class RawPeer:
    """The far end of a host channel, writing whatever bytes it likes and reading what it gets."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.received = bytearray()
        self._drain = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        while chunk := await self.reader.read(65536):
            self.received += chunk

    async def send(self, data: bytes) -> None:
        """Write ``data``; a host that stopped reading (it closed the channel) is no error."""
        try:
            self.writer.write(data)
            await asyncio.wait_for(self.writer.drain(), 5)
        except (ConnectionError, TimeoutError):
            pass

    def frames(self) -> list[tuple[int, int, bytes]]:
        out, view = [], bytes(self.received)
        while len(view) >= HEADER.size:
            kind, sid, length = HEADER.unpack_from(view)
            out.append((kind, sid, view[HEADER.size : HEADER.size + length]))
            view = view[HEADER.size + length :]
        return out

    def close(self) -> None:
        self._drain.cancel()
        self.writer.close()


async def refuse_everything(stream: Stream) -> None:
    await stream.end(error=("unimplemented", "no"))


async def hold_open(stream: Stream) -> None:
    while (await stream.recv()).kind != END:
        pass


@pytest.fixture()
async def host() -> AsyncIterator[tuple[Channel, RawPeer]]:
    """The host's channel as the node configures it (AgentLink), attached to a raw peer."""
    host_end, peer_end = await pipe_pair()
    link = AgentLink("sbx-under-test", serve=hold_open)
    link.channel.attach(*host_end)
    peer = RawPeer(*peer_end)
    yield link.channel, peer
    link.channel.close()
    peer.close()


async def closed_for(channel: Channel, timeout: float = 5.0) -> str:
    await asyncio.wait_for(channel.closed.wait(), timeout)
    return channel.close_reason


@pytest.mark.parametrize(
    "header",
    [
        (DATA, 1, int(1.5 * GIB)),  # the reproduction
        (DATA, 1, 256 * 1024 + 1),
        (MSG, 1, 2**32 - 1),
        (OPEN, 2, GIB),
        (END, 1, 64 * 2**20),
        (CTRL, 0, 512 * 2**20),
        (CREDIT, 1, 2**31),
        (EOF, 1, 1),
    ],
)
async def test_a_frame_longer_than_its_kind_allows_closes_before_it_is_buffered(
    host: tuple[Channel, RawPeer], header: tuple[int, int, int]
) -> None:
    channel, peer = host
    await channel.open("process.start", {})
    await peer.send(HEADER.pack(*header))
    asyncio.ensure_future(peer.send(bytes(8 * 2**20)))  # the "payload" keeps coming
    assert (await closed_for(channel)).startswith("protocol violation")


@pytest.mark.parametrize("kind", [0, 8, 9, 255])
async def test_an_unknown_kind_of_frame_closes(host: tuple[Channel, RawPeer], kind: int) -> None:
    channel, peer = host
    stream = await channel.open("process.start", {})
    await peer.send(frame(kind, stream.id))
    assert "unknown kind" in await closed_for(channel)


async def test_data_beyond_the_credit_closes_and_the_host_holds_no_more_than_a_window(
    host: tuple[Channel, RawPeer],
) -> None:
    channel, peer = host
    stream = await channel.open("process.start", {})  # nobody reads it
    chunk = frame(DATA, stream.id, bytes(256 * 1024))
    for _ in range(DEFAULT_WINDOW // (256 * 1024)):  # a whole window: fine
        await peer.send(chunk)
    await asyncio.sleep(0.1)
    assert not channel.closed.is_set()
    asyncio.ensure_future(peer.send(chunk * 8))  # past the window without waiting for credit
    assert "beyond the credit" in await closed_for(channel)
    queued = sum(len(item.data) for item in stream._items)
    assert queued <= DEFAULT_WINDOW + 256 * 1024


async def test_credit_beyond_the_window_closes(host: tuple[Channel, RawPeer]) -> None:
    channel, peer = host
    stream = await channel.open("process.start", {})
    await peer.send(frame(CREDIT, stream.id, struct.pack("!I", 2**32 - 1)))
    assert "credit beyond the window" in await closed_for(channel)


@pytest.mark.parametrize("payload", [b"", b"\x01", b"\x00\x01\x00"])
async def test_a_short_credit_closes(host: tuple[Channel, RawPeer], payload: bytes) -> None:
    channel, peer = host
    stream = await channel.open("process.start", {})
    await peer.send(frame(CREDIT, stream.id, payload))
    assert (await closed_for(channel)).startswith("protocol violation")


@pytest.mark.parametrize(
    "kind, payload",
    [
        (MSG, b'{"n": NaN}'),
        (MSG, b'{"n": Infinity}'),
        (MSG, '{"utf16": 1}'.encode("utf-16-le")),
        (MSG, b'{"x": "\xff\xfe"}'),
        (MSG, b"[" * 100_000),
        (MSG, b'{"truncated": '),
        (END, b"[1, 2]"),
        (CTRL, b'"ready"'),
        (CTRL, b'{"op": "pong", "t": -Infinity}'),
    ],
    ids=["nan", "infinity", "utf-16", "not-utf-8", "deep", "truncated", "end-not-object", "ctrl-string", "ctrl-inf"],
)
async def test_anything_but_strict_json_closes(host: tuple[Channel, RawPeer], kind: int, payload: bytes) -> None:
    channel, peer = host
    stream = await channel.open("process.start", {})
    await peer.send(frame(kind, 0 if kind == CTRL else stream.id, payload))
    assert (await closed_for(channel)).startswith("protocol violation")


@pytest.mark.parametrize(
    "body",
    [b'{"m": 5}', b'{"m": "egress.connect", "p": [1]}', b"[]", b"\xc3("],
    ids=["method", "params", "list", "utf-8"],
)
async def test_an_open_that_is_not_a_method_and_params_closes(host: tuple[Channel, RawPeer], body: bytes) -> None:
    channel, peer = host
    await peer.send(frame(OPEN, 2, body))
    assert (await closed_for(channel)).startswith("protocol violation")


async def test_garbage_for_a_stream_that_is_gone_still_closes(host: tuple[Channel, RawPeer]) -> None:
    channel, peer = host
    await peer.send(frame(MSG, 9999, b"not json"))
    assert "not JSON" in await closed_for(channel)


async def test_streams_past_the_guest_limit_close(host: tuple[Channel, RawPeer]) -> None:
    channel, peer = host
    opens = b"".join(frame(OPEN, 2 * n, b'{"m": "egress.connect", "p": {}}') for n in range(1, 2001))
    await peer.send(opens)
    reason = await closed_for(channel, 20)
    assert "streams opened at once" in reason
    assert channel.open_streams == 0 and len(channel._tasks) <= 300


async def test_an_open_of_a_stream_in_use_closes(host: tuple[Channel, RawPeer]) -> None:
    channel, peer = host
    mine = await channel.open("process.start", {})
    await peer.send(frame(OPEN, mine.id, b'{"m": "egress.connect", "p": {}}'))  # hijack the host's stream
    assert "open already" in await closed_for(channel)


async def test_tiny_frames_cost_their_bytes_not_their_count(host: tuple[Channel, RawPeer]) -> None:
    channel, peer = host
    stream = await channel.open("process.start", {})  # nobody reads it
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        one_byte = frame(DATA, stream.id, b"x")
        eof = frame(EOF, stream.id)
        for _ in range(2):
            await peer.send((one_byte + eof) * 50_000)  # 100k one-byte data frames, 100k EOFs
        await asyncio.sleep(0.5)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert not channel.closed.is_set()  # within the credit: allowed, and cheap
    assert grown < 8 * 2**20, grown
    got = b""
    while (item := await asyncio.wait_for(stream.recv(), 1)).kind == DATA:
        got += item.data
    assert item.kind == EOF and got == b"x" * len(got) and len(got) >= 1


async def test_a_flood_of_one_byte_messages_closes(host: tuple[Channel, RawPeer]) -> None:
    channel, peer = host
    stream = await channel.open("process.start", {})
    asyncio.ensure_future(peer.send(frame(MSG, stream.id, b"0") * (DEFAULT_WINDOW // 4)))
    assert "items queued" in await closed_for(channel, 20)


async def test_empty_data_frames_close(host: tuple[Channel, RawPeer]) -> None:
    channel, peer = host
    stream = await channel.open("process.start", {})
    await peer.send(frame(DATA, stream.id) * 1000)
    assert "empty DATA" in await closed_for(channel)


async def test_late_frames_after_end_are_dropped_and_the_channel_goes_on(host: tuple[Channel, RawPeer]) -> None:
    channel, peer = host
    stream = await channel.open("process.start", {})
    late = frame(END, stream.id, b"{}") + frame(MSG, stream.id, b'{"late": 1}') * 1000
    await peer.send(late + frame(DATA, stream.id, b"x") * 1000 + frame(EOF, stream.id) * 1000)
    assert (await asyncio.wait_for(stream.recv(), 2)).kind == END
    await asyncio.sleep(0.2)
    assert not channel.closed.is_set() and channel.open_streams == 0


async def test_a_refused_open_is_answered_and_a_handler_failure_still_ends_the_stream() -> None:
    async def broken(stream: Stream) -> None:
        raise UnicodeError("label empty or too long")

    for handler in (broken, refuse_everything):
        host_end, peer_end = await pipe_pair()
        channel = Channel(on_open=handler)
        channel.attach(*host_end)
        peer = RawPeer(*peer_end)
        try:
            await peer.send(b"".join(frame(OPEN, 2 * n, b'{"m": "x", "p": {}}') for n in range(1, 51)))
            for _ in range(100):
                if sum(1 for kind, *_ in peer.frames() if kind == END) == 50:
                    break
                await asyncio.sleep(0.02)
            ends = [sid for kind, sid, _ in peer.frames() if kind == END]
            assert sorted(ends) == [2 * n for n in range(1, 51)]
            assert channel.open_streams == 0 and not channel.closed.is_set()
        finally:
            channel.close()
            peer.close()


async def test_legitimate_traffic_is_untouched() -> None:
    """A message larger than the window, sent while some credit is left, is not a violation."""
    host_end, guest_end = await pipe_pair()

    async def big(stream: Stream) -> None:
        await stream.send({"blob": "y" * 300_000})
        await stream.send({"blob": "z" * 300_000})
        await stream.end(result={})

    host = Channel(window=64 * 1024)
    guest = Channel(on_open=big, window=64 * 1024, first_stream_id=2)
    host.attach(*host_end)
    guest.attach(*guest_end)
    try:
        stream = await host.open("big", {})
        first = await asyncio.wait_for(stream.recv(), 2)
        second = await asyncio.wait_for(stream.recv(), 2)
        assert first.msg == {"blob": "y" * 300_000} and second.msg == {"blob": "z" * 300_000}
        assert (await asyncio.wait_for(stream.recv(), 2)).kind == END
        assert not host.closed.is_set()
    finally:
        host.close()
        guest.close()


async def test_the_host_refuses_to_send_what_the_guest_would_refuse() -> None:
    from aenv.channel import MAX_JSON, Unsendable

    host_end, peer_end = await pipe_pair()
    channel = Channel()
    channel.attach(*host_end)
    peer = RawPeer(*peer_end)
    try:
        with pytest.raises(Unsendable) as exc:
            await channel.open("process.start", {"process": {"cmd": "x" * MAX_JSON}})
        assert exc.value.code == "out_of_range"  # a client asked for too much: 400, not rate limiting
        with pytest.raises(Unsendable):
            await channel.open("process.start", {"n": float("nan")})
        await asyncio.sleep(0.1)
        assert peer.frames() == [] and channel.open_streams == 0
    finally:
        channel.close()
        peer.close()


async def test_a_build_step_agent_that_answers_garbage_fails_the_step_not_the_node() -> None:
    """What the host reads out of a process stream (builds run untrusted recipes as root) is checked."""
    import base64

    from aenv.templates.builder import OUTPUT_TAIL, run_process

    host_end, peer_end = await pipe_pair()
    link = AgentLink("build-step")
    link.channel.attach(*host_end)
    peer = RawPeer(*peer_end)
    try:
        run = asyncio.ensure_future(run_process(link, ["/bin/true"]))
        await asyncio.sleep(0.1)
        sid = peer.frames()[0][1]
        chunk = base64.b64encode(b"y" * 32 * 1024).decode()
        garbage = [
            b'{"event": "x"}',
            b'["event"]',
            b'"event"',
            b'{"event": {"data": {"stdout": 5}}}',
            b'{"event": {"data": {"stdout": "!!not base64"}}}',
            b'{"event": {"data": []}}',
            *[json.dumps({"event": {"data": {"stdout": chunk}}}).encode()] * 64,  # 2 MiB of output
            b'{"event": {"end": {"exitCode": "x"}}}',
        ]
        await peer.send(b"".join(frame(MSG, sid, g) for g in garbage) + frame(END, sid, b'{"error": "boom"}'))
        ran = await asyncio.wait_for(run, 5)
        assert ran.code == -1 and len(ran.output) <= OUTPUT_TAIL + 64 * 1024 and ran.output.endswith("boom")
        assert ran.failure == "command failed: unknown: boom"
        assert not link.channel.closed.is_set()
    finally:
        link.close("done")
        peer.close()


# -- from inside a real sandbox, as root ----------------------------------------------------------
ATTACK = r"""
import os, socket, struct, sys, time

def channel_fd():
    # The agent dup'ed its stdout (the channel to the host) to a close-on-exec fd; root opens it again.
    for name in os.listdir("/proc/1/fd"):
        fd = int(name)
        link = os.readlink(f"/proc/1/fd/{fd}")
        with open(f"/proc/1/fdinfo/{fd}") as f:
            flags = int(f.read().split("flags:")[1].split()[0], 8)
        if fd > 2 and link.startswith("host:") and flags & 3 == os.O_WRONLY:
            return os.open(f"/proc/1/fd/{fd}", os.O_WRONLY)
    raise SystemExit("no channel fd")

def frame(kind, sid, payload=b""):
    return struct.pack("!BII", kind, sid, len(payload)) + payload

def write(data):
    view = memoryview(data)
    while view:
        view = view[os.write(out, view):]

out = channel_fd()
case, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
connect = ('{"m":"egress.connect","p":{"host":"%s","port":%d}}' % (host, port)).encode()
if case == "huge-length":
    write(frame(3, 1, b"")[:5] + struct.pack("!I", 3 * 2**29))  # DATA, 1.5 GiB
    zeros = bytes(2**20)
    for _ in range(1024):
        write(zeros)
elif case == "stream-flood":
    for n in range(1000):
        write(frame(1, 1_000_000 + 2 * n, connect))
elif case == "over-credit":
    sid = 2_000_000
    write(frame(1, sid, connect))
    time.sleep(2)  # the host has connected and answered; its listener never reads
    data = frame(3, sid, bytes(256 * 1024))
    for _ in range(256):
        write(data)
elif case == "unknown-kind":
    write(frame(9, 1))
elif case == "not-json":
    write(frame(7, 0, b'{"op": "pong", "t": NaN}'))
time.sleep(60)
"""


def rss_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


@pytest.fixture(scope="module")
def silent_listener() -> Iterator[tuple[str, int]]:
    """A TCP listener on this node's own address that accepts and never reads."""
    import socket
    import threading

    listener = socket.create_server((host_address(), 0), backlog=2048)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield host_address(), int(listener.getsockname()[1])
    listener.close()
    for conn in held:
        conn.close()


def gone_within(api: httpx.Client, sandbox_id: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if api.get(f"/sandboxes/{sandbox_id}").status_code == 404:
            return True
        time.sleep(0.5)
    return False


@pytest.mark.sandbox
@pytest.mark.parametrize("case", ["huge-length", "stream-flood", "over-credit", "unknown-kind", "not-json"])
def test_hostile_frames_from_sandbox_root_remove_that_sandbox_only(
    e2b_env: Server, api: httpx.Client, silent_listener: tuple[str, int], case: str
) -> None:
    from e2b import Sandbox

    ip, port = silent_listener
    network = {"allow_out": [f"{ip}/32"]}  # the attacker's streams reach a listener that never reads
    neighbour = Sandbox.create(timeout=300)
    victim = Sandbox.create(timeout=300, network=network)
    try:
        victim.files.write("/tmp/attack.py", ATTACK)
        pid = e2b_env.proc.pid
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS
        before = rss_kib(pid, "VmRSS")
        victim.commands.run(f"python3 /tmp/attack.py {case} {ip} {port}", user="root", background=True)
        assert gone_within(api, victim.sandbox_id, 30), f"{case}: the attacked sandbox is still there"
        peak = rss_kib(pid, "VmHWM")
        assert peak - before < 256 * 1024, f"{case}: the server grew from {before} to {peak} KiB"
        assert neighbour.commands.run("echo still here").stdout.strip() == "still here"
        assert api.get("/health").status_code == 200
        assert "protocol violation" in e2b_env.log.read_text()
    finally:
        neighbour.kill()
        try:
            victim.kill()
        except Exception:
            pass


WS_FLOOD = r"""
import base64, hashlib, socket, sys
server = socket.create_server(("127.0.0.1", int(sys.argv[1])))
while True:
    conn, _ = server.accept()
    head = b""
    while b"\r\n\r\n" not in head:
        head += conn.recv(4096)
    if b"sec-websocket-key" not in head.lower():  # a plain request: the port is up
        conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        conn.close()
        continue
    key = [l.split(b":", 1)[1].strip() for l in head.split(b"\r\n") if l.lower().startswith(b"sec-websocket-key:")][0]
    accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
    conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n")
    chunk = b"x" * 65536
    def fragment(opcode):  # FIN never set: one text message that never ends
        return bytes([opcode, 127]) + len(chunk).to_bytes(8, "big") + chunk
    try:
        conn.sendall(fragment(0x1))
        for _ in range(16 * 1024):  # 1 GiB
            conn.sendall(fragment(0x0))
    except OSError:
        pass
    conn.close()
"""


@pytest.mark.sandbox
def test_a_never_ending_websocket_message_from_a_sandbox_port_is_cut_off(e2b_env: Server) -> None:
    from e2b import Sandbox
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect as ws_connect

    from tests.api.test_proxy import wait_for_port

    sbx = Sandbox.create(timeout=300)
    try:
        sbx.files.write("/home/user/flood.py", WS_FLOOD)
        sbx.commands.run("python3 /home/user/flood.py 8766", background=True)
        routed = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8766"}
        wait_for_port(f"{e2b_env.url}/", routed)
        pid = e2b_env.proc.pid
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        before = rss_kib(pid, "VmRSS")
        with ws_connect(e2b_env.url.replace("http", "ws", 1) + "/", additional_headers=routed) as ws:
            with pytest.raises(ConnectionClosed) as exc:
                ws.recv(timeout=120)
        assert exc.value.rcvd is not None and exc.value.rcvd.code == 1009  # message too big
        peak = rss_kib(pid, "VmHWM")
        assert peak - before < 256 * 1024, f"the server grew from {before} to {peak} KiB"
        assert sbx.commands.run("echo fine").stdout.strip() == "fine"
    finally:
        sbx.kill()


@pytest.mark.sandbox
def test_sandbox_root_cannot_fill_the_hosts_disk_through_the_agents_stderr(e2b_env: Server) -> None:
    from e2b import Sandbox

    def agent_logs() -> int:
        return sum(p.stat().st_size for p in e2b_env.data_dir.glob("runtime/instances/*/agent.log"))

    sbx = Sandbox.create(timeout=300)
    try:
        before = agent_logs()
        r = sbx.commands.run("dd if=/dev/zero of=/proc/1/fd/2 bs=1M count=64 2>&1 | tail -1", user="root")
        assert "copied" in r.stdout or "No such" in r.stdout or "denied" in r.stdout, r.stdout
        assert agent_logs() - before < 2**20
        assert sbx.commands.run("echo fine").stdout.strip() == "fine"
    finally:
        sbx.kill()
