"""Teams on a cluster (etcd x3, two busybox nodes, two gateways): keys, isolation and quotas hold
across gateways. Seen failing with the gateways' admission off (each node counting only its own):
40 creates through both gateways at maxRunning 3 made 6 sandboxes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests import disk
from tests.cluster.cluster import Gateway, all_started, start_gateway, wait_for_nodes
from tests.cluster.conftest import require_etcd
from tests.cluster.etcd import EtcdCluster
from tests.cluster.nodes import shared_by_nodes
from tests.conftest import API_KEY, DATA_DIR, Server, _have_runtime, free_port, start_server
from tests.teams.attacks import Owned, drop_owned, envd_traffic, make_owned, routes_with_ids, routes_without_ids
from tests.teams.conftest import TeamKey, new_team

pytestmark = pytest.mark.sandbox
NODES = ("team-a", "team-b")


@dataclass
class BusyboxCluster:
    etcd: EtcdCluster
    nodes: dict[str, Server]
    gateways: list[Gateway]
    layout: Path

    def admin(self, gateway: int = 0) -> httpx.Client:
        return httpx.Client(base_url=self.gateways[gateway].url, headers={"X-API-Key": API_KEY}, timeout=120)

    def on(self, team: TeamKey, gateway: int) -> TeamKey:
        return TeamKey(team.team_id, team.key, self.gateways[gateway].url)


@contextmanager
def busybox_cluster() -> Iterator[BusyboxCluster]:
    """etcd x3, the nodes (a shared repository and import dir: `bb`, public, made on the first and
    fetched by the other), two gateways; everything stopped after."""
    require_etcd()
    if not _have_runtime():
        pytest.skip("needs root and runsc")
    from tests.images.oci import busybox_layer, write_layout

    shared = Path(f"{DATA_DIR}-teams-shared")
    for leftover in (shared, *(Path(f"{DATA_DIR}-teams-{name}") for name in NODES)):
        disk.release(leftover)  # a fresh cluster: nodes and repository from an earlier run disagree
    disk.dispose_after_module(shared)
    layout = shared / "imports" / "bb"
    write_layout(layout, [busybox_layer().bytes()], "v1")
    etcd = EtcdCluster(3)
    nodes: dict[str, Server] = {}
    gateways: list[Gateway] = []
    try:
        etcd.start()

        def node(name: str) -> Server:
            data_dir = Path(f"{DATA_DIR}-teams-{name}")
            disk.dispose_after_module(data_dir)
            port = free_port()
            env = {
                "AENV_CLUSTER": etcd.url,
                "AENV_NODE_ID": name,
                "AENV_ADVERTISE": f"http://127.0.0.1:{port}",
                "AENV_CLUSTER_LEASE_TTL": "3",
                "AENV_REPO": str(shared / "repo"),
                "AENV_IMAGE_IMPORT_DIRS": json.dumps([str(shared / "imports")]),
                "AENV_BUILD_BASE": "false",
                "AENV_SPARE_UPPERS": "1",
                "AENV_REPO_GC_INTERVAL": "0",
                "AENV_MIN_FREE_MEMORY_MB": "0",
                "AENV_METRICS_INTERVAL": "1",
                **shared_by_nodes(shared),
            }
            return start_server(data_dir, port=port, extra_env=env, wait_for=None)

        nodes.update(zip(NODES, all_started([lambda n=n: node(n) for n in NODES]), strict=True))
        gateways += all_started([lambda: start_gateway(etcd.url)] * 2)
        for gateway in gateways:
            wait_for_nodes(gateway, set(nodes))
        with nodes[NODES[0]].client() as first:
            made = first.post("/templates/from-image", json={"name": "bb", "image": f"oci:{layout}:v1"})
            assert made.status_code == 201, made.text
            assert first.patch("/templates/bb", json={"public": True}).status_code == 200
            deadline = time.monotonic() + 60
            while not first.get("/templates/bb").json().get("committed") and time.monotonic() < deadline:
                time.sleep(0.3)
        yield BusyboxCluster(etcd, nodes, gateways, layout)
    finally:
        for gateway in gateways:
            gateway.stop()
        for server in nodes.values():
            server.stop()
        etcd.stop()


@pytest.fixture(scope="module")
def cluster() -> Iterator[BusyboxCluster]:
    with busybox_cluster() as c:
        yield c


def test_keys_hold_across_gateways(cluster: BusyboxCluster) -> None:
    with cluster.admin(0) as admin:
        team = new_team(admin, "keys")  # through gateway 0
    with httpx.Client(base_url=cluster.gateways[1].url, headers={"X-API-Key": team.key}) as other:
        assert other.get("/v2/sandboxes").status_code == 200  # at once on the other
        made = other.post("/api-keys", json={"name": "second"}).json()
    key, urls = made["key"], [g.url for g in cluster.gateways] + [n.url for n in cluster.nodes.values()]
    for url in urls:  # every gateway and node knows it at once
        assert httpx.get(f"{url}/v2/sandboxes", headers={"X-API-Key": key}).status_code == 200, url
    with httpx.Client(base_url=cluster.gateways[0].url, headers={"X-API-Key": team.key}) as first:
        assert first.delete(f"/api-keys/{made['id']}").status_code == 204
    started = time.monotonic()
    refused: set[str] = set()
    while len(refused) < len(urls) and time.monotonic() - started < 15:
        refused |= {u for u in urls if httpx.get(f"{u}/v2/sandboxes", headers={"X-API-Key": key}).status_code == 401}
    assert refused == set(urls), "a deleted key must stop working everywhere within the bound"
    assert time.monotonic() - started < 10


def test_two_teams_are_isolated_on_every_route_through_the_gateways(cluster: BusyboxCluster) -> None:
    with cluster.admin(0) as admin:
        a, b = new_team(admin, "iso-a"), new_team(admin, "iso-b")
    owned = make_owned(cluster.on(a, 0), cluster.layout)
    _known_everywhere(cluster, owned)
    try:
        b_other = cluster.on(b, 1)
        assert routes_with_ids(owned, b_other) > 80
        routes_without_ids(owned, b_other, cluster.layout)
        envd_traffic(owned, b_other)
        moved = dataclasses.replace(owned, team=cluster.on(a, 1))
        assert routes_with_ids(moved, cluster.on(b, 0)) > 80  # the other way round, gateways swapped
        with b_other.client() as client:
            for method, path in (
                ("GET", "/nodes"),
                ("GET", f"/nodes/{NODES[0]}"),
                ("POST", f"/nodes/{NODES[0]}/drain"),
            ):
                assert client.request(method, path).status_code == 403, path
            assert client.get("/v2/sandboxes").json() == []
        with cluster.on(a, 1).client() as client:
            assert {s["sandboxID"] for s in client.get("/v2/sandboxes").json()} == {owned.running, owned.paused}
    finally:
        drop_owned(owned)


def test_the_running_quota_holds_across_gateways(cluster: BusyboxCluster) -> None:
    with cluster.admin(0) as admin:
        team = new_team(admin, "quota", maxRunning=3)

    async def burst() -> list[httpx.Response]:
        clients = [
            httpx.AsyncClient(base_url=g.url, headers={"X-API-Key": team.key}, timeout=120) for g in cluster.gateways
        ]
        try:
            return list(
                await asyncio.gather(
                    *(clients[i % 2].post("/sandboxes", json={"templateID": "bb", "timeout": 120}) for i in range(40))
                )
            )
        finally:
            for client in clients:
                await client.aclose()

    try:
        answers = asyncio.run(burst())
        statuses = [r.status_code for r in answers]
        # what went wrong, should it (seen once under CI load: two made, 38 refused): the errors, each once
        told = sorted({f"{r.status_code} {r.text[:300]}" for r in answers if r.status_code != 201})
        assert statuses.count(201) == 3 and statuses.count(429) == 37, told
        assert all(int(r.headers["retry-after"]) >= 1 for r in answers if r.status_code == 429)
        assert all(
            "maximum number of concurrent E2B sandboxes (3)" in r.json()["message"]
            for r in answers[3:]
            if r.status_code == 429
        )
        with cluster.on(team, 1).client() as client:
            running = [s["sandboxID"] for s in client.get("/v2/sandboxes").json()]
            assert len(running) == 3
        assert asyncio.run(_queued_until_room(cluster, team, running[0])).status_code == 201
        with cluster.on(team, 1).client() as client:  # every node's share, whichever node answers
            deadline = time.monotonic() + 20
            while (usage := client.get(f"/teams/{team.team_id}/usage").json())["sandboxSeconds"] <= 0:
                assert time.monotonic() < deadline, usage
                time.sleep(0.5)
            assert usage["teamID"] == team.team_id and usage["memoryGiBSeconds"] > 0
    finally:
        with cluster.on(team, 0).client() as client:
            for item in client.get("/v2/sandboxes").json():
                client.delete(f"/sandboxes/{item['sandboxID']}")


def test_a_killed_sandbox_frees_its_quota_slot_at_once(cluster: BusyboxCluster) -> None:
    """A kill frees the team's slot as soon as the directory shows the sandbox gone, through either
    gateway (the create's reservation counted the killed sandbox for 15 s more: creates at the
    limit got 429 meanwhile)."""
    with cluster.admin(0) as admin:
        team = new_team(admin, "freed", maxRunning=2)
    clients = [cluster.on(team, i).client() for i in range(2)]
    try:
        made = [clients[0].post("/sandboxes", json={"templateID": "bb", "timeout": 120}) for _ in range(2)]
        assert [r.status_code for r in made] == [201, 201], [r.text for r in made]
        alive = [r.json()["sandboxID"] for r in made]
        assert clients[1].post("/sandboxes", json={"templateID": "bb"}).status_code == 429
        for round_ in range(4):  # kill through one gateway, create through the same and the other
            killer, creator = clients[round_ % 2], clients[(round_ // 2) % 2]
            assert killer.delete(f"/sandboxes/{alive.pop(0)}").status_code == 204
            deadline, tries = time.monotonic() + 5, 0
            while (r := creator.post("/sandboxes", json={"templateID": "bb", "timeout": 120})).status_code == 429:
                tries += 1
                assert time.monotonic() < deadline, f"round {round_}: still 429 after {tries} tries: {r.text}"
                time.sleep(0.2)
            assert r.status_code == 201, r.text
            alive.append(r.json()["sandboxID"])
            assert creator.post("/sandboxes", json={"templateID": "bb"}).status_code == 429  # full again
    finally:
        for item in clients[0].get("/v2/sandboxes").json():
            clients[0].delete(f"/sandboxes/{item['sandboxID']}")
        for client in clients:
            client.close()


async def _queued_until_room(cluster: BusyboxCluster, team: TeamKey, victim: str) -> httpx.Response:
    """A create that waits (through one gateway) while the team is full, until a kill through the
    other gateway makes room."""
    headers = {"X-API-Key": team.key}
    async with (
        httpx.AsyncClient(base_url=cluster.gateways[0].url, headers=headers, timeout=60) as first,
        httpx.AsyncClient(base_url=cluster.gateways[1].url, headers=headers, timeout=60) as second,
    ):
        waiting = asyncio.ensure_future(first.post("/sandboxes", json={"templateID": "bb"}, params={"wait": "30"}))
        await asyncio.sleep(2)
        assert not waiting.done(), waiting.result().text
        assert (await second.delete(f"/sandboxes/{victim}")).status_code == 204
        return await waiting


def _known_everywhere(cluster: BusyboxCluster, owned: Owned) -> None:
    """A's template and snapshot on every node (a node learns the repository's new entries when a
    create names one it lacks): a gateway sends a template's requests to any node."""
    for server in cluster.nodes.values():
        node = TeamKey(owned.team.team_id, owned.team.key, server.url)
        with node.client() as client:
            deadline = time.monotonic() + 30
            for path, source in (
                (f"/templates/{owned.template}", owned.template),
                (f"/snapshots/{owned.snapshot}", owned.snapshot),
            ):
                while client.get(path).status_code != 200:
                    assert time.monotonic() < deadline, (server.url, path)
                    made = client.post("/sandboxes", json={"templateID": source, "timeout": 30})
                    if made.status_code == 201:
                        client.delete(f"/sandboxes/{made.json()['sandboxID']}")
                    time.sleep(0.5)
