"""The CLI against a gateway: `aenv nodes` (table, JSON, one node's detail, clear errors) and
`aenv list` merging both nodes' sandboxes, on a real cluster (3 etcd members, 2 nodes, a gateway)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

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


def test_nodes_json_when_piped_table_on_a_terminal(cluster: Cluster) -> None:  # noqa: F811
    gw = cluster.gateway.url
    piped = aenv(gw, "nodes")
    assert piped.returncode == 0, piped.stderr
    listed = json.loads(piped.stdout)
    assert [n["node_id"] for n in listed] == ["node-a", "node-b"]
    assert {n["address"] for n in listed} == {s.url for s in cluster.nodes.values()}
    assert all(n["room"] > 0 and not n["draining"] for n in listed)
    assert json.loads(aenv(gw, "nodes", "--json", terminal=True).stdout)[0]["node_id"] == "node-a"

    table = aenv(gw, "nodes", terminal=True)
    assert table.returncode == 0, table.stderr
    assert "2 nodes" in table.stdout and "node-b" in table.stdout and "cpu_committed" in table.stdout
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
