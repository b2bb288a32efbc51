"""The CLI against a gateway: `aenv nodes` (table, JSON in E2B's node shape, one node's detail,
clear errors), `aenv nodes undrain` (and the API under it, through a gateway and straight at the
node), and `aenv list` merging both nodes' sandboxes (each naming its node), on a real cluster (3
etcd members, 2 nodes, a gateway). The shape and undrain tests were seen failing before: /nodes
answered snake_case keys, and there was no undrain."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from aenv.sdk import AenvError, Client
from tests.cluster.test_gateway import Cluster, cluster  # noqa: F401  (the module's cluster fixture)
from tests.conftest import API_KEY, Server

pytestmark = pytest.mark.sandbox


def aenv(url: str, *args: str, key: str = API_KEY, terminal: bool = False) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "AENV_URL": url, "AENV_API_KEY": key, "COLUMNS": "200"}
    env.pop("FORCE_COLOR", None)
    if terminal:
        env["FORCE_COLOR"] = "1"  # rich takes it as a terminal: the table, not JSON
    argv = [sys.executable, "-m", "aenv.cli.main", *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


def test_nodes_json_when_piped_table_on_a_terminal(cluster: Cluster, one_on_each: dict[str, str]) -> None:  # noqa: F811
    """(A sandbox on each: a node whose data dir is new has no build of `base` cached until then,
    and says so in its entry at its next heartbeat: seen failing when listed at once.)"""
    gw = cluster.gateway.url
    deadline = time.monotonic() + 20
    while True:
        piped = aenv(gw, "nodes")
        assert piped.returncode == 0, piped.stderr
        listed = json.loads(piped.stdout)
        settled = all("base" in n.get("cachedBuilds", []) and n.get("createSuccesses", 0) >= 1 for n in listed)
        if settled or time.monotonic() > deadline:  # (creates counted at the next heartbeat)
            break
        time.sleep(0.5)
    assert [n["nodeID"] for n in listed] == ["node-a", "node-b"]
    assert {n["address"] for n in listed} == {s.url for s in cluster.nodes.values()}
    assert all(n["room"] > 0 and n["status"] == "ready" and not n["draining"] for n in listed)
    for node in listed:  # E2B's node fields, then aenv's, all camelCase
        assert {"sandboxCount", "sandboxStartingCount", "allocatedCPU", "allocatedMemoryMiB", "metrics"} <= set(node)
        assert node["id"] == node["nodeID"] and node["createSuccesses"] >= 1 and node["createFails"] >= 0
        assert {"maxSandboxes", "sandboxPausedCount", "cpuCount", "memoryMiB", "startedAt", "updatedAt"} <= set(node)
        assert not [key for key in node if "_" in key], node
        assert node["maxSandboxes"] > 0 and node["metrics"]["cpuCount"] == node["cpuCount"] > 0
        assert "base" in node["cachedBuilds"]
    assert json.loads(aenv(gw, "nodes", "--json", terminal=True).stdout)[0]["nodeID"] == "node-a"

    table = aenv(gw, "nodes", terminal=True)
    assert table.returncode == 0, table.stderr
    assert "2 nodes" in table.stdout and "node-b" in table.stdout and "allocatedCPU" in table.stdout
    with pytest.raises(ValueError):
        json.loads(table.stdout)

    one = aenv(gw, "nodes", "node-b")
    assert one.returncode == 0 and json.loads(one.stdout)["address"] == cluster.nodes["node-b"].url
    detail = aenv(gw, "nodes", "node-b", terminal=True)
    assert "address" in detail.stdout and cluster.nodes["node-b"].url in detail.stdout


def test_nodes_errors_are_one_line(cluster: Cluster, server: Server) -> None:  # noqa: F811
    gw = cluster.gateway.url
    missing = aenv(gw, "nodes", "node-zz")
    assert missing.returncode == 1 and "node-zz" in missing.stderr and "Traceback" not in missing.stderr
    odd = aenv(gw, "nodes", "../sandboxes")  # the id is one path segment, never a route of its own
    assert odd.returncode == 1 and "Traceback" not in odd.stderr
    wrong_key = aenv(gw, "nodes", key="e2b_" + "1" * 40)
    assert wrong_key.returncode == 1 and "Traceback" not in wrong_key.stderr and wrong_key.stdout == ""
    lone = aenv(server.url, "nodes")  # a node without a cluster has no node list
    assert lone.returncode == 1 and "not a gateway" in lone.stderr
    nothing = aenv("http://127.0.0.1:1", "nodes")
    assert nothing.returncode == 1 and "cannot reach" in nothing.stderr


@pytest.fixture()
def one_on_each(cluster: Cluster) -> Iterator[dict[str, str]]:  # noqa: F811
    """A sandbox made straight on each node: node-a's labelled, node-b's paused."""
    made: dict[str, str] = {}
    try:
        for name, body in (("node-a", {"metadata": {"who": "cli"}}), ("node-b", {})):
            with httpx.Client(base_url=cluster.nodes[name].url, headers={"X-API-Key": API_KEY}, timeout=120) as c:
                r = c.post("/sandboxes", json={"templateID": "base", "timeout": 300, **body})
                assert r.status_code == 201, r.text
                made[name] = r.json()["sandboxID"]
        with httpx.Client(base_url=cluster.nodes["node-b"].url, headers={"X-API-Key": API_KEY}, timeout=120) as c:
            assert c.post(f"/sandboxes/{made['node-b']}/pause").status_code == 204
        yield made
    finally:
        with cluster.api() as api:
            for sid in made.values():
                api.delete(f"/sandboxes/{sid}")


def test_list_through_a_gateway_merges_the_nodes(cluster: Cluster, one_on_each: dict[str, str]) -> None:  # noqa: F811
    gw = cluster.gateway.url
    everything = aenv(gw, "list")
    assert everything.returncode == 0, everything.stderr
    states = {row["sandboxID"]: row["state"] for row in json.loads(everything.stdout)}
    assert states[one_on_each["node-a"]] == "running" and states[one_on_each["node-b"]] == "paused"

    paused = {row["sandboxID"] for row in json.loads(aenv(gw, "list", "--state", "paused").stdout)}
    assert one_on_each["node-b"] in paused and one_on_each["node-a"] not in paused
    labelled = json.loads(aenv(gw, "list", "--meta", "who=cli").stdout)
    assert [row["sandboxID"] for row in labelled] == [one_on_each["node-a"]]
    assert json.loads(labelled[0]["metadata"]) == {"who": "cli"}


def test_list_items_name_their_node(cluster: Cluster, one_on_each: dict[str, str]) -> None:  # noqa: F811
    """Not E2B's, but the dashboard's Node column reads it: through a gateway (from its mirror, and
    merged from the nodes) and from a node that has an id."""
    with cluster.api() as api:
        for path in ("/v2/sandboxes", "/sandboxes"):
            items = {i["sandboxID"]: i.get("nodeID") for i in api.get(path, params={"state": "running"}).json()}
            assert items[one_on_each["node-a"]] == "node-a", (path, items)
        paused = {i["sandboxID"]: i.get("nodeID") for i in api.get("/v2/sandboxes", params={"state": "paused"}).json()}
        assert paused[one_on_each["node-b"]] == "node-b"
    with httpx.Client(base_url=cluster.nodes["node-a"].url, headers={"X-API-Key": API_KEY}) as direct:
        assert {i["sandboxID"]: i.get("nodeID") for i in direct.get("/v2/sandboxes").json()}[one_on_each["node-a"]] == (
            "node-a"
        )


def node_shown(cluster: Cluster, node_id: str, status: str) -> bool:  # noqa: F811
    """Whether the gateway shows ``node_id`` with ``status`` within 5 s (its mirror follows etcd)."""
    deadline = time.monotonic() + 5
    with cluster.api() as api:
        while time.monotonic() < deadline:
            if api.get(f"/nodes/{node_id}").json()["status"] == status:
                return True
            time.sleep(0.1)
    return False


def create_straight_at(cluster: Cluster, node_id: str) -> httpx.Response:  # noqa: F811
    with httpx.Client(base_url=cluster.nodes[node_id].url, headers={"X-API-Key": API_KEY}, timeout=120) as c:
        r = c.post("/sandboxes", json={"templateID": "base", "timeout": 60})
        if r.status_code == 201:
            c.delete(f"/sandboxes/{r.json()['sandboxID']}")
        return r


def test_undrain_takes_a_drained_node_back(cluster: Cluster) -> None:  # noqa: F811
    gw = cluster.gateway.url
    again = aenv(gw, "nodes", "undrain", "node-b")  # not draining: nothing to undo, and no error
    assert again.returncode == 0, again.stderr
    assert (json.loads(again.stdout)["nodeID"], json.loads(again.stdout)["status"]) == ("node-b", "ready")

    drain = aenv(gw, "nodes", "drain", "node-b")
    assert drain.returncode == 0 and json.loads(drain.stdout.splitlines()[-1])["done"], drain.stderr
    assert node_shown(cluster, "node-b", "draining")
    refused = create_straight_at(cluster, "node-b")
    assert refused.status_code == 429 and "draining" in refused.text

    undone = aenv(gw, "nodes", "undrain", "node-b", terminal=True)
    assert undone.returncode == 0 and "node-b takes new work again (status ready)" in undone.stdout, undone
    assert create_straight_at(cluster, "node-b").status_code == 201
    assert node_shown(cluster, "node-b", "ready")
    assert aenv(gw, "nodes", "undrain", "node-b").returncode == 0  # again: idempotent

    # straight at the node, as the gateway asks it
    with httpx.Client(base_url=cluster.nodes["node-b"].url, timeout=30) as direct:
        key = {"X-API-Key": API_KEY}
        assert direct.post("/cluster/undrain", headers={"X-API-Key": "e2b_wrong"}).status_code == 401
        assert direct.get("/cluster/undrain", headers=key).status_code == 400
        assert direct.post("/cluster/undrain", headers=key, content=b'{"move": true}').status_code == 400
        with direct.stream("POST", "/cluster/drain", headers=key, json={"move": False}) as r:
            assert r.status_code == 200 and json.loads(next(r.iter_lines()))["node"] == "node-b"
        assert create_straight_at(cluster, "node-b").status_code == 429
        r = direct.post("/cluster/undrain", headers=key)
        assert r.status_code == 200 and (r.json()["nodeID"], r.json()["status"]) == ("node-b", "ready"), r.text
        assert create_straight_at(cluster, "node-b").status_code == 201

    # E2B's status change (POST /nodes/{id}), and the refusals
    with cluster.api() as api:
        assert api.post("/nodes/node-b", json={"status": "draining"}).status_code == 204
        assert node_shown(cluster, "node-b", "draining")
        assert api.post("/nodes/node-b", json={"status": "ready"}).status_code == 204
        assert node_shown(cluster, "node-b", "ready")
        for body in ({"status": "gone"}, {}, ["ready"]):
            assert api.post("/nodes/node-b", json=body).status_code == 400, body
        assert api.post("/nodes/node-zz/undrain").status_code == 404
        assert api.post("/nodes/node-zz", json={"status": "ready"}).status_code == 404
        assert api.delete("/nodes/node-b").status_code == 405
    assert httpx.post(f"{gw}/nodes/node-b/undrain").status_code == 401
    missing = aenv(gw, "nodes", "undrain", "node-zz")
    assert missing.returncode == 1 and "node-zz" in missing.stderr and "Traceback" not in missing.stderr

    with Client(gw, API_KEY) as client:  # the SDK's twin of the CLI's (it had drain_node only)
        assert client.drain_node("node-b")["done"]
        assert node_shown(cluster, "node-b", "draining")
        assert (client.undrain_node("node-b")["nodeID"], client.undrain_node("node-b")["status"]) == ("node-b", "ready")
        assert node_shown(cluster, "node-b", "ready")
        with pytest.raises(AenvError, match="node-zz"):
            client.undrain_node("node-zz")


def test_undrain_stops_a_drain_under_way(cluster: Cluster) -> None:  # noqa: F811
    """An undrain while the drain pauses sandboxes: the drain ends, the node takes work at once, and
    a sandbox it paused resumes where it is."""
    with httpx.Client(base_url=cluster.nodes["node-b"].url, headers={"X-API-Key": API_KEY}, timeout=120) as c:
        made = [c.post("/sandboxes", json={"templateID": "base", "timeout": 120}) for _ in range(3)]
        ids = [r.json()["sandboxID"] for r in made if r.status_code == 201]
        assert len(ids) == 3, [r.text for r in made]
        try:
            with c.stream("POST", "/cluster/drain", json={"move": False}, timeout=120) as r:
                lines = r.iter_lines()
                assert json.loads(next(lines))["done"] is False
                undone = c.post("/cluster/undrain")
                assert undone.status_code == 200 and undone.json()["status"] == "ready", undone.text
                last = [json.loads(line) for line in lines if line][-1]
            assert last["done"] and last["paused"] < 3, last  # it stopped before pausing them all
            assert create_straight_at(cluster, "node-b").status_code == 201
            for sandbox_id in ids:
                state = c.get(f"/sandboxes/{sandbox_id}").json()["state"]
                if state == "paused":
                    assert c.post(f"/sandboxes/{sandbox_id}/connect", json={"timeout": 60}).status_code in (200, 201)
                assert c.get(f"/sandboxes/{sandbox_id}").json()["state"] == "running"
        finally:
            for sandbox_id in ids:
                c.delete(f"/sandboxes/{sandbox_id}")
