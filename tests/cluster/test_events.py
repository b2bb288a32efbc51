"""Lifecycle events and webhooks on a cluster (etcd x3, two nodes, two gateways): every node
answers every team's events and webhooks whichever gateway is asked, each event is delivered once
by the one node that delivers, and another node takes the deliveries over when that one dies."""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter

import pytest

from aenv.cluster.store import ClusterStore
from aenv.events.cluster import LEADER_KEY, LEADER_TTL
from tests.cluster.cluster import Cluster, running_cluster
from tests.conftest import Server
from tests.webhooks import e2b_signature, receiving

pytestmark = pytest.mark.sandbox
SECRET = "cluster-webhook-secret"
LIFE = ["sandbox.lifecycle.created", "sandbox.lifecycle.killed"]


def leader(cluster: Cluster) -> str:
    async def read() -> str:
        store = ClusterStore.from_url(cluster.etcd.url)
        try:
            got = await store.call("read", lambda c: c.get(LEADER_KEY.encode()))
        finally:
            await store.close()
        return bytes(got.value).decode() if got is not None else ""

    return asyncio.run(read())


def life(cluster: Cluster, gateway: int, count: int) -> list[str]:
    """``count`` sandboxes made and killed through one gateway; their ids."""
    made = []
    with cluster.api(gateway) as api:
        for _ in range(count):
            r = api.post("/sandboxes", json={"templateID": "base", "timeout": 120})
            assert r.status_code == 201, r.text
            made.append(r.json()["sandboxID"])
        for sandbox_id in made:
            assert api.delete(f"/sandboxes/{sandbox_id}").status_code == 204
    return made


def test_events_and_webhooks_hold_across_gateways_nodes_and_a_dead_deliverer(server: Server) -> None:
    with running_cluster() as cluster, receiving() as receiver, cluster.api(0) as g0, cluster.api(1) as g1:
        body = {"name": "all", "url": receiver.url, "events": LIFE}
        made = g0.post("/events/webhooks", json=body | {"signatureSecret": SECRET})
        assert made.status_code == 201, made.text
        hook_id = made.json()["id"]
        for gateway in (g0, g1):  # whichever node a gateway forwards to
            for _ in range(4):
                assert gateway.get(f"/events/webhooks/{hook_id}").json()["name"] == "all"
        sandboxes = life(cluster, 0, 3) + life(cluster, 1, 3)
        for sandbox_id in sandboxes:
            for gateway in (g0, g1):
                deadline = time.monotonic() + 30
                while True:
                    answer = gateway.get(f"/events/sandboxes/{sandbox_id}", params={"orderAsc": "true"})
                    kinds = [e["type"] for e in answer.json()] if answer.status_code == 200 else []
                    if len(kinds) >= 2 or time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
                assert kinds == LIFE, (sandbox_id, kinds)
        for sandbox_id in sandboxes:
            assert [b["type"] for b in receiver.wait(sandbox_id, 2)] == LIFE
        time.sleep(2)  # a second dispatcher would have sent its copies by now
        counts = Counter(d.body["id"] for d in receiver.got)
        assert set(counts.values()) == {1}, counts
        assert all(d.headers["e2b-signature"] == e2b_signature(SECRET, d.raw) for d in receiver.got)
        # the node that delivers dies: the other takes over within the lease, from where it was
        first = leader(cluster)
        assert first in cluster.nodes
        cluster.nodes[first].stop(signal.SIGKILL)
        other = next(n for n in cluster.nodes if n != first)
        deadline = time.monotonic() + LEADER_TTL * 3
        while leader(cluster) != other:
            assert time.monotonic() < deadline, "no node took the deliveries over"
            time.sleep(0.5)
        later = life(cluster, 0, 2)
        for sandbox_id in later:
            assert [b["type"] for b in receiver.wait(sandbox_id, 2)] == LIFE
        counts = Counter(d.body["id"] for d in receiver.got)
        assert set(counts.values()) == {1}, counts
