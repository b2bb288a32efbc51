"""An in-memory mirror of the cluster directory (nodes and sandboxes), kept by one etcd watch.

Reads never wait on etcd: lookups are dict reads. The mirror loads everything once, then follows
the watch from the next revision; when the stream fails it resumes from the last revision it
applied (etcd replays what it missed), and when that history was compacted it reads everything
again. While etcd is out of reach the mirror keeps its last state (running sandboxes stay
routable) and says how stale it is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from aenv.cluster.entries import NODES_PREFIX, SANDBOXES_PREFIX, E, EntryError, NodeEntry, SandboxEntry, decode
from aenv.cluster.store import Change, ClusterStore, Listing, WatchCompacted
from aenv.errors import ClusterUnavailable

log = logging.getLogger("aenv.cluster.mirror")

RETRY_MIN = 0.2
RETRY_MAX = 2.0
GONE_KEPT = 4096  # sandboxes whose entry this mirror saw deleted, the latest kept


class Mirror:
    def __init__(self, store: ClusterStore) -> None:
        self.store = store
        self.nodes: dict[str, NodeEntry] = {}
        self.sandboxes: dict[str, SandboxEntry] = {}
        # Sandboxes whose entry went while this mirror followed (killed, or moved out of the
        # directory): a create's quota reservation for one stops counting at once.
        self.gone: OrderedDict[str, None] = OrderedDict()
        self.revision = 0  # the last revision applied
        self.loaded = asyncio.Event()  # set once the first full read is in
        self.connected = False  # a watch is running now
        self.synced_at = 0.0  # monotonic time of the last full read or event
        self.reloads = 0  # full reads so far (the first one included)
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self._listeners: list[Callable[[Change], None]] = []

    async def start(self, *, wait: float | None = None) -> None:
        """Start following; with ``wait``, until the first full read is in (or ClusterUnavailable)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="cluster-mirror")
        if wait is not None:
            try:
                await asyncio.wait_for(self.loaded.wait(), wait)
            except TimeoutError:
                raise ClusterUnavailable(f"the cluster directory could not be read within {wait:g} s") from None

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    def on_change(self, listener: Callable[[Change], None]) -> None:
        """Call ``listener`` for every change applied from the watch (not for full reads)."""
        self._listeners.append(listener)

    # -- lookups ----------------------------------------------------------------------------------------
    def owner(self, sandbox_id: str) -> tuple[SandboxEntry | None, NodeEntry | None]:
        """A sandbox's entry and its node's (None when the node is gone: its lease expired)."""
        entry = self.sandboxes.get(sandbox_id)
        return entry, (self.nodes.get(entry.node_id) if entry is not None else None)

    async def wait_for(self, predicate: Callable[[Mirror], bool], timeout: float) -> bool:
        """Wait until ``predicate(self)`` holds after some change; False past ``timeout``."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: predicate(self)), timeout)
                return True
            except TimeoutError:
                return False

    # -- following --------------------------------------------------------------------------------------
    async def _run(self) -> None:
        delay = RETRY_MIN
        need_reload = True
        while True:
            try:
                if need_reload:
                    await self._reload(await self.store.read_all())
                    need_reload = False
                async for change in self.store.watch(self.revision + 1):
                    self.connected = True
                    delay = RETRY_MIN
                    await self._apply(change)
                raise ClusterUnavailable("the directory watch ended")
            except WatchCompacted as exc:
                log.warning("directory history compacted (%s); reading it again", exc)
                need_reload = True
            except ClusterUnavailable as exc:
                log.warning("cluster directory: %s; retrying in %.1f s", exc.message, delay)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not stop the mirror for good
                log.exception("cluster mirror failed; reading the directory again")
                need_reload = True
            self.connected = False
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX)

    async def _reload(self, listing: Listing) -> None:
        self.nodes = {k: v.entry for k, v in listing.nodes.items()}
        self.sandboxes = {k: v.entry for k, v in listing.sandboxes.items()}
        self.revision = listing.revision
        self.reloads += 1
        self.synced_at = time.monotonic()
        self.loaded.set()
        async with self._changed:
            self._changed.notify_all()

    async def _apply(self, change: Change) -> None:
        if change.key.startswith(NODES_PREFIX):
            _put_or_delete(self.nodes, NodeEntry, change.key[len(NODES_PREFIX) :], change)
        elif change.key.startswith(SANDBOXES_PREFIX):
            name = change.key[len(SANDBOXES_PREFIX) :]
            _put_or_delete(self.sandboxes, SandboxEntry, name, change)
            if change.kind == "delete":
                self.gone[name] = None
                self.gone.move_to_end(name)
                while len(self.gone) > GONE_KEPT:
                    self.gone.popitem(last=False)
            else:
                self.gone.pop(name, None)
        self.revision = max(self.revision, change.mod_revision)
        self.synced_at = time.monotonic()
        for listener in self._listeners:
            listener(change)
        async with self._changed:
            self._changed.notify_all()


def _put_or_delete(table: dict[str, E], cls: type[E], name: str, change: Change) -> None:
    if change.kind == "delete":
        table.pop(name, None)
        return
    try:
        table[name] = decode(cls, change.value)
    except EntryError as exc:
        log.warning("skipping cluster entry %s: %s", change.key[:200], exc)
        table.pop(name, None)
