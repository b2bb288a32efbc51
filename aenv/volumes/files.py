"""A volume's content, as E2B's content API serves it: entries listed, stat'd, read, written, made,
changed and removed below the volume's directory on the host.

Sandboxes write these trees, so every step walks from the volume's root one component at a time
with ``O_NOFOLLOW`` (aenv/storage/confined.py): a link a sandbox left is an entry to list, never a
way out, and a path through one is refused. Blocking calls; the routes run them in threads.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import os
import stat
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from aenv.errors import Conflict, InvalidRequest, NotFound
from aenv.storage.confined import (
    NEW_FILE_FLAGS,
    READ_FLAGS,
    chown_at,
    entry_parts,
    lstat_at,
    open_dir_at,
    open_root,
    remove_at,
)

USER = (1000, 1000)  # the sandbox's default user: what the content API makes is theirs
MAX_DEPTH = 16
MAX_ENTRIES = 10_000
CHUNK = 1 << 20


def parts_of(path: str) -> list[str]:
    if not isinstance(path, str) or len(path) > 4096 or "\0" in path:
        raise InvalidRequest("path: at most 4096 characters, no NUL")
    return entry_parts(path, "path", absolute_ok=True)


def _when(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.UTC).isoformat().replace("+00:00", "Z")


def entry(path: str, st: os.stat_result, target: str | None = None) -> dict[str, Any]:
    kind = "directory" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else "unknown"
    if stat.S_ISLNK(st.st_mode):
        kind = "symlink"
    body: dict[str, Any] = {
        "name": path.rsplit("/", 1)[-1] or "/",
        "type": kind,
        "path": path,
        "size": st.st_size,
        "mode": stat.S_IMODE(st.st_mode),
        "uid": st.st_uid,
        "gid": st.st_gid,
        "atime": _when(st.st_atime),
        "mtime": _when(st.st_mtime),
        "ctime": _when(st.st_ctime),
    }
    if target is not None:
        body["target"] = target
    return body


def _shown(parts: list[str]) -> str:
    return "/" + "/".join(parts)


class VolumeFiles:
    def __init__(self, root: Path) -> None:
        self.root = root

    def _root(self) -> int:
        try:
            return open_root(self.root)
        except FileNotFoundError:
            raise NotFound("the volume's directory is not on this node (AENV_VOLUMES_DIR)") from None

    @contextmanager
    def _dir(self, parts: list[str], *, create: bool = False, owner: tuple[int, int] = USER) -> Iterator[int]:
        """An fd of the directory ``parts`` (made, with ``owner``, when ``create``)."""
        fd = self._root()
        try:
            for i, part in enumerate(parts):
                st = lstat_at(fd, part)
                if st is None:
                    if not create:
                        raise NotFound(f"path {_shown(parts[: i + 1])} not found")
                    os.mkdir(part, 0o700, dir_fd=fd)
                    sub = open_dir_at(fd, part)
                    os.fchmod(sub, 0o755)
                    chown_at(None, sub, *owner)
                elif not stat.S_ISDIR(st.st_mode):
                    raise InvalidRequest(f"path {_shown(parts[: i + 1])} is not a directory")
                else:
                    sub = open_dir_at(fd, part)
                os.close(fd)
                fd = sub
            yield fd
        finally:
            os.close(fd)

    def _lstat(self, parts: list[str]) -> tuple[os.stat_result, str | None]:
        if not parts:
            fd = self._root()
            try:
                return os.fstat(fd), None
            finally:
                os.close(fd)
        with self._dir(parts[:-1]) as parent:
            st = lstat_at(parent, parts[-1])
            if st is None:
                raise NotFound(f"path {_shown(parts)} not found")
            target = os.readlink(parts[-1], dir_fd=parent) if stat.S_ISLNK(st.st_mode) else None
            return st, target

    def stat(self, path: str) -> dict[str, Any]:
        parts = parts_of(path)
        st, target = self._lstat(parts)
        return entry(_shown(parts), st, target)

    def listing(self, path: str, depth: int = 1) -> list[dict[str, Any]]:
        if not 1 <= depth <= MAX_DEPTH:
            raise InvalidRequest(f"depth: between 1 and {MAX_DEPTH}")
        parts = parts_of(path)
        found: list[dict[str, Any]] = []
        with self._dir(parts) as top:
            self._walk(top, parts, depth, found)
        return found

    def _walk(self, fd: int, parts: list[str], depth: int, found: list[dict[str, Any]]) -> None:
        for name in sorted(os.listdir(fd)):
            if len(found) >= MAX_ENTRIES:
                raise InvalidRequest(f"more than {MAX_ENTRIES} entries: list a deeper directory, or less deep")
            st = lstat_at(fd, name)
            if st is None:
                continue
            target = os.readlink(name, dir_fd=fd) if stat.S_ISLNK(st.st_mode) else None
            found.append(entry(_shown([*parts, name]), st, target))
            if depth > 1 and stat.S_ISDIR(st.st_mode):
                try:
                    sub = open_dir_at(fd, name)
                except OSError:
                    continue  # swapped for something else meanwhile
                try:
                    self._walk(sub, [*parts, name], depth - 1, found)
                finally:
                    os.close(sub)

    def make_dir(self, path: str, *, owner: tuple[int, int], mode: int | None, force: bool) -> dict[str, Any]:
        """E2B's: ``force`` makes the parents, and answers a directory already there as it is
        (unchanged); without it, anything already there is a 409."""
        parts = parts_of(path)
        if not parts:
            raise Conflict("path / already exists")
        with self._dir(parts[:-1], create=force, owner=owner) as parent:
            st = lstat_at(parent, parts[-1])
            if st is not None:
                if not force:
                    raise Conflict(f"path {_shown(parts)} already exists")
                if stat.S_ISDIR(st.st_mode):
                    return entry(_shown(parts), st)
                raise Conflict(f"path {_shown(parts)} exists and is not a directory")
            os.mkdir(parts[-1], 0o700, dir_fd=parent)
            sub = open_dir_at(parent, parts[-1])
            try:
                os.fchmod(sub, 0o755 if mode is None else mode & 0o7777)
                chown_at(None, sub, *owner)
                return entry(_shown(parts), os.fstat(sub))
            finally:
                os.close(sub)

    def update(self, path: str, *, uid: int | None, gid: int | None, mode: int | None) -> dict[str, Any]:
        parts = parts_of(path)
        if not parts:
            raise InvalidRequest("path / is the volume itself")
        with self._dir(parts[:-1]) as parent:
            st = lstat_at(parent, parts[-1])
            if st is None:
                raise NotFound(f"path {_shown(parts)} not found")
            if stat.S_ISLNK(st.st_mode):
                raise InvalidRequest(f"path {_shown(parts)} is a link: its target's attributes are not changed here")
            if uid is not None or gid is not None:
                os.chown(
                    parts[-1],
                    -1 if uid is None else uid,
                    -1 if gid is None else gid,
                    dir_fd=parent,
                    follow_symlinks=False,
                )
            if mode is not None:
                os.chmod(parts[-1], mode & 0o7777, dir_fd=parent, follow_symlinks=False)
            return entry(_shown(parts), os.stat(parts[-1], dir_fd=parent, follow_symlinks=False))

    def remove(self, path: str) -> None:
        parts = parts_of(path)
        if not parts:
            raise InvalidRequest("path / is the volume itself: delete the volume instead")
        with self._dir(parts[:-1]) as parent:
            if lstat_at(parent, parts[-1]) is None:
                raise NotFound(f"path {_shown(parts)} not found")
            remove_at(parent, parts[-1])

    @contextmanager
    def reading(self, path: str) -> Iterator[tuple[int, int]]:
        """An fd of the regular file ``path`` and its size."""
        parts = parts_of(path)
        if not parts:
            raise InvalidRequest("path / is a directory")
        with self._dir(parts[:-1]) as parent:
            st = lstat_at(parent, parts[-1])
            if st is None:
                raise NotFound(f"path {_shown(parts)} not found")
            if not stat.S_ISREG(st.st_mode):
                raise InvalidRequest(f"path {_shown(parts)} is not a regular file")
            fd = os.open(parts[-1], READ_FLAGS, dir_fd=parent)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidRequest(f"path {_shown(parts)} is not a regular file")
            os.set_blocking(fd, True)
            yield fd, st.st_size
        finally:
            os.close(fd)

    def begin_write(
        self, path: str, *, owner: tuple[int, int], mode: int | None, force: bool
    ) -> tuple[int, int, str, str, list[str]]:
        """A new temporary file beside ``path``: (its directory's fd, its fd, its name, the final
        name, the path's parts); ``finish_write`` or ``abort_write`` end it. E2B's ``force``:
        replace what is there and make the parents; without it, an entry already there is a 409
        (checked here, before the body is read, and again when the file is put in place)."""
        parts = parts_of(path)
        if not parts:
            raise InvalidRequest("path / is a directory")
        with self._dir(parts[:-1], create=force, owner=owner) as parent:
            st = lstat_at(parent, parts[-1])
            if st is not None and stat.S_ISDIR(st.st_mode):
                raise Conflict(f"path {_shown(parts)} is a directory")
            if st is not None and not force:
                raise Conflict(f"path {_shown(parts)} already exists")
            keep = os.dup(parent)
        temp = f".aenv-upload-{uuid.uuid4().hex}"
        try:
            fd = os.open(temp, NEW_FILE_FLAGS, 0o600, dir_fd=keep)
            os.fchmod(fd, 0o644 if mode is None else mode & 0o7777)
            chown_at(None, fd, *owner)
        except BaseException:
            os.close(keep)
            raise
        return keep, fd, temp, parts[-1], parts

    def finish_write(
        self, parent: int, fd: int, temp: str, name: str, parts: list[str], *, force: bool = True
    ) -> dict[str, Any]:
        try:
            os.fsync(fd)
            st = lstat_at(parent, name)
            if st is not None and stat.S_ISDIR(st.st_mode):
                raise Conflict(f"path {_shown(parts)} became a directory")
            if force:
                os.rename(temp, name, src_dir_fd=parent, dst_dir_fd=parent)  # a link there is replaced, not followed
            else:
                _put_new(parent, temp, name, parts)
            return entry(_shown(parts), os.fstat(fd))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=parent)
            raise
        finally:
            os.close(fd)
            os.close(parent)

    @staticmethod
    def abort_write(parent: int, fd: int, temp: str) -> None:
        try:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=parent)
        finally:
            os.close(fd)
            os.close(parent)


def _put_new(parent: int, temp: str, name: str, parts: list[str]) -> None:
    """``temp`` renamed to ``name`` only where nothing is: a hard link, which fails if something
    appeared meanwhile (kept, a 409); on a file system without them, checked just before the rename."""
    try:
        os.link(temp, name, src_dir_fd=parent, dst_dir_fd=parent, follow_symlinks=False)
    except FileExistsError:
        raise Conflict(f"path {_shown(parts)} already exists") from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK):
            raise
        if lstat_at(parent, name) is not None:
            raise Conflict(f"path {_shown(parts)} already exists") from None
        os.rename(temp, name, src_dir_fd=parent, dst_dir_fd=parent)
        return
    os.unlink(temp, dir_fd=parent)
