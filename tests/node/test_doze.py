"""Dozing (aenv/node/doze.py): a running sandbox with nothing in it but its agent and nothing on
its channel is frozen on the host (it then takes no CPU at all) and thawed by whatever comes to
it. Nobody may notice: every request and every operation on a dozing sandbox gets what it would
get from an awake one, and a sandbox running anything (a server, a daemon, a timer) never dozes.

One node for the module, dozing after 1 s of quiet, on a busybox template (nothing to
debootstrap), with a warm pool of one for one test.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import AsyncSandbox, Sandbox

from tests.conftest import Server, e2b_client, start_server
from tests.images.oci import busybox_layer, write_layout
from tests.node.test_restart import runsc_containers

pytestmark = pytest.mark.sandbox

DOZE_AFTER = 1.0
DOZES_WITHIN = 15.0  # quiet period + the doze loop's tick + asking the agent, on a busy machine
FREEZER = Path("/sys/fs/cgroup/freezer/aenv")


def dozing_node(data: Path, extra_env: dict[str, str] | None = None) -> Server:
    """A node without a repository, dozing after DOZE_AFTER, on a template `bb` of busybox with
    what the tests run (a timer, a daemon, a listener)."""
    env = {
        "AENV_BUILD_BASE": "false",
        "AENV_REPO": "none",
        "AENV_DOZE_AFTER": str(DOZE_AFTER),
        "AENV_MIN_FREE_MEMORY_MB": "0",
        **(extra_env or {}),
    }
    srv = start_server(data, extra_env=env, wait_for=None)
    try:
        layer = busybox_layer()
        for applet in ("nc", "date", "setsid"):
            layer.symlink(f"bin/{applet}", "busybox")
        write_layout(data / "imports" / "bb", [layer.bytes()], "v1")
        with srv.client() as api:
            r = api.post("/templates/from-image", json={"name": "bb", "image": f"oci:{data / 'imports' / 'bb'}:v1"})
            assert r.status_code == 201, r.text
    except BaseException:
        srv.stop()
        raise
    return srv


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    env = {"AENV_WARM_POOL_MIN_FREE_MB": "0"}
    srv = dozing_node(tmp_path_factory.mktemp("doze") / "data", env)
    yield srv
    srv.stop()
    assert runsc_containers(srv) == set()


@pytest.fixture()
def api(node: Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[httpx.Client]:
    yield from e2b_client(node, monkeypatch, empty_after=True)


def dozing(api: httpx.Client, sandbox_id: str) -> bool:
    r = api.get(f"/sandboxes/{sandbox_id}")
    assert r.status_code == 200, r.text
    return r.json().get("dozing") is True


def wait_dozing(api: httpx.Client, sandbox_id: str) -> None:
    deadline = time.monotonic() + DOZES_WITHIN
    while not dozing(api, sandbox_id):
        assert time.monotonic() < deadline, f"sandbox {sandbox_id} did not doze within {DOZES_WITHIN}s"
        time.sleep(0.3)


def frozen_instances(node: Server) -> set[str]:
    """The node's instances whose host tasks the kernel holds frozen."""
    out = set()
    for instance_id in os.listdir(node.data_dir / "runtime" / "instances"):
        try:
            if (FREEZER / instance_id / "freezer.state").read_text().strip() == "FROZEN":
                out.add(instance_id)
        except OSError:
            pass
    return out


def cpu_ns(instance_id: str) -> int:
    return int(Path(f"/sys/fs/cgroup/cpuacct/aenv/{instance_id}/cpuacct.usage").read_text())


def dozed_sandbox(api: httpx.Client) -> Sandbox:
    sandbox = Sandbox.create(template="bb", timeout=300)
    sandbox.files.write("/home/user/kept.txt", "before the doze")
    sandbox.commands.run("echo 41 > /tmp/counter")
    wait_dozing(api, sandbox.sandbox_id)
    return sandbox


def test_a_quiet_sandbox_dozes_takes_no_cpu_and_a_command_wakes_it(api: httpx.Client, node: Server) -> None:
    before = frozen_instances(node)
    sandbox = dozed_sandbox(api)
    mine = frozen_instances(node) - before
    assert len(mine) == 1, mine  # the host really holds its tasks frozen
    (instance,) = mine
    used = cpu_ns(instance)
    time.sleep(2)
    assert cpu_ns(instance) == used  # not one nanosecond while dozing
    r = sandbox.commands.run("cat /tmp/counter; cat /home/user/kept.txt")
    assert r.exit_code == 0 and r.stdout == "41\nbefore the doze"
    assert instance not in frozen_instances(node) and not dozing(api, sandbox.sandbox_id)
    metrics = api.get("/metrics").text
    assert "aenv_doze_wakes" in metrics and "aenv_sandboxes_dozing" in metrics
    wait_dozing(api, sandbox.sandbox_id)  # and dozes again once quiet again
    assert sandbox.files.read("/home/user/kept.txt") == "before the doze"


