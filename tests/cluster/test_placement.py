"""Placement of creates: in-flight creates counted on the gateway's clock, E2B's score, nodes that
hold the template or snapshot preferred (aenv/cluster/placement.py); then on a real cluster."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from aenv.cluster import placement
from aenv.cluster.entries import NodeEntry
from aenv.cluster.placement import Placement
from tests.cluster.cluster import Cluster, running_cluster
from tests.conftest import Server


def node(node_id: str, **kw: object) -> NodeEntry:
    defaults: dict[str, object] = {"max_sandboxes": 100, "cpu_count": 2.0, "updated_at": time.time()}
    return NodeEntry(node_id, f"http://127.0.0.1:1/{node_id}", "gvisor", "test", **{**defaults, **kw})  # type: ignore[arg-type]


def test_a_create_in_flight_counts_until_its_node_shows_it() -> None:
    """The node's entry may be rewritten while a create is on its way (before the node has
    registered it): the create still counts until the entry shows it starting, then once the
    answer came until the entry is rewritten; the next create goes to the other node each time."""
    p = Placement()
    a, b = node("a"), node("b")
    for _ in range(20):
        first = p.rank([a, b])[0].node_id
        p.sent(first)
        a, b = node("a"), node("b")  # both rewrite their entries (later updated_at), still idle
        assert p.rank([a, b])[0].node_id != first
        a, b = (node(n, starting=1, cpu_committed=1.0) if n == first else node(n) for n in ("a", "b"))
        assert p.pending(a if first == "a" else b) == 0  # shown starting: not counted twice
        assert p.rank([a, b])[0].node_id != first
        p.done(first, made=True, entry=a if first == "a" else b)
        a, b = node("a"), node("b")  # an entry from before the sandbox started, delivered late
        held = a if first == "a" else b
        p.answered[first] = [(held, time.monotonic())]  # as if answered while this entry was current
        assert p.rank([a, b])[0].node_id != first and p.pending(held) == 1
        a, b = node("a"), node("b")  # rewritten since the answer: it shows the sandbox now
        assert p.pending(a if first == "a" else b) == 0


def test_answered_creates_are_forgotten_after_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    p = Placement()
    a, b = node("a"), node("b")
    p.sent("a")
    p.done("a", made=True, entry=a)
    p.sent("b")
    p.done("b", made=False, entry=b)  # refused (429) or failed: nothing was made there
    assert (p.pending(a), p.pending(b)) == (1, 0)
    later = time.monotonic() + placement.ANSWERED_MEMORY + 0.1
    monkeypatch.setattr(placement.time, "monotonic", lambda: later)
    assert p.pending(a) == 0 and p.answered == {}


def test_the_score_is_e2b_s() -> None:
    p = Placement()
    busy = node("busy", running=3, cpu_committed=6.0, cpu_used=0.0, cpu_count=4.0)
    loaded = node("loaded", running=2, cpu_committed=2.0, cpu_used=4.0, cpu_count=4.0)  # half the used CPU counts
    assert p.score(busy) == pytest.approx((2 + 6) / 16)  # a create counts as its average sandbox (2 cores)
    assert p.score(loaded) == pytest.approx((1 + 2 + 2) / 16)
    assert p.score(node("empty", cpu_count=4.0)) == pytest.approx(placement.CREATE_CPU / 16)
    assert [n.node_id for n in p.rank([busy, loaded])] == ["loaded", "busy"]
    big = node("big", running=3, cpu_committed=6.0, cpu_count=16.0)  # per core, a bigger host is less loaded
    assert p.rank([busy, big])[0].node_id == "big"


def test_a_node_holding_the_source_is_preferred_and_always_sampled() -> None:
    p = Placement()
    holder = node("holder", running=1, cpu_committed=1.0, cached=["base", "snap-1"])
    others = [node(f"n{i}") for i in range(20)]
    for _ in range(30):
        assert p.rank([*others, holder], "snap-1")[0].node_id == "holder"
        assert len(p.rank([*others, holder], "snap-1")) == placement.SAMPLE + 1
    # much more loaded, a holder gives way to an idle node that would fetch
    full = node("holder", running=6, cpu_committed=6.0, cached=["snap-1"])
    assert p.rank([full, node("idle")], "snap-1")[0].node_id == "idle"


def test_full_and_draining_nodes_are_left_out() -> None:
    p = Placement()
    full = node("full", max_sandboxes=2, running=1)
    p.sent("full")  # its last slot is taken by a create in flight
    ranked = p.rank([full, node("draining", draining=True), node("ok")])
    assert [n.node_id for n in ranked] == ["ok"]


def test_a_memory_image_goes_to_a_node_with_its_runtime_while_one_has_room() -> None:
    """A durable pause's memory image restores only under the runsc and platform that wrote it:
    its takeover goes to such a node, however loaded, while one has room; else anywhere (that
    node answers 422 image_incompatible, which says what to do)."""
    p = Placement()
    old = "runsc 0.0~20221219.0 ptrace"
    same = node("same", runtime=old, running=5, cpu_committed=5.0, cached=[])
    others = [node(f"new{i}", runtime="runsc 0.0~20240729.0 ptrace", cached=["base"]) for i in range(10)]
    for _ in range(20):
        assert [n.node_id for n in p.rank([*others, same], "base", old)] == ["same"]
    assert p.rank([*others, same], "base")[0].node_id != "same"  # a create: anywhere
    full = node("same", runtime=old, max_sandboxes=1, running=1)
    assert len(p.rank([*others, full], "base", old)) == placement.SAMPLE  # none with it has room: the others
    assert {n.node_id for n in p.rank([*others, full], "base", old)} <= {n.node_id for n in others}


# -- on a real cluster ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(server: Server) -> Iterator[Cluster]:
    with running_cluster() as c:
        yield c


@pytest.mark.sandbox
def test_overlapping_creates_through_one_gateway_spread(cluster: Cluster) -> None:
    """Creates sent a moment apart while earlier ones are still starting (the nodes rewrite their
    entries meanwhile) spread evenly over two idle nodes."""

    def create(delay: float) -> tuple[str, str]:
        time.sleep(delay)
        with cluster.api() as api:
            r = api.post("/sandboxes", json={"templateID": "base", "timeout": 120})
            assert r.status_code == 201, r.text
            return r.json()["sandboxID"], r.headers["x-aenv-node-id"]

    placed: list[tuple[str, str]] = []
    try:
        with ThreadPoolExecutor(6) as pool:
            placed = list(pool.map(create, [0.35 * i for i in range(6)]))
        assert Counter(n for _, n in placed) == {"node-a": 3, "node-b": 3}, placed
    finally:
        with cluster.api() as api:
            for sid, _ in placed:
                api.delete(f"/sandboxes/{sid}")


@pytest.mark.sandbox
def test_creates_from_a_snapshot_go_to_the_node_holding_it(cluster: Cluster) -> None:
    """A snapshot made on one node: every gateway (not only the one that saw it made) sends creates
    from it to that node, which lists it in its entry, while the other node is as idle."""
    with cluster.api(0) as api:
        r = api.post("/sandboxes", json={"templateID": "base", "timeout": 120})
        source, maker = r.json()["sandboxID"], r.headers["x-aenv-node-id"]
        snap = api.post(f"/sandboxes/{source}/snapshots", json={})
        assert snap.status_code in (200, 201), snap.text
        snapshot_id = snap.json()["snapshotID"]
        api.delete(f"/sandboxes/{source}")
    try:
        with cluster.api(1) as other:
            deadline = time.monotonic() + 15
            while True:
                entries = {n["nodeID"]: n for n in other.get("/nodes").json()}
                if snapshot_id in entries[maker].get("cachedBuilds", []):
                    break
                assert time.monotonic() < deadline, f"{maker}'s entry does not list {snapshot_id}: {entries}"
                time.sleep(0.5)
            assert all(snapshot_id not in n.get("cachedBuilds", []) for k, n in entries.items() if k != maker)
            assert "base" in entries[maker]["cachedBuilds"]
            for _ in range(3):
                r = other.post("/sandboxes", json={"templateID": snapshot_id, "timeout": 60})
                assert r.status_code == 201 and r.headers["x-aenv-node-id"] == maker, (r.status_code, r.text)
                other.delete(f"/sandboxes/{r.json()['sandboxID']}")
                time.sleep(placement.ANSWERED_MEMORY)  # as idle as the other node again
    finally:
        with cluster.api(0) as api:
            api.delete(f"/snapshots/{snapshot_id}")


def test_an_entry_too_large_for_its_list_item_still_shows_what_it_says() -> None:
    """A lost node's durable pause whose entry had no room for the node's list item: GET through
    a gateway shows it paused and durable from the entry itself (it used to be 404 while a
    connect resumed it)."""
    from aenv.cluster.entries import SandboxEntry
    from aenv.cluster.lists import listed_item

    entry = SandboxEntry(
        sandbox_id="s1", node_id="gone", state="paused", template_id="base", started_at=1.0, end_at=61.0, durable=True
    )
    item = listed_item(entry, b"k" * 32, "example.test")
    assert item == {
        "sandboxID": "s1",
        "templateID": "base",
        "alias": "",
        "state": "paused",
        "startedAt": "1970-01-01T00:00:01Z",
        "endAt": "1970-01-01T00:01:01Z",
        "durable": True,
        "metadata": {},
        "domain": "example.test",
        "nodeID": "gone",  # the node it was on (the dashboard's column)
    }
