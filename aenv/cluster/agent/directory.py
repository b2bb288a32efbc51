"""This node's sandboxes in the cluster's directory: one entry per sandbox it holds, kept in line.

The node tells the agent of every state change; the agent's tick calls :meth:`Directory.sync`,
which compares what the directory should say with what was last written and writes the difference
(one compare-and-swap each), so a write lost to an etcd outage, or a change made without a state
change (a new timeout), is caught up on. :meth:`Directory.reconcile` reads the entries back: one
another node owns (the directory gave the sandbox away: a higher epoch) is never overwritten; the
node's instance of it is stale, and is killed, as is one killed through a gateway while this node
was lost (a tombstone). Apart from the membership (:mod:`aenv.cluster.agent.membership`: heartbeat,
refusals) because this is the part that owns what the node last wrote. The gateway's side, which
reads every node's entries, is :mod:`aenv.cluster.gateway.directory`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace

from aenv.api.schemas import sandbox_detail
from aenv.cluster.entries import MAX_CACHED_NAME, EntryError, SandboxEntry, Versioned, bounded_metadata, encode
from aenv.cluster.store import ClusterStore
from aenv.errors import TemplateNotFound
from aenv.node.service import PUBLIC_STATE, LiveSandbox, NodeService, SandboxState

log = logging.getLogger("aenv.cluster.agent")
WRITES_IN_FLIGHT = 16  # directory writes one sync has outstanding (a burst of creates lands at once)
MAX_TEMPLATE_NAMES = 8  # a sandbox entry's names of its template (id, name, aliases)
ANNOUNCE_SECONDS = 2.0  # how long a create's answer waits for its sandbox's directory entry
SWEEP_BATCH = 64  # killed sandboxes' durable pauses one reconcile removes from the repository


class Directory:
    """This node's directory entries: what it last wrote or read of each (``written``), the
    sandboxes here whose entry another node owns (``foreign``), and the writes and kills that keep
    them in line. ``wake`` is the agent's tick (set to write sooner), ``reached`` records that etcd
    answered, ``adopting`` tells a sandbox being taken over (its entry is written by its claim)."""

    def __init__(
        self,
        node: NodeService,
        store: ClusterStore,
        node_id: str,
        *,
        wake: asyncio.Event,
        reached: Callable[[], None],
        adopting: Callable[[str], bool],
    ) -> None:
        self.node = node
        self.store = store
        self.node_id = node_id
        self._wake = wake
        self._reached = reached
        self._adopting = adopting
        self.written: dict[str, Versioned] = {}  # this node's entries as last written or read
        self.foreign: set[str] = set()  # sandboxes here whose entry another node owns
        self.killing: set[str] = set()  # stale copies being killed
        self._kills: set[asyncio.Task[None]] = set()
        self.recheck = False  # reconcile at the next tick (an entry could not be created: a tombstone?)
        self._swept: set[str] = set()  # tombstones whose sandbox's durable pause this node removed
        self._listing: dict[str, asyncio.Future[None]] = {}  # new sandboxes whose entry is awaited

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

    def desired(self) -> dict[str, SandboxEntry]:
        """What the directory should say about each sandbox this node holds."""
        out: dict[str, SandboxEntry] = {}
        runtime = runtime_of(self.node.runtime_info())
        for sb in list(self.node.sandboxes.values()):
            if sb.state == SandboxState.KILLED or sb.id in self.foreign or self._adopting(sb.id):
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
        writes += [self._delete(i) for i in self.written if i not in desired and not self._adopting(i)]
        await _bounded_gather(writes, WRITES_IN_FLIGHT)
        self.foreign &= set(self.node.sandboxes)

    async def _create(self, entry: SandboxEntry) -> None:
        try:
            result = await self.store.create_sandbox(entry)
        except EntryError as exc:
            log.warning("sandbox %s has no directory entry: %s", entry.sandbox_id, exc)
            return
        if not result.ok and result.current is None:
            self.recheck = True  # refused with no entry there: killed while this node was lost
        self._settle(entry.sandbox_id, result.ok, result.current)

    async def _replace(self, entry: SandboxEntry, have: Versioned) -> None:
        result = await self.store.replace_sandbox(entry, have.mod_revision)
        self._settle(entry.sandbox_id, result.ok, result.current)

    async def _delete(self, sandbox_id: str) -> None:
        have = self.written[sandbox_id]
        result = await self.store.delete_sandbox(sandbox_id, have.mod_revision)
        self._reached()
        if result.ok or result.current is None or result.current.entry.node_id != self.node_id:
            self.written.pop(sandbox_id, None)  # gone, or no longer ours to delete
        else:
            self.written[sandbox_id] = result.current  # ours, changed meanwhile: next tick retries

    def _settle(self, sandbox_id: str, ok: bool, current: Versioned | None) -> None:
        """Record a write's outcome. A failed CAS leaves what is there: ours (retry at the next
        tick with its revision), nothing (create it next tick), or another node's (stale here)."""
        self._reached()
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

    async def reconcile(self) -> None:
        """Read the entries of every sandbox this node holds; one the directory gave to another
        node (a resume or move elsewhere while this node was cut off) is a stale copy: killed."""
        held = [sb.id for sb in list(self.node.sandboxes.values()) if sb.state != SandboxState.KILLED]
        entries = await self.store.get_sandboxes(held)
        self._reached()
        for sandbox_id, current in entries.items():
            if current.entry.node_id != self.node_id:
                self._owned_elsewhere(sandbox_id, current)
        await self.kill_buried([i for i in held if i not in entries])
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

    async def kill_buried(self, held: list[str] | None = None) -> None:
        """Sandboxes killed through a gateway while this node was lost (their entry replaced by a
        tombstone): killed here too (a durable pause's repository entry with them), never written
        again. The tombstone goes once the node it was meant for has seen it."""
        if held is None:
            held = [sb.id for sb in list(self.node.sandboxes.values()) if sb.state != SandboxState.KILLED]
        for sandbox_id, stone in (await self.store.tombstones(held)).items():
            if sandbox_id in self.killing or self._adopting(sandbox_id):
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
        if self._adopting(sandbox_id):
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


def runtime_of(info: dict[str, str]) -> str:
    return f"runsc {info.get('runsc', 'unknown')} {info.get('platform', '')}".strip()
