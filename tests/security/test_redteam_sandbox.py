"""Red-team variants of issue 10 on the sandbox-facing side: the channel, egress and envd as a
hostile sandbox (or a hostile agent answering the host) shapes them, beyond the cases the
first fixes were written against.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gzip
import ipaddress
import logging
import os
import socket
import struct
import threading
import time
import tracemalloc
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from aenv.channel import CTRL, DATA, END, ITEM_FLOOR, MAX_GUEST_STREAMS, MSG, OPEN, Channel, Stream
from aenv.node.agentlink import AgentLink
from aenv.node.egress import EgressPolicy, Guest
from tests.channel.test_channel import pipe_pair
from tests.conftest import API_KEY, Server
from tests.node.test_egress import host_address
from tests.security.test_api_hostile import envd  # noqa: F401  (a fixture)
from tests.security.test_channel_hostile import RawPeer, frame, refuse_everything

MIB = 2**20
WINDOW = MIB


# -- the channel: what a hostile peer makes the host hold ------------------------------------------
async def never_read(stream: Stream) -> None:
    await asyncio.sleep(3600)


@pytest.fixture()
async def stalled_host() -> AsyncIterator[tuple[Channel, RawPeer]]:
    """The host's channel as AgentLink sets it up (a smaller window, for speed) whose handlers of
    guest streams never read."""
    host_end, peer_end = await pipe_pair()
    channel = Channel(on_open=never_read, window=WINDOW, max_peer_streams=MAX_GUEST_STREAMS)
    channel.attach(*host_end)
    peer = RawPeer(*peer_end)
    yield channel, peer
    channel.close()
    peer.close()


async def settled(channel: Channel, stream_ids: list[int], count: int) -> None:
    """Until the host has queued ``count`` items on each stream (the pipe is drained)."""
    for _ in range(600):
        streams = [channel._streams.get(sid) for sid in stream_ids]
        if channel.closed.is_set() or all(s is not None and s._queued >= count for s in streams):
            return
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("shape", ["messages", "alternating"])
async def test_queued_small_frames_cost_their_bytes_on_every_stream(
    stalled_host: tuple[Channel, RawPeer], shape: str
) -> None:
    """Just under the item limit, one-byte messages (or one-byte messages and data frames in turn,
    so that nothing joins) on streams nobody reads: the host holds their bytes and a few bytes
    each, not an object each (~100 bytes: 49 MiB per stream of the default window's 512 KiB sent,
    and a sandbox may open 256 streams)."""
    channel, peer = stalled_host
    count = WINDOW // ITEM_FLOOR - 1
    sids = [1000 + 2 * n for n in range(3)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for sid in sids:
            await peer.send(frame(OPEN, sid, b'{"m": "egress.connect", "p": {}}'))
            one = frame(MSG, sid, b"7")
            both = one + frame(DATA, sid, b"x")
            await peer.send(one * count if shape == "messages" else both * (count // 2))
        await settled(channel, sids, count - 1)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert not channel.closed.is_set(), channel.close_reason
    assert grown < 2 * MIB * len(sids), f"{grown / MIB:.0f} MiB for {len(sids)} streams"
    stream = channel._streams[sids[0]]
    for n in range(1000):  # and every item comes out as it was sent
        item = await stream.recv()
        if shape == "messages" or n % 2 == 0:
            assert (item.kind, item.msg) == (MSG, 7)
        else:
            assert (item.kind, item.data) == (DATA, b"x")


async def test_a_held_end_costs_its_bytes_not_its_decoded_tree(stalled_host: tuple[Channel, RawPeer]) -> None:
    """An END the consumer has not read yet is kept as the bytes that came (4 MiB of ``{}`` is
    ~90 MiB of dicts once decoded), and decoded when read."""
    channel, peer = stalled_host
    streams = [await channel.open("fs.read", {}) for _ in range(3)]
    body = b'{"result": [' + b",".join([b"{}"] * (4 * MIB // 3 - 10)) + b"]}"
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for stream in streams:
            await peer.send(frame(END, stream.id, body))
        for _ in range(200):
            if all(s.remote_ended for s in streams):
                break
            await asyncio.sleep(0.05)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert all(s.remote_ended for s in streams) and not channel.closed.is_set()
    assert grown < 3 * 8 * MIB, f"{grown / MIB:.0f} MiB held for three ENDs of {len(body) / MIB:.0f} MiB"
    assert len(await streams[0].result()) == 4 * MIB // 3 - 10


# -- egress: a guest that ends its streams cannot keep host connections past its limit ------------
@pytest.fixture()
def silent_listener() -> Iterator[tuple[str, int, list[socket.socket]]]:
    """A listener on this node's address that accepts and never reads; the connections it holds."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    listener.bind((host_address(), 0))
    listener.listen(64)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield host_address(), int(listener.getsockname()[1]), held
    listener.close()
    for conn in held:
        conn.close()


