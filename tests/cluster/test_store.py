"""The cluster store and its mirror against a real 3-member etcd cluster."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TypeVar

import aetcd
import pytest

from aenv.cluster.entries import NodeEntry, SandboxEntry
from aenv.cluster.mirror import Mirror
from aenv.cluster.store import ClusterStore, Endpoint, parse_cluster_url
from aenv.errors import ClusterUnavailable, InvalidRequest
from tests.cluster.etcd import EtcdCluster, Member

T = TypeVar("T")


def node(node_id: str, **kw: object) -> NodeEntry:
    return NodeEntry(node_id, f"http://127.0.0.1:1/{node_id}", "gvisor", "test", **kw)  # type: ignore[arg-type]


def sandbox(sandbox_id: str, node_id: str = "n1", state: str = "running", **kw: object) -> SandboxEntry:
    return SandboxEntry(sandbox_id, node_id, state, **kw)  # type: ignore[arg-type]


def only(member: Member) -> ClusterStore:
    return ClusterStore([Endpoint("127.0.0.1", member.client_port)])


async def retrying(call: Callable[[], Awaitable[T]], timeout: float = 15) -> T:
    """``call()`` until the cluster answers: right after a member dies, a write may wait out an election."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except ClusterUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.3)


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:2379", "etcd://", "etcd://h:notaport", "etcd://h:1/path", "etcd://" + ",".join(["h"] * 17)],
)
def test_bad_cluster_urls_are_refused(url: str) -> None:
    with pytest.raises(InvalidRequest):
        parse_cluster_url(url)


def test_cluster_url_members_and_default_port() -> None:
    assert parse_cluster_url("etcd://a:1,b,[::1]:3") == [Endpoint("a", 1), Endpoint("b", 2379), Endpoint("::1", 3)]


async def test_lease_expiry_removes_a_node_within_its_ttl(store: ClusterStore) -> None:
    kept, dropped = await store.grant_lease(2), await store.grant_lease(2)
    await store.put_node(node("kept"), kept)
    await store.put_node(node("dropped"), dropped)
    assert {n.node_id for n in await store.nodes()} == {"kept", "dropped"}
    start = time.monotonic()
    while {n.node_id for n in await store.nodes()} != {"kept"}:
        assert await store.keep_alive(kept)
        # etcd's leader checks expiries twice a second; a loaded machine adds a few seconds
        assert time.monotonic() - start < 2 + 4, "an unrenewed lease outlived its TTL"
        await asyncio.sleep(0.2)
    # the renewed one outlives its TTL, and a lease that has expired says so
    await asyncio.sleep(0.5)
    assert await store.keep_alive(kept)
    assert not await store.keep_alive(dropped)


async def test_creates_race_one_wins(store: ClusterStore) -> None:
    results = await asyncio.gather(*(store.create_sandbox(sandbox("sb1", f"n{i}")) for i in range(8)))
    winners = [r for r in results if r.ok]
    assert len(winners) == 1
    winner = winners[0].current
    assert winner is not None
    # every loser was handed the winner's entry, not its own
    assert all(r.current == winner for r in results)


async def test_claims_race_on_the_epoch_one_wins(etcd: EtcdCluster, store: ClusterStore) -> None:
    assert (await store.create_sandbox(sandbox("sb1", "n0"))).ok
    # claimants on different connections (and members), as on different gateways
    others = [only(m) for m in etcd.members]
    try:
        results = await asyncio.gather(
            *(s.claim_sandbox("sb1", f"n{i + 1}", epoch=1) for i, s in enumerate(others * 2))
        )
        assert sum(r.ok for r in results) == 1
        final = await store.get_sandbox("sb1")
        assert final is not None and final.entry.epoch == 2 and final.entry.node_id != "n0"
        assert all(r.current is not None and r.current.entry == final.entry for r in results if not r.ok)
        # a claim at a stale epoch changes nothing
        stale = await store.claim_sandbox("sb1", "n9", epoch=1)
        assert not stale.ok and stale.current == final
    finally:
        for s in others:
            await s.close()


async def test_a_claim_outlasts_its_owner_rewriting_the_entry(store: ClusterStore) -> None:
    """The owner rewrites an entry at the same epoch (what a list shows changed) between the
    claimant's read and its transaction: not a lost race; the claim reads again and wins."""
    created = (await store.create_sandbox(sandbox("sb1", "n0", state="paused", durable=True))).current
    assert created is not None
    read = store.get_sandbox
    rewrites: list[int] = []

    async def read_then_owner_writes(sandbox_id: str):  # type: ignore[no-untyped-def]
        got = await read(sandbox_id)
        if not rewrites and got is not None:  # the first read only: then the owner's tick lands
            changed = dataclasses.replace(got.entry, end_at=got.entry.end_at + 60)
            rewritten = await store.replace_sandbox(changed, got.mod_revision)
            assert rewritten.ok and rewritten.current is not None
            rewrites.append(rewritten.current.mod_revision)
        return got

    store.get_sandbox = read_then_owner_writes  # type: ignore[method-assign]
    try:
        result = await store.claim_sandbox("sb1", "n1", epoch=1, durable_only=True)
    finally:
        del store.get_sandbox  # type: ignore[method-assign]
    assert len(rewrites) == 1 and result.ok and result.current is not None
    final = await store.get_sandbox("sb1")
    # the claim moved the entry as the owner last wrote it
    assert final == result.current and (final.entry.node_id, final.entry.epoch) == ("n1", 2)
    assert final.entry.end_at == created.entry.end_at + 60 and final.mod_revision > rewrites[0]


