"""runsc platforms with real runsc: the probes `auto` calibrates with, a node choosing and keeping
its platform, everything a sandbox does on each platform the calibration may choose, and images
written on one platform living on under a node that chose another.

In-process nodes on the `tiny` template (commands run with the agent's bundled Python), as
tests/node/test_failures.py. kvm is not exercised: this host's /dev/kvm boots no guest.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.node.orchestrator import Node
from aenv.node.spec import SandboxSpec
from aenv.runtime import platforms
from aenv.runtime.base import Limits
from aenv.runtime.gvisor import CGROUP_PARENT, CGROUP_ROOT, GVisorDriver, image_mark
from tests.node.test_failures import commit_tiny, run_py

pytestmark = pytest.mark.sandbox
PLATFORMS = ["ptrace", "systrap"]
FILL = """
import errno, os
try:
    # in the home directory, on its disk (runsc mounts a tmpfs at an empty /tmp)
    with open(os.path.expanduser('~/big'), 'wb') as f:
        for _ in range(80):
            f.write(b'x' * (1 << 20))
        f.flush()
        os.fsync(f.fileno())
except OSError as e:
    print(errno.errorcode[e.errno])
else:
    print('fit')
"""


def needs_runsc() -> None:
    if os.geteuid() != 0 or shutil.which("runsc") is None:
        if os.environ.get("CI"):
            pytest.fail("CI must run the runsc tests: need root and runsc")
        pytest.skip("needs root and runsc (the CI machine has them)")


def leftovers(driver: GVisorDriver) -> list[str]:
    """What this process's probes left on the host: bundles, runsc's files, cgroups (other
    processes calibrate alongside on a CI machine)."""
    mine = f"-{os.getpid()}"
    found = [p.name for p in driver.bundles.iterdir() if mine in p.name]
    found += [p.name for p in driver.runsc_root.iterdir() if mine in p.name]
    for controller in ("memory", "cpu", "pids"):
        parent = CGROUP_ROOT / controller / CGROUP_PARENT
        if parent.is_dir():
            found += [f"{controller}/{p.name}" for p in parent.iterdir() if mine in p.name]
    return found


def running(word: str) -> list[int]:
    """Processes whose command line names ``word``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and word.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            pass
    return found


@pytest.mark.parametrize("name", PLATFORMS)
async def test_a_probe_measures_agent_work_and_a_checkpoint_and_leaves_nothing(tmp_path: Path, name: str) -> None:
    needs_runsc()
    driver = GVisorDriver(state_dir=tmp_path / "runtime", calibration=tmp_path / "platform.json")
    trial = await driver.probe(name, Limits())
    assert trial.usable, trial
    assert set(trial.seconds) == {"spawn", "write", "stat", "cpu"}
    assert all(0 < s < platforms.PROBE_TIMEOUT for s in trial.seconds.values())
    assert leftovers(driver) == []


async def test_a_platform_that_cannot_run_fails_its_probe_cleanly(tmp_path: Path) -> None:
    needs_runsc()
    driver = GVisorDriver(state_dir=tmp_path / "runtime", calibration=tmp_path / "platform.json")
    trial = await driver.probe("no-such-platform", Limits())
    assert not trial.usable and trial.error
    assert leftovers(driver) == []


@pytest.mark.parametrize("deadline", [0.05, 0.4, 1.0])
async def test_a_probe_cut_off_at_its_deadline_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, deadline: float
) -> None:
    """A platform that hangs (kvm on a host whose /dev/kvm boots no guest) is cut off at the
    deadline: at any moment of runsc's start, nothing of it stays behind."""
    needs_runsc()
    monkeypatch.setattr(platforms, "PROBE_TIMEOUT", deadline)
    driver = GVisorDriver(state_dir=tmp_path / "runtime", calibration=tmp_path / "platform.json")
    trial = await driver.probe("ptrace", Limits())
    assert not trial.usable and "timed out" in (trial.error or "")
    assert leftovers(driver) == []
    assert running(f"probe-ptrace-{os.getpid()}") == []


async def test_a_node_removes_what_probes_of_dead_nodes_left_running(tmp_path: Path) -> None:
    """A node killed while it calibrated leaves its probe's cgroups (and what runs in them) in the
    tree every node shares: the next node to start kills and removes them; a live node's stay."""
    needs_runsc()
    gone = await asyncio.create_subprocess_exec("true")
    await gone.wait()
    dead, live = f"probe-kvm-{gone.pid}", f"probe-kvm-{os.getpid()}-restored"
    sleeper = await asyncio.create_subprocess_exec("sleep", "600")
    try:
        for name in (dead, live):
            for controller in ("memory", "pids"):
                (CGROUP_ROOT / controller / CGROUP_PARENT / name).mkdir(parents=True)
        (CGROUP_ROOT / "pids" / CGROUP_PARENT / dead / "cgroup.procs").write_text(str(sleeper.pid))
        driver = GVisorDriver(state_dir=tmp_path / "runtime", platform="ptrace")
        await driver.prepare(Limits())
        assert await asyncio.wait_for(sleeper.wait(), 5) == -signal.SIGKILL
        assert not any((CGROUP_ROOT / c / CGROUP_PARENT / dead).exists() for c in ("memory", "pids"))
        assert all((CGROUP_ROOT / c / CGROUP_PARENT / live).exists() for c in ("memory", "pids"))
    finally:
        if sleeper.returncode is None:
            sleeper.kill()
        for controller in ("memory", "pids"):
            for name in (dead, live):
                with contextlib.suppress(OSError):
                    (CGROUP_ROOT / controller / CGROUP_PARENT / name).rmdir()


