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

This module is the membership (register, heartbeat, the tick), what the node refuses while etcd is
silent or it drains, and the drain; the other parts of :mod:`aenv.cluster.agent`: ``directory``
(the sandboxes' entries), ``takeover`` (durable takeovers), ``create_claims`` (create ids),
``joining`` (a node's id, address and store from its settings) and ``node_app`` (the node's app
wrapped for all this).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from aenv import __version__
from aenv.cluster.agent.create_claims import CreateClaims
from aenv.cluster.agent.directory import Directory, runtime_of
from aenv.cluster.agent.drain import Drain
from aenv.cluster.agent.joining import advertise_of, cluster_store, join_cluster, node_id_of
from aenv.cluster.agent.node_app import subject
from aenv.cluster.agent.takeover import Takeovers
from aenv.cluster.entries import MAX_CACHED_NAME, MAX_CACHED_NAMES, NodeEntry, check_id
from aenv.cluster.store import ClusterStore
from aenv.config import Settings
from aenv.errors import ClusterUnavailable, LimitExceeded
from aenv.node import metrics
from aenv.node.service import PUBLIC_STATE, LiveSandbox, NodeService, SandboxState

__all__ = ["NodeAgent", "start_agent"]

log = logging.getLogger("aenv.cluster.agent")
HELD_REFRESH = 5.0  # seconds between looks at which templates and snapshots are on the node's disk


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
        cached_names: Callable[[int, int], list[str]] = lambda limit, longest: [],
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
        self.reached_at = time.monotonic()  # the last time a heartbeat got through to etcd
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._last_error = ""
        # what this node holds on its disk (see NodeEntry.cached): its artifact cache's names
        self._cached_names = cached_names
        self._held: list[str] = []
        self._held_at = -HELD_REFRESH
        self.api_key = api_key  # the cluster's one key: a drain's moves ask other nodes with it
        self.draining = False  # takes no new work (see aenv/cluster/agent/drain.py); until a restart
        self._drain: Drain | None = None
        self.directory = Directory(
            node, store, self.node_id, wake=self._wake, reached=self._reached, adopting=self._adopting
        )
        self.takeovers = Takeovers(
            node,
            store,
            self.node_id,
            self.directory,
            wake=self._wake,
            reached=self._reached,
            draining=lambda: self.draining,
        )
        self.create_claims = CreateClaims(store, self.node_id, lambda: self.lease_id)

    def _reached(self) -> None:
        self.reached_at = time.monotonic()

    def _adopting(self, sandbox_id: str) -> bool:
        return self.takeovers.adopting(sandbox_id)

    async def durable_written(self, sandbox_id: str, within: float = 10.0) -> bool:
        """Until the directory says the sandbox is durably paused (a drain's move waits for it)."""
        return await self.takeovers.durable_written(sandbox_id, within)

    async def moved_away(self, sandbox_id: str) -> None:
        """Another node took ``sandbox_id`` over (a drain's move): the copy here goes."""
        await self.takeovers.moved_away(sandbox_id)

    # -- start and stop -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Register (fails with ClusterUnavailable if etcd cannot be reached), adopt this node's
        existing directory entries, then keep both up to date from a task of its own."""
        await self._register()
        listing = await self.store.read_all()
        directory = self.directory
        directory.written = {k: v for k, v in listing.sandboxes.items() if v.entry.node_id == self.node_id}
        await directory.kill_buried()
        await directory.sync()
        self.node.state_listeners.append(self._changed)
        self.node.admission_checks.append(self.admit)
        self.node.create_ids.claims = self.create_claims
        self.node.adopter = self.takeovers.adopt
        self.node.durable_in_directory = directory.durable_in_directory
        self.node.resume_guard = self.takeovers.before_resume
        self.node.wake_refusal = self.wake_refusal
        self.node.announce = directory.announce
        self._task = asyncio.create_task(self._run(), name="cluster-agent")

    async def stop(self) -> None:
        """Write the last states (the node paused its sandboxes), then leave: revoking the lease
        removes the node's entry at once instead of after its TTL."""
        if self._changed in self.node.state_listeners:
            self.node.state_listeners.remove(self._changed)
        if self.admit in self.node.admission_checks:
            self.node.admission_checks.remove(self.admit)
        if self.node.create_ids.claims is self.create_claims:
            self.node.create_ids.claims = None
        if self.node.adopter == self.takeovers.adopt:
            self.node.adopter = None
        if self.node.durable_in_directory == self.directory.durable_in_directory:
            self.node.durable_in_directory = None
        if self.node.resume_guard == self.takeovers.before_resume:
            self.node.resume_guard = None
        if self.node.wake_refusal == self.wake_refusal:
            self.node.wake_refusal = None
        if self.node.announce == self.directory.announce:
            self.node.announce = None
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        try:
            await self.directory.sync()
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
        op, sandbox_id = subject(method, path, headers)
        sandbox_id = sandbox_id.split("-")[0] if sandbox_id else None
        if op is None and sandbox_id is not None and sandbox_id not in self.node.sandboxes:
            # traffic for a sandbox this node's drain moved a moment ago: a gateway whose mirror
            # has not seen the move yet sends it again, to where the sandbox runs now (the control
            # plane's 404 leads a gateway there too; a connect finds it by itself)
            if self.takeovers.just_moved(sandbox_id):
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
                    await self.create_claims.release_old()
                if time.monotonic() >= next_reconcile or self.directory.recheck:
                    self.directory.recheck = False
                    await self.directory.reconcile()
                    next_reconcile = time.monotonic() + self.reconcile_interval
                await self.directory.sync()
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
        created = metrics.outcomes("create")
        return NodeEntry(
            node_id=self.node_id,
            address=self.address,
            driver=settings.driver,
            version=__version__,
            runtime=runtime_of(self.node.runtime_info()),
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
            create_successes=created[0],
            create_fails=created[1],
        )

    def held(self) -> list[str]:
        """What this node holds on its disk, looked at every HELD_REFRESH seconds (it costs stats)."""
        if time.monotonic() - self._held_at >= HELD_REFRESH:
            self._held = self._cached_names(MAX_CACHED_NAMES, MAX_CACHED_NAME)
            self._held_at = time.monotonic()
        return self._held

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


def _host_memory_mb() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20)
    except (ValueError, OSError):
        return 0


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
        cached_names=node.artifacts.held,
    )
    try:
        await join_cluster(store, node, api_key)
        await agent.start()
    except BaseException:
        await store.close()
        raise
    return agent