async def test_a_takeover_claim_refuses_an_entry_its_owner_resumed(store: ClusterStore) -> None:
    """Read durably paused, then resumed by its owner (same epoch): a takeover must not claim it
    (two copies would run), and a lost node that is back is not claimed from either."""
    created = (await store.create_sandbox(sandbox("sb1", "n0", state="paused", durable=True))).current
    assert created is not None
    resumed = await store.replace_sandbox(sandbox("sb1", "n0", state="running"), created.mod_revision)
    assert resumed.ok
    refused = await store.claim_sandbox("sb1", "n1", epoch=1, durable_only=True)
    assert not refused.ok and refused.current == resumed.current == await store.get_sandbox("sb1")

    assert resumed.current is not None
    paused_again = sandbox("sb1", "n0", state="paused", durable=True)
    paused = await store.replace_sandbox(paused_again, resumed.current.mod_revision)
    lease = await store.grant_lease(10)
    await store.put_node(node("n0"), lease)  # its node has an entry: not lost
    try:
        back = await store.claim_sandbox("sb1", "n1", epoch=1, from_lost="n0", durable_only=True)
        assert not back.ok and back.current == paused.current == await store.get_sandbox("sb1")
    finally:
        await store.revoke_lease(lease)


async def test_replace_and_delete_compare_the_revision(store: ClusterStore) -> None:
    created = (await store.create_sandbox(sandbox("sb1"))).current
    assert created is not None
    moved = await store.replace_sandbox(sandbox("sb1", state="paused"), created.mod_revision)
    assert moved.ok and moved.current is not None and moved.current.entry.state == "paused"
    # the writer that read before that change loses both ways
    assert not (await store.replace_sandbox(sandbox("sb1"), created.mod_revision)).ok
    assert not (await store.delete_sandbox("sb1", created.mod_revision)).ok
    assert (await store.get_sandbox("sb1")) == moved.current
    gone = await store.delete_sandbox("sb1", moved.current.mod_revision)
    assert gone.ok and gone.current is None and await store.get_sandbox("sb1") is None


async def test_oversized_and_bad_ids_are_refused(store: ClusterStore) -> None:
    from aenv.cluster.entries import EntryError

    with pytest.raises(EntryError):
        await store.create_sandbox(sandbox("sb1", alias="x" * 20000))
    with pytest.raises(EntryError):
        await store.create_sandbox(sandbox("../nodes/n1"))
    with pytest.raises(EntryError):
        await store.put_node(node("a/b"), 0)


async def test_mirror_follows_puts_and_deletes(etcd: EtcdCluster, store: ClusterStore) -> None:
    await store.create_sandbox(sandbox("before"))
    mirror = Mirror(ClusterStore.from_url(etcd.url))
    await mirror.start(wait=10)
    try:
        assert set(mirror.sandboxes) == {"before"}
        lease = await store.grant_lease(2)
        await store.put_node(node("n1", running=3), lease)
        created = (await store.create_sandbox(sandbox("sb1", metadata={"k": "v"}))).current
        assert created is not None
        assert await mirror.wait_for(lambda m: "sb1" in m.sandboxes and "n1" in m.nodes, 5)
        entry, owner = mirror.owner("sb1")
        assert entry is not None and entry.metadata == {"k": "v"} and owner is not None and owner.running == 3
        await store.replace_sandbox(sandbox("sb1", state="paused"), created.mod_revision)
        assert await mirror.wait_for(lambda m: m.sandboxes["sb1"].state == "paused", 5)
        cur = await store.get_sandbox("before")
        assert cur is not None
        await store.delete_sandbox("before", cur.mod_revision)
        assert await mirror.wait_for(lambda m: "before" not in m.sandboxes, 5)
        # the node's lease runs out: the node leaves the mirror, its sandbox stays (lost, not gone)
        assert await mirror.wait_for(lambda m: "n1" not in m.nodes, 2 + 2)
        entry, owner = mirror.owner("sb1")
        assert entry is not None and owner is None
        assert mirror.reloads == 1
    finally:
        await mirror.stop()
        await mirror.store.close()


async def test_mirror_skips_entries_that_do_not_decode(etcd: EtcdCluster, store: ClusterStore) -> None:
    raw = aetcd.Client(port=etcd.members[0].client_port, timeout=2)
    mirror = Mirror(ClusterStore.from_url(etcd.url))
    try:
        await raw.put(b"/aenv/sandboxes/bad1", b"not json")
        await mirror.start(wait=10)
        assert "bad1" not in mirror.sandboxes
        await raw.put(b"/aenv/sandboxes/bad2", b'{"sandbox_id": 5}')
        await raw.put(b"/aenv/sandboxes/bad3", b"x" * (64 * 1024))
        await store.create_sandbox(sandbox("good"))
        assert await mirror.wait_for(lambda m: "good" in m.sandboxes, 5)
        assert set(mirror.sandboxes) == {"good"}
    finally:
        await mirror.stop()
        await mirror.store.close()
        await raw.close()


