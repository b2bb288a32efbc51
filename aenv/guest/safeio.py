"""Opening what a path names inside the sandbox without ever blocking the agent on it.

Whatever a path names is the sandbox's choice: opening a FIFO waits for its other end, a device
or a pseudo file (/dev/zero, /proc, /sys) never ends or reports no size. The agent serves every
request of the sandbox from one event loop, so files are opened with O_NONBLOCK (the open returns
at once, whatever it finds) and file I/O is done on regular files only.
"""

from __future__ import annotations

import errno
import os
import stat

SMALL_FILE_LIMIT = 4 * 2**20  # /etc/passwd and friends: anything past this is not read


class NotRegularFile(OSError):
    """The path names a FIFO, a socket, a device or a directory where a regular file is needed."""


def open_regular(path: str, flags: int, mode: int = 0o644) -> int:
    """os.open for file I/O: refused (NotRegularFile) unless ``path`` is a regular file.

    The check is made on the opened descriptor: the path may have changed since any earlier look.
    """
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a socket, or a FIFO opened for writing with no reader
            raise NotRegularFile(errno.EINVAL, "not a regular file", path) from exc
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile(errno.EINVAL, "not a regular file", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_regular(st: os.stat_result, path: str) -> None:
    """Refuse before opening, so that opening a device has no side effect (e.g. a tty's)."""
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFile(errno.EINVAL, "not a regular file", path)


def read_small(path: str, limit: int = SMALL_FILE_LIMIT) -> bytes:
    """The first ``limit`` bytes of a regular file (a configuration file the agent parses)."""
    fd = open_regular(path, os.O_RDONLY)
    try:
        chunks: list[bytes] = []
        left = limit
        while left > 0 and (chunk := os.read(fd, min(left, 2**16))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def replace_file(path: str, data: bytes, mode: int) -> None:
    """Write ``data`` beside ``path`` and rename it over: whatever the sandbox left at the name (a
    FIFO would block an open for writing, a link would lead elsewhere) is replaced, never opened."""
    staging = f"{path}.{os.getpid()}"
    try:
        os.unlink(staging)
    except FileNotFoundError:
        pass
    fd = open_regular(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    os.replace(staging, path)