def closed_by_host(conn: socket.socket) -> bool:
    """Whether the host closed its end: what it sent is read first (a FIN comes after the data)."""
    conn.settimeout(5)
    try:
        while conn.recv(MIB):
            pass
    except OSError:
        return False
    return True


async def test_ended_egress_streams_release_their_connections_and_data(
    silent_listener: tuple[str, int, list[socket.socket]],
) -> None:
    """Open a connection to a port that never reads, fill it until the host holds data for it,
    end the stream, again and again: each END frees the guest's slot, so the host must let the
    connection and what it holds go too, or a guest holds any number of them."""
    addr, port, held = silent_listener
    window, limit, rounds = 256 * 1024, 3, 2
    host_end, guest_end = await pipe_pair()
    policy = EgressPolicy.of(True, {"allowOut": [f"{addr}/32"]})
    host = Channel(on_open=Guest("sbx", lambda: policy), window=window, max_peer_streams=limit)
    guest = Channel(first_stream_id=2, window=window)
    host.attach(*host_end)
    guest.attach(*guest_end)
    try:
        for _ in range(rounds):
            for _ in range(limit):
                stream = await guest.open("egress.connect", {"host": addr, "port": port})
                assert (await asyncio.wait_for(stream.recv(), 10)).kind == MSG  # connected
                with pytest.raises(TimeoutError):  # until the host stops granting credit
                    await asyncio.wait_for(stream.send_data(bytes(256 * MIB)), 2)
                await stream.end()
        for _ in range(100):
            if not host._tasks:
                break
            await asyncio.sleep(0.1)
        assert not host._tasks, f"{len(host._tasks)} egress handlers outlive their streams"
        assert len(held) == rounds * limit and all(closed_by_host(conn) for conn in held)
        assert not host.closed.is_set()
    finally:
        host.close()
        guest.close()


# -- egress: IPv6 spellings of addresses the policy keeps closed ------------------------------------
@pytest.mark.parametrize(
    "literal",
    ["2002:a00:1::", "2002:c0a8:101::1", "2002:7f00:1::", "64:ff9b::a00:1", "64:ff9b::7f00:1", "::ffff:0:a00:1"],
)
def test_ipv6_that_carries_an_inside_ipv4_address_stays_closed(literal: str) -> None:
    """6to4 (2002::/16) and NAT64 (64:ff9b::/96) addresses lead to the IPv4 address inside them:
    the catch-all or internet access must not open a private or loopback address through them."""
    addr = ipaddress.ip_address(literal)
    for policy in (EgressPolicy.of(True, None), EgressPolicy.of(True, {"allowOut": ["0.0.0.0/0"]})):
        assert policy.check(literal, addr) is not None, policy


# -- a hostile agent's answers, as the host takes them ------------------------------------------
class Answering:
    """An AgentLink stand-in whose agent answers every call with ``answer``."""

    def __init__(self, answer: object) -> None:
        self.answer = answer

    async def call(self, method: str, params: object = None) -> object:
        return self.answer


