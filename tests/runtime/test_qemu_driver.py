"""The qemu driver (aenv/runtime/qemu.py): a QEMU microvm under TCG boots Debian's kernel on a
sandbox's layers and upper, a command runs through the agent's channel (AgentLink, as the node runs
them), and checkpoints work as the node uses them: a fork child restored from a checkpoint that left
its source running (on the source's upper copied as a layer), a pause and a resume on the same
upper. Needs root (the layer store's loop mounts), qemu-system-x86, qemu-utils and a Debian kernel
(scripts/install); marked `sandbox`, so it runs in the runsc tier, not the fast one.

One VM boots for the module (TCG on two busy cores: ~10-20 s to the agent's hello); its child is
restored from it in well under a second."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.errors import AenvError, ImageIncompatible
from aenv.node import agentlink
from aenv.node.agentlink import AgentLink
from aenv.runtime import qemu, vmboot, vmcgroup
from aenv.runtime.base import Instance, Limits, RootfsSpec
from aenv.storage.layers import LayerStore
from aenv.templates.builder import Ran, run_process

FLOOD = 256 * 1024
BOOT_DEADLINE = 180.0  # TCG on a loaded CI machine; a liveness bound, not a speed claim


pytestmark = [pytest.mark.sandbox, *([pytest.mark.skip(reason=why)] if (why := qemu.unmet()) else [])]


@dataclass
class Vm:
    driver: qemu.QemuDriver
    files: LayerStore
    instance: Instance
    link: AgentLink
    upper: str
    boot_seconds: float
    layers: list[str]


def rootfs_of(files: LayerStore, layers: list[str], upper: str) -> RootfsSpec:
    return RootfsSpec(
        tuple(files.layer(x) for x in layers),
        files.upper(upper),
        "",
        tuple(files.disk(x) for x in layers),
        files.disk(upper),
    )


def busybox_dir(path: Path) -> None:
    """A plain-directory layer (as debootstrap's base is): the driver makes a disk image of it."""
    for d in ("bin", "etc", "root"):
        (path / d).mkdir()
    (path / "tmp").mkdir(mode=0o1777)
    shutil.copy("/bin/busybox", path / "bin" / "busybox")
    for applet in ("sh", "cat", "echo", "uname", "sync", "head", "tr", "ls"):
        (path / "bin" / applet).symlink_to("busybox")
    (path / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (path / "etc" / "group").write_text("root:x:0:\n")
    (path / "etc" / "greeting").write_text("from the lowest layer\n")
    (path / "etc" / "lowest-only").write_text("kept\n")


@pytest.fixture(scope="module")
async def vm(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Vm]:
    root = tmp_path_factory.mktemp("qemu")
    files = LayerStore(root / "fs")
    base_id, base_dir = files.new_layer_dir()
    busybox_dir(base_dir)
    # A layer that is a layer store image (a sealed upper, as every built or pulled layer above
    # the base is): the guest mounts the image and takes its upper/.
    top = await files.new_upper(64)
    (files.layer(top) / "etc").mkdir()
    (files.layer(top) / "etc" / "greeting").write_text("from the image layer above\n")
    await files.make_read_only(top)
    upper = await files.new_upper(64)
    layers = [base_id, top]
    rootfs = rootfs_of(files, layers, upper)
    driver = qemu.QemuDriver(state_dir=root / "runtime", accel="tcg")
    await asyncio.to_thread(driver.guest_bundle)  # built once, as a node does before its first boot
    ready_timeout, agentlink.READY_TIMEOUT = agentlink.READY_TIMEOUT, BOOT_DEADLINE  # restored below
    started = time.monotonic()
    instance = await driver.boot(instance_id="vm-test", rootfs=rootfs, limits=Limits(cpu_count=2, memory_mb=512))
    link = AgentLink("vm-test")
    try:
        try:
            await link.booted(instance)
        except BaseException:
            print(driver.console(instance))
            raise
        yield Vm(driver, files, instance, link, upper, time.monotonic() - started, layers)
    finally:
        agentlink.READY_TIMEOUT = ready_timeout
        link.close("the test is over")
        await driver.kill(instance)
        await files.unmount_all()


async def sh(vm: Vm, script: str) -> Ran:
    return await run_process(vm.link, ["/bin/sh", "-c", script], cwd="/")


async def test_a_command_runs_in_the_microvm_on_the_sandbox_layers(vm: Vm) -> None:
    ran = await sh(vm, "echo hello; uname -r; cat /etc/greeting /etc/lowest-only; tr '\\0' ' ' < /proc/1/cmdline")
    print(f"boot to the agent's hello under TCG: {vm.boot_seconds:.1f} s")
    assert ran.code == 0, ran
    lines = ran.output.splitlines()
    assert lines[0] == "hello"
    # The guest's kernel is the Debian kernel the driver booted, not the host's: a VM, not a container.
    assert lines[1] == vm.driver.release
    assert lines[1] != os.uname().release
    # Layers lowest first: the image layer's file hides the directory layer's; the rest shows through.
    assert lines[2:4] == ["from the image layer above", "kept"]
    assert "-m aenv.guest" in lines[4]  # the agent is PID 1, as under gVisor (in stage two's interpreter)


async def test_the_sandbox_has_no_network_but_loopback(vm: Vm) -> None:
    ran = await sh(vm, "ls /sys/class/net")
    assert ran.code == 0, ran
    assert ran.output.split() == ["lo"]


async def test_a_console_flood_keeps_a_bounded_tail_on_the_host(vm: Vm) -> None:
    """The guest's root writes 256 KiB to its serial console: the host keeps CONSOLE_KEPT of it and
    the end of what was written. (Seen failing with the tail unbounded: 262144+ bytes kept.)"""
    ran = await sh(vm, f"head -c {FLOOD} /dev/zero | tr '\\0' x > /dev/ttyS0; echo END-OF-FLOOD > /dev/ttyS0")
    assert ran.code == 0, ran
    for _ in range(300):  # the console reaches the host after the command's answer: 30 s at most
        if "END-OF-FLOOD" in vm.driver.console(vm.instance):
            break
        await asyncio.sleep(0.1)
    kept = vm.driver.console(vm.instance)
    assert "END-OF-FLOOD" in kept
    assert len(kept) < FLOOD  # not all of it
    assert len(kept) <= qemu.CONSOLE_KEPT + 4096


COUNTER = "(i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.1; done) >/dev/null 2>&1 &"


async def count(link: AgentLink) -> int:
    for _ in range(50):
        ran = await run_process(link, ["/bin/cat", "/tmp/count"], cwd="/")
        assert ran.code == 0, ran
        if ran.output.strip():  # (read between the shell's truncation and its write: again)
            return int(ran.output)
    raise AssertionError("the counting process stopped writing")


async def rising(link: AgentLink, above: int) -> int:
    """The counter, once it went past ``above``: its process runs (10 s at most, TCG)."""
    for _ in range(100):
        now = await count(link)
        if now > above:
            return now
        await asyncio.sleep(0.1)
    raise AssertionError(f"the counting process is stuck at {above}")


async def fork_child(
    vm: Vm, instance_id: str, limits: Limits | None = None
) -> tuple[Instance, AgentLink, list[str], str, Path]:
    """As the node forks: freeze the agent, checkpoint leaving the VM running while the upper is
    copied into a layer, thaw; restore a child on the layers plus that copy, with a new upper."""
    image = vm.files.image(f"image-{instance_id}")
    copies: list[str] = []

    async def copy_upper() -> None:
        copies.append(await asyncio.to_thread(vm.files.copy_upper, vm.upper))

    await vm.link.freeze()
    await vm.driver.checkpoint_running(vm.instance, image_dir=image, while_stopped=copy_upper)
    await vm.link.unfreeze()
    layers, upper = [*vm.layers, *copies], await vm.files.new_upper(64)
    rootfs = rootfs_of(vm.files, layers, upper)
    child = await vm.driver.restore(instance_id=instance_id, rootfs=rootfs, limits=limits or Limits(), image_dir=image)
    link = AgentLink(instance_id)
    await link.restored(child, fresh=True, config={})
    return child, link, layers, upper, image


async def test_a_fork_child_has_the_sources_processes_and_files_then_diverges(vm: Vm) -> None:
    ran = await sh(vm, f"echo before-the-fork > /root/shared; {COUNTER} echo started")
    assert ran.output == "started\n", ran
    seen = await rising(vm.link, 1)
    child, link, layers, upper, forked = await fork_child(vm, "vm-child")
    try:
        # The source booted with its RAM in a file of its own: the image holds a copy of that file
        # (which the child maps copy-on-write) and the devices' state alone.
        assert (forked / qemu.RAM_FILE).stat().st_size == 512 * 2**20
        assert (forked / qemu.DEVICES).stat().st_size < 2**20
        assert vm.files.guest_written(layers[-1]) and vm.files.guest_written(upper)
        assert not vm.files.upper(upper).is_mount()  # the guest's, never the host's
        # The source's process came along, with its count, and goes on in the child.
        assert await rising(link, seen) > seen
        ran = await run_process(link, ["/bin/sh", "-c", "cat /root/shared; uname -r"], cwd="/")
        assert ran.output.splitlines() == ["before-the-fork", vm.driver.release]
        # Each writes its own disk from here on.
        await run_process(link, ["/bin/sh", "-c", "echo child > /root/mine; sync"], cwd="/")
        await sh(vm, "echo source > /root/mine; sync")
        assert (await run_process(link, ["/bin/cat", "/root/mine"], cwd="/")).output == "child\n"
        assert (await sh(vm, "cat /root/mine")).output == "source\n"
        assert await rising(vm.link, seen) > seen  # the source still runs its own

        # A pause ends the child's QEMU; a resume on the same upper has its memory and disk.
        image = vm.files.image("image-pause")
        paused_at = await count(link)
        await link.freeze()
        await vm.driver.checkpoint(child, image_dir=image, leave_running=False)
        # The child's RAM is private (its image's file, copied on write): its pause writes a copy
        # of that file with the pages the child wrote over it; the forked image is untouched.
        ram = (image / qemu.RAM_FILE).stat()
        assert ram.st_size == 512 * 2**20 and ram.st_ino != (forked / qemu.RAM_FILE).stat().st_ino
        assert ram.st_blocks * 512 < 512 * 2**20  # sparse: the guest's untouched pages are holes
        assert (image / qemu.DEVICES).stat().st_size < 2**20
        pid = int(child.extra["pid"])
        link.close("paused")
        await vm.driver.kill(child)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        rootfs = rootfs_of(vm.files, layers, upper)
        child = await vm.driver.restore(instance_id="vm-resumed", rootfs=rootfs, limits=Limits(), image_dir=image)
        link = AgentLink("vm-resumed")
        await link.restored(child, fresh=True, config={})
        assert (await run_process(link, ["/bin/cat", "/root/mine"], cwd="/")).output == "child\n"
        # /tmp is the guest's memory: the count is there, and goes on from where it was.
        assert await count(link) >= paused_at
        assert await rising(link, paused_at) > paused_at
    finally:
        link.close("the test is over")
        await vm.driver.kill(child)


def limit(driver: qemu.QemuDriver, instance_id: str, v1: tuple[str, str], v2: str) -> str:
    """A limit of an instance's QEMU cgroup: v1's (controller, file) or v2's file."""
    parent = vmcgroup.ROOT / (vmcgroup.PARENT if vmcgroup.unified() else f"{v1[0]}/{vmcgroup.PARENT}")
    group = parent / driver.scope / instance_id
    return (group / (v2 if vmcgroup.unified() else v1[1])).read_text().strip()


async def test_qemu_runs_in_a_cgroup_of_its_own(vm: Vm) -> None:
    """The VM's size bounds its guest; the host bounds QEMU around it: 2 CPUs' quota, the guest's
    512 MiB and QEMU's own (its heap, TCG's capped translation cache), its threads."""
    pid, name = int(vm.instance.extra["pid"]), vm.instance.id
    assert str(pid) in limit(vm.driver, name, ("pids", "cgroup.procs"), "cgroup.procs").split()
    assert limit(vm.driver, name, ("cpu", "cpu.cfs_quota_us"), "cpu.max").split()[0] == "200000"
    memory = (512 + qemu.QEMU_OVERHEAD_MB + qemu.TB_CACHE_MB) * 2**20
    assert int(limit(vm.driver, name, ("memory", "memory.limit_in_bytes"), "memory.max")) == memory
    assert int(limit(vm.driver, name, ("pids", "pids.max"), "pids.max")) == vmcgroup.TASKS
    # A restore has the limits it is given: a fractional CPU is a fraction of one vCPU's time.
    child, link, *_ = await fork_child(vm, "vm-half", limits=Limits(cpu_count=0.5))
    try:
        assert limit(vm.driver, "vm-half", ("cpu", "cpu.cfs_quota_us"), "cpu.max").split()[0] == "50000"
        assert (await run_process(link, ["/bin/echo", "half"], cwd="/")).output == "half\n"
    finally:
        link.close("the test is over")
        await vm.driver.kill(child)
    with pytest.raises(FileNotFoundError):  # gone with its QEMU
        limit(vm.driver, "vm-half", ("cpu", "cpu.cfs_quota_us"), "cpu.max")


async def test_a_restore_refuses_what_does_not_fit_its_image(vm: Vm) -> None:
    image = vm.files.image("image-refusals")
    await vm.link.freeze()
    await vm.driver.checkpoint_running(vm.instance, image_dir=image, while_stopped=_nothing)
    await vm.link.unfreeze()
    assert vm.driver.image_compatible(image)
    fresh = await vm.files.new_upper(64)
    cases = {
        # a fresh upper where the image's own was expected (its disk would be lost)
        "not the one": rootfs_of(vm.files, vm.layers, fresh),
        # layers the image was not saved on
        "was saved on 2 layers": rootfs_of(vm.files, vm.layers[:1], fresh),
    }
    for words, rootfs in cases.items():
        with pytest.raises(ImageIncompatible, match=words) as refused:
            await vm.driver.restore(instance_id="never", rootfs=rootfs, limits=Limits(), image_dir=image)
        assert refused.value.status == 422
    # An image another QEMU (or kernel, or accelerator) wrote, and one that is no image.
    meta = json.loads((image / qemu.META).read_text())
    (image / qemu.META).write_text(json.dumps({**meta, "mark": "qemu 99.0 microvm kvm kernel 7.0"}))
    assert not vm.driver.image_compatible(image)
    with pytest.raises(ImageIncompatible, match="written by qemu 99.0"):
        await vm.driver.restore(
            instance_id="never", rootfs=rootfs_of(vm.files, vm.layers, vm.upper), limits=Limits(), image_dir=image
        )
    for garbage in ("[]", "{", json.dumps({**meta, "lowers": 99}), json.dumps({**meta, "memory_mb": 1})):
        (image / qemu.META).write_text(garbage)
        assert not vm.driver.image_compatible(image)
    # The image's files are hostile too: QEMU must map no file but the image's own RAM file, of
    # the VM's size (QEMU would grow a shorter one), and read its own devices' state.
    (image / qemu.META).write_text(json.dumps(meta))
    ram = image / qemu.RAM_FILE
    ram.rename(image / "ram.kept")
    secret = vm.files.image("secret")
    secret.mkdir(parents=True)
    (secret / "host-file").write_bytes(b"host secret" * 1000)
    own = rootfs_of(vm.files, vm.layers, vm.upper)
    for words, plant in (
        ("lacks its ram", lambda: None),
        ("lacks its ram", lambda: ram.symlink_to(secret / "host-file")),
        ("is 11000 bytes, not the VM's", lambda: os.link(secret / "host-file", ram)),
        ("not a regular file", lambda: os.mkfifo(ram)),
    ):
        ram.unlink(missing_ok=True)
        plant()
        with pytest.raises(ImageIncompatible, match=words):
            await vm.driver.restore(instance_id="never", rootfs=own, limits=Limits(), image_dir=image)
    ram.unlink()
    (image / "ram.kept").rename(ram)
    devices = image / qemu.DEVICES
    with open(devices, "r+b") as f:  # a devices' state past its bound (sparse: nothing written)
        f.truncate(qemu.DEVICES_MAX + 1)
    with pytest.raises(ImageIncompatible, match="devices is too big"):
        await vm.driver.restore(instance_id="never", rootfs=own, limits=Limits(), image_dir=image)
    devices.unlink()
    devices.symlink_to(secret / "host-file")
    with pytest.raises(ImageIncompatible, match="lacks its devices"):
        await vm.driver.restore(instance_id="never", rootfs=own, limits=Limits(), image_dir=image)
    devices.unlink()
    with pytest.raises(ImageIncompatible, match="lacks its devices"):
        await vm.driver.restore(instance_id="never", rootfs=own, limits=Limits(), image_dir=image)
    assert (secret / "host-file").read_bytes() == b"host secret" * 1000
    assert not list(vm.driver.bundles.glob("never*"))  # nothing of the refused restores is left
    assert (await sh(vm, "echo still running")).output == "still running\n"


async def _nothing() -> None:
    return None


async def test_a_checkpoint_that_fails_leaves_the_vm_running(vm: Vm) -> None:
    image = vm.files.image("image-taken")
    image.mkdir(parents=True)
    (image / qemu.DEVICES).write_text("someone else's")  # the save cannot make its file
    await vm.link.freeze()
    with pytest.raises(AenvError):
        await vm.driver.checkpoint(vm.instance, image_dir=image, leave_running=False)
    await vm.link.unfreeze()
    assert (await sh(vm, "echo still running")).output == "still running\n"
    assert not (image / qemu.META).exists()


async def test_writes_land_in_the_upper_image_which_the_host_does_not_mount(vm: Vm) -> None:
    ran = await sh(vm, "echo written-in-the-vm > /root/note; sync")
    assert ran.code == 0, ran
    upper_dir = vm.files.upper(vm.upper)
    assert not upper_dir.is_mount()  # the guest's kernel owns the file system while the VM runs
    vm.link.close("killing")
    await vm.driver.kill(vm.instance)
    assert not upper_dir.is_mount()  # nor after: the host never mounts what a guest kernel wrote
    disk = vm.files.disk(vm.upper)
    assert disk is not None
    assert vm.files.guest_written(vm.upper)
    # Read without mounting: the qcow2 as a raw disk, which debugfs parses in user space.
    raw = disk.with_name("note-check.raw")
    await asyncio.to_thread(subprocess.run, ["qemu-img", "convert", "-O", "raw", str(disk), str(raw)], check=True)
    argv = ["debugfs", "-R", "cat /upper/root/note", str(raw)]
    out = (await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, check=True)).stdout
    assert out == "written-in-the-vm\n"


def test_the_qemu_driver_is_chosen_only_explicitly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from aenv.node.orchestrator import make_driver

    monkeypatch.delenv("AENV_DRIVER", raising=False)
    assert Settings.model_validate({}).driver == "gvisor"
    driver = make_driver(Settings.model_validate({"driver": "qemu", "data_dir": tmp_path, "qemu_accel": "tcg"}))
    assert isinstance(driver, qemu.QemuDriver)
    assert driver.info()["driver"] == "qemu"
    assert driver.info()["kernel"] == vmboot.find_kernel().release
