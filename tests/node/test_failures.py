"""Failed checkpoints leave sandboxes running (never frozen) or cleanly gone, on real sandboxes.

The node runs in-process on a tiny template (an almost empty root filesystem; commands run with the
agent's own bundled Python). The only thing faked is the failure itself: a driver subclass makes
`checkpoint` fail on demand, since a real runsc checkpoint cannot be made to fail at will.
"""

from __future__ import annotations

import asyncio
import base64
import os
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from aenv.channel import END
from aenv.config import Settings
from aenv.errors import InsufficientStorage, RuntimeFailure, SandboxNotFound
from aenv.node.orchestrator import Node
from aenv.runtime.base import Instance, Limits, RootfsSpec
from aenv.runtime.gvisor import GVisorDriver
from aenv.templates.builder import commit_template

pytestmark = pytest.mark.sandbox

PY = ["/.aenv/lib/ld-linux-x86-64.so.2", "--library-path", "/.aenv/lib", "/.aenv/bin/python3", "-c"]
COUNTER = (
    "import os,time\n"
    "i=0\n"
    "while True:\n"
    "    i+=1; open('/tmp/.n','w').write(str(i)); os.replace('/tmp/.n','/tmp/n'); time.sleep(0.05)\n"
)


class FaultyDriver(GVisorDriver):
    """The real gVisor driver, whose checkpoint can be told to fail (before or after it stopped
    the instance), and whose next restore can be told to fail."""

    fail_next: str | None = None  # "before" | "after"
    fail_restore = False

    async def restore(self, *, instance_id: str, rootfs: RootfsSpec, limits: Limits, image_dir: Path) -> Instance:
        if self.fail_restore:
            self.fail_restore = False
            raise RuntimeFailure("injected restore failure")
        return await super().restore(instance_id=instance_id, rootfs=rootfs, limits=limits, image_dir=image_dir)

    async def checkpoint(self, instance: Instance, *, image_dir: Path, leave_running: bool) -> None:
        mode, self.fail_next = self.fail_next, None
        if mode == "before":
            raise RuntimeFailure("injected checkpoint failure")
        if mode == "after":
            await super().kill(instance)  # the instance is gone, as after a crash mid-checkpoint
            raise RuntimeFailure("injected checkpoint failure after the instance stopped")
        await super().checkpoint(instance, image_dir=image_dir, leave_running=leave_running)


@pytest.fixture(scope="module")
async def tiny(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[Node, FaultyDriver]]:
    if os.geteuid() != 0:
        pytest.skip("needs root and runsc")
    data = Path(tmp_path_factory.mktemp("tiny-node"))
    settings = Settings(data_dir=data, build_base=False)
    driver = FaultyDriver(state_dir=data / "runtime", runsc=settings.runsc, platform=settings.runsc_platform)
    node = Node(settings, driver=driver)
    await node.start()
    await commit_tiny(node)
    yield node, driver
    await node.stop(pause_running=False)


async def commit_tiny(node: Node) -> None:
    """The template ``tiny``: an almost empty root filesystem (commands run with the agent's own
    bundled Python)."""
    layer_id, root = node.files.new_layer_dir()
    for d in ("etc", "root", "home/user", "tmp", "proc", "sys", "dev"):
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n")
    (root / "etc/group").write_text("root:x:0:\nuser:x:1000:\n")
    os.chown(root / "home/user", 1000, 1000)
    await commit_template(node, name="tiny", layers=[layer_id], steps=[])


async def run_py(node: Node, sandbox_id: str, code: str, *, wait: bool = True) -> str:
    link = node.get(sandbox_id).link
    assert link is not None
    params: dict[str, Any] = {"process": {"cmd": PY[0], "args": [*PY[1:], code], "envs": {"PYTHONHOME": "/.aenv"}}}
    stream = await link.open("process.start", {**params, "user": "root"})
    out = b""
    while True:
        item = await asyncio.wait_for(stream.recv(), 30)
        if item.kind == END:
            return out.decode()
        event = (item.msg or {}).get("event", {})
        if "start" in event and not wait:
            await stream.end()
            return ""
        if "data" in event:
            out += base64.b64decode(next(iter(event["data"].values())))


async def count(node: Node, sandbox_id: str) -> int:
    return int(await run_py(node, sandbox_id, "print(open('/tmp/n').read())"))


async def start_counter(node: Node, sandbox_id: str) -> None:
    """Start COUNTER and wait for its first write (interpreter start-up is slow on a busy host)."""
    await run_py(node, sandbox_id, COUNTER, wait=False)
    probe = "import os,time\nfor _ in range(300):\n    if os.path.exists('/tmp/n'): break\n    time.sleep(0.05)"
    await run_py(node, sandbox_id, probe)


async def test_failed_pause_leaves_the_sandbox_running(tiny: tuple[Node, FaultyDriver]) -> None:
    node, driver = tiny
    rec = await node.create("tiny")
    await start_counter(node, rec.id)
    driver.fail_next = "before"
    with pytest.raises(RuntimeFailure):
        await node.pause(rec.id)
    assert node.get(rec.id).state.value == "running"
    first = await count(node, rec.id)  # the agent answers: it was thawed, not left frozen
    await asyncio.sleep(0.3)
    assert await count(node, rec.id) > first  # and its processes run
    await node.pause(rec.id)  # a later pause works
    await node.resume(rec.id)
    assert await count(node, rec.id) >= first
    await node.kill(rec.id)


