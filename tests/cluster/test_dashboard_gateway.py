"""The dashboard and `aenv top` through a gateway: one row per node, the cluster's counters added up."""

from __future__ import annotations

import httpx
from typer.testing import CliRunner

from aenv.cli.main import app
from tests.cluster.cluster import running_cluster
from tests.conftest import API_KEY, Server


def test_dashboard_and_top_through_a_gateway(server: Server) -> None:
    with running_cluster(("node-a", "node-b"), gateways=1) as cluster, cluster.api() as api:
        url = cluster.gateway.url
        page = httpx.get(f"{url}/dashboard")
        assert page.status_code == 200 and "aenv dashboard" in page.text
        assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
        assert httpx.get(f"{url}/dashboard/api/nodes").status_code == 401
        nodes = api.get("/dashboard/api/nodes").json()
        assert [(n["nodeID"], n["status"]) for n in nodes] == [("node-a", "ready"), ("node-b", "ready")]
        assert all(n["cacheBudgetBytes"] > 0 and "address" in n for n in nodes)
        created = api.post("/sandboxes", json={"templateID": "base", "timeout": 120})
        assert created.status_code == 201, created.text
        sandbox_id = created.json()["sandboxID"]
        try:
            stats = api.get("/dashboard/api/stats").json()
            assert stats["nodes"] == 2 and stats["operations"]["create"]["ok"] >= 1
            assert api.get(f"/sandboxes/{sandbox_id}/logs").json()["commands"] == []
            assert api.get(f"/sandboxes/{sandbox_id}/family").json()["members"][0]["sandboxID"] == sandbox_id
            artifacts = api.get("/dashboard/api/artifacts").json()
            base = next(a for a in artifacts if a["name"] == "base")
            assert set(base["cachedOn"]) <= {"node-a", "node-b"} and base["committed"]
            result = CliRunner().invoke(app, ["--url", url, "--api-key", API_KEY, "top", "--once", "--interval", "0.3"])
            assert result.exit_code == 0, result.stdout
            assert "node-a" in result.stdout and "node-b" in result.stdout and "2 node(s)" in result.stdout
        finally:
            api.delete(f"/sandboxes/{sandbox_id}")
        # a node that stops is shown from the directory while its entry lives: unhealthy
        cluster.nodes["node-b"].stop()
        rows = {n["nodeID"]: n["status"] for n in api.get("/dashboard/api/nodes").json()}
        assert rows.get("node-b", "unhealthy") == "unhealthy" and rows["node-a"] == "ready"
