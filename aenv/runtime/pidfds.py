"""Host processes held by pidfd: opened only if their command line is the one expected, signalled
and awaited through the pidfd, so a pid the host reused meanwhile is never touched."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable


def open_checked(pid: int, expected: Callable[[list[bytes]], bool]) -> tuple[str, int | None]:
    """What ``pid`` is, with a pidfd of it when it may be waited for:

    - ``("ours", fd)``: its command line (its arguments) passes ``expected``;
    - ``("ending", fd)``: it has no command line left: it is exiting (a process's memory, and
      with it its arguments, goes first) or has exited (a zombie until its parent reaps it);
    - ``("gone", None)``: no such process;
    - ``("other", None)``: a process with a command line that is not the one expected.

    The check follows the open: a process that took the pid before the open fails it, and one
    that takes it after is not the one the pidfd holds."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return "gone", None
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        raw = b""  # reaped since the open: the pidfd reads ready
    args = raw.split(b"\0") if raw else []
    if not args:
        return "ending", fd
    if expected(args):
        return "ours", fd
    os.close(fd)
    return "other", None


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
