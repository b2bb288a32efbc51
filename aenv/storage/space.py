"""Disk space on the data dir's filesystem, and request bodies written to it as they arrive.

What clients make the node write (build contexts, E2B uploads, what they unpack to, artifacts
fetched from the repository) is refused with 507 before it would leave less than the configured
headroom free: the host's disk never fills up, and sandboxes, the database and the logs keep room.
Inodes count as much as bytes: a layer of millions of empty files uses none of the disk's bytes
and every one of its inodes (~15 minutes from a 100 MiB gzip'd layer), after which no host process
can create a file. The headroom keeps the same share of the filesystem's inodes free as of its bytes.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from aenv.config import Settings
from aenv.errors import InsufficientStorage, PayloadTooLarge

log = logging.getLogger("aenv.storage")

MiB = 1 << 20
FULL = "the node's disk is nearly full; try again later, or on another node"
FLUSH = MiB  # bytes gathered before each write (and space check), off the event loop
ENTRIES = 256  # files made between two looks at the free space (a statvfs: microseconds)


def headroom(settings: Settings) -> int:
    """Bytes kept free on the data dir's filesystem."""
    return settings.disk_headroom_mb * MiB


def ensure_space(path: Path | int, headroom: int, need: int, what: str) -> None:
    """Refuse (507) ``what`` if writing ``need`` more bytes would leave less than ``headroom``,
    or fewer inodes than the same share of the filesystem's. The answer says what the client can
    act on; the host's free space and reserve go to the node's log only."""
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize  # what an unprivileged process may write: root's reserve is spare
    if free - need < headroom:
        log.warning(
            "refused %s: %d MiB free, %d MiB more needed, %d MiB kept free",
            what,
            free // MiB,
            max(need, 0) // MiB,
            headroom // MiB,
        )
        raise InsufficientStorage(f"{what}: {FULL}")
    size = st.f_blocks * st.f_frsize
    if headroom and st.f_files and size:  # some filesystems have no inode table (f_files 0)
        kept = -(-st.f_files * headroom // size)
        if st.f_favail < kept:
            log.warning("refused %s: %d inodes free, %d kept free", what, st.f_favail, kept)
            raise InsufficientStorage(f"{what}: {FULL}")


class SpaceWatch:
    """Looks at the free space before writes, once every ``every`` bytes or `ENTRIES` files
    (and before the first)."""

    def __init__(self, headroom: int, what: str, every: int = 16 * MiB) -> None:
        self.headroom = headroom
        self.what = what
        self.every = every
        self._unchecked = every
        self._entries = 0

    def before(self, where: Path | int, size: int) -> None:
        """Before making a file (a directory, a link...) of ``size`` bytes on the filesystem of
        ``where`` (a path or an open fd)."""
        self._unchecked += size
        self._entries += 1
        if self._unchecked >= self.every or self._entries >= ENTRIES:
            ensure_space(where, self.headroom, size, self.what)
            self._unchecked = self._entries = 0


def too_large(what: str, limit: int, setting: str) -> PayloadTooLarge:
    return PayloadTooLarge(f"{what} is larger than {limit // MiB} MiB (the node's {setting})")


async def receive(
    body: AsyncIterator[bytes],
    dest: Path,
    *,
    declared: int | None,
    limit: int,
    headroom: int,
    what: str,
    setting: str,
) -> int:
    """Write a request body to the new file ``dest`` as it arrives; return its size.

    Refused before a byte is written when the declared length is over ``limit`` or would not fit
    (413, 507), and as soon as the bytes received pass ``limit`` or the disk gets within
    ``headroom`` of full (a chunked body declares nothing). ``dest`` is removed on any failure,
    the client going away included."""
    if declared is not None and declared > limit:
        raise too_large(what, limit, setting)
    ensure_space(dest.parent, headroom, declared or 0, what)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    size = 0
    pending = bytearray()
    try:
        async for chunk in body:
            size += len(chunk)
            if size > limit:
                raise too_large(what, limit, setting)
            pending += chunk
            if len(pending) >= FLUSH:
                await asyncio.to_thread(_write, fd, bytes(pending), headroom, what)
                pending.clear()
        await asyncio.to_thread(_write, fd, bytes(pending), headroom, what)
    except BaseException:
        os.close(fd)
        dest.unlink(missing_ok=True)
        raise
    os.close(fd)
    return size


def _write(fd: int, data: bytes, headroom: int, what: str) -> None:
    ensure_space(fd, headroom, len(data), what)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def data_runs(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """(start, end) of each region of the open file ``fd`` (``size`` bytes) that holds data, in
    order: what a sparse file's holes leave."""
    offset = 0
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # only a hole remains
                return
            raise
        end = os.lseek(fd, start, os.SEEK_HOLE)
        yield start, end
        offset = end
