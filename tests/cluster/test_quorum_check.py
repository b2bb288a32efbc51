"""The gateway's judgement of etcd during an outage, on its own (no cluster): an election that
outlasts its read window still counts as one etcd will end (most members listen), so a node's
503 for missing etcd is worth sending again; without a quorum (most members refuse connections)
the answer is no at once. A slow election behind a create's 503 is what CI hit."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest

from aenv.cluster.etcd import Endpoint
from aenv.cluster.gateway import GatewaySettings
from aenv.cluster.gateway import directory as directory_module
from aenv.cluster.gateway.directory import Directory
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


async def _listening(n: int) -> AsyncIterator[list[Endpoint]]:
    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    servers = [await asyncio.start_server(accept, "127.0.0.1", 0) for _ in range(n)]
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
    async for up in _listening(2):
        store = ElectingStore([*up, _closed_port()])  # the leader's member went; two of three listen
        directory = _directory(store)
        assert await directory.etcd_answers() is False  # no read came back within the window
        assert store.reads > 1  # it read again and again meanwhile
        assert await directory.store_recovers() is True
        store.answers = True
        directory._quorum = None  # a new check, not the one kept for QUORUM_CHECK_KEEP
        assert await directory.etcd_answers() is True
        assert await directory.store_recovers() is True


@pytest.mark.usefixtures("short_elections")
async def test_without_a_quorum_the_answer_is_no_at_once() -> None:
    async for up in _listening(1):
        store = ElectingStore([*up, _closed_port(), _closed_port()])
        directory = _directory(store)
        started = time.monotonic()
        assert await directory.store_recovers() is False
        assert time.monotonic() - started < ELECTION  # it did not wait out the read window
