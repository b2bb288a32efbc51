"""The HTTP layer of nodes and gateways (aenv/api/connections.py), as a client without the API key
shapes it: request heads are bounded in bytes and in header lines while they arrive (431, JSON,
then closed), each pipelined request with a budget of its own; a flood of half-sent heads closes
its own oldest connections, so /health answers and the server's descriptors stay bounded; idle
kept-alive connections are bounded too. A flood (silent connections, stalled heads, idle ones,
from one address or many) never costs a working connection of another client's: a kept-alive
client, or a gateway's pool to its node. Through the port proxy, a sandbox's server sees header
names as the client wrote them, and every answer carries one ``date`` and one ``server``.

One busybox node in cluster mode (one etcd member) and one gateway in front of it, for the module.
Each attack here was seen failing on the code before the bounds (the node and gateway then took
every header line, held every connection, lowercased names and doubled date and server).
"""

from __future__ import annotations

import json
import os
import resource
import select
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from tests.cluster.cluster import Gateway, start_gateway, wait_for_nodes
from tests.cluster.conftest import require_etcd
from tests.cluster.etcd import EtcdCluster
from tests.conftest import API_KEY, Server, e2b_client, start_busybox_node

pytestmark = pytest.mark.sandbox

MIB = 2**20
MAX_HEAD = 64 * 1024  # AENV_HTTP_MAX_HEAD_KB's default
MAX_HEADERS = 256  # AENV_HTTP_MAX_HEADERS's default
PER_IP = 256  # AENV_HTTP_MAX_PENDING_PER_IP's default
PENDING = 1024  # AENV_HTTP_MAX_PENDING's default
MAX_IDLE = 200  # AENV_HTTP_MAX_IDLE, lowered for the module (default 4096)
NODE_ID = "http-layer"
LOW_SOFT_LIMIT = 1024  # the open-files soft limit node and gateway are started with (systemd's default)
PORT = 8080
# A raw echo server for busybox: answers with the request's head as it arrived, and a Date and a
# Server of its own.
ECHO = r"""#!/bin/sh
head=""
while IFS= read -r line; do
  head="$head$line
"
  [ "$line" = "$(printf '\r')" ] && break
done
printf 'HTTP/1.1 200 OK\r\nDate: Thu, 01 Jan 1970 00:00:00 GMT\r\nServer: echo-in-sandbox\r\n'
printf 'Content-Length: %d\r\nConnection: close\r\n\r\n%s' "${#head}" "$head"
"""


@dataclass
class Target:
    name: str
    port: int
    pid: int


@dataclass
class Stack:
    node: Server
    gateway: Gateway
    sandbox_id: str


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    require_etcd()
    etcd = EtcdCluster(1)
    etcd.start()
    node: Server | None = None
    gateway: Gateway | None = None
    try:
        limits = {"AENV_HTTP_MAX_IDLE": str(MAX_IDLE)}
        env = {"AENV_CLUSTER": etcd.url, "AENV_NODE_ID": NODE_ID, "AENV_SPARE_UPPERS": "0", **limits}
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (LOW_SOFT_LIMIT, hard))  # as systemd starts services
        try:
            node = start_busybox_node(tmp_path_factory.mktemp("httplayer") / "data", env)
            with pytest.MonkeyPatch.context() as mp:
                for key, value in limits.items():
                    mp.setenv(key, value)  # the gateway's environment is this one's
                gateway = start_gateway(etcd.url)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        wait_for_nodes(gateway, {NODE_ID})
        with pytest.MonkeyPatch.context() as mp:
            for _ in e2b_client(node, mp):
                sandbox = Sandbox.create(template="bb", timeout=600)
                sandbox.files.write("/tmp/echo.sh", ECHO)
                sandbox.commands.run("/bin/busybox chmod 755 /tmp/echo.sh")
                # timeout=0: E2B kills a command when its deadline (60 s by default) passes, background or not
                sandbox.commands.run(f"/bin/busybox nc -ll -p {PORT} -e /tmp/echo.sh", background=True, timeout=0)
        yield Stack(node, gateway, sandbox.sandbox_id)
    finally:
        if gateway is not None:
            gateway.stop()
        if node is not None:
            node.stop()
        etcd.stop()


