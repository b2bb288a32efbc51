"""QEMU microvm driver (AENV_DRIVER=qemu, never a default): a skeleton that boots and runs commands.

Each instance is one ``qemu-system-x86_64 -M microvm``: KVM where /dev/kvm opens, TCG (software
emulation) elsewhere or when AENV_QEMU_ACCEL=tcg. It boots the host's Debian kernel with the
initramfs of aenv/runtime/vmboot.py and these virtio-mmio devices, found in the guest by serial
and by name:

  - the guest bundle as a read-only disk (``aenv-guest``), mounted at /.aenv by stage one of the
    init (aenv/runtime/compat/aenv_vminit.c), which then runs stage two from it
    (aenv/guest/vminit.py);
  - each layer's ext4 image as a read-only disk (``aenv-l<i>``, lowest first; the layer is the
    image's ``upper/``); a plain-directory layer gets an image made from it (vmboot.ext4_of);
  - the sandbox's upper image as a writable disk (``aenv-upper``), taken off the host for the
    VM's lifetime (unmounted there: one kernel at a time writes a file system);
  - a virtio-serial port (``aenv.channel``) on a Unix socket pair with the node: stage two makes
    it the agent's stdin and stdout, so the agent and the channel are those of every driver.

Stage two overlays the layers under the upper, mounts /proc, /sys, /dev and the bundle, brings up
loopback (no other network: as runsc --network=none) and execs the agent as PID 1.

What this skeleton does not do yet, each refused with a clear error: checkpoints (pause, snapshot,
fork, template commits: CheckpointRefused, 422) and restores (ImageIncompatible, 422), so a node on
it boots sandboxes but cannot create from templates; doze. Limits: memory and vCPUs are the VM's
size (-m, -smp), the disk quota is the upper image's size; no CPU quota or host cgroup. After the
VM ends its upper stays unmounted on the host: the host never mounts a file system that a guest
kernel wrote (what keeping it would need: checking it first, or keeping uppers in the guest).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path

from aenv.errors import CheckpointRefused, ImageIncompatible, OperationTimeout, RuntimeFailure
from aenv.runtime import guestbundle, hostexec, vmboot
from aenv.runtime.base import Instance, Limits, NothingToChoose, OwnBase, RootfsSpec, TeardownOnKill, Usage
from aenv.runtime.gvisor import _guest_mount_point

log = logging.getLogger(__name__)

NAME = "qemu"
MARK = "qemu microvm (no checkpoints yet)"
NOT_YET = "not supported by the qemu driver yet"
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
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# A small, quiet boot: the console only for what goes wrong, no reboot (a panic ends QEMU), the
# CPU's random numbers trusted (the agent's Python asks for entropy at start), no probing of
# legacy keyboards and mice.
KERNEL_ARGS = (
    "console=ttyS0 quiet loglevel=4 panic=-1 reboot=t random.trust_cpu=on "
    "i8042.noaux i8042.nomux i8042.nopnp i8042.dumbkbd tsc=reliable no_timer_check"
)


def kvm_usable() -> bool:
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    os.close(fd)
    return True


def _drive(path: Path) -> str:
    return str(path).replace(",", ",,")  # QEMU's option syntax doubles a comma in a value


class QemuDriver(guestbundle.BundledGuests, TeardownOnKill, NothingToChoose):
    name = NAME
    own_base: OwnBase | None = None  # `base` is the node's debootstrapped Debian
    saves_epoll_tcp = True  # nothing is saved: nothing for the node to ask the agent first
    leaves_running = False
    restore_leaves_garbage = False
    image_mark = MARK

    def __init__(self, *, state_dir: Path, qemu: str = "qemu-system-x86_64", kernel: str = "", accel: str = "auto"):
        found = shutil.which(qemu)
        if found is None:
            raise RuntimeFailure(f"the qemu driver needs {qemu}: install Debian's qemu-system-x86 (scripts/install)")
        self.qemu = found
        self.kernel = vmboot.find_kernel(kernel)
        self.release = self.kernel.release
        if accel not in ("auto", "kvm", "tcg"):
            raise RuntimeFailure(f"AENV_QEMU_ACCEL must be auto, kvm or tcg, not {accel!r}")
        # auto: KVM if /dev/kvm opens and a kernel boots on it (a nested host may have one that
        # does not), decided at the first boot; TCG otherwise.
        self.accel = ("probe" if kvm_usable() else "tcg") if accel == "auto" else accel
        self._probing = asyncio.Lock()
        self.version = _qemu_version(found)
        self.tsc_khz = _host_tsc_khz()
        self.state_dir = state_dir
        self.bundles = state_dir / "qemu-instances"
        self.disks = state_dir / "qemu-disks"  # images of plain-directory layers and of guest bundles
        for d in (self.bundles, self.disks):
            d.mkdir(parents=True, exist_ok=True)
        self._init_guests(state_dir / "guest")  # built as for every driver, attached as a disk
        self._making: dict[Path, asyncio.Lock] = {}
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self._consoles: dict[str, deque[bytes]] = {}
        self._tails: dict[str, asyncio.Future[None]] = {}  # the readers of QEMU's output
        self.wakes = 0

    def info(self) -> dict[str, str]:
        return {
            "driver": NAME,
            "runsc": "none",
            "platform": f"qemu microvm ({self.accel})",
            "qemu": self.version,
            "kernel": self.release,
        }

    def remove_guest(self, key: str) -> None:
        super().remove_guest(key)
        (self.disks / f"guest-{key}.img").unlink(missing_ok=True)  # the bundle as the disk it was attached as

    def image_compatible(self, image_dir: Path) -> bool:
        return False  # it writes none and restores none yet

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

    # -- start ----------------------------------------------------------------------------------------
    async def boot(self, *, instance_id: str, rootfs: RootfsSpec, limits: Limits) -> Instance:
        if len(rootfs.layers) > MAX_LAYERS:
            count = len(rootfs.layers)
            raise RuntimeFailure(f"the qemu driver boots at most {MAX_LAYERS} layers yet; this sandbox has {count}")
        if rootfs.upper_disk is None:
            raise RuntimeFailure("the qemu driver needs the sandbox's upper as a disk image (not a plain directory)")
        if rootfs.mounts:
            raise RuntimeFailure("the qemu driver mounts no volumes yet")
        bundle = self.bundles / instance_id
        bundle.mkdir(parents=True, exist_ok=True)
        try:
            return await self._start(instance_id, rootfs, limits, bundle)
        except BaseException:
            await self._teardown(instance_id)
            raise

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

    async def _start(self, instance_id: str, rootfs: RootfsSpec, limits: Limits, bundle: Path) -> Instance:
        if self.accel == "probe":
            async with self._probing:
                if self.accel == "probe":
                    self.accel = "kvm" if await self._kvm_boots() else "tcg"
        guest = self.guest_bundle(rootfs.guest)
        guest_disk = await self._image_of(guest, self.disks / f"guest-{guest.name}.img")
        initramfs = await asyncio.to_thread(vmboot.ensure_initramfs, self.disks, self.kernel)
        layers = await self._layer_disks(rootfs)
        upper = rootfs.upper_disk
        assert upper is not None
        if os.path.ismount(rootfs.upper):
            (rootfs.upper / "work").mkdir(exist_ok=True)
            _guest_mount_point(rootfs.upper / "upper", rootfs.layers)
            await hostexec.run(["umount", str(rootfs.upper)], timeout=60)
        (bundle / "upper").write_text(str(rootfs.upper))
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
        host_end, guest_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = self._argv(instance_id, limits, append, guest_end.fileno(), initramfs)
        argv += ["-drive", f"id=guest,file={_drive(guest_disk)},format=raw,if=none,readonly=on"]
        argv += ["-device", "virtio-blk-device,drive=guest,serial=aenv-guest"]
        for i, (disk, _) in enumerate(layers):
            argv += ["-drive", f"id=l{i},file={_drive(disk)},format=raw,if=none,readonly=on"]
            argv += ["-device", f"virtio-blk-device,drive=l{i},serial=aenv-l{i}"]
        argv += ["-drive", f"id=upper,file={_drive(upper)},format=raw,if=none,cache=writeback"]
        argv += ["-device", "virtio-blk-device,drive=upper,serial=aenv-upper"]
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=(guest_end.fileno(),),
                start_new_session=True,
            )
        except OSError as exc:
            host_end.close()
            raise RuntimeFailure(f"cannot run {self.qemu}: {exc}", argv=argv) from exc
        finally:
            guest_end.close()
        self._procs[instance_id] = proc
        (bundle / "pid").write_text(f"{proc.pid} {_start_time(proc.pid)}")
        console: deque[bytes] = deque()
        self._consoles[instance_id] = console
        self._tails[instance_id] = asyncio.ensure_future(_keep_tail(proc, console))
        reader, writer = await asyncio.open_unix_connection(sock=host_end, limit=2**22)
        return Instance(instance_id, reader, writer, rootfs, limits, bundle, {"pid": str(proc.pid)})

    def _clock_args(self) -> list[str]:
        """Under TCG the guest's TSC runs at the host's, which no device of microvm's lets the kernel
        measure (its ACPI is hardware-reduced: no PIT); without being told, it waits forever for a
        timer it cannot calibrate. Under KVM, kvmclock tells it."""
        if self.accel == "kvm" or not self.tsc_khz:
            return []
        hz = _kernel_hz(self.kernel)  # and its delay loop, which it would calibrate for ~1 s
        return [f"tsc_early_khz={self.tsc_khz}", *([f"lpj={self.tsc_khz * 1000 // hz}"] if hz else [])]

    def _argv(self, instance_id: str, limits: Limits, append: str, channel_fd: int, initramfs: Path) -> list[str]:
        cpus = max(1, math.ceil(limits.cpu_count))
        kvm = self.accel == "kvm"
        accel = ["-accel", "kvm", "-cpu", "host"] if kvm else ["-accel", "tcg,thread=multi", "-cpu", "max"]
        # fmt: off
        return [
            self.qemu,
            "-name", f"aenv-{instance_id}",
            "-M", "microvm,x-option-roms=off",
            *accel,
            "-smp", str(cpus),
            "-m", f"{max(limits.memory_mb, 128)}M",
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
            "-serial", "stdio",
            "-kernel", str(self.kernel.path), "-initrd", str(initramfs), "-append", append,
            "-device", "virtio-serial-device,max_ports=2",
            "-chardev", f"socket,id=channel,fd={channel_fd}",
            "-device", f"virtserialport,chardev=channel,name={PORT}",
        ]
        # fmt: on

    def console(self, instance: Instance) -> str:
        """The tail of the guest's console: what the kernel and the init said (errors only, quiet)."""
        return b"".join(self._consoles.get(instance.id, ())).decode(errors="replace")

    # -- not yet ------------------------------------------------------------------------------------
    async def restore(self, *, instance_id: str, rootfs: RootfsSpec, limits: Limits, image_dir: Path) -> Instance:
        raise ImageIncompatible(f"restoring a memory image is {NOT_YET} (it boots sandboxes only)")

    async def checkpoint(self, instance: Instance, *, image_dir: Path, leave_running: bool) -> None:
        raise CheckpointRefused(f"checkpoints (pause, snapshot, fork) are {NOT_YET}")

    async def checkpoint_running(
        self, instance: Instance, *, image_dir: Path, while_stopped: Callable[[], Awaitable[None]]
    ) -> None:
        raise CheckpointRefused(f"checkpoints (pause, snapshot, fork) are {NOT_YET}")

    def doze(self, instance: Instance) -> bool:
        return False

    def wake(self, instance: Instance) -> None:
        return None

    def dozing(self, instance: Instance) -> bool:
        return False

    # -- the rest of the contract ---------------------------------------------------------------------
    async def _teardown(self, instance_id: str) -> None:
        bundle = self.bundles / instance_id
        proc = self._procs.pop(instance_id, None)
        self._consoles.pop(instance_id, None)
        pid = proc.pid if proc is not None else _read_pid(bundle / "pid")
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)  # QEMU is its session's leader
        if proc is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), KILL_TIMEOUT)
        tail = self._tails.pop(instance_id, None)
        if tail is not None:
            tail.cancel()
        await asyncio.to_thread(shutil.rmtree, bundle, True)

    async def usage(self, instance: Instance) -> Usage:
        proc = self._procs.get(instance.id)
        cpu, rss, threads = 0.0, 0, 0
        if proc is not None:
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{proc.pid}/stat", "rb") as f:
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
            if path.is_dir() and path.name not in keep and path.name not in self._procs:
                await self._teardown(path.name)
                removed.append(path.name)
        for src in self.disks.glob("layer-*.src"):  # images of directory layers that are gone
            with contextlib.suppress(OSError):
                if not Path(src.read_text()).is_dir():
                    src.with_suffix(".img").unlink(missing_ok=True)
                    src.unlink()
        return removed


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
