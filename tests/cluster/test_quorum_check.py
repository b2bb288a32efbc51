"""The gateway's judgement of etcd during an outage, on its own (no cluster): an election that
outlasts its read window still counts as one etcd will end (most members listen), so a node's
503 for missing etcd is worth sending again; without a quorum (most members refuse connections)
the answer is no at once. A slow election behind a create's 503 is what CI hit."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace

import httpx
import pytest

from aenv.cluster.entries import NodeEntry
from aenv.cluster.etcd import Endpoint
from aenv.cluster.gateway import GatewaySettings
from aenv.cluster.gateway import directory as directory_module
from aenv.cluster.gateway.directory import Directory
from aenv.cluster.gateway.upstream import Upstream
from aenv.errors import ClusterUnavailable

pytestmark = pytest.mark.fast  # the fast tier (./scripts/test --fast)

ELECTION = 0.6  # the read window, made short for the test


class ElectingStore:
    """A store whose reads fail (no leader) until ``answers`` is set."""

    def __init__(self, endpoints: list[Endpoint]) -> None:
        self.endpoints = endpoints
        self.answers = False
        self.reads = 0

    async def get_config(self) -> None:
        self.reads += 1
        if not self.answers:
            raise ClusterUnavailable("etcdserver: no leader")


ACCEPTED: list[int] = []  # the ports connections came to


@asynccontextmanager
async def listening(n: int) -> AsyncIterator[list[Endpoint]]:
    """``n`` members that accept connections (and say nothing)."""
    servers: list[asyncio.Server] = []

    for _ in range(n):

        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            ACCEPTED.append(writer.get_extra_info("sockname")[1])
            writer.close()

        servers.append(await asyncio.start_server(accept, "127.0.0.1", 0))
    try:
        yield [Endpoint("127.0.0.1", s.sockets[0].getsockname()[1]) for s in servers]
    finally:
        for s in servers:
            s.close()
            await s.wait_closed()


def _closed_port() -> Endpoint:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return Endpoint("127.0.0.1", s.getsockname()[1])  # nothing listens once closed


@pytest.fixture
def short_elections(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(directory_module, "ELECTION_SECONDS", ELECTION)


def _directory(store: ElectingStore) -> Directory:
    return Directory(GatewaySettings(cluster="etcd://127.0.0.1:2379"), SimpleNamespace(store=store))  # type: ignore[arg-type]


@pytest.mark.usefixtures("short_elections")
async def test_an_election_longer_than_the_read_window_is_still_worth_waiting_for() -> None:
    async with listening(2) as up:
        store = ElectingStore([*up, _closed_port()])  # the leader's member went; two of three listen
        directory = _directory(store)
        assert await directory.etcd_answers() is False  # no read came back within the window
        assert store.reads > 1  # it read again and again meanwhile
        assert await directory.store_recovers() is True
        store.answers = True
        directory._quorum = directory._recovers = None  # new checks, not those kept a moment
        assert await directory.etcd_answers() is True
        assert await directory.store_recovers() is True


@pytest.mark.usefixtures("short_elections")
async def test_without_a_quorum_the_answer_is_no_at_once() -> None:
    async with listening(1) as up:
        store = ElectingStore([*up, _closed_port(), _closed_port()])
        directory = _directory(store)
        started = time.monotonic()
        assert await directory.store_recovers() is False
        assert time.monotonic() - started < ELECTION  # it did not wait out the read window


@pytest.mark.usefixtures("short_elections")
async def test_requests_waiting_out_an_election_share_one_probe() -> None:
    """Hundreds of creates waiting for a node during an election ask at once: one read of etcd
    and one connection to each member serve them all."""
    async with listening(2) as up:
        store = ElectingStore([*up, _closed_port()])
        directory = _directory(store)
        ACCEPTED.clear()
        answers = await asyncio.gather(*(directory.store_recovers() for _ in range(200)))
        await asyncio.sleep(0.1)  # the members' accept handlers have run
        assert answers == [True] * 200
        # One read loop (a read every ELECTION_RETRY, a probe of the members between two) and one
        # probe after it, whoever asked: not 200 of each.
        assert store.reads <= ELECTION / 0.3 + 2
        assert set(ACCEPTED) == {ep.port for ep in up} and len(ACCEPTED) <= 2 * (store.reads + 1)


class Judged:
    """A directory whose judgement of etcd is given: what the gateway's retry of a node's 503 asks."""

    def __init__(self, node: NodeEntry, recovers: bool) -> None:
        self.mirror = SimpleNamespace(nodes={node.node_id: node})
        self.recovers = recovers
        self.asked = 0

    async def store_recovers(self) -> bool:
        self.asked += 1
        return self.recovers

    async def etcd_answers(self) -> bool:
        return False  # an election longer than the read window: the old check gave up here


def _refusal() -> httpx.Response:
    """A node's 503 for missing etcd, as its answer arrives (a stream, not yet read)."""
    body = b'{"code": 503, "message": "out of touch with the cluster store", "error_code": "cluster_unavailable"}'
    request = httpx.Request("POST", "http://node/sandboxes/x/pause")
    headers = {"content-type": "application/json"}
    return httpx.Response(503, headers=headers, stream=httpx.ByteStream(body), request=request)


@pytest.mark.parametrize("recovers", [True, False])
async def test_a_node_s_refusal_for_etcd_is_sent_again_while_etcd_elects(recovers: bool) -> None:
    node = NodeEntry("node-one", "http://127.0.0.1:9", "gvisor", "test")
    directory = Judged(node, recovers)
    upstream = Upstream(GatewaySettings(cluster="etcd://127.0.0.1:2379"), directory, None)  # type: ignore[arg-type]
    answer = await upstream.unless_blip(_refusal(), node, time.monotonic() + 30)
    assert directory.asked == 1
    if recovers:
        assert answer is None  # sent again
    else:
        assert answer is not None and answer.status_code == 503  # passed on: no quorum
