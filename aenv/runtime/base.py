"""The isolation-driver contract: boot, checkpoint, restore, kill, a channel, usage.

Pause = checkpoint (stopping) ; snapshot = checkpoint that leaves the source running (or, on a
runtime that cannot, checkpoint + restore of the source) ; fork = that checkpoint + N restores ;
create-from-template = restore of the template's image.
Nothing above this module knows which driver runs: gvisor.py (runsc, the default), fake.py (host
processes, for tests) and qemu.py (a QEMU microvm per sandbox) implement it, each
chosen by AENV_DRIVER; runsc's settings (AENV_RUNSC*) concern gvisor.py alone.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-sandbox resource limits, all enforced by the driver."""

    cpu_count: float = 1.0
    memory_mb: int = 1024
    nproc: int = 256  # processes+threads of one uid inside the sandbox (fork-bomb guard)
    disk_mb: int = 2048  # bytes the sandbox may write to its filesystem


@dataclass(frozen=True, slots=True)
class RootfsSpec:
    """A root filesystem described, not made: read-only layers (lowest first) under one writable
    upper, and the guest bundle as one more read-only layer at /.aenv. Each driver materialises it
    its own way: gVisor and the fake runtime overlay the directories on the host and bind the
    bundle's directory; a VM attaches the layers' and the upper's disk images as block devices
    (a plain-directory layer gets an image made from it) and overlays them inside the guest."""

    layers: tuple[Path, ...]  # each layer's directory (an overlayfs lower)
    upper: Path  # the directory that holds ``upper/`` and ``work/``
    # The guest bundle the instance's agent was started from. A restored agent is that very
    # process, so it must see the same bundle at /.aenv; "" means the current one.
    guest: str = ""
    # The ext4 image each layer is the ``upper/`` directory of (None: a plain directory), and the
    # upper's: what a VM attaches. Empty when the node did not say (a driver must then not need them).
    layer_disks: tuple[Path | None, ...] = ()
    upper_disk: Path | None = None
    # Host directories bound read-write at these absolute sandbox paths (volumes): shared live
    # with whatever else mounts them, never part of the upper, a checkpoint or a commit.
    mounts: tuple[tuple[Path, str], ...] = ()


@dataclass(slots=True)
class Usage:
    cpu_seconds: float = 0.0
    memory_bytes: int = 0
    memory_limit_bytes: int = 0
    pids: int = 0  # host tasks (the sentry's threads, and stubs under the ptrace platform)
    pids_limit: int = 0  # where the host stops the sandbox (0: no limit known)
    oom: bool = False  # the memory limit was hit


@dataclass(slots=True)
class Instance:
    """A running sandbox instance as its driver sees it."""

    id: str
    # The agent's channel (aenv/channel): any byte stream the runtime carries into the guest. Two
    # host pipes that are the agent's stdin and stdout under gVisor and the fake runtime; a Unix
    # socket to a virtio-serial port, which the guest's init makes the agent's stdin and stdout,
    # under QEMU. The agent is the same on all of them.
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    rootfs: RootfsSpec
    limits: Limits
    state_dir: Path
    extra: dict[str, str] = field(default_factory=dict)


OWN_BASE = "(its runtime's own)"  # ends the description of a `base` a driver made itself


@dataclass(frozen=True)
class OwnBase:
    """A `base` template a driver makes itself instead of the node's debootstrapped Debian (the
    fake runtime: the host's system). ``description`` ends with OWN_BASE; ``write`` fills a new
    layer directory with its root file system."""

    description: str
    write: Callable[[Path], None]


