"""Egress against hostile input: malformed proxy requests, a hostile guest's egress.connect, and
allowOut rules that must not open this node or private networks by accident.

The policy is checked with injected resolvers and node addresses (no DNS, no internet), and a
real connection goes to a listener on this node's own address; the proxy is driven from inside a
real sandbox.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from aenv.channel import END, MAX_GUEST_STREAMS, Channel, Stream
from aenv.node.egress import Address, EgressPolicy, Guest
from tests.channel.test_channel import pipe_pair
from tests.conftest import Server
from tests.node.test_egress import host_address, outside  # noqa: F401 (a fixture)
from tests.node.test_isolation import run

NODE_PUBLIC = ipaddress.ip_address("93.184.216.34")  # stands for a node with a public address
NODE = frozenset({NODE_PUBLIC, ipaddress.ip_address("192.0.2.1")})


def ip(text: str) -> Address:
    return ipaddress.ip_address(text)


# -- the policy -----------------------------------------------------------------------------------
INSIDE = ["10.1.2.3", "172.16.0.9", "192.168.1.1", "100.64.0.1", "fd00::5", "::ffff:10.0.0.1", str(NODE_PUBLIC)]


@pytest.mark.parametrize("addr", INSIDE)
def test_the_catch_all_opens_public_addresses_only(addr: str) -> None:
    everything = EgressPolicy.of(True, {"allowOut": ["0.0.0.0/0"]})
    assert everything.check("x", ip("8.8.8.8"), NODE) is None
    assert everything.check("x", ip("2606:4700::1111"), NODE) is None
    reason = everything.check("x", ip(addr), NODE)
    assert reason is not None and "narrower than 0.0.0.0/0" in reason
    no_internet = EgressPolicy.of(False, {"allowOut": ["0.0.0.0/0", "::/0"]})
    assert no_internet.check("x", ip(addr), NODE) is not None


@pytest.mark.parametrize("addr", INSIDE)
def test_an_address_or_a_narrower_cidr_opens_it(addr: str) -> None:
    plain = str(ipaddress.ip_address(addr).ipv4_mapped or addr) if ":" in addr else addr
    net = ipaddress.ip_network(f"{plain}/{16 if '.' in plain else 64}", strict=False)
    for rule in (plain, str(net)):
        assert EgressPolicy.of(False, {"allowOut": [rule]}).check("x", ip(addr), NODE) is None, rule
    neighbour = ipaddress.ip_address(int(ipaddress.ip_address(plain)) ^ 1)
    assert EgressPolicy.of(False, {"allowOut": [plain]}).check("x", neighbour, NODE) is not None


@pytest.mark.parametrize("addr", ["127.0.0.1", "169.254.169.254", "fe80::1", "0.0.0.0", "0.1.2.3", "::ffff:127.0.0.1"])
def test_loopback_and_link_local_stay_closed_whatever_is_named(addr: str) -> None:
    policy = EgressPolicy.of(True, {"allowOut": ["0.0.0.0/0", "::/0", addr, "0.0.0.0/1", "svc.example"]})
    assert "never reachable" in (policy.check("svc.example", ip(addr), NODE) or "")


@pytest.mark.parametrize("resolved", ["127.0.0.1", "10.0.0.5", "100.64.1.1", str(NODE_PUBLIC), "fd00::1"])
def test_a_domain_rule_does_not_follow_its_name_inside(resolved: str) -> None:
    """DNS rebinding: the allowed name now resolves to this node or a private network."""
    policy = EgressPolicy.of(False, {"allowOut": ["svc.example", "*.svc.example"]})
    assert policy.check("svc.example", ip("151.101.0.223"), NODE) is None
    assert policy.check("a.svc.example", ip(resolved), NODE) is not None
    assert policy.check("svc.example", ip(resolved), NODE) is not None


def test_the_node_addresses_are_read_from_the_kernel() -> None:
    from aenv.node.egress import node_addresses

    addresses = node_addresses()
    assert ip(host_address()) in addresses and ip("127.0.0.1") in addresses
    policy = EgressPolicy.of(True, {"allowOut": ["0.0.0.0/0"]})
    assert "this node's own" in (policy.check("x", ip(host_address())) or "")


# -- a hostile guest's egress.connect ------------------------------------------------------------
@pytest.fixture()
async def guest() -> AsyncIterator[Channel]:
    """The guest's end of a channel whose host serves egress as the node does."""
    host_end, guest_end = await pipe_pair()
    policy = EgressPolicy.of(True, {"allowOut": [f"{host_address()}/32"]})
    host = Channel(on_open=Guest("sbx", lambda: policy), max_peer_streams=MAX_GUEST_STREAMS)
    guest = Channel(first_stream_id=2)
    host.attach(*host_end)
    guest.attach(*guest_end)
    yield guest
    host.close()
    guest.close()


