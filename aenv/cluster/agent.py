"""The node agent: a node's membership in the cluster and its sandboxes' directory entries.

It registers the node under a lease (its entry vanishes when the node stops renewing it), rewrites
the entry with the node's load about once a second, and keeps one directory entry per sandbox the
node holds. The node tells it of every state change (``Node.state_listeners``); the agent writes
from its own task, so a sandbox operation does not wait on etcd, but for one: the resume of a
durably paused sandbox first takes the entry's durable mark off (one compare-and-swap), since
from that mark on another node may take the sandbox over. Each tick also compares what the
directory should say with what was last written, so a write lost to an etcd outage, or a change
made without a state change (a new timeout), is caught up on.

An entry another node owns (the directory gave the sandbox away: a higher epoch) is never
overwritten; the node's instance of it is stale, and is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from starlette.responses import JSONResponse

from aenv import __version__
from aenv.api.app import sandbox_target
from aenv.api.schemas import sandbox_detail
from aenv.cluster.drain import Drain
from aenv.cluster.entries import (
    MAX_CACHED_NAME,
    MAX_CACHED_NAMES,
    ClusterConfig,
    CreateClaim,
    EntryError,
    NodeEntry,
    SandboxEntry,
    Versioned,
    api_key_digest,
    bounded_metadata,
    check_id,
    encode,
    key_matches,
)
from aenv.cluster.store import CLAIM_ATTEMPTS, ClusterStore, EtcdTls, EtcdUser
from aenv.config import Settings
from aenv.errors import (
    ClusterUnavailable,
    CreateElsewhere,
    InvalidRequest,
    LimitExceeded,
    TemplateNotFound,
    WrongState,
    error_body,
)
from aenv.node.create_ids import KEEP_SECONDS
from aenv.node.service import PUBLIC_STATE, LiveSandbox, NodeService, SandboxState

log = logging.getLogger("aenv.cluster.agent")
# A request that would pause or resume a sandbox (E2B's routes; a connect resumes a paused one).
OWNERSHIP_PATH = re.compile(r"(?:/v2)?/sandboxes/(?P<id>[^/]+)/(?P<op>pause|resume|connect)")
WRITES_IN_FLIGHT = 16  # directory writes one sync has outstanding (a burst of creates lands at once)
HELD_REFRESH = 5.0  # seconds between looks at which templates and snapshots are on the node's disk
MAX_TEMPLATE_NAMES = 8  # a sandbox entry's names of its template (id, name, aliases)
ANNOUNCE_SECONDS = 2.0  # how long a create's answer waits for its sandbox's directory entry
MOVED_SECONDS = 30.0  # how long traffic for a sandbox a drain moved away is told to look again
SWEEP_BATCH = 64  # killed sandboxes' durable pauses one reconcile removes from the repository

Scope = dict[str, Any]
Message = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


class NodeAgent:
    def __init__(
        self,
        node: NodeService,
        store: ClusterStore,
        *,
        node_id: str,
        address: str,
        lease_ttl: int = 10,
        interval: float = 1.0,
        reconcile_interval: float = 10.0,
        api_key: str = "",
    ) -> None:
        self.node = node
        self.store = store
        self.node_id = check_id(node_id, "node id")
        self.address = address
        self.lease_ttl = lease_ttl
        self.interval = interval
        self.reconcile_interval = reconcile_interval
        self.lease_id = 0
        self.started_at = time.time()
        self.written: dict[str, Versioned] = {}  # this node's entries as last written or read
        self.foreign: set[str] = set()  # sandboxes here whose entry another node owns
        self.reached_at = time.monotonic()  # the last time a heartbeat got through to etcd
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._last_error = ""
        self.claims: dict[str, tuple[int, float]] = {}  # create id -> (its key's create revision, when)
        self.killing: set[str] = set()  # stale copies being killed
        self._kills: set[asyncio.Task[None]] = set()
        self._held: list[str] = []  # templates and snapshots on this node's disk (see NodeEntry.cached)
        self._held_at = -HELD_REFRESH
        self._adoptions: dict[str, asyncio.Future[None]] = {}  # durably paused sandboxes being taken over
        self.api_key = api_key  # the cluster's one key: a drain's moves ask other nodes with it
        self.draining = False  # takes no new work (see aenv/cluster/drain.py); until a restart
        self._drain: Drain | None = None
        self._recheck = False  # reconcile at the next tick (an entry could not be created: a tombstone?)
        self._swept: set[str] = set()  # tombstones whose sandbox's durable pause this node removed
        self._listing: dict[str, asyncio.Future[None]] = {}  # new sandboxes whose entry is awaited
        self.moved: dict[str, float] = {}  # sandboxes a drain moved to another node -> when

    # -- start and stop -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Register (fails with ClusterUnavailable if etcd cannot be reached), adopt this node's
        existing directory entries, then keep both up to date from a task of its own."""
        await self._register()
        listing = await self.store.read_all()
        self.written = {k: v for k, v in listing.sandboxes.items() if v.entry.node_id == self.node_id}
        await self._kill_buried()
        await self.sync()
        self.node.state_listeners.append(self._changed)
        self.node.admission_checks.append(self.admit)
        self.node.create_ids.claims = self
        self.node.adopter = self.adopt
        self.node.durable_in_directory = self.durable_in_directory
        self.node.resume_guard = self.before_resume
        self.node.wake_refusal = self.wake_refusal
        self.node.announce = self.announce
        self._task = asyncio.create_task(self._run(), name="cluster-agent")

    async def stop(self) -> None:
        """Write the last states (the node paused its sandboxes), then leave: revoking the lease
        removes the node's entry at once instead of after its TTL."""
        if self._changed in self.node.state_listeners:
            self.node.state_listeners.remove(self._changed)
        if self.admit in self.node.admission_checks:
            self.node.admission_checks.remove(self.admit)
        if self.node.create_ids.claims is self:
            self.node.create_ids.claims = None
        if self.node.adopter == self.adopt:
            self.node.adopter = None
        if self.node.durable_in_directory == self.durable_in_directory:
            self.node.durable_in_directory = None
        if self.node.resume_guard == self.before_resume:
            self.node.resume_guard = None
        if self.node.wake_refusal == self.wake_refusal:
            self.node.wake_refusal = None
        if self.node.announce == self.announce:
            self.node.announce = None
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        try:
            await self.sync()
            if self.lease_id:
                await self.store.revoke_lease(self.lease_id)
        except ClusterUnavailable as exc:
            log.warning("leaving the cluster: %s (the node's entry goes when its lease runs out)", exc.message)
        await self.store.close()

    def _changed(self, sb: LiveSandbox) -> None:
        self._wake.set()

    def admit(self) -> None:
        """Refuse new sandboxes while draining (429: a gateway tries the next node) and while etcd
        does not answer: one no gateway could find, on a node whose registration may be
        expiring, is worse than a clear 503 the client can retry."""
        if self.draining:
            raise LimitExceeded(f"node {self.node_id} is draining: it takes no new sandboxes")
        silent = self.silent()
        if silent is not None:
            raise ClusterUnavailable(
                f"node {self.node_id} has not reached the cluster store for {silent:.0f} s (no quorum?): "
                "it takes no new sandboxes until it does"
            )

    def silent(self) -> float | None:
        """Seconds since etcd last answered, once that is longer than a few heartbeats; else None."""
        silent = time.monotonic() - self.reached_at
        return silent if silent > self.unreachable_after else None

    def refusal(self, method: str, path: str, headers: dict[str, str]) -> str | None:
        """Why this node will not serve a request now (answered 503), or None."""
        if not self.draining and self.silent() is None:
            return None
        op, sandbox_id = _subject(method, path, headers)
        sandbox_id = sandbox_id.split("-")[0] if sandbox_id else None
        if op is None and sandbox_id is not None and sandbox_id not in self.node.sandboxes:
            # traffic for a sandbox this node's drain moved a moment ago: a gateway whose mirror
            # has not seen the move yet sends it again, to where the sandbox runs now (the control
            # plane's 404 leads a gateway there too; a connect finds it by itself)
            if self._just_moved(sandbox_id):
                moved = f"sandbox {sandbox_id} moved to another node (through a gateway)"
                return f"node {self.node_id} is draining: {moved}"
        sb = self.node.sandboxes.get(sandbox_id) if sandbox_id else None
        return self._refusal(op["op"] if op is not None else None, sb)

    def wake_refusal(self, sb: LiveSandbox) -> str | None:
        """Why traffic that found ``sb`` not running may not be served (or wake it) here now, or
        None: asked once it came through, as what it found running when it arrived may be paused
        by then (a drain's move)."""
        return self._refusal(None, sb)

    def _refusal(self, op: str | None, sb: LiveSandbox | None) -> str | None:
        """Why ``op`` (a pause, resume or connect; None for traffic) on ``sb`` must wait, or None."""
        silent = self.silent()
        if silent is not None:
            return self._unreachable_refusal(op, sb, silent)
        if self.draining:
            return self._draining_refusal(op, sb)
        return None

    def _just_moved(self, sandbox_id: str) -> bool:
        moved = self.moved.get(sandbox_id)
        return moved is not None and time.monotonic() - moved < MOVED_SECONDS

    def _draining_refusal(self, op: str | None, sb: LiveSandbox | None) -> str | None:
        """A draining node does not resume a sandbox paused durably, or being so (a connect, or
        traffic waking one with auto-resume): it may be moving to another node right then.
        Through a gateway the resume waits for the pause to be durable and goes to another node;
        asked directly, the client is told to go through one. A pause that stays here for good
        (no repository, no memory) resumes here as before. Traffic to a sandbox the drain is
        moving waits for the move whether it wakes the sandbox or not: the client sees a pause,
        not a sandbox that is gone."""
        if op == "pause":
            return None
        pausing = (SandboxState.PAUSING, SandboxState.PAUSED)
        if sb is None or sb.state not in pausing or self.node.durable_reason(sb.rec):
            return None
        if op is None and self._drain is not None and self._drain.moving(sb.id):
            return f"node {self.node_id} is draining: sandbox {sb.id} is moving to another node (through a gateway)"
        if op is None and not (sb.rec.auto_resume and not sb.rec.filesystem_only):
            return None  # traffic that wakes nothing: the node's own answer (not running)
        return (
            f"node {self.node_id} is draining: sandbox {sb.id} is durably paused and resumes on another node "
            "(through a gateway)"
        )

    def _unreachable_refusal(self, op: str | None, sb: LiveSandbox | None, silent: float) -> str | None:
        """Why a request must wait for etcd, or None. Without etcd a node does not pause or resume
        a sandbox (through its API, a connect, or traffic waking one with auto-resume): what
        the directory says of it, and who holds it, would change where no gateway can see. A
        refused pause leaves it running; a refused resume leaves it paused. Kills, snapshots,
        timeouts and the node's own stop go on (their entries are written once etcd answers)."""
        if sb is None or sb.state == SandboxState.KILLED:
            return None  # the node's own answer (not found)
        if op is None and sb.state != SandboxState.RUNNING and not sb.rec.auto_resume:
            return None  # traffic that wakes nothing: the node's own answer (not running)
        if op == "pause":
            if sb.state != SandboxState.RUNNING:
                return None
            doing = f"pause sandbox {sb.id} (it keeps running)"
        elif sb.state == SandboxState.RUNNING:
            return None  # a connect or resume of a running sandbox only extends its timeout
        else:
            doing = f"resume sandbox {sb.id} (it stays {PUBLIC_STATE[sb.state]})"
        return (
            f"node {self.node_id} has not reached the cluster store for {silent:.0f} s (no quorum?): "
            f"it cannot {doing} until it does; try again then"
        )

    @property
    def unreachable_after(self) -> float:
        return max(3 * self.interval, 2.0)

    async def _run(self) -> None:
        next_beat = time.monotonic() + self.interval
        next_reconcile = time.monotonic() + self.reconcile_interval
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), max(0.0, next_beat - time.monotonic()))
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + self.interval
                    if await self._heartbeat():
                        next_reconcile = 0.0  # back after its lease ran out: what did it miss?
                    await self._release_old_claims()
                if time.monotonic() >= next_reconcile or self._recheck:
                    self._recheck = False
                    await self.reconcile()
                    next_reconcile = time.monotonic() + self.reconcile_interval
                await self.sync()
                self._last_error = ""
            except ClusterUnavailable as exc:
                if exc.message != self._last_error:  # once per distinct failure, not every second
                    log.warning("cluster store: %s", exc.message)
                self._last_error = exc.message
                await asyncio.sleep(self.interval / 2)
                # beat again now: a failover to another member or a new leader takes about a
                # second, and every second more here counts towards refusing work (silent())
                next_beat = min(next_beat, time.monotonic())
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("cluster agent tick failed")
                await asyncio.sleep(self.interval)

    # -- the node's entry ------------------------------------------------------------------------------
    async def _register(self) -> None:
        self.lease_id = await self.store.grant_lease(self.lease_ttl)
        await self.store.put_node(self.entry(), self.lease_id)
        self.reached_at = time.monotonic()
        log.info("registered node %s (%s) with the cluster", self.node_id, self.address)

    async def _heartbeat(self) -> bool:
        """Renew the lease and rewrite the node's entry; True when the lease had run out."""
        if not await self.store.keep_alive(self.lease_id):
            log.warning("node %s's lease expired; registering again", self.node_id)
            await self._register()
            return True
        await self.store.put_node(self.entry(), self.lease_id)
        self.reached_at = time.monotonic()
        return False

    def entry(self) -> NodeEntry:
        settings: Settings = self.node.settings
        load = self.node.capacity()
        return NodeEntry(
            node_id=self.node_id,
            address=self.address,
            driver=settings.driver,
            version=__version__,
            runtime=_runtime_of(self.node.runtime_info()),
            running=load.running,
            paused=load.paused,
            starting=load.starting,
            max_sandboxes=load.max_sandboxes,
            cpu_count=float(os.cpu_count() or 1),
            memory_mb=_host_memory_mb(),
            cpu_committed=load.cpu_committed,
            memory_committed_mb=load.memory_committed_mb,
            cpu_used=load.cpu_used,
            load1=round(os.getloadavg()[0], 2),
            draining=self.draining,
            started_at=self.started_at,
            updated_at=round(time.time(), 3),
            cached=self.held(),
        )

    def held(self) -> list[str]:
        """What this node holds on its disk, looked at every HELD_REFRESH seconds (it costs stats)."""
        if time.monotonic() - self._held_at >= HELD_REFRESH:
            self._held = self.node.artifacts.held(MAX_CACHED_NAMES, MAX_CACHED_NAME)
            self._held_at = time.monotonic()
        return self._held

    # -- stale copies ----------------------------------------------------------------------------------
    async def reconcile(self) -> None:
        """Read the entries of every sandbox this node holds; one the directory gave to another
        node (a resume or move elsewhere while this node was cut off) is a stale copy: killed."""
        held = [sb.id for sb in list(self.node.sandboxes.values()) if sb.state != SandboxState.KILLED]
        entries = await self.store.get_sandboxes(held)
        self.reached_at = time.monotonic()
        for sandbox_id, current in entries.items():
            if current.entry.node_id != self.node_id:
                self._owned_elsewhere(sandbox_id, current)
        await self._kill_buried([i for i in held if i not in entries])
        await self.sweep_buried()

    async def sweep_buried(self) -> None:
        """A sandbox killed through a gateway while its node was lost leaves its durable pause in
        the repository if that node never comes back (back, it kills its copy and the pause with
        it): the live node with the smallest id removes such pauses, once per tombstone. A
        tombstone's sandbox is dead for good (nothing makes or takes over its entry again)."""
        if not self.node.has_repository or min(await self.store.node_ids(), default=self.node_id) != self.node_id:
            return
        stones = await self.store.all_tombstones()
        self._swept &= set(stones)
        fresh = [s for s in stones if s not in self._swept and s not in self.node.sandboxes][:SWEEP_BATCH]
        alive = await self.store.get_sandboxes(fresh)  # a tombstone beside an entry is not to be trusted
        for sandbox_id in fresh:
            if sandbox_id in alive:
                continue
            try:
                if await self.node.forget_durable_pause(sandbox_id):
                    log.info("removed the durable pause of sandbox %s, killed while its node was lost", sandbox_id)
            except Exception as exc:  # the repository out of reach: the next reconcile tries again
                log.warning("removing the durable pause of killed sandbox %s: %r", sandbox_id, exc)
                return
            self._swept.add(sandbox_id)

    async def _kill_buried(self, held: list[str] | None = None) -> None:
        """Sandboxes killed through a gateway while this node was lost (their entry replaced by a
        tombstone): killed here too (a durable pause's repository entry with them), never written
        again. The tombstone goes once the node it was meant for has seen it."""
        if held is None:
            held = [sb.id for sb in list(self.node.sandboxes.values()) if sb.state != SandboxState.KILLED]
        for sandbox_id, stone in (await self.store.tombstones(held)).items():
            if sandbox_id in self.killing or sandbox_id in self._adoptions:
                continue
            log.warning("sandbox %s was killed while node %s was lost: killing it here", sandbox_id, stone.node_id)
            self.written.pop(sandbox_id, None)
            self.foreign.add(sandbox_id)
            self.killing.add(sandbox_id)
            task = asyncio.ensure_future(self._kill_dead(sandbox_id, stone.node_id == self.node_id))
            self._kills.add(task)
            task.add_done_callback(self._kills.discard)

    async def _kill_dead(self, sandbox_id: str, drop_tombstone: bool) -> None:
        try:
            await self.node.kill(sandbox_id)
            if drop_tombstone:
                await self.store.drop_tombstone(sandbox_id)
        except Exception as exc:  # gone already, or its kill failed (logged by the node); the next reconcile retries
            log.warning("killing sandbox %s, killed while its node was lost: %r", sandbox_id, exc)
        finally:
            self.killing.discard(sandbox_id)

    def _owned_elsewhere(self, sandbox_id: str, current: Versioned) -> None:
        if sandbox_id in self._adoptions:
            return  # its entry is the lost node's until the claim: not a stale copy
        ours = self.written.pop(sandbox_id, None)
        self.foreign.add(sandbox_id)  # never written again: the entry is the other node's
        if ours is not None and current.entry.epoch <= ours.entry.epoch:
            log.warning(
                "sandbox %s: node %s wrote an entry at epoch %d", sandbox_id, current.entry.node_id, ours.entry.epoch
            )
            return
        if sandbox_id in self.killing or sandbox_id not in self.node.sandboxes:
            return
        log.warning(
            "sandbox %s belongs to node %s in the directory (epoch %d): killing the stale copy here",
            sandbox_id,
            current.entry.node_id,
            current.entry.epoch,
        )
        self.killing.add(sandbox_id)
        task = asyncio.ensure_future(self._kill_stale(sandbox_id))
        self._kills.add(task)
        task.add_done_callback(self._kills.discard)

    async def _kill_stale(self, sandbox_id: str) -> None:
        try:
            await self.node.let_go(sandbox_id)
        except Exception as exc:  # gone already, or its kill failed (logged by the node)
            log.warning("killing the stale copy of sandbox %s: %r", sandbox_id, exc)
        finally:
            self.killing.discard(sandbox_id)

    # -- durably paused sandboxes of lost nodes ----------------------------------------------------------
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
        if self.draining:
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
            self.written[sandbox_id] = result.current
            self.foreign.discard(sandbox_id)
            log.info("took over sandbox %s, durably paused on lost node %s", sandbox_id, entry.node_id)
            return
        await self.node.let_go(sandbox_id)
        winner = result.current.entry.node_id if result.current is not None else "none"
        raise WrongState(f"sandbox {sandbox_id} was taken over by node {winner} meanwhile", sandbox_id=sandbox_id)

    # -- drain ---------------------------------------------------------------------------------------
    def drain(self, *, move: bool) -> Drain:
        """This node's drain: started, or joined (asking to move makes a drain that only pauses
        move what it pauses from then on)."""
        if self._drain is None:
            self._drain = Drain(self, move=move, api_key=self.api_key)
        elif move:
            self._drain.progress.move = True
        return self._drain

    async def set_draining(self) -> None:
        """Take no new work, and say so in the node's entry at once (gateways stop placing here,
        and other nodes may then take over its durable pauses)."""
        self.draining = True
        await self.store.put_node(self.entry(), self.lease_id)

    async def undrain(self) -> None:
        """Take new work again (``aenv nodes undrain``): a drain under way stops first (what it
        paused stays durably paused here), and the entry says so at once. Idempotent."""
        drain = self._drain
        if drain is not None:
            await drain.stop()  # still this node's drain meanwhile: its moves' traffic is held as before
            if self._drain is drain:
                self._drain = None
        self.draining = False
        await self.store.put_node(self.entry(), self.lease_id)

    def durable_in_directory(self, sandbox_id: str) -> bool:
        """Whether this node's directory entry for the sandbox says durably paused: only then may
        another node take it over, so only then does the node call the pause durable."""
        have = self.written.get(sandbox_id)
        return have is not None and have.entry.durable and have.entry.node_id == self.node_id

    async def announce(self, sandbox_ids: list[str], within: float = ANNOUNCE_SECONDS) -> None:
        """Until the directory lists these new sandboxes (for at most ``within`` seconds): a client
        told of one by this node (a create or fork asked of it directly) finds it through any
        gateway at once, not after the next write."""
        waits = []
        for sandbox_id in sandbox_ids:
            if sandbox_id in self.written or sandbox_id not in self.node.sandboxes:
                continue
            waiting = self._listing.get(sandbox_id)
            if waiting is None:
                waiting = self._listing[sandbox_id] = asyncio.get_running_loop().create_future()
            waits.append(waiting)
        if not waits:
            return
        self._wake.set()
        try:
            _, pending = await asyncio.wait(waits, timeout=within)  # the futures are left as they are
        finally:
            for sandbox_id in sandbox_ids:
                waiting = self._listing.get(sandbox_id)
                if waiting is not None and (waiting.done() or sandbox_id not in self.node.sandboxes):
                    self._listing.pop(sandbox_id, None)
        if pending:
            log.warning("new sandboxes not in the directory within %g s: %s", within, ", ".join(sandbox_ids[:8]))

    async def durable_written(self, sandbox_id: str, within: float = 10.0) -> bool:
        """Until the directory says the sandbox is durably paused (another node takes over only
        such an entry); whether it does within ``within`` seconds."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if self.durable_in_directory(sandbox_id):
                return True
            self._wake.set()
            await asyncio.sleep(0.05)
        return False

    async def before_resume(self, sandbox_id: str) -> None:
        """A sandbox paused here, durably, is about to resume here. Another node may be taking it
        over while its entry says durably paused: the mark comes off first (a compare-and-swap),
        so from then on none can, and a takeover that won already makes this copy stale: it is not
        resumed (the sandbox is the other node's) and goes."""
        if sandbox_id in self.foreign:
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
                self.written.pop(sandbox_id, None)  # perhaps written: the next tick reads it again
                raise
            self.reached_at = time.monotonic()
            if result.ok and result.current is not None:
                self.written[sandbox_id] = result.current
                return
            # changed between the read and the write (this node's own tick, or a claim): once more
        else:
            raise ClusterUnavailable(f"sandbox {sandbox_id}: its directory entry kept changing; try again")
        if current is None:
            if sandbox_id not in self.written:
                return  # never written: nobody could have taken it over
            self._recheck = True  # no entry: killed while this node was cut off (a tombstone)
            raise WrongState(f"sandbox {sandbox_id} was killed through the cluster", sandbox_id=sandbox_id)
        # Stale here: the next tick's reconcile kills this copy (not now: this resume holds its
        # lock, and its caller should hear where the sandbox went, not that it was killed).
        self.written.pop(sandbox_id, None)
        self._recheck = True
        self._wake.set()
        raise WrongState(
            f"sandbox {sandbox_id} was taken over by node {current.entry.node_id}: it resumes there",
            sandbox_id=sandbox_id,
        )

    async def moved_away(self, sandbox_id: str) -> None:
        """Another node took ``sandbox_id`` over (a drain's move): its entry is that node's, and
        the paused copy here goes (its repository entry is the other node's to remove)."""
        self.written.pop(sandbox_id, None)
        self.foreign.add(sandbox_id)
        now = time.monotonic()
        self.moved = {k: t for k, t in self.moved.items() if now - t < MOVED_SECONDS} | {sandbox_id: now}
        await self.node.let_go(sandbox_id)

    # -- create ids (aenv.node.create_ids.Claims) -------------------------------------------------------
    async def claim(self, create_id: str) -> None:
        result = await self.store.claim_create(
            create_id, CreateClaim(self.node_id, round(time.time(), 3)), self.lease_id
        )
        held = result.current
        if held is None:  # gone already (our lease expired in between): nobody holds it, try again
            raise ClusterUnavailable(f"create id {create_id} could not be taken; try again")
        if not result.ok and held.entry.node_id != self.node_id:
            raise CreateElsewhere(f"create id {create_id} is node {held.entry.node_id}'s")
        # ours: just taken, or taken before a restart of this node (that create died with it)
        self.claims[create_id] = (held.create_revision, time.monotonic())

    async def confirm(self, create_id: str) -> None:
        held = await self.store.get_create(create_id)
        mine = self.claims.get(create_id)
        if held is not None and mine is not None and held.create_revision == mine[0]:
            return
        if held is None:  # our lease ran out while cut off, and nobody took the id since: take it again
            self.claims.pop(create_id, None)
            await self.claim(create_id)
            return
        raise CreateElsewhere(f"create id {create_id} went to node {held.entry.node_id} while this node was cut off")

    async def release(self, create_id: str) -> None:
        mine = self.claims.pop(create_id, None)
        if mine is not None:
            with contextlib.suppress(ClusterUnavailable):  # it goes with the lease otherwise
                await self.store.release_create(create_id, mine[0])

    async def _release_old_claims(self) -> None:
        """Claims live while a retry may come (KEEP_SECONDS); then they go (few per second)."""
        now = time.monotonic()
        old = [c for c, (_, at) in self.claims.items() if now - at > KEEP_SECONDS][:WRITES_IN_FLIGHT]
        for create_id in old:
            await self.release(create_id)

    # -- the sandboxes' entries -------------------------------------------------------------------------
    def desired(self) -> dict[str, SandboxEntry]:
        """What the directory should say about each sandbox this node holds."""
        out: dict[str, SandboxEntry] = {}
        runtime = _runtime_of(self.node.runtime_info())
        for sb in list(self.node.sandboxes.values()):
            if sb.state == SandboxState.KILLED or sb.id in self.foreign or sb.id in self._adoptions:
                continue  # (one being taken over is written by its claim)
            rec = sb.rec
            metadata, omitted = bounded_metadata(rec.metadata)
            durable = sb.state == SandboxState.PAUSED and bool(rec.durable_at)
            listed = self._listed(sb)
            if "durable" in listed:  # what this very write says, not what the last one did (one write, not two)
                listed["durable"] = durable
            entry = SandboxEntry(
                sandbox_id=sb.id,
                node_id=self.node_id,
                state=PUBLIC_STATE[sb.state],
                template_id=rec.template_id,
                alias=rec.alias[:200],
                started_at=rec.started_at,
                end_at=rec.end_at,
                metadata=metadata,
                metadata_omitted=omitted,
                listed=listed,
                template_names=self._template_names(rec.template_id),
                durable=durable,
                runtime=runtime,
                team=rec.team,
            )
            out[sb.id] = entry if _fits(entry) else replace(entry, listed={})  # routing needs the entry
        return out

    def _listed(self, sb: LiveSandbox) -> dict[str, object]:
        """The node's list item for ``sb`` without what the entry keeps apart or must not hold:
        metadata, tokens (the gateway derives them from the cluster secret; it is told which the
        sandbox has), the domain."""
        item = sandbox_detail(self.node, sb, None)
        item["secure"] = item.pop("envdAccessToken", None) is not None
        item["private"] = item.pop("trafficAccessToken", None) is not None
        for key in ("metadata", "domain", "sandboxID"):
            item.pop(key, None)
        return item

    def _template_names(self, template: str) -> list[str]:
        try:
            found = self.node.find_template(template)
        except TemplateNotFound:  # the list's filter compares the name the sandbox records
            return [template] if len(template) <= MAX_CACHED_NAME else []
        names = [found.id, found.name, *found.aliases]
        return [n for n in dict.fromkeys(names) if len(n) <= MAX_CACHED_NAME][:MAX_TEMPLATE_NAMES]

    async def sync(self) -> None:
        """Bring this node's directory entries in line with its sandboxes (one CAS each change)."""
        desired = self.desired()
        writes: list[Awaitable[None]] = []
        for sandbox_id, entry in desired.items():
            have = self.written.get(sandbox_id)
            if have is None:
                writes.append(self._create(entry))
            elif have.entry != _with_epoch(entry, have.entry.epoch):
                writes.append(self._replace(_with_epoch(entry, have.entry.epoch), have))
        # One being taken over is left out of ``desired`` but written by its claim: not deleted
        # (a delete there made its resume find no entry, and the next write made it afresh at epoch 1).
        writes += [self._delete(i) for i in self.written if i not in desired and i not in self._adoptions]
        await _bounded_gather(writes, WRITES_IN_FLIGHT)
        self.foreign &= set(self.node.sandboxes)

    async def _create(self, entry: SandboxEntry) -> None:
        try:
            result = await self.store.create_sandbox(entry)
        except EntryError as exc:
            log.warning("sandbox %s has no directory entry: %s", entry.sandbox_id, exc)
            return
        if not result.ok and result.current is None:
            self._recheck = True  # refused with no entry there: killed while this node was lost
        self._settle(entry.sandbox_id, result.ok, result.current)

    async def _replace(self, entry: SandboxEntry, have: Versioned) -> None:
        result = await self.store.replace_sandbox(entry, have.mod_revision)
        self._settle(entry.sandbox_id, result.ok, result.current)

    async def _delete(self, sandbox_id: str) -> None:
        have = self.written[sandbox_id]
        result = await self.store.delete_sandbox(sandbox_id, have.mod_revision)
        self.reached_at = time.monotonic()
        if result.ok or result.current is None or result.current.entry.node_id != self.node_id:
            self.written.pop(sandbox_id, None)  # gone, or no longer ours to delete
        else:
            self.written[sandbox_id] = result.current  # ours, changed meanwhile: next tick retries

    def _settle(self, sandbox_id: str, ok: bool, current: Versioned | None) -> None:
        """Record a write's outcome. A failed CAS leaves what is there: ours (retry at the next
        tick with its revision), nothing (create it next tick), or another node's (stale here)."""
        self.reached_at = time.monotonic()
        if current is None:
            self.written.pop(sandbox_id, None)
        elif current.entry.node_id == self.node_id:
            self.written[sandbox_id] = current
        else:
            self._owned_elsewhere(sandbox_id, current)
        listing = self._listing.pop(sandbox_id, None)
        if listing is not None and not listing.done():
            listing.set_result(None)  # written, or known not to be ours: no longer waited for
        if not ok:
            self._wake.set()


async def _bounded_gather(calls: list[Awaitable[None]], limit: int) -> None:
    """Run ``calls`` at most ``limit`` at a time; the first failure is raised once all are done
    (the others' outcomes are recorded: nothing is written twice)."""
    gate = asyncio.Semaphore(limit)

    async def one(call: Awaitable[None]) -> None:
        async with gate:
            await call

    results = await asyncio.gather(*(one(c) for c in calls), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result


def _fits(entry: SandboxEntry) -> bool:
    try:
        encode(entry)
    except EntryError:
        return False
    return True


def _with_epoch(entry: SandboxEntry, epoch: int) -> SandboxEntry:
    return replace(entry, epoch=epoch)


def _runtime_of(info: dict[str, str]) -> str:
    return f"runsc {info.get('runsc', 'unknown')} {info.get('platform', '')}".strip()


def _host_memory_mb() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20)
    except (ValueError, OSError):
        return 0


# -- configuration -------------------------------------------------------------------------------------
def node_id_of(settings: Settings) -> str:
    """AENV_NODE_ID, else one made once from the host name and kept in the data dir (a restart
    keeps its id, so it takes its directory entries back)."""
    if settings.node_id:
        return check_id(settings.node_id, "node id")
    path: Path = settings.data_dir / "node-id"
    try:
        return check_id(path.read_text().strip(), "node id")
    except FileNotFoundError:
        pass
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:40].strip("-._") or "node"
    node_id = f"{host}-{secrets.token_hex(3)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(node_id + "\n")
    return node_id


