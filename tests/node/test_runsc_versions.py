"""Memory images are bound to the runsc that wrote them: an upgraded node (or one sharing a
repository with nodes of another runsc) refuses to restore another's image with a clear 422 and
loses nothing, instead of handing runsc an image it crashes on (a Go panic, 500)."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from aenv.runtime.gvisor import IMAGE_MARK, LEGACY_RUNSC, RunscVersion, image_mark
from tests.conftest import Server, modern_runsc

pytestmark = pytest.mark.sandbox

OTHER_RUNSC = "runsc 0.0~20000101.0"


def images(server: Server) -> set[str]:
    return set(os.listdir(server.data_dir / "fs" / "images"))


def test_a_pause_another_runsc_wrote_is_refused_and_boots_without_its_memory(
    sandbox: Sandbox, server: Server, api: httpx.Client
) -> None:
    sandbox.files.write("/home/user/kept", "on disk")
    before = images(server)
    assert sandbox.pause() is True
    (image,) = images(server) - before
    mark = server.data_dir / "fs" / "images" / image / IMAGE_MARK
    runtime = api.get("/health").json()["runtime"]
    assert mark.read_text() == f"runsc {runtime['runsc']} {runtime['platform']}"
    mark.write_text(OTHER_RUNSC)  # as if this node's runsc had been upgraded since

    r = api.post(f"/sandboxes/{sandbox.sandbox_id}/resume", json={})
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["error_code"] == "image_incompatible" and OTHER_RUNSC in body["message"]
    assert "memory=false" in body["message"]
    assert api.get(f"/sandboxes/{sandbox.sandbox_id}").json()["state"] == "paused"  # nothing lost

    r = api.post(f"/sandboxes/{sandbox.sandbox_id}/connect", json={"timeout": 60, "memory": False})
    assert r.status_code == 201, r.text
    again = Sandbox.connect(sandbox.sandbox_id)
    assert again.files.read("/home/user/kept") == "on disk"


def test_a_snapshot_another_runsc_wrote_is_refused(sandbox: Sandbox, server: Server, api: httpx.Client) -> None:
    before = images(server)
    r = api.post(f"/sandboxes/{sandbox.sandbox_id}/snapshots", json={})
    assert r.status_code == 201, r.text
    snap = r.json()["snapshotID"]
    (image,) = images(server) - before
    (server.data_dir / "fs" / "images" / image / IMAGE_MARK).write_text(OTHER_RUNSC)
    r = api.post("/sandboxes", json={"templateID": snap})
    assert r.status_code == 422, r.text
    assert r.json()["error_code"] == "image_incompatible" and snap in r.json()["message"]
    assert sandbox.commands.run("echo alive").stdout == "alive\n"  # the source is not touched


def test_the_mark_is_read_as_a_small_regular_file_only(tmp_path: Path) -> None:
    assert image_mark(tmp_path) == LEGACY_RUNSC  # images from before marks
    (tmp_path / IMAGE_MARK).symlink_to("/etc/hostname")
    assert image_mark(tmp_path) == "an unreadable mark"  # never followed
    (tmp_path / IMAGE_MARK).unlink()
    os.mkfifo(tmp_path / IMAGE_MARK)
    assert image_mark(tmp_path) == "an unreadable mark"  # never blocks on a FIFO
    (tmp_path / IMAGE_MARK).unlink()
    (tmp_path / IMAGE_MARK).write_text("runsc " + "x" * 100_000)
    assert len(image_mark(tmp_path)) < 200


def test_versions_runsc_prints() -> None:
    assert RunscVersion("0.0~20240729.0").date == 20240729 and RunscVersion("0.0~20240729.0").modern
    assert RunscVersion("release-20250106.0").modern
    assert not RunscVersion("0.0~20221219.0").modern
    assert RunscVersion("VERSION_MISSING").modern  # a development build: taken to be recent
    assert f"{RunscVersion('0.0~20221219.0').mark} ptrace" == LEGACY_RUNSC


STATX_NO_AUTOMOUNT = """
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
buf = ctypes.create_string_buffer(512)
# The raw system call (the compat shim never sees it): statx(AT_FDCWD, "/etc", AT_NO_AUTOMOUNT, ...)
r = libc.syscall(332, -100, b"/etc", 0x800, 0xFFF, buf)
print("ok" if r == 0 else errno.errorcode[ctypes.get_errno()])
"""


def test_statx_with_no_automount_needs_no_shim(sandbox: Sandbox, server: Server, api: httpx.Client) -> None:
    """runsc 20221219 refuses statx(AT_NO_AUTOMOUNT) (EINVAL), which coreutils always passes, so the
    compat shim dropped the flag; the runsc a node is made for takes it, and its bundles' shim has
    no statx of its own any more."""
    if not modern_runsc(api):
        pytest.skip("runsc 20221219 needs the statx shim")
    sandbox.files.write("/home/user/statx.py", STATX_NO_AUTOMOUNT)
    assert sandbox.commands.run("python3 /home/user/statx.py").stdout.strip() == "ok"
    assert sandbox.commands.run("stat -c %F /etc && ls -ld /etc").stdout.startswith("directory\n")
    # The shim this sandbox's programs load (its bundle's) names no statx any more.
    assert sandbox.commands.run("grep -c statx /.aenv/compat/libaenv_compat.so || true").stdout.strip() == "0"


ROOT_XATTR = """
import os, sys
path = "/home/user/root-xattr"
if sys.argv[1] == "set":
    open(path, "w").close()
    os.setxattr(path, "user.k", b"root's")
