"""Snapshot and fork on a runsc that checkpoints leaving the sandbox running: the source is never
stopped and restored, so what it holds open (connections through the port proxy, its upper) goes
on untouched, and the copies see its files as they were at the checkpoint."""

from __future__ import annotations

import os

import httpx
import pytest
from e2b import Sandbox

from tests.api.test_proxy import wait_for_port
from tests.compat.servers import WEBSOCKET_SERVER
from tests.conftest import Server, modern_runsc

pytestmark = pytest.mark.sandbox


@pytest.fixture(autouse=True)
def _needs_leave_running(api: httpx.Client) -> None:
    if not modern_runsc(api):
        pytest.skip("runsc 20221219 stops the source at a checkpoint and restores it")


def instances(server: Server) -> set[str]:
    return set(os.listdir(server.data_dir / "runtime" / "instances"))


@pytest.mark.parametrize("operation", ["snapshot", "fork"])
def test_the_source_is_never_stopped(sandbox: Sandbox, server: Server, api: httpx.Client, operation: str) -> None:
    """No new instance is started for the source (a fork starts only its children's), and a
    connection to it through the port proxy goes on."""
    from websockets.sync.client import connect as ws_connect

    sandbox.files.write("/home/user/ws.py", WEBSOCKET_SERVER)
    sandbox.commands.run("python3 /home/user/ws.py 8765", background=True)
    routed = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "8765"}
    wait_for_port(f"{server.url}/", routed)
    url = server.url.replace("http", "ws", 1) + "/"
    with ws_connect(url, additional_headers=routed) as ws:
        ws.send("before")
        assert ws.recv() == "before"
        before = instances(server)
        if operation == "snapshot":
            r = api.post(f"/sandboxes/{sandbox.sandbox_id}/snapshots", json={})
        else:
            r = api.post(f"/sandboxes/{sandbox.sandbox_id}/fork", json={"count": 2})
        assert r.status_code == 201, r.text
        started = instances(server) - before
        assert len(started) == (0 if operation == "snapshot" else 2), started
        ws.send("after")
        assert ws.recv() == "after"
    assert sandbox.commands.run("echo alive").stdout == "alive\n"


def test_copies_see_the_files_of_the_checkpoint_and_the_source_goes_on(sandbox: Sandbox, api: httpx.Client) -> None:
    sandbox.files.write("/home/user/state", "one")
    r = api.post(f"/sandboxes/{sandbox.sandbox_id}/snapshots", json={})
    assert r.status_code == 201, r.text
    snap = r.json()["snapshotID"]
    sandbox.files.write("/home/user/state", "two")  # the source writes on into the same upper
    sandbox.files.write("/home/user/later", "x" * 100_000)
    children = api.post(f"/sandboxes/{sandbox.sandbox_id}/fork", json={"count": 2}).json()
    sandbox.files.write("/home/user/state", "three")

    r = api.post("/sandboxes", json={"templateID": snap})
    assert r.status_code == 201, r.text
    from_snap = Sandbox.connect(r.json()["sandboxID"])
    assert from_snap.files.read("/home/user/state") == "one"
    assert not from_snap.files.exists("/home/user/later")
    for child in children:
        kid = Sandbox.connect(child["sandbox"]["sandboxID"])
        assert kid.files.read("/home/user/state") == "two"
        assert kid.files.read("/home/user/later") == "x" * 100_000
        kid.files.write("/home/user/state", "mine")  # its own upper: nobody else sees it
        kid.kill()
    assert sandbox.files.read("/home/user/state") == "three"
    assert from_snap.files.read("/home/user/state") == "one"
    from_snap.kill()
