"""`aenv gateway`: two real nodes behind one gateway, driven by the real E2B SDK."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.cluster.conftest import require_etcd
from tests.cluster.etcd import EtcdCluster
from tests.cluster.nodes import start_node
from tests.conftest import API_KEY, DATA_DIR, Server, free_port

pytestmark = pytest.mark.sandbox
LEASE_TTL = 3


@dataclass
class Gateway:
    url: str
    proc: subprocess.Popen[bytes]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_gateway(etcd_url: str) -> Gateway:
    port = free_port()
    log = DATA_DIR.parent / f"{DATA_DIR.name}-gateway-{port}.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "aenv.cli.main", "gateway", "--cluster", etcd_url, "--port", str(port)],
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "AENV_API_KEY": API_KEY},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return Gateway(url, proc)
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"gateway did not become ready:\n{log.read_text()[-3000:]}")


@dataclass
class Cluster:
    etcd: EtcdCluster
    nodes: dict[str, Server]
    gateway: Gateway

    def api(self) -> httpx.Client:
        return httpx.Client(base_url=self.gateway.url, headers={"X-API-Key": API_KEY}, timeout=120)


@pytest.fixture(scope="module")
def cluster(server: Server) -> Iterator[Cluster]:
    require_etcd()
    etcd = EtcdCluster(3)
    nodes: dict[str, Server] = {}
    gateway = None
    try:
        etcd.start()
        for name in ("node-a", "node-b"):
            nodes[name] = start_node(etcd.url, name, lease_ttl=LEASE_TTL)
        gateway = start_gateway(etcd.url)
        wait_for_nodes(gateway, set(nodes))
        yield Cluster(etcd, nodes, gateway)
    finally:
        if gateway is not None:
            gateway.stop()
        for node in nodes.values():
            node.stop()
        etcd.stop()


def wait_for_nodes(gateway: Gateway, names: set[str], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while True:
        listed = httpx.get(f"{gateway.url}/nodes", headers={"X-API-Key": API_KEY}).json()
        if {n["node_id"] for n in listed} == names:
            return
        assert time.monotonic() < deadline, f"the gateway lists {listed}, not {names}"
        time.sleep(0.2)


@pytest.fixture()
def e2b_gateway(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> Cluster:
    monkeypatch.setenv("E2B_API_KEY", API_KEY)
    monkeypatch.setenv("E2B_API_URL", cluster.gateway.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", cluster.gateway.url)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    return cluster


def test_the_e2b_sdk_works_through_the_gateway(e2b_gateway: Cluster) -> None:
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=120)
    try:
        result = sbx.commands.run("echo hello from $(hostname) && echo oops >&2")
        assert result.exit_code == 0 and result.stdout.startswith("hello from") and result.stderr == "oops\n"
        sbx.files.write("/home/user/data.bin", b"\x00\x01payload" * 10000)
        assert sbx.files.read("/home/user/data.bin", format="bytes") == b"\x00\x01payload" * 10000
        assert sbx.is_running()
        with e2b_gateway.api() as api:
            r = api.get(f"/sandboxes/{sbx.sandbox_id}")
            assert r.status_code == 200 and r.headers["x-aenv-node-id"] in e2b_gateway.nodes
    finally:
        sbx.kill()
    with e2b_gateway.api() as api:
        r = api.get(f"/sandboxes/{sbx.sandbox_id}")
        assert r.status_code == 404


def test_creates_spread_over_the_nodes(cluster: Cluster) -> None:
    placed: dict[str, str] = {}
    with cluster.api() as api:
        try:
            for _ in range(4):
                r = api.post("/sandboxes", json={"templateID": "base", "timeout": 120})
                assert r.status_code == 201, r.text
                placed[r.json()["sandboxID"]] = r.headers["x-aenv-node-id"]
            assert set(placed.values()) == set(cluster.nodes), placed
            # each is served by the node it was placed on, right after its create
            for sid, node in placed.items():
                r = api.post(
                    "/process.Process/Start",
                    headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983"},
                    json={},
                )
                assert r.headers.get("x-aenv-node-id") == node
        finally:
            for sid in placed:
                api.delete(f"/sandboxes/{sid}")


def test_own_routes_need_the_key_and_list_the_nodes(cluster: Cluster) -> None:
    assert httpx.get(f"{cluster.gateway.url}/nodes").status_code == 401
    assert httpx.get(f"{cluster.gateway.url}/nodes", headers={"X-API-Key": "e2b_wrong"}).status_code == 401
    with cluster.api() as api:
        nodes = api.get("/nodes").json()
        assert {n["node_id"]: n["address"] for n in nodes} == {k: v.url for k, v in cluster.nodes.items()}
        assert api.get("/nodes/node-a").json()["node_id"] == "node-a"
        missing = api.get("/nodes/nope")
        assert missing.status_code == 404 and missing.json()["code"] == 404
        # forwarded requests are the nodes' to authenticate
        assert httpx.get(f"{cluster.gateway.url}/sandboxes/abc").status_code == 401
        unknown = api.get("/sandboxes/doesnotexist123")
        assert unknown.status_code == 404 and unknown.json()["error_code"] == "sandbox_not_found"
        bad = api.post("/sandboxes", content=b"x" * (2 * 1024 * 1024))
        assert bad.status_code == 413
    health = httpx.get(f"{cluster.gateway.url}/health").json()
    assert health["status"] == "ok" and health["nodes"] == 2


def test_a_lost_node_s_sandboxes_answer_404_naming_it(cluster: Cluster) -> None:
    node = start_node(cluster.etcd.url, "node-lost", lease_ttl=LEASE_TTL)
    try:
        with node.client() as direct:
            sid = direct.post("/sandboxes", json={"templateID": "base", "timeout": 300}).json()["sandboxID"]
        with cluster.api() as api:
            deadline = time.monotonic() + 10
            while api.get(f"/sandboxes/{sid}").status_code != 200:
                assert time.monotonic() < deadline, "the gateway never found the sandbox"
                time.sleep(0.2)
            node.stop(signal.SIGKILL)
            deadline = time.monotonic() + LEASE_TTL + 5
            while (r := api.get(f"/sandboxes/{sid}")).status_code != 404:
                assert time.monotonic() < deadline, "the gateway still routes to a dead node"
                time.sleep(0.3)
            assert "node-lost" in r.json()["message"] and r.json()["error_code"] == "sandbox_not_found"
            envd = api.post(
                "/filesystem.Filesystem/Stat",
                headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983"},
                json={"path": "/"},
            )
            assert envd.status_code == 404 and "node-lost" in envd.json()["message"]
            # creates keep working on the others
            r = api.post("/sandboxes", json={"templateID": "base", "timeout": 60})
            assert r.status_code == 201 and r.headers["x-aenv-node-id"] in cluster.nodes
            api.delete(f"/sandboxes/{r.json()['sandboxID']}")
    finally:
        node.restart()  # a crashed node's mounts and instances go at its next start
        node.stop()


def test_a_port_and_id_host_routes_to_the_sandbox_s_node(cluster: Cluster) -> None:
    with cluster.api() as api:
        r = api.post("/sandboxes", json={"templateID": "base", "timeout": 60})
        sid, node = r.json()["sandboxID"], r.headers["x-aenv-node-id"]
        try:
            health = httpx.get(f"{cluster.gateway.url}/health", headers={"Host": f"49983-{sid}.cluster.test"})
            assert health.status_code == 204 and health.headers["x-aenv-node-id"] == node
            unknown = httpx.get(f"{cluster.gateway.url}/health", headers={"Host": "49983-nosuchsandbox1.cluster.test"})
            assert unknown.status_code == 404
            half = httpx.get(f"{cluster.gateway.url}/health", headers={"E2b-Sandbox-Id": sid})
            assert half.status_code == 400
        finally:
            api.delete(f"/sandboxes/{sid}")


def test_lists_merge_every_node_with_the_node_s_filters_and_pages(e2b_gateway: Cluster) -> None:
    from e2b import Sandbox, SandboxQuery, SandboxState

    run = uuid.uuid4().hex[:8]
    boxes = [Sandbox.create(timeout=120, metadata={"suite": run, "n": str(i)}) for i in range(4)]
    try:
        with e2b_gateway.api() as api:
            placed = {api.get(f"/sandboxes/{b.sandbox_id}").headers["x-aenv-node-id"] for b in boxes}
            assert placed == set(e2b_gateway.nodes)  # the list below has to merge both
            assert boxes[0].pause() is True
            pager = Sandbox.list(query=SandboxQuery(metadata={"suite": run}), limit=3)
            found = pager.next_items()
            assert len(found) == 3 and pager.has_next
            found += pager.next_items()
            assert not pager.has_next
            assert sorted(s.sandbox_id for s in found) == sorted(b.sandbox_id for b in boxes)
            started = [s.started_at for s in found]
            assert started == sorted(started, reverse=True)
            running = Sandbox.list(query=SandboxQuery(metadata={"suite": run}, state=[SandboxState.RUNNING]))
            assert {s.sandbox_id for s in running.next_items()} == {b.sandbox_id for b in boxes[1:]}
            legacy = api.get("/sandboxes", params={"metadata": f"suite={run}"})
            assert legacy.status_code == 200
            assert {s["sandboxID"] for s in legacy.json()} == {b.sandbox_id for b in boxes[1:]}
            assert api.get("/v2/sandboxes", params={"limit": "0"}).status_code == 400
            assert api.get("/v2/sandboxes", params={"nextToken": "!!"}).status_code == 400
            bad = api.get("/v2/sandboxes", params={"state": "nonsense"})
            assert bad.status_code == 400 and bad.json()["error_code"] == "invalid_request"
    finally:
        for box in boxes:
            Sandbox.kill(box.sandbox_id)


def test_without_quorum_running_sandboxes_keep_working(e2b_gateway: Cluster) -> None:
    # last in this module: it stops two etcd members (and starts them again)
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=120)
    down = e2b_gateway.etcd.members[:2]
    try:
        for m in down:
            m.stop(signal.SIGKILL)
        assert sbx.commands.run("echo still here").stdout == "still here\n"
        sbx.files.write("/tmp/q", "no quorum")
        assert sbx.files.read("/tmp/q") == "no quorum"
        with e2b_gateway.api() as api:
            assert api.get(f"/sandboxes/{sbx.sandbox_id}").status_code == 200
            # a sandbox the directory never had: its lookup needs etcd, which cannot answer
            start = time.monotonic()
            r = api.get("/sandboxes/neverexisted12345")
            assert r.status_code == 503 and r.json()["error_code"] == "cluster_unavailable"
            assert time.monotonic() - start < 5
    finally:
        for m in down:
            m.start()
        e2b_gateway.etcd.wait_healthy(e2b_gateway.etcd.members)
    assert sbx.commands.run("echo back").stdout == "back\n"
    sbx.kill()
    with e2b_gateway.api() as api:
        deadline = time.monotonic() + 15
        while api.get(f"/sandboxes/{sbx.sandbox_id}").status_code != 404:
            assert time.monotonic() < deadline
            time.sleep(0.3)