def advertise_of(settings: Settings) -> str:
    """The URL gateways reach this node at: AENV_ADVERTISE, else the listening address (refused
    when that is a wildcard, which names no host)."""
    if settings.advertise:
        parts = urlsplit(settings.advertise)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
            raise InvalidRequest(f"--advertise must be http(s)://HOST:PORT, not {settings.advertise[:200]!r}")
        return settings.advertise.rstrip("/")
    if settings.host in ("0.0.0.0", "::", ""):
        raise InvalidRequest("--advertise http://ADDRESS:PORT is needed when listening on every address")
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    return f"http://{host}:{settings.port}"


async def join_cluster(store: ClusterStore, node: Any, api_key: str) -> ClusterConfig:
    """Take the cluster's one token secret, or give it this node's when it is the first to join
    (so a node's sandboxes keep their tokens when it becomes a cluster's first node). A node
    started with another API key than the cluster's is refused: half the requests would be 401."""
    proposed = ClusterConfig(node.token_secret, api_key_digest(node.token_secret, api_key), round(time.time(), 3))
    config = await store.ensure_config(proposed)
    if not key_matches(config, api_key):
        raise InvalidRequest("this node's API key (AENV_API_KEY) is not the one the cluster was started with")
    if config.secret != node.token_secret:
        held = len(node.sandboxes)
        if held:
            log.warning(
                "this node's %d sandboxes get new envd and traffic tokens: the cluster has its own secret",
                held,
            )
        await node.use_token_secret(config.secret)
    return config


