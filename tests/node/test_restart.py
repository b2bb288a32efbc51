"""A node restart keeps paused sandboxes and snapshots and reconciles running ones (no leaks)."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
from e2b import Sandbox

from tests.conftest import Server

pytestmark = pytest.mark.sandbox


def runsc_containers(server: Server) -> set[str]:
    root = server.data_dir / "runtime" / "runsc"
    runsc = server.env.get("AENV_RUNSC", "runsc")  # the node's own runsc
    out = subprocess.run([runsc, "--root", str(root), "list", "-quiet"], capture_output=True, text=True).stdout
    return {line.strip() for line in out.splitlines() if line.strip()}


def test_crash_keeps_paused_and_reconciles_running(e2b_env: Server) -> None:
    paused = Sandbox.create(timeout=600)
    paused.files.write("/home/user/survives.txt", "yes")
    paused.commands.run("nohup sleep 3600 >/dev/null 2>&1 &")
    assert paused.pause()
    running = Sandbox.create(timeout=600)
    with e2b_env.client() as api:
        snap = api.post(f"/sandboxes/{running.sandbox_id}/snapshots", json={}).json()["snapshotID"]

    e2b_env.restart(signal.SIGKILL)  # a crash: nothing is paused on the way down

    with e2b_env.client() as api:
        assert api.get(f"/sandboxes/{running.sandbox_id}").status_code == 404  # reconciled, not leaked
        assert api.get(f"/sandboxes/{paused.sandbox_id}").json()["state"] == "paused"
        assert any(s["snapshotID"] == snap for s in api.get("/snapshots").json())
    assert runsc_containers(e2b_env) == set()  # the crashed instances were cleaned up
    back = Sandbox.connect(paused.sandbox_id)
    assert back.files.read("/home/user/survives.txt") == "yes"
    assert back.commands.run("pgrep -x sleep").stdout.strip()
    from_snap = Sandbox.create(template=snap)
    assert from_snap.commands.run("echo restored").stdout == "restored\n"
    for sbx in (back, from_snap):
        sbx.kill()


def test_graceful_stop_pauses_running_sandboxes(e2b_env: Server) -> None:
    sbx = Sandbox.create(timeout=600)
    sbx.commands.run("echo 41 > /home/user/n; nohup sleep 3600 >/dev/null 2>&1 &")
    e2b_env.restart(signal.SIGTERM)
    with e2b_env.client() as api:
        assert api.get(f"/sandboxes/{sbx.sandbox_id}").json()["state"] == "paused"
    back = Sandbox.connect(sbx.sandbox_id)
    assert back.commands.run("cat /home/user/n").stdout == "41\n"
    assert back.commands.run("pgrep -x sleep").stdout.strip()
    back.kill()
    time.sleep(0.1)
