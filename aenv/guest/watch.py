"""Directory watches on inotify (through ctypes; gVisor implements inotify), E2B event shapes."""

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import Callable
from typing import Any

from aenv.guest.files import entry_info

IN_MODIFY = 0x002
IN_ATTRIB = 0x004
IN_CLOSE_WRITE = 0x008
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_ISDIR = 0x40000000
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000
MASK = IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF
EVENT = struct.Struct("iIII")

_libc: Any = None


def _lib() -> Any:
    global _libc
    if _libc is None:
        import ctypes  # on first use: see aenv/guest/__main__.py

        _libc = ctypes.CDLL(None, use_errno=True)  # the libc the agent runs on
    return _libc


def _event_type(mask: int) -> str | None:
    if mask & IN_CREATE:
        return "EVENT_TYPE_CREATE"
    if mask & IN_MODIFY:
        return "EVENT_TYPE_WRITE"
    if mask & (IN_DELETE | IN_DELETE_SELF):
        return "EVENT_TYPE_REMOVE"
    if mask & (IN_MOVED_FROM | IN_MOVED_TO):
        return "EVENT_TYPE_RENAME"
    if mask & IN_ATTRIB:
        return "EVENT_TYPE_CHMOD"
    return None


class Watcher:
    """Watches ``root`` (recursively if asked) and calls ``emit`` with FilesystemEvent dicts.

    Made off the event loop (a recursive watch walks the whole tree), then :meth:`start`ed on it."""

    def __init__(self, root: str, recursive: bool, emit: Callable[[dict[str, Any]], None], include_entry: bool) -> None:
        self.root = root
        self.recursive = recursive
        self.emit = emit
        self.include_entry = include_entry
        lib = _lib()
        self.fd = lib.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self.fd < 0:
            import ctypes

            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self.dirs: dict[int, str] = {}
        try:
            self._add(root)
            if recursive:
                for base, subdirs, _ in os.walk(root):
                    for name in subdirs:
                        self._add(os.path.join(base, name))
        except BaseException:
            os.close(self.fd)
            raise

    def start(self) -> None:
        asyncio.get_running_loop().add_reader(self.fd, self._readable)

    def _add(self, path: str) -> None:
        wd = _lib().inotify_add_watch(self.fd, os.fsencode(path), MASK)
        if wd >= 0:
            self.dirs[wd] = path

    def _readable(self) -> None:
        try:
            buf = os.read(self.fd, 64 * 1024)
        except BlockingIOError:
            return
        off = 0
        while off + EVENT.size <= len(buf):
            wd, mask, _cookie, length = EVENT.unpack_from(buf, off)
            raw = buf[off + EVENT.size : off + EVENT.size + length]
            off += EVENT.size + length
            directory = self.dirs.get(wd)
            if directory is None:
                continue
            name = raw.split(b"\0", 1)[0].decode(errors="replace")
            full = os.path.join(directory, name) if name else directory
            if self.recursive and mask & IN_ISDIR and mask & (IN_CREATE | IN_MOVED_TO):
                self._add(full)
            kind = _event_type(mask)
            if kind is None or full == self.root:
                continue
            event: dict[str, Any] = {"name": os.path.relpath(full, self.root), "type": kind}
            if self.include_entry and kind != "EVENT_TYPE_REMOVE":
                try:
                    event["entry"] = entry_info(full)
                except OSError:
                    pass
            self.emit(event)

    def close(self) -> None:
        try:
            asyncio.get_running_loop().remove_reader(self.fd)
        except RuntimeError:
            pass
        os.close(self.fd)
