"""Starts one instance of the fake runtime (aenv/runtime/fake.py): the guest agent in namespaces of
its own, on its root file system. Stdlib only; run by the host's interpreter as a script
(``python -I fakeinit.py CONFIG``) with the agent's channel as its stdin and stdout.

Three processes: this one (P, the instance's process as the driver sees it, and the reaper of
what follows), a child (C) that unshares the user, mount, PID, network, IPC and UTS namespaces
while P writes its id maps (only a process outside a user namespace may map more than one id),
and C's child (G), PID 1 of the new PID namespace, which mounts the root (overlayfs of the
layers under the upper), /proc, /dev, /.aenv and the host directories a layer asks for, brings
up loopback, pivots its root there (the host's is detached), keeps runsc's capabilities only and
becomes the agent. C exits at once; G, a child of P's subreaper, is
reaped by P, which exits with G's status. SIGKILL to G ends every process of the instance (the
kernel kills a PID namespace's processes with its init) and with it every mount (the mount
namespace goes with its last process): nothing of an instance stays mounted on the host.

None of this is isolation: see the module docstring of aenv/runtime/fake.py.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import struct
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
PR_SET_CHILD_SUBREAPER, PR_CAPBSET_DROP = 36, 24
MNT_DETACH = 2
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}  # syscall numbers: glibc has no wrapper
# The capabilities runsc gives a sandbox's processes (aenv/runtime/gvisor.py CAPS); every other one
# (CAP_SYS_ADMIN above all: mounts) leaves the bounding set before the agent starts.
KEPT_CAPS = {0, 1, 3, 4, 5, 6, 7, 8, 10, 13, 18, 27, 29, 31}
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
OPTIONS_MAX = 4000  # of the page mount(2) takes

libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


# statvfs flag -> mount flag, for the flags a less privileged mount namespace may not drop
LOCKED_FLAGS = (
    (os.ST_RDONLY, 0x1),  # MS_RDONLY
    (os.ST_NOEXEC, 0x8),  # MS_NOEXEC
    (os.ST_NOATIME, 0x400),  # MS_NOATIME
    (os.ST_NODIRATIME, 0x800),  # MS_NODIRATIME
    (os.ST_RELATIME, 0x200000),  # MS_RELATIME
)


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(
        libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            flags,
            data.encode() if data else None,
        ),
        f"mount {fstype or 'bind'} {target}",
    )


def bind_read_only(source: str, target: str, extra: int = 0) -> None:
    mount(source, target, None, MS_BIND | MS_REC)
    mount("none", target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | extra)


def mount_root(config: dict[str, object]) -> str:
    root = str(config["root"])
    lower = [str(x) for x in config["lower"]]  # type: ignore[attr-defined]
    upper, work = str(config["upper"]), str(config["work"])
    # userxattr: the overlay's own attributes (opaque directories, redirects) in user.overlay.*, the
    # only ones a mount inside a user namespace may write; index=off as the gVisor driver's.
    base = ""
    opts = f"lowerdir={':'.join(reversed(lower))},upperdir={upper},workdir={work},userxattr,index=off"
    if len(opts) >= OPTIONS_MAX:
        base = os.path.commonpath([*lower, upper, work])
        rel = [os.path.relpath(p, base) for p in (*reversed(lower),)]
        opts = (
            f"lowerdir={':'.join(rel)},upperdir={os.path.relpath(upper, base)},"
            f"workdir={os.path.relpath(work, base)},userxattr,index=off"
        )
        os.chdir(base)
    if not lower:  # overlayfs needs a lower: an empty one
        os.makedirs(f"{work}-lower", exist_ok=True)
        opts = opts.replace("lowerdir=,", f"lowerdir={work}-lower,")
    mount("overlay", root, "overlay", MS_NOSUID | MS_NODEV, opts)
    os.chdir("/")
    return root


def _mkdir(path: str, mode: int = 0o755) -> None:
    if not os.path.isdir(path) or os.path.islink(path):
        os.makedirs(path, mode=mode, exist_ok=True)


def populate(root: str, config: dict[str, object]) -> None:
    for name in config.get("host_dirs", []):  # type: ignore[attr-defined]
        # The host's system directories (the fake `base` template): read-only, as its own.
        target = f"{root}/{name}"
        if os.path.isdir(f"/{name}") and not os.path.islink(f"/{name}") and os.path.isdir(target):
            bind_read_only(f"/{name}", target, MS_NODEV)
    _mkdir(f"{root}/.aenv")
    bind_read_only(str(config["guest"]), f"{root}/.aenv", MS_NOSUID | MS_NODEV)
    for host, path in config.get("mounts", []):  # type: ignore[attr-defined]
        # A volume: its target inside the root, with no link of the sandbox's on the way out of it.
        target = root
        for part in path.strip("/").split("/"):  # each made 0755 (this process's umask is the node's)
            target = f"{target}/{part}"
            if not os.path.lexists(target):
                os.mkdir(target)
                os.chmod(target, 0o755)
        if os.path.realpath(target) != os.path.normpath(target):
            raise OSError(f"volume mount point {path} leads out of the sandbox's root")
        mount(host, target, None, MS_BIND | MS_REC)
        # The flags of the volume's own mount are locked in this user namespace: kept, not dropped.
        kept = os.statvfs(host).f_flag
        locked = sum(ms for st, ms in LOCKED_FLAGS if kept & st)
        mount("none", target, None, MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV | locked)
    _mkdir(f"{root}/proc")
    mount("proc", f"{root}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mkdir(f"{root}/sys")
    try:
        mount("sysfs", f"{root}/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
    except OSError:
        pass  # a sandbox without /sys works, as most programs do
    dev = f"{root}/dev"
    _mkdir(dev)
    mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=64k")
    for name in DEVICES:
        open(f"{dev}/{name}", "wb").close()
        mount(f"/dev/{name}", f"{dev}/{name}", None, MS_BIND)
    os.mkdir(f"{dev}/pts")
    mount("devpts", f"{dev}/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620")
    os.symlink("pts/ptmx", f"{dev}/ptmx")
    os.mkdir(f"{dev}/shm")
    mount("shm", f"{dev}/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "fd/0"), ("stdout", "fd/1"), ("stderr", "fd/2")):
        os.symlink(target, f"{dev}/{name}")


def loopback_up() -> None:
    """A new network namespace's loopback is down: the agent's egress proxy listens on it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        import fcntl

        req = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | IFF_UP, b""))