@pytest.fixture(params=["node", "gateway"])
def target(request: pytest.FixtureRequest, stack: Stack) -> Target:
    if request.param == "node":
        return Target("node", stack.node.port, stack.node.proc.pid)
    return Target("gateway", int(stack.gateway.url.rsplit(":", 1)[1]), stack.gateway.proc.pid)


# -- helpers ---------------------------------------------------------------------------------------
def connect(target: Target) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", target.port), timeout=10)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def read_until_closed(conn: socket.socket, limit: float = 10) -> bytes:
    """What the server sends until it closes (or resets) the connection, or ``limit`` seconds."""
    got, deadline = b"", time.monotonic() + limit
    conn.settimeout(limit)
    try:
        while time.monotonic() < deadline and (chunk := conn.recv(65536)):
            got += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return got


def answers(raw: bytes) -> list[tuple[int, dict[str, list[str]], bytes]]:
    """The whole HTTP/1.1 answers in ``raw``, in order: status, headers (lowercased names), body."""
    found = []
    while raw.startswith(b"HTTP/1.1 ") and b"\r\n\r\n" in raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers: dict[str, list[str]] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers.setdefault(name.strip().lower(), []).append(value.strip())
        length = int(headers.get("content-length", ["0"])[0])
        if len(rest) < length:
            break
        found.append((int(lines[0].split()[1]), headers, rest[:length]))
        raw = rest[length:]
    return found


def answer_to(conn: socket.socket, data: bytes) -> tuple[int, dict[str, list[str]], bytes]:
    """Send ``data`` on a kept-alive connection and read the whole answer."""
    conn.sendall(data)
    got = b""
    while not answers(got):
        chunk = conn.recv(65536)
        assert chunk, f"closed after {got[:200]!r}"
        got += chunk
    return answers(got)[0]


def exchange(target: Target, data: bytes) -> list[tuple[int, dict[str, list[str]], bytes]]:
    with connect(target) as conn:
        conn.sendall(data)
        return answers(read_until_closed(conn))


def send_until_answered(target: Target, start: bytes, filler: bytes, cap: int = 4 * MIB) -> tuple[bytes, int]:
    """Send ``start``, then ``filler`` over and over until the server answers or closes, or
    ``cap`` bytes went out: what came back and how much was sent."""
    with connect(target) as conn:
        conn.sendall(start)
        sent = len(start)
        while sent < cap:
            if select.select([conn], [], [], 0.002)[0]:
                break
            try:
                conn.sendall(filler)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(filler)
        return read_until_closed(conn, 5), sent


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def settled_descriptors(pid: int, limit: float = 5) -> int:
    """The server's descriptors once they stop changing (the connections of an earlier test gone,
    or a flood's all accepted and read), within ``limit`` seconds."""
    deadline, last, same = time.monotonic() + limit, descriptors(pid), 0
    while time.monotonic() < deadline and same < 3:
        time.sleep(0.25)
        now = descriptors(pid)
        same = same + 1 if now == last else 0
        last = now
    return last


def descriptors_below(pid: int, before: int, bound: int, limit: float = 5) -> int:
    """The descriptors the server holds beyond ``before``, once fewer than ``bound`` or after
    ``limit`` seconds (shorter than the deadline on heads, 8 s here, which would close them all):
    the gate sheds a stalled head only once it has been quiet for a second, at its next sweep."""
    deadline = time.monotonic() + limit
    while (held := descriptors(pid) - before) >= bound and time.monotonic() < deadline:
        time.sleep(0.1)
    return held


