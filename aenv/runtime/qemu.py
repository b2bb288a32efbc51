"""QEMU microvm driver (AENV_DRIVER=qemu, never a default): each sandbox its own kernel.

Each instance is one ``qemu-system-x86_64 -M microvm``: KVM where a probe guest boots on /dev/kvm
(decided at the node's start, ``prepare``), TCG (software emulation) elsewhere or when
AENV_QEMU_ACCEL=tcg. It boots the host's Debian kernel with the initramfs of aenv/runtime/vmboot.py
and these virtio-mmio devices, found in the guest by serial and by name:

  - the guest bundle as a read-only disk (``aenv-guest``), mounted at /.aenv by stage one of the
    init (aenv/runtime/compat/aenv_vminit.c), which then runs stage two from it
    (aenv/guest/vminit.py);
  - each layer's image as a read-only disk (``aenv-l<i>``, lowest first; the layer is the image's
    ``upper/``); a plain-directory layer gets an image made from it (vmboot.ext4_of);
  - the sandbox's upper as a writable disk (``aenv-upper``): a qcow2 file at the layer store's
    ``<upper>.img`` that only QEMU opens (aenv/runtime/vmdisks.py says how its chain is built);
  - a virtio-serial port (``aenv.channel``) on a Unix socket pair with the node: stage two makes
    it the agent's stdin and stdout, so the agent and the channel are those of every driver.

Stage two overlays the layers under the upper, mounts /proc, /sys, /dev and the bundle, brings up
loopback (no other network: as runsc --network=none) and execs the agent as PID 1.

**Checkpoints** go through QEMU's monitor (QMP, on a socket pair): the VM is stopped (its disks
drained and flushed), its devices' state saved without RAM (``xen-save-devices-state``) into
``<image>/devices``, its RAM into ``<image>/ram`` as a file (aenv/runtime/vmram.py: a booted VM's
own file, or a restored VM's composed from the file it maps and the pages it wrote), and
``<image>/vm.json`` says how many layer disks it had, its size and its upper. A pause then ends
QEMU; a snapshot or fork continues the VM once the node has copied its upper (which the copies are
restored on). A restore maps the RAM file privately and loads the devices' state. The devices
must match what the image was saved with, so a restore maps the node's layer list back: the
image's lower disks first; then either the upper it was saved with (a resume), or one more layer,
the saved upper sealed or copied, which the new upper becomes a copy-on-write overlay of (a create
from a template, a fork child, a snapshot's restore).

Limits: memory and vCPUs are the VM's size (-m, -smp; a restore keeps the image's, so templates are
snapshotted at their sandboxes' size), QEMU's host cgroup (aenv/runtime/vmcgroup.py) holds a CPU
quota, its memory and threads, the disk quota is the upper's size. Doze stops the QEMU process
(SIGSTOP). The network is the agent's, as under gVisor (no NIC). Not yet: volumes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import math
import os
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qemu.qmp import QMPClient, QMPError

from aenv.errors import CheckpointRefused, ImageIncompatible, OperationTimeout, RuntimeFailure
from aenv.runtime import guestbundle, hostexec, vmboot, vmcgroup, vmdisks, vmram
from aenv.runtime.base import Instance, Limits, NothingToChoose, OwnBase, RootfsSpec, TeardownOnKill, Usage
from aenv.storage.layers import copy_sparse

log = logging.getLogger(__name__)
logging.getLogger("qemu.qmp").setLevel(logging.WARNING)  # it says every QEMU's end at INFO

NAME = "qemu"
PORT = "aenv.channel"
# microvm has 24 virtio-mmio transports (QEMU 7.2); the bundle, the upper and the serial ports
# take three.
MAX_LAYERS = 21
CONSOLE_KEPT = 64 * 1024  # of the guest's console (kernel messages, the init's errors): the tail
# The kernel reads 2048 bytes of its command line. (It finds the virtio-mmio devices in microvm's
# ACPI tables: Debian's kernels cannot take them from the command line, as with ACPI off.)
CMDLINE_MAX = 2047
KILL_TIMEOUT = 10.0
KVM_PROBE_TIMEOUT = 10.0
QMP_TIMEOUT = 30.0  # a monitor command (QEMU answers at once unless it is wedged)
LOAD_TIMEOUT = 300.0
POLL = 0.005
DEVICES = "devices"  # in an image: the devices' state (QEMU's xen-save-devices-state: no RAM)
RAM_FILE = "ram"  # in an image: the guest's RAM as a file, which restores map copy-on-write
IMAGE_FORMAT = "devices+ram"  # in the mark: images of streamed RAM (earlier nodes') are not restored
META = "vm.json"  # in an image: what the VM was (its disks, size, QEMU, kernel)
META_MAX = 64 * 1024
DEVICES_MAX = 64 * 2**20  # a devices' state is tens of KiB
# What QEMU may hold besides its guest's RAM (its host cgroup's memory limit is the sum): its heap
# and devices, and under TCG its translation cache.
QEMU_OVERHEAD_MB = 256
TB_CACHE_MB = 256
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# A small, quiet boot: the console only for what goes wrong, no reboot (a panic ends QEMU), the
# CPU's random numbers trusted (the agent's Python asks for entropy at start), no probing of
# legacy keyboards and mice.
KERNEL_ARGS = (
    "console=ttyS0 quiet loglevel=4 panic=-1 reboot=t random.trust_cpu=on "
    "i8042.noaux i8042.nomux i8042.nopnp i8042.dumbkbd tsc=reliable no_timer_check"
)


def unmet(qemu: str = "qemu-system-x86_64", kernel: str = "") -> str:
    """What this host lacks for the qemu driver ("" for nothing): QEMU, qemu-img, a guest kernel."""
    missing = [tool for tool in (qemu, "qemu-img") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found: AENV_DRIVER=qemu ./scripts/install installs them"
    try:
        vmboot.find_kernel(kernel)
    except RuntimeFailure as exc:
        return exc.message
    return ""


def kvm_usable() -> bool:
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    os.close(fd)
    return True


@dataclass
class _Vm:
    """One running QEMU as the driver holds it."""

    proc: asyncio.subprocess.Process
    qmp: QMPClient
    console: deque[bytes] = field(default_factory=deque)
    tail: asyncio.Future[None] | None = None
    dozing: bool = False
    meta: dict[str, Any] = field(default_factory=dict)  # what a checkpoint of it writes to vm.json
    ram: Path | None = None  # its RAM as a file of its own (mapped shared): a booted VM's
    base: int | None = None  # a restored VM's: the image's RAM file it maps privately, open


class QemuDriver(guestbundle.BundledGuests, TeardownOnKill, NothingToChoose):
    name = NAME
    own_base: OwnBase | None = None  # `base` is the node's debootstrapped Debian
    saves_epoll_tcp = True  # a VM's migration saves every socket its kernel holds
    leaves_running = True  # a migration into a file, then `cont`
    restore_leaves_garbage = False
    sized_by_image = True  # its RAM and vCPUs

    def __init__(self, *, state_dir: Path, qemu: str = "qemu-system-x86_64", kernel: str = "", accel: str = "auto"):
        found = shutil.which(qemu)
        if found is None:
            raise RuntimeFailure(f"the qemu driver needs {qemu}: install Debian's qemu-system-x86 (scripts/install)")
        if shutil.which("qemu-img") is None:
            raise RuntimeFailure("the qemu driver needs qemu-img: install Debian's qemu-utils (scripts/install)")
        self.qemu = found
        self.kernel = vmboot.find_kernel(kernel)
        self.release = self.kernel.release
        if accel not in ("auto", "kvm", "tcg"):
            raise RuntimeFailure(f"AENV_QEMU_ACCEL must be auto, kvm or tcg, not {accel!r}")
        # auto: KVM if /dev/kvm opens and a kernel boots on it (a nested host may have one that
        # does not), decided by `prepare` (or the first boot); TCG otherwise.
        self.accel = ("probe" if kvm_usable() else "tcg") if accel == "auto" else accel
        self._probing = asyncio.Lock()
        self.version = _qemu_version(found)
        self.tsc_khz = _host_tsc_khz()
        self.state_dir = state_dir
        # This node's VMs' cgroups: aenv-vm/<scope>/ (another node on the host has its own).
        self.scope = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:12]
        self.bundles = state_dir / "qemu-instances"
        self.disks = state_dir / "qemu-disks"  # images of plain-directory layers and of guest bundles
        for d in (self.bundles, self.disks):
            d.mkdir(parents=True, exist_ok=True)
        self._init_guests(state_dir / "guest")  # built as for every driver, attached as a disk
        self._making: dict[Path, asyncio.Lock] = {}
        self._vms: dict[str, _Vm] = {}
        self.wakes = 0

    @property
    def boot_timeout(self) -> float:
        return 30.0 if self.accel == "kvm" else 180.0  # TCG: 7-10 s to the hello here, quiet

    @property
    def image_mark(self) -> str:
        """Who can restore an image: the same QEMU, kernel and CPU model (KVM's is the host's)."""
        return f"qemu {self.version} microvm {self.accel} kernel {self.release} {IMAGE_FORMAT}"

    def info(self) -> dict[str, str]:
        return {
            "driver": NAME,
            "runsc": "none",
            "platform": f"qemu microvm ({self.accel})",
            "qemu": self.version,
            "kernel": self.release,
        }

    def calibration(self) -> dict[str, Any] | None:
        return {"accel": self.accel, "kvm_device": kvm_usable()}

    async def prepare(self, limits: Limits) -> None:
        await self._settle_accel()

    async def _settle_accel(self) -> None:
        if self.accel == "probe":
            async with self._probing:
                if self.accel == "probe":
                    self.accel = "kvm" if await self._kvm_boots() else "tcg"

    def remove_guest(self, key: str) -> None:
        super().remove_guest(key)
        (self.disks / f"guest-{key}.img").unlink(missing_ok=True)  # the bundle as the disk it was attached as

    def image_compatible(self, image_dir: Path) -> bool:
        try:
            return _read_meta(image_dir).get("mark") == self.image_mark
        except ImageIncompatible:
            return False

    async def _image_of(self, source: Path, dest: Path) -> Path:
        """An ext4 image of a directory, made once (one maker at a time per image)."""
        lock = self._making.setdefault(dest, asyncio.Lock())
        async with lock:
            made = await vmboot.ext4_of(source, dest)
        self._making.pop(dest, None)
        return made

    async def _layer_disks(self, rootfs: RootfsSpec) -> list[tuple[Path, str]]:
        """(disk image, the layer's directory in it) of each layer, lowest first."""
        disks = rootfs.layer_disks or (None,) * len(rootfs.layers)
        out = []
        for layer, disk in zip(rootfs.layers, disks, strict=True):
            if disk is not None:
                out.append((disk, layer.name))  # a layer store image: the layer is its upper/
                continue
            key = hashlib.sha256(os.fsencode(layer.resolve())).hexdigest()[:24]
            (self.disks / f"layer-{key}.src").write_text(str(layer))
            out.append((await self._image_of(layer, self.disks / f"layer-{key}.img"), ""))
        return out

    async def _kvm_boots(self) -> bool:
        """Whether the kernel boots under KVM here: it panics at once with no root to mount, and
        QEMU (-no-reboot) exits. A host whose /dev/kvm cannot run it fails or hangs instead."""
        argv = [self.qemu, "-M", "microvm", "-accel", "kvm", "-cpu", "host", "-m", "256M", "-nodefaults"]
        argv += ["-no-user-config", "-display", "none", "-no-reboot", "-serial", "stdio"]
        argv += ["-kernel", str(self.kernel.path), "-append", "console=ttyS0 panic=-1 loglevel=1"]
        try:
            out = await hostexec.run(argv, timeout=KVM_PROBE_TIMEOUT)
        except (RuntimeFailure, OperationTimeout) as exc:
            log.warning("/dev/kvm is here but QEMU cannot boot on it (%s): the qemu driver uses TCG", exc.message)
            return False
        return "Kernel panic" in out

    # -- start ----------------------------------------------------------------------------------------
    async def boot(self, *, instance_id: str, rootfs: RootfsSpec, limits: Limits) -> Instance:
        self._check(rootfs)
        await self._settle_accel()
        bundle = self.bundles / instance_id
        bundle.mkdir(parents=True, exist_ok=True)
        try:
            upper = await self._take_upper(rootfs)
            if vmdisks.read_qcow2(upper) is None:
                await vmdisks.standalone(upper)  # a fresh upper: from now on the guest's alone
            layers = await self._layer_disks(rootfs)
            cpus, memory_mb = max(1, math.ceil(limits.cpu_count)), max(limits.memory_mb, 128)
            append = self._append(rootfs, layers)
            return await self._launch(
                instance_id, rootfs, limits, bundle, layers, len(layers), cpus, memory_mb, append, None
            )
        except BaseException:
            await self._teardown(instance_id)
            raise

    async def restore(self, *, instance_id: str, rootfs: RootfsSpec, limits: Limits, image_dir: Path) -> Instance:
        meta = _read_meta(image_dir)
        if meta.get("mark") != self.image_mark:
            raise ImageIncompatible(
                f"its memory image was written by {str(meta.get('mark'))[:200]}; this node runs {self.image_mark}"
            )
        self._check(rootfs)
        lowers, saved_on, saved_upper = int(meta["lowers"]), int(meta["layers"]), str(meta["upper"])
        extra = len(rootfs.layers) - saved_on
        disks = rootfs.layer_disks
        if extra not in (0, 1) or len(disks) != len(rootfs.layers) or rootfs.upper_disk is None:
            raise ImageIncompatible(f"the image was saved on {saved_on} layers; this sandbox has {len(rootfs.layers)}")
        bundle = self.bundles / instance_id
        bundle.mkdir(parents=True, exist_ok=True)
        try:
            upper = await self._take_upper(rootfs)
            fresh = vmdisks.read_qcow2(upper) is None
            if extra == 1:
                # The saved upper sealed or copied as a layer: the new upper starts as it, copy on write.
                below = disks[-1]
                if not fresh or below is None or vmdisks.read_qcow2(below) is None:
                    raise ImageIncompatible("the layer above the image's own is not a disk this driver wrote")
                await vmdisks.overlay(upper, below)
            elif fresh or upper.stem != saved_upper:
                raise ImageIncompatible("the sandbox's disk is not the one its memory image was saved with")
            every = await self._layer_disks(rootfs)
            cpus, memory_mb, append = int(meta["cpus"]), int(meta["memory_mb"]), str(meta["append"])
            return await self._launch(
                instance_id, rootfs, limits, bundle, every, lowers, cpus, memory_mb, append, image_dir
            )
        except BaseException:
            await self._teardown(instance_id)
            raise

    def _check(self, rootfs: RootfsSpec) -> None:
        if len(rootfs.layers) > MAX_LAYERS:
            count = len(rootfs.layers)
            raise RuntimeFailure(f"the qemu driver boots at most {MAX_LAYERS} layers yet; this sandbox has {count}")
        if rootfs.upper_disk is None:
            raise RuntimeFailure("the qemu driver needs the sandbox's upper as a disk image (not a plain directory)")
        if rootfs.mounts:
            raise RuntimeFailure("the qemu driver mounts no volumes yet")

    async def _take_upper(self, rootfs: RootfsSpec) -> Path:
        """The upper's image, unmounted on the host if the layer store had mounted it (a fresh one):
        one kernel at a time writes a file system, and from here on it is the guest's."""
        upper = rootfs.upper_disk
        assert upper is not None
        if os.path.ismount(rootfs.upper):  # (stage two makes the bundle's mount point, in the guest)
            (rootfs.upper / "work").mkdir(exist_ok=True)
            await hostexec.run(["umount", str(rootfs.upper)], timeout=60)
        return upper

    def _append(self, rootfs: RootfsSpec, layers: list[tuple[Path, str]]) -> str:
        cfg = {
            "layers": "".join("u" if subdir else "r" for _, subdir in layers),  # aenv/guest/vminit.py
            "module": guestbundle.agent_argv()[-1],  # run by stage two's interpreter: the agent's
            "env": {"PATH": PATH, **dict(e.split("=", 1) for e in guestbundle.agent_env())},
        }
        encoded = base64.urlsafe_b64encode(json.dumps(cfg, separators=(",", ":")).encode()).decode().rstrip("=")
        stage_two = [guestbundle.GUEST_MOUNT, *guestbundle.agent_argv("aenv.guest.vminit"), "--"]
        kernel_env = guestbundle.agent_env()  # stage two's: the kernel passes what it does not know to init
        append = " ".join((KERNEL_ARGS, *self._clock_args(), *kernel_env, f"aenv.cfg={encoded}", "--", *stage_two))
        if len(append) > CMDLINE_MAX:
            raise RuntimeFailure(f"the qemu driver cannot boot {len(layers)} layers: the kernel's command line is full")
        return append

    async def _launch(
        self,
        instance_id: str,
        rootfs: RootfsSpec,
        limits: Limits,
        bundle: Path,
        layers: list[tuple[Path, str]],
        lowers: int,
        cpus: int,
        memory_mb: int,
        append: str,
        image: Path | None,
    ) -> Instance:
        """Start QEMU on every layer of the record (``layers``), of which the first ``lowers`` are
        the VM's lower disks (a restore's may be fewer: the rest back its upper), the bundle and the
        upper; restored from ``image`` or booting. A booting VM's RAM is a file of its own, mapped
        shared, which its checkpoints hand on as it is (aenv/runtime/vmram.py). A restored VM maps
        the image's RAM file privately: the pages nobody writes are shared by every VM restored
        from the image, and its checkpoints lay the pages it wrote over a copy of that file."""
        guest = self.guest_bundle(rootfs.guest)
        guest_disk = await self._image_of(guest, self.disks / f"guest-{guest.name}.img")
        initramfs = await asyncio.to_thread(vmboot.ensure_initramfs, self.disks, self.kernel)
        upper = rootfs.upper_disk
        assert upper is not None
        (bundle / "upper").write_text(str(rootfs.upper))
        chain = vmdisks.Chain()
        chain.raw(guest_disk, name="guest")
        every = [disk for disk, _ in layers]
        names = chain.layers(every)  # a node for each layer, a device for each lower
        upper_node = chain.upper(upper, every)
        own_ram, base, devices = None, None, None
        try:
            if image is None:
                own_ram = bundle / RAM_FILE
                ram, share = own_ram, True
            else:
                # QEMU opens what it is given by path: the file checked here, through its descriptor.
                base = _open_image_file(image / RAM_FILE, memory_mb * 2**20)
                ram, share = Path(f"/proc/self/fd/{base}"), False
                devices = _open_image_file(image / DEVICES, None)
        except BaseException:
            _close(base, devices)
            raise
        host_end, guest_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        qmp_host, qmp_guest = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = self._argv(instance_id, cpus, memory_mb, append, guest_end.fileno(), qmp_guest.fileno(), initramfs)
        # One RAM block named "ram" whatever backs it (a device state names the blocks it knew).
        backend: dict[str, Any] = {"qom-type": "memory-backend-file", "id": "ram", "size": memory_mb * 2**20}
        backend |= {"mem-path": str(ram), "share": share}
        argv += ["-object", json.dumps(backend), "-machine", "memory-backend=ram"]
        argv += chain.argv()
        argv += ["-device", "virtio-blk-device,drive=guest,serial=aenv-guest"]
        for i in range(lowers):
            argv += ["-device", f"virtio-blk-device,drive={names[i]},serial=aenv-l{i}"]
        argv += ["-device", f"virtio-blk-device,drive={upper_node},serial=aenv-upper"]
        if devices is not None:
            # No ROM is written into RAM while incoming, and a device state has no configuration
            # section (xen-save-devices-state writes none) for the loader to look for.
            argv += ["-incoming", "defer", "-global", "migration.send-configuration=off"]
        passed = (guest_end.fileno(), qmp_guest.fileno(), *(fd for fd in (base, devices) if fd is not None))
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=passed,
                start_new_session=True,
            )
        except OSError as exc:
            host_end.close()
            qmp_host.close()
            _close(base, devices)
            raise RuntimeFailure(f"cannot run {self.qemu}: {exc}", argv=argv) from exc
        finally:
            guest_end.close()
            qmp_guest.close()
        vm = _Vm(proc, QMPClient(f"aenv-{instance_id}"), ram=own_ram, base=base)
        self._vms[instance_id] = vm
        vm.meta = {
            "lowers": lowers,
            "layers": len(layers),
            "upper": upper.stem,
            "cpus": cpus,
            "memory_mb": memory_mb,
            "append": append,
        }
        (bundle / "pid").write_text(f"{proc.pid} {_start_time(proc.pid)}")
        vm.tail = asyncio.ensure_future(_keep_tail(proc, vm.console))
        try:
            self._contain(instance_id, proc.pid, limits.cpu_count, memory_mb)
            await asyncio.wait_for(vm.qmp.connect(qmp_host), QMP_TIMEOUT)
            if devices is not None:
                await self._qmp(vm, "migrate-incoming", {"uri": f"fd:{devices}"})
                await self._wait_loaded(vm)
        except BaseException:
            qmp_host.close()
            host_end.close()
            raise
        finally:
            if devices is not None:
                os.close(devices)
        reader, writer = await asyncio.open_unix_connection(sock=host_end, limit=2**22)
        # A restore's machine is the image's, whatever was asked: the limits say what it has.
        sized = dataclasses.replace(limits, cpu_count=float(cpus), memory_mb=memory_mb) if image else limits
        return Instance(instance_id, reader, writer, rootfs, sized, bundle, {"pid": str(proc.pid)})

    def _contain(self, instance_id: str, pid: int, cpus: float, memory_mb: int) -> None:
        """QEMU into a cgroup of its own (aenv/runtime/vmcgroup.py): a quota of ``cpus``, and the
        guest's RAM plus QEMU's own as its memory."""
        host_mb = memory_mb + QEMU_OVERHEAD_MB + (0 if self.accel == "kvm" else TB_CACHE_MB)
        try:
            group = vmcgroup.create(self.scope, instance_id, cpus=cpus, memory_bytes=host_mb * 2**20)
            if group is not None:
                group.join(pid)
        except OSError as exc:
            raise RuntimeFailure(f"cannot put QEMU in its cgroup: {exc}") from exc

    async def _wait_loaded(self, vm: _Vm) -> None:
        """Until the incoming migration is loaded, then run the VM: it was saved stopped, which the
        image keeps (QEMU would not start it by itself)."""
        deadline = time.monotonic() + LOAD_TIMEOUT
        while True:
            status = await self._qmp(vm, "query-status")
            if isinstance(status, dict) and status.get("status") == "running":
                return
            if isinstance(status, dict) and status.get("status") == "paused":
                await self._qmp(vm, "cont")
                return
            if vm.proc.returncode is not None:
                raise RuntimeFailure(f"QEMU could not load the memory image: {self._tail(vm)}")
            if isinstance(status, dict) and status.get("status") not in ("inmigrate", "paused", "prelaunch"):
                raise RuntimeFailure(f"the restored VM is {status.get('status')}: {self._tail(vm)}")
            if time.monotonic() > deadline:
                raise OperationTimeout(f"QEMU did not load the memory image within {LOAD_TIMEOUT:.0f}s")
            await asyncio.sleep(POLL)

    async def _qmp(self, vm: _Vm, command: str, arguments: dict[str, Any] | None = None) -> Any:
        try:
            return await asyncio.wait_for(vm.qmp.execute(command, arguments), QMP_TIMEOUT)
        except TimeoutError as exc:
            raise OperationTimeout(f"QEMU's monitor did not answer {command} within {QMP_TIMEOUT:.0f}s") from exc
        except (QMPError, OSError, EOFError) as exc:
            raise RuntimeFailure(f"QEMU's monitor refused {command}: {exc}; {self._tail(vm)}") from exc

    def _tail(self, vm: _Vm) -> str:
        return b"".join(vm.console).decode(errors="replace")[-2000:].strip() or "(QEMU said nothing)"

    def _clock_args(self) -> list[str]:
        """Under TCG the guest's TSC runs at the host's, which no device of microvm's lets the kernel
        measure (its ACPI is hardware-reduced: no PIT); without being told, it waits forever for a
        timer it cannot calibrate. Under KVM, kvmclock tells it."""
        if self.accel == "kvm" or not self.tsc_khz:
            return []
        hz = _kernel_hz(self.kernel)  # and its delay loop, which it would calibrate for ~1 s
        return [f"tsc_early_khz={self.tsc_khz}", *([f"lpj={self.tsc_khz * 1000 // hz}"] if hz else [])]

    def _argv(
        self, instance_id: str, cpus: int, memory_mb: int, append: str, channel_fd: int, qmp_fd: int, initramfs: Path
    ) -> list[str]:
        kvm = self.accel == "kvm"
        tcg = f"tcg,thread=multi,tb-size={TB_CACHE_MB}"  # (QEMU's default: up to 1 GiB per VM)
        accel = ["-accel", "kvm", "-cpu", "host"] if kvm else ["-accel", tcg, "-cpu", "max"]
        # fmt: off
        return [
            self.qemu,
            "-name", f"aenv-{instance_id}",
            "-M", "microvm,x-option-roms=off",
            *accel,
            "-smp", str(cpus),
            "-m", f"{memory_mb}M",
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
            "-serial", "stdio",
            "-chardev", f"socket,id=monitor,fd={qmp_fd}",
            "-mon", "chardev=monitor,mode=control",
            "-kernel", str(self.kernel.path), "-initrd", str(initramfs), "-append", append,
            "-device", "virtio-serial-device,max_ports=2",
            "-chardev", f"socket,id=channel,fd={channel_fd}",
            "-device", f"virtserialport,chardev=channel,name={PORT}",
        ]
        # fmt: on

    def console(self, instance: Instance) -> str:
        """The tail of the guest's console: what the kernel and the init said (errors only, quiet)."""
        vm = self._vms.get(instance.id)
        return b"".join(vm.console).decode(errors="replace") if vm is not None else ""

    # -- checkpoints --------------------------------------------------------------------------------
    async def checkpoint(self, instance: Instance, *, image_dir: Path, leave_running: bool) -> None:
        if leave_running:

            async def nothing() -> None:
                return None

            await self.checkpoint_running(instance, image_dir=image_dir, while_stopped=nothing)
            return
        vm = self._running(instance)
        await self._save(vm, image_dir, ends=True)
        with contextlib.suppress(RuntimeFailure, OperationTimeout):
            await self._qmp(vm, "quit")  # saved: the instance ends here, as a pause wants
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(vm.proc.wait(), KILL_TIMEOUT)

    async def checkpoint_running(
        self, instance: Instance, *, image_dir: Path, while_stopped: Callable[[], Awaitable[None]]
    ) -> None:
        vm = self._running(instance)
        try:
            await self._save(vm, image_dir, ends=False)
            try:
                await while_stopped()  # the disks are flushed and nothing writes them: the node copies the upper
            except BaseException:
                _drop_image(image_dir)
                raise
        finally:
            if vm.proc.returncode is None:
                await self._qmp(vm, "cont")

    def _running(self, instance: Instance) -> _Vm:
        vm = self._vms.get(instance.id)
        if vm is None or vm.proc.returncode is not None:
            raise CheckpointRefused(f"sandbox instance {instance.id} is not running")
        self.wake(instance)
        return vm

    async def _save(self, vm: _Vm, image_dir: Path, *, ends: bool) -> None:
        """Stop the VM and write its image into ``image_dir``: the devices' state, vm.json, and its
        RAM as a file (a booted VM's own, taken as it is when the VM ``ends`` here, else copied; a
        restored VM's composed: aenv/runtime/vmram.py). On failure the VM is continued (a
        checkpoint that fails leaves the sandbox as it was) and the image's files are gone."""
        devices = image_dir / DEVICES
        try:
            image_dir.mkdir(parents=True, exist_ok=True)
            # QEMU opens the path itself: a new file of ours, never a link someone left there.
            os.close(os.open(devices, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
        except OSError as exc:
            raise RuntimeFailure(f"cannot write the memory image: {exc.strerror}") from exc
        try:
            await self._qmp(vm, "stop")  # stopping drains and flushes the disks
            await self._qmp(vm, "xen-save-devices-state", {"filename": str(devices), "live": False})
            (image_dir / META).write_text(json.dumps({**vm.meta, "mark": self.image_mark}))
            started = time.monotonic()
            written = await asyncio.to_thread(self._save_ram, vm, image_dir / RAM_FILE, ends)
            took = time.monotonic() - started
            log.debug("qemu: RAM of image %s saved in %.3fs (%d MiB written)", image_dir.name, took, written >> 20)
        except OSError as exc:
            _drop_image(image_dir)
            await self._resume_after_failure(vm)
            raise CheckpointRefused(f"cannot save the VM's RAM: {exc}") from exc
        except BaseException:
            _drop_image(image_dir)
            await self._resume_after_failure(vm)
            raise

    def _save_ram(self, vm: _Vm, target: Path, ends: bool) -> int:
        """The stopped VM's RAM into ``target``; the bytes of pages it wrote (a restored VM's)."""
        if vm.ram is not None:
            if ends:
                _take_file(vm.ram, target)  # nothing copied: the VM ends
            else:
                copy_sparse(vm.ram, target)
            return 0
        assert vm.base is not None
        return vmram.compose(vm.proc.pid, vm.base, target)

    async def _resume_after_failure(self, vm: _Vm) -> None:
        if vm.proc.returncode is None:
            with contextlib.suppress(RuntimeFailure, OperationTimeout):
                await self._qmp(vm, "cont")

    # -- doze: the whole QEMU process stopped --------------------------------------------------------
    def doze(self, instance: Instance) -> bool:
        vm = self._vms.get(instance.id)
        if vm is None or vm.proc.returncode is not None:
            return False
        if not vm.dozing:
            with contextlib.suppress(ProcessLookupError):
                os.kill(vm.proc.pid, signal.SIGSTOP)
            vm.dozing = True
        return True

    def wake(self, instance: Instance) -> None:
        vm = self._vms.get(instance.id)
        if vm is not None and vm.dozing:
            with contextlib.suppress(ProcessLookupError):
                os.kill(vm.proc.pid, signal.SIGCONT)
            vm.dozing = False
            self.wakes += 1

    def dozing(self, instance: Instance) -> bool:
        vm = self._vms.get(instance.id)
        return vm is not None and vm.dozing

    # -- the rest of the contract ---------------------------------------------------------------------
    async def _teardown(self, instance_id: str) -> None:
        bundle = self.bundles / instance_id
        vm = self._vms.pop(instance_id, None)
        if vm is not None and vm.base is not None:
            os.close(vm.base)
            vm.base = None
        pid = vm.proc.pid if vm is not None else _read_pid(bundle / "pid")
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)  # QEMU is its session's leader
        if vm is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(vm.proc.wait(), KILL_TIMEOUT)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(vm.qmp.disconnect(), 5)
            if vm.tail is not None:
                vm.tail.cancel()
        await vmcgroup.remove(self.scope, instance_id)
        await asyncio.to_thread(shutil.rmtree, bundle, True)

    async def usage(self, instance: Instance) -> Usage:
        vm = self._vms.get(instance.id)
        cpu, rss, threads = 0.0, 0, 0
        if vm is not None:
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{vm.proc.pid}/stat", "rb") as f:
                    fields = f.read().rpartition(b")")[2].split()
                cpu = sum(int(x) for x in fields[11:13]) / os.sysconf("SC_CLK_TCK")
                threads = int(fields[17])
                rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        return Usage(
            cpu_seconds=cpu,
            memory_bytes=rss,
            memory_limit_bytes=instance.limits.memory_mb * 2**20,
            pids=threads,
            pids_limit=0,
        )

    async def host_tasks(self, instance: Instance) -> tuple[int, int]:
        return 0, 0  # one QEMU process whatever the guest runs: nothing for the node to contain

    async def cleanup_orphans(self, keep: set[str]) -> list[str]:
        removed = []
        for path in sorted(self.bundles.iterdir()):
            if path.is_dir() and path.name not in keep and path.name not in self._vms:
                await self._teardown(path.name)
                removed.append(path.name)
        for name in vmcgroup.names(self.scope) - keep - set(self._vms) - set(removed):
            await vmcgroup.remove(self.scope, name)  # a VM of a node that ended without its clean-up
        for src in self.disks.glob("layer-*.src"):  # images of directory layers that are gone
            with contextlib.suppress(OSError):
                if not Path(src.read_text()).is_dir():
                    src.with_suffix(".img").unlink(missing_ok=True)
                    src.unlink()
        return removed


def _drop_image(image_dir: Path) -> None:
    for name in (DEVICES, META, RAM_FILE):
        (image_dir / name).unlink(missing_ok=True)


def _close(*fds: int | None) -> None:
    for fd in fds:
        if fd is not None:
            os.close(fd)


def _open_image_file(path: Path, size: int | None) -> int:
    """A file of an image (hostile: a repository others write), open for reading: a regular file,
    no link, of ``size`` bytes (a RAM file: QEMU would grow a shorter one), or at most
    DEVICES_MAX."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ImageIncompatible(f"the memory image lacks its {path.name} ({exc.strerror})") from exc
    st = os.fstat(fd)
    wrong = (
        "is not a regular file"
        if not stat.S_ISREG(st.st_mode)
        else f"is {st.st_size} bytes, not the VM's {size}"
        if size is not None and st.st_size != size
        else "is too big"
        if size is None and st.st_size > DEVICES_MAX
        else ""
    )
    if wrong:
        os.close(fd)
        raise ImageIncompatible(f"the memory image's {path.name} {wrong}")
    return fd


def _take_file(source: Path, target: Path) -> None:
    """Move a stopped VM's RAM file into its image (a copy where they are on two file systems)."""
    try:
        os.rename(source, target)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        copy_sparse(source, target)


def _read_meta(image_dir: Path) -> dict[str, Any]:
    """An image's vm.json (hostile: a repository others write), checked for what a restore reads."""
    try:
        fd = os.open(image_dir / META, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            raw = os.read(fd, META_MAX + 1)
        finally:
            os.close(fd)
        meta = json.loads(raw) if len(raw) <= META_MAX else None
    except (OSError, ValueError) as exc:
        raise ImageIncompatible(f"no memory image of the qemu driver here ({type(exc).__name__})") from exc
    if not isinstance(meta, dict):
        raise ImageIncompatible("the memory image's description is not one")
    kinds = {"lowers": int, "layers": int, "upper": str, "cpus": int, "memory_mb": int, "append": str, "mark": str}
    for key, kind in kinds.items():
        if not isinstance(meta.get(key), kind):
            raise ImageIncompatible(f"the memory image's description lacks {key}")
    if (
        not 0 <= meta["lowers"] <= meta["layers"] <= MAX_LAYERS
        or not 1 <= meta["cpus"] <= 256
        or not 128 <= meta["memory_mb"] <= 2**20
    ):
        raise ImageIncompatible("the memory image's description is out of bounds")
    if len(meta["append"]) > CMDLINE_MAX:
        raise ImageIncompatible("the memory image's kernel command line is too long")
    return meta


async def _keep_tail(proc: asyncio.subprocess.Process, kept: deque[bytes]) -> None:
    """Read QEMU's output (the guest's serial console, its own errors) to the end, keeping the
    tail: whatever the guest prints, the host keeps CONSOLE_KEPT bytes of it."""
    assert proc.stdout is not None
    size = 0
    while chunk := await proc.stdout.read(4096):
        kept.append(chunk)
        size += len(chunk)
        while size - len(kept[0]) >= CONSOLE_KEPT:
            size -= len(kept.popleft())


def _qemu_version(qemu: str) -> str:
    try:
        out = subprocess.run([qemu, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    first = out.splitlines()[0] if out else ""
    return first.removeprefix("QEMU emulator version").strip()[:100] or "unknown"


def _host_tsc_khz() -> int:
    """The host's TSC frequency as far as /proc/cpuinfo says it (0 if it does not)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("cpu MHz"):
                    return int(float(line.split(":", 1)[1]) * 1000)
    except (OSError, ValueError):
        pass
    return 0


def _kernel_hz(kernel: vmboot.Kernel) -> int:
    try:
        for line in (kernel.path.parent / f"config-{kernel.release}").read_text().splitlines():
            if line.startswith("CONFIG_HZ="):
                return int(line.split("=", 1)[1])
    except (OSError, ValueError):
        pass
    return 0


def _start_time(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rpartition(b")")[2].split()[19].decode()


def _read_pid(path: Path) -> int | None:
    """The QEMU a pid file names, if that process (by its start time) is still the one it named."""
    try:
        pid_text, start = path.read_text().split()
        pid = int(pid_text)
        return pid if _start_time(pid) == start else None
    except (OSError, ValueError, IndexError):
        return None
