"""The data dir is the node's alone: no host user but root may enter it or read anything in it.

It holds secrets (``aenv.db`` keeps the secret every sandbox's envd access token derives from,
``api-key``), checkpoint images (a sandbox's memory) and every sandbox's files. The server runs
with umask 077, so whatever it or its tools create is owner-only; the data dir is made 0700 from
the start, and a data dir an older version left open (0755, 0644 files) is tightened at start.

Sandbox files keep the owners and modes their sandbox gave them: files of uid 1000 (``user``
inside) carry uid 1000 on the host too. Rather than mapping sandbox ids to an unused host range
(this runsc's gofer writes the ids the sandbox asks for), they are kept out of reach: they lie
only under the data dir, which no other host user can traverse, and they are mounted nosuid and
nodev (see ``aenv.runtime.hostexec``), so even a path to them gives a host user nothing to run
as another user.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

PRIVATE_UMASK = 0o077
PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
SANDBOX_DIR = 0o755


# What sandboxes see keeps the modes their users need inside: the layers (and the uppers mounted
# there) and the guest bundles mounted at /.aenv. Only what the node keeps beside them (disk
# images, use markers) is tightened there.
SANDBOX_TREES = ("fs/layers", "runtime/guest", "runtime/fake-instances")  # (the last: overlayfs's work dirs)
NODE_ONLY_BESIDE_THEM = (".used",)


class UnsafeDirectory(PermissionError):
    """A directory of the node's that another host user could change."""


def secure(data_dir: Path) -> None:
    """Create ``data_dir`` owner-only, or make an existing one (and what the node keeps in it)
    so: an older version left it 0755 with 0644 files."""
    data_dir.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    check_owned(data_dir)
    _tighten(data_dir, "")


def check_owned(path: Path) -> None:
    """Refuse (UnsafeDirectory) a directory that another host user owns, or could rename or
    replace: one of its parents is theirs, or writable by others without the sticky bit. Such a
    user could have made it before the node's first start (in /var/tmp, say) and swap what root
    reads and writes there, an `api-key` of theirs or links where layers go; tightening its mode
    does not help, an owner can loosen it again. As OpenSSH's StrictModes does."""
    me = os.geteuid()
    real = path.resolve()
    for here in (real, *real.parents):
        st = os.stat(here)
        if st.st_uid not in (0, me) or (here == real and st.st_uid != me):
            raise UnsafeDirectory(f"{here} belongs to another user (uid {st.st_uid}): {path} cannot be the node's")
        if here != real and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise UnsafeDirectory(
                f"another user may write in {here} (mode {stat.S_IMODE(st.st_mode):o}): {path} cannot be the node's"
            )


def _tighten(path: Path, rel: str) -> None:
    _make_private(path)
    for entry in os.scandir(path):
        if entry.is_symlink():
            continue  # never followed
        if not entry.is_dir():
            _make_private(Path(entry.path))
        elif rel in SANDBOX_TREES and entry.name not in NODE_ONLY_BESIDE_THEM:
            continue
        elif not os.path.ismount(entry.path):  # a sandbox's root overlay left by a crash
            _tighten(Path(entry.path), f"{rel}/{entry.name}".lstrip("/"))


def private_dir(path: Path) -> None:
    """A directory of the node's own outside the data dir (a repository on a path): owner-only."""
    path.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    check_owned(path)
    _make_private(path)


def sandbox_dir(path: Path) -> Path:
    """A directory that sandboxes see (an upper's root is their "/"): 0755, not the umask's 0700."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, SANDBOX_DIR)
    return path


def _make_private(path: Path) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        return  # never followed
    mode = PRIVATE_DIR if stat.S_ISDIR(st.st_mode) else PRIVATE_FILE
    if stat.S_IMODE(st.st_mode) & ~mode:
        os.chmod(path, stat.S_IMODE(st.st_mode) & mode)
