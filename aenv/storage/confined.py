"""Host file operations on trees whose content is untrusted: image layers, build contexts, the
layers a build writes. Whatever links, devices or odd names an image, a sandbox or a client put
there, the host never follows, opens or executes them, and never reads or writes outside the tree.

Every operation walks from a directory fd one component at a time with ``O_NOFOLLOW``, so the
host kernel never resolves a link found in a tree. Links are resolved here instead, the way the
sandbox would see them: ``View`` is the overlay of a stack of layer directories (whiteouts and
opaque directories honoured), where a link's absolute target starts again at the view's root and
``..`` stops there. Its writes go to the view's top layer only, creating missing directories there
with the attributes the layers below give them.
"""

from __future__ import annotations

import fnmatch
import os
import posixpath
import shutil
import stat
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO

from aenv.errors import InvalidRequest

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # never blocks on a FIFO
NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
OPAQUE_XATTR = "trusted.overlay.opaque"
# Attributes a layer may carry: what images use. trusted.* steers the host kernel (overlayfs's
# redirect, origin, metacopy...), so of those only the opaque marker, which layers express anyway.
XATTR_PREFIXES = ("user.", "security.capability", "system.posix_acl_", OPAQUE_XATTR)
MAX_LINKS = 40  # Linux's MAXSYMLINKS
MAX_READ = 16 << 20
WILDCARDS = "*?["


# Without root (a node on the fake runtime, aenv/runtime/fake.py) nothing can be given another
# owner: what the node writes stays its user's, whom that runtime maps to the sandbox's `user`.
AS_ROOT = os.geteuid() == 0


def chown_at(dir_fd: int | None, name: str | int, uid: int, gid: int) -> None:
    """Give an entry (``name`` in ``dir_fd``, never followed; or the fd ``name``) its owner."""
    if not AS_ROOT:
        return
    if isinstance(name, int):
        os.fchown(name, uid, gid)
    else:
        os.chown(name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)


class PathRefused(InvalidRequest):
    """A path in an untrusted tree that cannot be used as asked."""


def is_whiteout(st: os.stat_result) -> bool:
    """An overlayfs whiteout: a 0/0 character device."""
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def open_dir_at(dir_fd: int, name: str) -> int:
    """The directory ``name`` in ``dir_fd``; a link there is an error, never followed."""
    return os.open(name, DIR_FLAGS, dir_fd=dir_fd)


def open_root(path: Path) -> int:
    return os.open(path, DIR_FLAGS)


def dir_at(dir_fd: int, name: str) -> int:
    """An fd of the directory ``name`` in ``dir_fd``, made (0700) if missing; whatever else is
    there (a link, a file) is removed first, never followed."""
    existing = lstat_at(dir_fd, name)
    if existing is not None and not stat.S_ISDIR(existing.st_mode):
        remove_at(dir_fd, name)
        existing = None
    if existing is None:
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    return open_dir_at(dir_fd, name)


def remove_at(dir_fd: int, name: str, *, ignore_errors: bool = False) -> None:
    """Remove ``name`` (a whole tree if it is a directory) without following any link."""
    st = lstat_at(dir_fd, name)
    if st is None:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    top = open_dir_at(dir_fd, name)
    try:
        walk_dirs(top, partial(_empty_dir, ignore_errors=ignore_errors), partial(_rmdir, ignore_errors=ignore_errors))
    finally:
        os.close(top)
    _rmdir(dir_fd, name, ignore_errors=ignore_errors)


def remove_tree(path: Path, *, ignore_errors: bool = False) -> None:
    """`shutil.rmtree` for trees an image, a context, a repository or a sandbox made: no link
    followed, no other file system entered (a bind mount of the same one is not told apart), and
    no recursion (Python's own walks recurse: a tree 3000 directories deep, a few KiB of tar,
    overflowed the stack of every removal)."""
    try:
        parent = open_root(path.parent)
    except OSError:
        if ignore_errors:
            return
        raise
    try:
        remove_at(parent, path.name, ignore_errors=ignore_errors)
    except OSError:
        if not ignore_errors:
            raise
    finally:
        os.close(parent)