def enter_root(root: str) -> None:
    """pivot_root into ``root`` and detach the old root: unlike a chroot, nothing of the host's
    file system is left in the instance's mount namespace to climb back to."""
    os.chdir(root)
    number = PIVOT_ROOT.get(os.uname().machine)
    if number is None or libc.syscall(number, b".", b".") != 0:
        raise OSError(ctypes.get_errno(), f"pivot_root: {os.strerror(ctypes.get_errno())}")
    _check(libc.umount2(b".", MNT_DETACH), "detach the old root")  # it was stacked over the new one
    os.chdir("/")


def drop_capabilities() -> None:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
    except (OSError, ValueError):
        last = 40
    for cap in range(last + 1):
        if cap not in KEPT_CAPS:
            _check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap}")


def become_agent(config: dict[str, object]) -> None:
    """G: PID 1 of the instance. Never returns."""
    try:
        mount("none", "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here reaches the host
        root = mount_root(config)
        populate(root, config)
        loopback_up()
        socket.sethostname("sandbox")
        enter_root(root)
        drop_capabilities()
        os.umask(0o022)  # as runsc starts a container's first process, not the node's 077
        uid = int(config["uid"])  # type: ignore[call-overload]
        if uid:  # no root in this namespace: the agent runs as the one id it has
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        else:
            os.setgroups([0])
        argv = [str(a) for a in config["argv"]]  # type: ignore[attr-defined]
        env = {k: str(v) for k, v in config["env"].items()}  # type: ignore[attr-defined]
        os.execve(argv[0], argv, env)
    except BaseException as exc:  # noqa: BLE001 - the log is all that is left
        sys.stderr.write(f"fake runtime: the instance did not start: {exc}\n")
        sys.stderr.flush()
        os._exit(127)


def main() -> int:
    config = json.loads(open(sys.argv[1]).read())
    _check(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl")
    to_parent_r, to_parent_w = os.pipe()
    to_child_r, to_child_w = os.pipe()
    child = os.fork()
    if child == 0:  # C
        try:
            os.close(to_parent_r)
            os.close(to_child_w)
            flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
            _check(libc.unshare(flags), "unshare")
            os.write(to_parent_w, b"u")
            if os.read(to_child_r, 1) != b"m":
                os._exit(126)
            init = os.fork()
            if init == 0:
                os.close(to_parent_w)
                os.close(to_child_r)
                become_agent(config)
            os.write(to_parent_w, struct.pack("i", init))
        except BaseException as exc:  # noqa: BLE001
            sys.stderr.write(f"fake runtime: could not make the instance's namespaces: {exc}\n")
            sys.stderr.flush()
            os._exit(126)
        os._exit(0)
    os.close(to_parent_w)
    os.close(to_child_r)
    if os.read(to_parent_r, 1) != b"u":
        os.waitpid(child, 0)
        return 126
    for name, value in (("setgroups", config.get("setgroups", "")), ("uid_map", config["uid_map"])):
        if value:
            with open(f"/proc/{child}/{name}", "w") as f:
                f.write(str(value))
    with open(f"/proc/{child}/gid_map", "w") as f:
        f.write(str(config["gid_map"]))
    os.write(to_child_w, b"m")
    raw = os.read(to_parent_r, 4)
    os.waitpid(child, 0)
    if len(raw) != 4:
        return 126
    (init,) = struct.unpack("i", raw)
    with open(f"{config['pidfile']}.tmp", "w") as f:
        f.write(f"{init} {_start_time(init)}\n")
    os.rename(f"{config['pidfile']}.tmp", str(config["pidfile"]))
    # The channel is the agent's alone: a copy held here would keep the pipe open after it died.
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    status = 0
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid == init:
            break
    return os.waitstatus_to_exitcode(status) if status else 0


def _start_time(pid: int) -> str:
    """A process's start time (clock ticks since boot): with its pid, it names it for good."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[19].decode()
    except (OSError, IndexError):
        return "0"


if __name__ == "__main__":
    sys.exit(main())