print(os.getxattr(path, "user.k").decode())
"""


def test_roots_xattrs_on_the_root_file_system_are_kept(sandbox: Sandbox) -> None:
    """runsc 20240729 accepts root's user xattrs on the root file system and keeps none (a getxattr
    right after answers ENODATA); the compat shim has the agent keep them, as it does a user's."""
    sandbox.files.write("/home/user/rx.py", ROOT_XATTR)
    assert sandbox.commands.run("python3 /home/user/rx.py set", user="root").stdout == "root's\n"
    assert sandbox.pause() is True
    again = Sandbox.connect(sandbox.sandbox_id)
    assert again.commands.run("python3 /home/user/rx.py get", user="root").stdout == "root's\n"


DESKTOP_CALLS = """
import ctypes, errno, os, termios
libc = ctypes.CDLL(None, use_errno=True)
def said(r):
    return "ok" if r >= 0 else errno.errorcode[ctypes.get_errno()]
# The raw system call (the shim never sees it) against libc's, which is the shim's.
print("raw close_range", said(libc.syscall(436, 5, ctypes.c_uint(0xFFFFFFFF), 0)))
print("close_range", said(libc.close_range(5, ctypes.c_uint(0xFFFFFFFF), 0)))
libc.ptsname.restype = ctypes.c_char_p
master = libc.posix_openpt(os.O_RDWR | os.O_NOCTTY)
libc.grantpt(master); libc.unlockpt(master)
peer = libc.ioctl(master, ctypes.c_ulong(0x5441), ctypes.c_ulong(os.O_RDWR | os.O_NOCTTY))  # TIOCGPTPEER
print("peer", said(peer), os.ttyname(peer) == libc.ptsname(master).decode())
one = ctypes.c_int(1)
print("packet mode", said(libc.ioctl(master, ctypes.c_ulong(termios.TIOCPKT), ctypes.byref(one))))
attrs = termios.tcgetattr(peer)
attrs[3] &= ~(termios.ECHO | termios.ICANON)
termios.tcsetattr(peer, termios.TCSANOW, attrs)
os.write(peer, b"abc")
buf = ctypes.create_string_buffer(64)
got = libc.read(master, buf, 64)
print("read", buf.raw[:got])
zero = ctypes.c_int(0)
libc.ioctl(master, ctypes.c_ulong(termios.TIOCPKT), ctypes.byref(zero))
os.write(peer, b"def")
got = libc.read(master, buf, 64)
print("read", buf.raw[:got])
null = os.open("/dev/null", os.O_RDONLY)
print("not a master", said(libc.ioctl(null, ctypes.c_ulong(termios.TIOCPKT), ctypes.byref(one))))
"""


def test_the_shim_mends_the_pty_and_descriptor_calls_desktop_programs_make(sandbox: Sandbox, api: httpx.Client) -> None:
    """GLib's spawn closes descriptors with close_range(fd, ~0U), which runsc 20240729 refuses
    (EINVAL); VTE opens a terminal's peer with TIOCGPTPEER and sets packet mode (TIOCPKT), neither
    known to it (ENOTTY). The compat shim answers all three (docs/desktop.md): XFCE's session,
    panel and terminal start only with it."""
    if not modern_runsc(api):
        pytest.skip("the shims are for runsc 20240729, the runsc a node is made for")
    sandbox.files.write("/home/user/desktop_calls.py", DESKTOP_CALLS)
    lines = sandbox.commands.run("python3 /home/user/desktop_calls.py").stdout.splitlines()
    assert lines[0] in ("raw close_range EINVAL", "raw close_range ok")  # ok: a runsc that mended it
    assert lines[1:] == [
        "close_range ok",
        "peer ok True",
        "packet mode ok",
        "read b'\\x00abc'",  # each read of a master in packet mode: a status byte (data), then the data
        "read b'def'",  # packet mode off: as it was
        "not a master ENOTTY",
    ]


def test_the_agent_churns_the_sentry_s_heap_only_where_a_restore_leaves_garbage(tmp_path: Path) -> None:
    """20221219's restores left ~30 MiB of garbage in the sentry's heap, which the agent makes it
    give back once quiet (aenv/guest/sentry.py); on 20240729 that churn kept 4-6 MiB more per
    sandbox (measured with smaps_rollup: 8.3 MiB of the sentry's anonymous memory without it,
    13.9 with it), so the node tells the agent to hold off there."""
    from aenv.config import Settings
    from aenv.node.orchestrator import Node
    from aenv.node.store import SandboxRecord

    node = Node(Settings(data_dir=tmp_path / "data"))
    config = node.instances.agent_config(SandboxRecord(id="s1", template_id="base", started_at=0.0, end_at=60.0))
    assert node.driver.restore_leaves_garbage is (not node.driver.version.modern)
    assert config.get("hold_heap", False) is (not node.driver.restore_leaves_garbage)