HOSTILE_PARAMS: list[dict[str, Any]] = [
    {"host": "a..b", "port": 443},
    {"host": "a" * 64 + ".com", "port": 443},
    {"host": "a." * 127 + "com", "port": 443},
    {"host": "xn--zz.com", "port": 443},
    {"host": "bücher.de", "port": 443},
    {"host": "a\x00b", "port": 80},
    {"host": "user@example.com", "port": 80},
    {"host": "fe80::1%eth0", "port": 80},
    {"host": "", "port": 80},
    {"host": 5, "port": 80},
    {"host": ["x"], "port": 80},
    {"host": "example.com", "port": 0},
    {"host": "example.com", "port": 65536},
    {"host": "example.com", "port": "80"},
    {"host": "example.com", "port": True},
    {"host": "example.com", "port": 80.5},
    {"port": 80},
    {},
]


async def test_a_hostile_guest_request_is_answered_at_once(guest: Channel) -> None:
    for params in HOSTILE_PARAMS:
        stream = await guest.open("egress.connect", params)
        item = await asyncio.wait_for(stream.recv(), 2)
        assert item.kind == END and item.msg["error"]["code"] == "invalid_argument", params
    assert guest.open_streams == 0 and not guest.closed.is_set()


async def test_a_guest_that_gives_up_while_the_host_resolves_leaves_nothing_behind() -> None:
    from aenv.node.egress import serve_connect

    resolving = asyncio.Event()

    async def slow(host: str, port: int) -> list[Address]:
        resolving.set()
        await asyncio.sleep(3600)
        return []

    outcome: list[str] = []

    async def serve(stream: Stream) -> None:
        outcome.append(await serve_connect(stream, EgressPolicy.of(True, None), resolver=slow))

    host_end, guest_end = await pipe_pair()
    host, guest = Channel(on_open=serve), Channel(first_stream_id=2)
    host.attach(*host_end)
    guest.attach(*guest_end)
    try:
        stream = await guest.open("egress.connect", {"host": "slow.example", "port": 443})
        await asyncio.wait_for(resolving.wait(), 2)
        await stream.end()
        for _ in range(100):
            if outcome:
                break
            await asyncio.sleep(0.02)
        assert outcome == ["abandoned"] and host.open_streams == 0 and not host._tasks
    finally:
        host.close()
        guest.close()


async def test_resolver_errors_are_answers_not_crashes() -> None:
    from aenv.node.egress import connect

    async def broken(host: str, port: int) -> list[Address]:
        raise UnicodeError("label empty or too long")

    from aenv.node.egress import Refused

    with pytest.raises(Refused) as exc:
        await connect("svc.example", 443, EgressPolicy.of(True, None), resolver=broken)
    assert exc.value.outcome == "unresolved"