def tree_usage(path: Path, least: int = 0) -> int:
    """Bytes the tree at ``path`` holds on disk (allocated blocks), each entry counted as at least
    ``least``; links not followed, other file systems not entered, no recursion."""
    total = 0

    def count(fd: int) -> list[str]:
        nonlocal total
        subdirs = []
        device = os.fstat(fd).st_dev
        for entry in _entries(fd):
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # gone meanwhile
            total += max(st.st_blocks * 512, least)
            if stat.S_ISDIR(st.st_mode) and st.st_dev == device:
                subdirs.append(entry.name)
        return subdirs

    top = open_root(path)
    try:
        walk_dirs(top, count)
    finally:
        os.close(top)
    return total


def tree_extent(path: Path) -> tuple[int, int]:
    """(bytes, entries) the tree at ``path`` would take as a tar: a 512-byte header per entry,
    and each file's size (its apparent size, holes included) once per inode, rounded up to 512;
    links not followed, other file systems not entered, no recursion."""
    total = entries = 0
    seen: set[int] = set()

    def count(fd: int) -> list[str]:
        nonlocal total, entries
        subdirs = []
        device = os.fstat(fd).st_dev
        for entry in _entries(fd):
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # gone meanwhile
            entries += 1
            total += 512
            if stat.S_ISREG(st.st_mode):
                if st.st_nlink > 1:
                    if st.st_ino in seen:
                        continue  # a hard link: its data is counted once
                    seen.add(st.st_ino)
                total += -(-st.st_size // 512) * 512
            elif stat.S_ISDIR(st.st_mode) and st.st_dev == device:
                subdirs.append(entry.name)
        return subdirs

    top = open_root(path)
    try:
        walk_dirs(top, count)
    finally:
        os.close(top)
    return total, entries


def walk_dirs(top: int, enter: Callable[[int], list[str]], leave: Callable[[int, str], None] | None = None) -> None:
    """Every directory below the directory fd ``top``, depth first, without recursion and with two
    fds open at most: ``enter(fd)`` is called in each and names the subdirectories to go into;
    ``leave(parent_fd, name)`` once everything below one is done."""
    fd = os.dup(top)
    pending = [enter(fd)]
    names: list[str] = []
    try:
        while pending:
            if pending[-1]:
                name = pending[-1].pop()
                try:
                    sub = open_dir_at(fd, name)
                except OSError:
                    continue  # gone meanwhile, or no longer a directory
                os.close(fd)
                fd = sub
                names.append(name)
                pending.append(enter(fd))
                continue
            pending.pop()
            if names:
                parent = os.open("..", DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = parent
                if leave is not None:
                    leave(fd, names.pop())
                else:
                    names.pop()
    finally:
        os.close(fd)


def _entries(fd: int) -> list[os.DirEntry[str]]:
    with os.scandir(fd) as it:
        return list(it)


def _empty_dir(fd: int, *, ignore_errors: bool) -> list[str]:
    """Unlink what is not a directory in ``fd``; the subdirectories on its file system."""
    subdirs = []
    device = os.fstat(fd).st_dev
    for entry in _entries(fd):
        try:
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                if st.st_dev == device:  # a mount inside: never emptied (its rmdir fails)
                    subdirs.append(entry.name)
            else:
                os.unlink(entry.name, dir_fd=fd)
        except OSError:
            if not ignore_errors:
                raise
    return subdirs


def _rmdir(parent: int, name: str, *, ignore_errors: bool) -> None:
    try:
        os.rmdir(name, dir_fd=parent)
    except OSError:
        if not ignore_errors:
            raise


def entry_parts(name: str, what: str, *, absolute_ok: bool = False) -> list[str]:
    """The components of an archive entry's name, relative to the tree it is unpacked in."""
    if name.startswith("/") and not absolute_ok:
        raise PathRefused(f"{what} {name!r} has an absolute name")
    parts = _split(name)
    if ".." in parts:
        raise PathRefused(f"{what} {name!r} escapes its tree ('..')")
    return parts


def parent_at(root_fd: int, parts: Sequence[str], what: str, *, create: bool) -> int:
    """An fd (the caller closes it) of the directory that holds ``parts[-1]`` below ``root_fd``.

    Every component before the last must be a directory, never a link; missing ones are made
    (mode 0755) when ``create``."""
    fd = os.dup(root_fd)
    try:
        for part in parts[:-1]:
            st = lstat_at(fd, part)
            if st is None:
                if not create:
                    raise PathRefused(f"{what} {'/'.join(parts)!r}: {part!r} does not exist")
                os.mkdir(part, 0o700, dir_fd=fd)
            elif not stat.S_ISDIR(st.st_mode):
                raise PathRefused(f"{what} {'/'.join(parts)!r} goes through a non-directory ({part!r})")
            sub = open_dir_at(fd, part)
            if st is None:
                os.fchmod(sub, 0o755)  # set, not asked of mkdir: the node's umask (077) must not reach sandboxes
            os.close(fd)
            fd = sub
        return fd
    except BaseException:
        os.close(fd)
        raise


def _split(path: str) -> list[str]:
    return [p for p in path.split("/") if p not in ("", ".")]


def _opaque(fd: int) -> bool:
    try:
        return os.getxattr(fd, OPAQUE_XATTR) == b"y"
    except OSError:
        return False


@dataclass
class _Dir:
    """A directory of the view: its fd in every layer that contributes to it, top first."""

    fds: list[tuple[int, int]]  # (layer index, fd); layer 0 is the top


@dataclass
class _Leaf:
    """A non-directory of the view (a link too): the one layer entry that shows."""

    parent: int  # fd of the directory holding it
    name: str
    stat: os.stat_result


_Found = _Dir | _Leaf | None


class _Walk:
    """The directory fds one lookup opened; all closed when it ends."""

    def __init__(self, roots: Sequence[Path]) -> None:
        self.fds: list[int] = []
        self.root = _Dir([(i, self.track(open_root(root))) for i, root in enumerate(roots)])

    def track(self, fd: int) -> int:
        self.fds.append(fd)
        return fd

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


class View:
    """What a sandbox sees of ``lowers`` (lowest first) under an optional writable ``top``.

    Paths are as the sandbox names them ("/etc/passwd"). Lookups follow links as the sandbox's
    kernel would, but inside the view: nothing outside the layer directories is ever reached."""

    def __init__(self, lowers: Sequence[Path], top: Path | None = None) -> None:
        self.top = top
        self._roots = [*([top] if top is not None else []), *reversed(lowers)]

    @contextmanager
    def _walk(self) -> Iterator[_Walk]:
        walk = _Walk(self._roots)
        try:
            yield walk
        finally:
            walk.close()

    # -- lookups ---------------------------------------------------------------------------------
    def _child(self, walk: _Walk, here: _Dir, name: str) -> _Found:
        dirs: list[tuple[int, int]] = []
        for layer, fd in here.fds:
            st = lstat_at(fd, name)
            if st is None:
                continue
            if is_whiteout(st):
                break
            if not stat.S_ISDIR(st.st_mode):
                if dirs:
                    break  # a directory above hides what lower layers have
                return _Leaf(fd, name, st)
            sub = walk.track(open_dir_at(fd, name))
            dirs.append((layer, sub))
            if _opaque(sub):
                break
        return _Dir(dirs) if dirs else None

    def _resolve(self, walk: _Walk, path: str, follow_last: bool) -> tuple[list[str], list[_Found]]:
        """``path`` without links or dots (but the last link when not ``follow_last``), and what
        the view has at each of its prefixes (``chain[0]`` is the root, ``None`` missing)."""
        todo = deque(_split(path))
        parts: list[str] = []
        chain: list[_Found] = [walk.root]
        hops = 0
        while todo:
            here = chain[-1]
            if isinstance(here, _Leaf):
                raise PathRefused(f"{path}: /{'/'.join(parts)} is not a directory")
            name = todo.popleft()
            if name == "..":
                if parts:
                    parts.pop()
                    chain.pop()
                continue
            found = self._child(walk, here, name) if here is not None else None
            if isinstance(found, _Leaf) and stat.S_ISLNK(found.stat.st_mode) and (todo or follow_last):
                hops += 1
                if hops > MAX_LINKS:
                    raise PathRefused(f"{path}: too many levels of symbolic links")
                target = os.readlink(found.name, dir_fd=found.parent)
                if target.startswith("/"):
                    del parts[:], chain[1:]
                todo.extendleft(reversed(_split(target)))
                continue
            parts.append(name)
            chain.append(found)
        return parts, chain

    def _stat(self, found: _Found) -> os.stat_result | None:
        if isinstance(found, _Dir):
            return os.fstat(found.fds[0][1])
        return found.stat if found is not None else None

    def canonical(self, path: str, *, follow: bool = True) -> str:
        """``path`` as the sandbox resolves it: no links (the last one kept unless ``follow``), no dots."""
        with self._walk() as walk:
            parts, _ = self._resolve(walk, path, follow)
        return "/" + "/".join(parts)

    def stat(self, path: str, *, follow: bool = True) -> os.stat_result | None:
        with self._walk() as walk:
            _, chain = self._resolve(walk, path, follow)
            return self._stat(chain[-1])

    def is_dir(self, path: str) -> bool:
        st = self.stat(path)
        return st is not None and stat.S_ISDIR(st.st_mode)

    def is_dir_here(self, path: str) -> bool:
        """Whether ``path`` itself is a directory: a link there is not one, even to a directory."""
        st = self.stat(path, follow=False)
        return st is not None and stat.S_ISDIR(st.st_mode)

    def readlink(self, path: str) -> str:
        with self._walk() as walk:
            _, chain = self._resolve(walk, path, False)
            leaf = chain[-1]
            if not isinstance(leaf, _Leaf) or not stat.S_ISLNK(leaf.stat.st_mode):
                raise PathRefused(f"{path} is not a symbolic link")
            return os.readlink(leaf.name, dir_fd=leaf.parent)

    @contextmanager
    def open(self, path: str, *, follow: bool = False) -> Iterator[IO[bytes]]:
        """The regular file at ``path``, for reading (anything else is refused, never opened)."""
        with self._walk() as walk:
            _, chain = self._resolve(walk, path, follow)
            leaf = chain[-1]
            if not isinstance(leaf, _Leaf) or not stat.S_ISREG(leaf.stat.st_mode):
                raise PathRefused(f"{path} is not a regular file")
            fd = os.open(leaf.name, READ_FLAGS, dir_fd=leaf.parent)
        with os.fdopen(fd, "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                raise PathRefused(f"{path} is not a regular file")
            yield file

    def read(self, path: str, limit: int = MAX_READ) -> bytes | None:
        """The regular file the sandbox sees at ``path`` (links followed), or None."""
        st = self.stat(path)
        if st is None or not stat.S_ISREG(st.st_mode):
            return None
        with self.open(path, follow=True) as file:
            data = file.read(limit + 1)
        if len(data) > limit:
            raise PathRefused(f"{path} is larger than {limit} bytes")
        return data

    def listdir(self, path: str) -> list[str]:
        """The names in the directory at ``path`` (whiteouts hide lower layers' names)."""
        with self._walk() as walk:
            _, chain = self._resolve(walk, path, True)
            here = chain[-1]
            if not isinstance(here, _Dir):
                return []
            seen: set[str] = set()
            names: list[str] = []
            for _, fd in here.fds:
                for name in os.listdir(fd):
                    if name in seen:
                        continue
                    seen.add(name)
                    st = lstat_at(fd, name)
                    if st is not None and not is_whiteout(st):
                        names.append(name)
        return sorted(names)

    def glob(self, pattern: str) -> list[str]:
        """Paths matching ``pattern`` (``*``, ``?`` and ``[...]`` within one component)."""
        paths = ["/"]
        for part in _split(pattern):
            if any(c in part for c in WILDCARDS):
                paths = [posixpath.join(p, n) for p in paths for n in self.listdir(p) if fnmatch.fnmatchcase(n, part)]
            else:
                paths = [posixpath.join(p, part) for p in paths]
        return sorted({p for p in paths if self.stat(p, follow=False) is not None})

    def walk_tree(self, path: str) -> Iterator[tuple[str, str, os.stat_result]]:
        """(path, path relative to ``path``, stat) of everything below the directory ``path``,
        parents first; links are reported, not followed."""
        pending = deque([(path, "")])
        while pending:
            here, rel = pending.popleft()
            for name in self.listdir(here):
                child, child_rel = posixpath.join(here, name), posixpath.join(rel, name)
                st = self.stat(child, follow=False)
                if st is None:
                    continue
                yield child, child_rel, st
                if stat.S_ISDIR(st.st_mode):
                    pending.append((child, child_rel))

    # -- writes to the top layer -----------------------------------------------------------------
    def _top_dirs(self, walk: _Walk, parts: list[str], chain: list[_Found], owner: tuple[int, int]) -> int:
        """The fd of the top layer's directory at ``parts``, made where missing: with the mode
        and owner the layers below have for it (in an overlay the top copy decides them), or
        0755 and ``owner`` for a directory new to the view."""
        if self.top is None:
            raise RuntimeError("this view has no writable top layer")
        fd = walk.root.fds[0][1]
        for k, name in enumerate(parts, 1):
            here = chain[k]
            if isinstance(here, _Dir) and here.fds[0][0] == 0:
                fd = here.fds[0][1]
                continue
            if isinstance(here, _Leaf):
                raise PathRefused(f"/{'/'.join(parts[:k])} is not a directory")
            os.mkdir(name, 0o700, dir_fd=fd)
            new = walk.track(open_dir_at(fd, name))
            if here is not None:
                below = os.fstat(here.fds[0][1])
                chown_at(None, new, below.st_uid, below.st_gid)
                os.fchmod(new, stat.S_IMODE(below.st_mode))
            else:
                chown_at(None, new, *owner)
                os.fchmod(new, 0o755)
            chain[k] = _Dir([(0, new), *(here.fds if here is not None else [])])
            fd = new
        return fd

    def make_dir(self, path: str, owner: tuple[int, int] = (0, 0), attrs: tuple[int, int, int] | None = None) -> str:
        """Make sure the directory ``path`` (links followed) is in the top layer; return where it
        is. ``attrs`` (mode, uid, gid) are set on it; missing parents are made as `_top_dirs` says."""
        with self._walk() as walk:
            parts, chain = self._resolve(walk, path, True)
            if isinstance(chain[-1], _Leaf):
                raise PathRefused(f"{path} exists and is not a directory")
            fd = self._top_dirs(walk, parts, chain, owner)
            if attrs is not None and parts:
                chown_at(None, fd, attrs[1], attrs[2])
                os.fchmod(fd, attrs[0])
        return "/" + "/".join(parts)

    def _place(self, walk: _Walk, path: str, owner: tuple[int, int]) -> tuple[int, str]:
        """(top layer directory fd, name) where a non-directory at ``path`` goes: its parents are
        resolved (links followed), the last component is replaced, never followed."""
        parts, chain = self._resolve(walk, path, False)
        if not parts or isinstance(chain[-1], _Dir):
            raise PathRefused(f"{path} is a directory")
        parent = self._top_dirs(walk, parts[:-1], chain[:-1], owner)
        if lstat_at(parent, parts[-1]) is not None:
            os.unlink(parts[-1], dir_fd=parent)
        return parent, parts[-1]

    def write_file(self, path: str, source: IO[bytes] | bytes, mode: int, owner: tuple[int, int] = (0, 0)) -> None:
        with self._walk() as walk:
            parent, name = self._place(walk, path, owner)
            fd = os.open(name, NEW_FILE_FLAGS, 0o600, dir_fd=parent)
        with os.fdopen(fd, "wb") as out:
            if isinstance(source, bytes):
                out.write(source)
            else:
                shutil.copyfileobj(source, out, 1 << 20)
            chown_at(None, out.fileno(), *owner)
            os.fchmod(out.fileno(), mode)  # after the chown, which clears set-id bits

    def symlink(self, path: str, target: str, owner: tuple[int, int] = (0, 0)) -> None:
        with self._walk() as walk:
            parent, name = self._place(walk, path, owner)
            os.symlink(target, name, dir_fd=parent)
            chown_at(parent, name, *owner)
