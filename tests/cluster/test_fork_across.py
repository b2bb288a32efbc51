"""Fork across nodes (aenv/cluster/forks.py): a fork through a gateway of a sandbox whose node has
room for fewer children than asked makes the rest on another node from a durable snapshot of the
source. Every child runs, each answer names its node, and every child's memory (a Python process
counting) and files go on from the source's. One cluster for the module: node-a runs at most 3
sandboxes, node-b has room."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from e2b import Sandbox

from aenv.cluster import forks
from tests.cluster.cluster import Cluster, running_cluster, use_gateway
from tests.conftest import API_KEY, Server
from tests.durable import COUNTER, count, wait_for

pytestmark = pytest.mark.sandbox

ROOM = {"AENV_MAX_SANDBOXES": "3", "AENV_MIN_FREE_MEMORY_MB": "0"}


@pytest.fixture(scope="module")
def cluster(server: Server) -> Iterator[Cluster]:
    env = {"node-a": ROOM, "node-b": {"AENV_MIN_FREE_MEMORY_MB": "0"}}
    with running_cluster(gateways=1, node_env=env) as c:
        yield c


@pytest.fixture()
def gateway(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[httpx.Client]:
    use_gateway(cluster, 0, monkeypatch)
    with httpx.Client(base_url=cluster.gateway.url, headers={"X-API-Key": API_KEY}, timeout=300) as client:
        yield client
    for node in cluster.nodes.values():
        with node.client() as direct:
            for item in direct.get("/sandboxes").json():
                direct.delete(f"/sandboxes/{item['sandboxID']}")


def counting_source(node: Server, gateway: httpx.Client) -> tuple[Sandbox, int]:
    """A sandbox made on ``node`` directly, its counter running and a file written."""
    with node.client() as direct:
        body: dict[str, Any] = {
            "templateID": "base",
            "timeout": 600,
            "metadata": {"run": "f1"},
            "envVars": {"MARK": "kept"},
            "lifecycle": {"onTimeout": "pause", "autoResume": False},
            "allow_internet_access": False,
            "network": {"allowOut": ["93.184.215.14"], "allowPublicTraffic": False},
        }
        r = direct.post("/sandboxes", json=body)
        assert r.status_code == 201, r.text
    sandbox_id = r.json()["sandboxID"]
    # Made on the node, not through the gateway: known to the gateway once the node's entry is written.
    wait_for(lambda: gateway.get(f"/sandboxes/{sandbox_id}").status_code == 200, 10)
    sbx = Sandbox.connect(sandbox_id)
    sbx.commands.run(COUNTER, background=True)
    sbx.files.write("/home/user/state.txt", "written before the fork")
    time.sleep(1.5)  # the counter's first writes
    return sbx, count(sbx)


def test_a_fork_past_its_nodes_room_runs_the_rest_on_another_node(cluster: Cluster, gateway: httpx.Client) -> None:
    source, before = counting_source(cluster.nodes["node-a"], gateway)
    source_info = gateway.get(f"/sandboxes/{source.sandbox_id}").json()
    assert source_info["network"]["allowPublicTraffic"] is False
    r = gateway.post(f"/sandboxes/{source.sandbox_id}/fork", json={"count": 4, "timeout": 300})
    assert r.status_code == 201, r.text
    results = r.json()
    assert len(results) == 4 and all("sandbox" in item for item in results), results
    where = [item["sandbox"]["nodeID"] for item in results]
    assert where.count("node-a") == 2 and where.count("node-b") == 2, where  # node-a: the source and 2
    for item in results:
        child_id = item["sandbox"]["sandboxID"]
        assert gateway.get(f"/sandboxes/{child_id}").json()["nodeID"] == item["sandbox"]["nodeID"]
        child = Sandbox.connect(child_id)
        assert child.files.read("/home/user/state.txt") == "written before the fork"
        at = count(child)
        assert at >= before  # the counter's process came along, with its memory
        assert wait_for(lambda child=child, at=at: count(child) > at, 10)  # and runs on
        assert child.commands.run("echo $MARK").stdout.strip() == "kept"
        info = gateway.get(f"/sandboxes/{child_id}").json()
        assert info["metadata"] == {"run": "f1"} and info["lifecycle"]["onTimeout"] == "pause"
        assert info["state"] == "running" and info["allowInternetAccess"] is False
        assert info["network"] == source_info["network"] and "trafficAccessToken" in item["sandbox"]
    with cluster.nodes["node-a"].client() as direct:
        assert len(direct.get("/sandboxes").json()) == 3  # never more than its room
    assert count(source) >= before  # the source runs on


def test_a_fork_with_no_room_on_its_node_is_made_elsewhere_whole(cluster: Cluster, gateway: httpx.Client) -> None:
    source, before = counting_source(cluster.nodes["node-a"], gateway)
    first = gateway.post(f"/sandboxes/{source.sandbox_id}/fork", json={"count": 2})
    assert first.status_code == 201 and all("sandbox" in i for i in first.json()), first.text
    assert [i["sandbox"]["nodeID"] for i in first.json()] == ["node-a"] * 2
    r = gateway.post(f"/sandboxes/{source.sandbox_id}/fork", json={"count": 2})
    assert r.status_code == 201 and all("sandbox" in i for i in r.json()), r.text
    assert [item["sandbox"]["nodeID"] for item in r.json()] == ["node-b"] * 2
    for item in r.json():
        child = Sandbox.connect(item["sandbox"]["sandboxID"])
        assert count(child) >= before
        assert child.files.read("/home/user/state.txt") == "written before the fork"


@pytest.mark.parametrize(
    "body",
    [
        b'{"count": 0}',
        b'{"count": "two"}',
        b'{"timeout": -1}',
        b"[1]",
        b"{not json",
        b'{"count": 100000}',
        b'{"n": 1000000000}',  # was 201 with one child (seen failing before unknown fields were refused)
        b'{"count": 2, "n": true}',
    ],
    ids=["zero", "string", "negative-timeout", "list", "not-json", "too-many", "unknown-n", "count-and-unknown"],
)
def test_a_fork_the_node_refuses_is_answered_as_the_node_answered(
    cluster: Cluster, gateway: httpx.Client, body: bytes
) -> None:
    """A fork body the node refuses (or one it answers with something else than its list) is
    passed through: the node's own status and JSON, never a gateway error."""
    with cluster.nodes["node-b"].client() as direct:
        r = direct.post("/sandboxes", json={"templateID": "base", "timeout": 120})
        assert r.status_code == 201, r.text
        sandbox_id = r.json()["sandboxID"]
        wait_for(lambda: gateway.get(f"/sandboxes/{sandbox_id}").status_code == 200, 10)
        headers = {"content-type": "application/json"}
        through = gateway.post(f"/sandboxes/{sandbox_id}/fork", content=body, headers=headers)
        own = direct.post(f"/sandboxes/{sandbox_id}/fork", content=body, headers=headers)
        assert 400 <= through.status_code < 500, through.text
        assert (through.status_code, through.json()) == (own.status_code, own.json())
        assert through.headers["x-aenv-node-id"] == "node-b"
        assert direct.get(f"/sandboxes/{sandbox_id}").json()["state"] == "running"


