"""The fake runtime (AENV_DRIVER=fake): the driver contract without runsc, for tests and laptops.

**It isolates nothing.** A sandbox is the real guest agent (aenv/guest, from the same bundle the
gVisor driver mounts) started as a host process by aenv/runtime/fakeinit.py, in namespaces of its
own (user, mount, PID, network, IPC, UTS), its root pivoted to an overlayfs of the sandbox's layers
under its upper directory, with runsc's capabilities (no CAP_SYS_ADMIN). The namespaces keep
sandboxes from seeing each other's files, ports, processes and abstract sockets, and from signalling
host processes; they are no security boundary: the host kernel serves every system call, on the
machine's root the sandbox's root is the host's uid 0 (its files' owners are the host's own ids),
and the host's system directories are bound into the fake `base` template. Never run untrusted code
on it. It is chosen only by setting AENV_DRIVER=fake, serves on a loopback address only, logs a
warning at start, and /health's ``runtime`` says ``"driver": "fake"`` and ``"isolation": "none"``.

What is real: the agent and everything it serves (commands, PTYs, files, watches, tunnels to
ports, egress through its proxy, which has the sandbox's only network), the node above it (states,
records, uppers, layers, snapshots, forks, the repository, the API).

What is simulated, and how:
  - **Checkpoint** (pause, snapshot, fork, template commit): every process of the instance is
    stopped (SIGSTOP, each one found by its PID namespace) and the image directory gets only a mark
    naming this runtime; no memory is saved. With ``leave_running`` the processes are continued
    once the node has copied the upper (``checkpoint_running``).
  - **Restore** (create, resume, a fork's child): a new agent boots on the layers and the upper.
    Files are all there; **processes, their memory, open streams and background commands are not**
    (a template's start command is not running in a sandbox created from it; a command started
    before a pause is gone after the resume). The restored agent gets the sandbox's settings in
    the thaw, as a restored one does.
  - **Limits**: CPU, memory, process and disk limits are not enforced (no cgroups, and uppers
    are plain directories: ``Limits.disk_mb`` is no quota); usage is read from /proc (CPU time and
    resident memory of the instance's processes). Dozing is not done (``doze`` answers False).
  - **Users**: as root, ids 0-65535 map to themselves. Without root the instance has one id: the
    host user is uid 1000 (`user`) inside, the agent runs as it, and a command as root fails.
Images of this runtime restore only under it, and gVisor's only under gVisor (``image_mark``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import stat
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from aenv.errors import ImageIncompatible, RuntimeFailure
from aenv.runtime import guestbundle
from aenv.runtime.base import (
    OWN_BASE,
    Instance,
    Limits,
    NothingToChoose,
    OwnBase,
    RootfsSpec,
    TeardownOnKill,
    Usage,
    agent_pipes,
)
from aenv.runtime.gvisor import IMAGE_MARK, _guest_mount_point, image_mark

log = logging.getLogger(__name__)

NAME = "fake"
MARK = "fake runtime 1 (no memory saved)"
LAUNCHER = Path(__file__).with_name("fakeinit.py")
STARTED_TIMEOUT = 30.0
KILL_TIMEOUT = 10.0
ROOT_IDS = 65536
USER_UID = 1000
# Host directories the fake `base` template has bound read-only: the host's programs and libraries.
HOST_SYSTEM = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
HOST_MARKER = ".aenv-fake-host"  # in a template's lowest layer: which of HOST_SYSTEM to bind
# What of the host's /etc the fake base does not take: secrets and the host's own identity.
ETC_SKIPPED = {"shadow", "shadow-", "gshadow", "gshadow-", "sudoers", "sudoers.d", "ssh", "ld.so.preload", "machine-id"}
ETC_FILE_MAX = 1 << 20
FAKE_BASE_DESCRIPTION = f"the host's system, read-only {OWN_BASE}"
WARNING = (
    "AENV_DRIVER=fake: sandboxes are host processes in namespaces, NOT isolated; for tests only, "
    "never for untrusted code"
)


def user_namespaces_work() -> str:
    """Why this host does not let this user make the instance's namespaces ("" if it does)."""
    try:
        if Path("/proc/sys/kernel/unprivileged_userns_clone").read_text().strip() == "0" and os.geteuid() != 0:
            return "unprivileged user namespaces are off (kernel.unprivileged_userns_clone=0)"
    except OSError:
        pass
    if int(Path("/proc/sys/user/max_user_namespaces").read_text() or 0) == 0:
        return "user namespaces are off (user.max_user_namespaces=0)"
    return ""