def cluster_store(settings: Settings) -> ClusterStore:
    """The store for a node's cluster settings (URL, TLS files, etcd user), checked; not connected."""
    assert settings.cluster
    tls = EtcdTls(settings.cluster_ca, settings.cluster_cert, settings.cluster_key)
    user = EtcdUser.load(settings.cluster_user, settings.cluster_password_file, settings.cluster_password)
    return ClusterStore.from_url(settings.cluster, tls=tls, user=user)


async def start_agent(node: Any, settings: Settings, api_key: str) -> NodeAgent:
    """Join the cluster named by ``settings.cluster`` (raises ClusterUnavailable if out of reach)."""
    store = cluster_store(settings)
    agent = NodeAgent(
        node,
        store,
        node_id=node_id_of(settings),
        address=advertise_of(settings),
        lease_ttl=settings.cluster_lease_ttl,
        reconcile_interval=settings.cluster_reconcile_interval,
        api_key=api_key,
    )
    try:
        await join_cluster(store, node, api_key)
        await agent.start()
    except BaseException:
        await store.close()
        raise
    return agent


def _subject(method: str, path: str, headers: dict[str, str]) -> tuple[re.Match[str] | None, str | None]:
    """(the pause, resume or connect a request is, if it is one; the sandbox it is about): sandbox
    traffic (by its headers or host) is about its own sandbox, whatever its path says."""
    target = sandbox_target(headers)
    if isinstance(target, tuple):
        return None, target[0]
    op = OWNERSHIP_PATH.fullmatch(path) if method == "POST" and target is None else None
    return op, op["id"] if op is not None else None