def assert_refused_431(raw: bytes, words: str) -> None:
    got = answers(raw)
    assert got, f"no answer: {raw[:300]!r}"
    status, headers, body = got[0]
    assert status == 431, raw[:300]
    assert headers["content-type"] == ["application/json"] and headers["connection"] == ["close"]
    error = json.loads(body)
    assert error["code"] == 431 and words in error["message"], error


@pytest.fixture()
def many_files() -> Iterator[None]:
    """This test's own descriptor limit raised to its hard limit (thousands of connections)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


GET = b"GET /health HTTP/1.1\r\nHost: x\r\n"


def test_the_servers_raise_their_open_files_limit(target: Target) -> None:
    """Every connection is a descriptor: started with a soft limit of 1024 (which a flood of
    half-sent heads filled before), node and gateway raise it to their hard limit."""
    limits = Path(f"/proc/{target.pid}/limits").read_text().splitlines()
    soft, hard = next(line.split()[3:5] for line in limits if line.startswith("Max open files"))
    assert int(soft) > LOW_SOFT_LIMIT and soft == hard, limits


# -- heads: bounded while they arrive ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("start", "filler", "words"),
    [
        (GET, b"X-Pad-%d: " % 0 + b"v" * 48 + b"\r\n", "header lines"),  # the 900 MB finding's shape
        (GET + b"X-Big: ", b"v" * 8192, "head is larger"),  # one value httptools buffers whole
        (b"GET /health?q=", b"a" * 8192, "head is larger"),  # a URL without end
    ],
    ids=["header-lines", "one-value", "url"],
)
def test_a_head_past_its_bounds_is_refused_while_it_arrives(
    target: Target, start: bytes, filler: bytes, words: str
) -> None:
    before = rss_mib(target.pid)
    raw, sent = send_until_answered(target, start, filler)
    assert sent < MIB, f"{sent} bytes of head taken without an answer"
    assert_refused_431(raw, words)
    assert rss_mib(target.pid) - before < 32
    assert exchange(target, GET + b"Connection: close\r\n\r\n")[0][0] == 200  # and the server serves on


def test_header_lines_are_counted(target: Target) -> None:
    lines = b"".join(b"X-L%d: 1\r\n" % i for i in range(MAX_HEADERS + 1))
    assert_refused_431(read_from(target, GET + lines + b"\r\n"), "header lines")
    fits = b"".join(b"X-L%d: 1\r\n" % i for i in range(MAX_HEADERS - 10))
    assert exchange(target, GET + fits + b"Connection: close\r\n\r\n")[0][0] == 200


def read_from(target: Target, data: bytes) -> bytes:
    with connect(target) as conn:
        conn.sendall(data)
        return read_until_closed(conn)


def test_heads_within_the_bounds_are_served(target: Target) -> None:
    """A URL of 60 KiB (a signed envd URL with a long non-ASCII path is a few KiB) and 240 header lines."""
    long_url = b"GET /health?pad=" + b"%C3%A9" * 10_000 + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    assert exchange(target, long_url)[0][0] == 200
    lines = b"".join(b"X-Trace-%d: %s\r\n" % (i, b"t" * 100) for i in range(240))
    assert exchange(target, GET + lines + b"Connection: close\r\n\r\n")[0][0] == 200


def test_the_e2b_sdk_reaches_a_long_non_ascii_path(target: Target, stack: Stack) -> None:
    """A file path of nearly 4 KiB of two-byte characters, as the E2B SDK sends it (percent-encoded
    in the URL: 12 KiB), is well within the bound, through a node and through a gateway."""
    path = "/tmp/" + "/".join(["\u00e9" * 120] * 16)
    assert len(path.encode()) > 3800
    url = f"http://127.0.0.1:{target.port}"
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {"E2B_API_KEY": API_KEY, "E2B_API_URL": url, "E2B_SANDBOX_URL": url}.items():
            mp.setenv(key, value)
        sandbox = Sandbox.connect(stack.sandbox_id)
        sandbox.files.write(path, f"via the {target.name}")
        assert sandbox.files.read(path) == f"via the {target.name}"


def test_each_pipelined_request_has_its_own_budget(target: Target) -> None:
    """Three heads of 50 KiB sent back to back are each served; the fourth, past the bound, is a
    431 after the three answers; then the connection closes."""
    fine = GET + b"X-Pad: " + b"p" * 50_000 + b"\r\n\r\n"
    too_large = GET + b"X-Pad: " + b"p" * (MAX_HEAD + 4096) + b"\r\n\r\n"
    got = answers(read_from(target, fine * 3 + too_large))
    assert [status for status, _, _ in got] == [200, 200, 200, 431]
    # kept alive: a later head has a fresh budget too, and one past it is refused alone
    with connect(target) as conn:
        assert answer_to(conn, fine)[0] == 200
        conn.sendall(too_large)
        assert_refused_431(read_until_closed(conn), "head is larger")


def test_a_chunked_bodys_trailers_are_bounded(target: Target) -> None:
    """Trailer lines after a chunked body are header lines httptools buffers too: a body whose
    trailers never end (to a route that reads its body: a create, with the key) is refused with
    431 once they pass the head's bound, holding nothing."""
    start = (
        f"POST /sandboxes HTTP/1.1\r\nHost: x\r\nX-API-Key: {API_KEY}\r\nContent-Type: application/json\r\n".encode()
        + b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nX-Trailer: "
    )
    before = rss_mib(target.pid)
    raw, sent = send_until_answered(target, start, b"t" * 8192)
    assert sent < MIB, f"{sent} bytes of trailer taken"
    assert_refused_431(raw, "trailers")
    assert rss_mib(target.pid) - before < 32


