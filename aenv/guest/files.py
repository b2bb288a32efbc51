"""Filesystem operations inside the sandbox, answering in E2B envd's filesystem.Filesystem shapes."""

from __future__ import annotations

import errno
import math
import os
import stat
import time
from collections.abc import Iterator
from typing import Any

from aenv.guest import metadata, safeio
from aenv.guest.users import User, name_of_gid, name_of_uid

# /proc and /sys files report size 0 and may hold anything, or never end: read whole up to this.
UNSIZED_READ_LIMIT = 16 * 2**20


class FileError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def resolve(path: str, user: User, workdir: str | None = None) -> str:
    """Upstream's rules: '' is the workdir, '~' the user's home, relative paths are under home."""
    if not path:
        return workdir or user.home
    if path == "~":
        return user.home
    if path.startswith("~/"):
        return os.path.normpath(os.path.join(user.home, path[2:]))
    if not path.startswith("/"):
        return os.path.normpath(os.path.join(user.home, path))
    return os.path.normpath(path)


def _go_permissions(mode: int) -> str:
    """Go's os.FileMode.String() of a stat mode, as envd reports it: a letter for each type or
    special bit set, in Go's order ("dalTLDpSugct?"), then the nine rwx permission bits."""
    kind = stat.S_IFMT(mode)
    flags = (
        (kind == stat.S_IFDIR, "d"),
        (kind == stat.S_IFLNK, "L"),
        (kind in (stat.S_IFBLK, stat.S_IFCHR), "D"),
        (kind == stat.S_IFIFO, "p"),
        (kind == stat.S_IFSOCK, "S"),
        (bool(mode & stat.S_ISUID), "u"),
        (bool(mode & stat.S_ISGID), "g"),
        (kind == stat.S_IFCHR, "c"),
        (bool(mode & stat.S_ISVTX), "t"),
    )
    letters = "".join(letter for is_set, letter in flags if is_set) or "-"
    return letters + "".join(c if mode & (0o400 >> i) else "-" for i, c in enumerate("rwxrwxrwx"))


def _rfc3339(ts: float) -> str:
    """As datetime's isoformat() in UTC (microseconds when there are any), without datetime."""
    frac, whole = math.modf(ts)  # rounding the fraction alone, as datetime does
    seconds, micros = divmod(int(whole) * 1_000_000 + round(frac * 1_000_000), 1_000_000)
    t = time.gmtime(seconds)
    text = f"{t.tm_year:04d}-{t.tm_mon:02d}-{t.tm_mday:02d}T{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d}"
    return text + (f".{micros:06d}" if micros else "") + "Z"


