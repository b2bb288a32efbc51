"""Pause, resume and snapshot: the operations that checkpoint a running sandbox or restore a
paused one, the branches a fork takes of its source, durable pauses taken over from another node,
and waking a paused sandbox for traffic.

``Node`` (aenv/node/orchestrator.py) makes one ``Checkpoints`` from the parts it uses: the records,
the instances, the runner every operation goes through, the admission checks and the hooks the
cluster agent sets (read at each call).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Awaitable, Callable

from aenv.errors import ArtifactDamaged, ClusterUnavailable, ImageIncompatible, InvalidRequest, WrongState
from aenv.node import rollout
from aenv.node.admission import Admission, Hooks
from aenv.node.artifacts import ArtifactCache
from aenv.node.catalogue import Catalogue
from aenv.node.instances import Instances
from aenv.node.records import Records
from aenv.node.rollout import RolloutLogs
from aenv.node.runner import Runner
from aenv.node.sandbox import LiveSandbox
from aenv.node.state import SandboxState
from aenv.node.store import SandboxRecord, SnapshotRecord
from aenv.runtime.base import Driver
from aenv.storage.layers import LayerStore, new_id

log = logging.getLogger("aenv.node")
S = SandboxState
EXCHANGE_GRACE = 5.0  # how long a pause waits for the HTTP requests relayed to the sandbox's ports
EXCHANGE_POLL = 0.02
WAKE_ROUNDS = 3  # how often traffic wakes a sandbox paused again each time before it gives up


class Checkpoints:
    def __init__(
        self,
        *,
        records: Records,
        instances: Instances,
        runner: Runner,
        admission: Admission,
        hooks: Hooks,
        driver: Driver,
        files: LayerStore,
        artifacts: ArtifactCache,
        catalogue: Catalogue,
        rollouts: RolloutLogs,
    ) -> None:
        self.records = records
        self.instances = instances
        self.runner = runner
        self.admission = admission
        self.hooks = hooks
        self.driver = driver
        self.files = files
        self.artifacts = artifacts
        self.catalogue = catalogue
        self.rollouts = rollouts

    async def pause(self, sandbox_id: str, *, keep_memory: bool = True, settle_streams: bool = False) -> SandboxRecord:
        """Pause a running sandbox. Without ``keep_memory`` only its file system is kept (E2B's
        filesystem-only pause): its processes end and the resume boots it fresh. With
        ``settle_streams`` (a drain's move) its commands' output streams may end first as well."""
        sb = self.records.get(sandbox_id)

        async def run() -> SandboxRecord:
            if sb.state == S.PAUSED:
                raise WrongState(f"sandbox {sb.id} is already paused", sandbox_id=sb.id)
            await self.records.set_state(sb, S.PAUSING, persist=False)
            await self._exchanges_finish(sb, streams=settle_streams)
            upper = sb.rec.upper
            try:
                image = await self.instances.checkpoint_stopped(sb) if keep_memory else await self.instances.halt(sb)
            except BaseException:
                await self.runner.after_failed_checkpoint(sb)
                raise
            self.instances.stop_instance(sb, f"sandbox {sb.id} was paused")
            sb.rec.image = image
            sb.rec.filesystem_only = not keep_memory
            sb.rec.paused_at = time.time()
            sb.rec.durable_at = 0.0
            await self.records.set_state(sb, S.PAUSED)
            self.artifacts.commit_pause_later(sb)  # not waited for: the pause is done locally
            if not keep_memory:
                # Not checkpointed, the instance runs (its agent idle) until torn down; answer once
                # it is gone. A resume waits for it too, should this wait be cut short.
                await self.instances.settled([upper])
            return sb.rec

        # The two kinds do not join: a pause without memory asked during a full one finds it paused.
        return await self.runner.operate(sb, "pause" if keep_memory else "pause_filesystem", run, join=True)

    @staticmethod
    async def _exchanges_finish(sb: LiveSandbox, *, streams: bool = False) -> None:
        """Let the HTTP requests being relayed to its ports and envd's finish (new ones wait: it is
        pausing), for at most EXCHANGE_GRACE: a pause cut them short, and a client saw a response
        end before its Content-Length (a drain's move pauses with traffic going on)."""
        deadline = time.monotonic() + EXCHANGE_GRACE
        while sb.exchanging(streams=streams) and time.monotonic() < deadline:  # noqa: ASYNC110 - no one event for their ends
            await asyncio.sleep(EXCHANGE_POLL)

    async def resume(
        self, sandbox_id: str, *, timeout: int | None = None, memory: bool = True, owner_full: bool = False
    ) -> tuple[SandboxRecord, bool]:
        """Resume a paused sandbox; returns (record, True if it was resumed, False if it ran).
        Without ``memory`` (E2B's connect ``memory: false``, the SDKs' ``on_resume="reboot"``)
        one paused with its memory boots fresh on its files instead, as one paused without.
        ``owner_full``: a gateway's word that the sandbox's own node refused it for room."""
        if sandbox_id not in self.records.sandboxes and self.hooks.adopter is not None:
            # durably paused on a node that is gone, draining or full: taken over here
            await self.hooks.adopter(sandbox_id, owner_full)
        sb = self.records.get(sandbox_id)
        # Without a timeout it keeps its own (E2B restarts it at 300 s): a 600 s sandbox paused and
        # resumed runs 600 s again; one that names a timeout makes it the sandbox's own.
        timeout_s = self.admission.check_timeout(timeout) if timeout is not None else self.admission.own_timeout(sb.rec)

        async def run() -> tuple[SandboxRecord, bool]:
            if sb.state == S.RUNNING:
                sb.rec.end_at = max(sb.rec.end_at, time.time() + timeout_s)  # as E2B: only extended
                sb.rec.timeout = timeout_s
                await self.records.store.put_sandbox(sb.rec)
                self.records.updated(sb, {"end_at": sb.rec.end_at})  # as E2B's: an update, even unchanged
                return sb.rec, False
            # A resume takes a running sandbox's room, as a create does (429: a gateway takes a
            # durable pause elsewhere); checked before the guard, which makes it no longer movable.
            self.admission.check_room(sb.rec)
            if sb.rec.durable_at and self.hooks.resume_guard is not None:
                await self.hooks.resume_guard(sb.id)  # raises if another node took it over: it stays paused here
                self.admission.check_room(sb.rec)  # taken meanwhile: it stays paused (the agent marks it durable again)
            await self.records.set_state(sb, S.RESUMING, persist=False)
            try:
                await self.artifacts.release_pause(sb)
                await self.files.mount(sb.rec.upper, writable=True)
                await self.files.remount(sb.rec.upper, writable=True)  # read-only while it was committed
                if sb.rec.filesystem_only or not memory:
                    await self.instances.settled([sb.rec.upper])  # the instance it paused
                    await self.instances.boot_into(sb)
                else:
                    await self.instances.restore_into(
                        sb, image=sb.rec.image, layers=sb.rec.layers, upper=sb.rec.upper, fresh=True
                    )
            except BaseException as exc:
                if sb.killer is None:
                    await self.records.set_state(sb, S.PAUSED, persist=False)
                    self.artifacts.commit_pause_later(sb)  # if the resume abandoned it
                if isinstance(exc, ImageIncompatible):
                    remedy = "resume it without its memory (connect with memory=false) to boot it on its files"
                    raise ImageIncompatible(f"{exc.message}; {remedy}", sandbox_id=sb.id) from exc
                raise
            self.files.remove_image(sb.rec.image)
            sb.rec.image = ""
            sb.rec.filesystem_only = False
            if sb.rec.durable_at:
                sb.rec.durable_at = 0.0
                self.instances.spawn(self.artifacts.forget_pause(sb.id))  # it runs here now
            sb.rec.end_at = time.time() + timeout_s
            sb.rec.timeout = timeout_s
            await self.records.set_state(sb, S.RUNNING)
            return sb.rec, True

        return await self.runner.operate(sb, "resume", run, join=True)

    async def adopt_paused(self, sandbox_id: str) -> None:
        """Hold a sandbox another node paused durably: its record and artifacts from the repository
        (its upper there is a layer here, under an empty upper of its own); paused, so the resume
        that asked for it restores it with its id, metadata, env, timeout and network rules."""
        if sandbox_id in self.records.sandboxes:
            return
        self.admission.check_room()  # before any fetch: with no room here it goes to another node (429)
        rec = await self.artifacts.fetch_pause(sandbox_id)
        if sandbox_id in self.records.sandboxes:
            return  # another adoption here finished first
        if rec.state != S.PAUSED:  # a repository entry is committed only once its pause is done
            raise ArtifactDamaged(f"sandbox {sandbox_id}: its repository entry is not a paused sandbox")
        rec.upper = await self.files.new_upper(self.records.limits_of(rec).disk_mb)
        rec.instance_id = ""
        sb = LiveSandbox(rec)
        sb.events.note("taken over: another node's durable pause, fetched from the repository")
        self.records.sandboxes[rec.id] = sb
        await self.records.store.put_sandbox(rec)

    async def let_go(self, sandbox_id: str) -> None:
        sb = self.records.sandboxes.get(sandbox_id)
        if sb is not None:
            sb.rec.durable_at = 0.0  # its repository entry is the other node's now: kept
            await self.runner.kill(sandbox_id)

    async def forget_durable_pause(self, sandbox_id: str) -> bool:
        repo = self.artifacts.repo
        if repo is None or sandbox_id in self.records.sandboxes or not await self.artifacts.holds_pause(sandbox_id):
            return False
        await asyncio.to_thread(repo.delete_entry, "sandbox", sandbox_id)  # raises: tried again later
        return True

    async def ensure_running(self, sandbox_id: str) -> LiveSandbox:
        """For data-plane traffic: a paused sandbox with auto-resume comes back on use. What this
        returns is running when the caller gets it (no await in between): a pause that starts
        later sees what the caller then registers (LiveSandbox.exchanges)."""
        for _ in range(WAKE_ROUNDS):
            sb = self.records.get(sandbox_id)
            if sb.state == S.RUNNING and sb.link is not None:
                return sb
            if _traffic_wakes(sb):
                refusal = self.hooks.wake_refusal(sb) if self.hooks.wake_refusal is not None else None
                if refusal is not None:  # a draining node's pause is moving, or etcd is silent
                    raise ClusterUnavailable(refusal)
                await self.resume(sandbox_id)
                continue  # paused again meanwhile? Looked at afresh.
            async with sb.lock:  # wait out a transition in progress (a pause: then woken, above)
                pass
            if sb.state != S.RUNNING and not _traffic_wakes(sb):
                break
        sb = self.records.get(sandbox_id)
        refusal = self.hooks.wake_refusal(sb) if self.hooks.wake_refusal is not None and sb.state != S.KILLED else None
        if refusal is not None:  # not running for now: a drain is moving it (its traffic is held back)
            raise ClusterUnavailable(refusal)
        if sb.state == S.PAUSED and sb.rec.filesystem_only:
            message = f"sandbox {sandbox_id} is paused without its memory; resume it explicitly (connect)"
            raise WrongState(message, sandbox_id=sandbox_id)
        raise WrongState(f"sandbox {sandbox_id} is {sb.state.value}", sandbox_id=sandbox_id)

    async def snapshot(self, sandbox_id: str, *, name: str | None = None, durable: bool = False) -> SnapshotRecord:
        """Snapshot a running sandbox; it is committed to the repository in the background, or
        before this returns with ``durable``."""
        sb = self.records.get(sandbox_id)
        if name is not None and self.catalogue.snapshot_named(name):
            raise InvalidRequest(f"a snapshot named '{name}' already exists")

        async def run() -> SnapshotRecord:
            leaves_running = self.driver.leaves_running
            if leaves_running:
                image, layers = await self.branch_running(sb, S.SNAPSHOTTING)
                await self.records.set_state(sb, S.RUNNING)
            else:
                image, layers = await self.branch(sb, S.SNAPSHOTTING)
            snap = SnapshotRecord(
                id=f"snap_{new_id(16)}",
                name=name or "",
                sandbox_id=sb.id,
                template_id=sb.rec.template_id,
                layers=layers,
                image=image,
                created_at=time.time(),
                metadata=dict(sb.rec.metadata),
                env_vars=dict(sb.rec.env_vars),
                limits=dict(sb.rec.limits),
                guest=sb.rec.guest,
                user=sb.rec.user,
                workdir=sb.rec.workdir,
                start=dict(sb.rec.start),
                team=sb.rec.team,
            )
            try:
                await self.catalogue.put_snapshot(snap)
                self.rollouts.copy(sb.id, rollout.snapshot_key(snap.id))
            except BaseException:  # its record could not be written: the snapshot is not, the source runs on
                self.catalogue.snapshots.pop(snap.id, None)
                if not leaves_running:
                    await self.restart_source(sb, image)
                    await self.records.set_state(sb, S.RUNNING)
                self.files.remove_image(image)
                for layer in [x for x in layers if x not in sb.rec.layers]:  # the upper's copy
                    await self.files.remove(layer)
                raise
            self.artifacts.commit_later(snap)
            sb.events.note(f"snapshot {snap.id}{f' ({snap.name[:100]})' if snap.name else ''}")
            if not leaves_running:
                await self.restart_source(sb, image)
                await self.records.set_state(sb, S.RUNNING)
            return snap

        snap = await self.runner.operate(sb, "snapshot", run, join=False)
        if durable:
            await self.artifacts.wait_committed(snap)
        return snap

    async def branch(self, sb: LiveSandbox, during: SandboxState) -> tuple[str, list[str]]:
        """Checkpoint a running sandbox and seal its upper; returns (image, layers).

        The caller restores the source from that image onto a fresh upper. If the checkpoint
        fails the sandbox is left running."""
        await self.records.set_state(sb, during, persist=False)
        try:
            image = await self.instances.checkpoint_stopped(sb)
        except BaseException:
            await self.runner.after_failed_checkpoint(sb)
            raise
        sealed = sb.rec.upper
        empty = self.files.is_empty(sealed)

        async def settle() -> None:  # once the old instance is gone, nothing writes the old upper
            if empty:
                await self.files.remove(sealed)
            else:
                await self.files.make_read_only(sealed)

        self.instances.stop_instance(sb, "", keep_streams=True, then=settle)
        layers = [*sb.rec.layers, *([] if empty else [sealed])]
        sb.rec.layers = layers
        sb.rec.upper = await self.files.new_upper(self.records.limits_of(sb.rec).disk_mb)
        return image, layers

    async def branch_running(
        self, sb: LiveSandbox, during: SandboxState, *, also: Callable[[], Awaitable[None]] | None = None
    ) -> tuple[str, list[str]]:
        """Checkpoint a running sandbox leaving it running, with a copy of its upper as a new layer;
        returns (image, layers) for the copies. The source keeps its instance, upper and streams.
        ``also`` runs while it is stopped (a fork's volume copies). If the checkpoint (or ``also``)
        fails the sandbox is left running."""
        await self.records.set_state(sb, during, persist=False)
        try:
            image, copy = await self.instances.checkpoint_running(sb, also=also)
        except BaseException:
            await self.runner.after_failed_checkpoint(sb)
            raise
        return image, [*sb.rec.layers, *([copy] if copy is not None else [])]

    async def restart_source(self, sb: LiveSandbox, image: str) -> None:
        try:
            await self.instances.restore_into(sb, image=image, layers=sb.rec.layers, upper=sb.rec.upper, fresh=False)
        except BaseException:
            if sb.link is not None:
                sb.link.close("sandbox could not be restarted")
                sb.link = None
            if sb.killer is not None:
                raise  # killed meanwhile: nothing to keep
            # The source could not come back; keep it as a paused sandbox rather than lose it.
            log.exception("sandbox %s could not be restarted after a checkpoint; keeping it paused", sb.id)
            copy = new_id()
            await asyncio.to_thread(shutil.copytree, self.files.image(image), self.files.image(copy))
            sb.rec.image = copy
            await self.records.set_state(sb, S.PAUSED)
            raise


def _traffic_wakes(sb: LiveSandbox) -> bool:
    """Whether data-plane traffic resumes ``sb``. Never one paused without memory: its resume is a
    reboot, which loses whatever ran, so only an explicit resume (connect) does that, as in E2B."""
    return sb.state in (S.PAUSED, S.RESUMING) and sb.rec.auto_resume and not sb.rec.filesystem_only