async def test_an_auto_node_calibrates_once_per_host_and_says_so(tmp_path: Path) -> None:
    needs_runsc()
    cache = tmp_path / "platform.json"
    first = Node(Settings(data_dir=tmp_path / "a", build_base=False, runsc_calibration=cache))
    await first.start()
    try:
        info = first.runtime_info()
        report = first.runtime_calibration()
        assert report is not None and info["platformBy"] == "calibration" == report["by"]
        usable = {p: t for p, t in report["trials"].items() if "totalSeconds" in t}
        assert info["platform"] == min(usable, key=lambda p: usable[p]["totalSeconds"])
        assert {"ptrace", "systrap"} <= set(report["trials"])
    finally:
        await first.stop(pause_running=False)
    again = Node(Settings(data_dir=tmp_path / "b", build_base=False, runsc_calibration=cache))
    await again.start()
    try:
        assert again.runtime_info()["platformBy"] == "kept calibration"
        assert again.runtime_info()["platform"] == info["platform"]
    finally:
        await again.stop(pause_running=False)
    named = Node(Settings(data_dir=tmp_path / "c", build_base=False, runsc_platform="ptrace", runsc_calibration=cache))
    await named.start()
    try:
        assert (named.runtime_info()["platform"], named.runtime_info()["platformBy"]) == ("ptrace", "setting")
    finally:
        await named.stop(pause_running=False)


@pytest.fixture(params=PLATFORMS)
async def node_on(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Node]:
    needs_runsc()
    node = Node(Settings(data_dir=tmp_path / "node", build_base=False, runsc_platform=request.param, max_fork=4))
    await node.start()
    await commit_tiny(node)
    yield node
    await node.stop(pause_running=False)


async def read(node: Node, sandbox_id: str, path: str) -> str:
    return (await run_py(node, sandbox_id, f"print(open({path!r}).read(), end='')")).strip()


async def test_everything_a_sandbox_does_works_on_each_platform(node_on: Node) -> None:
    node = node_on
    rec = await node.create("tiny", SandboxSpec(timeout=600, limits={"disk_mb": 64}))
    await run_py(node, rec.id, "open('/tmp/state', 'w').write('one')")
    assert await read(node, rec.id, "/tmp/state") == "one"
    # its disk quota holds: 80 MiB do not fit in 64
    assert (await run_py(node, rec.id, FILL)).strip() in ("ENOSPC", "EDQUOT")
    await run_py(node, rec.id, "import os; os.remove(os.path.expanduser('~/big'))")

    await node.pause(rec.id)
    await node.resume(rec.id)
    assert await read(node, rec.id, "/tmp/state") == "one"

    snap = await node.snapshot(rec.id)
    await run_py(node, rec.id, "open('/tmp/state', 'w').write('two')")
    from_snap = await node.create(snap.id, SandboxSpec(timeout=600))
    assert await read(node, from_snap.id, "/tmp/state") == "one"

    children = await node.fork(rec.id, count=2)
    assert all(c.sandbox is not None for c in children), [c.error for c in children]
    for child in children:
        assert child.sandbox is not None
        assert await read(node, child.sandbox.id, "/tmp/state") == "two"
    assert await read(node, rec.id, "/tmp/state") == "two"
    image_dir = node.files.image(snap.image)
    assert image_mark(image_dir) == node.driver.image_mark  # written on the node's platform


async def test_images_of_another_platform_restore_on_theirs(tmp_path: Path) -> None:
    """A node that chose systrap resumes what a ptrace node paused, creates from its template and
    snapshot, and forks it: each on ptrace, the platform that wrote its image (a ptrace image
    restored under systrap hangs). A platform switch never strands a paused sandbox."""
    needs_runsc()
    data = tmp_path / "node"
    before = Node(Settings(data_dir=data, build_base=False, runsc_platform="ptrace"))
    await before.start()
    try:
        await commit_tiny(before)
        rec = await before.create("tiny", SandboxSpec(timeout=600))
        await run_py(before, rec.id, "open('/tmp/state', 'w').write('kept')")
        await before.pause(rec.id)
    finally:
        await before.stop(pause_running=False)

    after = Node(Settings(data_dir=data, build_base=False, runsc_platform="systrap"))
    await after.start()
    try:
        driver = after.driver
        assert isinstance(driver, GVisorDriver) and driver.platform == "systrap"
        tiny = after.find_template("tiny")
        tiny_image = after.files.image(tiny.image)
        assert driver.image_compatible(tiny_image) and not driver.image_preferred(tiny_image)

        await after.resume(rec.id)
        assert await read(after, rec.id, "/tmp/state") == "kept"
        sb = after.get(rec.id)
        assert sb.instance is not None and driver._platform_of[sb.instance.id] == "ptrace"

        fresh = await after.create("tiny", SandboxSpec(timeout=600))
        assert await read(after, fresh.id, "/etc/group") != ""

        children = await after.fork(rec.id, count=2)
        for child in children:
            assert child.sandbox is not None, child.error
            assert await read(after, child.sandbox.id, "/tmp/state") == "kept"
        paused = await after.pause(rec.id)
        assert image_mark(after.files.image(paused.image)) == driver.mark_of("ptrace")
        await after.resume(rec.id)
        assert await read(after, rec.id, "/tmp/state") == "kept"
    finally:
        await after.stop(pause_running=False)