# -- connections: a flood costs the flood ----------------------------------------------------------
def test_a_flood_of_half_sent_heads_leaves_health_answering(target: Target, many_files: None) -> None:
    """3000 connections from this address each send half a head and stop (4 clients x 5200 took a
    node to 15k descriptors and /health timed out): the server closes the flood's oldest, /health
    on a new connection answers, and the server holds a bounded number of descriptors."""
    before = settled_descriptors(target.pid)
    flood = []
    try:
        for i in range(3000):
            conn = socket.create_connection(("127.0.0.1", target.port), timeout=10)
            conn.sendall(GET + b"X-Slow-%d: " % i)
            flood.append(conn)
        held = descriptors_below(target.pid, before, PER_IP + 200)
        assert held < PER_IP + 200, f"{held} more descriptors held for the flood"
        r = httpx.get(f"http://127.0.0.1:{target.port}/health", timeout=5)
        assert r.status_code == 200
        closed = 0
        for conn in flood[:2000]:
            conn.settimeout(0.5)
            try:
                closed += conn.recv(1) == b""
            except (TimeoutError, ConnectionResetError):
                pass
        assert closed > 1500, f"only {closed} of the 2000 oldest were closed"
    finally:
        for conn in flood:
            conn.close()


def test_a_flood_of_silent_connections_is_bounded_too(target: Target, many_files: None) -> None:
    """Connections that send nothing may be a client opening thousands at once (it writes on each
    within seconds), and are kept longer: past four times AENV_HTTP_MAX_PENDING the oldest go."""
    before = settled_descriptors(target.pid)
    flood = []
    try:
        for _ in range(4 * PENDING + 600):
            flood.append(socket.create_connection(("127.0.0.1", target.port), timeout=10))
        held = settled_descriptors(target.pid) - before  # within the deadline on heads (8 s here)
        assert held < 4 * PENDING + 200, f"{held} more descriptors held for silent connections"
        assert httpx.get(f"http://127.0.0.1:{target.port}/health", timeout=5).status_code == 200
    finally:
        for conn in flood:
            conn.close()


def connect_from(address: str, port: int) -> socket.socket:
    """A connection to ``port`` from another loopback address (all of 127/8 is this machine's)."""
    conn = socket.socket()
    conn.bind((address, 0))
    conn.settimeout(10)
    conn.connect(("127.0.0.1", port))
    return conn