@pytest.mark.parametrize(
    ("internet", "allow_out", "asked"),
    [
        (False, None, False),  # nothing could be allowed: the name never leaves the node
        (False, ["pypi.org"], False),  # a rule for another name
        (False, ["*.pypi.org"], True),
        (False, ["10.0.0.0/8"], True),  # the name may resolve into the allowed range
        (True, None, True),
    ],
)
async def test_a_name_is_resolved_only_when_the_policy_could_allow_it(
    internet: bool, allow_out: list[str] | None, asked: bool
) -> None:
    """A sandbox without internet access must not reach the node's resolver with names of its
    choosing: DNS queries are a way out (exfiltration) and into the node's own DNS."""
    from aenv.node.egress import Refused, connect

    names: list[str] = []

    async def recording(host: str, port: int) -> list[Address]:
        names.append(host)
        return [ip("127.0.0.1")]  # refused whatever the rules say: only the asking is under test

    policy = EgressPolicy.of(internet, {"allowOut": allow_out} if allow_out else None)
    with pytest.raises(Refused) as exc:
        await connect("secret-data.files.pypi.org", 9, policy, resolver=recording)
    assert names == (["secret-data.files.pypi.org"] if asked else [])
    if not asked:
        assert exc.value.outcome == "denied" and "no internet access" in exc.value.message


