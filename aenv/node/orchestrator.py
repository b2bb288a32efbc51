"""The node: one data dir's sandboxes, templates and snapshots, started and stopped as one.

``Node`` implements the node's service (aenv/node/service.py) by composing separate parts, each an
object made here and given, in its constructor, the other parts it uses (no part reaches the node
through ``self``; those that need a narrow view of it get a Protocol):
  - ``Records`` (aenv/node/records.py): the table of live sandboxes, lookups, the checked state
    change, limits, timeout, network rules, tokens, usage and capacity;
  - ``Instances`` (aenv/node/instances.py): a sandbox's instance: restore, boot, checkpoint,
    teardown, its agent link and watcher;
  - ``Runner`` (aenv/node/runner.py): the runner every operation goes through, and the kill;
  - ``Admission`` (aenv/node/admission.py): room, quotas and timeouts, reading the cluster agent's
    hooks through ``Hooks`` (the node itself, narrowed);
  - ``Checkpoints`` (aenv/node/checkpoints.py): pause, resume, snapshot, takeovers, wakes;
  - ``Creation`` (aenv/node/creation.py): create and fork;
  - ``Catalogue`` (aenv/node/catalogue.py): templates and snapshots; ``ArtifactCache``
    (aenv/node/artifacts.py): their files and the repository, seeing the node as an
    ``ArtifactHost``; aenv/node/housekeeping.py: recovery, garbage collection and the reaper.
This module builds them, starts and stops the node, answers for the catalogue, and delegates the
rest of the service to the part that owns it (thin methods at the end of ``Node``).
"""

from __future__ import annotations

import asyncio
import builtins
import fcntl
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aenv.channel import StreamError
from aenv.config import Settings
from aenv.errors import AenvError, Conflict, InvalidRequest
from aenv.node import housekeeping, imagecache, metrics, rollout
from aenv.node.admission import Admission
from aenv.node.artifacts import ArtifactCache
from aenv.node.catalogue import Catalogue
from aenv.node.checkpoints import Checkpoints
from aenv.node.create_ids import CreateIds
from aenv.node.creation import Creation
from aenv.node.doze import Dozer
from aenv.node.instances import Instances
from aenv.node.records import Records
from aenv.node.rollout import RolloutLogs
from aenv.node.runner import Runner
from aenv.node.sandbox import ForkResult, LiveSandbox
from aenv.node.service import CachedArtifacts, Capacity
from aenv.node.spec import DEFAULT_SPEC, SandboxSpec, VolumeClones
from aenv.node.state import SandboxState
from aenv.node.store import SandboxRecord, SnapshotRecord, Store, TemplateRecord
from aenv.node.transforms import SecretLookup
from aenv.node.usage import History, UsageHistory
from aenv.node.warmpool import WarmPools
from aenv.repo.backends import open_backend
from aenv.repo.repository import Repository
from aenv.runtime.base import Driver, Instance, Limits, RootfsSpec
from aenv.storage import datadir
from aenv.storage.layers import LayerStore
from aenv.templates.uploads import UploadCache

log = logging.getLogger("aenv.node")

S = SandboxState
STOP_OPS_GRACE = 30.0  # how long a stopping node lets operations in flight finish
STOP_PAUSE_TIMEOUT = 60.0  # per sandbox, a stopping node's pause; past it the sandbox is killed


def make_driver(settings: Settings) -> Driver:
    """Drivers are imported only when chosen."""
    if settings.driver == "gvisor":
        from aenv.runtime.gvisor import GVisorDriver

        return GVisorDriver(
            state_dir=settings.data_dir / "runtime",
            runsc=settings.runsc,
            platform=settings.runsc_platform,
            debug=settings.runsc_debug,
            max_sandboxes=settings.max_sandboxes,
            flags=settings.runsc_flags.split(),
            calibration=settings.runsc_calibration,
            cpu_limit=settings.cpu_limit,
        )
    if settings.driver == "fake":  # no isolation: for tests only, chosen explicitly (aenv/runtime/fake.py)
        from aenv.runtime.fake import FakeDriver

        return FakeDriver(state_dir=settings.data_dir / "runtime")
    if settings.driver == "qemu":  # each sandbox a microVM (aenv/runtime/qemu.py)
        from aenv.runtime.qemu import QemuDriver

        return QemuDriver(
            state_dir=settings.data_dir / "runtime",
            qemu=settings.qemu,
            kernel=settings.qemu_kernel,
            accel=settings.qemu_accel,
        )
    raise InvalidRequest(f"unknown driver {settings.driver!r}")