class Flood:
    """Connections that send nothing from one address, and half-sent heads from many: opened at
    once, then renewed (what the server closed is opened again) at each ``fill``."""

    def __init__(self, port: int, silent: int, stalled_addresses: int, stalled_each: int) -> None:
        self.port = port
        self.silent: list[socket.socket] = []
        self.stalled: list[socket.socket] = []
        self.sizes = (silent, stalled_addresses, stalled_each)

    def fill(self) -> None:
        silent, addresses, each = self.sizes
        self.silent = [c for c in self.silent if self._open(c)]
        while len(self.silent) < silent:
            self.silent.append(connect_from("127.0.0.2", self.port))
        self.stalled = [c for c in self.stalled if self._open(c)]
        have: dict[str, int] = {}
        for conn in self.stalled:
            have[conn.getsockname()[0]] = have.get(conn.getsockname()[0], 0) + 1
        for i in range(addresses):
            address = f"127.0.1.{i + 1}"
            for _ in range(each - have.get(address, 0)):
                conn = connect_from(address, self.port)
                conn.sendall(GET + b"X-Slow: ")
                self.stalled.append(conn)

    @staticmethod
    def _open(conn: socket.socket) -> bool:
        try:
            conn.setblocking(False)
            closed = conn.recv(1) == b""
        except BlockingIOError:
            closed = False
        except OSError:
            closed = True
        if closed:
            conn.close()
        else:
            conn.setblocking(True)
        return not closed

    def close(self) -> None:
        for conn in self.silent + self.stalled:
            conn.close()


@pytest.mark.parametrize("client", ["raw", "httpx"])
def test_a_flood_never_costs_a_working_kept_alive_connection(target: Target, client: str, many_files: None) -> None:
    """More than AENV_HTTP_MAX_PENDING connections from one address sending nothing, and half-sent
    heads from 40 others, renewed for longer than the silent ones' grace: a client on another
    address reusing one kept-alive connection gets every answer (seen failing: every second
    request on the reused connection was closed without one, as the gate shed the connection that
    had just sent a whole head and spared the silent flood)."""
    flood = Flood(target.port, silent=PENDING + 300, stalled_addresses=40, stalled_each=20)
    url = f"http://127.0.0.1:{target.port}/health"
    try:
        flood.fill()
        answered = 0
        with connect(target) as conn, httpx.Client(timeout=10, limits=httpx.Limits(max_connections=1)) as pool:
            deadline = time.monotonic() + 14  # past SILENT_GRACE (10 s), when the silent ones may go
            while time.monotonic() < deadline:
                if client == "raw":
                    assert answer_to(conn, GET + b"\r\n")[0] == 200, f"after {answered} answers"
                else:
                    assert pool.get(url).status_code == 200, f"after {answered} answers"
                answered += 1
                if answered % 20 == 0:
                    flood.fill()
                time.sleep(0.05)
        assert answered > 50
        assert httpx.get(url, timeout=5).status_code == 200  # a new connection is served too
    finally:
        flood.close()


def test_a_flood_of_the_node_spares_the_gateways_pooled_connections(stack: Stack, many_files: None) -> None:
    """A gateway's connections to its node are one address's kept-alive pool: a flood of the node's
    port from other addresses closes none that is in use, so requests through the gateway are
    answered throughout."""
    flood = Flood(stack.node.port, silent=PENDING + 300, stalled_addresses=40, stalled_each=20)
    try:
        flood.fill()
        with httpx.Client(base_url=stack.gateway.url, headers={"X-API-Key": API_KEY}, timeout=10) as api:
            deadline, answered = time.monotonic() + 14, 0
            while time.monotonic() < deadline:
                got = api.get(f"/sandboxes/{stack.sandbox_id}")
                assert got.status_code == 200, f"after {answered} answers: {got.text}"
                answered += 1
                if answered % 20 == 0:
                    flood.fill()
                time.sleep(0.05)
        assert answered > 50
    finally:
        flood.close()


