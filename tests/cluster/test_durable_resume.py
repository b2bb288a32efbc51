"""Resume anywhere: a sandbox paused durably on a node that is then lost (kill -9) is resumed by
another node through a gateway, with its memory (a process's counter goes on), its files, its
id, metadata and env; the directory moves it with an epoch compare-and-swap."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
from e2b import Sandbox

from aenv.node.service import OWNER_FULL_HEADER
from aenv.repo.backends import PosixBackend
from aenv.repo.repository import Repository
from tests.cluster.cluster import LEASE_TTL, Cluster, directory_entry, running_cluster, use_gateway, wait_for_nodes
from tests.cluster.nodes import start_node
from tests.conftest import REPO_DIR, Server
from tests.durable import COUNTER, count, wait_for

pytestmark = pytest.mark.sandbox


@pytest.fixture(scope="module")
def cluster(server: Server) -> Iterator[Cluster]:
    with running_cluster() as c:
        yield c


def test_a_durable_pause_outlives_its_node(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    lost = start_node(cluster.etcd.url, "node-gone", lease_ttl=LEASE_TTL)
    repo = Repository(PosixBackend(REPO_DIR))
    sandbox_id = ""
    try:
        for gateway in cluster.gateways:
            wait_for_nodes(gateway, {*cluster.nodes, "node-gone"})
        with lost.client() as direct:
            body = {"templateID": "base", "timeout": 600, "metadata": {"run": "r1"}, "envVars": {"MARK": "kept"}}
            r = direct.post("/sandboxes", json=body)
            assert r.status_code == 201, r.text
            sandbox_id = r.json()["sandboxID"]
        use_gateway(cluster, 0, monkeypatch)
        sbx = Sandbox.connect(sandbox_id)
        sbx.commands.run(COUNTER, background=True)
        sbx.files.write("/home/user/state.txt", "written on node-gone")
        time.sleep(1.5)
        before = count(sbx)
        with cluster.api(0) as api:
            r = api.post(f"/sandboxes/{sandbox_id}/pause")
            assert r.status_code == 204, r.text
            assert r.headers["x-aenv-node-id"] == "node-gone"
            wait_for(lambda: api.get(f"/sandboxes/{sandbox_id}").json().get("durable"))
        # durable means the directory says so already: another node may take it over from now on
        # (GET said so up to a beat earlier, and a node lost in between lost the sandbox)
        entry = directory_entry(cluster, sandbox_id)
        assert entry is not None and entry.durable
        assert entry.node_id == "node-gone" and entry.state == "paused"

        lost.stop(signal.SIGKILL)
        wait_for_nodes(cluster.gateways[1], set(cluster.nodes), timeout=LEASE_TTL + 15)

        use_gateway(cluster, 1, monkeypatch)
        resumed = Sandbox.connect(sandbox_id)
        at_resume = count(resumed)
        assert at_resume >= before  # the same process, its memory kept: not a fresh counter
        wait_for(lambda: count(resumed) > at_resume, 10)
        assert resumed.files.read("/home/user/state.txt") == "written on node-gone"
        assert resumed.commands.run("echo $MARK").stdout.strip() == "kept"
        with cluster.api(1) as api:
            r = api.get(f"/sandboxes/{sandbox_id}")
            assert r.status_code == 200, r.text
            assert r.headers["x-aenv-node-id"] in cluster.nodes
            assert r.json()["state"] == "running" and r.json()["metadata"] == {"run": "r1"}
        moved = directory_entry(cluster, sandbox_id)
        assert moved is not None and moved.node_id in cluster.nodes
        assert moved.epoch == entry.epoch + 1 and moved.state == "running" and not moved.durable
        wait_for(lambda: repo.get_entry("sandbox", sandbox_id) is None, 20)  # it runs again

        # The lost node comes back: its copy is stale (the directory gave the sandbox away) and
        # goes; the sandbox runs on where it was resumed.
        lost = start_node(cluster.etcd.url, "node-gone", lease_ttl=LEASE_TTL)
        with lost.client() as direct:
            wait_for(lambda: direct.get(f"/sandboxes/{sandbox_id}").status_code == 404, 30)
        assert directory_entry(cluster, sandbox_id) == moved
        going = count(resumed)
        wait_for(lambda: count(resumed) > going, 10)
    finally:
        if sandbox_id:
            with cluster.api(1) as api:
                api.delete(f"/sandboxes/{sandbox_id}")
        lost.stop()


def test_a_pause_that_is_not_durable_is_not_taken_over(cluster: Cluster) -> None:
    """A resume through a gateway of a sandbox whose lost node kept its pause local (paused
    without memory) gets a 404 naming the node; no other node invents it."""
    node = start_node(cluster.etcd.url, "node-local", lease_ttl=LEASE_TTL)
    sandbox_id = ""
    try:
        wait_for_nodes(cluster.gateway, {*cluster.nodes, "node-local"})
        with node.client() as direct:
            r = direct.post("/sandboxes", json={"templateID": "base", "timeout": 300})
            assert r.status_code == 201, r.text
            sandbox_id = r.json()["sandboxID"]
            assert direct.post(f"/sandboxes/{sandbox_id}/pause", json={"memory": False}).status_code == 204
            assert direct.get(f"/sandboxes/{sandbox_id}").json()["durable"] is False
        wait_for(lambda: (e := directory_entry(cluster, sandbox_id)) is not None and e.state == "paused")
        node.stop(signal.SIGKILL)
        wait_for_nodes(cluster.gateway, set(cluster.nodes), timeout=LEASE_TTL + 15)
        with cluster.api() as api:
            r = api.post(f"/sandboxes/{sandbox_id}/connect", json={"timeout": 60})
            assert r.status_code == 404 and "node-local" in r.json()["message"], r.text
        for other in cluster.nodes.values():
            with other.client() as direct:
                assert direct.post(f"/sandboxes/{sandbox_id}/connect", json={"timeout": 60}).status_code == 404
        entry = directory_entry(cluster, sandbox_id)
        assert entry is not None and entry.node_id == "node-local" and entry.epoch == 1
    finally:
        node.stop(signal.SIGKILL)
        back = start_node(cluster.etcd.url, "node-local", lease_ttl=LEASE_TTL)  # to remove what it left
        with back.client() as direct:
            if sandbox_id:
                direct.delete(f"/sandboxes/{sandbox_id}")
        back.stop()


def test_a_resume_on_a_node_that_does_not_hold_it_is_not_found(cluster: Cluster) -> None:
    """A node asked directly to resume a sandbox another live node holds does not take it."""
    with cluster.api() as api:
        r = api.post("/sandboxes", json={"templateID": "base", "timeout": 120})
        assert r.status_code == 201, r.text
        sandbox_id, holder = r.json()["sandboxID"], r.headers["x-aenv-node-id"]
        try:
            assert api.post(f"/sandboxes/{sandbox_id}/pause").status_code == 204
            wait_for(lambda: (e := directory_entry(cluster, sandbox_id)) is not None and e.durable)
            other = next(n for name, n in cluster.nodes.items() if name != holder)
            with other.client() as direct:
                r = direct.post(f"/sandboxes/{sandbox_id}/connect", json={"timeout": 60})
                assert r.status_code == 404, r.text
            entry = directory_entry(cluster, sandbox_id)
            assert entry is not None and entry.node_id == holder and entry.epoch == 1
            # the gateway's word that its owner is full is the gateway's: a client's is dropped
            forged = {OWNER_FULL_HEADER: "1"}
            r = api.post(f"/sandboxes/{sandbox_id}/connect", json={"timeout": 60}, headers=forged)
            assert r.status_code == 201 and r.headers["x-aenv-node-id"] == holder, r.text
            entry = directory_entry(cluster, sandbox_id)
            assert entry is not None and entry.node_id == holder and entry.epoch == 1
        finally:
            api.delete(f"/sandboxes/{sandbox_id}")


@contextmanager
def lost_durable_sandbox(cluster: Cluster, name: str) -> Iterator[str]:
    """A sandbox paused durably on node ``name``, which is then killed (-9) and known lost by
    every gateway; killed after, and what the node left removed by restarting it."""
    lost = start_node(cluster.etcd.url, name, lease_ttl=LEASE_TTL)
    sandbox_id = ""
    try:
        for gateway in cluster.gateways:
            wait_for_nodes(gateway, {*cluster.nodes, name})
        with lost.client() as direct:
            r = direct.post("/sandboxes", json={"templateID": "base", "timeout": 600})
            assert r.status_code == 201, r.text
            sandbox_id = r.json()["sandboxID"]
            assert direct.post(f"/sandboxes/{sandbox_id}/pause").status_code == 204
        wait_for(lambda: (e := directory_entry(cluster, sandbox_id)) is not None and e.durable)
        lost.stop(signal.SIGKILL)
        for gateway in cluster.gateways:
            wait_for_nodes(gateway, set(cluster.nodes), timeout=LEASE_TTL + 15)
        yield sandbox_id
    finally:
        if sandbox_id:
            with cluster.api() as api:
                api.delete(f"/sandboxes/{sandbox_id}")
        lost.stop(signal.SIGKILL)
        back = start_node(cluster.etcd.url, name, lease_ttl=LEASE_TTL)
        with back.client() as direct:
            if sandbox_id:
                direct.delete(f"/sandboxes/{sandbox_id}")
        back.stop()


def holders(cluster: Cluster, sandbox_id: str) -> list[str]:
    found = []
    for name, node in cluster.nodes.items():
        with node.client() as direct:
            if direct.get(f"/sandboxes/{sandbox_id}").status_code == 200:
                found.append(name)
    return found


def test_two_connects_through_two_gateways_give_one_instance(cluster: Cluster) -> None:
    with lost_durable_sandbox(cluster, "node-race") as sandbox_id:
        for index in (0, 1):  # it belongs to the cluster: shown paused (not 404) until a connect
            with cluster.api(index) as api:
                r = api.get(f"/sandboxes/{sandbox_id}")
                assert r.status_code == 200 and r.headers["x-aenv-node-id"] == "node-race", r.text
                assert (r.json()["state"], r.json()["durable"], r.json()["nodeID"]) == ("paused", True, "node-race")
                listed = api.get("/v2/sandboxes", params={"state": "paused"}).json()
                assert sandbox_id in [s["sandboxID"] for s in listed]

        def connect(index: int) -> tuple[int, str, str]:
            with cluster.api(index) as api:
                r = api.post(f"/sandboxes/{sandbox_id}/connect", json={"timeout": 120})
                return r.status_code, r.json().get("sandboxID", r.text), r.headers.get("x-aenv-node-id", "")

        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(connect, [0, 1]))
        assert sorted(a[0] for a in answers) in ([200, 201], [201, 201]), answers
        assert {a[1] for a in answers} == {sandbox_id} and len({a[2] for a in answers}) == 1, answers
        assert holders(cluster, sandbox_id) == [answers[0][2]]
        entry = directory_entry(cluster, sandbox_id)
        assert entry is not None and entry.node_id == answers[0][2] and entry.epoch == 2 and entry.state == "running"


def test_two_nodes_taking_over_one_sandbox_at_once_one_wins(cluster: Cluster) -> None:
    """Both nodes asked at once (directly): both fetch it, one claim wins; the loser lets its
    copy go (409, or 404 if it saw the move first) and the sandbox runs once, on the winner."""
    with lost_durable_sandbox(cluster, "node-race2") as sandbox_id:

        def connect(node: Server) -> int:
            with node.client() as direct:
                return direct.post(f"/sandboxes/{sandbox_id}/connect", json={"timeout": 120}).status_code

        with ThreadPoolExecutor(2) as pool:
            codes = dict(zip(cluster.nodes, pool.map(connect, cluster.nodes.values()), strict=True))
        assert sorted(codes.values()) in ([201, 404], [201, 409]), codes
        winner = next(name for name, code in codes.items() if code == 201)
        assert holders(cluster, sandbox_id) == [winner]
        entry = directory_entry(cluster, sandbox_id)
        assert entry is not None and entry.node_id == winner and entry.epoch == 2
        with cluster.api(1) as api:
            r = api.post(f"/sandboxes/{sandbox_id}/connect", json={"timeout": 120})
            assert r.status_code == 200 and r.headers["x-aenv-node-id"] == winner, r.text


def test_a_durable_pause_whose_node_is_full_resumes_on_another(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its node is up but full (a resume takes room as a create does: the node answers 429): a
    connect through a gateway resumes it on another node, from the repository, with its memory
    and files, and so does a port's traffic to one with auto-resume; the full node lets its
    paused copies go, and each sandbox runs once, elsewhere."""
    full = start_node(cluster.etcd.url, "node-full", lease_ttl=LEASE_TTL, extra_env={"AENV_MAX_SANDBOXES": "1"})
    made: list[str] = []
    try:
        for gateway in cluster.gateways:
            wait_for_nodes(gateway, {*cluster.nodes, "node-full"})
        use_gateway(cluster, 0, monkeypatch)
        with full.client() as direct:
            r = direct.post("/sandboxes", json={"templateID": "base", "timeout": 600})
            assert r.status_code == 201, r.text
            sandbox_id = r.json()["sandboxID"]
            made.append(sandbox_id)
            sbx = Sandbox.connect(sandbox_id)
            sbx.commands.run(COUNTER, background=True)
            sbx.files.write("/home/user/state.txt", "written on node-full")
            time.sleep(1.0)
            before = count(sbx)
            assert direct.post(f"/sandboxes/{sandbox_id}/pause").status_code == 204

            lifecycle = {"onTimeout": "pause", "autoResume": True}
            r = direct.post("/sandboxes", json={"templateID": "base", "timeout": 600, "lifecycle": lifecycle})
            assert r.status_code == 201, r.text
            woken_id = r.json()["sandboxID"]
            made.append(woken_id)
            woken = Sandbox.connect(woken_id)
            woken.files.write("/home/user/hello.txt", "hello from the port")
            woken.commands.run("cd /home/user && python3 -m http.server 8000", background=True)
            routed = {"E2b-Sandbox-Id": woken_id, "E2b-Sandbox-Port": "8000"}
            wait_for(lambda: httpx.get(f"{cluster.gateway.url}/hello.txt", headers=routed).status_code == 200, 20)
            assert direct.post(f"/sandboxes/{woken_id}/pause").status_code == 204
            for sid in (sandbox_id, woken_id):
                wait_for(lambda sid=sid: (e := directory_entry(cluster, sid)) is not None and e.durable)

            r = direct.post("/sandboxes", json={"templateID": "base", "timeout": 600})  # its one room
            assert r.status_code == 201, r.text
            made.append(r.json()["sandboxID"])
            r = direct.post(f"/sandboxes/{sandbox_id}/connect", json={"timeout": 60})
            assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1, r.text
        wait_for(lambda: (e := directory_entry(cluster, sandbox_id)) is not None and e.durable)  # still offered
        with cluster.api(1) as api:
            r = api.post(f"/sandboxes/{sandbox_id}/connect", json={"timeout": 120})
            assert r.status_code == 201, r.text
            moved_to = r.headers["x-aenv-node-id"]
            assert moved_to in cluster.nodes, moved_to
        resumed = Sandbox.connect(sandbox_id)
        assert count(resumed) >= before  # its memory: the same process goes on
        assert resumed.files.read("/home/user/state.txt") == "written on node-full"
        entry = directory_entry(cluster, sandbox_id)
        assert entry is not None and (entry.node_id, entry.epoch, entry.state) == (moved_to, 2, "running")

        # the port's traffic: the gateway sees the node full in its mirror and wakes it elsewhere
        with cluster.api(1) as api:
            wait_for(lambda: api.get("/nodes/node-full").json()["sandboxCount"] >= 1, 10)
        r = httpx.get(f"{cluster.gateways[1].url}/hello.txt", headers=routed, timeout=90)
        assert r.status_code == 200 and r.text == "hello from the port", r.text
        assert r.headers["x-aenv-node-id"] in cluster.nodes
        entry = directory_entry(cluster, woken_id)
        assert entry is not None and entry.node_id in cluster.nodes and entry.state == "running"

        with full.client() as direct:
            for sid in (sandbox_id, woken_id):
                wait_for(lambda sid=sid: direct.get(f"/sandboxes/{sid}").status_code == 404, 30)
        assert holders(cluster, sandbox_id) == [moved_to]
    finally:
        with cluster.api() as api:
            for sid in made:
                api.delete(f"/sandboxes/{sid}")
        full.stop()
