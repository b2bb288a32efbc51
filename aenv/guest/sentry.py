"""Give the gVisor sentry's restore garbage back to the host once a sandbox goes quiet (runsc
20221219; the node tells the agent to hold off on runsc 20240729, whose restores leave little:
there the churn below kept 4-6 MiB more per sandbox, see ``Driver.restore_leaves_garbage``).

Restoring (on 20221219) leaves the sentry, a Go program, holding
~30 MiB of heap from decoding the image. Go returns it only after its next GC, and an idle
sandbox allocates nothing, so that GC is the runtime's forced one two minutes later; measured,
the memory comes back about four minutes after a restore. The environment of the sentry is
scrubbed by runsc, so GOGC/GOMEMLIMIT cannot be set from outside.

Pushing ~128 MiB through a local socketpair makes the sentry allocate and drop socket buffers
in its Go heap: that runs a GC, and the scavenger hands the freed heap back. It costs about
50 ms of CPU inside the sandbox, so it runs once, after the sandbox has been quiet for a moment,
and stops as soon as a freeze is asked for (the buffers must not end up in a checkpoint).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable

CHUNK = 1 << 20
TOTAL = 128 << 20
QUIET_S = 2.0  # how long without requests before spending the CPU
GIVE_UP_S = 60.0  # a sandbox busy this long gets the GC from its own allocations anyway


def churn_socket_buffers(stop: threading.Event, total: int = TOTAL) -> int:
    """Send ``total`` bytes through a socketpair in CHUNK pieces; return the bytes moved."""
    a, b = socket.socketpair()
    try:
        for s in (a, b):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * CHUNK)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * CHUNK)
        # One thread sends, then reads: a piece must fit the buffer the kernel granted (Linux caps
        # it at net.core.wmem_max, far below gVisor's), or the send never returns.
        chunk = max(4096, min(CHUNK, a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 4))
        data = bytes(chunk)
        sink = bytearray(chunk)
        view = memoryview(sink)
        moved = 0
        while moved < total and not stop.is_set():
            a.sendall(data)
            got = 0
            while got < chunk:
                got += b.recv_into(view[got:])
            moved += chunk
        return moved
    finally:
        a.close()
        b.close()


class HeapRelease:
    """Schedules one churn after each thaw; ``halt`` stops it (and waits) before a freeze."""

    def __init__(self, last_activity: Callable[[], float]) -> None:
        self._last_activity = last_activity
        self._task: asyncio.Task[None] | None = None
        self._worker: asyncio.Future[int] | None = None
        self._stop = threading.Event()

    def schedule(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def halt(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._worker is not None:
            await asyncio.wait([self._worker])
            self._worker = None

    async def _run(self) -> None:
        started = time.monotonic()
        while True:
            await asyncio.sleep(QUIET_S)
            idle = time.monotonic() - self._last_activity()
            if idle >= QUIET_S or time.monotonic() - started > GIVE_UP_S:
                break
        self._stop = threading.Event()
        self._worker = asyncio.get_running_loop().run_in_executor(None, churn_socket_buffers, self._stop)
        await asyncio.shield(self._worker)  # a cancel must not orphan the thread; halt() waits for it