class Driver(Protocol):
    name: str
    own_base: OwnBase | None  # None: the node debootstraps Debian for `base`
    # False when the runtime cannot checkpoint a TCP socket that an epoll set watches; the node
    # then asks the agent first (sys.checkpointable), because a failed save kills the instance.
    saves_epoll_tcp: bool
    # True when a checkpoint can leave the instance running (snapshot and fork then restore only
    # the copies); False: the instance stops and the source is restored from its own image.
    leaves_running: bool
    # True when a restore (or a leave-running checkpoint) leaves the sentry a heap of garbage the
    # agent should make it give back once quiet (aenv/guest/sentry.py); False: that costs memory.
    restore_leaves_garbage: bool
    # True when an image fixes the machine's size (a VM's RAM and vCPUs): every restore of it has
    # the size it was saved at, so a template's snapshot is taken at its sandboxes' size.
    sized_by_image: bool
    wakes: int  # how many times a dozing instance was thawed (aenv_doze_wakes)

    @property
    def boot_timeout(self) -> float:
        """Seconds a fresh boot may take to its agent's hello (and a restore to its thaw): a VM
        whose CPU is emulated (QEMU's TCG) boots its kernel in seconds, on a loaded host in tens."""
        ...

    @property
    def image_mark(self) -> str:
        """Names the runtime, version and options that write this node's checkpoint images."""
        ...

    def info(self) -> dict[str, str]:
        """The runtime's name, version and options (e.g. runsc's platform), as the node reports them."""
        ...

    def calibration(self) -> dict[str, Any] | None:
        """How the runtime chose its options on this host (runsc's platform), with what it
        measured; None when it had nothing to choose."""
        ...

    async def prepare(self, limits: Limits) -> None:
        """Ready the runtime before the node's first sandbox (``limits``: a default sandbox's)."""
        ...

    def image_compatible(self, image_dir: Path) -> bool:
        """Whether this runtime can restore the image (another version may have written it)."""
        ...

    def image_preferred(self, image_dir: Path) -> bool:
        """Whether the image runs as this node runs new sandboxes (runsc: on its platform);
        a compatible image that is not is still restored, on the options it was written with."""
        ...

    def guest_key(self) -> str:
        """The id of the guest bundle that fresh boots use now."""
        ...

    def guest_path(self, key: str) -> Path:
        """Where the guest bundle ``key`` lives on this node (present or not): the snapshot
        repository commits it with the images that need it and fetches it back."""
        ...

    def guest_keys(self) -> set[str]:
        """The guest bundles on this node."""
        ...

    def remove_guest(self, key: str) -> None:
        """Remove a bundle no record names any more (an agent upgrade leaves the old one); the
        caller keeps the current one, which fresh boots use."""
        ...

    async def boot(self, *, instance_id: str, rootfs: RootfsSpec, limits: Limits) -> Instance:
        """Start a fresh instance whose first process is the guest agent."""
        ...

    async def checkpoint(self, instance: Instance, *, image_dir: Path, leave_running: bool) -> None:
        """Save the instance's memory and process state to ``image_dir``. A driver that cannot
        raises CheckpointRefused (422 to clients, the instance left as it was)."""
        ...

    async def checkpoint_running(
        self, instance: Instance, *, image_dir: Path, while_stopped: Callable[[], Awaitable[None]]
    ) -> None:
        """Checkpoint and leave the instance running (only when ``leaves_running``); it stays stopped
        until ``while_stopped`` returns, so what is on its disk then is what the image expects."""
        ...

    async def restore(self, *, instance_id: str, rootfs: RootfsSpec, limits: Limits, image_dir: Path) -> Instance:
        """Start an instance from ``image_dir``; one image may be restored any number of times.
        An image this driver cannot restore (another runtime's, or none it can read) raises
        ImageIncompatible before anything starts."""
        ...

    async def kill(self, instance: Instance) -> None:
        """Stop the instance and release everything it held on the host. Idempotent."""
        ...

    async def halt(self, instance: Instance) -> None:
        """Stop the instance for good and release its root filesystem, as soon as can be: what it
        wrote may be sealed then. The rest of its teardown is ``kill``'s, which must follow."""
        ...

    async def usage(self, instance: Instance) -> Usage: ...

    def doze(self, instance: Instance) -> bool:
        """Stop every host task of an idle instance, so that it takes no CPU at all; False when
        the host cannot. The node dozes only an instance with nothing running in it but its agent
        and nothing in flight on its channel (aenv/node/doze.py)."""
        ...

    def wake(self, instance: Instance) -> None:
        """Undo :meth:`doze` (nothing if not dozing). Runs before every write to the instance's
        channel, and before every runtime operation on it, so nothing ever waits on a dozing
        instance."""
        ...

    def dozing(self, instance: Instance) -> bool: ...

    async def host_tasks(self, instance: Instance) -> tuple[int, int]:
        """(host tasks now, where the host stops the sandbox; 0 if unknown): what the node looks
        at every second for every sandbox, so cheaper than ``usage``."""
        ...

    async def cleanup_orphans(self, keep: set[str]) -> list[str]:
        """Remove instances left over from an earlier process, except those in ``keep``."""
        ...


class NothingToChoose:
    """A driver with no options to choose per host (the fake runtime, QEMU): it prepares nothing,
    and an image it can restore at all is as good as any."""

    def calibration(self) -> dict[str, Any] | None:
        return None

    async def prepare(self, limits: Limits) -> None:
        return None

    def image_compatible(self, image_dir: Path) -> bool:
        raise NotImplementedError

    def image_preferred(self, image_dir: Path) -> bool:
        return self.image_compatible(image_dir)


class TeardownOnKill:
    """``kill`` and ``halt`` of a driver whose instance ends with its process tree at once (the fake
    runtime's processes, a QEMU process): the agent's pipe closed, then ``_teardown``. A halt has
    nothing faster to do, and the kill that follows it finds nothing left."""

    async def _teardown(self, instance_id: str) -> None:
        raise NotImplementedError

    async def kill(self, instance: Instance) -> None:
        instance.writer.close()
        await self._teardown(instance.id)

    async def halt(self, instance: Instance) -> None:
        await self.kill(instance)


async def agent_pipes(from_guest: int, to_guest: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """The host's ends of an instance's agent channel, as streams (the pipes' descriptors, which
    the streams then own)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**22)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(from_guest, "rb", 0))
    transport, protocol = await loop.connect_write_pipe(
        lambda: asyncio.StreamReaderProtocol(asyncio.StreamReader()), os.fdopen(to_guest, "wb", 0)
    )
    return reader, asyncio.StreamWriter(transport, protocol, None, loop)