def test_idle_kept_alive_connections_are_bounded(target: Target, many_files: None) -> None:
    """Kept-alive connections idle between requests are what clients' pools reuse, and are not
    closed for a flood of heads; past AENV_HTTP_MAX_IDLE (lowered here) the longest idle go."""
    before = settled_descriptors(target.pid)
    idle = []
    try:
        for _ in range(2 * MAX_IDLE):
            conn = connect(target)
            idle.append(conn)
            assert answer_to(conn, GET + b"\r\n")[0] == 200
        held = descriptors(target.pid) - before
        assert held < MAX_IDLE + 50, f"{held} more descriptors held for idle connections"
        assert answer_to(idle[-1], GET + b"\r\n")[0] == 200  # the newest are still open and served
    finally:
        for conn in idle:
            conn.close()


def test_idle_connections_past_the_bound_are_the_heaviest_addresses(target: Target, many_files: None) -> None:
    """Past AENV_HTTP_MAX_IDLE, the idle connections closed are those of the address idling most:
    a client elsewhere that rests between its requests keeps its connection (a gateway's pool)."""
    flood: list[socket.socket] = []
    try:
        with connect(target) as mine:
            for round_ in range(3):
                for _ in range(MAX_IDLE):
                    conn = connect_from("127.0.0.3", target.port)
                    flood.append(conn)
                    assert answer_to(conn, GET + b"\r\n")[0] == 200
                assert answer_to(mine, GET + b"\r\n")[0] == 200, f"round {round_}"  # then idle meanwhile
        assert sum(Flood._open(c) for c in flood) <= MAX_IDLE + 5
    finally:
        for conn in flood:
            conn.close()


