"""Durable takeovers: a sandbox durably paused on a node that is gone, draining or full resumes on
another node, and exactly one node ends up holding it.

A taker fetches first and claims after (a compare-and-swap that needs the entry's durable mark
still on); a live owner takes the mark off (its own compare-and-swap) before it resumes such a
sandbox, so of the two exactly one wins, and the loser's copy is stale. A drain's move hands a
sandbox over the same way. Apart from the directory writes (:mod:`aenv.cluster.agent.directory`) because
this is where two nodes race for one sandbox.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace

from aenv.cluster.agent.directory import Directory
from aenv.cluster.entries import EntryError
from aenv.cluster.store import CLAIM_ATTEMPTS, ClusterStore
from aenv.errors import ClusterUnavailable, WrongState
from aenv.node.service import NodeService

log = logging.getLogger("aenv.cluster.agent")
MOVED_SECONDS = 30.0  # how long traffic for a sandbox a drain moved away is told to look again


class Takeovers:
    """The node's side of durable takeovers: those it is making (``adopt``), the guard before it
    resumes a durable pause of its own (``before_resume``), and the sandboxes a drain moved away
    (``moved``). ``draining`` tells whether the node takes new work."""

    def __init__(
        self,
        node: NodeService,
        store: ClusterStore,
        node_id: str,
        directory: Directory,
        *,
        wake: asyncio.Event,
        reached: Callable[[], None],
        draining: Callable[[], bool],
    ) -> None:
        self.node = node
        self.store = store
        self.node_id = node_id
        self.directory = directory
        self._wake = wake
        self._reached = reached
        self._draining = draining
        self._adoptions: dict[str, asyncio.Future[None]] = {}  # durably paused sandboxes being taken over
        self.moved: dict[str, float] = {}  # sandboxes a drain moved to another node -> when

    def adopting(self, sandbox_id: str) -> bool:
        """Whether the node is taking ``sandbox_id`` over right now (its entry is the lost node's
        until the claim)."""
        return sandbox_id in self._adoptions

    def just_moved(self, sandbox_id: str) -> bool:
        moved = self.moved.get(sandbox_id)
        return moved is not None and time.monotonic() - moved < MOVED_SECONDS

    async def adopt(self, sandbox_id: str, owner_full: bool = False) -> None:
        """A resume here names a sandbox this node does not hold: if the directory says it is
        durably paused on a node that is gone, draining, or (``owner_full``: a gateway's word)
        refused its resume for room, take it over (concurrent resumes join)."""
        running = self._adoptions.get(sandbox_id)
        if running is None:
            running = asyncio.ensure_future(self._adopt(sandbox_id, owner_full))
            self._adoptions[sandbox_id] = running
            running.add_done_callback(lambda _: self._adoptions.pop(sandbox_id, None))
        await asyncio.shield(running)

    async def _adopt(self, sandbox_id: str, owner_full: bool) -> None:
        try:
            current = await self.store.get_sandbox(sandbox_id)
        except EntryError:
            return  # not a sandbox id: the node's own answer (not found)
        entry = current.entry if current is not None else None
        if entry is None or entry.node_id == self.node_id or not (entry.durable and entry.state == "paused"):
            return
        if self._draining():
            return  # takes no new work (a move's or a gateway's race with this node's drain): not found here
        owner = next((n for n in await self.store.nodes() if n.node_id == entry.node_id), None)
        if owner is not None and not owner.draining and not owner_full:
            return  # its node is up: the sandbox is that node's to resume
        # Fetch first, claim after: the directory moves the sandbox only once this node can serve it.
        # A live owner (draining, or full) resumes a durable pause only after taking its mark off
        # by a compare-and-swap (NodeAgent.before_resume), and the claim needs the mark still on:
        # of the two exactly one wins. A lost one must still be gone.
        await self.node.adopt_paused(sandbox_id)
        lost = entry.node_id if owner is None else None
        result = await self.store.claim_sandbox(
            sandbox_id, self.node_id, epoch=entry.epoch, from_lost=lost, durable_only=True
        )
        if result.ok and result.current is not None:
            self.directory.written[sandbox_id] = result.current
            self.directory.foreign.discard(sandbox_id)
            log.info("took over sandbox %s, durably paused on lost node %s", sandbox_id, entry.node_id)
            return
        await self.node.let_go(sandbox_id)
        winner = result.current.entry.node_id if result.current is not None else "none"
        raise WrongState(f"sandbox {sandbox_id} was taken over by node {winner} meanwhile", sandbox_id=sandbox_id)

    async def durable_written(self, sandbox_id: str, within: float = 10.0) -> bool:
        """Until the directory says the sandbox is durably paused (another node takes over only
        such an entry); whether it does within ``within`` seconds."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if self.directory.durable_in_directory(sandbox_id):
                return True
            self._wake.set()
            await asyncio.sleep(0.05)
        return False

    async def before_resume(self, sandbox_id: str) -> None:
        """A sandbox paused here, durably, is about to resume here. Another node may be taking it
        over while its entry says durably paused: the mark comes off first (a compare-and-swap),
        so from then on none can, and a takeover that won already makes this copy stale: it is not
        resumed (the sandbox is the other node's) and goes."""
        if sandbox_id in self.directory.foreign:
            raise WrongState(f"sandbox {sandbox_id} belongs to another node now", sandbox_id=sandbox_id)
        # Read from etcd, not from what this node last wrote: a write of the durable mark still in
        # flight may land after. The compare-and-swap below is made even on an entry without the
        # mark, so such a write (it compares an older revision) fails once this one is in.
        for _ in range(CLAIM_ATTEMPTS):
            try:
                current = await self.store.get_sandbox(sandbox_id)
                if current is None or current.entry.node_id != self.node_id:
                    break
                listed = dict(current.entry.listed)
                if "durable" in listed:
                    listed["durable"] = False
                held = replace(current.entry, durable=False, listed=listed)
                result = await self.store.replace_sandbox(held, current.mod_revision)
            except ClusterUnavailable:
                self.directory.written.pop(sandbox_id, None)  # perhaps written: the next tick reads it again
                raise
            self._reached()
            if result.ok and result.current is not None:
                self.directory.written[sandbox_id] = result.current
                return
            # changed between the read and the write (this node's own tick, or a claim): once more
        else:
            raise ClusterUnavailable(f"sandbox {sandbox_id}: its directory entry kept changing; try again")
        if current is None:
            if sandbox_id not in self.directory.written:
                return  # never written: nobody could have taken it over
            self.directory.recheck = True  # no entry: killed while this node was cut off (a tombstone)
            raise WrongState(f"sandbox {sandbox_id} was killed through the cluster", sandbox_id=sandbox_id)
        # Stale here: the next tick's reconcile kills this copy (not now: this resume holds its
        # lock, and its caller should hear where the sandbox went, not that it was killed).
        self.directory.written.pop(sandbox_id, None)
        self.directory.recheck = True
        self._wake.set()
        raise WrongState(
            f"sandbox {sandbox_id} was taken over by node {current.entry.node_id}: it resumes there",
            sandbox_id=sandbox_id,
        )

    async def moved_away(self, sandbox_id: str) -> None:
        """Another node took ``sandbox_id`` over (a drain's move): its entry is that node's, and
        the paused copy here goes (its repository entry is the other node's to remove)."""
        self.directory.written.pop(sandbox_id, None)
        self.directory.foreign.add(sandbox_id)
        now = time.monotonic()
        self.moved = {k: t for k, t in self.moved.items() if now - t < MOVED_SECONDS} | {sandbox_id: now}
        await self.node.let_go(sandbox_id)
