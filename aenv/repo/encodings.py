"""How node-local artifacts become byte streams and back.

- ``tar``: a directory (a root filesystem layer, a checkpoint image, a guest bundle) as a GNU tar
  stream with numeric owners and every extended attribute. Overlay whiteouts (0/0 character
  devices) and opaque markers (``trusted.overlay.opaque``) survive as they are.
- ``sparse``: a file with holes (a sealed upper's ext4 image: gigabytes of quota, megabytes of
  data) as the concatenation of its data extents, plus the extent map and the file's size.

Readers yield blocks; writers consume verified chunk contents and build into a temporary path the
caller renames into place only when everything arrived.

The repository may be a bucket or a directory that other nodes write, so what a writer decodes is
treated as untrusted: nothing lands outside its target. GNU tar already strips leading ``/`` and
refuses ``..`` in names and hardlink targets, and it extracts a link that is absolute or has a
``..`` only after everything else (a placeholder file holds its place), so nothing is ever written
through a link the stream made. On top of that only the extended attributes layers may have are
restored (``trusted.*`` other than the opaque marker steers the host's overlayfs), and device
nodes other than whiteouts are removed before the tree is used, as image layers do. A sparse
file's extents must lie inside its size, in order. Writers stop (507) when the disk gets within
the node's headroom of full.
"""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from aenv.errors import ArtifactDamaged, StorageError
from aenv.storage.confined import XATTR_PREFIXES, is_whiteout
from aenv.storage.space import SpaceWatch, data_runs

log = logging.getLogger("aenv.repo")
BLOCK = 1024 * 1024
SPACE_CHECK = 64 * 1024  # bytes written between two looks at the free space (a tar's 64 KiB: 128 files)
TAR_OPTS = ["--numeric-owner", "--xattrs"]
CREATE_OPTS = [*TAR_OPTS, "--xattrs-include=*"]  # a commit keeps every attribute...
EXTRACT_OPTS = [*TAR_OPTS, *(f"--xattrs-include={prefix}*" for prefix in XATTR_PREFIXES)]  # ...a fetch these


def tar_blocks(path: Path) -> Iterator[bytes]:
    argv = ["tar", "--create", "--file=-", "--directory", str(path), "--sparse", *CREATE_OPTS, "."]
    with tempfile.TemporaryFile() as errors:  # a file, not a pipe: nothing can block on it
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=errors)
        assert proc.stdout is not None
        try:
            while block := proc.stdout.read(BLOCK):
                yield block
        except BaseException:  # the consumer failed or stopped early
            proc.kill()
            proc.wait()
            raise
        if proc.wait() != 0:  # 1 is "file changed as we read it": never commit a moving target
            errors.seek(0)
            message = errors.read().decode(errors="replace").strip()[-500:]
            raise StorageError(f"tar of {path} failed: {message}")


def untar(chunks: Iterable[bytes], dest: Path, headroom: int = 0) -> None:
    """Extract a tar stream into ``dest`` (an empty directory); any error leaves the caller to
    remove ``dest``."""
    argv = [
        "tar",
        "--extract",
        "--file=-",
        "--directory",
        str(dest),
        "--same-permissions",
        "--same-owner",
        *EXTRACT_OPTS,
    ]
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stderr=errors)
        assert proc.stdin is not None
        try:
            for data in _watching_space(chunks, dest, headroom):
                proc.stdin.write(data)
            proc.stdin.close()
        except BrokenPipeError:
            pass  # tar failed early: its own message says why
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        if proc.wait() != 0:
            errors.seek(0)
            message = errors.read().decode(errors="replace").strip()[-500:]
            raise ArtifactDamaged(f"extracting into {dest} failed: {message}")
    _drop_devices(dest)
    # On disk before the caller renames it into place: after a crash a cached layer must be
    # whole or absent, never a tree of empty files.
    subprocess.run(["sync", "--file-system", str(dest)], check=False)


def _watching_space(chunks: Iterable[bytes], dest: Path, headroom: int) -> Iterator[memoryview]:
    """``chunks`` in pieces of `SPACE_CHECK` bytes, the free space (bytes and inodes) looked at
    before each: a chunk of up to 4 MiB of tar is 8192 empty files."""
    room = SpaceWatch(headroom, "fetching from the snapshot repository", every=SPACE_CHECK)
    for data in chunks:
        view = memoryview(data)
        for start in range(0, len(view), SPACE_CHECK):
            piece = view[start : start + SPACE_CHECK]
            room.before(dest, len(piece))
            yield piece


def _drop_devices(dest: Path) -> None:
    """Remove the device nodes tar made (overlay whiteouts, 0/0 character devices, stay): the
    host holds no node that opens one of its own devices. One `find` over the new tree, not a
    walk in Python; nothing else has seen the tree yet."""
    found = subprocess.run(
        ["find", str(dest), "-xdev", "(", "-type", "b", "-o", "-type", "c", ")", "-print0"],
        capture_output=True,
        check=True,
    ).stdout
    for raw in filter(None, found.split(b"\0")):
        path = os.fsdecode(raw)
        st = os.lstat(path)
        if stat.S_ISCHR(st.st_mode) and is_whiteout(st):
            continue
        log.warning("%s: device node %d:%d removed", path, os.major(st.st_rdev), os.minor(st.st_rdev))
        os.unlink(path)


def data_extents(path: Path) -> tuple[int, list[tuple[int, int]]]:
    """(file size, [(offset, length)] of the regions holding data)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        return size, [(start, end - start) for start, end in data_runs(fd, size)]
    finally:
        os.close(fd)


def sparse_blocks(path: Path, extents: list[tuple[int, int]]) -> Iterator[bytes]:
    fd = os.open(path, os.O_RDONLY)
    try:
        for start, length in extents:
            done = 0
            while done < length:
                block = os.pread(fd, min(BLOCK, length - done), start + done)
                if not block:
                    raise StorageError(f"{path} shrank while being read")
                done += len(block)
                yield block
    finally:
        os.close(fd)


def check_extents(size: int, extents: list[tuple[int, int]]) -> None:
    """Extents of a file of ``size`` bytes: in order, apart, each inside the file."""
    end = 0
    for start, length in extents:
        if start < end or length <= 0 or start + length > size:
            raise ArtifactDamaged(f"extent ({start}, {length}) is out of order or outside a file of {size} bytes")
        end = start + length


def write_sparse(
    chunks: Iterable[bytes], dest: Path, size: int, extents: list[tuple[int, int]], headroom: int = 0
) -> None:
    """Lay a stream of extent data back out as the new sparse file ``dest`` of ``size`` bytes."""
    check_extents(size, extents)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
        regions = iter(extents)
        offset, left = next(regions, (0, 0))
        for data in _watching_space(chunks, dest.parent, headroom):
            view = memoryview(data)
            while view:
                if left == 0:
                    nxt = next(regions, None)
                    if nxt is None:
                        raise ArtifactDamaged(f"{dest}: more data than its extents hold")
                    offset, left = nxt
                n = min(left, len(view))
                os.pwrite(fd, view[:n], offset)
                offset, left, view = offset + n, left - n, view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)