@pytest.mark.parametrize(
    "start",
    [
        "sleep 300",  # a background command the client still follows
        "setsid sh -c 'sleep 300' >/dev/null 2>&1 < /dev/null &",  # a daemon nobody follows
        "nc -l -p 8080 >/dev/null 2>&1 &",  # a server waiting for a connection
    ],
    ids=["background", "daemon", "server"],
)
def test_a_sandbox_running_anything_never_dozes(api: httpx.Client, start: str) -> None:
    sandbox = Sandbox.create(template="bb", timeout=300)
    if start == "sleep 300":
        handle = sandbox.commands.run(start, background=True)
        handle.disconnect()  # the process runs on; no stream of ours follows it any more
    else:
        sandbox.commands.run(start)
    time.sleep(DOZE_AFTER * 2 + 1)  # an idle one dozes within ~1.5 s here
    assert not dozing(api, sandbox.sandbox_id)


def test_a_timer_in_the_sandbox_fires_on_time(api: httpx.Client) -> None:
    """A sleeping process has no CPU use to show, but its timer must fire when it is due."""
    sandbox = Sandbox.create(template="bb", timeout=300)
    started = time.time()
    sandbox.commands.run("setsid sh -c 'sleep 3; date +%s > /tmp/fired' >/dev/null 2>&1 < /dev/null &")
    time.sleep(6)
    fired = int(sandbox.files.read("/tmp/fired").strip())
    assert fired - started < 5  # due at +3 s; frozen until this read, it would say +6


def test_an_open_stream_keeps_it_awake(api: httpx.Client) -> None:
    """A streaming watch (the async SDK's) is a stream open on the channel: no doze under it."""

    async def watched() -> tuple[bool, list[str]]:
        sandbox = await AsyncSandbox.create(template="bb", timeout=300)
        seen: list[str] = []
        handle = await sandbox.files.watch_dir("/home/user", on_event=lambda e: seen.append(e.name))
        try:
            await asyncio.sleep(DOZE_AFTER * 4 + 2)
            awake = not dozing(api, sandbox.sandbox_id)
            await sandbox.files.write("/home/user/late.txt", "x")
            for _ in range(50):
                if "late.txt" in seen:
                    break
                await asyncio.sleep(0.1)
        finally:
            await handle.stop()
        return awake, seen

    awake, seen = asyncio.run(watched())
    assert awake and "late.txt" in seen


def test_a_polled_watch_sees_what_changed_across_a_doze(api: httpx.Client) -> None:
    """The sync SDK's watch lives in the agent between polls: the sandbox may doze meanwhile (only
    a process in it could change a file, and none runs), and the next poll has every change."""
    sandbox = Sandbox.create(template="bb", timeout=300)
    watch = sandbox.files.watch_dir("/home/user")
    try:
        wait_dozing(api, sandbox.sandbox_id)
        sandbox.files.write("/home/user/while-dozing.txt", "x")
        names = {e.name for e in watch.get_new_events()}
        assert "while-dozing.txt" in names
    finally:
        watch.stop()


OPERATIONS = ["pause-resume", "snapshot", "fork", "kill", "timeout", "metrics", "port", "files", "list"]