async def test_failed_snapshot_and_fork_leave_the_source_running(tiny: tuple[Node, FaultyDriver]) -> None:
    node, driver = tiny
    rec = await node.create("tiny")
    await start_counter(node, rec.id)
    for op in (lambda: node.snapshot(rec.id), lambda: node.fork(rec.id, count=2)):
        driver.fail_next = "before"
        with pytest.raises(RuntimeFailure):
            await op()
        assert node.get(rec.id).state.value == "running"
        assert await count(node, rec.id) > 0
    assert [s for s in node.snapshots.values() if s.sandbox_id == rec.id] == []
    await node.kill(rec.id)


async def test_a_failed_copy_of_the_upper_leaves_the_source_running_and_nothing_behind(
    tiny: tuple[Node, FaultyDriver], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot or fork that leaves its source running copies the upper while the sandbox is
    stopped; if that copy fails (a full disk), the sandbox is resumed and thawed, and neither an
    image nor a layer is left."""
    node, driver = tiny
    if not driver.leaves_running:
        pytest.skip("runsc 20221219 seals the upper instead of copying it")
    rec = await node.create("tiny")
    await start_counter(node, rec.id)
    await run_py(node, rec.id, "open('/root/written', 'w').write('x')")  # an upper that is not empty
    await node.settle()  # earlier tests' teardowns
    layers, images = node.files.layer_ids(), node.files.image_ids()

    def full(upper_id: str) -> str:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(node.files, "copy_upper", full)
    for op in (lambda: node.snapshot(rec.id), lambda: node.fork(rec.id, count=2)):
        with pytest.raises(OSError):
            await op()
        assert node.get(rec.id).state.value == "running"
        first = await count(node, rec.id)
        await asyncio.sleep(0.3)
        assert await count(node, rec.id) > first  # resumed (runsc pause undone) and thawed
    assert node.files.layer_ids() - layers == set() and node.files.image_ids() - images == set()
    monkeypatch.undo()
    monkeypatch.setattr(node.settings, "disk_headroom_mb", 2**40)  # no room for the copy: refused first
    with pytest.raises(InsufficientStorage):
        await node.snapshot(rec.id)
    assert node.get(rec.id).state.value == "running" and await count(node, rec.id) > 0
    monkeypatch.undo()
    snap = await node.snapshot(rec.id)  # and a later one works, with the copy as its top layer
    await node.files.mount_lowers(snap.layers)  # (mounted at its first use, as a create from it does)
    assert snap.layers[-1] not in layers and (node.files.layer(snap.layers[-1]) / "root" / "written").exists()
    await node.kill(rec.id)


async def test_a_snapshot_whose_record_cannot_be_written_leaves_nothing_and_the_source_running(
    tiny: tuple[Node, FaultyDriver], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint and the upper's copy are made, then the snapshot's record cannot be written
    (the node's database refuses, a full disk): no snapshot, its image and copy go at once (not at
    the next collection, minutes later), and the source runs on."""
    node, _ = tiny
    rec = await node.create("tiny")
    await start_counter(node, rec.id)
    await run_py(node, rec.id, "open('/root/written', 'w').write('x')")
    await node.settle()
    layers, images, snapshots = node.files.layer_ids(), node.files.image_ids(), set(node.snapshots)

    async def refused(snap: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(node.store, "put_snapshot", refused)
    with pytest.raises(OSError):
        await node.snapshot(rec.id)
    monkeypatch.undo()
    assert set(node.snapshots) == snapshots
    assert node.files.layer_ids() - layers == set() and node.files.image_ids() - images == set()
    assert node.get(rec.id).state.value == "running"
    first = await count(node, rec.id)
    await asyncio.sleep(0.3)
    assert await count(node, rec.id) > first
    await node.kill(rec.id)


async def test_a_kill_during_the_upper_s_copy_leaves_no_layer_behind(
    tiny: tuple[Node, FaultyDriver], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kill overtakes a snapshot while its copy of the upper runs in a thread (which cannot be
    stopped): once the thread is done, its layer goes too (not at a collection minutes later)."""
    node, driver = tiny
    if not driver.leaves_running:
        pytest.skip("runsc 20221219 seals the upper instead of copying it")
    rec = await node.create("tiny")
    await run_py(node, rec.id, "open('/root/written', 'w').write('x')")
    await node.settle()
    layers = node.files.layer_ids()
    real, copying, copied = node.files.copy_upper, threading.Event(), threading.Event()

    def slow(upper_id: str) -> str:
        made = real(upper_id)
        copying.set()
        time.sleep(1.5)  # copied, not yet returned: the kill lands meanwhile
        copied.set()
        return made

    monkeypatch.setattr(node.files, "copy_upper", slow)
    snapshot = asyncio.ensure_future(node.snapshot(rec.id))
    assert await asyncio.to_thread(copying.wait, 30)
    await node.kill(rec.id)
    with pytest.raises((SandboxNotFound, asyncio.CancelledError)):
        await snapshot
    assert await asyncio.to_thread(copied.wait, 30)  # the thread returns its layer after all ...
    for _ in range(100):  # ... and it goes
        if node.files.layer_ids() - layers == set():
            break
        await asyncio.sleep(0.1)
    assert node.files.layer_ids() - layers == set()
    assert [s for s in node.snapshots.values() if s.sandbox_id == rec.id] == []


async def test_checkpoint_that_killed_the_instance_removes_the_sandbox(tiny: tuple[Node, FaultyDriver]) -> None:
    node, driver = tiny
    rec = await node.create("tiny")
    driver.fail_next = "after"
    with pytest.raises(RuntimeFailure):
        await node.pause(rec.id)
    with pytest.raises(SandboxNotFound):
        node.get(rec.id)  # gone, not stuck in "pausing"
    await node.settle()
    assert await driver.cleanup_orphans(keep=set()) == []  # nothing leaked