def test_a_create_the_node_refuses_is_answered_as_the_node_answered(cluster: Cluster, gateway: httpx.Client) -> None:
    """What a fork elsewhere sends is a create: one a node refuses (an unknown field, a label with
    a NUL, a feature not built) is that node's 400 through the gateway too, and makes nothing."""
    bodies = [
        {"templateId": "base"},
        {"templateID": "base", "metadata": {"a\x00": "b"}},
        {"templateID": "base", "iam": {"tokens": {"aws": {"audience": "sts.amazonaws.com"}}}},
    ]

    def listed() -> set[str]:
        return {item["sandboxID"] for item in gateway.get("/v2/sandboxes").json()}

    before = listed()  # the session's nodes hold other modules' sandboxes (paused ones too)
    with cluster.nodes["node-b"].client() as direct:
        for body in bodies:
            through, own = gateway.post("/v2/sandboxes", json=body), direct.post("/v2/sandboxes", json=body)
            assert through.status_code == 400, through.text
            assert through.json() == own.json()
    assert listed() - before == set()


def test_a_node_creates_from_a_snapshot_committed_elsewhere_a_moment_ago(
    cluster: Cluster, gateway: httpx.Client
) -> None:
    """What a fork elsewhere relies on: a create naming an id the node does not know reads that
    entry from the repository at once, not only at its next whole-catalogue read (every 3 s)."""
    a, b = cluster.nodes["node-a"], cluster.nodes["node-b"]
    with a.client() as on_a, b.client() as on_b:
        unknown = on_b.post("/sandboxes", json={"templateID": "snap_0000000000000000", "timeout": 60})
        assert unknown.status_code == 404, unknown.text  # and node-b has just read the whole catalogue
        made = on_a.post("/sandboxes", json={"templateID": "base", "timeout": 120})
        assert made.status_code == 201, made.text
        source = made.json()["sandboxID"]
        snapped = on_a.post(f"/sandboxes/{source}/snapshots", json={"durable": True})
        assert snapped.status_code == 201 and snapped.json()["committed"] is True, snapped.text
        child = on_b.post("/sandboxes", json={"templateID": snapped.json()["snapshotID"], "timeout": 60})
        assert child.status_code == 201, child.text
        assert on_b.get(f"/sandboxes/{child.json()['sandboxID']}").json()["state"] == "running"