def refusing_without_quorum(app: ASGIApp, agent: NodeAgent) -> ASGIApp:
    """``app``, with the pauses and resumes ``NodeAgent.refusal`` names answered 503
    ``cluster_unavailable`` (a WebSocket: closed with 1013, try again later) while etcd is silent.
    Only a request that arrives then is looked at: otherwise this costs one clock read."""

    async def wrapped(
        scope: Scope, receive: Callable[[], Awaitable[Message]], send: Callable[[Message], Awaitable[None]]
    ) -> None:
        if scope["type"] in ("http", "websocket") and (agent.draining or agent.silent() is not None):
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            reason = agent.refusal(scope.get("method", "GET"), scope["path"], headers)
            if reason is not None:
                log.warning("%s", reason)
                if scope["type"] == "websocket":
                    await receive()  # websocket.connect
                    await send({"type": "websocket.close", "code": 1013, "reason": "cluster unavailable"})
                    return
                await JSONResponse(error_body(ClusterUnavailable(reason)), status_code=503)(scope, receive, send)
                return
        await app(scope, receive, send)

    return wrapped


def leaving_with(app: ASGIApp, agent: NodeAgent) -> ASGIApp:
    """``app``, with the agent stopped once the app's own shutdown is done (the node has paused
    its sandboxes then; uvicorn re-raises a stopping signal right after, so it cannot wait)."""

    async def wrapped(
        scope: Scope, receive: Callable[[], Awaitable[Message]], send: Callable[[Message], Awaitable[None]]
    ) -> None:
        if scope["type"] != "lifespan":
            await app(scope, receive, send)
            return

        async def on_send(message: Message) -> None:
            if message["type"] in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
                await agent.stop()
            await send(message)

        await app(scope, receive, on_send)

    return wrapped