@pytest.mark.parametrize(
    "answer",
    [
        ["killed"],
        "killed",
        {"killed": ["1000"]},
        {"killed": {"1000": "x" * 100_000}},
        {"killed": {"1000\n2026-01-01 00:00:00 ERROR aenv.node forged": 5}},
        {"killed": {str(n): n for n in range(1, 100_000)}},
    ],
    ids=["list", "string", "list-of-uids", "huge-count", "forged-line", "many-uids"],
)
async def test_a_contain_answer_cannot_fail_the_check_or_write_the_nodes_log(
    answer: object, caplog: pytest.LogCaptureFixture
) -> None:
    from aenv.node.housekeeping import _contain

    with caplog.at_level(logging.INFO, logger="aenv.node"):
        await _contain("sbx", Answering(answer), 900, 1000)  # type: ignore[arg-type]
    for record in caplog.records:
        text = record.getMessage()
        assert "\n" not in text and len(text) < 1000, text[:200]


# -- envd on a real sandbox: what a client asks of a big or deep tree is an answer, not a 500 ------
def run_as_root(client: httpx.Client, cmd: str) -> None:
    r = client.post(
        "/process.Process/Start",
        json={"process": {"cmd": "/bin/sh", "args": ["-c", cmd]}},
        headers={"content-type": "application/json", "authorization": "Basic cm9vdDo="},
        timeout=120,
    )
    assert r.status_code == 200, r.text


@pytest.mark.sandbox
def test_listing_a_tree_too_large_for_one_answer_is_a_client_error(
    envd: tuple[httpx.Client, str],  # noqa: F811
) -> None:
    """ListDir of / at depth 100 is more than one answer holds: a 4xx that says so, not an internal
    error blaming the disk quota (the answer's size limit was taken for a full disk)."""
    client, _ = envd
    r = client.post("/filesystem.Filesystem/ListDir", json={"path": "/", "depth": 100}, timeout=120)
    assert r.status_code == 400 and r.json()["code"] == "out_of_range", r.text
    assert "disk" not in r.json()["message"] and "more than the limit" in r.json()["message"], r.text
    assert client.post("/filesystem.Filesystem/ListDir", json={"path": "/home", "depth": 2}).status_code == 200


@pytest.mark.sandbox
def test_a_tree_deeper_than_the_recursion_limit_is_listed_watched_and_removed_without_5xx(
    envd: tuple[httpx.Client, str],  # noqa: F811
) -> None:
    client, _ = envd
    deep = "/home/user/deep/" + "/".join(["d"] * 1500)
    run_as_root(client, f"mkdir -p {deep}")
    assert client.post("/filesystem.Filesystem/Stat", json={"path": deep}).status_code == 200
    r = client.post("/filesystem.Filesystem/ListDir", json={"path": "/home/user/deep", "depth": 5000}, timeout=120)
    assert r.status_code == 200, r.text
    assert len(r.json()["entries"]) == 1500 and r.json()["entries"][-1]["path"] == deep
    for path, msg in [
        ("/filesystem.Filesystem/CreateWatcher", {"path": "/home/user/deep", "recursive": True}),
        ("/filesystem.Filesystem/Remove", {"path": "/home/user/deep"}),
    ]:
        r = client.post(path, json=msg, timeout=120)
        assert r.status_code < 500, (path, r.status_code, r.text)
    assert client.post("/filesystem.Filesystem/Stat", json={"path": "/home/user"}).status_code == 200


