"""Apply one OCI layer (a tar, plain, gzip, zstd, bzip2 or xz) to a directory that overlayfs uses as a lower.

OCI whiteouts become overlayfs ones: ``.wh.NAME`` a 0/0 character device named NAME,
``.wh..wh..opq`` the ``trusted.overlay.opaque`` attribute on its directory. Nothing in a layer
may land outside the directory: entries are written from directory fds, never through a link;
``..`` components, paths through a symlink the layer made, and whiteouts of no name (``.wh.``,
``.wh..``, ``.wh...``) are refused. Device nodes are not kept (see `_entry`). The uncompressed
stream is hashed as it is read, so a layer whose content is not its diff_id never becomes visible.

What a layer unpacks to is bounded (`Bounds`, `Meter`): a gzip bomb of 2 MiB writes 2 GiB, a zstd
one far more, and a tar entry can say its file is a sparse one of any size. The decompressed
stream is counted as it comes out of the decompressor (and a sparse file at its full size, and
each entry's declared size before a byte of it is written), against a total and against a ratio
to the layer's compressed size past a floor; entries are counted too. An image's layers together
are held to the same bounds (a pull's `Meter` that each layer's passes its growth on to).
"""

from __future__ import annotations

import _compression
import bz2
import gzip
import hashlib
import io
import json
import logging
import lzma
import os
import re
import stat
import sys
import tarfile
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import zstandard

from aenv.config import Settings
from aenv.errors import AenvError, InvalidRequest, PayloadTooLarge
from aenv.storage.confined import (
    NEW_FILE_FLAGS,
    OPAQUE_XATTR,
    XATTR_PREFIXES,
    PathRefused,
    chown_at,
    dir_at,
    entry_parts,
    lstat_at,
    open_root,
    parent_at,
    remove_at,
)
from aenv.storage.space import SpaceWatch

log = logging.getLogger("aenv.images")

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
AUFS_META = ".wh..wh."  # AUFS bookkeeping (.wh..wh.plnk, ...), not content
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
BZIP2_MAGIC = re.compile(rb"BZh[1-9]1AY&SY")  # and the first block's magic: "BZh" alone can start a file name
XZ_MAGIC = b"\xfd7zXZ\x00"
XZ_MEMORY = 128 << 20  # what decoding an xz stream may take, as zstd's default window limit
WHAT = "layer entry"
MAX_HEADERS = 1 << 20  # one entry's headers: pax records (attributes), long names, a sparse map
SPACE_CHECK = 64 << 20  # file bytes unpacked between two looks at the free space
REPORT_BYTES = 4 << 20  # a layer unpacking in a process of its own tells its growth this often
REPORT_ENTRIES = 4096  # ... or once this many entries
# What reading a damaged archive raises, from the tar reader or one of the decompressors
# (tarfile parses some headers' numbers with int(): a GNU sparse map of words is a ValueError).
UNREADABLE = (tarfile.TarError, OSError, EOFError, ValueError, zlib.error, lzma.LZMAError, zstandard.ZstdError)


class LayerError(InvalidRequest):
    """A layer that is corrupt, hostile, or not what its digest says."""


GrowthFn = Callable[[int, int], None]  # (bytes, entries) a layer grew by: raises past a bound


@dataclass(frozen=True)
class Bounds:
    """How far a layer, or an image's layers together, may unpack: at most ``unpacked`` bytes, at
    most ``ratio`` times the compressed size once past ``floor`` bytes, at most ``entries``
    entries. ``settings`` name them in refusals (unpacked, ratio, floor, entries)."""

    unpacked: int
    ratio: float
    floor: int
    entries: int
    settings: tuple[str, str, str, str]

    @classmethod
    def layer(cls, settings: Settings) -> Bounds:
        return cls(
            settings.max_layer_unpacked_mb << 20,
            settings.max_layer_ratio,
            settings.layer_ratio_floor_mb << 20,
            settings.max_layer_entries,
            LAYER_SETTINGS,
        )

    @classmethod
    def image(cls, settings: Settings) -> Bounds:
        return cls(
            settings.max_image_unpacked_mb << 20,
            settings.max_layer_ratio,
            settings.layer_ratio_floor_mb << 20,
            settings.max_image_entries,
            IMAGE_SETTINGS,
        )

    def to_json(self) -> str:
        return json.dumps([self.unpacked, self.ratio, self.floor, self.entries, list(self.settings)])

    @classmethod
    def from_json(cls, text: str) -> Bounds:
        unpacked, ratio, floor, entries, settings = json.loads(text)
        return cls(int(unpacked), float(ratio), int(floor), int(entries), tuple(settings))