def _entry_type(mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return "FILE_TYPE_FILE"
    if stat.S_ISDIR(mode):
        return "FILE_TYPE_DIRECTORY"
    return None  # FIFOs, sockets, devices: envd's FILE_TYPE_UNSPECIFIED, left out of the message


def real_path(path: str, real_parent: str | None = None) -> str:
    """``path`` with its directory's symlinks resolved (a final symlink stays itself): the key of
    the metadata store. ``real_parent``: the directory's real path, when known."""
    parent, name = os.path.split(path)
    return os.path.join(real_parent or os.path.realpath(parent), name) if name else path


def entry_info(path: str, real_parent: str | None = None) -> dict[str, Any]:
    """envd's EntryInfo of ``path``, not following a final symlink, with envd's rules: ``mode`` is
    the permission bits only; a symlink is reported with the type and permission bits of what it
    finally leads to and that target's absolute path (a broken or looping link: no type, mode 0,
    the link's own path as target); ``permissions``, size, owner and time are the link's own; the
    metadata is what the path leads to has. ``real_parent``: the real path of its directory."""
    st = os.lstat(path)
    target: os.stat_result | None = st
    info: dict[str, Any] = {"name": os.path.basename(path) or "/", "path": path}
    if stat.S_ISLNK(st.st_mode):
        try:
            resolved = os.path.realpath(path, strict=True)
            target = os.stat(resolved)
        except OSError:  # broken, looping or unreadable on the way
            resolved, target = path, None
        info["symlinkTarget"] = resolved
    kind = _entry_type(target.st_mode) if target is not None else None
    if kind is not None:
        info["type"] = kind
    info.update(
        size=st.st_size,
        mode=stat.S_IMODE(target.st_mode) & 0o777 if target is not None else 0,
        permissions=_go_permissions(st.st_mode),
        owner=name_of_uid(st.st_uid),
        group=name_of_gid(st.st_gid),
        modifiedTime=_rfc3339(st.st_mtime),
    )
    if target is not None:
        found = metadata.read(path, target, lambda: info.get("symlinkTarget") or real_path(path, real_parent))
        if found:
            info["metadata"] = found
    return info


# What a sandbox's file system answers a client's request is the client's to hear (a 4xx): the path
# it named, in the state the sandbox is in. Anything not named here is failed_precondition.
# ENOSPC/EDQUOT stay apart: the host answers them as envd does (507 on /files, internal on Connect).
_CODES = {
    errno.ENOENT: "not_found",
    errno.EACCES: "permission_denied",
    errno.EPERM: "permission_denied",
    errno.EROFS: "permission_denied",
    errno.ENAMETOOLONG: "invalid_argument",
    errno.ELOOP: "invalid_argument",
    errno.EINVAL: "invalid_argument",
    errno.ENOTDIR: "invalid_argument",
    errno.EISDIR: "invalid_argument",
    errno.EEXIST: "already_exists",
    errno.ENOSPC: "resource_exhausted",
    errno.EDQUOT: "resource_exhausted",
}
_MESSAGES = {
    errno.ENOENT: "path '{path}' does not exist",
    errno.EACCES: "permission denied: '{path}'",
    errno.EPERM: "permission denied: '{path}'",
    errno.EROFS: "read-only file system: '{path}'",
    errno.ENOTDIR: "path '{path}' is not a directory",
    errno.EISDIR: "path '{path}' is a directory",
    errno.EEXIST: "path '{path}' already exists",
    errno.ENOSPC: "not enough disk space for '{path}'",
    errno.EDQUOT: "not enough disk space for '{path}'",
}


def translate(exc: OSError, path: str) -> FileError:
    """The answer to a client for ``exc``, met on ``path``; the message names the errno."""
    if isinstance(exc, safeio.NotRegularFile):
        return FileError("invalid_argument", f"path '{path}' is not a regular file")
    err = exc.errno or 0
    text = _MESSAGES.get(err, "{reason}: '{path}'").format(path=path, reason=exc.strerror or exc)
    return FileError(_CODES.get(err, "failed_precondition"), f"{text} ({errno.errorcode.get(err, 'error')})")


def stat_path(path: str) -> dict[str, Any]:
    try:
        return {"entry": entry_info(path)}
    except OSError as exc:
        raise translate(exc, path) from exc


def list_dir(path: str, depth: int) -> dict[str, Any]:
    depth = max(depth, 1)
    try:
        if not os.path.isdir(path):
            os.lstat(path)  # raises not_found for a missing path
            raise FileError("invalid_argument", f"path '{path}' is not a directory")
    except OSError as exc:
        raise translate(exc, path) from exc
    entries: list[dict[str, Any]] = []
    # Each entry followed by what is below it, in name order, without recursion: a tree may be
    # nested deeper than Python's recursion limit.
    stack: list[tuple[str, str | None, int, Iterator[str]]] = []
    _descend(stack, path, 1)
    while stack:
        directory, real_directory, level, names = stack[-1]
        name = next(names, None)
        if name is None:
            stack.pop()
            continue
        full = os.path.join(directory, name)
        try:
            entries.append(entry_info(full, real_directory))
        except OSError:
            continue
        if level < depth and os.path.isdir(full) and not os.path.islink(full):
            _descend(stack, full, level + 1)
    return {"entries": entries}


def _descend(stack: list[tuple[str, str | None, int, Iterator[str]]], directory: str, level: int) -> None:
    try:
        names = iter(sorted(os.listdir(directory)))
    except OSError:
        return
    real = os.path.realpath(directory) if len(metadata.STORE) else None  # once per directory, not per entry
    stack.append((directory, real, level, names))


def _chown(path: str, user: User) -> None:
    if os.getuid() == 0:
        os.lchown(path, user.uid, user.gid)


def make_parents(path: str, user: User) -> None:
    """mkdir -p for the parent of ``path``; directories it creates belong to ``user``."""
    parent = os.path.dirname(path)
    missing: list[str] = []
    while parent and not os.path.exists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    for directory in reversed(missing):
        os.mkdir(directory)
        _chown(directory, user)


def make_dir(path: str, user: User) -> dict[str, Any]:
    try:
        if os.path.isdir(path):
            raise FileError("already_exists", f"directory '{path}' already exists")
        if os.path.lexists(path):
            raise FileError("invalid_argument", f"path '{path}' already exists and is not a directory")
        make_parents(path, user)
        os.mkdir(path)
        _chown(path, user)
        metadata.STORE.removed(real_path(path))  # what a directory removed behind the agent's back had
        return {"entry": entry_info(path)}
    except OSError as exc:
        raise translate(exc, path) from exc


def move(source: str, destination: str, user: User) -> dict[str, Any]:
    try:
        os.lstat(source)
    except OSError as exc:
        raise translate(exc, source) from exc
    try:
        make_parents(destination, user)
        real_source = real_path(source)
        try:
            os.rename(source, destination)
            metadata.STORE.moved(real_source, real_path(destination))  # a rename keeps the inode, and its xattrs
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            import shutil  # on first use: see aenv/guest/__main__.py

            shutil.move(source, destination, copy_function=_copy_regular)
            metadata.STORE.removed(real_source)
        return {"entry": entry_info(destination)}
    except OSError as exc:
        raise translate(exc, destination) from exc


def _copy_regular(source: str, destination: str) -> None:
    """A move's copy across file systems, of regular files only: a device would never end. The
    metadata comes along, whichever file system keeps it on either side."""
    import shutil

    src = safeio.open_regular(source, os.O_RDONLY)
    try:
        carried = metadata.read(source, os.fstat(src), lambda: os.path.realpath(source)) or {}
        dst = safeio.open_regular(destination, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with open(src, "rb", closefd=False) as reader, open(dst, "wb", closefd=False) as writer:
                shutil.copyfileobj(reader, writer)
            metadata.write(dst, os.path.realpath(destination), carried)
        finally:
            os.close(dst)
    finally:
        os.close(src)
    shutil.copystat(source, destination)


def remove(path: str) -> dict[str, Any]:
    try:
        real = real_path(path)
        if os.path.isdir(path) and not os.path.islink(path):
            import shutil

            shutil.rmtree(path)
        else:
            os.unlink(path)
        metadata.STORE.removed(real)
    except FileNotFoundError:
        pass  # like rm -rf, a missing path is fine
    except OSError as exc:
        raise translate(exc, path) from exc
    return {}


def _stat_or_none(path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None


def open_for_read(path: str) -> tuple[int, dict[str, Any]]:
    """An open regular file and its entry, whose size is what the file holds now."""
    try:
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode):
            raise FileError("invalid_argument", f"path '{path}' is a directory")
        safeio.check_regular(st, path)
        fd = safeio.open_regular(path, os.O_RDONLY)
        try:
            entry = entry_info(path)
            entry["size"] = os.fstat(fd).st_size  # the target's, when the path is a symlink
        except BaseException:
            os.close(fd)
            raise
        return fd, entry
    except OSError as exc:
        raise translate(exc, path) from exc


def read_unsized(fd: int, path: str) -> bytes:
    """All of a regular file that reports size 0 (the size sent ahead of the data must be the
    data's), refused past UNSIZED_READ_LIMIT."""
    data = bytearray()
    try:
        while chunk := os.read(fd, 2**16):
            data += chunk
            if len(data) > UNSIZED_READ_LIMIT:
                limit = UNSIZED_READ_LIMIT >> 20
                raise FileError("invalid_argument", f"path '{path}' reports no size and holds more than {limit} MiB")
    except OSError as exc:
        raise translate(exc, path) from exc
    return bytes(data)


def open_for_write(path: str, user: User) -> int:
    try:
        existing = _stat_or_none(path)
        if existing is not None and stat.S_ISDIR(existing.st_mode):
            raise FileError("invalid_argument", f"path '{path}' is a directory")
        if existing is not None:
            safeio.check_regular(existing, path)
        make_parents(path, user)
        fd = safeio.open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            if existing is None and os.getuid() == 0:
                os.fchown(fd, user.uid, user.gid)
        except BaseException:
            os.close(fd)
            raise
        return fd
    except OSError as exc:
        raise translate(exc, path) from exc


def check_metadata_room(path: str, wanted: dict[str, str]) -> None:
    """Refuse an upload whose metadata could not be kept before a byte of it is written."""
    if wanted:
        try:
            metadata.STORE.room_for(path, metadata.as_attrs(wanted))
        except metadata.Full as exc:
            raise _no_metadata_room(exc) from exc


def set_metadata(fd: int, path: str, wanted: dict[str, str]) -> dict[str, str] | None:
    """Give the file just written at ``path`` (open as ``fd``) exactly ``wanted`` as its metadata
    (none clears what an earlier upload set, as envd) and return what it has now."""
    real = os.path.realpath(path)
    try:
        metadata.write(fd, real, wanted)
        return metadata.read(path, os.fstat(fd), lambda: real)
    except metadata.Full as exc:
        raise _no_metadata_room(exc) from exc
    except OSError as exc:
        raise translate(exc, path) from exc


def _no_metadata_room(exc: OSError) -> FileError:
    return FileError("resource_exhausted", f"not enough space for file metadata: {exc.strerror}")


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
