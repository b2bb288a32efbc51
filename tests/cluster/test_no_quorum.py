"""Without etcd quorum a cluster node refuses pauses and resumes (API, connect, traffic waking an
auto-resume sandbox) at once with 503 `cluster_unavailable`, and loses nothing: the sandbox keeps
running (or stays paused) and the same requests work once quorum is back. Real 3-member etcd."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.cluster.cluster import Cluster, running_cluster, wait_cut_off
from tests.conftest import API_KEY, Server

pytestmark = pytest.mark.sandbox


@pytest.fixture(scope="module")
def cluster(server: Server) -> Iterator[Cluster]:
    with running_cluster(("node-a",), gateways=1) as c:
        yield c


def poke(api: httpx.Client, sandbox_id: str) -> httpx.Response:
    """Sandbox traffic (envd's route) through the gateway, as the SDKs send it."""
    return api.post(
        "/process.Process/Start", headers={"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "49983"}, json={}
    )


def shell(cluster: Cluster, sandbox_id: str, command: str) -> str:
    """A command through the gateway with the E2B SDK (its connect of a running sandbox included)."""
    from e2b import Sandbox

    url = cluster.gateway.url
    sbx = Sandbox.connect(sandbox_id, api_url=url, sandbox_url=url, api_key=API_KEY)
    return sbx.commands.run(command).stdout


def refused(r: httpx.Response, sandbox_id: str) -> bool:
    body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    return (
        r.status_code == 503
        and body.get("error_code") == "cluster_unavailable"
        and "node-a" in body.get("message", "")
        and sandbox_id in body.get("message", "")
    )


def until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.3)


def test_without_quorum_pause_and_resume_fail_fast_and_lose_nothing(cluster: Cluster) -> None:
    with cluster.api() as api:
        live = api.post("/sandboxes", json={"templateID": "base", "timeout": 300}).json()["sandboxID"]
        asleep = api.post(
            "/sandboxes",
            json={"templateID": "base", "timeout": 300, "lifecycle": {"onTimeout": "pause", "autoResume": True}},
        ).json()["sandboxID"]
        try:
            shell(cluster, live, "echo before > /tmp/mark")
            assert api.post(f"/sandboxes/{asleep}/pause").status_code == 204
            down = cluster.etcd.members[:2]
            for member in down:
                member.stop(signal.SIGKILL)
            try:
                # the node notices within a few heartbeats (its creates are refused for it from then on)
                wait_cut_off(cluster.nodes["node-a"])
                started = time.monotonic()
                r = api.post(f"/sandboxes/{live}/pause")
                assert refused(r, live) and time.monotonic() - started < 2.0, (r.status_code, r.text)
                assert "keeps running" in r.json()["message"]
                for path in (
                    f"/sandboxes/{asleep}/resume",
                    f"/sandboxes/{asleep}/connect",
                    f"/v2/sandboxes/{asleep}/connect",
                ):
                    r = api.post(path, json={"timeout": 60})
                    assert refused(r, asleep), (path, r.status_code, r.text)
                assert refused(poke(api, asleep), asleep)  # traffic would wake it (auto-resume)
                # nothing was lost: the running one runs and answers, the paused one is still paused
                assert api.get(f"/sandboxes/{live}").json()["state"] == "running"
                assert api.get(f"/sandboxes/{asleep}").json()["state"] == "paused"
                assert shell(cluster, live, "cat /tmp/mark") == "before\n"  # the SDK's connect: allowed
            finally:
                for member in down:
                    member.start()
                cluster.etcd.wait_healthy(cluster.etcd.members)
            until(lambda: api.post(f"/sandboxes/{live}/pause").status_code == 204, 30, "pause after quorum returned")
            assert api.post(f"/sandboxes/{live}/connect", json={"timeout": 60}).status_code in (200, 201)
            assert shell(cluster, live, "cat /tmp/mark") == "before\n"
            assert shell(cluster, asleep, "echo awake") == "awake\n"
        finally:
            for sid in (live, asleep):
                api.delete(f"/sandboxes/{sid}")