class FakeDriver(guestbundle.BundledGuests, TeardownOnKill, NothingToChoose):
    name = NAME
    own_base: OwnBase | None = OwnBase(FAKE_BASE_DESCRIPTION, lambda root: host_base_layer(root))  # no debootstrap
    saves_epoll_tcp = True  # nothing is saved: nothing to refuse
    leaves_running = True
    restore_leaves_garbage = False
    sized_by_image = False
    boot_timeout = 30.0
    image_mark = MARK
    plain_uppers = True  # uppers are directories (LayerStore), the instance's overlay upper itself

    def __init__(self, *, state_dir: Path) -> None:
        why = user_namespaces_work()
        if why:
            raise RuntimeFailure(f"the fake runtime needs user namespaces: {why}")
        self.state_dir = state_dir
        self.bundles = state_dir / "fake-instances"
        self.bundles.mkdir(parents=True, exist_ok=True)
        self._init_guests(state_dir / "guest")  # the gVisor driver's bundles, built the same way
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self._init: dict[str, int] = {}  # instance id -> host pid of its PID 1
        self.wakes = 0
        log.warning("%s", WARNING)

    def info(self) -> dict[str, str]:
        return {"driver": NAME, "runsc": "none", "platform": "host processes", "isolation": "none"}

    def image_compatible(self, image_dir: Path) -> bool:
        return image_mark(image_dir) == MARK

    # -- start ----------------------------------------------------------------------------------------
    def _config(self, instance_id: str, rootfs: RootfsSpec, bundle: Path) -> dict[str, object]:
        # The upper directory itself is the overlay's upper (LayerStore's plain uppers); its work
        # directory is the instance's, on the same file system (the data dir).
        upper = rootfs.upper
        _guest_mount_point(upper, rootfs.layers)
        work = bundle / "work"
        work.mkdir(exist_ok=True)
        (bundle / "rootfs").mkdir(exist_ok=True)
        uid, gid = os.geteuid(), os.getegid()
        ids: dict[str, object] = (
            {"uid_map": f"0 0 {ROOT_IDS}", "gid_map": f"0 0 {ROOT_IDS}", "uid": 0}
            if uid == 0
            else {
                "uid_map": f"{USER_UID} {uid} 1",
                "gid_map": f"{USER_UID} {gid} 1",
                "setgroups": "deny",
                "uid": USER_UID,
            }
        )
        return {
            "root": str(bundle / "rootfs"),
            "lower": [str(p) for p in rootfs.layers],
            "upper": str(upper),
            "work": str(work),
            "guest": str(self.guest_bundle(rootfs.guest)),
            "host_dirs": _host_dirs(rootfs.layers[0]) if rootfs.layers else [],
            "mounts": [[str(host), path] for host, path in rootfs.mounts],
            "argv": guestbundle.agent_argv(),
            "env": {
                "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                **dict(e.split("=", 1) for e in guestbundle.agent_env()),
            },
            "pidfile": str(bundle / "init.pid"),
            **ids,
        }

    async def _start(self, instance_id: str, rootfs: RootfsSpec, limits: Limits) -> Instance:
        bundle = self.bundles / instance_id
        bundle.mkdir(parents=True, exist_ok=True)
        config = bundle / "config.json"
        config.write_text(json.dumps(self._config(instance_id, rootfs, bundle)))
        to_guest_r, to_guest_w = os.pipe()
        from_guest_r, from_guest_w = os.pipe()
        err = os.open(bundle / "agent.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-I",
                str(LAUNCHER),
                str(config),
                stdin=to_guest_r,
                stdout=from_guest_w,
                stderr=err,
                start_new_session=True,
            )
        except BaseException:
            for fd in (to_guest_r, to_guest_w, from_guest_r, from_guest_w):
                os.close(fd)
            await self._teardown(instance_id)
            raise
        finally:
            os.close(err)
        os.close(to_guest_r)
        os.close(from_guest_w)
        self._procs[instance_id] = proc
        try:
            await self._wait_started(instance_id, proc, bundle)
        except BaseException:
            os.close(to_guest_w)
            os.close(from_guest_r)
            await self._teardown(instance_id)
            raise
        reader, writer = await agent_pipes(from_guest_r, to_guest_w)
        return Instance(instance_id, reader, writer, rootfs, limits, bundle)

    async def _wait_started(self, instance_id: str, proc: asyncio.subprocess.Process, bundle: Path) -> None:
        """Until the launcher names the instance's PID 1 (its namespaces are made)."""
        deadline = time.monotonic() + STARTED_TIMEOUT
        pidfile = bundle / "init.pid"
        while time.monotonic() < deadline:
            found = _read_pidfile(pidfile)
            if found is not None:
                self._init[instance_id] = found
                return
            if proc.returncode is not None:
                break
            await asyncio.sleep(0.005)
        text = (bundle / "agent.log").read_text(errors="replace").strip()
        raise RuntimeFailure(
            f"the fake runtime's instance did not start: {text.splitlines()[-1] if text else 'no reason given'}",
            stderr=text[-4000:],
        )

    async def boot(self, *, instance_id: str, rootfs: RootfsSpec, limits: Limits) -> Instance:
        return await self._start(instance_id, rootfs, limits)

    async def restore(self, *, instance_id: str, rootfs: RootfsSpec, limits: Limits, image_dir: Path) -> Instance:
        written_by = image_mark(image_dir)
        if written_by != MARK:
            raise ImageIncompatible(
                f"its memory image was written by {written_by}; this node runs the fake runtime, which cannot "
                "restore it"
            )
        return await self._start(instance_id, rootfs, limits)  # a new agent: no process comes back

    # -- checkpoints --------------------------------------------------------------------------------
    def _members(self, instance_id: str) -> list[int]:
        """Host pids of every process of the instance (those in its PID namespace)."""
        init = self._init.get(instance_id)
        if init is None:
            return []
        try:
            ns = os.readlink(f"/proc/{init}/ns/pid")
        except OSError:
            return []
        found = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    if os.readlink(f"/proc/{name}/ns/pid") == ns:
                        found.append(int(name))
                except OSError:
                    continue
        return found

    def _signal_all(self, instance_id: str, sig: int) -> None:
        """Signal every process; for SIGSTOP again until no new one shows (one may fork meanwhile)."""
        done: set[int] = set()
        for _ in range(10):
            fresh = [p for p in self._members(instance_id) if p not in done]
            if not fresh:
                return
            for pid in fresh:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            done.update(fresh)
            if sig != signal.SIGSTOP:
                return

    def _stop(self, instance: Instance, image_dir: Path) -> None:
        self._signal_all(instance.id, signal.SIGSTOP)
        image_dir.mkdir(parents=True, exist_ok=True)
        (image_dir / IMAGE_MARK).write_text(MARK)

    async def checkpoint(self, instance: Instance, *, image_dir: Path, leave_running: bool) -> None:
        self._stop(instance, image_dir)
        if leave_running:
            self._signal_all(instance.id, signal.SIGCONT)
        # Otherwise it stays stopped until the node kills it: nothing changes its upper meanwhile.

    async def checkpoint_running(
        self, instance: Instance, *, image_dir: Path, while_stopped: Callable[[], Awaitable[None]]
    ) -> None:
        self._stop(instance, image_dir)
        try:
            await while_stopped()
        finally:
            self._signal_all(instance.id, signal.SIGCONT)

    # -- the rest of the contract ---------------------------------------------------------------------
    async def _teardown(self, instance_id: str) -> None:
        bundle = self.bundles / instance_id
        init = self._init.pop(instance_id, None)
        if init is None:
            init = _read_pidfile(bundle / "init.pid")
        if init is not None:
            try:
                os.kill(init, signal.SIGKILL)  # and with it every process of its PID namespace
            except ProcessLookupError:
                pass
        proc = self._procs.pop(instance_id, None)
        if proc is not None:
            try:
                await asyncio.wait_for(proc.wait(), KILL_TIMEOUT)
            except TimeoutError:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                await proc.wait()
        await asyncio.to_thread(_remove, bundle)

    async def usage(self, instance: Instance) -> Usage:
        cpu, rss, count = 0.0, 0, 0
        tick, page = os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE")
        for pid in self._members(instance.id):
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    fields = f.read().rpartition(b")")[2].split()
            except OSError:
                continue
            count += 1
            # utime, stime and those of reaped children: a command's CPU stays counted once it ends
            cpu += sum(int(x) for x in fields[11:15]) / tick
            rss += int(fields[21]) * page
        return Usage(
            cpu_seconds=cpu,
            memory_bytes=rss,
            memory_limit_bytes=instance.limits.memory_mb * 2**20,
            pids=count,
            pids_limit=0,
        )

    async def host_tasks(self, instance: Instance) -> tuple[int, int]:
        return 0, 0  # no host limit to watch: the fake runtime sets none

    def doze(self, instance: Instance) -> bool:
        return False

    def wake(self, instance: Instance) -> None:
        return None

    def dozing(self, instance: Instance) -> bool:
        return False

    async def cleanup_orphans(self, keep: set[str]) -> list[str]:
        removed = []
        for path in sorted(self.bundles.iterdir()):
            if path.is_dir() and path.name not in keep and path.name not in self._procs:
                await self._teardown(path.name)
                removed.append(path.name)
        return removed


