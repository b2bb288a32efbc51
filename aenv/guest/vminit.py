"""Stage two of a microVM's boot (aenv/runtime/qemu.py): makes the sandbox's root and becomes the agent.

Stdlib only; run as PID 1 by stage one (aenv/runtime/compat/aenv_vminit.c), which loaded the
kernel's virtio and overlayfs modules, mounted /dev, /proc and /sys and this bundle read-only at
/.aenv. The kernel command line's ``aenv.cfg`` (URL-safe base64 of JSON, written by the driver;
the whole line has 2048 bytes) says the rest:

  ``layers``  one letter per read-only layer disk, lowest first (see make_root)
  ``module``, ``env``  the agent's module and environment (aenv/runtime/guestbundle.py's, as
                       under gVisor); it runs in this interpreter, started as the agent's is

The writable disk (serial ``aenv-upper``) holds ``upper/`` and ``work/``; the virtio-serial port
``aenv.channel`` carries the agent's channel.

Disks are found by serial and the port by name, not by the order the kernel probed them. The
root is an overlayfs of the layers under the upper, with /proc, /sys (read-only), /dev, /dev/pts,
/dev/shm and the bundle at /.aenv; loopback is up and there is no other network, as under
runsc --network=none. Then this process, PID 1, becomes the agent, the port its stdin and stdout.
"""

from __future__ import annotations

import base64
import ctypes
import fcntl
import json
import os
import resource
import runpy
import socket
import struct
import sys
import time
from typing import Any

GUEST = "/.aenv"
UPPER = "aenv-upper"  # the serial of the writable disk
PORT = "aenv.channel"  # the name of the channel's virtio-serial port
NEW_ROOT = "/run/root"
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_MOVE = 0x2000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
RLIMIT_NPROC = 65536  # aenv.config.MAX_NPROC: the agent's own, as the gVisor driver's spec sets
RLIMIT_NOFILE = 65536
WAIT_SECONDS = 10.0

libc = ctypes.CDLL(None, use_errno=True)


def mount(source: str, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    kind = fstype.encode() if fstype else None
    if libc.mount(source.encode(), target.encode(), kind, flags, data.encode() if data else None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype or 'move'} {source} on {target}: {os.strerror(err)}")


def config() -> dict[str, Any]:
    with open("/proc/cmdline") as f:
        words = f.read().split()
    for word in words:
        if word.startswith("aenv.cfg="):
            raw = word.removeprefix("aenv.cfg=")
            return dict(json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4))))
    raise SystemExit("aenv-vminit: no aenv.cfg on the kernel command line")


def disks() -> dict[str, str]:
    """Serial -> /dev path of every virtio-blk disk."""
    found = {}
    for name in os.listdir("/sys/block"):
        try:
            with open(f"/sys/block/{name}/serial") as f:
                found[f.read().strip()] = f"/dev/{name}"
        except OSError:
            continue
    return found


def port(name: str) -> str:
    for entry in os.listdir("/sys/class/virtio-ports"):
        try:
            with open(f"/sys/class/virtio-ports/{entry}/name") as f:
                if f.read().strip() == name:
                    return f"/dev/{entry}"
        except OSError:
            continue
    raise FileNotFoundError(f"no virtio-serial port named {name}")


def wait_for(what: str, find: Any) -> Any:
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        try:
            found = find()
        except OSError:
            found = None
        if found:
            return found
        if time.monotonic() > deadline:
            raise SystemExit(f"aenv-vminit: {what} did not appear")
        time.sleep(0.005)


def loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req + b"\0" * 22)[:18])[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP) + b"\0" * 22)


def make_root(cfg: dict[str, Any]) -> None:
    mount("run", "/run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
    # One letter a layer, lowest first: "u" the layer is the disk's upper/ (a layer store image),
    # "r" its root (an image made from a directory). Their disks are aenv-l0, aenv-l1, ...
    layers = [(f"aenv-l{i}", "upper" if kind == "u" else "") for i, kind in enumerate(str(cfg["layers"]))]
    wanted = {serial for serial, _ in layers} | {UPPER}

    def all_disks() -> dict[str, str] | None:
        found = disks()
        return found if wanted <= found.keys() else None

    found = wait_for("the sandbox's disks", all_disks)
    lower = []
    for i, (serial, subdir) in enumerate(layers):
        point = f"/run/l{i}"
        os.mkdir(point)
        mount(found[serial], point, "ext4", MS_RDONLY | MS_NODEV)
        lower.append(os.path.join(point, subdir) if subdir else point)
    os.mkdir("/run/u")
    mount(found[UPPER], "/run/u", "ext4", MS_NODEV)
    for d in ("upper", "work"):
        os.makedirs(f"/run/u/{d}", exist_ok=True)
    os.mkdir(NEW_ROOT)
    opts = f"lowerdir={':'.join(reversed(lower))},upperdir=/run/u/upper,workdir=/run/u/work,index=off"
    mount("overlay", NEW_ROOT, "overlay", MS_NODEV, opts)
    for d, mode in ((GUEST, 0o755), ("/proc", 0o555), ("/sys", 0o555), ("/dev", 0o755)):
        os.makedirs(NEW_ROOT + d, mode=mode, exist_ok=True)
    mount(GUEST, NEW_ROOT + GUEST, None, MS_MOVE)
    mount("proc", NEW_ROOT + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    mount("sysfs", NEW_ROOT + "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
    mount("/dev", NEW_ROOT + "/dev", None, MS_MOVE)
    for d in ("pts", "shm"):
        os.makedirs(f"{NEW_ROOT}/dev/{d}", exist_ok=True)
    mount("devpts", NEW_ROOT + "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620")
    mount("shm", NEW_ROOT + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    try:
        os.unlink(NEW_ROOT + "/dev/ptmx")
    except OSError:
        pass
    os.symlink("pts/ptmx", NEW_ROOT + "/dev/ptmx")


def main() -> None:
    cfg = config()
    make_root(cfg)
    channel = wait_for("the channel's port", lambda: port(PORT))
    loopback_up()
    socket.sethostname("sandbox")
    os.chdir(NEW_ROOT)
    mount(".", "/", None, MS_MOVE)
    os.chroot(".")
    os.chdir("/")
    fd = os.open(channel, os.O_RDWR | os.O_NOCTTY)
    os.dup2(fd, 0)
    os.dup2(fd, 1)
    if fd > 2:
        os.close(fd)
    for limit, value in ((resource.RLIMIT_NPROC, RLIMIT_NPROC), (resource.RLIMIT_NOFILE, RLIMIT_NOFILE)):
        resource.setrlimit(limit, (value, value))
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in cfg["env"].items()})
    # The agent runs on in this interpreter (the same bundle, flags and PID 1): a second start of
    # Python took ~3 s of a boot under TCG.
    module = str(cfg["module"])
    sys.argv = [module]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    try:
        main()
    except BaseException as exc:  # PID 1 must not just vanish: say why on the console, then end
        print(f"aenv-vminit: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