LAYER_SETTINGS = (
    "AENV_MAX_LAYER_UNPACKED_MB",
    "AENV_MAX_LAYER_RATIO",
    "AENV_LAYER_RATIO_FLOOR_MB",
    "AENV_MAX_LAYER_ENTRIES",
)
IMAGE_SETTINGS = ("AENV_MAX_IMAGE_UNPACKED_MB", *LAYER_SETTINGS[1:3], "AENV_MAX_IMAGE_ENTRIES")


def amount(size: int | float) -> str:
    """``size`` bytes as people read it: 64 GiB, 256 MiB, 1.5 MiB, 300 bytes."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            return f"{size / (1 << shift):.3g} {unit}"
    return f"{int(size)} bytes"


class Meter:
    """What ``what`` (a layer, or an image) has unpacked so far, held to ``bounds`` for its
    ``compressed`` size as it grows: 413 naming the bound passed. Each growth is passed on to
    ``then`` (the image's meter, or a report to it) once within the bounds. Thread-safe: the
    layers of one image unpack at once."""

    def __init__(self, what: str, bounds: Bounds, compressed: int, then: GrowthFn | None = None) -> None:
        self.what, self.bounds, self.compressed, self.then = what, bounds, compressed, then
        by_ratio = max(bounds.floor, int(bounds.ratio * compressed))
        self.limit = min(bounds.unpacked, by_ratio)
        self.by_ratio = by_ratio < bounds.unpacked  # the ratio (or its floor) is the bound that holds
        self.bytes = 0  # the decompressed tar, and sparse files' holes
        self.entries = 0
        self._lock = threading.Lock()

    def add(self, size: int, entries: int = 0) -> None:
        with self._lock:
            self.bytes += size
            self.entries += entries
            self._check(self.bytes, self.entries)
        if self.then is not None:
            self.then(size, entries)

    def expect(self, total: int) -> None:
        """Refuse now if the layer will have unpacked ``total`` bytes (an entry's end, as its
        header says): not a byte of a file past a bound is written."""
        with self._lock:
            self._check(total, self.entries)

    def _check(self, size: int, entries: int) -> None:
        bounds = self.bounds
        unpacked, ratio, floor, entry_setting = bounds.settings
        if entries > bounds.entries:
            raise PayloadTooLarge(f"{self.what} has more than {bounds.entries} entries (the node's {entry_setting})")
        if size <= self.limit:
            return
        if self.by_ratio:
            raise PayloadTooLarge(
                f"{self.what} expands more than {bounds.ratio:g}x its compressed size of {amount(self.compressed)}:"
                f" more than {amount(self.limit)} (the node's {ratio}, applied past {floor}: {amount(bounds.floor)})"
            )
        raise PayloadTooLarge(f"{self.what} unpacks to more than {amount(self.limit)} (the node's {unpacked})")


class _Hashing(io.RawIOBase):
    """Hashes what passes through it (the uncompressed tar, for the diff_id), and counts it
    against ``meter``: as it comes out of the decompressor, before the tar reader sees it."""

    def __init__(self, inner: IO[bytes], meter: Meter | None = None) -> None:
        self.inner = inner
        self.meter = meter
        self.sha = hashlib.sha256()
        self.size = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self.inner.read(len(buffer))
        n = len(data)
        buffer[:n] = data
        self.sha.update(data)
        self.size += n
        if self.meter is not None:
            self.meter.add(n)
        return n


class _Prefixed(io.RawIOBase):
    """A stream that cannot seek back, with the bytes read from its start put in front again."""

    def __init__(self, head: bytes, inner: IO[bytes]) -> None:
        self.head, self.inner = head, inner

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self.head:
            n = min(len(buffer), len(self.head))
            buffer[:n], self.head = self.head[:n], self.head[n:]
            return n
        data = self.inner.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def decompressed(raw: IO[bytes]) -> IO[bytes]:
    """``raw`` (a file, or a stream such as a pipe), decompressed as its first bytes say: gzip,
    zstd, bzip2, xz, or none."""
    if raw.seekable():
        head = raw.read(10)
        raw.seek(0)
    else:
        head = b""
        while len(head) < 10 and (more := raw.read(10 - len(head))):
            head += more
        raw = io.BufferedReader(_Prefixed(head, raw), buffer_size=1 << 20)
    if head.startswith(GZIP_MAGIC):
        # a file object like BZ2File, which typeshed declares an IO[bytes] but not GzipFile
        return cast(IO[bytes], gzip.GzipFile(fileobj=raw, mode="rb"))
    if head.startswith(ZSTD_MAGIC):
        return zstandard.ZstdDecompressor().stream_reader(raw)
    if BZIP2_MAGIC.match(head):
        return bz2.BZ2File(raw)
    if head.startswith(XZ_MAGIC):
        # lzma.LZMAFile takes no memory limit, and an xz header names the dictionary its decoder
        # fills: a 150 KiB upload held 1 GiB of the node's memory while it unpacked. What
        # LZMAFile reads through, with the limit zstd has by default (xz -9 needs 65 MiB).
        reader = _compression.DecompressReader(
            raw, lzma.LZMADecompressor, trailing_error=lzma.LZMAError, memlimit=XZ_MEMORY
        )
        return io.BufferedReader(reader)
    return raw


def unpacks_too_much(what: str, limit: int, setting: str) -> PayloadTooLarge:
    return PayloadTooLarge(f"{what} unpacks to more than {limit >> 20} MiB (the node's {setting})")


class TarStream:
    """A tar as tarfile reads it, entry after entry: counted (past ``limit``, 413 naming
    ``setting``) and, while tarfile reads an entry's headers, bounded by `MAX_HEADERS`: it holds
    a pax header, a long name or a sparse map in memory whole, as large as the archive says."""

    def __init__(self, inner: IO[bytes], what: str, limit: int | None = None, setting: str = "") -> None:
        self.inner = inner
        self.what = what
        self.limit = limit
        self.setting = setting
        self.total = 0
        self.headers: int | None = 0  # None while an entry's content is read

    def read(self, size: int = -1) -> bytes:
        data = self.inner.read(size if size >= 0 else MAX_HEADERS)
        self.total += len(data)
        if self.limit is not None and self.total > self.limit:
            raise unpacks_too_much(self.what, self.limit, self.setting)
        if self.headers is not None:
            self.headers += len(data)
            if self.headers > MAX_HEADERS:
                raise PayloadTooLarge(f"{self.what}: an entry's tar headers are larger than {MAX_HEADERS >> 20} MiB")
        return data

    def members(self) -> Iterator[tuple[tarfile.TarFile, tarfile.TarInfo]]:
        """The entries, one at a time (tarfile would keep every one it read: not a million)."""
        with tarfile.open(fileobj=self, mode="r|") as tar:  # type: ignore[call-overload]
            while True:
                self.headers = 0
                member = tar.next()
                self.headers = None
                if member is None:
                    return
                tar.members.clear()
                if "\0" in member.name or "\0" in member.linkname:  # a pax header can say so; no file can
                    raise tarfile.HeaderError(f"entry {member.name!r} has a NUL byte in its name or link")
                yield tar, member


def apply_layer(blob: Path, dest: Path, headroom: int = 0, name: str = "", meter: Meter | None = None) -> str:
    """Unpack ``blob`` into ``dest`` (created); return ``sha256:...`` of the uncompressed tar.
    Stops (507) when the disk gets within ``headroom`` bytes of full, and (413) past ``meter``'s
    bounds."""
    with open(blob, "rb") as raw:
        return apply_layer_stream(raw, dest, headroom, name or blob.name, meter)


def apply_layer_stream(
    raw: IO[bytes], dest: Path, headroom: int = 0, name: str = "", meter: Meter | None = None
) -> str:
    """:func:`apply_layer` of a layer read as it arrives (a pipe from its download). Whoever
    writes the pipe learns of a failure from its reader closing it (EPIPE)."""
    dest.mkdir(parents=True, exist_ok=True)
    root = open_root(dest)
    parents = _Parents(root)
    room = SpaceWatch(headroom, f"layer {name}", every=SPACE_CHECK)
    holes = 0  # of sparse files: written as zeros, and never in the stream
    try:
        hashing = _Hashing(decompressed(raw), meter)
        stream = io.BufferedReader(hashing, buffer_size=1 << 20)
        for tar, member in TarStream(stream, f"layer {name}").members():
            if meter is not None:
                hole = _holes(member)
                holes += hole
                meter.expect(tar.offset + holes)  # the stream up to this entry's end: declared, not yet read
                meter.add(hole, 1)
            room.before(root, member.size if member.isreg() else 0)  # every entry takes an inode
            _apply(tar, member, root, parents)
        while stream.read(1 << 20):  # tar padding after the end-of-archive blocks counts too
            pass
    except PathRefused as exc:
        raise LayerError(f"layer {name}: {exc.message}") from exc
    except AenvError:
        raise  # a full disk (507), a layer too large (413): OSErrors too, but not the layer's fault
    except UNREADABLE as exc:
        raise LayerError(f"cannot unpack layer {name}: {exc}") from exc
    finally:
        parents.close()
        os.close(root)
    return "sha256:" + hashing.sha.hexdigest()


def _holes(member: tarfile.TarInfo) -> int:
    """What a sparse entry's file has beyond the data the tar holds for it (tarfile writes it as
    zeros): its size, as the header says, less the data its sparse map names."""
    if not member.issparse():
        return 0
    runs = cast(list[tuple[int, int]], member.sparse)  # typeshed says int: a list of (offset, size)
    return max(0, member.size - sum(size for _, size in runs))


class _Parents:
    """The directories recent entries went into, by path, as fds: a layer of many files in a few
    directories is not walked from its root for each file (the walk checks every component; it is
    made once per directory). An entry that removes or replaces a path drops the fds of it and of
    what is below it first, so a cached fd is always what the walk would find again."""

    KEEP = 64

    def __init__(self, root: int) -> None:
        self.root = root
        self.fds: OrderedDict[tuple[str, ...], int] = OrderedDict()

    def of(self, parts: list[str]) -> int:
        """The directory holding ``parts[-1]`` (the cache's: not to be closed)."""
        key = tuple(parts[:-1])
        fd = self.fds.get(key)
        if fd is not None:
            self.fds.move_to_end(key)
            return fd
        fd = parent_at(self.root, parts, WHAT, create=True)
        self.fds[key] = fd
        if len(self.fds) > self.KEEP:
            os.close(self.fds.popitem(last=False)[1])
        return fd

    def remove(self, parent: int, parts: tuple[str, ...]) -> None:
        """``remove_at`` of the entry ``parts`` (in ``parent``), forgetting what was below it."""
        if lstat_at(parent, parts[-1]) is None:
            return
        for key in [k for k in self.fds if k[: len(parts)] == parts]:
            os.close(self.fds.pop(key))
        remove_at(parent, parts[-1])

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _apply(tar: tarfile.TarFile, member: tarfile.TarInfo, root: int, parents: _Parents) -> None:
    parts = entry_parts(member.name, WHAT, absolute_ok=True)
    if not parts:
        return  # the layer's root: an overlay takes its attributes from the top layer
    if parts[0].startswith(AUFS_META):
        return  # AUFS bookkeeping (.wh..wh.plnk/ holds hardlinks' originals): skipped, as Docker does
    if any(part.startswith(WHITEOUT) for part in parts[:-1]):  # the prefix is reserved for whiteouts
        raise PathRefused(f"{WHAT} {member.name!r} is inside a whiteout")
    _entry(tar, member, root, parents.of(parts), tuple(parts), parents)


def _entry(
    tar: tarfile.TarFile, member: tarfile.TarInfo, root: int, parent: int, path: tuple[str, ...], parents: _Parents
) -> None:
    name = path[-1]
    if name == OPAQUE:
        os.setxattr(parent, OPAQUE_XATTR, b"y")
        return
    if name.startswith(AUFS_META):
        return
    if name.startswith(WHITEOUT):
        hidden = name[len(WHITEOUT) :]
        if hidden not in ("", ".", ".."):
            parents.remove(parent, (*path[:-1], hidden))
        _whiteout(parent, hidden, member.name)
        return
    if member.ischr() or member.isblk():
        # Device nodes in images are normal (an exported /dev), but the host must never hold a
        # node that opens one of its own devices: a sandbox gets its /dev from the runtime, so
        # they are skipped. A 0/0 character device already is an overlay whiteout: kept as one.
        if member.ischr() and member.devmajor == 0 and member.devminor == 0:
            parents.remove(parent, path)
            _whiteout(parent, name, member.name)
        else:
            log.info("layer entry %s: device node %d:%d skipped", member.name, member.devmajor, member.devminor)
        return
    if member.isdir():
        fd = dir_at(parent, name)
        try:
            _attributes(fd, member)
        finally:
            os.close(fd)
        return
    parents.remove(parent, path)  # a later entry replaces an earlier one, as tar does
    if member.isreg():
        source = tar.extractfile(member)
        assert source is not None
        fd = os.open(name, NEW_FILE_FLAGS, 0o600, dir_fd=parent)
        try:
            while chunk := source.read(1 << 20):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view) :]
            _attributes(fd, member)
        finally:
            os.close(fd)
    elif member.issym():
        os.symlink(member.linkname, name, dir_fd=parent)
        chown_at(parent, name, member.uid, member.gid)
    elif member.islnk():
        # The link's metadata is its target's: nothing to set (and nothing followed to set it).
        target = entry_parts(member.linkname, WHAT, absolute_ok=True)
        if not target:
            raise PathRefused(f"{WHAT} {member.name!r} is a hardlink to the layer's root")
        holder = parent_at(root, target, WHAT, create=False)
        try:
            os.link(target[-1], name, src_dir_fd=holder, dst_dir_fd=parent, follow_symlinks=False)
        finally:
            os.close(holder)
    elif member.isfifo():
        os.mkfifo(name, 0o600, dir_fd=parent)
        chown_at(parent, name, member.uid, member.gid)
        os.chmod(name, member.mode & 0o7777, dir_fd=parent)  # made just now by us: no link there
    # exotic entries (contiguous files, volume labels): not in images we take


