"""Create and fork: the operations that make new sandboxes, from a template or snapshot (or a warm
pool member restored ahead), and as children of a running sandbox.

``Node`` (aenv/node/orchestrator.py) makes one ``Creation`` from the parts it uses: the records,
the instances, the runner every operation goes through, the admission checks, the branches of
``Checkpoints`` a fork takes of its source, the catalogue and the warm pools.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

from aenv.config import Settings
from aenv.errors import AenvError, ImageIncompatible, InvalidRequest, LimitExceeded, QuotaExceeded, TemplateNotFound
from aenv.node import rollout
from aenv.node.admission import Admission
from aenv.node.artifacts import ArtifactCache
from aenv.node.catalogue import Catalogue
from aenv.node.checkpoints import Checkpoints
from aenv.node.egress import EgressPolicy
from aenv.node.instances import Instances
from aenv.node.records import Records
from aenv.node.rollout import RolloutLogs
from aenv.node.runner import Runner
from aenv.node.sandbox import ForkResult, LiveSandbox, new_sandbox_id
from aenv.node.spec import DEFAULT_SPEC, SandboxSpec, VolumeClones
from aenv.node.state import SandboxState
from aenv.node.store import SandboxRecord, SnapshotRecord, TemplateRecord
from aenv.node.warmpool import Member, WarmPools
from aenv.runtime.base import Driver
from aenv.storage.layers import LayerStore
from aenv.teams.model import team_of_new

S = SandboxState
log = logging.getLogger("aenv.node")


class Creation:
    def __init__(
        self,
        *,
        settings: Settings,
        records: Records,
        instances: Instances,
        runner: Runner,
        admission: Admission,
        checkpoints: Checkpoints,
        driver: Driver,
        files: LayerStore,
        artifacts: ArtifactCache,
        catalogue: Catalogue,
        rollouts: RolloutLogs,
        warm: WarmPools,
    ) -> None:
        self.settings = settings
        self.records = records
        self.instances = instances
        self.runner = runner
        self.admission = admission
        self.checkpoints = checkpoints
        self.driver = driver
        self.files = files
        self.artifacts = artifacts
        self.catalogue = catalogue
        self.rollouts = rollouts
        self.warm = warm

    async def create(
        self,
        template: str = "base",
        spec: SandboxSpec = DEFAULT_SPEC,
    ) -> SandboxRecord:
        timeout = self.admission.check_timeout(spec.timeout)
        grace = spec.grace
        if isinstance(grace, bool) or not isinstance(grace, int) or not 0 <= grace <= self.settings.max_grace:
            raise InvalidRequest(f"grace must be 0 to {self.settings.max_grace} seconds")
        _check_auto_pause(spec.auto_pause, spec.auto_resume, spec.auto_pause_memory)
        allow_internet_access = spec.allow_internet_access
        if allow_internet_access is None:
            allow_internet_access = self.settings.internet_by_default
        EgressPolicy.of(allow_internet_access, spec.network)  # bad rules are the caller's 400, before any work
        self.admission.admit()
        self.admission.check_room()
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
            volume_mounts=[dict(m) for m in spec.volume_mounts],
        )
        # From the check to the sandbox's entry nothing awaits: a burst cannot overfill the node.
        self.admission.check_room(rec)
        # A pool member was restored without volumes: a create that mounts some restores its own.
        member = None
        if isinstance(source, TemplateRecord) and not rec.volume_mounts:
            member = self.warm.take(source, self.records.limits_of(rec))
        if member is not None:
            return await self._claim(member, rec, timeout)
        sb = LiveSandbox(rec)
        sb.events.note(f"restoring from {'snapshot' if snapshot_id else 'template'} {template[:100]}")
        self.records.sandboxes[rec.id] = sb
        if snapshot_id:
            self.rollouts.copy(rollout.snapshot_key(snapshot_id), rec.id)  # its commands are this one's past

        async def run() -> SandboxRecord:
            try:
                rec.upper = await self.files.new_upper(self.records.limits_of(rec).disk_mb)
                async with self.artifacts.using(source):  # fetched from the repository if not here
                    await self.instances.restore_into(sb, image=image, layers=layers, upper=rec.upper, fresh=True)
            except BaseException as exc:
                await self.runner.discard(sb)
                if isinstance(exc, ImageIncompatible):
                    raise _stale_source(source, exc) from exc
                raise
            rec.started_at = time.time()
            rec.end_at = rec.started_at + timeout
            await self.records.set_state(sb, S.RUNNING)
            return rec

        return await self.runner.operate(sb, "create", run, join=False)

    async def _claim(self, member: Member, rec: SandboxRecord, timeout: int) -> SandboxRecord:
        """Make a warm pool member the sandbox ``rec``: it takes the member's instance and upper,
        and everything of the create is applied now (the agent's env, user, workdir and process
        limit; the record's id, tokens, metadata, timeout, lifecycle and network rules)."""
        link, egress = member.sb.link, member.sb.egress
        assert link is not None and egress is not None and member.sb.instance is not None
        rec.upper, rec.instance_id = member.sb.rec.upper, member.sb.rec.instance_id
        rec.layers = list(member.sb.rec.layers)  # a first sandbox runs without its upper's copy
        sb = LiveSandbox(rec, instance=member.sb.instance, link=link, egress=egress)
        if member.first:
            sb.events.note(f"the sandbox image template {rec.template_id[:100]} was snapshotted from")
        else:
            sb.events.note(f"a warm pool member of template {rec.template_id[:100]}, restored in advance")
        link.sandbox_id = egress.sandbox_id = rec.id
        egress.policy_of = lambda: self.records.policy_of(sb.id)
        self.records.sandboxes[rec.id] = sb
        self.warm.release(member)

        async def run() -> SandboxRecord:
            try:
                await link.call("sys.configure", self.instances.agent_config(rec))
            except BaseException:
                await self.runner.discard(sb)
                raise
            link.watcher = asyncio.ensure_future(self.instances.watch(sb, link))
            rec.started_at = time.time()
            rec.end_at = rec.started_at + timeout
            await self.records.set_state(sb, S.RUNNING)
            return rec

        return await self.runner.operate(sb, "create", run, join=False)

    async def fork(
        self,
        sandbox_id: str,
        *,
        count: int = 1,
        timeout: int | None = None,
        metadata: list[dict[str, str]] | None = None,
        volume_clones: VolumeClones | None = None,
    ) -> list[ForkResult]:
        """``count`` children of a running sandbox; ``metadata``, one map per child, is added to
        the source's metadata for that child. With ``volume_clones`` each child mounts its own copy
        of each of the source's volumes, as they were at the fork, in place of the shared volume."""
        sb = self.records.get(sandbox_id)
        self._check_fork(count, metadata)
        child_timeout = self.admission.check_timeout(timeout) if timeout is not None else None
        self.admission.admit()
        self.admission.check_room(sb.rec)  # no room for any child: the whole fork is refused, nothing checkpointed

        async def run() -> list[ForkResult]:
            ids = [new_sandbox_id() for _ in range(count)]
            clones = volume_clones if sb.rec.volume_mounts else None
            capture = None if clones is None else functools.partial(clones.capture, ids[0])
            leaves_running = self.driver.leaves_running
            if leaves_running:
                image, layers = await self.checkpoints.branch_running(sb, S.FORKING, also=capture)
            else:
                image, layers = await self.checkpoints.branch(sb, S.FORKING)
            now = time.time()
            ttl = child_timeout if child_timeout is not None else max(1, int(sb.rec.end_at - now))
            children: list[LiveSandbox] = []
            try:
                if capture is not None and not leaves_running:
                    await capture()  # the source stays stopped until its restart below
                for i in range(min(count, self.admission.room()[0])):
                    extra = metadata[i] if metadata is not None else {}
                    children.append(await self._child_of(sb, layers, now, ttl, child_timeout, extra, ids[i]))
                # From the count to the entries nothing awaits: concurrent creates and forks cannot
                # overfill the node. Children past its room are answered with the limit instead.
                room, limit = self.admission.room()
                team_room, over_quota = self.admission.team_room(sb.rec, len(children))
                over: type[LimitExceeded] = LimitExceeded  # the node's room, or the team's quota
                if team_room < min(room, len(children)):
                    room, limit, over = team_room, over_quota, QuotaExceeded
                for child in children[room:]:
                    self.rollouts.remove(child.id)
                    await self.files.remove(child.rec.upper)
                children = children[:room]
                for child in children:
                    self.records.sandboxes[child.id] = child
                if clones is not None:  # the first child has the copies captured, the others copies of those
                    await clones.spread([child.id for child in children[1:]])
                    for child in children:
                        child.rec.volume_mounts = clones.mounts_of(child.id)
                # The source is restored from the image too unless the checkpoint left it running.
                restart = [] if leaves_running else [self.checkpoints.restart_source(sb, image)]
                outcomes = await asyncio.gather(
                    *restart, *(self._start_child(child, image) for child in children), return_exceptions=True
                )
            except BaseException:  # cancelled (killed, or past the deadline): no child is handed out
                for child in children:
                    await self.runner.discard(child)
                if clones is not None:
                    await asyncio.shield(self._drop_clones(clones, ids))
                raise
            finally:
                self.files.remove_image(image)  # a restored instance no longer needs its image
            if restart and isinstance(outcomes[0], BaseException):
                for child in children:
                    await self.runner.discard(child)
                if clones is not None:
                    await self._drop_clones(clones, ids)
                raise outcomes[0]
            await self.records.set_state(sb, S.RUNNING)
            if not children:
                raise over(limit)  # the room went to others while the source was checkpointed
            results = []
            for child, outcome in zip(children, outcomes[len(restart) :], strict=True):
                if isinstance(outcome, BaseException):
                    await self.runner.discard(child)
                    err = outcome if isinstance(outcome, AenvError) else self.runner.killed(child, "fork")
                    results.append(ForkResult(error=err))
                else:
                    results.append(ForkResult(sandbox=child.rec))
            refused = f"{limit}: no room for this child ({len(children)} of the fork's {count} fit)"
            results += [ForkResult(error=over(refused)) for _ in range(count - len(children))]
            made = [r.sandbox.id for r in results if r.sandbox is not None]
            if clones is not None:  # the copies of children not made (no room, a failed restore) go
                await self._drop_clones(clones, [i for i in ids if i not in made])
            sb.events.note(f"fork of {count}: {len(made)} children made ({', '.join(made[:8])})")
            return results

        return await self.runner.operate(sb, "fork", run, join=False)

    async def _child_of(
        self,
        sb: LiveSandbox,
        layers: list[str],
        now: float,
        ttl: int,
        timeout: int | None,
        metadata: dict[str, str] | None = None,
        child_id: str | None = None,
    ) -> LiveSandbox:
        """A child runs for what its source has left (``ttl``) unless the fork names a ``timeout``;
        its own timeout, for its resumes, is the one named, else its source's."""
        src = sb.rec
        upper = await self.files.new_upper(self.records.limits_of(src).disk_mb)
        rec = SandboxRecord(
            id=child_id or new_sandbox_id(),
            template_id=src.template_id,
            started_at=now,
            end_at=now + ttl,
            timeout=timeout if timeout is not None else self.admission.own_timeout(src),
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
            volume_mounts=[dict(m) for m in src.volume_mounts],
        )
        child = LiveSandbox(rec)
        child.events.note(f"forked from {src.id}")
        self.rollouts.copy(src.id, rec.id)  # its source's commands are its past too
        return child

    def _check_fork(self, count: int, metadata: list[dict[str, str]] | None) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise InvalidRequest("count must be a positive integer")
        if count > self.settings.max_fork:
            raise InvalidRequest(f"count may be at most {self.settings.max_fork}")
        if metadata is not None and len(metadata) != count:
            raise InvalidRequest(f"metadata names {len(metadata)} children, the fork makes {count}")

    @staticmethod
    async def _drop_clones(clones: VolumeClones, child_ids: list[str]) -> None:
        for child_id in child_ids:
            try:
                await clones.drop(child_id)
            except Exception as exc:  # noqa: BLE001 - the fork's own outcome matters more than a leftover copy
                log.warning("a fork's copy of a volume for %s was not removed: %s", child_id, exc)

    def _start_child(self, child: LiveSandbox, image: str) -> asyncio.Task[None]:
        """A fork child's restore, as an operation of the child: killing the child cancels it."""

        async def start() -> None:
            async with child.lock:
                await self.instances.restore_into(
                    child, image=image, layers=child.rec.layers, upper=child.rec.upper, fresh=True
                )
                await self.records.set_state(child, S.RUNNING)

        task = asyncio.ensure_future(start())
        child.tasks.add(task)
        task.add_done_callback(child.tasks.discard)
        return task


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
