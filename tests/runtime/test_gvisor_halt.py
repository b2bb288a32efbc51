"""A runsc instance's halt: its processes dead and its root filesystem unmounted at once, runsc's
own teardown (`runsc delete`, slow where PID 1 reaps orphans late) left to the kill that follows;
and no process but the instance's is ever signalled, whatever runsc's state file names.

Real runsc sandboxes on an in-process node with a tiny template (as tests/node/test_failures.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from aenv.config import Settings
from aenv.errors import SandboxNotFound
from aenv.node.orchestrator import Node
from aenv.runtime.gvisor import GVisorDriver
from tests.node.test_failures import commit_tiny

pytestmark = pytest.mark.sandbox
SLEEPER = "python3 -c 'import time; time.sleep(60)'"  # extra arguments change nothing


@pytest.fixture(scope="module")
async def tiny(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Node]:
    if os.geteuid() != 0:
        pytest.skip("needs root and runsc")
    data = Path(tmp_path_factory.mktemp("halt-node"))
    node = Node(Settings(data_dir=data, build_base=False))
    await node.start()
    await commit_tiny(node)
    yield node
    await node.stop(pause_running=False)


def state(pid: int) -> str:
    """A process's state letter, "" once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


async def test_a_halt_leaves_nothing_running_or_mounted_and_the_kill_after_the_rest(tiny: Node) -> None:
    driver = tiny.driver
    assert isinstance(driver, GVisorDriver)
    rec = await tiny.create("tiny")
    sb = tiny.get(rec.id)
    instance = sb.instance
    assert instance is not None
    pids = driver._processes_of(instance.id)
    assert len(pids) == 2 and all(state(p) not in ("", "Z") for p in pids), pids  # the sandbox and its gofer
    rootfs = driver.bundles / instance.id / "rootfs"
    assert os.path.ismount(rootfs)
    sb.instance = None  # the node's watcher sees it die: it must not tear it down itself meanwhile
    await asyncio.wait_for(driver.halt(instance), 10)
    assert [state(p) in ("", "Z", "X") for p in pids] == [True, True], [state(p) for p in pids]
    assert not os.path.ismount(rootfs)
    assert any(driver.runsc_root.glob(f"{instance.id}_*.state"))  # runsc's teardown is the kill's
    await asyncio.wait_for(driver.kill(instance), 60)
    assert not any(driver.runsc_root.glob(f"{instance.id}_*")) and not (driver.bundles / instance.id).exists()
    with contextlib.suppress(SandboxNotFound):  # the node saw it stop on its own and removed it
        await tiny.kill(rec.id)


@pytest.fixture
def bystanders() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a forged or stale state file might name: plain, and dressed as runsc."""
    procs = [
        subprocess.Popen(["sleep", "60"]),
        subprocess.Popen(["bash", "-c", f"exec -a runsc-sandbox {SLEEPER} another-instance"]),
        subprocess.Popen(["bash", "-c", f"exec -a sleepy {SLEEPER} haltvictim01"]),
    ]
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def recorded_teardowns(driver: GVisorDriver, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The instances the halt hands over to runsc's own teardown, recorded instead of run (runsc
    would act on the forged state file)."""
    handed: list[str] = []

    async def teardown(instance_id: str) -> None:
        handed.append(instance_id)

    monkeypatch.setattr(driver, "_teardown", teardown)
    return handed


async def halt_naming(driver: GVisorDriver, instance_id: str, sandbox_pid: int, gofer_pid: int) -> None:
    """Halt an instance ``instance_id`` whose runsc state file names these processes."""
    path = driver.runsc_root / f"{instance_id}_sandbox:{instance_id}.state"
    body: dict[str, Any] = {"sandbox": {"pid": sandbox_pid}, "goferPid": gofer_pid}
    path.write_text(json.dumps(body))
    fake = SimpleNamespace(id=instance_id, writer=SimpleNamespace(close=lambda: None))
    try:
        await asyncio.wait_for(driver.halt(fake), 30)  # type: ignore[arg-type]
    finally:
        path.unlink()


async def test_a_halt_signals_no_process_that_is_not_the_instances(
    tiny: Node, bystanders: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A state file naming other processes (a pid runsc named once and the host reused since, or
    one runsc of another instance): the halt signals none of them, and hands over to runsc's own
    teardown (recorded here, not run: runsc would act on the forged state file)."""
    driver = tiny.driver
    assert isinstance(driver, GVisorDriver)
    handed = recorded_teardowns(driver, monkeypatch)
    await asyncio.sleep(0.2)  # the dressed ones have exec'd
    instance_id = "haltvictim01"
    for named in ((bystanders[0].pid, bystanders[1].pid), (bystanders[2].pid, 1)):
        await halt_naming(driver, instance_id, *named)
        assert [p.poll() for p in bystanders] == [None, None, None]
        assert all(state(p.pid) not in ("", "Z") for p in bystanders)
    assert handed == [instance_id, instance_id]


@pytest.fixture
def exited() -> Iterator[tuple[list[subprocess.Popen[bytes]], subprocess.Popen[bytes]]]:
    """Two children that exited and are not waited for (zombies of this process), and a live one."""
    dead = [subprocess.Popen(["true"]) for _ in range(2)]
    live = subprocess.Popen(["sleep", "60"])
    yield dead, live
    live.kill()
    for p in [*dead, live]:
        p.wait()


async def test_a_halt_after_the_instance_exited_on_its_own_is_not_runscs_slow_way(
    tiny: Node,
    exited: tuple[list[subprocess.Popen[bytes]], subprocess.Popen[bytes]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A checkpoint ends the sandbox: by the halt, its processes may be zombies that PID 1 has not
    reaped yet (no command line to check). They are dead, so the halt goes on without runsc's
    teardown (which waits for the reaping: 1-2 s on a host whose init reaps late). A live process
    named instead still hands over, as in the test above."""
    driver = tiny.driver
    assert isinstance(driver, GVisorDriver)
    handed = recorded_teardowns(driver, monkeypatch)
    dead, live = exited
    for _ in range(100):
        if all(state(p.pid) == "Z" for p in dead):
            break
        await asyncio.sleep(0.05)
    assert [state(p.pid) for p in dead] == ["Z", "Z"]
    instance_id = "haltzombie01"
    for named, hands_over in (((dead[0].pid, dead[1].pid), False), ((dead[0].pid, live.pid), True)):
        await halt_naming(driver, instance_id, *named)
        assert handed == ([instance_id] if hands_over else []), named
    assert live.poll() is None
