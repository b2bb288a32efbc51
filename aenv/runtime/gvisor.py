"""gVisor driver: runsc with --network=none, --overlay2=none and a host overlayfs root.

The agent's channel is the container's stdin/stdout: two host pipes that runsc hands to the
sandbox and re-attaches at restore, so one image restores onto fresh pipes any number of times.

A checkpoint image restores only under the runsc that wrote it: each image holds a mark naming
that runsc and its platform (``aenv-runtime``), and a restore of an image another runsc or platform
wrote is refused before runsc sees it (images without a mark were written by runsc 20221219 on
ptrace, the only ones before marks).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aenv.config import MAX_NPROC
from aenv.errors import (
    CHECKPOINT_REFUSAL,
    AenvError,
    CheckpointRefused,
    ImageIncompatible,
    InvalidRequest,
    RuntimeFailure,
    snippet,
)
from aenv.runtime import cgroups, guestbundle, hostexec, pidfds, platforms
from aenv.runtime.base import Instance, Limits, OwnBase, RootfsSpec, Usage, agent_pipes
from aenv.storage.confined import View, dir_at, open_root
from aenv.storage.datadir import SANDBOX_DIR, sandbox_dir

log = logging.getLogger(__name__)

CGROUP_ROOT = cgroups.ROOT
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PROBE_WORK = "/work"  # where a platform probe's sandbox writes (a host directory of its bundle)
CGROUP_PARENT = "aenv"
BOOT_ID_DIR = "/proc/sys/kernel/random"
HALT_TIMEOUT = 10.0  # seconds for a killed sandbox's processes to exit before the slow way
CONTROL_TIMEOUT = 30.0  # a call to a sandbox's control socket (a pause waits for its tasks to stop)
CONTROL_MAX_ANSWER = 64 * 1024
MOUNT_OPTIONS_MAX = 4000  # of the page the kernel accepts, with room to spare
IMAGE_MARK = "aenv-runtime"  # in each checkpoint image: the runsc that wrote it
MARK_MAX = 256
LEGACY_RUNSC = "runsc 0.0~20221219.0 ptrace"  # what wrote the images that have no mark
# The first runsc measured (Debian bookworm-backports) whose `checkpoint --leave-running` keeps
# the container running and which saves TCP sockets that an epoll set watches; 20221219 does
# neither (its leave-running is a stop and a restore of the whole sandbox).
MODERN_RUNSC = 20240729
CAPS = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_RAW",
    "CAP_SYS_CHROOT",
    "CAP_MKNOD",
    "CAP_AUDIT_WRITE",
    "CAP_SETFCAP",
]


# Host tasks an idle sandbox holds under ptrace: runsc's sandbox process (~23 threads), its gofer
# (~10) and the stubs of the agent's threads (~4 processes of 3): measured by bench.density.
TASKS_PER_IDLE_SANDBOX = 50


def host_tasks_limit(nproc: int) -> int:
    """The sandbox's host pids cgroup: a backstop that stops the whole sandbox when hit.

    It counts the sentry's threads and, under the ptrace platform, a stub process per guest
    process with a thread per sentry thread that ran it, kept for reuse after the process exits:
    a user at its RLIMIT_NPROC keeps growing it (see aenv/guest/runaway.py, which the node uses
    to stop such a user first). Whatever the limits asked for, one sandbox gets at most a quarter
    of the host's tasks, so no sandbox can starve the node or its neighbours of processes."""
    return min(max(8192, nproc * 32), _host_tasks() // 4)


def all_sandboxes_tasks_limit() -> int:
    """The host tasks every sandbox together may hold (the pids cgroup that holds them all): half
    of the host's. A contained fork bomb leaves its sandbox thousands of stubs until it is next
    restored, and a root bomb may take its quarter: a few sandboxes running one program (a
    rollout's forks) took every pid of a host otherwise. Past it a sandbox that needs a thread
    stops, as at its own limit; the host keeps half."""
    return _host_tasks() // 2


def _host_tasks() -> int:
    """How many tasks the host can have: its pid space, or its thread limit if lower (a 24 GiB
    host has pid_max 4194304 and threads-max 192730)."""
    return min(_kernel_limit("pid_max"), _kernel_limit("threads-max"))


def _kernel_limit(name: str) -> int:
    try:
        return int(Path(f"/proc/sys/kernel/{name}").read_text())
    except (OSError, ValueError):
        return 32768  # pid_max's default, and lower than any host's threads-max


def limit_all_sandboxes(max_sandboxes: int = 0) -> None:
    """Cap the pids cgroup every sandbox's is made in (runsc makes the parent on first use), and
    say so when that cap holds fewer idle sandboxes than the node admits."""
    parent = CGROUP_ROOT / "pids" / CGROUP_PARENT
    limit = all_sandboxes_tasks_limit()
    try:
        parent.mkdir(exist_ok=True)
        (parent / "pids.max").write_text(str(limit))
    except OSError as exc:  # not root, or no cgroup v1 pids controller: runsc would fail as well
        log.warning("cannot limit the host tasks of all sandboxes in %s: %s", parent, exc)
    if limit // TASKS_PER_IDLE_SANDBOX < max_sandboxes:
        log.warning(
            "this host's tasks (pid_max %d, threads-max %d) hold about %d idle sandboxes, fewer than "
            "AENV_MAX_SANDBOXES (%d): raise kernel.pid_max to 4194304 (scripts/install does)",
            _kernel_limit("pid_max"),
            _kernel_limit("threads-max"),
            limit // TASKS_PER_IDLE_SANDBOX,
            max_sandboxes,
        )


def _cgroup_value(instance_id: str, controller: str, name: str) -> int:
    """An instance's cgroup counter (0 when unreadable, and for pids.max's "max")."""
    try:
        with open(CGROUP_ROOT / controller / CGROUP_PARENT / instance_id / name, "rb") as f:
            return int(f.read(64).split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _freezer(instance_id: str) -> tuple[Path, bytes, bytes] | None:
    """An instance's freezer file and what freezes and thaws it: cgroup v1's freezer controller,
    or v2's cgroup.freeze; None when the host has neither for it."""
    v1 = CGROUP_ROOT / "freezer" / CGROUP_PARENT / instance_id / "freezer.state"
    if v1.exists():
        return v1, b"FROZEN", b"THAWED"
    v2 = CGROUP_ROOT / CGROUP_PARENT / instance_id / "cgroup.freeze"
    if v2.exists():
        return v2, b"1", b"0"
    return None


def _set_freezer(instance_id: str, *, frozen: bool) -> bool:
    """Freeze or thaw every host task of the instance (its sentry, stubs and gofer): one write,
    which returns at once (the kernel stops the tasks as they next leave the kernel)."""
    found = _freezer(instance_id)
    if found is None:
        return False
    path, freeze, thaw = found
    try:
        with open(path, "wb", buffering=0) as f:
            f.write(freeze if frozen else thaw)
    except OSError as exc:
        log.warning("could not %s instance %s: %s", "freeze" if frozen else "thaw", instance_id, exc)
        return False
    return True


CONTROLLERS = ("memory", "cpu", "cpuacct", "pids", "cpuset", "freezer", "blkio", "devices")
PROBE_ID = re.compile(r"probe-.+-(\d+)(?:-restored)?")  # a probe's sandbox id names its node's pid


def _cgroup_dirs(instance_id: str) -> list[Path]:
    """An instance's cgroups: one a cgroup v1 controller, or its one v2 group."""
    candidates = [CGROUP_ROOT / c / CGROUP_PARENT / instance_id for c in CONTROLLERS]
    return [p for p in (*candidates, CGROUP_ROOT / CGROUP_PARENT / instance_id) if p.is_dir()]


async def _remove_cgroups(instance_id: str) -> bool:
    """Remove an instance's cgroups, killing what still runs in them first (a sandbox whose runsc
    died before it could, a probe of a node killed while it calibrated)."""
    if await cgroups.remove(_cgroup_dirs(instance_id)):
        return True
    log.warning("instance %s: its cgroups outlived its tasks", instance_id)
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # there, someone else's
    return True


async def sweep_dead_probes() -> list[str]:
    """Remove what calibration probes of nodes no longer running left in the shared cgroup tree
    (their state and bundles live in that node's own data directory, cleaned at its next start)."""
    names = {p.name for c in CONTROLLERS for p in _children(CGROUP_ROOT / c / CGROUP_PARENT)}
    names |= {p.name for p in _children(CGROUP_ROOT / CGROUP_PARENT)}
    swept = []
    for name in sorted(names):
        match = PROBE_ID.fullmatch(name)
        if match and not _alive(int(match.group(1))):
            _set_freezer(name, frozen=False)  # frozen tasks die of SIGKILL only once thawed
            await _remove_cgroups(name)
            swept.append(name)
    return swept


def _children(parent: Path) -> list[Path]:
    try:
        return [p for p in parent.iterdir() if p.is_dir()]
    except OSError:
        return []


def _runsc_files(runsc_root: Path, instance_id: str) -> list[Path]:
    """runsc's own files of an instance in its root: a lock, a state file, a control socket."""
    try:
        names = os.listdir(runsc_root)
    except OSError:
        return []
    own = (f"{instance_id}_sandbox:", f"runsc-{instance_id}.sock")
    return [runsc_root / n for n in names if n.startswith(own) and not (runsc_root / n).is_dir()]


def _runsc_of(instance_id: str) -> Callable[[list[bytes]], bool]:
    """Whether a command line is a runsc process (sandbox, gofer) of ``instance_id``."""
    return lambda args: (
        os.path.basename(args[0]).startswith(b"runsc") and any(instance_id.encode() in a for a in args[1:])
    )


def _guest_mount_point(upper: Path, layers: Sequence[Path]) -> None:
    """Where the guest bundle is mounted, made a directory in the upper unless the layers already
    have one there: whatever else they have (an image's link to a host path) is hidden from the
    sandbox and never looked at on the host, where the merged root file system would follow it.
    Left alone when it is a directory, so a committed upper holds no entry of its own for it (a
    rebuild of unchanged steps reuses their layers)."""
    if View(layers, top=upper).is_dir_here(guestbundle.GUEST_MOUNT):
        return
    fd = open_root(upper)
    try:
        point = dir_at(fd, guestbundle.GUEST_MOUNT.lstrip("/"))
        os.fchmod(point, SANDBOX_DIR)  # the node's umask is not its users'
        os.close(point)
    finally:
        os.close(fd)


def _volume_mount_points(upper: Path, layers: Sequence[Path], paths: Sequence[str]) -> None:
    """Where volumes are mounted, made directories (0755) in the upper where the layers have none:
    runsc would make them with the node's umask, out of reach of the sandbox's users. Links are
    followed as the sandbox sees them, never on the host."""
    if not paths:
        return
    view = View(layers, top=upper)
    for path in paths:
        try:
            view.make_dir(path)
        except (OSError, InvalidRequest) as exc:
            raise RuntimeFailure(f"volume mount path {path}: {exc}") from None


@dataclass(frozen=True, slots=True)
class RunscVersion:
    """What `runsc --version` says, and what this driver makes of it."""

    version: str  # "0.0~20240729.0" (Debian), "release-20240729.0" (upstream); "" if it did not say

    @classmethod
    def of(cls, runsc: str) -> RunscVersion:
        try:
            out = subprocess.run([runsc, "--version"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("cannot ask %s its version: %s", runsc, exc)
            return cls("")
        first = out.splitlines()[0] if out else ""
        return cls(first.removeprefix("runsc version").strip()[:100])

    @property
    def date(self) -> int:
        """Its release date (20240729), 0 when the version names none (a development build)."""
        found = re.search(r"(20\d{6})", self.version)
        return int(found.group(1)) if found else 0

    @property
    def modern(self) -> bool:
        """At least MODERN_RUNSC, or a build that names no date (taken to be recent)."""
        return self.date == 0 or self.date >= MODERN_RUNSC

    @property
    def mark(self) -> str:
        """How its checkpoint images' marks name it (the platform follows)."""
        return f"runsc {self.version or 'unknown'}"


def image_mark(image_dir: Path) -> str:
    """The runsc that wrote a checkpoint image. The image may come from a repository others write:
    the mark is read only as a small regular file, never through a link."""
    try:
        fd = os.open(image_dir / IMAGE_MARK, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return LEGACY_RUNSC
    except OSError:
        return "an unreadable mark"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "an unreadable mark"
        text = os.read(fd, MARK_MAX + 1).decode("utf-8", "replace").strip()
    finally:
        os.close(fd)
    return snippet(text, 120) if text else LEGACY_RUNSC


class GVisorDriver(guestbundle.BundledGuests):
    name = "gvisor"
    own_base: OwnBase | None = None  # `base` is the node's debootstrapped Debian
    boot_timeout = 30.0
    sized_by_image = False  # limits are the host's cgroups, set at every restore

    def __init__(
        self,
        *,
        state_dir: Path,
        runsc: str = "runsc",
        platform: str = platforms.AUTO,
        debug: bool = False,
        max_sandboxes: int = 0,
        flags: Sequence[str] = (),
        calibration: Path | None = None,
        cpu_limit: str = "share",
    ) -> None:
        self.state_dir = state_dir
        self.runsc = runsc
        # The platform new sandboxes boot on: "auto" until prepare() has chosen (aenv/runtime/platforms.py).
        self.platform = platform
        self.choice = platforms.Choice(platform, "setting")
        self.calibration_file = calibration or state_dir / "runsc-platform.json"
        self.debug = debug
        self.cpu_limit = cpu_limit
        self.flags = tuple(flags)  # an operator's extra global flags, after aenv's own (the last wins)
        self.version = RunscVersion.of(runsc)
        # runsc 20221219 cannot save a TCP socket an epoll set watches ("endpoint still has waiters
        # upon save", then the sandbox exits): the node asks the agent first and refuses.
        self.saves_epoll_tcp = self.version.modern
        # A checkpoint that leaves the sandbox running (snapshot, fork) instead of a stop + restore.
        self.leaves_running = self.version.modern
        # 20221219's restores left ~30 MiB of decoding garbage in the sentry's heap until its GC
        # two minutes later; 20240729's images are not compressed and leave little: pushing buffers
        # through the sentry to force its GC there kept 4-6 MiB more (and cost ~50 ms of CPU).
        self.restore_leaves_garbage = not self.version.modern
        self.runsc_root = state_dir / "runsc"
        self.bundles = state_dir / "instances"
        for d in (self.runsc_root, self.bundles):
            d.mkdir(parents=True, exist_ok=True)
        # runsc 20221219 refuses statx(AT_NO_AUTOMOUNT): its bundles' shim drops the flag.
        self._init_guests(state_dir / "guest", statx_shim=not self.version.modern)
        self._pids_max: dict[str, int] = {}  # instance id -> its pids cgroup's limit
        self._platform_of: dict[str, str] = {}  # instance id -> its platform, when not the node's
        self._dozing: set[str] = set()  # instances frozen while idle (see doze)
        self.wakes = 0  # how many times a dozing instance was thawed
        limit_all_sandboxes(max_sandboxes)

    def info(self) -> dict[str, str]:
        """What the node reports of its runtime (/health, /metrics, its cluster entry)."""
        return {
            "driver": self.name,
            "runsc": self.version.version or "unknown",
            "platform": self.platform,
            "platformBy": self.choice.by,
        }

    # -- the platform -----------------------------------------------------------------------------
    def calibration(self) -> dict[str, Any] | None:
        return self.choice.report()

    async def prepare(self, limits: Limits) -> None:
        """Choose the platform new sandboxes boot on: the setting's, or for "auto" the fastest this
        host runs a default sandbox's work on (measured once per host, kept in ``calibration_file``)."""
        swept = await sweep_dead_probes()
        if swept:
            log.info("removed the cgroups of %d probes of nodes no longer running", len(swept))
        key = platforms.host_key(
            runsc_version=self.version.version, flags=self.flags, cpu_count=limits.cpu_count, cpu_limit=self.cpu_limit
        )
        self.choice = await platforms.choose(
            self.platform,
            probe=lambda name: self.probe(name, limits),
            cache=self.calibration_file,
            key=key,
        )
        self.platform = self.choice.platform
        log.info("runsc platform: %s (%s)", self.platform, self.choice.by)

    def mark_of(self, platform: str) -> str:
        """What a checkpoint image written on ``platform`` says of its writer."""
        return " ".join((self.version.mark, platform, *self.flags))

    @property
    def image_mark(self) -> str:
        """The mark of images this node writes by default (its platform's)."""
        return self.mark_of(self.platform)

    def _image_platform(self, image_dir: Path) -> str | None:
        """The platform to restore an image on: the one that wrote it (an image restores under
        the runsc and the platform that wrote it; a ptrace image restored under systrap hangs),
        when this runsc and host run it; None when not."""
        written_by = image_mark(image_dir)
        usable = [self.platform, *(p for p in platforms.KNOWN if p != self.platform and self._runs(p))]
        return next((p for p in usable if self.mark_of(p) == written_by), None)

    def _runs(self, platform: str) -> bool:
        """Whether this host runs sandboxes on ``platform`` (a probe said so, or nothing says not:
        ptrace and systrap run wherever runsc does; kvm only with a /dev/kvm a probe booted)."""
        for trial in self.choice.trials:
            if trial.platform == platform:
                return trial.usable
        return platform != "kvm" or platforms.kvm_available()

    async def probe(self, platform: str, limits: Limits) -> platforms.Trial:
        """A short, typical piece of agent work in a sandbox on ``platform`` with ``limits``, and a
        checkpoint and restore of a running one: how fast, and whether it works at all."""
        trial = platforms.Trial(platform)
        probe_id = f"probe-{platform}-{os.getpid()}"
        restored = f"{probe_id}-restored"
        self._platform_of.update({probe_id: platform, restored: platform})
        bundle = self.bundles / probe_id
        work = bundle / "work"
        try:
            work.mkdir(parents=True, exist_ok=True)
            spec = self._probe_spec(
                probe_id, limits, [os.path.realpath(sys.executable), "-c", platforms.PROBE, PROBE_WORK]
            )
            (bundle / "config.json").write_text(json.dumps(spec))
            argv = [*self._global(probe_id), "run", "--bundle", str(bundle), probe_id]
            out = await hostexec.run(argv, timeout=platforms.PROBE_TIMEOUT)
            trial.seconds = {k: float(v) for k, v in json.loads(out.strip().splitlines()[-1]).items()}
            await self._teardown(probe_id)
            self._platform_of[probe_id] = platform  # the teardown forgot it; the checkpoint probe reuses the id
            trial.checkpoints = await self._probe_checkpoint(probe_id, restored, limits)
        except (AenvError, OSError, ValueError, IndexError, AttributeError) as exc:
            trial.error = snippet(str(exc), 300)
        finally:
            for instance_id in (probe_id, restored):
                await self._teardown(instance_id)
        return trial

    async def _probe_checkpoint(self, probe_id: str, restored: str, limits: Limits) -> bool:
        bundle = self.bundles / probe_id
        image = bundle / "image"
        (bundle / "work").mkdir(parents=True, exist_ok=True)
        (bundle / "config.json").write_text(json.dumps(self._probe_spec(probe_id, limits, ["/bin/sleep", "60"])))
        timeout = platforms.PROBE_TIMEOUT
        log_file = bundle / "probe.log"
        quiet = asyncio.subprocess.DEVNULL  # a detached sandbox keeps its stdio: a pipe would never end
        run = [*self._global(probe_id), "run", "--detach", "--bundle", str(bundle), probe_id]
        await hostexec.run(run, timeout=timeout, stdout=quiet, stderr_file=log_file)
        checkpoint = [*self._global(probe_id), "checkpoint", "--image-path", str(image), probe_id]
        await hostexec.run(checkpoint, timeout=timeout)
        await hostexec.run([*self._global(probe_id), "delete", "--force", probe_id], timeout=timeout, check=False)
        restore = [*self._global(restored), "restore", "--detach", "--image-path", str(image), "--bundle", str(bundle)]
        await hostexec.run([*restore, restored], timeout=timeout, stdout=quiet, stderr_file=log_file)
        state = json.loads(await hostexec.run([*self._global(restored), "state", restored], timeout=timeout))
        return isinstance(state, dict) and state.get("status") == "running"

    def _probe_spec(self, probe_id: str, limits: Limits, args: list[str]) -> dict[str, Any]:
        """A probe sandbox: the host's root read-only (its python3, its tools), a host directory
        at PROBE_WORK as a sandbox's upper is, and a default sandbox's cgroup limits."""
        spec = self._spec(probe_id, limits, "")
        spec["process"].update(args=args, env=[f"PATH={PATH}"])
        spec["root"] = {"path": "/", "readonly": True}
        work = str(self.bundles / probe_id / "work")
        spec["mounts"] = [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmp", "options": ["nosuid", "nodev"]},
            {"destination": PROBE_WORK, "type": "bind", "source": work, "options": ["rbind", "rw"]},
        ]
        return spec

    # -- helpers ----------------------------------------------------------------------------------
    def _global(self, instance_id: str | None = None) -> list[str]:
        # --overlay2=none: newer runsc put a memory-backed overlay over the root by default; the
        # sandbox's writes belong in its upper on the host (its disk quota, snapshots, commits).
        platform = self._platform_of.get(instance_id or "", self.platform)
        # No platform until one is chosen (a driver only cleaning up): runsc's own state says.
        chosen = [f"--platform={platform}"] if platform != platforms.AUTO else []
        argv = [self.runsc, "--root", str(self.runsc_root), *chosen, "--network=none", "--overlay2=none"]
        argv += self.flags
        if self.debug and instance_id:
            argv += ["--debug", f"--debug-log={self.bundles / instance_id / 'runsc.log'}"]
        return argv

    def _cpu(self, cpus: float) -> dict[str, int]:
        """A sandbox's CPU: that many cores' weight against its busy neighbours, and under "cap"
        no more than that many cores' time. The cap charges gVisor's own kernel work (the Sentry,
        systrap's stubs) to the sandbox, and its quota throttled agent work by ~25% on a host with
        idle cores (docs/performance.md)."""
        cpu = {"shares": max(2, int(cpus * 1024))}
        if self.cpu_limit == "cap":
            cpu.update(quota=int(cpus * 100_000), period=100_000)
        return cpu

    def _spec(self, instance_id: str, limits: Limits, guest: str) -> dict[str, Any]:
        nproc = max(limits.nproc, 64)
        return {
            "ociVersion": "1.0.2",
            "process": {
                "terminal": False,
                "user": {"uid": 0, "gid": 0},
                "args": guestbundle.agent_argv(),
                "env": [f"PATH={PATH}", *guestbundle.agent_env()],
                "cwd": "/",
                "capabilities": {k: CAPS for k in ("bounding", "effective", "permitted")},
                "rlimits": [
                    # The agent's own, kept through every restore; each command gets the sandbox's.
                    {"type": "RLIMIT_NPROC", "hard": MAX_NPROC, "soft": MAX_NPROC},
                    {"type": "RLIMIT_NOFILE", "hard": 65536, "soft": 65536},
                ],
                "noNewPrivileges": False,
            },
            "root": {"path": "rootfs", "readonly": False},
            "hostname": "sandbox",
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc"},
                {
                    "destination": "/sys",
                    "type": "sysfs",
                    "source": "sysfs",
                    "options": ["nosuid", "noexec", "nodev", "ro"],
                },
                {
                    "destination": "/dev/shm",
                    "type": "tmpfs",
                    "source": "shm",
                    "options": ["nosuid", "nodev", "mode=1777"],
                },
                {
                    # gVisor's /proc has no kernel/random/boot_id; the agent writes one here at each
                    # boot. A tmpfs is the sandbox's memory: checkpoints keep it, nothing on the host
                    # backs it, and the host never reads it.
                    "destination": BOOT_ID_DIR,
                    "type": "tmpfs",
                    "source": "boot-id",
                    "options": ["nosuid", "noexec", "nodev", "mode=0555", "size=64k"],
                },
                {
                    "destination": guestbundle.GUEST_MOUNT,
                    "type": "bind",
                    "source": str(self.guest_bundle(guest)),
                    "options": ["rbind", "ro"],
                },
            ],
            "linux": {
                "cgroupsPath": f"/{CGROUP_PARENT}/{instance_id}",
                "resources": {
                    "memory": {"limit": limits.memory_mb * 2**20, "swap": limits.memory_mb * 2**20},
                    "cpu": self._cpu(limits.cpu_count),
                    "pids": {"limit": host_tasks_limit(nproc)},
                },
                "namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount", "network")],
            },
        }

    async def _mount_rootfs(self, bundle: Path, rootfs: RootfsSpec) -> Path:
        target = bundle / "rootfs"
        target.mkdir(parents=True, exist_ok=True)
        upper, work = rootfs.upper / "upper", rootfs.upper / "work"
        if not upper.is_dir():
            sandbox_dir(upper)
        work.mkdir(parents=True, exist_ok=True)
        _guest_mount_point(upper, rootfs.layers)
        _volume_mount_points(upper, rootfs.layers, [path for _, path in rootfs.mounts])
        # index=off: after a snapshot the old instance's upper becomes a lower of new overlays while
        # the old (inert) overlay may still be unmounting; that is safe, and only a warning then.
        lower = ":".join(str(p) for p in reversed(rootfs.layers))
        opts = f"lowerdir={lower},upperdir={upper},workdir={work},index=off"
        if len(opts) < MOUNT_OPTIONS_MAX:
            await hostexec.mount("overlay", target, "overlay", opts, flags=hostexec.NOSUID_NODEV)
        else:
            # The kernel takes one page of options: paths relative to a common base (the `mount`
            # tool run there) keep a long layer list within it.
            base = Path(os.path.commonpath([str(p) for p in (*rootfs.layers, upper)]))
            lower = ":".join(os.path.relpath(p, base) for p in reversed(rootfs.layers))
            upper_rel, work_rel = os.path.relpath(upper, base), os.path.relpath(work, base)
            opts = f"lowerdir={lower},upperdir={upper_rel},workdir={work_rel},index=off"
            opts = ",".join((*hostexec.NOSUID_NODEV, opts))
            await hostexec.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(target)], cwd=base)
        return target

    async def _start(self, argv: list[str], instance_id: str, rootfs: RootfsSpec, limits: Limits) -> Instance:
        if self._platform_of.get(instance_id, self.platform) == platforms.AUTO:
            raise RuntimeFailure("no runsc platform chosen yet: the driver starts sandboxes only after prepare()")
        bundle = self.bundles / instance_id
        bundle.mkdir(parents=True, exist_ok=True)
        spec = self._spec(instance_id, limits, rootfs.guest)
        spec["mounts"] += [
            {"destination": path, "type": "bind", "source": str(host), "options": ["rbind", "rw", "nosuid", "nodev"]}
            for host, path in rootfs.mounts
        ]
        (bundle / "config.json").write_text(json.dumps(spec))
        await self._mount_rootfs(bundle, rootfs)
        to_guest_r, to_guest_w = os.pipe()
        from_guest_r, from_guest_w = os.pipe()
        try:
            await hostexec.run(
                [*self._global(instance_id), *argv, "--bundle", str(bundle), "--detach", instance_id],
                timeout=60,
                stdin=to_guest_r,
                stdout=from_guest_w,
                stderr_file=bundle / "agent.log",
            )
        except BaseException:
            for fd in (to_guest_r, to_guest_w, from_guest_r, from_guest_w):
                os.close(fd)
            await self._teardown(instance_id)
            raise
        os.close(to_guest_r)
        os.close(from_guest_w)
        reader, writer = await agent_pipes(from_guest_r, to_guest_w)
        return Instance(instance_id, reader, writer, rootfs, limits, bundle)

    # -- the contract ------------------------------------------------------------------------------
    async def boot(self, *, instance_id: str, rootfs: RootfsSpec, limits: Limits) -> Instance:
        return await self._start(["run"], instance_id, rootfs, limits)

    async def restore(self, *, instance_id: str, rootfs: RootfsSpec, limits: Limits, image_dir: Path) -> Instance:
        platform = self._image_platform(image_dir)
        if platform is None:
            raise ImageIncompatible(
                f"its memory image was written by {image_mark(image_dir)}; this node runs "
                f"{self.image_mark}, which cannot restore it"
            )
        if platform != self.platform:
            self._platform_of[instance_id] = platform
        return await self._start(["restore", "--image-path", str(image_dir)], instance_id, rootfs, limits)

    def image_compatible(self, image_dir: Path) -> bool:
        """Whether this node restores the image (the runsc that wrote it, on a platform it runs)."""
        return self._image_platform(image_dir) is not None

    def image_preferred(self, image_dir: Path) -> bool:
        """Whether the image runs on the platform this node boots new sandboxes on."""
        return image_mark(image_dir) == self.image_mark

    # An idle sentry still wakes a few times a second (Go runtime timers, the timekeeper), ~0.4 ms
    # of CPU each second: 400 idle sandboxes keep 0.16 cores busy. Frozen, they take none, and a
    # thaw is one write. Every runsc command below wakes the instance first: runsc talks to a
    # sentry that must be running to answer.
    def doze(self, instance: Instance) -> bool:
        if instance.id in self._dozing:
            return True
        if not _set_freezer(instance.id, frozen=True):
            return False
        self._dozing.add(instance.id)
        return True

    def wake(self, instance: Instance) -> None:
        self._wake(instance.id)

    def dozing(self, instance: Instance) -> bool:
        return instance.id in self._dozing

    def _wake(self, instance_id: str) -> None:
        if instance_id in self._dozing:
            self._dozing.discard(instance_id)
            self.wakes += 1
            _set_freezer(instance_id, frozen=False)

    async def checkpoint(self, instance: Instance, *, image_dir: Path, leave_running: bool) -> None:
        self._wake(instance.id)
        image_dir.mkdir(parents=True, exist_ok=True)
        argv = [*self._global(instance.id), "checkpoint", "--image-path", str(image_dir)]
        if self.version.modern:
            # Uncompressed: the checkpoint and every restore skip flate (a fork of 8 restores its
            # children ~25% sooner); the repository compresses what it stores anyway.
            argv.append("--compression=none")
        if leave_running:
            argv.append("--leave-running")
        try:
            await hostexec.run([*argv, instance.id], timeout=120)
        except RuntimeFailure as exc:
            if "still has waiters upon save" in (exc.stderr or ""):
                # The node asks the agent first; this is a socket its check did not see.
                message = f"{CHECKPOINT_REFUSAL}; the failed save stopped the sandbox"
                raise CheckpointRefused(message, argv=exc.argv, stderr=exc.stderr) from exc
            raise
        (image_dir / IMAGE_MARK).write_text(self.mark_of(self._platform_of.get(instance.id, self.platform)))

    async def checkpoint_running(
        self, instance: Instance, *, image_dir: Path, while_stopped: Callable[[], Awaitable[None]]
    ) -> None:
        """Checkpoint with `--leave-running`, the sandbox stopped (`runsc pause`) from before the
        checkpoint until ``while_stopped`` (the node copies its upper) is done: what the image
        holds and what is on its disk are one moment."""
        if not self.leaves_running:
            raise RuntimeFailure(f"runsc {self.version.version} cannot checkpoint a sandbox and leave it running")
        self._wake(instance.id)
        image_dir.mkdir(parents=True, exist_ok=True)
        await self._control(instance.id, "containerManager.Pause")
        try:
            await self.checkpoint(instance, image_dir=image_dir, leave_running=True)
            await while_stopped()
        except BaseException:
            with contextlib.suppress(RuntimeFailure, OSError, TimeoutError):  # the failure itself says what went wrong
                await asyncio.shield(self._control(instance.id, "containerManager.Resume"))
            raise
        await self._control(instance.id, "containerManager.Resume")

    async def _control(self, instance_id: str, method: str) -> None:
        """One call to the sandbox's own control server, as `runsc pause` and `runsc resume` make
        it (urpc: a JSON call and its JSON answer on the runsc-<id>.sock in runsc's root), without
        starting a runsc process for it (~30 ms each). Pause stops every task of the sandbox (its
        kernel keeps serving, so a checkpoint still runs) and nests: a checkpoint's own pause and
        resume inside it leave it stopped until its Resume."""
        path = self.runsc_root / f"runsc-{instance_id}.sock"
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path)), CONTROL_TIMEOUT)
        except (OSError, TimeoutError) as exc:
            raise RuntimeFailure(f"sandbox {instance_id}: its control socket: {exc}") from None
        try:
            writer.write(json.dumps({"method": method, "arg": None}).encode())
            await writer.drain()
            answer = await asyncio.wait_for(_json_answer(reader), CONTROL_TIMEOUT)
        except (OSError, TimeoutError, ValueError) as exc:
            raise RuntimeFailure(f"sandbox {instance_id}: {method}: {exc or type(exc).__name__}") from None
        finally:
            writer.close()
        if not isinstance(answer, dict) or answer.get("success") is not True:
            error = answer.get("err") if isinstance(answer, dict) else answer
            raise RuntimeFailure(f"sandbox {instance_id}: {method} failed: {str(error)[:500]}")

    async def kill(self, instance: Instance) -> None:
        instance.writer.close()
        await self._teardown(instance.id)

    async def halt(self, instance: Instance) -> None:
        """Stop the instance for good and unmount its root filesystem, without runsc's own teardown.

        `runsc delete` waits until the sandbox's processes are reaped, and they are orphans: PID 1
        reaps them, which on some hosts (a container's init) takes 1.5-2 s. Dead is enough for
        what a build does next (seal its upper): a process that has exited writes nothing and
        holds no file. The processes are found through runsc's state file and signalled through
        pidfds opened after checking they are this instance's (a pid runsc names may be reused)."""
        instance.writer.close()
        self._wake(instance.id)  # frozen tasks die of SIGKILL only once thawed
        ours = _runsc_of(instance.id)
        pids = self._processes_of(instance.id)
        if not pids:  # no state file to go by: runsc's way
            await self._teardown(instance.id)
            return
        found = [pidfds.open_checked(pid, ours) for pid in pids]
        held = [fd for kind, fd in found if fd is not None]
        if any(kind == "other" for kind, _ in found):
            # A live process runsc names that is not this instance's runsc: a pid reused, or a
            # state file not as expected. Signalled never; runsc's way instead.
            for fd in held:
                os.close(fd)
            await self._teardown(instance.id)
            return
        try:
            # Ours are killed; ending ones (a checkpoint ends the sandbox: exiting, or a zombie
            # until PID 1 reaps it, with no command line left) are only waited for.
            for kind, pidfd in found:
                if kind == "ours" and pidfd is not None:
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            await asyncio.wait_for(asyncio.gather(*(pidfds.exited(fd) for fd in held)), HALT_TIMEOUT)
        except (OSError, TimeoutError):
            await self._teardown(instance.id)  # the slow way
            return
        finally:
            for fd in held:
                os.close(fd)
        rootfs = self.bundles / instance.id / "rootfs"
        if os.path.ismount(rootfs):
            await hostexec.run(["umount", str(rootfs)], timeout=30, check=False)
        if os.path.ismount(rootfs):  # something else holds it: runsc's way, then its own retries
            await self._teardown(instance.id)

    def _processes_of(self, instance_id: str) -> list[int]:
        """The sandbox and gofer processes runsc's state file names (runsc writes it, on the host)."""
        try:
            state = json.loads((self.runsc_root / f"{instance_id}_sandbox:{instance_id}.state").read_text())
        except (OSError, ValueError):
            return []
        sandbox = state.get("sandbox") if isinstance(state, dict) else None
        pids = [sandbox.get("pid") if isinstance(sandbox, dict) else None, state.get("goferPid")]
        return [p for p in pids if isinstance(p, int) and not isinstance(p, bool) and p > 1]

    async def _teardown(self, instance_id: str) -> None:
        delete = [*self._global(instance_id), "delete", "--force", instance_id]
        self._pids_max.pop(instance_id, None)
        self._platform_of.pop(instance_id, None)
        self._dozing.discard(instance_id)
        # Thawed whatever this process knows of it: an orphan of a node that died may be frozen,
        # and frozen tasks die of SIGKILL only once thawed.
        _set_freezer(instance_id, frozen=False)
        await hostexec.run(delete, timeout=30, check=False)
        bundle = self.bundles / instance_id
        rootfs = bundle / "rootfs"
        if os.path.ismount(rootfs):
            try:
                await hostexec.run(["umount", str(rootfs)], timeout=30)
            except RuntimeFailure:
                await hostexec.run(["umount", "-l", str(rootfs)], timeout=30, check=False)
        shutil.rmtree(bundle, ignore_errors=True)
        # What a runsc that never finished starting leaves in its root (delete knows no state).
        for path in _runsc_files(self.runsc_root, instance_id):
            path.unlink(missing_ok=True)
        await _remove_cgroups(instance_id)

    async def usage(self, instance: Instance) -> Usage:
        pids, pids_limit = await self.host_tasks(instance)
        return Usage(
            cpu_seconds=_cgroup_value(instance.id, "cpuacct", "cpuacct.usage") / 1e9,
            memory_bytes=_cgroup_value(instance.id, "memory", "memory.usage_in_bytes"),
            memory_limit_bytes=instance.limits.memory_mb * 2**20,
            pids=pids,
            pids_limit=pids_limit,
            oom=_cgroup_value(instance.id, "memory", "memory.failcnt") > 0,
        )

    async def host_tasks(self, instance: Instance) -> tuple[int, int]:
        # pids.max is set once, at the instance's start: read once (one file a sandbox a second
        # instead of five: at 300 idle sandboxes these reads were most of the node's idle CPU).
        limit = self._pids_max.get(instance.id)
        if limit is None:
            limit = self._pids_max[instance.id] = _cgroup_value(instance.id, "pids", "pids.max")
        return _cgroup_value(instance.id, "pids", "pids.current"), limit

    async def cleanup_orphans(self, keep: set[str]) -> list[str]:
        removed = []
        ids = {p.name for p in self.bundles.iterdir() if p.is_dir()}
        ids |= {p.name for p in self.runsc_root.iterdir() if p.is_dir()}
        # Newer runsc keeps a container's state as "<sandbox>_sandbox:<container>.state" files
        # (and its lock beside it, alone when a start never finished), and a "runsc-<id>.sock".
        ids |= {p.name.partition("_sandbox:")[0] for p in self.runsc_root.glob("*_sandbox:*")}
        ids |= {p.name[len("runsc-") : -len(".sock")] for p in self.runsc_root.glob("runsc-*.sock")}
        for instance_id in sorted(ids - keep):
            await self._teardown(instance_id)
            removed.append(instance_id)
        return removed


async def _json_answer(reader: asyncio.StreamReader) -> Any:
    """One JSON value from a control socket (urpc frames nothing: the value ends where it parses)."""
    data = b""
    while len(data) < CONTROL_MAX_ANSWER:
        chunk = await reader.read(4096)
        if not chunk:
            break
        data += chunk
        try:
            return json.loads(data)
        except ValueError:
            continue
    raise ValueError(f"no JSON answer ({len(data)} bytes)")
