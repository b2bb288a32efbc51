"""The fake runtime (aenv/runtime/fake.py): chosen only explicitly, never pretending isolation, and
simulating checkpoints as its docstring says (files kept, processes not). No runsc, no root needed
(user namespaces are); it runs in both tiers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from aenv.config import Settings
from aenv.sdk import Client
from tests.conftest import Server, free_port, start_server

pytestmark = pytest.mark.fast  # the fast tier (./scripts/test --fast)

FAKE = {"AENV_DRIVER": "fake", "AENV_REPO": "none"}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("fake") / "data", extra_env=FAKE)
    yield srv
    srv.stop()


@pytest.fixture()
def api(node: Server) -> Iterator[httpx.Client]:
    with node.client() as client:
        yield client
        for item in client.get("/v2/sandboxes").json():
            client.delete(f"/sandboxes/{item['sandboxID']}")


@pytest.fixture(scope="module")
def sdk(node: Server) -> Iterator[Client]:
    with Client(node.url, api_key=node.env["AENV_API_KEY"]) as client:
        yield client


def run(sdk: Client, sandbox_id: str, cmd: str, *, check: bool = True, user: str | None = None) -> str:
    result = sdk.connect(sandbox_id).exec(cmd, user=user, timeout=30)  # `user`: without root, the one id there is
    assert result.exit_code == 0 or not check, (result.stdout, result.stderr)
    return str(result.stdout)


def create(api: httpx.Client) -> str:
    r = api.post("/sandboxes", json={"templateID": "base", "timeout": 120})
    assert r.status_code == 201, r.text
    return str(r.json()["sandboxID"])


def test_it_is_never_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AENV_DRIVER", raising=False)
    assert Settings().driver == "gvisor"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.1"])
def test_it_serves_on_loopback_only(tmp_path: Path, host: str) -> None:
    """Seen failing before the check: a fake node listened on 0.0.0.0 like any other."""
    env = {**os.environ, **FAKE, "AENV_HOST": host}
    argv = [sys.executable, "-m", "aenv.cli.main", "server", "--data-dir", str(tmp_path), "--port", str(free_port())]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "loopback" in done.stdout + done.stderr and "isolates nothing" in done.stdout + done.stderr


def test_health_and_the_log_say_it_is_fake(node: Server, api: httpx.Client) -> None:
    runtime = api.get("/health").json()["runtime"]
    assert runtime["driver"] == "fake" and runtime["isolation"] == "none"
    assert "NOT isolated" in node.log.read_text()


def test_files_survive_a_pause_and_processes_do_not(api: httpx.Client, sdk: Client) -> None:
    """What the docstring says is simulated: the files come back, the processes do not."""
    sid = create(api)
    run(sdk, sid, "echo kept > /home/user/state; nohup sleep 300 >/dev/null 2>&1 &")
    assert "sleep 300" in run(sdk, sid, "ps -eo args")
    assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
    assert api.post(f"/sandboxes/{sid}/resume", json={}).status_code == 201
    assert run(sdk, sid, "cat /home/user/state") == "kept\n"
    assert "sleep 300" not in run(sdk, sid, "ps -eo args")


def test_fork_children_get_the_files_and_their_own_namespaces(api: httpx.Client, sdk: Client) -> None:
    sid = create(api)
    run(sdk, sid, "echo parent > /tmp/who; nohup python3 -m http.server 8000 >/dev/null 2>&1 &")
    r = api.post(f"/sandboxes/{sid}/fork", json={"count": 2})
    assert r.status_code == 201, r.text
    children = [c["sandbox"]["sandboxID"] for c in r.json()]
    for i, child in enumerate(children):
        assert run(sdk, child, "cat /tmp/who") == "parent\n"
        run(sdk, child, f"echo child{i} > /tmp/who")
        # The port is free in each child: a network namespace of its own, no copied process.
        run(sdk, child, "nohup python3 -m http.server 8000 >/dev/null 2>&1 & sleep 0.5; kill -0 $!")
    assert run(sdk, sid, "cat /tmp/who") == "parent\n"
    assert [run(sdk, c, "cat /tmp/who") for c in children] == ["child0\n", "child1\n"]


def test_a_sandbox_cannot_signal_host_processes(api: httpx.Client, sdk: Client) -> None:
    """A PID namespace of its own: kill -9 -1 ends its own processes only (as root: all of them), and
    it sees no host process."""
    sentinel = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        sid = create(api)
        listed = run(sdk, sid, "ps -eo pid,args")
        assert str(sentinel.pid) not in listed.split() and "sleep 300" not in listed
        run(sdk, sid, "kill -9 -1; true", check=False)
        time.sleep(0.5)
        assert sentinel.poll() is None
    finally:
        sentinel.send_signal(signal.SIGKILL)
        sentinel.wait()


def test_images_of_another_runtime_are_refused(node: Server, api: httpx.Client) -> None:
    """An image gVisor wrote is never restored as if it were the fake runtime's (and the gVisor
    driver refuses the fake one's by the same mark)."""
    marks = list((node.data_dir / "fs" / "images").glob("*/aenv-runtime"))
    assert marks
    saved = {m: m.read_text() for m in marks}
    try:
        for mark in marks:
            mark.write_text("runsc 0.0~20240729.0 ptrace")
        r = api.post("/sandboxes", json={"templateID": "base"})
        assert r.status_code == 422 and r.json()["code"] in (422, "image_incompatible"), r.text
        assert "fake runtime" in r.json()["message"]
    finally:
        for mark, text in saved.items():
            mark.write_text(text)
    create(api)


ESCAPE = """
import os, sys
os.makedirs("/tmp/jail", exist_ok=True)
os.chroot("/tmp/jail")  # the classic way out of a chroot: chroot below, then climb past the old root
for _ in range(64):
    os.chdir("..")
os.chroot(".")
print(os.path.exists(sys.argv[1]))
"""


@pytest.mark.root  # root in the sandbox
def test_root_in_a_sandbox_can_neither_mount_nor_climb_out_of_its_root(
    api: httpx.Client, sdk: Client, tmp_path: Path
) -> None:
    """Not isolation, but no accident either: the instance's root is pivoted to and the host's is
    detached (seen failing with a chroot: the climb found the host's files), and it has runsc's
    capabilities only, no CAP_SYS_ADMIN (seen failing before: it mounted a tmpfs), so the host's
    directories bound read-only stay so."""
    marker = tmp_path / "host-only"
    marker.write_text("x")
    sid = create(api)
    sdk.connect(sid).write("/tmp/escape.py", ESCAPE)
    assert run(sdk, sid, f"python3 /tmp/escape.py {marker}", user="root") == "False\n"
    mounted = run(
        sdk, sid, "mkdir -p /m; mount -t tmpfs none /m 2>&1; grep ' /m ' /proc/mounts", user="root", check=False
    )
    assert "tmpfs" not in mounted, mounted
    out = run(sdk, sid, "mount -o remount,rw /usr 2>&1; touch /usr/aenv-probe 2>&1; echo done", user="root")
    assert not Path("/usr/aenv-probe").exists(), out