@pytest.mark.sandbox
@pytest.mark.parametrize(
    "body",
    [
        {"name": "redteam-bool", "cpuCount": True},
        {"name": "redteam-bool", "memoryMB": True},
        {"name": "redteam-bool", "cpuCount": 1.5},
        {"name": "redteam-bool", "memoryMB": "512"},
        {"name": "redteam-bool", "minFreeDiskMB": False},
    ],
)
def test_template_numbers_are_numbers(api: httpx.Client, body: dict[str, object]) -> None:
    r = api.post("/v3/templates", json=body)
    assert r.status_code == 400 and r.json()["code"] == 400, r.text
    assert "redteam-bool" not in {t.get("name") for t in api.get("/templates").json()}


# -- slow clients: a request's head and a control-plane body have a deadline -------------------------
def _whole(answers: bytes) -> bool:
    """Whether the last answer in ``answers`` has all of its body (its head and body may come in
    separate segments)."""
    head, sep, body = answers[answers.rindex(b"HTTP/1.1 ") :].partition(b"\r\n\r\n")
    if not sep:
        return False
    length = next(
        (line.split(b":", 1)[1] for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")), b"0"
    )
    return len(body) >= int(length)


def answer_within(server: Server, parts: list[bytes], gap: float, limit: float) -> tuple[bytes, float]:
    """Send ``parts`` ``gap`` seconds apart (then nothing); what the server answers (b"" if it
    closes) and when, or (b"<open>", limit) if the connection is still open after ``limit`` s."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port)) as conn:
        answers = b""
        for part in parts:
            try:
                conn.sendall(part)
            except OSError:
                return answers, time.monotonic() - started
            time.sleep(gap)
            conn.setblocking(False)
            try:
                answers += conn.recv(65536) or b"<closed>"
            except BlockingIOError:
                pass
            conn.setblocking(True)
        conn.settimeout(max(0.1, limit - (time.monotonic() - started)))
        before = answers.count(b"HTTP/1.1 ")
        try:
            while chunk := conn.recv(65536):
                answers += chunk
                if answers.count(b"HTTP/1.1 ") > before and _whole(answers):  # an answer: enough
                    break
        except TimeoutError:
            return answers + b"<open>", time.monotonic() - started
        return answers, time.monotonic() - started


def slow_client_deadlines(server: Server) -> tuple[float, float]:
    """The server's deadlines on a request's head and on a body's next byte (seconds)."""
    env = server.env or {}
    return float(env.get("AENV_HTTP_HEAD_TIMEOUT", 30)), float(env.get("AENV_HTTP_BODY_TIMEOUT", 60))


@pytest.mark.sandbox
def test_slow_heads_and_bodies_do_not_hold_connections(server: Server) -> None:
    """Half a head (no key needed), a byte of the next head every few seconds after a first
    request, and a control-plane body that never completes (plain and chunked) each held a
    connection and a file descriptor for good: the head is closed after AENV_HTTP_HEAD_TIMEOUT
    (30 s by default), the body is a 408 after AENV_HTTP_BODY_TIMEOUT (60 s)."""
    head, body = slow_client_deadlines(server)
    key = f"X-API-Key: {API_KEY}\r\n".encode()
    body_head = b"POST /sandboxes HTTP/1.1\r\nHost: x\r\n" + key + b"Content-Type: application/json\r\n"
    cases = {
        "half a head": ([b"GET /health HTTP/1.1\r\nHost: x\r\n"], 0.0, head + 15),
        "a byte now and then": ([b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"] + [b"G"] * 20, head / 8, head * 3 + 15),
        "a body that stops": ([body_head + b"Content-Length: 100\r\n\r\n{"], 0.0, body + 15),
        "a chunked body that stops": ([body_head + b"Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n"], 0.0, body + 15),
        # an idle kept-alive connection is not a slow head: clients' pools reuse them for minutes
        "idle between requests": ([b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"] * 2, head + 5, 2 * head + 15),
    }
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        futures = {name: pool.submit(answer_within, server, *case) for name, case in cases.items()}
        results = {name: future.result() for name, future in futures.items()}
    idle, _ = results.pop("idle between requests")
    assert idle.count(b"HTTP/1.1 200") == 2 and idle.endswith(b"<open>"), idle  # and still open
    for name, (answer, took) in results.items():
        assert not answer.endswith(b"<open>"), f"{name}: still open after {took:.0f}s"
    assert results["half a head"][0] == b""
    assert results["a byte now and then"][0].count(b"HTTP/1.1 200") == 1
    for name in ("a body that stops", "a chunked body that stops"):
        assert results[name][0].startswith(b"HTTP/1.1 408"), results[name][0][:200]
        assert b'"error_code":"request_timeout"' in results[name][0]


# -- the channel: a peer's frames take a share of the node's event loop, not all of it -------------
def nested(size: int, head: bytes, tail: bytes) -> bytes:
    """A JSON document of about ``size`` bytes that is dear to check: empty lists, one after another."""
    return head + b",".join([b"[]"] * (size // 3)) + tail


FLOODS = {
    "open": frame(OPEN, 0, nested(4 * MIB - 64, b'{"m": "x", "p": {"a": [', b"]}}")),
    "ctrl": frame(CTRL, 0, nested(MIB - 64, b'{"op": "x", "a": [', b"]}")),
    "late-end": frame(END, 999_999, nested(4 * MIB - 64, b'{"a": [', b"]}")),
}


@pytest.mark.parametrize("flood", list(FLOODS))
async def test_a_flood_of_frames_leaves_the_event_loop_to_everyone_else(flood: str) -> None:
    """Frames that are dear to check (4 MiB of nested empty lists took 280 ms) kept the node's
    single event loop busy: every sandbox and the API waited (~10 ticks of ~390 ran)."""
    host_end, peer_end = await pipe_pair()
    link = AgentLink("sbx-under-test", serve=refuse_everything)
    link.channel.attach(*host_end)
    peer = RawPeer(*peer_end)
    sid = 2

    async def attack() -> None:
        nonlocal sid
        data = FLOODS[flood]
        while True:
            if flood == "open":  # a new stream each time (the host refuses and forgets it)
                data = data[:1] + struct.pack("!I", sid) + data[5:]
                sid += 2
            await peer.send(data)

    flooding = asyncio.ensure_future(attack())
    try:
        await asyncio.sleep(1)  # the flood is under way
        ticks, started = 0, time.monotonic()
        while time.monotonic() - started < 4:
            await asyncio.sleep(0.01)
            ticks += 1
    finally:
        flooding.cancel()
        link.channel.close()
        peer.close()
    assert ticks > 150, f"the loop ran {ticks} times in 4 s of 10 ms sleeps: the {flood} flood held it"


# -- /files: an upload that fails leaves nothing, by the time the client hears it failed -------------
@pytest.mark.sandbox
def test_a_failed_upload_is_gone_before_its_answer(envd: tuple[httpx.Client, str]) -> None:  # noqa: F811
    """The agent removed a refused upload's partial file only after the client had its 400: a GET
    right after the answer found an empty file (gzip that is not, or stops short; multipart with
    or without a path whose body stops inside the file part, which was even taken as a whole file)."""
    from tests.security.test_api_hostile import GZIP, MULTIPART, _multipart

    client, _ = envd
    cut = _multipart(b"p.txt", b"x" * 300_000).rsplit(b"\r\n--", 1)[0]  # the closing boundary never comes
    compressed = gzip.compress(os.urandom(200_000))
    uploads = [
        ({"path": "/home/user/z"}, b"not gzip", GZIP),
        ({"path": "/home/user/z"}, compressed[: len(compressed) // 2], GZIP),
        ({"path": "/home/user/z"}, cut, {"content-type": MULTIPART}),
        ({}, cut, {"content-type": MULTIPART}),
    ]
    for _ in range(3):
        for n, (params, body, headers) in enumerate(uploads):
            r = client.post("/files", params=params, content=body, headers=headers)
            assert r.status_code == 400, (n, r.text)
            for path in ("/home/user/z", "/home/user/p.txt"):
                assert client.get("/files", params={"path": path}).status_code == 404, (n, path)


# -- egress: new rules apply to the connections already open -----------------------------------------
@pytest.fixture()
def echo_listener() -> Iterator[tuple[str, int]]:
    """A TCP echo server on this node's own address."""
    listener = socket.create_server((host_address(), 0))

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield host_address(), int(listener.getsockname()[1])
    listener.close()


async def test_rules_that_no_longer_allow_an_open_connection_end_it(echo_listener: tuple[str, int]) -> None:
    """allowOut named the node's address, a connection went out; the rules change: a connection
    they no longer allow ends at once (a denied destination stayed reachable for as long as the
    connection lasted), one they still allow goes on."""
    addr, port = echo_listener
    rules: dict[str, object] = {"allowOut": [f"{addr}/32"]}
    host_end, guest_end = await pipe_pair()
    served = Guest("sbx", lambda: EgressPolicy.of(False, rules))
    host = Channel(on_open=served, max_peer_streams=MAX_GUEST_STREAMS)
    guest = Channel(first_stream_id=2)
    host.attach(*host_end)
    guest.attach(*guest_end)
    try:
        stream = await guest.open("egress.connect", {"host": addr, "port": port})
        assert (await asyncio.wait_for(stream.recv(), 10)).kind == MSG
        await stream.send_data(b"ping")
        assert (await asyncio.wait_for(stream.recv(), 5)).data == b"ping"
        assert served.recheck() == 0  # nothing changed: nothing ends
        rules["allowOut"] = [f"{addr}/32", "203.0.113.0/24"]
        assert served.recheck() == 0
        rules["allowOut"] = ["203.0.113.0/24"]
        assert served.recheck() == 1
        item = await asyncio.wait_for(stream.recv(), 5)
        assert item.kind == END and item.msg["error"]["code"] == "permission_denied", item.msg
        for _ in range(50):
            if not host._tasks and not served.connections:
                break
            await asyncio.sleep(0.1)
        assert not host._tasks and not served.connections
    finally:
        host.close()
        guest.close()


HOLD_OPEN = r"""
import socket, sys, time
s = socket.create_connection(("127.0.0.1", 3128))
s.sendall(f"CONNECT {sys.argv[1]} HTTP/1.1\r\nHost: {sys.argv[1]}\r\n\r\n".encode())
assert s.recv(4096).startswith(b"HTTP/1.1 200"), "not connected"
s.sendall(b"ping")
assert s.recv(4) == b"ping"
print("connected", flush=True)
s.settimeout(60)
started = time.monotonic()
while True:
    try:
        data = s.recv(4096)
    except OSError as exc:
        data = b""
    if not data:
        break
print(f"closed after {time.monotonic() - started:.1f}s", flush=True)
"""


@pytest.mark.sandbox
def test_update_network_ends_an_open_connection_it_no_longer_allows(
    e2b_env: Server, api: httpx.Client, echo_listener: tuple[str, int]
) -> None:
    from e2b import Sandbox

    addr, port = echo_listener
    sbx = Sandbox.create(timeout=300, allow_internet_access=False, network={"allow_out": [f"{addr}/32"]})
    try:
        sbx.files.write("/tmp/hold.py", HOLD_OPEN)
        said: list[str] = []
        handle = sbx.commands.run(f"python3 /tmp/hold.py {addr}:{port}", background=True)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the sync SDK hands output over in wait()
            result = pool.submit(handle.wait, on_stdout=said.append)
            deadline = time.monotonic() + 30
            while "connected" not in "".join(said) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert "connected" in "".join(said), said
            r = api.put(f"/sandboxes/{sbx.sandbox_id}/network", json={"allowOut": ["203.0.113.0/24"]})
            assert r.status_code == 204, r.text
            out = result.result(timeout=30).stdout
        assert "closed after" in out and float(out.split()[-1][:-1]) < 10, out
    finally:
        sbx.kill()


# -- Connect client streams: a body of tiny envelopes does not hold the node's loop ----------------
class Body:
    """A request whose body arrives in the given chunks (what EnvelopeReader reads)."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    def stream(self) -> AsyncIterator[bytes]:
        async def chunks() -> AsyncIterator[bytes]:
            for chunk in self.chunks:
                yield chunk

        return chunks()


async def test_a_client_stream_of_empty_envelopes_leaves_the_loop_to_everyone_else() -> None:
    """StreamInput reads envelopes one after another: 1 MiB of empty ones (a chunk the size a
    client can make the server read at once, several times over) took 3 s, the loop held."""
    from aenv.api.connect import ENVELOPE, EnvelopeReader
    from aenv.api.envd import STREAM_INPUT

    empty = ENVELOPE.pack(0, 0)
    reader = EnvelopeReader(Body([empty * (MIB // 5)] * 4), STREAM_INPUT)  # type: ignore[arg-type]
    gaps: list[float] = []

    async def ticker() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.005)
            gaps.append(time.monotonic() - last)
            last = time.monotonic()

    ticking = asyncio.ensure_future(ticker())
    started, taken = time.monotonic(), 0
    try:
        while await reader.next() is not None:
            taken += 1
    finally:
        ticking.cancel()
    assert taken == 4 * (MIB // 5)
    assert time.monotonic() - started < 30, "reading the envelopes took too long"
    assert gaps and max(gaps) < 0.5, f"the loop stood still for {max(gaps or [0]):.1f}s"


# -- egress: slow name lookups do not take the threads the node works on -----------------------------
async def test_slow_name_lookups_leave_the_nodes_default_executor_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """Names whose servers never answer hold a lookup's thread for the resolver's whole timeout: a
    sandbox asking for many filled the loop's default executor, and every mount of every restore
    (and the node's other file work) queued behind them."""
    from aenv.node.egress import resolve

    def unanswered(*args: object, **kwargs: object) -> object:
        time.sleep(3)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", unanswered)
    lookups = [asyncio.ensure_future(resolve(f"n{n}.slow.example", 443)) for n in range(40)]
    await asyncio.sleep(0.2)
    started = time.monotonic()
    await asyncio.wait_for(asyncio.to_thread(lambda: None), 30)
    waited = time.monotonic() - started
    await asyncio.gather(*lookups, return_exceptions=True)
    assert waited < 1, f"the node's own work waited {waited:.1f}s behind name lookups"


async def test_a_sandbox_whose_lookups_never_end_waits_for_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Egress lookups share a pool of threads: one sandbox holds at most a few of them, so
    another sandbox's names still resolve while the first floods names that never answer."""
    from aenv.node.egress import Guest

    real = socket.getaddrinfo

    def lookup(host: str, *args: object, **kwargs: object) -> object:
        if host.endswith(".slow.example"):
            time.sleep(3)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real("127.0.0.1", *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    policy = EgressPolicy.of(True, None)
    flooding, neighbour = Guest("flooding", lambda: policy), Guest("neighbour", lambda: policy)
    slow = [asyncio.ensure_future(flooding._resolve(f"n{n}.slow.example", 443)) for n in range(40)]
    await asyncio.sleep(0.2)
    started = time.monotonic()
    assert await asyncio.wait_for(neighbour._resolve("fine.example", 443), 30)
    waited = time.monotonic() - started
    for task in slow:
        task.cancel()
    await asyncio.gather(*slow, return_exceptions=True)
    assert waited < 1, f"the neighbour's lookup waited {waited:.1f}s behind another sandbox's"


@pytest.mark.sandbox
def test_envd_bodies_that_stop_are_let_go(server: Server, envd: tuple[httpx.Client, str]) -> None:  # noqa: F811
    """An upload (or a Connect request) whose body stops coming held its connection, and the
    agent's write, for good: envd bodies may not go AENV_HTTP_BODY_TIMEOUT (60 s by default) without
    a byte (408, or deadline_exceeded), and what the stopped upload wrote is gone."""
    client, sid = envd
    limit = slow_client_deadlines(server)[1] + 20
    routing = "".join(f"{k}: {v}\r\n" for k, v in client.headers.items() if k.lower().startswith(("e2b-", "x-access")))
    head = f"Host: x\r\n{routing}".encode()
    upload = b"POST /files?path=/home/user/stalled HTTP/1.1\r\n" + head + b"Content-Length: 1000000\r\n\r\n"
    rpc = b"POST /filesystem.Filesystem/Stat HTTP/1.1\r\n" + head + b"Content-Type: application/json\r\n"
    cases = {
        "upload": ([upload + b"x" * 100_000], 0.0, limit),
        "chunked upload": (
            [upload.replace(b"Content-Length: 1000000", b"Transfer-Encoding: chunked") + b"5\r\nxxxxx\r\n"],
            0.0,
            limit,
        ),
        "rpc": ([rpc + b"Content-Length: 100\r\n\r\n{"], 0.0, limit),
    }
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        futures = {name: pool.submit(answer_within, server, *case) for name, case in cases.items()}
        results = {name: future.result() for name, future in futures.items()}
    for name, (answer, took) in results.items():
        assert not answer.endswith(b"<open>"), f"{name}: still open after {took:.0f}s"
    assert results["upload"][0].startswith(b"HTTP/1.1 408"), results["upload"][0][:300]
    assert results["chunked upload"][0].startswith(b"HTTP/1.1 408"), results["chunked upload"][0][:300]
    assert results["rpc"][0].startswith(b"HTTP/1.1 504"), results["rpc"][0][:300]  # deadline_exceeded
    assert client.get("/files", params={"path": "/home/user/stalled"}).status_code == 404


@pytest.mark.sandbox
def test_a_body_to_a_sandbox_port_that_stops_is_let_go(server: Server, sandbox: Any) -> None:
    """Sandbox ports are public: a client that sent a head and then a byte of its body held a
    connection, a tunnel and the agent's relay threads for good (nginx's client_body_timeout)."""
    from tests.api.test_proxy import wait_for_port

    sandbox.commands.run("python3 -m http.server 8123 --directory /tmp", background=True)
    routed = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "8123"}
    wait_for_port(f"{server.url}/", routed)
    head = "".join(f"{k}: {v}\r\n" for k, v in routed.items()).encode()
    request = b"POST /x HTTP/1.1\r\nHost: x\r\n" + head + b"Content-Length: 1000\r\n\r\nx"
    answer, took = answer_within(server, [request], 0.0, slow_client_deadlines(server)[1] + 20)
    assert not answer.endswith(b"<open>"), f"still open after {took:.0f}s"
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]


async def test_refused_attempts_do_not_fill_the_nodes_log(caplog: pytest.LogCaptureFixture) -> None:
    """A sandbox decides how often it is refused: a line per attempt let it write the node's log at
    its own pace. Refusals are counted (the metric) and logged a line per 10 s at most."""
    host_end, guest_end = await pipe_pair()
    host = Channel(on_open=Guest("sbx", lambda: EgressPolicy.of(False, None)), max_peer_streams=MAX_GUEST_STREAMS)
    guest = Channel(first_stream_id=2)
    host.attach(*host_end)
    guest.attach(*guest_end)
    try:
        with caplog.at_level(logging.INFO, logger="aenv.egress"):
            for n in range(300):
                stream = await guest.open("egress.connect", {"host": f"x{n}.example", "port": 443})
                item = await asyncio.wait_for(stream.recv(), 5)
                assert item.kind == END and item.msg["error"]["code"] == "permission_denied"
    finally:
        host.close()
        guest.close()
    denied = [r for r in caplog.records if r.getMessage().startswith("egress denied")]
    assert 1 <= len(denied) <= 2, len(denied)