def _remove(path: Path) -> None:
    """Remove an instance's directory. Overlayfs leaves a mode-0 directory in its work dir, which
    only root could enter: without root it is opened up first."""
    if os.geteuid() != 0:
        for here, dirs, _ in os.walk(path):
            for name in dirs:
                try:
                    os.chmod(os.path.join(here, name), 0o700, follow_symlinks=False)
                except OSError:
                    pass
    shutil.rmtree(path, ignore_errors=True)


def _read_pidfile(path: Path) -> int | None:
    """The pid the launcher wrote, if that process (by its start time) is still the one it named."""
    try:
        pid_text, start = path.read_text().split()
        pid = int(pid_text)
        with open(f"/proc/{pid}/stat", "rb") as f:
            if f.read().rpartition(b")")[2].split()[19].decode() != start:
                return None
    except (OSError, ValueError, IndexError):
        return None
    return pid


def _host_dirs(lowest: Path) -> list[str]:
    """Which host system directories the template's lowest layer asks for (of HOST_SYSTEM only)."""
    try:
        fd = os.open(lowest / HOST_MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return []
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return []
        asked = os.read(fd, 1024).decode(errors="replace").split()
    finally:
        os.close(fd)
    return [name for name in asked if name in HOST_SYSTEM]


def host_base_layer(root: Path) -> None:
    """The fake `base` template's root file system in ``root`` (a new layer directory): the host's
    system directories as mount points (or the links a merged /usr has), a copy of what of the
    host's /etc every host user may read (no secrets), and the sandbox conventions (`user`, its
    home, /run/e2b)."""
    as_root = os.geteuid() == 0
    os.chmod(root, 0o755)
    bound = []
    for name in HOST_SYSTEM:
        host = Path("/") / name
        if host.is_symlink():
            os.symlink(os.readlink(host), root / name)
        elif host.is_dir():
            (root / name).mkdir(mode=0o755)
            bound.append(name)
    (root / HOST_MARKER).write_text(" ".join(bound) + "\n")
    os.chmod(root / HOST_MARKER, 0o644)
    _copy_readable(Path("/etc"), root / "etc")
    etc = root / "etc"
    for name, text in (
        (
            "passwd",
            f"root:x:0:0:root:/root:/bin/bash\nuser:x:{USER_UID}:{USER_UID}:user:/home/user:/bin/bash\n"
            "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        ),
        ("group", f"root:x:0:\ntty:x:5:\nsudo:x:27:user\nuser:x:{USER_UID}:\nnogroup:x:65534:\n"),
        ("hostname", "sandbox\n"),
        ("hosts", "127.0.0.1 localhost sandbox\n::1 localhost ip6-localhost\n"),
    ):
        path = etc / name
        if path.is_symlink() or path.exists():
            path.unlink()
        path.write_text(text)
        os.chmod(path, 0o644)
    for name, mode in (("root", 0o700), ("tmp", 0o1777), ("home", 0o755), ("run", 0o755), ("var", 0o755)):
        (root / name).mkdir(exist_ok=True)
        os.chmod(root / name, mode)
    for name, mode in (("home/user", 0o755), ("run/e2b", 0o755), ("var/tmp", 0o1777), ("opt", 0o755)):
        (root / name).mkdir(parents=True, exist_ok=True)
        os.chmod(root / name, mode)
    if as_root:
        os.chown(root / "home/user", USER_UID, USER_UID)


def _copy_readable(source: Path, target: Path) -> None:
    """Copy what any host user may read of ``source`` (links as links, nothing followed)."""
    target.mkdir(mode=0o755, exist_ok=True)
    os.chmod(target, 0o755)
    try:
        entries = list(os.scandir(source))
    except OSError:
        return
    for entry in entries:
        if entry.name in ETC_SKIPPED:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(entry.path), target / entry.name)
            elif stat.S_ISDIR(st.st_mode) and st.st_mode & 0o005 == 0o005:
                _copy_readable(Path(entry.path), target / entry.name)
            elif stat.S_ISREG(st.st_mode) and st.st_mode & 0o004 and st.st_size <= ETC_FILE_MAX:
                shutil.copyfile(entry.path, target / entry.name, follow_symlinks=False)
                os.chmod(target / entry.name, 0o644 | (st.st_mode & 0o111))
        except OSError:
            continue