@pytest.mark.parametrize("operation", OPERATIONS)
def test_every_operation_on_a_dozing_sandbox_works(api: httpx.Client, node: Server, operation: str) -> None:
    before = frozen_instances(node)
    sandbox = dozed_sandbox(api)
    sid = sandbox.sandbox_id
    mine = frozen_instances(node) - before
    if operation == "pause-resume":
        assert sandbox.pause()
        again = Sandbox.connect(sid)
        assert again.commands.run("cat /tmp/counter").stdout == "41\n"
    elif operation == "snapshot":
        r = api.post(f"/sandboxes/{sid}/snapshots", json={})
        assert r.status_code == 201, r.text
        r = api.post("/sandboxes", json={"templateID": r.json()["snapshotID"]})
        assert r.status_code == 201, r.text
        copy = Sandbox.connect(r.json()["sandboxID"])
        assert copy.commands.run("cat /tmp/counter").stdout == "41\n"
        assert sandbox.commands.run("cat /tmp/counter").stdout == "41\n"
    elif operation == "fork":
        r = api.post(f"/sandboxes/{sid}/fork", json={"count": 2})
        assert r.status_code == 201, r.text
        for item in r.json():
            child = Sandbox.connect(item["sandbox"]["sandboxID"])
            assert child.files.read("/home/user/kept.txt") == "before the doze"
        assert sandbox.commands.run("cat /tmp/counter").stdout == "41\n"
    elif operation == "kill":
        assert sandbox.kill()
        assert api.get(f"/sandboxes/{sid}").status_code == 404
        deadline = time.monotonic() + 30
        while mine & frozen_instances(node):  # nothing frozen is left behind
            assert time.monotonic() < deadline, mine
            time.sleep(0.2)
    elif operation == "timeout":
        sandbox.set_timeout(120)
        assert sandbox.commands.run("cat /tmp/counter").stdout == "41\n"
    elif operation == "metrics":
        deadline = time.monotonic() + 30
        while not (metrics := sandbox.get_metrics()) or metrics[-1].cpu_used_pct != 0:
            assert time.monotonic() < deadline, metrics  # a sample taken while dozing: nothing used
            time.sleep(1)
        assert metrics[-1].mem_used > 0
        assert dozing(api, sid)  # reading its metrics is the host's business: it dozes on
    elif operation == "port":
        # Nothing listens (a listener would have kept it awake): a clear 502, not a hang.
        started = time.monotonic()
        r = httpx.get(f"{node.url}/", headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8000"}, timeout=20)
        assert r.status_code == 502 and time.monotonic() - started < 10
    elif operation == "files":
        assert sandbox.files.read("/home/user/kept.txt") == "before the doze"
        sandbox.files.write("/home/user/new.txt", "after")
        assert sandbox.commands.run("cat /home/user/new.txt").stdout == "after"
    elif operation == "list":
        listed = {s.sandbox_id for s in Sandbox.list().next_items()}
        assert sid in listed
        assert dozing(api, sid)  # listing is the host's business too


@pytest.mark.parametrize("on_timeout", ["pause", "kill"])
def test_a_dozing_sandbox_times_out_as_an_awake_one(api: httpx.Client, on_timeout: str) -> None:
    r = api.post("/sandboxes", json={"templateID": "bb", "timeout": 300, "autoPause": on_timeout == "pause"})
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    Sandbox.connect(sid).commands.run("echo 41 > /tmp/counter")
    wait_dozing(api, sid)
    r = api.post(f"/sandboxes/{sid}/timeout", json={"timeout": 1})  # E2B's set_timeout
    assert r.status_code == 204, r.text
    deadline = time.monotonic() + 20
    while True:
        r = api.get(f"/sandboxes/{sid}")
        if r.status_code == 404 or r.json().get("state") == "paused":
            break
        assert time.monotonic() < deadline, r.text
        time.sleep(0.3)
    assert r.status_code == (200 if on_timeout == "pause" else 404), r.text
    if on_timeout == "pause":
        assert Sandbox.connect(sid).commands.run("cat /tmp/counter").stdout == "41\n"


def test_warm_pool_members_doze_and_a_claim_wakes_one(api: httpx.Client, node: Server) -> None:
    before = frozen_instances(node)
    assert api.put("/templates/bb/warm-pool", json={"size": 1}).status_code == 200
    try:
        deadline = time.monotonic() + 60
        while not frozen_instances(node) - before:  # the pool's member, which no one has claimed
            assert time.monotonic() < deadline, "the warm pool's member did not doze"
            time.sleep(0.3)
        sandbox = Sandbox.create(template="bb", timeout=300, envs={"FROM": "the claim"})
        assert sandbox.commands.run("echo $FROM").stdout == "the claim\n"
    finally:
        api.put("/templates/bb/warm-pool", json={"size": 0})


def test_a_node_killed_with_dozing_sandboxes_leaves_nothing_frozen(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    srv = dozing_node(tmp_path_factory.mktemp("doze-kill") / "data")
    try:
        with srv.client() as api:
            r = api.post("/sandboxes", json={"templateID": "bb", "timeout": 300})
            assert r.status_code == 201, r.text
            wait_dozing(api, r.json()["sandboxID"])
        srv.stop(signal.SIGKILL)
        assert frozen_instances(srv)  # its instance outlived the node, frozen
        srv.restart()
        assert frozen_instances(srv) == set() and runsc_containers(srv) == set()  # removed, thawed
    finally:
        srv.stop()