def _whiteout(parent: int, hidden: str, entry: str) -> None:
    if hidden in ("", ".", ".."):
        raise PathRefused(f"{WHAT} {entry!r} is a whiteout of no file")
    remove_at(parent, hidden)
    os.mknod(hidden, stat.S_IFCHR | 0o000, os.makedev(0, 0), dir_fd=parent)


def _attributes(fd: int, member: tarfile.TarInfo) -> None:
    chown_at(None, fd, member.uid, member.gid)
    os.fchmod(fd, member.mode & 0o7777)  # after the chown, which clears set-id bits
    os.utime(fd, (member.mtime, member.mtime))
    for key, value in (member.pax_headers or {}).items():
        attribute = key[len("SCHILY.xattr.") :]
        if key.startswith("SCHILY.xattr.") and attribute.startswith(XATTR_PREFIXES):
            try:
                os.setxattr(fd, attribute, value.encode("latin-1"))
            except (OSError, ValueError):  # ValueError: a NUL byte in its name
                pass  # an attribute this filesystem does not take is not worth the layer


class Report:
    """A layer's growth told to the pull that started this process (its image's `Meter`): one
    JSON line ``{"grew": [bytes, entries]}`` once every `REPORT_BYTES` or `REPORT_ENTRIES`."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.bytes = self.entries = 0

    def __call__(self, size: int, entries: int) -> None:
        self.bytes += size
        self.entries += entries
        if self.bytes >= REPORT_BYTES or self.entries >= REPORT_ENTRIES:
            self.flush()

    def flush(self) -> None:
        if self.bytes or self.entries:
            self.out.write(json.dumps({"grew": [self.bytes, self.entries]}) + "\n")
            self.out.flush()
            self.bytes = self.entries = 0


def main(argv: list[str]) -> int:
    """``python -m aenv.images.unpack DEST HEADROOM NAME [BOUNDS COMPRESSED]``: unpack the layer
    on stdin into DEST (a pull's unpack in a process of its own: the node's interpreter lock is not
    shared with the download, and layers unpack on several cores), within BOUNDS (`Bounds` as
    JSON) for its COMPRESSED size. Prints its growth as it goes (`Report`), then ``{"digest"}``
    or ``{"error": {type, message, status}}``, one JSON line each."""
    dest, room, name = Path(argv[0]), int(argv[1]), argv[2]
    report = Report(sys.stdout)
    meter = Meter(f"layer {name}", Bounds.from_json(argv[3]), int(argv[4]), report) if len(argv) > 4 else None
    try:
        with open(0, "rb", buffering=0, closefd=False) as raw:
            digest = apply_layer_stream(raw, dest, room, name, meter)
    except AenvError as exc:
        print(json.dumps({"error": {"type": type(exc).__name__, "message": exc.message, "status": exc.status}}))
        return 1
    report.flush()
    print(json.dumps({"digest": digest}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