def test_what_the_gateway_reads_of_a_fork_and_asks_for_its_children() -> None:
    assert forks.asked(b"", 16) == (1, None, None)
    assert forks.asked(b'{"count": 3, "timeout": 60}', 16) == (3, 60, None)
    # per-child metadata (aenv's): one map for all, or one per child
    assert forks.asked(b'{"count": 2, "metadata": {"k": "v"}}', 16) == (2, None, [{"k": "v"}, {"k": "v"}])
    assert forks.asked(b'{"count": 2, "metadata": [{"i": "0"}, {}]}', 16) == (2, None, [{"i": "0"}, {}])
    # copies of volumes are made on the source's node alone: such a fork is never spread
    assert forks.asked(b'{"count": 2, "volumes": "shared"}', 16) == (2, None, None)
    assert forks.asked(b'{"count": 2, "volumes": "clone"}', 16) is None
    bad = (b"[1]", b'{"count": true}', b'{"count": 0}', b'{"timeout": "1"}', b"{", b'{"count": 2, "n": 9}', b'{"n": 9}')
    bad += (b'{"count": 2, "metadata": [{}]}', b'{"metadata": {"k": 1}}', b'{"metadata": "x"}', b'{"metadata": [1]}')
    for body in bad:
        assert forks.asked(body, 16) is None  # the node answered those itself
    # past the gateway's own bound, whatever a node configured otherwise answered: never spread
    assert forks.asked(b'{"count": 16}', 16) == (16, None, None) and forks.asked(b'{"count": 17}', 16) is None
    full = {"code": 429, "message": "this node runs at most 3 sandboxes", "error_code": "limit_exceeded"}
    assert forks.results_of(429, full, 2) == [{"error": full}, {"error": full}]
    assert forks.results_of(429, {**full, "error_code": "cluster_unavailable"}, 2) is None
    assert forks.results_of(201, [{"sandbox": {}}], 2) is None  # not one result per child
    source = {
        "sandboxID": "s1",
        "envdAccessToken": "t",
        "metadata": {"a": "b"},
        "endAt": "2999-01-01T00:00:00Z",
        "lifecycle": {"onTimeout": "pause", "autoResume": True, "keepMemory": True},
        "network": {"denyOut": ["10.0.0.0/8"], "maskRequestHost": "x:${PORT}"},
        "allowInternetAccess": True,
    }
    body = forks.child_body(source, "snap_1", None)
    assert body["templateID"] == "snap_1" and body["secure"] is True and body["metadata"] == {"a": "b"}
    assert body["network"] == source["network"] and body["allow_internet_access"] is True
    assert body["lifecycle"] == {"onTimeout": "pause", "autoResume": True} and body["autoPauseMemory"] is True
    assert body["timeout"] > 10**9  # what is left of the source's
    assert forks.child_body({**source, "envdAccessToken": None} | {}, "snap_1", 60)["timeout"] == 60
    assert forks.child_body({k: v for k, v in source.items() if k != "envdAccessToken"}, "s", 5)["secure"] is False
    mine = forks.child_body({**source, "grace": 30}, "snap_1", None, {"child": "3", "a": "c"})
    assert mine["metadata"] == {"a": "c", "child": "3"} and mine["grace"] == 30 and "grace" not in body