async def test_mirror_resumes_after_its_member_is_killed(etcd: EtcdCluster, store: ClusterStore) -> None:
    first, *rest = etcd.members
    mirror = Mirror(ClusterStore.from_url(etcd.url))  # connects to the first member listed
    writer = only(rest[0])
    try:
        await mirror.start(wait=10)
        await writer.create_sandbox(sandbox("sb1"))
        assert await mirror.wait_for(lambda m: "sb1" in m.sandboxes, 5)
        first.stop(signal.SIGKILL)
        for i in range(5):
            await retrying(partial(writer.create_sandbox, sandbox(f"after{i}")))
        assert await mirror.wait_for(lambda m: all(f"after{i}" in m.sandboxes for i in range(5)), 15)
        assert mirror.reloads == 1  # resumed from its revision, not read again
        etcd.restart(first)
    finally:
        await mirror.stop()
        await mirror.store.close()
        await writer.close()


async def test_mirror_reads_everything_again_after_compaction(etcd: EtcdCluster, store: ClusterStore) -> None:
    first, second, _ = etcd.members
    mirror = Mirror(only(first))
    writer = only(second)
    raw = aetcd.Client(port=second.client_port, timeout=2)
    try:
        await mirror.start(wait=10)
        created = (await writer.create_sandbox(sandbox("sb1"))).current
        assert created is not None and await mirror.wait_for(lambda m: "sb1" in m.sandboxes, 5)
        first.stop(signal.SIGKILL)  # the mirror loses its only member
        await retrying(lambda: writer.delete_sandbox("sb1", created.mod_revision))
        for i in range(3):
            await retrying(partial(writer.create_sandbox, sandbox(f"new{i}")))
        status = await retrying(writer.read_all)
        await raw.compact(status.revision)
        etcd.restart(first)
        assert await mirror.wait_for(lambda m: set(m.sandboxes) == {"new0", "new1", "new2"}, 20)
        assert mirror.reloads == 2
    finally:
        await mirror.stop()
        await mirror.store.close()
        await writer.close()
        await raw.close()


async def test_no_quorum_fails_fast_and_recovers(etcd: EtcdCluster, store: ClusterStore) -> None:
    created = (await store.create_sandbox(sandbox("sb1"))).current
    assert created is not None
    mirror = Mirror(ClusterStore.from_url(etcd.url))
    await mirror.start(wait=10)
    try:
        down = etcd.members[:2]
        for m in down:
            m.stop(signal.SIGKILL)
        for attempt in (
            lambda: store.create_sandbox(sandbox("sb2")),
            lambda: store.get_sandbox("sb1"),
            lambda: store.grant_lease(5),
            lambda: store.replace_sandbox(sandbox("sb1", state="paused"), created.mod_revision),
        ):
            start = time.monotonic()
            with pytest.raises(ClusterUnavailable) as info:
                await attempt()
            assert time.monotonic() - start < store.timeout + 1
            assert info.value.status == 503 and "cluster store" in info.value.message
        # the mirror keeps what it had: running sandboxes stay routable
        assert "sb1" in mirror.sandboxes
        for m in down:
            m.start()
        etcd.wait_healthy(etcd.members)
        made = await retrying(lambda: store.create_sandbox(sandbox("sb2")))
        # A create that timed out may still be applied: the member left kept its proposal, and etcd
        # commits it once quorum is back (seen in CI). Then the entry is there, as written, once.
        assert made.ok or (made.current is not None and made.current.entry == sandbox("sb2")), made
        assert await mirror.wait_for(lambda m: "sb2" in m.sandboxes, 15)
    finally:
        await mirror.stop()
        await mirror.store.close()


async def test_a_read_dropped_for_a_leader_change_is_made_again(store: ClusterStore) -> None:
    """etcd drops a request when its leader changes (a member died: an election follows within
    about a second). A read, or a write that may be made twice, is made again within the call's
    deadline; any other call fails as it came, and so does "no leader" (no quorum: fail fast)."""
    assert await store.get_config() is None  # connected: the calls below fail only as they are told
    sent: list[str] = []

    def dropping_once(error: str) -> Callable[[object], Awaitable[str]]:
        async def make(client: object) -> str:
            sent.append(error)
            if len(sent) == 1:
                raise aetcd.exceptions.ClientError(f"etcdserver: {error}")
            return "answered"

        return make

    assert await store._call("read a test key", dropping_once("leader changed"), again=True) == "answered"
    assert len(sent) == 2
    for error, again in (("leader changed", False), ("no leader", True)):
        sent.clear()
        with pytest.raises(ClusterUnavailable) as info:
            await store._call("read a test key", dropping_once(error), again=again)
        assert error in info.value.message and len(sent) == 1
