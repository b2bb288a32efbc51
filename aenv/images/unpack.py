"""Apply one OCI layer (a tar, plain, gzip or zstd) to a directory that overlayfs uses as a lower.

OCI whiteouts become overlayfs ones: ``.wh.NAME`` a 0/0 character device named NAME,
``.wh..wh..opq`` the ``trusted.overlay.opaque`` attribute on its directory. Nothing in a layer
may land outside the directory: ``..`` components, and paths that would pass through a symlink
the layer made, are refused. The uncompressed stream is hashed as it is read, so a layer whose
content is not its diff_id never becomes visible.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import stat
import tarfile
from pathlib import Path
from typing import IO, Any

import zstandard

from aenv.errors import AenvError

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


class LayerError(AenvError):
    """A layer that is corrupt, hostile, or not what its digest says."""


class _Hashing(io.RawIOBase):
    """Hashes what passes through it (the uncompressed tar, for the diff_id)."""

    def __init__(self, inner: IO[bytes]) -> None:
        self.inner = inner
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
        return n


def _decompressed(raw: IO[bytes]) -> IO[bytes]:
    head = raw.read(4)
    raw.seek(0)
    if head.startswith(GZIP_MAGIC):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if head == ZSTD_MAGIC:
        return zstandard.ZstdDecompressor().stream_reader(raw)  # type: ignore[return-value]
    return raw


def _safe_path(root: Path, name: str) -> Path:
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise LayerError(f"layer entry {name!r} escapes the layer")
    here = root
    for part in parts[:-1]:
        here = here / part
        try:
            mode = os.lstat(here).st_mode
        except FileNotFoundError:
            os.mkdir(here)
            os.chmod(here, 0o755)  # not the node's umask (077): a directory the image implies
            continue
        if not stat.S_ISDIR(mode):
            raise LayerError(f"layer entry {name!r} goes through a non-directory ({part})")
    return here / parts[-1]


def _clear(path: Path) -> None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        for child in os.listdir(path):
            _clear(path / child)
        os.rmdir(path)
    else:
        os.unlink(path)


def _finish(path: Path, member: tarfile.TarInfo) -> None:
    os.lchown(path, member.uid, member.gid)
    if not member.issym():
        os.chmod(path, member.mode & 0o7777)
        os.utime(path, (member.mtime, member.mtime))
    for key, value in (member.pax_headers or {}).items():
        if key.startswith("SCHILY.xattr."):
            try:
                os.setxattr(path, key[len("SCHILY.xattr.") :], value.encode("latin-1"), follow_symlinks=False)
            except OSError:
                pass  # an attribute this filesystem does not take is not worth the layer


def apply_layer(blob: Path, dest: Path) -> str:
    """Unpack ``blob`` into ``dest`` (created); return ``sha256:...`` of the uncompressed tar."""
    dest.mkdir(parents=True, exist_ok=True)
    with open(blob, "rb") as raw:
        hashing = _Hashing(_decompressed(raw))
        stream = io.BufferedReader(hashing, buffer_size=1 << 20)
        try:
            with tarfile.open(fileobj=stream, mode="r|") as tar:
                for member in tar:
                    _apply(tar, member, dest)
            while stream.read(1 << 20):  # tar padding after the end-of-archive blocks counts too
                pass
        except (tarfile.TarError, OSError, EOFError, zstandard.ZstdError) as exc:
            raise LayerError(f"cannot unpack layer {blob.name}: {exc}") from exc
    return "sha256:" + hashing.sha.hexdigest()


def _apply(tar: tarfile.TarFile, member: tarfile.TarInfo, root: Path) -> None:
    path = _safe_path(root, member.name)
    base = path.name
    if base == OPAQUE:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.setxattr(path.parent, "trusted.overlay.opaque", b"y")
        return
    if base.startswith(WHITEOUT):
        target = path.with_name(base[len(WHITEOUT) :])
        _clear(target)
        os.mknod(target, stat.S_IFCHR | 0o000, os.makedev(0, 0))
        return
    if member.isdir():
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            _clear(path)
        path.mkdir(exist_ok=True)
        _finish(path, member)
        return
    _clear(path)
    if member.isreg():
        source = tar.extractfile(member)
        assert source is not None
        with open(path, "wb") as out:
            while chunk := source.read(1 << 20):
                out.write(chunk)
    elif member.issym():
        os.symlink(member.linkname, path)
    elif member.islnk():
        target = _safe_path(root, member.linkname)
        os.link(target, path, follow_symlinks=False)
    elif member.ischr() or member.isblk():
        kind = stat.S_IFCHR if member.ischr() else stat.S_IFBLK
        os.mknod(path, kind | (member.mode & 0o7777), os.makedev(member.devmajor, member.devminor))
    elif member.isfifo():
        os.mkfifo(path, member.mode & 0o7777)
    else:
        return  # sparse or exotic entries: not in images we take
    _finish(path, member)
