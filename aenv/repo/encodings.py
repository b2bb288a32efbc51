"""How node-local artifacts become byte streams and back.

- ``tar``: a directory (a root filesystem layer, a checkpoint image, a guest bundle) as a GNU tar
  stream with numeric owners and every extended attribute. Overlay whiteouts (0/0 character
  devices) and opaque markers (``trusted.overlay.opaque``) survive as they are.
- ``sparse``: a file with holes (a sealed upper's ext4 image: gigabytes of quota, megabytes of
  data) as the concatenation of its data extents, plus the extent map and the file's size.

Readers yield blocks; writers consume verified chunk contents and build into a temporary path the
caller renames into place only when everything arrived.
"""

from __future__ import annotations

import errno
import os
import subprocess
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from aenv.errors import StorageError

BLOCK = 1024 * 1024
TAR_OPTS = ["--numeric-owner", "--xattrs", "--xattrs-include=*"]


def tar_blocks(path: Path) -> Iterator[bytes]:
    argv = ["tar", "--create", "--file=-", "--directory", str(path), "--sparse", *TAR_OPTS, "."]
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


def untar(chunks: Iterable[bytes], dest: Path) -> None:
    """Extract a tar stream into ``dest`` (an empty directory); any error leaves the caller to
    remove ``dest``."""
    argv = ["tar", "--extract", "--file=-", "--directory", str(dest), "--same-permissions", "--same-owner", *TAR_OPTS]
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stderr=errors)
        assert proc.stdin is not None
        try:
            for data in chunks:
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
            raise StorageError(f"extracting into {dest} failed: {message}")
    # On disk before the caller renames it into place: after a crash a cached layer must be
    # whole or absent, never a tree of empty files.
    subprocess.run(["sync", "--file-system", str(dest)], check=False)


def data_extents(path: Path) -> tuple[int, list[tuple[int, int]]]:
    """(file size, [(offset, length)] of the regions holding data)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        extents: list[tuple[int, int]] = []
        offset = 0
        while offset < size:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # only a hole remains
                    break
                raise
            end = os.lseek(fd, start, os.SEEK_HOLE)
            extents.append((start, end - start))
            offset = end
        return size, extents
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


def write_sparse(chunks: Iterable[bytes], dest: Path, size: int, extents: list[tuple[int, int]]) -> None:
    """Lay a stream of extent data back out as a sparse file of ``size`` bytes."""
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, size)
        regions = iter(extents)
        offset, left = next(regions, (0, 0))
        for data in chunks:
            view = memoryview(data)
            while view:
                if left == 0:
                    nxt = next(regions, None)
                    if nxt is None:
                        raise StorageError(f"{dest}: more data than its extents hold")
                    offset, left = nxt
                n = min(left, len(view))
                os.pwrite(fd, view[:n], offset)
                offset, left, view = offset + n, left - n, view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)