def make_repository(settings: Settings) -> Repository | None:
    if settings.repo.strip().lower() == "none":
        return None
    url = settings.repo or str(settings.data_dir / "repo")
    backend = open_backend(
        url,
        endpoint=settings.repo_s3_endpoint,
        region=settings.repo_s3_region,
        access_key_id=settings.repo_s3_access_key_id,
        secret_access_key=settings.repo_s3_secret_access_key,
    )
    return Repository(backend)


class Node:
    def __init__(self, settings: Settings, driver: Driver | None = None) -> None:
        self.settings = settings
        datadir.secure(settings.data_dir)
        self.store = Store(settings.data_dir / "aenv.db")
        self.files = LayerStore(settings.data_dir / "fs")
        self.driver = driver or make_driver(settings)
        self.files.plain_uppers = getattr(self.driver, "plain_uppers", False)
        self.artifacts = ArtifactCache(self, make_repository(settings))
        self.uploads = UploadCache(self.files.root / "build-files", settings)
        self.catalogue = Catalogue(self.store)
        self._housekeepers: list[asyncio.Task[None]] = []  # the reaper, expiry and usage sampling
        self.background: set[asyncio.Task[Any]] = set()  # a stopping node cancels and awaits them
        self._stopped = False
        self._lock_fd: int | None = None
        self.contained: dict[str, int] = {}  # instance id -> its host tasks when last contained
        self.usage_history = UsageHistory(settings.metrics_interval, settings.metrics_history)
        self.rollouts = RolloutLogs(
            settings.data_dir / "rollout",
            log_bytes=settings.rollout_log_kb * 1024,
            output_bytes=settings.rollout_output_kb * 1024,
        )
        self.started_at = time.time()
        self.records = Records(settings, self.store, self.usage_history)
        self.sandboxes = self.records.sandboxes
        self.state_listeners = self.records.state_listeners  # see Records
        self.transition_listeners = self.records.transition_listeners
        self.update_listeners = self.records.update_listeners
        # Called before a create or a fork starts (new sandboxes): each may refuse by raising
        # (the cluster agent refuses while the node cannot write the directory).
        self.admission_checks: list[Callable[[], None]] = []
        self.create_ids = CreateIds(kill=self.kill)
        # Called when a resume names a sandbox this node does not hold: the cluster agent takes
        # over one durably paused on a node that is gone (adopt_paused), or does nothing.
        self.adopter: Callable[[str, bool], Awaitable[None]] | None = None
        # In a cluster: whether the directory says a sandbox is durably paused (its entry is
        # written a moment after the commit; another node may take it over only from then on).
        self.durable_in_directory: Callable[[str], bool] | None = None
        # In a cluster: called before a durably paused sandbox resumes here (the directory must stop
        # offering it for takeover first); raises if another node took it over meanwhile.
        self.resume_guard: Callable[[str], Awaitable[None]] | None = None
        # In a cluster: why traffic may not wake a paused sandbox here now (a draining node moves
        # its pauses; a node out of touch with etcd resumes nothing), or None. Answered 503.
        self.wake_refusal: Callable[[LiveSandbox], str | None] | None = None
        # In a cluster: waits, a moment at most, until the directory lists new sandboxes (a
        # create's or a fork's answer then names only sandboxes every gateway can find).
        self.announce: Callable[[list[str]], Awaitable[None]] | None = None
        # Teams' quotas (aenv/teams/quotas.py): how many sandboxes like a record its team may start
        # now, of those wanted, and why not more. Called with nothing awaited before the entry.
        self.team_room: Callable[[SandboxRecord, int], tuple[int, str]] | None = None
        self.warm = WarmPools(self)  # idle sandboxes restored ahead of creates
        members = lambda: [m.sb for pool in self.warm.pools.values() for m in pool]  # noqa: E731
        self.dozer = Dozer(self.settings, self.driver, self.sandboxes.values, members)  # freezes idle sandboxes
        # The operations' parts, each given what it uses; the hooks above are read at each call.
        self.instances = Instances(
            settings=settings,
            driver=self.driver,
            files=self.files,
            artifacts=self.artifacts,
            records=self.records,
            background=self.background,
            died=self.kill,
        )
        self.runner = Runner(
            settings=settings,
            records=self.records,
            instances=self.instances,
            files=self.files,
            artifacts=self.artifacts,
            rollouts=self.rollouts,
            background=self.background,
        )
        self.admission = Admission(settings, self.sandboxes, hooks=self)
        self.checkpoints = Checkpoints(
            records=self.records,
            instances=self.instances,
            runner=self.runner,
            admission=self.admission,
            hooks=self,
            driver=self.driver,
            files=self.files,
            artifacts=self.artifacts,
            catalogue=self.catalogue,
            rollouts=self.rollouts,
        )
        self.creation = Creation(
            settings=settings,
            records=self.records,
            instances=self.instances,
            runner=self.runner,
            admission=self.admission,
            checkpoints=self.checkpoints,
            driver=self.driver,
            files=self.files,
            artifacts=self.artifacts,
            catalogue=self.catalogue,
            rollouts=self.rollouts,
            warm=self.warm,
        )

    # -- start and stop ---------------------------------------------------------------------------
    async def start(self) -> None:
        self._lock_data_dir()
        await self.driver.prepare(self.records.limits_from({}))
        await self.store.open()
        await self.records.load_token_secret()
        await self.catalogue.load()
        self.artifacts.sweep_partial_fetches()
        await self.artifacts.sync_catalogue()
        await housekeeping.recover(self)
        spares = self.settings.spare_uppers
        self.files.keep_spares(
            self.settings.max_fork + 1 if spares is None else spares,
            self.settings.disk_mb,
            idle=lambda: not any(sb.lock.locked() for sb in self.sandboxes.values()),
        )
        self._housekeepers = [
            asyncio.create_task(housekeeping.reap_forever(self)),
            asyncio.create_task(housekeeping.expire_forever(self)),
            asyncio.create_task(self.usage_history.sample_forever(self)),
            asyncio.create_task(self.dozer.forever()),
        ]
        await self.warm.load()
        self.warm.start()

    async def stop(self, *, pause_running: bool = True) -> None:
        """Stop the node. Running sandboxes are paused so a restart loses nothing; one that cannot
        be paused in time (its agent is wedged) is killed. Nothing of this node outlives it: no
        runsc process, mount or cgroup."""
        if self._stopped:
            return
        self._stopped = True
        for task in self._housekeepers:
            task.cancel()
        self._housekeepers = []
        await self.warm.stop()
        in_flight = [t for sb in self.sandboxes.values() for t in sb.tasks]
        if in_flight:
            await asyncio.wait(in_flight, timeout=STOP_OPS_GRACE)
        running = [sb for sb in self.sandboxes.values() if sb.state == S.RUNNING]
        sem = asyncio.Semaphore(4)

        async def settle(sb: LiveSandbox) -> None:
            async with sem:
                if not pause_running:
                    await self.kill(sb.id)
                    return
                try:
                    async with asyncio.timeout(STOP_PAUSE_TIMEOUT):
                        await self.pause(sb.id)
                except (AenvError, TimeoutError) as exc:
                    log.warning("could not pause %s at shutdown (%r); killing it", sb.id, exc)
                    await self.kill(sb.id)

        if running:
            log.info("stopping: pausing %d running sandboxes", len(running))
        await asyncio.gather(*(settle(sb) for sb in running), return_exceptions=True)
        # Whatever is not paused by now is in an operation that did not finish in time.
        stuck = [sb.id for sb in self.sandboxes.values() if sb.state != S.PAUSED]
        await asyncio.gather(*(self.kill(x) for x in stuck), return_exceptions=True)
        await self.settle()
        background = list(self.background)
        for task in background:
            task.cancel()
        if background:  # builds among them kill their instances on the way out
            await asyncio.wait(background, timeout=STOP_OPS_GRACE)
        await self.files.drop_spares()
        await self.files.unmount_all()
        await self.artifacts.close()
        await self.store.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _lock_data_dir(self) -> None:
        """One node per data dir: a second one would reconcile away the first one's sandboxes."""
        path = self.settings.data_dir / "node.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise Conflict(f"another aenv node is using {self.settings.data_dir}") from None
        self._lock_fd = fd

    # -- lookups ------------------------------------------------------------------------------------

    @property
    def templates(self) -> Mapping[str, TemplateRecord]:
        return self.catalogue.templates_view

    @property
    def snapshots(self) -> Mapping[str, SnapshotRecord]:
        return self.catalogue.snapshots_view

    def find_template(self, ref: str) -> TemplateRecord:
        return self.catalogue.find_template(ref)

    def find_snapshot(self, ref: str) -> SnapshotRecord:
        return self.catalogue.find_snapshot(ref)

    def observe_metrics(self) -> None:
        metrics.observe_node(self)

    def runtime_info(self) -> dict[str, str]:
        return self.driver.info()

    def runtime_calibration(self) -> dict[str, Any] | None:
        return self.driver.calibration()

    # -- the catalogue: templates, and what the repository holds -----------------------------------------
    async def add_template(self, rec: TemplateRecord) -> None:
        """A template just built: recorded, and committed to the repository in the background."""
        await self.catalogue.put_template(rec)
        self.artifacts.commit_later(rec)
        self.warm.wake()  # a rebuild: the pool of its name holds the old build

    async def save_template(self, rec: TemplateRecord) -> None:
        """A template's record changed (its name or aliases)."""
        await self.catalogue.put_template(rec)
        await self.artifacts.record_changed(rec)
        self.warm.wake()  # a name moved to another build: its pool holds the old one

    async def drop_template(self, rec: TemplateRecord) -> None:
        """Forget a template; its layers go with the next collection no record names them in."""
        await self.catalogue.remove_template(rec)
        self.warm.forget(rec)
        await self.artifacts.forget(rec)

    async def delete_snapshot(self, ref: str) -> None:
        snap = self.find_snapshot(ref)
        await self.catalogue.remove_snapshot(snap)
        await self.artifacts.forget(snap)
        self.files.remove_image(snap.image)
        self.rollouts.remove(rollout.snapshot_key(snap.id))
        await housekeeping.gc_files(self, min_age=60)

    async def collect_garbage(self, *, min_age: float = 0.0) -> None:
        await housekeeping.gc_files(self, min_age=min_age)

    async def images(self) -> list[dict[str, Any]]:
        return await imagecache.report(self, housekeeping.busy_now(self))

    def cached_artifacts(self) -> CachedArtifacts:
        return CachedArtifacts(
            templates=frozenset(t.id for t in self.templates.values() if self.artifacts.is_cached(t)),
            snapshots=frozenset(s.id for s in self.snapshots.values() if self.artifacts.is_cached(s)),
        )

    async def repository_status(self) -> dict[str, Any]:
        """The snapshot repository, and what of this node's is not committed to it yet."""
        records = metrics.committable(self)
        pending = metrics.pending_records(self)
        repo = self.artifacts.repo
        return {
            "url": repo.url if repo is not None else None,
            "templates": len(self.templates),
            "snapshots": len(records) - len(self.templates),
            "committed": len(records) - len(pending),
            "pending": pending,
            "pendingPauses": metrics.pending_pauses(self),  # paused sandboxes not durable yet
            "cacheBytes": await housekeeping.cache_bytes(self),
            "cacheBudgetBytes": self.settings.layer_cache_mb * 2**20,
        }

    def warm_pool(self, ref: str) -> dict[str, Any]:
        return self.warm.status(ref)

    async def set_warm_pool(self, ref: str, size: int | None) -> dict[str, Any]:
        return await self.warm.set_size(ref, size)

    @property
    def has_repository(self) -> bool:
        return self.artifacts.repo is not None

    def durable_reason(self, rec: SandboxRecord) -> str:
        return self.artifacts.durable_reason(rec)

    def is_dozing(self, sb: LiveSandbox) -> bool:
        return sb.instance is not None and self.driver.dozing(sb.instance)

    def is_durable(self, rec: SandboxRecord) -> bool:
        confirmed = self.durable_in_directory
        return bool(rec.durable_at) and (confirmed is None or confirmed(rec.id))

    async def wait_durable(self, sandbox_id: str) -> bool:
        sb = self.get(sandbox_id)
        for _ in range(2):  # a failed commit is tried once more at once (else every minute)
            await self.artifacts.wait_pause_committed(sb.id)
            if sb.rec.durable_at or self.durable_reason(sb.rec) or sb.state != S.PAUSED:
                break
            self.artifacts.commit_pause_later(sb)
        return bool(sb.rec.durable_at) and sb.state == S.PAUSED

    async def gc_repository(self) -> dict[str, Any]:
        if self.artifacts.repo is None:
            raise InvalidRequest("this node has no snapshot repository (AENV_REPO=none)")
        return await self.artifacts.gc_repository()

    # -- the rest of the service, answered by the part that owns it ---------------------------------
    async def create(self, template: str = "base", spec: SandboxSpec = DEFAULT_SPEC) -> SandboxRecord:
        return await self.creation.create(template, spec)

    async def fork(
        self,
        sandbox_id: str,
        *,
        count: int = 1,
        timeout: int | None = None,
        metadata: builtins.list[dict[str, str]] | None = None,
        volume_clones: VolumeClones | None = None,
    ) -> builtins.list[ForkResult]:
        return await self.creation.fork(
            sandbox_id, count=count, timeout=timeout, metadata=metadata, volume_clones=volume_clones
        )

    async def pause(self, sandbox_id: str, *, keep_memory: bool = True, settle_streams: bool = False) -> SandboxRecord:
        return await self.checkpoints.pause(sandbox_id, keep_memory=keep_memory, settle_streams=settle_streams)

    async def resume(
        self, sandbox_id: str, *, timeout: int | None = None, memory: bool = True, owner_full: bool = False
    ) -> tuple[SandboxRecord, bool]:
        return await self.checkpoints.resume(sandbox_id, timeout=timeout, memory=memory, owner_full=owner_full)

    async def ensure_running(self, sandbox_id: str) -> LiveSandbox:
        return await self.checkpoints.ensure_running(sandbox_id)

    async def snapshot(self, sandbox_id: str, *, name: str | None = None, durable: bool = False) -> SnapshotRecord:
        return await self.checkpoints.snapshot(sandbox_id, name=name, durable=durable)

    async def adopt_paused(self, sandbox_id: str) -> None:
        await self.checkpoints.adopt_paused(sandbox_id)

    async def let_go(self, sandbox_id: str) -> None:
        await self.checkpoints.let_go(sandbox_id)

    async def forget_durable_pause(self, sandbox_id: str) -> bool:
        return await self.checkpoints.forget_durable_pause(sandbox_id)

    async def kill(self, sandbox_id: str) -> None:
        await self.runner.kill(sandbox_id)

    async def set_timeout(self, sandbox_id: str, timeout: int) -> SandboxRecord:
        return await self.records.set_timeout(sandbox_id, timeout)

    def use_secrets(self, lookup: SecretLookup) -> None:
        self.instances.secret_lookup = lookup

    async def set_network(self, sandbox_id: str, network: dict[str, Any], internet: bool | None = None) -> None:
        had_rules = bool(self.records.get(sandbox_id).rec.network.get("rules"))
        await self.records.set_network(sandbox_id, network, internet)
        sb = self.records.get(sandbox_id)
        # rules added to (or taken from) a running sandbox: its commands trust the egress CA from now
        # on (a paused one gets it with its configuration when it resumes)
        if bool(network.get("rules")) != had_rules and sb.state is SandboxState.RUNNING and sb.link is not None:
            try:
                await sb.link.call("sys.configure", self.instances.agent_config(sb.rec))
            except (AenvError, StreamError, OSError) as exc:
                log.warning("sandbox %s: its new egress trust was not configured: %s", sandbox_id, exc)

    def get(self, sandbox_id: str) -> LiveSandbox:
        return self.records.get(sandbox_id)

    def limits_of(self, rec: SandboxRecord) -> Limits:
        return self.records.limits_of(rec)

    def usage_of(self, sandbox_id: str) -> History | None:
        return self.records.usage_of(sandbox_id)

    def capacity(self) -> Capacity:
        return self.records.capacity()

    def access_token(self, sandbox_id: str) -> str:
        return self.records.access_token(sandbox_id)

    def traffic_token(self, sandbox_id: str) -> str:
        return self.records.traffic_token(sandbox_id)

    @property
    def token_secret(self) -> str:
        return self.records.token_secret

    async def use_token_secret(self, secret: str) -> None:
        await self.records.use_token_secret(secret)

    async def settle(self, timeout: float = 60) -> None:
        await self.instances.settle(timeout)

    async def settled(self, layers: builtins.list[str]) -> None:
        await self.instances.settled(layers)

    def rootfs(self, layers: builtins.list[str], upper: str, guest: str = "") -> RootfsSpec:
        return self.instances.rootfs(layers, upper, guest)

    @property
    def first_sandboxes(self) -> WarmPools | None:
        if not self.driver.leaves_running or self.settings.first_sandbox_seconds <= 0:
            return None
        return self.warm

    def spawn(self, coro: Awaitable[Any]) -> None:
        self.instances.spawn(coro)

    def kill_later(self, instance: Instance) -> None:
        self.instances.kill_later(instance)

    def list(
        self, *, states: set[str] | None = None, metadata: dict[str, str] | None = None
    ) -> builtins.list[LiveSandbox]:
        return self.records.list(states=states, metadata=metadata)
