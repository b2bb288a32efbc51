"""What clients send to build from: Dockerfile build contexts and E2B's file uploads, both tars
(gzip'd or not) that an API-key holder chooses.

Each is bounded where it could exhaust the node: the body as sent (``max_upload_mb``,
checked while it streams to disk, 413), what it unpacks to (``max_unpacked_mb``: the tar
after decompression and the files it writes) and its entries (``max_upload_entries``); every write
stops with 507 when the data dir's filesystem gets within ``disk_headroom_mb`` of full. Entries
are read through `aenv.images.unpack.TarStream`: tarfile alone would hold a header as large as
the archive says in memory and keep every member it has read.

E2B uploads are a cache by files hash (the SDK asks whether a hash is present before uploading
it, then starts the build that uses it): one is removed once no build start is unpacking it and
nothing has used it for ``upload_ttl`` seconds.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tarfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from aenv.config import Settings
from aenv.errors import AenvError, InvalidRequest, PayloadTooLarge
from aenv.images.unpack import UNREADABLE, TarStream, decompressed, unpacks_too_much
from aenv.storage import space
from aenv.storage.confined import (
    NEW_FILE_FLAGS,
    PathRefused,
    dir_at,
    entry_parts,
    lstat_at,
    open_root,
    parent_at,
    remove_at,
    remove_tree,
)
from aenv.storage.layers import new_id
from aenv.storage.space import MiB

log = logging.getLogger("aenv.templates")

FILES_HASH = re.compile(r"[0-9A-Za-z]{1,128}")  # the SDKs send a sha256 in hex
UPLOAD_SETTING = "AENV_MAX_UPLOAD_MB"
UNPACKED_SETTING = "AENV_MAX_UNPACKED_MB"
ENTRIES_SETTING = "AENV_MAX_UPLOAD_ENTRIES"


@dataclass(frozen=True)
class ContextLimits:
    upload: int  # bytes of a body as sent
    unpacked: int  # bytes of its tar after decompression, and of the files it holds
    entries: int
    headroom: int  # bytes kept free on the data dir's filesystem

    @classmethod
    def of(cls, settings: Settings) -> ContextLimits:
        return cls(
            upload=settings.max_upload_mb * MiB,
            unpacked=settings.max_unpacked_mb * MiB,
            entries=settings.max_upload_entries,
            headroom=space.headroom(settings),
        )

    async def receive(self, body: AsyncIterator[bytes], dest: Path, declared: int | None, what: str) -> int:
        """Stream a request body into the new file ``dest`` (see `space.receive`)."""
        return await space.receive(
            body, dest, declared=declared, limit=self.upload, headroom=self.headroom, what=what, setting=UPLOAD_SETTING
        )


def context_members(
    raw: IO[bytes], limits: ContextLimits, what: str
) -> Iterator[tuple[tarfile.TarFile, tarfile.TarInfo]]:
    """The entries of a context tar (``raw``, compressed or not), one at a time, read in bounded
    memory; stops with 413 past the unpacked or entry limit. A caller writing a regular file
    counts its size with `UnpackBudget`."""
    stream = TarStream(decompressed(raw), what, limits.unpacked, UNPACKED_SETTING)
    for entries, member in enumerate(stream.members(), 1):
        if entries > limits.entries:
            raise PayloadTooLarge(f"{what} has more than {limits.entries} entries (the node's {ENTRIES_SETTING})")
        yield member


class UnpackBudget:
    """The file bytes one context may still write, and the free space looked at as they are."""

    def __init__(self, limits: ContextLimits, what: str) -> None:
        self.limits = limits
        self.what = what
        self.written = 0
        self.space = space.SpaceWatch(limits.headroom, what)

    def spend(self, dir_fd: int, size: int) -> None:
        """Before making an entry (``size`` bytes for a file) in the directory ``dir_fd``."""
        self.written += size
        if self.written > self.limits.unpacked:
            raise unpacks_too_much(self.what, self.limits.unpacked, UNPACKED_SETTING)
        self.space.before(dir_fd, size)


class UploadCache:
    """E2B file uploads (one tar per files hash) in one directory."""

    def __init__(self, root: Path, settings: Settings) -> None:
        self.dir = root
        self.limits = ContextLimits.of(settings)
        self.ttl = settings.upload_ttl
        self._using: Counter[str] = Counter()  # hashes a build start is unpacking now

    def tar(self, files_hash: str | None) -> Path:
        """Where the upload of ``files_hash`` is kept (the hash is only ever a name in one directory)."""
        if not files_hash or not FILES_HASH.fullmatch(files_hash):
            raise InvalidRequest(f"bad files hash {files_hash!r}")
        self.dir.mkdir(exist_ok=True)
        return self.dir / f"{files_hash}.tar"

    def has(self, files_hash: str) -> bool:
        """Whether it is here; if so, it counts as used (the SDK will not upload it again, and
        names it in the build it starts next)."""
        path = self.tar(files_hash)
        try:
            os.utime(path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    async def receive(self, files_hash: str, body: AsyncIterator[bytes], declared: int | None) -> None:
        final = self.tar(files_hash)
        part = final.with_name(f"{final.name}.{new_id()}.part")
        await self.limits.receive(body, part, declared, f"the upload of files {files_hash}")
        os.rename(part, final)

    @contextmanager
    def using(self, files_hash: str) -> Iterator[Path]:
        """The upload of ``files_hash``, never collected while in use; used again when done."""
        path = self.tar(files_hash)
        self._using[files_hash] += 1
        try:
            yield path
        finally:
            self._using[files_hash] -= 1
            if self._using[files_hash] <= 0:
                del self._using[files_hash]
            try:
                os.utime(path, follow_symlinks=False)
            except FileNotFoundError:
                pass

    def collect(self) -> list[str]:
        """Remove uploads unused for the TTL; returns their hashes. Runs on the event loop, as
        `has` does, so nothing reports an upload present that is removed right after."""
        if not self.dir.is_dir():
            return []
        removed = []
        now = time.time()
        for entry in os.scandir(self.dir):
            files_hash = entry.name.removesuffix(".tar")
            if not entry.name.endswith(".tar") or files_hash in self._using:
                continue
            try:
                idle = now - entry.stat(follow_symlinks=False).st_mtime
            except FileNotFoundError:
                continue
            if idle >= self.ttl:
                os.unlink(entry.path)
                removed.append(files_hash)
        if removed:
            log.info("removed %d E2B uploads unused for %.0f s", len(removed), self.ttl)
        return removed

    def sweep(self) -> None:
        """At start: remove uploads a stop interrupted, and build contexts older versions kept here."""
        if not self.dir.is_dir():
            return
        for entry in os.scandir(self.dir):
            if entry.is_dir(follow_symlinks=False):
                remove_tree(Path(entry.path), ignore_errors=True)
            elif entry.name.endswith(".part"):
                os.unlink(entry.path)


def unpack_context(raw: Path, dest: Path, limits: ContextLimits, what: str = "the build context") -> None:
    """Unpack a tar a client or an operator handed over (a build context, E2B files, an image
    archive; compressed or not) into ``dest``.

    Directories and regular files, links kept as links whatever they point at (a build resolves
    them inside the context, COPY copies them as links), hardlinks to files unpacked before them.
    Nothing is written through a link or outside ``dest``; names with ``..``, absolute names,
    devices and FIFOs are refused (400). Bounded as this module says: 413 past the unpacked size
    or the entry limit, 507 when the disk is nearly full."""
    dest.mkdir(parents=True, exist_ok=True)
    root = open_root(dest)
    budget = UnpackBudget(limits, what)
    try:
        with open(raw, "rb") as file:
            for tar, member in context_members(file, limits, what):
                _context_entry(tar, member, root, budget)
    except AenvError:
        raise
    except UNREADABLE as exc:
        raise InvalidRequest(f"{what} is not a readable tar: {exc}") from exc
    finally:
        os.close(root)


def _context_entry(tar: tarfile.TarFile, member: tarfile.TarInfo, root: int, budget: UnpackBudget) -> None:
    label = f"{budget.what}: entry"
    parts = entry_parts(member.name, label)
    if not parts:
        return  # the context's own directory
    if not (member.isdir() or member.isreg() or member.issym() or member.islnk()):
        raise PathRefused(f"{label} {member.name!r}: devices and FIFOs have no place in {budget.what}")
    parent = parent_at(root, parts, label, create=True)
    try:
        budget.spend(parent, member.size if member.isreg() else 0)  # every entry takes an inode
        name = parts[-1]
        if member.isdir():
            fd = dir_at(parent, name)
            try:
                os.fchmod(fd, member.mode & 0o7777)
            finally:
                os.close(fd)
            return
        remove_at(parent, name)  # a later entry replaces an earlier one, as tar does
        if member.issym():
            os.symlink(member.linkname, name, dir_fd=parent)
        elif member.islnk():
            _context_hardlink(root, member, parent, name, label)
        else:
            source = tar.extractfile(member)
            assert source is not None
            with os.fdopen(os.open(name, NEW_FILE_FLAGS, 0o600, dir_fd=parent), "wb") as out:
                shutil.copyfileobj(source, out, 1 << 20)
                os.fchmod(out.fileno(), member.mode & 0o7777)
    finally:
        os.close(parent)


def _context_hardlink(root: int, member: tarfile.TarInfo, parent: int, name: str, label: str) -> None:
    target = entry_parts(member.linkname, f"{label} {member.name!r}: hardlink")
    holder = parent_at(root, target, label, create=False) if target else None
    try:
        st = lstat_at(holder, target[-1]) if holder is not None else None
        if holder is None or st is None or not stat.S_ISREG(st.st_mode):
            raise PathRefused(f"{label} {member.name!r} links to {member.linkname!r}, not a file before it")
        os.link(target[-1], name, src_dir_fd=holder, dst_dir_fd=parent, follow_symlinks=False)
    finally:
        if holder is not None:
            os.close(holder)