@pytest.fixture()
def node_listener() -> Iterator[tuple[str, int]]:
    """A TCP server on this node's own (non-loopback) address that says who it is."""
    server = socket.create_server((host_address(), 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.sendall(b"node service\n")
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    yield host_address(), int(server.getsockname()[1])
    server.close()


async def test_rebinding_to_this_node_is_refused_and_a_named_address_is_connected_as_checked(
    node_listener: tuple[str, int],
) -> None:
    from aenv.node.egress import Refused, connect

    addr, port = node_listener

    async def rebinding(host: str, port: int) -> list[Address]:
        return [ip("10.0.0.5"), ip(addr)]

    by_name = EgressPolicy.of(True, {"allowOut": ["svc.example", "0.0.0.0/0"]})
    with pytest.raises(Refused) as exc:
        await connect("svc.example", port, by_name, resolver=rebinding)
    assert exc.value.outcome == "denied" and "this node's own" in exc.value.message
    named = EgressPolicy.of(False, {"allowOut": ["svc.example", f"{addr}/32"]})
    reader, writer, used = await connect("svc.example", port, named, resolver=rebinding)
    try:
        assert used == ip(addr)  # 10.0.0.5 was checked and skipped; the connection went where allowed
        assert await asyncio.wait_for(reader.readline(), 5) == b"node service\n"
    finally:
        writer.close()


# -- the proxy inside a real sandbox ---------------------------------------------------------------
BAD_TARGETS = [
    ("CONNECT", "a..b:443"),
    ("CONNECT", ".a:443"),
    ("CONNECT", "a" * 64 + ".com:443"),
    ("CONNECT", "a." * 127 + "com:443"),
    ("CONNECT", "xn--zz.com:443"),
    ("CONNECT", "b\u00fccher.de:443"),
    ("CONNECT", "example.com:0"),
    ("CONNECT", "example.com:65536"),
    ("CONNECT", "example.com:x"),
    ("CONNECT", "example.com:"),
    ("CONNECT", "example.com"),
    ("CONNECT", "example.com:+80"),
    ("CONNECT", "[::1:443"),
    ("CONNECT", "::1:443"),
    ("CONNECT", "[fe80::1%25eth0]:443"),
    ("CONNECT", "[1.2.3.4]:443"),
    ("CONNECT", "user@example.com:443"),
    ("CONNECT", "u:p@example.com:443"),
    ("CONNECT", "a\x00b:443"),
    ("CONNECT", ""),
    ("GET", "http://a..b/"),
    ("GET", "http://example.com:0/"),
    ("GET", "http://example.com:99999/"),
    ("GET", "http://u:p@example.com/"),
    ("GET", "http://[::1/"),
    ("GET", "http:///path"),
    ("GET", "ftp://example.com/"),
    ("GET", "http://a\x00b/"),
]

PROBE = r"""
import json, os, socket, sys, time
targets = json.loads(sys.stdin.read())
def threads():
    return len(os.listdir("/proc/1/task"))
def ask(method, target):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
    try:
        s.sendall(f"{method} {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode("utf-8", "surrogateescape"))
        started, answer = time.monotonic(), b""
        while b"\r\n" not in answer:
            part = s.recv(4096)
            if not part:
                break
            answer += part
        return answer.split(b"\r\n")[0].decode("latin-1"), time.monotonic() - started
    except socket.timeout:
        return "timeout", 5.0
    finally:
        s.close()
before = threads()
answers = [ask(m, t) for _ in range(2) for m, t in targets]
deadline = time.monotonic() + 10
while threads() > before and time.monotonic() < deadline:
    time.sleep(0.1)
print(json.dumps({"before": before, "after": threads(), "answers": answers}))
"""


def open_streams(server: Server) -> float:
    """Open channel streams of every sandbox, whatever their method (none open: no sample at all)."""
    text = httpx.get(f"{server.url}/metrics").text
    assert "# TYPE aenv_channel_streams gauge" in text, "aenv_channel_streams is not on /metrics"
    return sum(float(v) for v in re.findall(r"^aenv_channel_streams\{[^}]*\} (\S+)$", text, re.M))


@pytest.mark.sandbox
def test_malformed_proxy_requests_get_400_at_once_and_leave_nothing_behind(e2b_env: Server) -> None:
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=300)
    try:
        sbx.files.write("/tmp/probe.py", PROBE)
        sbx.files.write("/tmp/targets.json", json.dumps([("CONNECT", "warm.up:1")]))
        sbx.commands.run("python3 /tmp/probe.py < /tmp/targets.json")  # threads the agent keeps
        streams_before = open_streams(e2b_env)
        sbx.files.write("/tmp/targets.json", json.dumps(BAD_TARGETS))
        result = json.loads(sbx.commands.run("python3 /tmp/probe.py < /tmp/targets.json", timeout=600).stdout)
        wrong = [
            (t, a)
            for t, a in zip(BAD_TARGETS * 2, result["answers"], strict=True)
            if not a[0].endswith(" 400 Bad Request") or a[1] > 2
        ]
        assert not wrong, wrong
        assert len(result["answers"]) >= 50
        assert result["after"] == result["before"], result  # no thread of the agent's proxy left behind
        time.sleep(0.5)
        assert open_streams(e2b_env) == streams_before  # and no stream on the host
        assert sbx.commands.run("echo fine").stdout.strip() == "fine"
    finally:
        sbx.kill()


@pytest.mark.sandbox
def test_catch_all_allow_out_does_not_open_this_node(e2b_env: Server, outside: tuple[str, str]) -> None:  # noqa: F811
    from e2b import Sandbox

    url, _ = outside
    node_ip = url.split("//")[1].split(":")[0]
    wide = Sandbox.create(timeout=300, network={"allow_out": ["0.0.0.0/0"]})
    named = Sandbox.create(timeout=300, network={"allow_out": ["0.0.0.0/0", f"{node_ip}/32"]})
    try:
        code, out = run(wide, f"curl -sS -w ' %{{http_code}}' {url}/hello.txt")
        assert "hello from outside" not in out and "this node's own" in out and out.rstrip().endswith("403"), out
        code, out = run(wide, f"curl -sS -p -m 20 {url}/hello.txt")  # CONNECT: the same refusal
        assert code != 0 and "hello from outside" not in out, out
        started = time.monotonic()
        code, out = run(wide, "curl -sS -m 20 -w ' %{http_code}' http://10.255.255.1:9/")
        assert out.rstrip().endswith("403") and time.monotonic() - started < 10, out  # refused, not tried
        assert named.commands.run(f"curl -sS {url}/hello.txt").stdout == "hello from outside"
    finally:
        wide.kill()
        named.kill()
