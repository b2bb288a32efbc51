"""The qemu driver skeleton (aenv/runtime/qemu.py): a QEMU microvm under TCG boots Debian's kernel on
a sandbox's layers and upper, and a command runs through the agent's channel (AgentLink, as the node
runs them). Needs root (the layer store's loop mounts), qemu-system-x86 and a Debian kernel
(scripts/install); marked `sandbox`, so it runs in the runsc tier, not the fast one.

One VM boots for the module (TCG on two busy cores: ~10-20 s to the agent's hello)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.errors import CheckpointRefused, ImageIncompatible
from aenv.node import agentlink
from aenv.node.agentlink import AgentLink
from aenv.runtime import qemu, vmboot
from aenv.runtime.base import Instance, Limits, RootfsSpec
from aenv.storage.layers import LayerStore
from aenv.templates.builder import Ran, run_process

FLOOD = 256 * 1024
BOOT_DEADLINE = 180.0  # TCG on a loaded CI machine; a liveness bound, not a speed claim


def _missing() -> str:
    if shutil.which("qemu-system-x86_64") is None:
        return "qemu-system-x86_64 is not installed (scripts/install installs qemu-system-x86)"
    try:
        vmboot.find_kernel()
    except Exception as exc:
        return str(exc)
    return ""


pytestmark = [pytest.mark.sandbox, *([pytest.mark.skip(reason=_missing())] if _missing() else [])]


@dataclass
class Vm:
    driver: qemu.QemuDriver
    files: LayerStore
    instance: Instance
    link: AgentLink
    upper: str
    boot_seconds: float


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
    rootfs = RootfsSpec(
        tuple(files.layer(x) for x in layers),
        files.upper(upper),
        "",
        tuple(files.disk(x) for x in layers),
        files.disk(upper),
    )
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
        yield Vm(driver, files, instance, link, upper, time.monotonic() - started)
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


async def test_checkpoints_and_restores_are_refused_clearly(vm: Vm, tmp_path: Path) -> None:
    with pytest.raises(CheckpointRefused, match="not supported by the qemu driver yet") as refused:
        await vm.driver.checkpoint(vm.instance, image_dir=tmp_path / "image", leave_running=True)
    assert refused.value.status == 422
    with pytest.raises(ImageIncompatible, match="not supported by the qemu driver yet"):
        await vm.driver.restore(
            instance_id="never", rootfs=vm.instance.rootfs, limits=vm.instance.limits, image_dir=tmp_path
        )
    assert not vm.driver.image_compatible(tmp_path)
    ran = await sh(vm, "echo still running")
    assert ran.output == "still running\n"


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
    # Read without mounting (debugfs parses the image in user space).
    argv = ["debugfs", "-R", "cat /upper/root/note", str(disk)]
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
