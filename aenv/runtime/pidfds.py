"""Host processes held by pidfd: opened only if their command line is the one expected, signalled
and awaited through the pidfd, so a pid the host reused meanwhile is never touched."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable


def open_checked(pid: int, expected: Callable[[list[bytes]], bool]) -> int | None:
    """A pidfd of ``pid`` if its command line (its arguments) passes ``expected``, else None. The
    check follows the open: a process that took the pid before the open fails it, and one that
    takes it after is not the one the pidfd holds."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return None
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except OSError:
        args = []
    if not args or not expected(args):
        os.close(fd)
        return None
    return fd


def alive(pid: int) -> bool:
    """Whether a process ``pid`` runs (one that exited is not, reaped or not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return bool(fields) and fields[0] not in (b"Z", b"X")


async def exited(pidfd: int) -> None:
    """Until the process behind ``pidfd`` has exited (a pidfd reads ready then, zombie or not)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(pidfd, ready)
    try:
        await done
    finally:
        loop.remove_reader(pidfd)
