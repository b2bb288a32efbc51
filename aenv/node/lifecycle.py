"""Every lifecycle operation on a sandbox: create, pause, resume, snapshot, fork, network, timeout and
kill, and the runner they go through.

Each operation on a sandbox runs as its own task under the sandbox's lock, so it completes even
if the client that asked for it goes away, and concurrent requests for the same idempotent
transition (pause, resume) join the task already running instead of starting a second one. Every
operation has a deadline. A kill does not queue behind them: it cancels whatever is in flight on
the sandbox (those callers get 404, the sandbox was killed) and removes it within seconds.

The ``Lifecycle`` part of ``Node`` (aenv/node/orchestrator.py).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aenv.errors import (
    AenvError,
    ArtifactDamaged,
    ClusterUnavailable,
    ImageIncompatible,
    InvalidRequest,
    LimitExceeded,
    OperationTimeout,
    QuotaExceeded,
    SandboxNotFound,
    TemplateNotFound,
    WrongState,
)
from aenv.node import housekeeping, metrics, rollout
from aenv.node.egress import EgressPolicy
from aenv.node.sandbox import ForkResult, LiveSandbox, log_failure, new_sandbox_id
from aenv.node.spec import DEFAULT_SPEC, SandboxSpec
from aenv.node.state import SETTLED, SandboxState
from aenv.node.store import SandboxRecord, SnapshotRecord, TemplateRecord
from aenv.node.warmpool import Member, memory_available_mb
from aenv.storage.layers import new_id
from aenv.teams.model import team_of_new

log = logging.getLogger("aenv.node")
S = SandboxState
T = TypeVar("T")
KILL_GRACE = 10.0  # how long a kill waits for the operations it cancelled to unwind
EXCHANGE_GRACE = 5.0  # how long a pause waits for the HTTP requests relayed to the sandbox's ports
EXCHANGE_POLL = 0.02
WAKE_ROUNDS = 3  # how often traffic wakes a sandbox paused again each time before it gives up


class Lifecycle:
    async def _operate(self, sb: LiveSandbox, name: str, fn: Callable[[], Awaitable[T]], *, join: bool) -> T:
        if join:
            running = sb.ops.get(name)
            if running is not None and not running.done():
                return await self._outcome(sb, name, running)
        if sb.killer is not None:
            raise self._killed(sb, name)

        async def locked() -> T:
            async with sb.lock:
                if sb.killer is not None:  # killed while this one waited for the lock
                    raise self._killed(sb, name)
                started = time.monotonic()
                try:
                    result = await self._within_deadline(sb, name, fn)
                except BaseException as exc:
                    metrics.operation_failed(name, exc)
                    raise
                finally:
                    self._check_settled(sb, name)
                metrics.OPERATIONS.labels(op=name, outcome="ok").inc()
                metrics.OPERATION_SECONDS.labels(op=name).observe(time.monotonic() - started)
                return result

        task: asyncio.Task[T] = asyncio.ensure_future(locked())
        self._background.add(task)
        sb.tasks.add(task)
        if join:
            sb.ops[name] = task

        def done(t: asyncio.Task[T]) -> None:
            self._background.discard(t)
            sb.tasks.discard(t)
            if sb.ops.get(name) is t:
                sb.ops.pop(name, None)
            if not t.cancelled():
                t.exception()  # retrieved: a client that left must not cause a warning

        task.add_done_callback(done)
        return await self._outcome(sb, name, task)

    async def _outcome(self, sb: LiveSandbox, name: str, task: asyncio.Task[T]) -> T:
        """The operation's result; if a kill stopped it, a clear error for its caller."""
        try:
            return await asyncio.shield(task)
        except BaseException as exc:
            caller = asyncio.current_task()
            if sb.killer is None or (caller is not None and caller.cancelling()):
                raise
            raise self._killed(sb, name) from exc

    def _killed(self, sb: LiveSandbox, name: str) -> SandboxNotFound:
        return SandboxNotFound(f"sandbox {sb.id} was killed (during {name})", sandbox_id=sb.id)

    async def _within_deadline(self, sb: LiveSandbox, name: str, fn: Callable[[], Awaitable[T]]) -> T:
        """``fn``, cancelled past the operation deadline: its cleanup puts the sandbox back."""
        limit = self.settings.operation_timeout
        deadline = asyncio.timeout(limit)
        try:
            async with deadline:
                return await fn()
        except TimeoutError as exc:
            if not deadline.expired():
                raise
            raise OperationTimeout(
                f"{name} of sandbox {sb.id} did not finish within {limit:g}s", sandbox_id=sb.id
            ) from exc

    def _check_settled(self, sb: LiveSandbox, name: str) -> None:
        """After an operation a sandbox is running, paused or gone; one left in between (an
        operation that could not put it back) is killed rather than left there for good."""
        if self.sandboxes.get(sb.id) is sb and sb.killer is None and sb.state not in SETTLED:
            log.error("sandbox %s was left %s by %s; killing it", sb.id, sb.state.value, name)
            self.spawn(self.kill(sb.id))

    async def _after_failed_checkpoint(self, sb: LiveSandbox) -> None:
        """Back to running if the instance survived (the usual case); otherwise it is gone."""
        if sb.killer is not None:
            return  # the kill that stopped the checkpoint removes the sandbox
        if sb.instance is not None:
            await self._set_state(sb, S.RUNNING, persist=False)
        else:
            await self._discard(sb)

    async def create(
        self,
        template: str = "base",
        spec: SandboxSpec = DEFAULT_SPEC,
    ) -> SandboxRecord:
        timeout = self._check_timeout(spec.timeout)
        grace = spec.grace
        if isinstance(grace, bool) or not isinstance(grace, int) or not 0 <= grace <= self.settings.max_grace:
            raise InvalidRequest(f"grace must be 0 to {self.settings.max_grace} seconds")
        _check_auto_pause(spec.auto_pause, spec.auto_resume, spec.auto_pause_memory)
        allow_internet_access = spec.allow_internet_access
        if allow_internet_access is None:
            allow_internet_access = self.settings.internet_by_default
        EgressPolicy.of(allow_internet_access, spec.network)  # bad rules are the caller's 400, before any work
        self._admit()
        self._check_room()
        source = self.catalogue.source(template)
        if source is None and await self.artifacts.refresh_catalogue(template):
            source = self.catalogue.source(template)  # committed to the repository by another node
        if source is None:
            raise TemplateNotFound(f"no template or snapshot named '{template}'")
        if isinstance(source, TemplateRecord):
            template_id, snapshot_id = source.name, ""
        else:
            template_id, snapshot_id = source.template_id, source.id
        layers, image, guest = list(source.layers), source.image, source.guest
        base_env, base_limits = dict(source.env_vars), dict(source.limits)
        user, workdir, start = source.user, source.workdir, dict(source.start)
        base_env.update(spec.env_vars)
        base_limits.update(spec.limits)
        now = time.time()
        rec = SandboxRecord(
            id=new_sandbox_id(),
            template_id=template_id,
            started_at=now,
            end_at=now + timeout,
            timeout=timeout,
            grace=grace,
            auto_pause=spec.auto_pause,
            auto_resume=spec.auto_resume,
            auto_pause_memory=spec.auto_pause_memory,
            metadata=dict(spec.metadata),
            env_vars=base_env,
            limits=base_limits,
            layers=layers,
            snapshot_id=snapshot_id,
            user=user,
            workdir=workdir,
            allow_internet_access=allow_internet_access,
            network=dict(spec.network),
            secure=spec.secure,
            public_traffic=spec.public_traffic,
            mask_request_host=spec.mask_request_host,
            guest=guest,
            start=start,
            team=team_of_new(),
        )
        # From the check to the sandbox's entry nothing awaits: a burst cannot overfill the node.
        self._check_room(rec)
        member = self.warm.take(source, self.limits_of(rec)) if isinstance(source, TemplateRecord) else None
        if member is not None:
            return await self._claim(member, rec, timeout)
        sb = LiveSandbox(rec)
        sb.events.note(f"restoring from {'snapshot' if snapshot_id else 'template'} {template[:100]}")
        self.sandboxes[rec.id] = sb
        if snapshot_id:
            self.rollouts.copy(rollout.snapshot_key(snapshot_id), rec.id)  # its commands are this one's past

        async def run() -> SandboxRecord:
            try:
                rec.upper = await self.files.new_upper(self.limits_of(rec).disk_mb)
                async with self.artifacts.using(source):  # fetched from the repository if not here
                    await self._restore_into(sb, image=image, layers=layers, upper=rec.upper, fresh=True)
            except BaseException as exc:
                await self._discard(sb)
                if isinstance(exc, ImageIncompatible):
                    raise _stale_source(source, exc) from exc
                raise
            rec.started_at = time.time()
            rec.end_at = rec.started_at + timeout
            await self._set_state(sb, S.RUNNING)
            return rec

        return await self._operate(sb, "create", run, join=False)

    async def _claim(self, member: Member, rec: SandboxRecord, timeout: int) -> SandboxRecord:
        """Make a warm pool member the sandbox ``rec``: it takes the member's instance and upper,
        and everything of the create is applied now (the agent's env, user, workdir and process
        limit; the record's id, tokens, metadata, timeout, lifecycle and network rules)."""
        link, egress = member.sb.link, member.sb.egress
        assert link is not None and egress is not None and member.sb.instance is not None
        rec.upper, rec.instance_id = member.sb.rec.upper, member.sb.rec.instance_id
        sb = LiveSandbox(rec, instance=member.sb.instance, link=link, egress=egress)
        sb.events.note(f"a warm pool member of template {rec.template_id[:100]}, restored in advance")
        link.sandbox_id = egress.sandbox_id = rec.id
        egress.policy_of = lambda: self.policy_of(sb.id)
        self.sandboxes[rec.id] = sb
        self.warm.release(member)

        async def run() -> SandboxRecord:
            try:
                await link.call("sys.configure", self._agent_config(rec))
            except BaseException:
                await self._discard(sb)
                raise
            link.watcher = asyncio.ensure_future(self._watch(sb, link))
            rec.started_at = time.time()
            rec.end_at = rec.started_at + timeout
            await self._set_state(sb, S.RUNNING)
            return rec

        return await self._operate(sb, "create", run, join=False)

    def _check_room(self, rec: SandboxRecord | None = None) -> None:
        """Room for one more running sandbox, and for ``rec`` in its team's quota (429 if not)."""
        room, limit = self._room()
        if room == 0:
            raise LimitExceeded(limit)
        if rec is not None and self._team_room(rec, 1)[0] < 1:
            raise QuotaExceeded(self._team_room(rec, 1)[1], retry_after=1)

    def _team_room(self, rec: SandboxRecord, wanted: int) -> tuple[int, str]:
        """How many sandboxes like ``rec`` its team's quotas let start now (aenv/teams/quotas.py)."""
        if self.team_room is None:
            return wanted, ""
        return self.team_room(rec, wanted)

    def _room(self) -> tuple[int, str]:
        """How many more sandboxes this node may run now, and the limit that stops the next one."""
        available = memory_available_mb()
        if available is not None and available < self.settings.min_free_memory_mb:
            return 0, (
                f"this node's host has {available} MiB of memory available, "
                f"less than the {self.settings.min_free_memory_mb} MiB it keeps free"
            )
        live = sum(1 for sb in self.sandboxes.values() if sb.state != S.PAUSED)
        most = self.settings.max_sandboxes
        return max(0, most - live), f"this node runs at most {most} sandboxes"

    def _admit(self) -> None:
        for check in self.admission_checks:
            check()

    def _check_timeout(self, timeout: int | None) -> int:
        if timeout is None:
            return self.settings.default_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout <= 0:
            raise InvalidRequest("timeout must be a positive number of seconds")
        if timeout > self.settings.max_timeout:
            raise InvalidRequest(f"timeout may be at most {self.settings.max_timeout} seconds")
        return timeout

    def _own_timeout(self, rec: SandboxRecord) -> int:
        """The lease a resume that names none gives: the one the sandbox was last given (a
        record from another node's repository entry is checked as a request's would be)."""
        own = rec.timeout
        return own if type(own) is int and 0 < own <= self.settings.max_timeout else self.settings.default_timeout

    async def pause(self, sandbox_id: str, *, keep_memory: bool = True, settle_streams: bool = False) -> SandboxRecord:
        """Pause a running sandbox. Without ``keep_memory`` only its file system is kept (E2B's
        filesystem-only pause): its processes end and the resume boots it fresh. With
        ``settle_streams`` (a drain's move) its commands' output streams may end first as well."""
        sb = self.get(sandbox_id)

        async def run() -> SandboxRecord:
            if sb.state == S.PAUSED:
                raise WrongState(f"sandbox {sb.id} is already paused", sandbox_id=sb.id)
            await self._set_state(sb, S.PAUSING, persist=False)
            await self._exchanges_finish(sb, streams=settle_streams)
            upper = sb.rec.upper
            try:
                image = await self._checkpoint_stopped(sb) if keep_memory else await self._halt(sb)
            except BaseException:
                await self._after_failed_checkpoint(sb)
                raise
            self._stop_instance(sb, f"sandbox {sb.id} was paused")
            sb.rec.image = image
            sb.rec.filesystem_only = not keep_memory
            sb.rec.paused_at = time.time()
            sb.rec.durable_at = 0.0
            await self._set_state(sb, S.PAUSED)
            self.artifacts.commit_pause_later(sb)  # not waited for: the pause is done locally
            if not keep_memory:
                # Not checkpointed, the instance runs (its agent idle) until torn down; answer once
                # it is gone. A resume waits for it too, should this wait be cut short.
                await self.settled([upper])
            return sb.rec

        # The two kinds do not join: a pause without memory asked during a full one finds it paused.
        return await self._operate(sb, "pause" if keep_memory else "pause_filesystem", run, join=True)

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
        if sandbox_id not in self.sandboxes and self.adopter is not None:
            # durably paused on a node that is gone, draining or full: taken over here
            await self.adopter(sandbox_id, owner_full)
        sb = self.get(sandbox_id)
        # Without a timeout it keeps its own (E2B restarts it at 300 s): a 600 s sandbox paused and
        # resumed runs 600 s again; one that names a timeout makes it the sandbox's own.
        timeout_s = self._check_timeout(timeout) if timeout is not None else self._own_timeout(sb.rec)

        async def run() -> tuple[SandboxRecord, bool]:
            if sb.state == S.RUNNING:
                sb.rec.end_at = max(sb.rec.end_at, time.time() + timeout_s)  # as E2B: only extended
                sb.rec.timeout = timeout_s
                await self.store.put_sandbox(sb.rec)
                return sb.rec, False
            # A resume takes a running sandbox's room, as a create does (429: a gateway takes a
            # durable pause elsewhere); checked before the guard, which makes it no longer movable.
            self._check_room(sb.rec)
            if sb.rec.durable_at and self.resume_guard is not None:
                await self.resume_guard(sb.id)  # raises if another node took it over: it stays paused here
                self._check_room(sb.rec)  # taken meanwhile: it stays paused (the agent marks it durable again)
            await self._set_state(sb, S.RESUMING, persist=False)
            try:
                await self.artifacts.release_pause(sb)
                await self.files.mount(sb.rec.upper, writable=True)
                await self.files.remount(sb.rec.upper, writable=True)  # read-only while it was committed
                if sb.rec.filesystem_only or not memory:
                    await self.settled([sb.rec.upper])  # the instance it paused
                    await self._boot_into(sb)
                else:
                    await self._restore_into(
                        sb, image=sb.rec.image, layers=sb.rec.layers, upper=sb.rec.upper, fresh=True
                    )
            except BaseException as exc:
                if sb.killer is None:
                    await self._set_state(sb, S.PAUSED, persist=False)
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
                self.spawn(self.artifacts.forget_pause(sb.id))  # it runs here now
            sb.rec.end_at = time.time() + timeout_s
            sb.rec.timeout = timeout_s
            await self._set_state(sb, S.RUNNING)
            return sb.rec, True

        return await self._operate(sb, "resume", run, join=True)

    async def adopt_paused(self, sandbox_id: str) -> None:
        """Hold a sandbox another node paused durably: its record and artifacts from the repository
        (its upper there is a layer here, under an empty upper of its own); paused, so the resume
        that asked for it restores it with its id, metadata, env, timeout and network rules."""
        if sandbox_id in self.sandboxes:
            return
        self._check_room()  # before any fetch: with no room here it goes to another node (429)
        rec = await self.artifacts.fetch_pause(sandbox_id)
        if sandbox_id in self.sandboxes:
            return  # another adoption here finished first
        if rec.state != S.PAUSED:  # a repository entry is committed only once its pause is done
            raise ArtifactDamaged(f"sandbox {sandbox_id}: its repository entry is not a paused sandbox")
        rec.upper = await self.files.new_upper(self.limits_of(rec).disk_mb)
        rec.instance_id = ""
        sb = LiveSandbox(rec)
        sb.events.note("taken over: another node's durable pause, fetched from the repository")
        self.sandboxes[rec.id] = sb
        await self.store.put_sandbox(rec)

    async def let_go(self, sandbox_id: str) -> None:
        sb = self.sandboxes.get(sandbox_id)
        if sb is not None:
            sb.rec.durable_at = 0.0  # its repository entry is the other node's now: kept
            await self.kill(sandbox_id)

    async def forget_durable_pause(self, sandbox_id: str) -> bool:
        repo = self.artifacts.repo
        if repo is None or sandbox_id in self.sandboxes or not await self.artifacts.holds_pause(sandbox_id):
            return False
        await asyncio.to_thread(repo.delete_entry, "sandbox", sandbox_id)  # raises: tried again later
        return True

    async def ensure_running(self, sandbox_id: str) -> LiveSandbox:
        """For data-plane traffic: a paused sandbox with auto-resume comes back on use. What this
        returns is running when the caller gets it (no await in between): a pause that starts
        later sees what the caller then registers (LiveSandbox.exchanges)."""
        for _ in range(WAKE_ROUNDS):
            sb = self.get(sandbox_id)
            if sb.state == S.RUNNING and sb.link is not None:
                return sb
            if _traffic_wakes(sb):
                refusal = self.wake_refusal(sb) if self.wake_refusal is not None else None
                if refusal is not None:  # a draining node's pause is moving, or etcd is silent
                    raise ClusterUnavailable(refusal)
                await self.resume(sandbox_id)
                continue  # paused again meanwhile? Looked at afresh.
            async with sb.lock:  # wait out a transition in progress (a pause: then woken, above)
                pass
            if sb.state != S.RUNNING and not _traffic_wakes(sb):
                break
        sb = self.get(sandbox_id)
        refusal = self.wake_refusal(sb) if self.wake_refusal is not None and sb.state != S.KILLED else None
        if refusal is not None:  # not running for now: a drain is moving it (its traffic is held back)
            raise ClusterUnavailable(refusal)
        if sb.state == S.PAUSED and sb.rec.filesystem_only:
            message = f"sandbox {sandbox_id} is paused without its memory; resume it explicitly (connect)"
            raise WrongState(message, sandbox_id=sandbox_id)
        raise WrongState(f"sandbox {sandbox_id} is {sb.state.value}", sandbox_id=sandbox_id)

    async def _branch(self, sb: LiveSandbox, during: SandboxState) -> tuple[str, list[str]]:
        """Checkpoint a running sandbox and seal its upper; returns (image, layers).

        The caller restores the source from that image onto a fresh upper. If the checkpoint
        fails the sandbox is left running."""
        await self._set_state(sb, during, persist=False)
        try:
            image = await self._checkpoint_stopped(sb)
        except BaseException:
            await self._after_failed_checkpoint(sb)
            raise
        sealed = sb.rec.upper
        empty = self.files.is_empty(sealed)

        async def settle() -> None:  # once the old instance is gone, nothing writes the old upper
            if empty:
                await self.files.remove(sealed)
            else:
                await self.files.make_read_only(sealed)

        self._stop_instance(sb, "", keep_streams=True, then=settle)
        layers = [*sb.rec.layers, *([] if empty else [sealed])]
        sb.rec.layers = layers
        sb.rec.upper = await self.files.new_upper(self.limits_of(sb.rec).disk_mb)
        return image, layers

    async def _branch_running(self, sb: LiveSandbox, during: SandboxState) -> tuple[str, list[str]]:
        """Checkpoint a running sandbox leaving it running, with a copy of its upper as a new layer;
        returns (image, layers) for the copies. The source keeps its instance, upper and streams.
        If the checkpoint fails the sandbox is left running."""
        await self._set_state(sb, during, persist=False)
        try:
            image, copy = await self._checkpoint_running(sb)
        except BaseException:
            await self._after_failed_checkpoint(sb)
            raise
        return image, [*sb.rec.layers, *([copy] if copy is not None else [])]

    async def _restart_source(self, sb: LiveSandbox, image: str) -> None:
        try:
            await self._restore_into(sb, image=image, layers=sb.rec.layers, upper=sb.rec.upper, fresh=False)
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
            await self._set_state(sb, S.PAUSED)
            raise

    async def snapshot(self, sandbox_id: str, *, name: str | None = None, durable: bool = False) -> SnapshotRecord:
        """Snapshot a running sandbox; it is committed to the repository in the background, or
        before this returns with ``durable``."""
        sb = self.get(sandbox_id)
        if name is not None and self.catalogue.snapshot_named(name):
            raise InvalidRequest(f"a snapshot named '{name}' already exists")

        async def run() -> SnapshotRecord:
            leaves_running = self.driver.leaves_running
            if leaves_running:
                image, layers = await self._branch_running(sb, S.SNAPSHOTTING)
                await self._set_state(sb, S.RUNNING)
            else:
                image, layers = await self._branch(sb, S.SNAPSHOTTING)
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
                    await self._restart_source(sb, image)
                    await self._set_state(sb, S.RUNNING)
                self.files.remove_image(image)
                for layer in [x for x in layers if x not in sb.rec.layers]:  # the upper's copy
                    await self.files.remove(layer)
                raise
            self.artifacts.commit_later(snap)
            sb.events.note(f"snapshot {snap.id}{f' ({snap.name[:100]})' if snap.name else ''}")
            if not leaves_running:
                await self._restart_source(sb, image)
                await self._set_state(sb, S.RUNNING)
            return snap

        snap = await self._operate(sb, "snapshot", run, join=False)
        if durable:
            await self.artifacts.wait_committed(snap)
        return snap

    async def delete_snapshot(self, ref: str) -> None:
        snap = self.find_snapshot(ref)
        await self.catalogue.remove_snapshot(snap)
        await self.artifacts.forget(snap)
        self.files.remove_image(snap.image)
        self.rollouts.remove(rollout.snapshot_key(snap.id))
        await housekeeping.gc_files(self, min_age=60)

    async def fork(
        self,
        sandbox_id: str,
        *,
        count: int = 1,
        timeout: int | None = None,
        metadata: list[dict[str, str]] | None = None,
    ) -> list[ForkResult]:
        """``count`` children of a running sandbox; ``metadata``, one map per child, is added to
        the source's metadata for that child."""
        sb = self.get(sandbox_id)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise InvalidRequest("count must be a positive integer")
        if count > self.settings.max_fork:
            raise InvalidRequest(f"count may be at most {self.settings.max_fork}")
        if metadata is not None and len(metadata) != count:
            raise InvalidRequest(f"metadata names {len(metadata)} children, the fork makes {count}")
        child_timeout = self._check_timeout(timeout) if timeout is not None else None
        self._admit()
        self._check_room(sb.rec)  # no room for any child: the whole fork is refused, nothing checkpointed

        async def run() -> list[ForkResult]:
            leaves_running = self.driver.leaves_running
            branch = self._branch_running if leaves_running else self._branch
            image, layers = await branch(sb, S.FORKING)
            now = time.time()
            ttl = child_timeout if child_timeout is not None else max(1, int(sb.rec.end_at - now))
            children: list[LiveSandbox] = []
            try:
                for i in range(min(count, self._room()[0])):
                    extra = metadata[i] if metadata is not None else {}
                    children.append(await self._child_of(sb, layers, now, ttl, child_timeout, extra))
                # From the count to the entries nothing awaits: concurrent creates and forks cannot
                # overfill the node. Children past its room are answered with the limit instead.
                room, limit = self._room()
                team_room, over_quota = self._team_room(sb.rec, len(children))
                over: type[LimitExceeded] = LimitExceeded  # the node's room, or the team's quota
                if team_room < min(room, len(children)):
                    room, limit, over = team_room, over_quota, QuotaExceeded
                for child in children[room:]:
                    self.rollouts.remove(child.id)
                    await self.files.remove(child.rec.upper)
                children = children[:room]
                for child in children:
                    self.sandboxes[child.id] = child
                # The source is restored from the image too unless the checkpoint left it running.
                restart = [] if leaves_running else [self._restart_source(sb, image)]
                outcomes = await asyncio.gather(
                    *restart, *(self._start_child(child, image) for child in children), return_exceptions=True
                )
            except BaseException:  # cancelled (killed, or past the deadline): no child is handed out
                for child in children:
                    await self._discard(child)
                raise
            finally:
                self.files.remove_image(image)  # a restored instance no longer needs its image
            if restart and isinstance(outcomes[0], BaseException):
                for child in children:
                    await self._discard(child)
                raise outcomes[0]
            await self._set_state(sb, S.RUNNING)
            if not children:
                raise over(limit)  # the room went to others while the source was checkpointed
            results = []
            for child, outcome in zip(children, outcomes[len(restart) :], strict=True):
                if isinstance(outcome, BaseException):
                    await self._discard(child)
                    err = outcome if isinstance(outcome, AenvError) else self._killed(child, "fork")
                    results.append(ForkResult(error=err))
                else:
                    results.append(ForkResult(sandbox=child.rec))
            refused = f"{limit}: no room for this child ({len(children)} of the fork's {count} fit)"
            results += [ForkResult(error=over(refused)) for _ in range(count - len(children))]
            made = [r.sandbox.id for r in results if r.sandbox is not None]
            sb.events.note(f"fork of {count}: {len(made)} children made ({', '.join(made[:8])})")
            return results

        return await self._operate(sb, "fork", run, join=False)

    async def _child_of(
        self,
        sb: LiveSandbox,
        layers: list[str],
        now: float,
        ttl: int,
        timeout: int | None,
        metadata: dict[str, str] | None = None,
    ) -> LiveSandbox:
        """A child runs for what its source has left (``ttl``) unless the fork names a ``timeout``;
        its own timeout, for its resumes, is the one named, else its source's."""
        src = sb.rec
        upper = await self.files.new_upper(self.limits_of(src).disk_mb)
        rec = SandboxRecord(
            id=new_sandbox_id(),
            template_id=src.template_id,
            started_at=now,
            end_at=now + ttl,
            timeout=timeout if timeout is not None else self._own_timeout(src),
            grace=src.grace,
            auto_pause=src.auto_pause,
            auto_resume=src.auto_resume,
            auto_pause_memory=src.auto_pause_memory,
            metadata={**src.metadata, **(metadata or {})},
            env_vars=dict(src.env_vars),
            limits=dict(src.limits),
            layers=list(layers),
            upper=upper,
            parent_id=src.id,
            allow_internet_access=src.allow_internet_access,
            network=dict(src.network),
            secure=src.secure,
            public_traffic=src.public_traffic,
            mask_request_host=src.mask_request_host,
            guest=src.guest,
            user=src.user,
            workdir=src.workdir,
            start=dict(src.start),
            team=src.team,
        )
        child = LiveSandbox(rec)
        child.events.note(f"forked from {src.id}")
        self.rollouts.copy(src.id, rec.id)  # its source's commands are its past too
        return child

    def _start_child(self, child: LiveSandbox, image: str) -> asyncio.Task[None]:
        """A fork child's restore, as an operation of the child: killing the child cancels it."""

        async def start() -> None:
            async with child.lock:
                await self._restore_into(child, image=image, layers=child.rec.layers, upper=child.rec.upper, fresh=True)
                await self._set_state(child, S.RUNNING)

        task = asyncio.ensure_future(start())
        child.tasks.add(task)
        task.add_done_callback(child.tasks.discard)
        return task

    async def set_network(self, sandbox_id: str, network: dict[str, Any], internet: bool | None = None) -> None:
        """Replace a sandbox's egress rules: connections made from now on follow them, and open
        connections they no longer allow are ended."""
        sb = self.get(sandbox_id)
        internet = sb.rec.allow_internet_access if internet is None else internet
        EgressPolicy.of(internet, network)
        sb.rec.network, sb.rec.allow_internet_access = dict(network), internet
        await self.store.put_sandbox(sb.rec)
        if sb.egress is not None:
            sb.egress.recheck()

    async def set_timeout(self, sandbox_id: str, timeout: int) -> SandboxRecord:
        """The sandbox expires ``timeout`` seconds from now; 0 expires it now (E2B's minimum), so
        the reaper pauses or kills it at its next round."""
        sb = self.get(sandbox_id)
        timeout = 0 if type(timeout) is int and timeout == 0 else self._check_timeout(timeout)
        sb.rec.end_at = time.time() + timeout
        if timeout:  # 0 ends this run; its resumes get the lease it had
            sb.rec.timeout = timeout
        await self.store.put_sandbox(sb.rec)
        return sb.rec

    async def kill(self, sandbox_id: str) -> None:
        """Stop and remove a sandbox within seconds, whatever it or its agent is doing: operations
        in flight on it are cancelled (their callers get 404) and concurrent kills join this one."""
        sb = self.get(sandbox_id)
        if sb.killer is None:
            sb.killer = asyncio.ensure_future(self._kill(sb))
            self._background.add(sb.killer)
            sb.killer.add_done_callback(log_failure(sb.id, self._background))
        await asyncio.shield(sb.killer)

    async def _kill(self, sb: LiveSandbox) -> None:
        started = time.monotonic()
        if sb.link is not None:
            sb.link.close(f"sandbox {sb.id} was killed")  # every wait on the agent ends now
        in_flight = [t for t in sb.tasks if not t.done()]
        for task in in_flight:
            task.cancel()
        if in_flight:
            _, stuck = await asyncio.wait(in_flight, timeout=KILL_GRACE)
            if stuck:
                log.error(
                    "sandbox %s: %d operations did not stop within %gs of its kill", sb.id, len(stuck), KILL_GRACE
                )
        if sb.state != S.KILLED:
            await self._set_state(sb, S.KILLING, persist=False)
            await self._forget(sb)
        metrics.OPERATIONS.labels(op="kill", outcome="ok").inc()
        metrics.OPERATION_SECONDS.labels(op="kill").observe(time.monotonic() - started)

    async def _discard(self, sb: LiveSandbox) -> None:
        """Remove a sandbox an operation cannot keep (it died, or is a failed fork's child)."""
        if sb.killer is None and sb.state != S.KILLED:
            await self._set_state(sb, S.KILLING, persist=False)
            await self._forget(sb)

    async def _forget(self, sb: LiveSandbox) -> None:
        upper, image = sb.rec.upper, sb.rec.image

        async def release() -> None:
            await self.files.remove(upper)
            self.files.remove_image(image)

        self._stop_instance(sb, f"sandbox {sb.id} was killed", then=release)
        self.rollouts.remove(sb.id)
        if sb.rec.durable_at:
            self.spawn(self.artifacts.forget_pause(sb.id))
        await self._set_state(sb, S.KILLED, persist=False)
        self.sandboxes.pop(sb.id, None)
        await self.store.delete_sandbox(sb.id)


