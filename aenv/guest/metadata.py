"""User-defined file metadata, as envd keeps it: ``user.e2b.<key>`` extended attributes of a file.

gVisor keeps no extended attributes on its gofer-backed root file system, whatever the host file
system under it takes: runsc 20221219's gofers (9p and lisafs) answer EOPNOTSUPP to every xattr
call, runsc 20240729 answers a user's with EOPNOTSUPP and accepts root's without keeping them. Its
tmpfs mounts (/tmp, /dev/shm) do keep them (told apart by statfs). So metadata is a real xattr
where the file system takes one (what user programs set there is read back too), and elsewhere
the agent keeps a file's user.* xattrs in a store of its own (programs' own xattr calls reach it
through the compat shim: aenv.guest.xattrs), which follows what xattrs follow as far as the agent
can tell:

- it is keyed by the file's real path and checked against the inode number the file had when its
  metadata was set: a file replaced at that path (``sed -i``, an editor's save, ``mv x file``) has
  none, and a file moved away (``mv file x``) is found again by its inode number at its new path;
  the agent's own moves and removals carry it along or drop it;
- it lives in the agent's memory, so a pause, snapshot or fork keeps it, and in a file the agent
  writes at each freeze (read when an agent boots on a kept file system).

The sentry numbers inodes anew at each restore, so after a thaw every entry is bound again to the
inode number its path has then. A file removed and created again at the same path often gets the
same inode number back from the host: such a file keeps the old metadata, where ext4 would not.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

from aenv.guest import safeio

PREFIX = "user.e2b."
MAX_KEY = 255 - len(PREFIX)  # the kernel's limit on an xattr name, with the prefix
MAX_TOTAL = 4096  # envd's: what fits in the one ext4 block that holds an inode's xattrs
MAX_READ = 64 * 1024  # what is surfaced of one file's user.e2b.* xattrs, whoever set them
# The store's bounds: its memory is the sandbox's. Past them, entries of files that are gone are
# dropped; if that is not enough, new metadata is refused (as a full disk refuses an xattr).
MAX_ENTRIES = 16384
MAX_STORED = 16 * 2**20
STORE_FILE = "/var/lib/aenv/file-metadata.json"
# There while the store holds anything: programs' listxattr asks the agent only then (one stat,
# where asking costs most of a millisecond under the ptrace platform). On runsc's tmpfs; that a
# user may make one of the same name only makes their listings ask.
KEPT_FLAG = "/dev/shm/.aenv-user-xattrs"
_UNSUPPORTED = (errno.EOPNOTSUPP, errno.ENOTSUP)


class Invalid(ValueError):
    """Metadata a client may not set (envd's ValidateMetadata)."""


class Full(OSError):
    """No room left in the store."""


def validate(metadata: dict[str, str]) -> None:
    """envd's rules: non-empty keys of at most MAX_KEY bytes, printable US-ASCII keys and values,
    names and values together at most MAX_TOTAL bytes."""
    total = 0
    for key, value in metadata.items():
        if not key:
            raise Invalid("metadata key must not be empty")
        if len(key.encode()) > MAX_KEY:
            raise Invalid(f"metadata key {key[:64]!r}... exceeds {MAX_KEY} bytes")
        for label, text in (("key", key), (f"value for key {key!r}", value)):
            bad = next((i for i, c in enumerate(text) if not " " <= c <= "~"), None)
            if bad is not None:
                raise Invalid(f"metadata {label} contains a non-printable-ASCII character at offset {bad}")
        total += len(PREFIX) + len(key) + len(value)
    if total > MAX_TOTAL:
        raise Invalid(f"total metadata size {total} exceeds {MAX_TOTAL} bytes")


Attrs = dict[str, bytes]  # a file's user.* xattrs: full name -> value


def as_attrs(metadata: dict[str, str]) -> Attrs:
    return {PREFIX + key: value.encode() for key, value in metadata.items()}


def as_metadata(attrs: Attrs) -> dict[str, str] | None:
    """The user.e2b.* part of ``attrs``, prefix stripped; as envd, a value that is not UTF-8 is
    skipped, not the whole answer."""
    found: dict[str, str] = {}
    for name, value in attrs.items():
        if name.startswith(PREFIX):
            try:
                found[name[len(PREFIX) :]] = value.decode()
            except UnicodeDecodeError:
                continue
    return found or None


def attrs_size(attrs: Attrs) -> int:
    """What ext4 would count against the one block an inode's xattrs get."""
    return sum(len(name) + len(value) for name, value in attrs.items())


def _size(key: str, attrs: Attrs) -> int:
    return len(key) + attrs_size(attrs)


@dataclass(slots=True)
class _Entry:
    attrs: Attrs
    inode: tuple[int, int] | None  # (st_dev, st_ino) in the current epoch; None: not bound since a restore


class Store:
    """The user.* xattrs of files whose file system keeps none, by real path. Thread-safe: file
    operations run on a pool, user programs' xattr calls on threads of their own."""

    def __init__(self, flag: str | None = None) -> None:
        self._flag = flag  # KEPT_FLAG for the agent's own store
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._by_inode: dict[tuple[int, int], str] = {}
        self._bytes = 0
        self._dirty = False

    def __len__(self) -> int:
        return len(self._entries)

    # -- lookups ------------------------------------------------------------------------------
    def get(self, key: str, st: os.stat_result) -> Attrs | None:
        """The xattrs of the file at real path ``key`` (``st``: its stat)."""
        inode = (st.st_dev, st.st_ino)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.inode is None:
                self._bind(key, entry, inode)
            if entry is not None and entry.inode == inode:
                return dict(entry.attrs)
            elsewhere = self._by_inode.get(inode)
            if elsewhere is None or elsewhere == key:
                return None
            found = self._entries[elsewhere]
        if _inode_at(elsewhere) == inode:
            return dict(found.attrs)  # a hard link to it: they share their xattrs
        with self._lock:  # moved here by someone else: its xattrs came along
            if self._entries.get(elsewhere) is found:
                self._drop(elsewhere)
                self._put(key, found.attrs, inode)
        return dict(found.attrs)

    # -- changes --------------------------------------------------------------------------------
    def put(self, key: str, st: os.stat_result, attrs: Attrs) -> None:
        """Replace the xattrs of the file at ``key``; none clears them."""
        with self._lock:
            old = self._entries.get(key)
            if attrs:
                self._make_room(_size(key, attrs) - (_size(key, old.attrs) if old else 0), old is None)
            self._drop(key)
            if attrs:
                self._put(key, dict(attrs), (st.st_dev, st.st_ino))

    def room_for(self, key: str, attrs: Attrs) -> None:
        """Raise Full now if giving the file at ``key`` ``attrs`` would not fit."""
        with self._lock:
            old = self._entries.get(key)
            self._make_room(_size(key, attrs) - (_size(key, old.attrs) if old else 0), old is None)

    def moved(self, source: str, destination: str) -> None:
        """The agent renamed ``source`` to ``destination`` (real paths): what was under it follows."""
        with self._lock:
            for key in self._under(source):
                entry = self._entries[key]
                self._drop(key)
                target = destination + key[len(source) :]
                self._drop(target)
                self._put(target, entry.attrs, entry.inode)

    def removed(self, key: str) -> None:
        with self._lock:
            for under in self._under(key):
                self._drop(under)

    def rebind(self) -> None:
        """After a restore: inode numbers were given anew, so every entry is bound to the one its
        path has now (and dropped if the path is gone)."""
        with self._lock:
            self._by_inode.clear()
            for unbound in self._entries.values():
                unbound.inode = None
            keys = list(self._entries)
        for key in keys:
            inode = _inode_at(key, follow=True)
            with self._lock:
                entry = self._entries.get(key)
                if entry is None or entry.inode is not None:
                    continue  # changed or looked up meanwhile
                if inode is None:
                    self._drop(key)
                else:
                    self._bind(key, entry, inode)

    # -- persistence ------------------------------------------------------------------------------
    def save(self, path: str = STORE_FILE) -> None:
        """Write the store beside its file and rename it over (best effort: the sandbox's root
        may have made the place unusable; memory still has it)."""
        with self._lock:
            if not self._dirty:
                return
            saved = {
                key: {n: v.decode("latin-1") for n, v in entry.attrs.items()} for key, entry in self._entries.items()
            }
            data = json.dumps(saved).encode()
            self._dirty = False
        try:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            safeio.replace_file(path, data, 0o600)
        except OSError:
            with self._lock:
                self._dirty = True

    def load(self, path: str = STORE_FILE) -> None:
        """Read what a previous agent saved on this file system; anything malformed is skipped."""
        try:
            saved = json.loads(safeio.read_small(path, MAX_STORED + 2**20))
        except (OSError, ValueError, RecursionError):
            return
        if not isinstance(saved, dict):
            return
        with self._lock:
            for key, value in list(saved.items())[:MAX_ENTRIES]:
                attrs = _loadable(key, value)
                if attrs and self._bytes + _size(key, attrs) <= MAX_STORED:
                    self._drop(key)
                    self._put(key, attrs, None)

    # -- internals (under the lock) --------------------------------------------------------------
    def _put(self, key: str, attrs: Attrs, inode: tuple[int, int] | None) -> None:
        if not self._entries:
            self._show(kept=True)
        self._entries[key] = _Entry(attrs, inode)
        self._bytes += _size(key, attrs)
        if inode is not None:
            self._by_inode[inode] = key
        self._dirty = True

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self._bytes -= _size(key, entry.attrs)
        if entry.inode is not None and self._by_inode.get(entry.inode) == key:
            del self._by_inode[entry.inode]
        self._dirty = True
        if not self._entries:
            self._show(kept=False)

    def _show(self, *, kept: bool) -> None:
        if self._flag is None:
            return
        try:
            if kept:
                os.close(os.open(self._flag, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o444))
            else:
                os.unlink(self._flag)
        except OSError:
            pass  # there already (or not), or /dev/shm is not a directory here: programs just ask

    def _bind(self, key: str, entry: _Entry, inode: tuple[int, int]) -> None:
        entry.inode = inode
        self._by_inode[inode] = key

    def _under(self, key: str) -> list[str]:
        inside = key.rstrip("/") + "/"
        return [k for k in self._entries if k == key or k.startswith(inside)]

    def _make_room(self, needed: int, new_entry: bool) -> None:
        def fits() -> bool:
            return (not new_entry or len(self._entries) < MAX_ENTRIES) and self._bytes + needed <= MAX_STORED

        if fits():
            return
        for key in [k for k in self._entries if _inode_at(k, follow=True) is None]:
            self._drop(key)  # files that are gone
        if not fits():
            raise Full(errno.ENOSPC, f"no room left for file metadata ({len(self._entries)} files have some)")


def _inode_at(path: str, *, follow: bool = False) -> tuple[int, int] | None:
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _saved(attrs: Attrs) -> dict[str, str]:
    return {name: value.decode("latin-1") for name, value in attrs.items()}  # bytes as JSON strings


def _loadable(key: object, saved: object) -> Attrs | None:
    """The xattrs a saved entry holds, if it is one a live store could hold."""
    if not isinstance(key, str) or not key.startswith("/") or "\0" in key or len(key) > 4096:
        return None
    if not isinstance(saved, dict) or not saved:
        return None
    try:
        attrs = {name: value.encode("latin-1") for name, value in saved.items()}
        for name in attrs:
            check_name(name)
    except (AttributeError, UnicodeEncodeError, OSError):
        return None
    return attrs if attrs_size(attrs) <= MAX_TOTAL else None


def check_name(name: object) -> None:
    """What a user.* xattr name must be, with the kernel's errno otherwise."""
    if not isinstance(name, str) or not name.startswith("user.") or len(name) == len("user.") or "\0" in name:
        raise OSError(errno.EOPNOTSUPP, "not a user xattr")
    if len(name.encode()) > 255:
        raise OSError(errno.ERANGE, "xattr name too long")


STORE = Store(KEPT_FLAG)
# Whether each device (st_dev) keeps xattrs: runsc's own tmpfs mounts do; the root file system
# (the gofer's) does not, whatever its calls answer: runsc 20221219 refuses them (EOPNOTSUPP), and
# 20240729 accepts root's and keeps nothing (a getxattr then answers ENODATA).
_keeps: dict[int, bool] = {}
TMPFS_MAGIC = 0x01021994


def forget_devices() -> None:
    """After a restore device numbers may differ: each file system is asked again."""
    _keeps.clear()


def _keeps_xattrs(file: str | int, dev: int) -> bool:
    known = _keeps.get(dev)
    if known is None:
        fs_type = _fs_type(file)
        if fs_type is None:
            return True  # the file, not its file system (it went away): try, and fail softly
        known = fs_type == TMPFS_MAGIC
        _keeps[dev] = known
    return known


def _fs_type(file: str | int) -> int | None:
    """statfs(2)'s f_type of the file system that holds ``file`` (None if it cannot be asked)."""
    import ctypes  # not at start: the agent's memory is in every checkpoint

    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(256)  # struct statfs (120 bytes on 64-bit Linux); f_type first
    if isinstance(file, int):
        done = libc.fstatfs(file, buf)
    else:
        done = libc.statfs(os.fsencode(file), buf)
    if done != 0:
        return None
    return int.from_bytes(buf.raw[: ctypes.sizeof(ctypes.c_long)], sys.byteorder)


def read(path: str, st: os.stat_result, real_path: Callable[[], str]) -> dict[str, str] | None:
    """The metadata of what ``path`` leads to (a file or directory; ``st``: its stat), as envd
    reads it through a symlink. ``real_path`` gives its real path, asked only if the store is."""
    if _keeps_xattrs(path, st.st_dev):
        try:
            return _read_xattrs(path)
        except OSError:
            return None  # unreadable here (a pseudo file): as envd, the entry is still reported
    return as_metadata(STORE.get(real_path(), st) or {}) if len(STORE) else None


def _read_xattrs(path: str) -> dict[str, str] | None:
    found: Attrs = {}
    total = 0
    for name in os.listxattr(path):
        if not name.startswith(PREFIX):
            continue
        try:
            found[name] = os.getxattr(path, name)
        except OSError as exc:
            if exc.errno == errno.ENODATA:
                continue
            raise
        total += len(name) + len(found[name])
        if total > MAX_READ:
            break
    return as_metadata(found)


def write(fd: int, key: str, metadata: dict[str, str]) -> None:
    """Replace the metadata of the open file ``fd`` (at real path ``key``): names not given are
    removed, so that an overwritten file does not keep a previous upload's; other user.* xattrs
    stay, as envd leaves them."""
    st = os.fstat(fd)
    if _keeps_xattrs(fd, st.st_dev):
        try:
            _write_xattrs(fd, metadata)
            STORE.put(key, st, {})  # a file moved here from a file system that keeps none
            return
        except OSError as exc:
            if exc.errno not in _UNSUPPORTED:
                raise
            _keeps[st.st_dev] = False
    others = {n: v for n, v in (STORE.get(key, st) or {}).items() if not n.startswith(PREFIX)}
    attrs = {**others, **as_attrs(metadata)}
    if attrs_size(attrs) > MAX_TOTAL:
        raise Full(errno.ENOSPC, "the file's other user xattrs leave no room for this metadata")
    STORE.put(key, st, attrs)


def _write_xattrs(fd: int, metadata: dict[str, str]) -> None:
    for name in os.listxattr(fd):
        if name.startswith(PREFIX) and name[len(PREFIX) :] not in metadata:
            try:
                os.removexattr(fd, name)
            except OSError as exc:
                if exc.errno != errno.ENODATA:
                    raise
    for key, value in metadata.items():
        os.setxattr(fd, PREFIX + key, value.encode())