def test_a_body_sent_on_after_its_answer_keeps_no_connection(target: Target, many_files: None) -> None:
    """A request answered before its body came (POST /health without the key: 401) leaves the body to be
    read and dropped; a byte of it now and then held the connection for good (the keep-alive
    timer stopped at every byte and the connection left the idle ones: seen failing, all 600 of
    3 rounds held). Such a connection stays idle, under AENV_HTTP_MAX_IDLE and the keep-alive
    timeout; one that sends its whole body serves its next request as before."""
    with connect(target) as conn:
        status, _, _ = answer_to(conn, b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n")
        conn.sendall(b"12345")
        assert status == 401 and answer_to(conn, GET + b"\r\n")[0] == 200
    before = settled_descriptors(target.pid)
    trickling: list[socket.socket] = []
    try:
        for _ in range(3):
            batch = [connect(target) for _ in range(MAX_IDLE)]
            for conn in batch:
                conn.sendall(b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\nab")
            for conn in batch:
                got = b""
                while not answers(got) and (chunk := conn.recv(65536)):
                    got += chunk
            trickling += batch
            for conn in trickling:
                try:
                    conn.send(b"b")
                except OSError:
                    pass
        held = settled_descriptors(target.pid) - before
        assert held < MAX_IDLE + 50, f"{held} more descriptors held for bodies sent after their answers"
        assert exchange(target, GET + b"Connection: close\r\n\r\n")[0][0] == 200
    finally:
        for conn in trickling:
            conn.close()


# -- what reaches a sandbox's port, and what comes back ---------------------------------------------
def routed(stack: Stack, extra: bytes = b"") -> bytes:
    return (
        b"GET /echo?x=1 HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        + f"E2b-Sandbox-Id: {stack.sandbox_id}\r\nE2b-Sandbox-Port: {PORT}\r\n".encode()
        + extra
        + b"Connection: close\r\n\r\n"
    )


def through_the_port(target: Target, stack: Stack, extra: bytes = b"") -> tuple[int, dict[str, list[str]], bytes]:
    deadline = time.monotonic() + 30
    while True:
        got = exchange(target, routed(stack, extra))
        if got and got[0][0] != 502:  # the server in the sandbox is up
            return got[0]
        assert time.monotonic() < deadline, got
        time.sleep(0.3)


def test_a_port_sees_header_names_as_the_client_wrote_them(target: Target, stack: Stack) -> None:
    status, _, body = through_the_port(target, stack, b"x-MiXeD-Case: 1\r\nACCEPT: */*\r\nuser-agent: raw\r\n")
    assert status == 200, body
    seen = body.decode().split("\r\n")
    assert "x-MiXeD-Case: 1" in seen and "ACCEPT: */*" in seen and "user-agent: raw" in seen, seen
    assert "Host: 127.0.0.1" in seen, seen
    # nothing the client did not send (routing stays behind; a gateway's HTTP client added its
    # own Accept-Encoding, so a port's server could compress for a client that never asked)
    names = {line.split(":")[0].lower() for line in seen[1:] if line}
    assert names == {"host", "x-mixed-case", "accept", "user-agent", "connection"}, seen


def test_a_port_sees_a_websocket_upgrade_s_header_names_as_sent(target: Target, stack: Stack) -> None:
    """An upgrade goes through uvicorn's WebSocket protocol, whose scope had lowercased names (seen
    failing: `x-mixed-case: 1` reached the port). The echo server refuses the upgrade with the head
    it saw as the body, which the proxy passes on."""
    through_the_port(target, stack)  # the echo server is up
    upgrade = (
        b"GET /echo HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        + f"E2b-Sandbox-Id: {stack.sandbox_id}\r\nE2b-Sandbox-Port: {PORT}\r\n".encode()
        + b"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
        + b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nx-MiXeD-Case: 1\r\nUser-Agent: ws-raw\r\n\r\n"
    )
    got = exchange(target, upgrade)
    assert got and got[0][0] == 200, got
    seen = got[0][2].decode().split("\r\n")
    assert "x-MiXeD-Case: 1" in seen and "User-Agent: ws-raw" in seen, "\n".join(seen)
    assert "Host: 127.0.0.1" in seen, "\n".join(seen)  # the client's, as for any request


def test_answers_carry_one_date_and_one_server(target: Target, stack: Stack) -> None:
    """The port's own Date and Server are the only ones (uvicorn added its own: two of each, three
    through a gateway); the server's own answers, errors included, carry one of each."""
    status, headers, _ = through_the_port(target, stack)
    assert status == 200
    assert headers["date"] == ["Thu, 01 Jan 1970 00:00:00 GMT"], headers
    assert headers["server"] == ["echo-in-sandbox"], headers
    for request in (GET, b"GET /sandboxes HTTP/1.1\r\nHost: x\r\n", b"GET /no/such/route HTTP/1.1\r\nHost: x\r\n"):
        status, headers, _ = exchange(target, request + b"Connection: close\r\n\r\n")[0]
        assert len(headers.get("date", [])) == 1 and len(headers.get("server", [])) == 1, (status, headers)


# A WebSocket server for busybox: accepts the upgrade (the accept key made with sha1sum and
# base64), with a Date and a Server of its own unless it runs as ws-bare.sh, then holds it open.
WS_ACCEPT = r"""#!/bin/sh
key=""
while IFS= read -r line; do
  case "$line" in
    [Ss]ec-[Ww]eb[Ss]ocket-[Kk]ey:*) key=$(echo "$line" | /bin/busybox cut -d' ' -f2 | /bin/busybox tr -d '\r') ;;
  esac
  [ "$line" = "$(printf '\r')" ] && break
done
hex=$(printf '%s' "${key}258EAFA5-E914-47DA-95CA-C5AB0DC85B11" | /bin/busybox sha1sum | /bin/busybox cut -c1-40)
accept=$(printf "$(echo "$hex" | /bin/busybox sed 's/../\\x&/g')" | /bin/busybox base64)
own='Date: Thu, 01 Jan 1970 00:00:00 GMT\r\nServer: ws-in-sandbox\r\n'
case "$0" in *bare*) own='' ;; esac
printf "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
printf "Sec-WebSocket-Accept: %s\r\n$own\r\n" "$accept"
/bin/busybox sleep 10
"""
WS_PORTS = {"own": 8091, "bare": 8092}


@pytest.fixture(scope="module")
def ws_ports(stack: Stack) -> None:
    with pytest.MonkeyPatch.context() as mp:
        for _ in e2b_client(stack.node, mp):
            sandbox = Sandbox.connect(stack.sandbox_id)
            for name in ("ws", "ws-bare"):
                sandbox.files.write(f"/tmp/{name}.sh", WS_ACCEPT)
                sandbox.commands.run(f"/bin/busybox chmod 755 /tmp/{name}.sh")
            sandbox.commands.run(f"/bin/busybox nc -ll -p {WS_PORTS['own']} -e /tmp/ws.sh", background=True, timeout=0)
            sandbox.commands.run(
                f"/bin/busybox nc -ll -p {WS_PORTS['bare']} -e /tmp/ws-bare.sh", background=True, timeout=0
            )


def upgrade_head(target: Target, stack: Stack, port: int) -> list[str]:
    """The head of the answer to a WebSocket upgrade for ``port`` (its lines), once the port is up."""
    upgrade = (
        b"GET /ws HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        + f"E2b-Sandbox-Id: {stack.sandbox_id}\r\nE2b-Sandbox-Port: {port}\r\n".encode()
        + b"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
        + b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    )
    deadline = time.monotonic() + 30
    while True:
        with connect(target) as conn:
            conn.sendall(upgrade)
            got = b""
            while b"\r\n\r\n" not in got and (chunk := conn.recv(65536)):
                got += chunk
        head = got.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
        if not head[0].startswith("HTTP/1.1 502"):  # the server in the sandbox is up
            return head
        assert time.monotonic() < deadline, head
        time.sleep(0.3)


@pytest.mark.parametrize("port", ["own", "bare"])
def test_an_accepted_websocket_carries_one_date_and_one_server(
    target: Target, stack: Stack, ws_ports: None, port: str
) -> None:
    """A 101 for a sandbox's port carries the port's own Date and Server, or one of each of the
    node's when the port sent none (seen failing: the 101 had neither, on a node and through a
    gateway, while every other answer had one of each)."""
    head = upgrade_head(target, stack, WS_PORTS[port])
    assert head[0].startswith("HTTP/1.1 101"), head
    dates = [line.split(":", 1)[1].strip() for line in head if line.lower().startswith("date:")]
    servers = [line.split(":", 1)[1].strip() for line in head if line.lower().startswith("server:")]
    assert len(dates) == 1 and len(servers) == 1, head
    if port == "own":
        assert dates == ["Thu, 01 Jan 1970 00:00:00 GMT"] and servers == ["ws-in-sandbox"], head


@pytest.mark.parametrize("case", ["without a key", "on the control plane", "to envd"])
def test_a_refused_websocket_is_json_with_one_date_and_one_server(target: Target, stack: Stack, case: str) -> None:
    """An upgrade nothing takes is refused as any request is: a 4xx JSON ``{code, message}`` with one
    date and one server (seen failing on a node: an empty 403 with a date and no server)."""
    extra = {
        "without a key": b"",
        "on the control plane": f"X-API-Key: {API_KEY}\r\n".encode(),
        "to envd": f"E2b-Sandbox-Id: {stack.sandbox_id}\r\nE2b-Sandbox-Port: 49983\r\n".encode(),
    }[case]
    upgrade = (
        b"GET /sandboxes HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        + extra
        + b"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
        + b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    )
    got = exchange(target, upgrade)
    assert got, case
    status, headers, body = got[0]
    assert 400 <= status < 500, (status, headers, body)
    assert len(headers.get("date", [])) == 1 and len(headers.get("server", [])) == 1, headers
    error = json.loads(body)
    assert error["code"] == status and error["message"], error