def _stale_source(source: TemplateRecord | SnapshotRecord, exc: ImageIncompatible) -> ImageIncompatible:
    """What a create from an image another runsc wrote says: a template can be built again (its
    unchanged steps come from the build cache), a snapshot's memory is bound to that runsc."""
    if isinstance(source, TemplateRecord):
        what, remedy = f"template '{source.name}'", "build it again on this node"
    else:
        what, remedy = f"snapshot {source.id}", "create it on a node that runs that runsc"
    return ImageIncompatible(f"{what}: {exc.message}; {remedy}")


def _check_auto_pause(auto_pause: bool, auto_resume: bool, auto_pause_memory: bool) -> None:
    """E2B's rules for a timeout's pause without memory: it needs a pause, and traffic cannot wake
    it (resuming it reboots the sandbox, which only an explicit request may do)."""
    if auto_pause_memory:
        return
    if not auto_pause:
        raise InvalidRequest("autoPauseMemory=false only applies when autoPause is true")
    if auto_resume:
        raise InvalidRequest(
            "autoPauseMemory=false (filesystem-only auto-pause) cannot be combined with autoResume: "
            "such a sandbox must be resumed explicitly"
        )


def _traffic_wakes(sb: LiveSandbox) -> bool:
    """Whether data-plane traffic resumes ``sb``. Never one paused without memory: its resume is a
    reboot, which loses whatever ran, so only an explicit resume (connect) does that, as in E2B."""
    return sb.state in (S.PAUSED, S.RESUMING) and sb.rec.auto_resume and not sb.rec.filesystem_only
