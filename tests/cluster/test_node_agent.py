"""`aenv server --cluster`: real nodes register in a real etcd cluster and keep their sandboxes'
directory entries (create, pause, resume, timeout, kill, expiry, stop, crash and restart)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator

import httpx
import pytest

from aenv.cluster.entries import SandboxEntry
from aenv.cluster.mirror import Mirror
from aenv.cluster.store import ClusterStore
from tests.cluster.etcd import EtcdCluster
from tests.cluster.nodes import start_node
from tests.conftest import API_KEY, Server

pytestmark = pytest.mark.sandbox
LEASE_TTL = 3
RECONCILE = 1.0  # seconds between node-a's checks of its sandboxes' entries


@pytest.fixture()
def node_a(server: Server, etcd: EtcdCluster) -> Iterator[Server]:
    # `server` first: `base` is in its repository, which the cluster's nodes share
    node = start_node(
        etcd.url, "node-a", lease_ttl=LEASE_TTL, extra_env={"AENV_CLUSTER_RECONCILE_INTERVAL": str(RECONCILE)}
    )
    yield node
    node.stop()


@pytest.fixture()
async def mirror(etcd: EtcdCluster) -> AsyncIterator[Mirror]:
    m = Mirror(ClusterStore.from_url(etcd.url))
    await m.start(wait=10)
    yield m
    await m.stop()
    await m.store.close()


def client(node: Server) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=node.url, headers={"X-API-Key": API_KEY}, timeout=120)


async def until(mirror: Mirror, predicate: Callable[[Mirror], bool], timeout: float = 5, what: str = "") -> None:
    assert await mirror.wait_for(predicate, timeout), f"the directory did not show {what or 'the change'}: " + repr(
        (mirror.nodes, mirror.sandboxes)
    )


def entry(mirror: Mirror, sandbox_id: str) -> SandboxEntry | None:
    return mirror.sandboxes.get(sandbox_id)


async def test_a_node_registers_with_its_capacity(node_a: Server, mirror: Mirror) -> None:
    await until(mirror, lambda m: "node-a" in m.nodes, what="node-a")
    n = mirror.nodes["node-a"]
    assert n.address == node_a.url and n.driver == "gvisor" and n.max_sandboxes > 0
    assert n.cpu_count >= 1 and n.memory_mb > 0 and n.running == 0
    # refreshed about once a second
    first = n.updated_at
    await until(mirror, lambda m: m.nodes["node-a"].updated_at > first, 3, "a refresh")


async def test_a_create_or_fork_is_answered_once_the_directory_lists_it(node_a: Server, mirror: Mirror) -> None:
    """A create asked of a node directly, one of a burst, and the children of a fork: each id the
    node answers with is in etcd when the answer comes, so a gateway asked about it at once finds
    it (it was written a moment later, and a connect through a gateway right after got 404)."""
    async with client(node_a) as api:

        async def create() -> str:
            r = await api.post("/sandboxes", json={"templateID": "base", "timeout": 120})
            assert r.status_code == 201, r.text
            sandbox_id = str(r.json()["sandboxID"])
            assert await mirror.store.get_sandbox(sandbox_id) is not None, f"{sandbox_id} not in etcd"
            return sandbox_id

        made = await asyncio.gather(*(create() for _ in range(6)))
        r = await api.post(f"/sandboxes/{made[0]}/fork", json={"count": 3})
        assert r.status_code == 201, r.text
        children = [item["sandbox"]["sandboxID"] for item in r.json()]
        assert len(children) == 3
        listed = await mirror.store.get_sandboxes(children)
        assert sorted(listed) == sorted(children)
        assert {v.entry.node_id for v in listed.values()} == {"node-a"}
        for sandbox_id in [*made, *children]:
            await api.delete(f"/sandboxes/{sandbox_id}")


async def test_a_create_is_not_answered_before_its_entry_can_be_written(
    node_a: Server, mirror: Mirror, etcd: EtcdCluster
) -> None:
    """With every etcd member frozen (SIGSTOP) for 1.5 s, shorter than the node's wait for its
    directory (and than the silence after which it refuses creates), a create asked meanwhile is
    answered only once etcd took its entry."""
    async with client(node_a) as api:
        await until(mirror, lambda m: "node-a" in m.nodes, what="node-a")
        frozen = [m.proc for m in etcd.members if m.proc is not None]
        for proc in frozen:
            proc.send_signal(signal.SIGSTOP)
        try:
            asked = asyncio.ensure_future(api.post("/sandboxes", json={"templateID": "base", "timeout": 120}))
            await asyncio.sleep(1.5)
            early = asked.done()
        finally:
            for proc in frozen:
                proc.send_signal(signal.SIGCONT)
        r = await asked
        assert r.status_code == 201, r.text
        assert not early, "the create was answered while its entry could not be written"
        sandbox_id = r.json()["sandboxID"]
        got = await mirror.store.get_sandbox(sandbox_id)
        assert got is not None and got.entry.node_id == "node-a"
        await api.delete(f"/sandboxes/{sandbox_id}")


async def test_directory_follows_the_sandbox_lifecycle(node_a: Server, mirror: Mirror) -> None:
    async with client(node_a) as api:
        r = await api.post("/sandboxes", json={"templateID": "base", "timeout": 120, "metadata": {"run": "7"}})
        assert r.status_code == 201, r.text
        sid = r.json()["sandboxID"]
        await until(mirror, lambda m: sid in m.sandboxes, what="the create")
        e = entry(mirror, sid)
        assert e is not None and (e.node_id, e.state, e.epoch, e.template_id) == ("node-a", "running", 1, "base")
        assert e.metadata == {"run": "7"}
        await until(mirror, lambda m: m.nodes["node-a"].running == 1, 3, "the node's load")

        assert (await api.post(f"/sandboxes/{sid}/pause")).status_code == 204
        await until(mirror, lambda m: m.sandboxes[sid].state == "paused", what="the pause")
        assert (await api.post(f"/sandboxes/{sid}/resume", json={"timeout": 120})).status_code == 201
        await until(mirror, lambda m: m.sandboxes[sid].state == "running", what="the resume")
        before = mirror.sandboxes[sid].end_at
        assert (await api.post(f"/sandboxes/{sid}/timeout", json={"timeout": 600})).status_code == 204
        await until(mirror, lambda m: m.sandboxes[sid].end_at > before + 300, 3, "the new timeout")

        assert (await api.delete(f"/sandboxes/{sid}")).status_code == 204
        await until(mirror, lambda m: sid not in m.sandboxes, what="the kill")
        assert mirror.sandboxes.get(sid) is None

        # expiry (the node's reaper) removes the entry too
        r = await api.post("/sandboxes", json={"templateID": "base", "timeout": 2})
        sid = r.json()["sandboxID"]
        await until(mirror, lambda m: sid in m.sandboxes, what="the second create")
        await until(mirror, lambda m: sid not in m.sandboxes, 10, "the expiry")


async def test_a_node_that_dies_leaves_within_its_ttl_and_takes_its_entries_back(
    server: Server, etcd: EtcdCluster, mirror: Mirror
) -> None:
    node = start_node(etcd.url, "node-crash", lease_ttl=LEASE_TTL)
    try:
        async with client(node) as api:
            running = (await api.post("/sandboxes", json={"templateID": "base", "timeout": 300})).json()["sandboxID"]
            paused = (await api.post("/sandboxes", json={"templateID": "base", "timeout": 300})).json()["sandboxID"]
            assert (await api.post(f"/sandboxes/{paused}/pause")).status_code == 204
        await until(mirror, lambda m: paused in m.sandboxes and m.sandboxes[paused].state == "paused")
        await until(mirror, lambda m: running in m.sandboxes)
        node.stop(signal.SIGKILL)
        killed_at = time.monotonic()
        await until(mirror, lambda m: "node-crash" not in m.nodes, LEASE_TTL + 3, "the node's loss")
        assert time.monotonic() - killed_at < LEASE_TTL + 3
        # its entries stay (the gateway reports them lost, naming the node)
        assert {running, paused} <= set(mirror.sandboxes)

        # the same id comes back: what it no longer runs leaves the directory, the paused one stays
        node.restart()
        await until(mirror, lambda m: "node-crash" in m.nodes, 10, "the node's return")
        await until(mirror, lambda m: running not in m.sandboxes, 5, "the lost sandbox's removal")
        assert mirror.sandboxes[paused].state == "paused" and mirror.sandboxes[paused].node_id == "node-crash"

        # a graceful stop leaves at once (lease revoked) and leaves paused sandboxes paused
        async with client(node) as api:
            assert (await api.post(f"/sandboxes/{paused}/resume", json={"timeout": 300})).status_code == 201
        await until(mirror, lambda m: m.sandboxes[paused].state == "running")
        stopped_at = time.monotonic()
        node.stop(signal.SIGTERM)
        await until(mirror, lambda m: "node-crash" not in m.nodes, 1, "the node's leave")
        assert time.monotonic() - stopped_at < LEASE_TTL + 60  # stop itself pauses the sandbox first
        assert mirror.sandboxes[paused].state == "paused"
        node.restart()
        async with client(node) as api:
            assert (await api.delete(f"/sandboxes/{paused}")).status_code == 204
        await until(mirror, lambda m: paused not in m.sandboxes)
    finally:
        node.stop()


@pytest.mark.parametrize("state", ["running", "paused"])
async def test_a_copy_the_directory_gave_to_another_node_is_killed(
    node_a: Server, etcd: EtcdCluster, mirror: Mirror, state: str
) -> None:
    store = ClusterStore.from_url(etcd.url)
    try:
        async with client(node_a) as api:
            sid = (await api.post("/sandboxes", json={"templateID": "base", "timeout": 120})).json()["sandboxID"]
            if state == "paused":
                assert (await api.post(f"/sandboxes/{sid}/pause")).status_code == 204
            await until(mirror, lambda m: sid in m.sandboxes and m.sandboxes[sid].state == state)
            # the directory gives the sandbox to another node (as a resume elsewhere will), with no
            # change on node-a that would make it write: its reconcile finds out, and kills its copy
            for _ in range(10):  # node-a may rewrite the entry in between (a CAS then fails): again
                if (await store.claim_sandbox(sid, "node-elsewhere", epoch=1)).ok:
                    break
                await asyncio.sleep(0.2)
            now = await store.get_sandbox(sid)
            assert now is not None and now.entry.node_id == "node-elsewhere"
            deadline = time.monotonic() + RECONCILE + 5
            while (await api.get(f"/sandboxes/{sid}")).status_code != 404:
                assert time.monotonic() < deadline, "node-a kept a copy the directory gave to another node"
                await asyncio.sleep(0.3)
            # and the other node's entry stays as it is
            await asyncio.sleep(1.5)
            e = mirror.sandboxes[sid]
            assert (e.node_id, e.epoch, e.state) == ("node-elsewhere", 2, state)
            await store.delete_sandbox(sid, now.mod_revision)
    finally:
        await store.close()


async def test_a_durable_pause_another_node_took_over_is_not_resumed_here(
    server: Server, etcd: EtcdCluster, mirror: Mirror
) -> None:
    """Another node claims a durably paused sandbox (its owner was draining, or seemed lost) and
    the owner, not yet aware, is asked to resume it: the owner's resume first takes the durable
    mark off the entry (a compare-and-swap), finds the sandbox gone to the other node, and does
    not resume it (two copies would run): 409 naming that node, and its copy goes."""
    # checks its entries rarely: only the resume's own write can find out in time
    node = start_node(etcd.url, "node-guard", extra_env={"AENV_CLUSTER_RECONCILE_INTERVAL": "600"})
    store = ClusterStore.from_url(etcd.url)
    try:
        async with client(node) as api:
            sid = (await api.post("/sandboxes", json={"templateID": "base", "timeout": 120})).json()["sandboxID"]
            assert (await api.post(f"/sandboxes/{sid}/pause")).status_code == 204
            await until(mirror, lambda m: sid in m.sandboxes and m.sandboxes[sid].durable, 60, "a durable pause")
            taken = await store.claim_sandbox(sid, "node-elsewhere", epoch=1, durable_only=True)
            assert taken.ok, taken
            r = await api.post(f"/sandboxes/{sid}/connect", json={"timeout": 60})
            assert r.status_code == 409 and "node-elsewhere" in r.json()["message"], r.text
            deadline = time.monotonic() + 15
            while (await api.get(f"/sandboxes/{sid}")).status_code != 404:
                assert time.monotonic() < deadline, "the owner kept its stale copy"
                await asyncio.sleep(0.3)
            now = await store.get_sandbox(sid)
            assert now is not None and (now.entry.node_id, now.entry.epoch, now.entry.state) == (
                "node-elsewhere",
                2,
                "paused",
            )
            assert now.entry.durable  # still the other node's to resume

            # and a resume here of a durable pause nobody took: the mark comes off first, then it runs
            mine = (await api.post("/sandboxes", json={"templateID": "base", "timeout": 120})).json()["sandboxID"]
            assert (await api.post(f"/sandboxes/{mine}/pause")).status_code == 204
            await until(mirror, lambda m: mine in m.sandboxes and m.sandboxes[mine].durable, 60, "a durable pause")
            assert (await api.post(f"/sandboxes/{mine}/connect", json={"timeout": 60})).status_code == 201
            late = await store.claim_sandbox(mine, "node-elsewhere", epoch=1, durable_only=True)
            assert not late.ok  # no longer offered for takeover
            await until(
                mirror, lambda m: m.sandboxes[mine].state == "running" and m.sandboxes[mine].node_id == "node-guard"
            )
            await store.delete_sandbox(sid, now.mod_revision)
    finally:
        await store.close()
        node.stop()


async def test_without_quorum_a_node_refuses_new_sandboxes_until_it_returns(
    node_a: Server, etcd: EtcdCluster, mirror: Mirror
) -> None:
    async with client(node_a) as api:
        before = (await api.post("/sandboxes", json={"templateID": "base", "timeout": 120})).json()["sandboxID"]
        await until(mirror, lambda m: before in m.sandboxes)
        down = etcd.members[:2]
        for m in down:
            m.stop(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while (r := await api.post("/sandboxes", json={"templateID": "base", "timeout": 60})).status_code == 201:
            await api.delete(f"/sandboxes/{r.json()['sandboxID']}")
            assert time.monotonic() < deadline, "the node kept taking sandboxes it cannot register"
            await asyncio.sleep(0.5)
        assert r.status_code == 503, r.text
        assert r.json()["error_code"] == "cluster_unavailable" and "node-a" in r.json()["message"]
        fork = await api.post(f"/sandboxes/{before}/fork", json={"count": 1})
        assert fork.status_code == 503, fork.text
        # what runs keeps running
        assert (await api.get(f"/sandboxes/{before}")).json()["state"] == "running"
        for m in down:
            m.start()
        etcd.wait_healthy(etcd.members)
        deadline = time.monotonic() + 20
        while (r := await api.post("/sandboxes", json={"templateID": "base", "timeout": 60})).status_code != 201:
            assert r.status_code == 503 and time.monotonic() < deadline, r.text
            await asyncio.sleep(0.5)
        sid = r.json()["sandboxID"]
        await until(mirror, lambda m: sid in m.sandboxes, 15, "the create after quorum returned")
        for s in (sid, before):
            assert (await api.delete(f"/sandboxes/{s}")).status_code == 204
