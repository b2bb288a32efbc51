"""The node: sandbox records, their state machine, and every lifecycle operation.

Each operation on a sandbox runs as its own task under the sandbox's lock, so it completes even
if the client that asked for it goes away, and concurrent requests for the same idempotent
transition (pause, resume) join the task already running instead of starting a second one. Every
operation has a deadline. A kill does not queue behind them: it cancels whatever is in flight on
the sandbox (those callers get 404, the sandbox was killed) and removes it within seconds.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aenv.channel import PROTOCOL_VIOLATION, StreamError, Unsendable
from aenv.config import Settings
from aenv.errors import (
    CHECKPOINT_REFUSAL,
    AenvError,
    CheckpointRefused,
    Conflict,
    InvalidRequest,
    LimitExceeded,
    OperationTimeout,
    SandboxNotFound,
    SnapshotNotFound,
    TemplateNotFound,
    WrongState,
)
from aenv.node import egress, housekeeping, metrics, tokens
from aenv.node.agentlink import AgentLink
from aenv.node.artifacts import ArtifactCache
from aenv.node.create_ids import CreateIds
from aenv.node.egress import EgressPolicy
from aenv.node.sandbox import ForkResult, LiveSandbox, log_failure, new_sandbox_id
from aenv.node.state import PUBLIC_STATE, SETTLED, SandboxState, check_transition
from aenv.node.store import SandboxRecord, SnapshotRecord, Store, TemplateRecord
from aenv.node.usage import UsageHistory
from aenv.repo.backends import open_backend
from aenv.repo.repository import Repository
from aenv.runtime.base import Driver, Instance, Limits, RootfsSpec
from aenv.storage import datadir
from aenv.storage.layers import LayerStore, new_id
from aenv.templates.uploads import UploadCache

log = logging.getLogger("aenv.node")

T = TypeVar("T")
S = SandboxState
DEFAULT_USER = "user"
KILL_GRACE = 10.0  # how long a kill waits for the operations it cancelled to unwind
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


def _blocker(entry: Any) -> str:
    """One process the agent says blocks a checkpoint, as the agent described it (bounded)."""
    if isinstance(entry, dict):
        return f"pid {str(entry.get('pid'))[:20]} ({str(entry.get('cmd'))[:200]})"
    return str(entry)[:200]


class Node:
    def __init__(self, settings: Settings, driver: Driver | None = None) -> None:
        self.settings = settings
        datadir.secure(settings.data_dir)
        self.store = Store(settings.data_dir / "aenv.db")
        self.files = LayerStore(settings.data_dir / "fs")
        self.driver = driver or make_driver(settings)
        self.artifacts = ArtifactCache(self, make_repository(settings))
        self.uploads = UploadCache(self.files.root / "build-files", settings)
        self.sandboxes: dict[str, LiveSandbox] = {}
        self.templates: dict[str, TemplateRecord] = {}
        self.snapshots: dict[str, SnapshotRecord] = {}
        self._housekeepers: list[asyncio.Task[None]] = []  # the reaper, expiry and usage sampling
        self._background: set[asyncio.Task[Any]] = set()
        self._secret = b""
        self._stopped = False
        self._lock_fd: int | None = None
        self._teardowns: set[asyncio.Task[None]] = set()
        self._pending_layers: set[str] = set()  # uppers of instances still being torn down
        self._teardown_of: dict[str, asyncio.Task[None]] = {}  # upper id -> its instance's teardown
        self.contained: dict[str, int] = {}  # instance id -> its host tasks when last contained
        self.usage_history = UsageHistory(settings.metrics_interval, settings.metrics_history)
        self.started_at = time.time()
        # Called (synchronously; they must not block or raise) after every state change of a
        # sandbox, KILLED included: the cluster agent keeps the directory from them.
        self.state_listeners: list[Callable[[LiveSandbox], None]] = []
        # Called before a create or a fork starts (new sandboxes): each may refuse by raising
        # (the cluster agent refuses while the node cannot write the directory).
        self.admission_checks: list[Callable[[], None]] = []
        self.create_ids = CreateIds(kill=self.kill)

    # -- start and stop ---------------------------------------------------------------------------
    async def start(self) -> None:
        self._lock_data_dir()
        await self.store.open()
        secret = await self.store.get_meta("token_secret")
        if secret is None:
            secret = secrets.token_hex(32)
            await self.store.set_meta("token_secret", secret)
        self._secret = secret.encode()
        self.templates = {t.id: t for t in await self.store.templates()}
        self.snapshots = {s.id: s for s in await self.store.snapshots()}
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
        ]

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
        background = list(self._background)
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

    async def settle(self, timeout: float = 60) -> None:
        """Wait for background teardowns of old instances to finish."""
        if self._teardowns:
            await asyncio.wait(list(self._teardowns), timeout=timeout)

    async def settled(self, layers: list[str]) -> None:
        """Wait until no instance being torn down still writes one of ``layers`` (a snapshot's
        newest layer is its source's old upper, sealed read-only once that instance is gone)."""
        tasks = [t for x in layers if (t := self._teardown_of.get(x)) is not None]
        if tasks:
            await asyncio.wait(tasks)

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
    def get(self, sandbox_id: str) -> LiveSandbox:
        sb = self.sandboxes.get(sandbox_id)
        if sb is None or sb.state == S.KILLED:
            raise SandboxNotFound(f"sandbox {sandbox_id} not found", sandbox_id=sandbox_id)
        return sb

    def find_template(self, ref: str) -> TemplateRecord:
        for t in self.templates.values():
            if ref in (t.id, t.name) or ref in t.aliases:
                return t
        raise TemplateNotFound(f"template '{ref}' not found")

    def find_snapshot(self, ref: str) -> SnapshotRecord:
        for s in self.snapshots.values():
            if ref in (s.id, s.name) and not s.ephemeral:
                return s
        raise SnapshotNotFound(f"snapshot '{ref}' not found")

    def _source(self, ref: str) -> TemplateRecord | SnapshotRecord | None:
        """The template, else the snapshot, that ``ref`` names."""
        try:
            return self.find_template(ref)
        except TemplateNotFound:
            try:
                return self.find_snapshot(ref)
            except SnapshotNotFound:
                return None

    def list(self, *, states: set[str] | None = None, metadata: dict[str, str] | None = None) -> list[LiveSandbox]:
        out = []
        for sb in self.sandboxes.values():
            if sb.state == S.KILLED:
                continue
            if states and sb.state.value not in states and _public(sb.state) not in states:
                continue
            if metadata and any(sb.rec.metadata.get(k) != v for k, v in metadata.items()):
                continue
            out.append(sb)
        return sorted(out, key=lambda s: s.rec.started_at, reverse=True)

    def access_token(self, sandbox_id: str) -> str:
        return tokens.access_token(self._secret, sandbox_id)

    def traffic_token(self, sandbox_id: str) -> str:
        return tokens.traffic_token(self._secret, sandbox_id)

    @property
    def token_secret(self) -> str:
        """The secret every sandbox's tokens derive from (64 hex digits)."""
        return self._secret.decode()

    async def use_token_secret(self, secret: str) -> None:
        """Derive tokens from ``secret`` from now on (the cluster's), kept for later starts too."""
        await self.store.set_meta("token_secret", secret)
        self._secret = secret.encode()

    # -- the operation runner -------------------------------------------------------------------------
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
            self._spawn(self.kill(sb.id))

    async def _set_state(self, sb: LiveSandbox, target: SandboxState, *, persist: bool = True) -> None:
        check_transition(sb.id, sb.state, target)
        sb.rec.state = target
        if persist:
            await self.store.put_sandbox(sb.rec)
        for listener in self.state_listeners:
            listener(sb)

    def _limits(self, rec: SandboxRecord) -> Limits:
        return self._limits_of(rec.limits)

    def _limits_of(self, overrides: dict[str, Any]) -> Limits:
        s = self.settings
        base = {"cpu_count": s.cpu_count, "memory_mb": s.memory_mb, "nproc": s.nproc, "disk_mb": s.disk_mb}
        base.update({k: v for k, v in overrides.items() if k in base and v is not None})
        return Limits(**base)

    def _agent_config(self, rec: SandboxRecord) -> dict[str, Any]:
        env = dict(rec.env_vars)
        env.update({"E2B_SANDBOX": "true", "E2B_SANDBOX_ID": rec.id, "E2B_TEMPLATE_ID": rec.template_id})
        env.update({"AENV_SANDBOX_ID": rec.id})
        return {
            "env": env,
            "user": rec.user or DEFAULT_USER,
            "workdir": rec.workdir or None,
            "nproc": self._limits(rec).nproc,
        }

    def _rootfs(self, layers: list[str], upper: str, guest: str = "") -> RootfsSpec:
        return RootfsSpec(tuple(self.files.layer(x) for x in layers), self.files.upper(upper), guest)

    async def _restore_into(self, sb: LiveSandbox, *, image: str, layers: list[str], upper: str, fresh: bool) -> None:
        """Start an instance of ``sb`` from a checkpoint image and wire up its agent."""
        instance_id = new_id()
        instance = await self.driver.restore(
            instance_id=instance_id,
            rootfs=self._rootfs(layers, upper, sb.rec.guest),
            limits=self._limits(sb.rec),
            image_dir=self.files.image(image),
        )
        link = sb.link if (sb.link is not None and not fresh) else self._new_link(sb)
        try:
            await link.restored(instance, fresh=fresh, config=self._agent_config(sb.rec))
        except BaseException:
            await self.driver.kill(instance)
            raise
        sb.instance, sb.link = instance, link
        sb.rec.instance_id = instance_id
        if link.watcher is None:
            link.watcher = asyncio.ensure_future(self._watch(sb, link))

    async def _boot_into(self, sb: LiveSandbox) -> None:
        """Boot a fresh instance of ``sb`` on its layers and upper (a resume after a pause that kept
        no memory): a new agent from the current bundle, the sandbox's settings, and the template's
        start command started again, as in every sandbox made from the template."""
        instance_id, guest = new_id(), self.driver.guest_key()
        instance = await self.driver.boot(
            instance_id=instance_id,
            rootfs=self._rootfs(sb.rec.layers, sb.rec.upper, guest),
            limits=self._limits(sb.rec),
        )
        link = self._new_link(sb)
        try:
            await link.booted(instance)
            await link.call("sys.configure", self._agent_config(sb.rec))
            await self._start_again(sb, link)
        except BaseException:
            link.close("the sandbox could not boot")
            await self.driver.kill(instance)
            raise
        sb.instance, sb.link = instance, link
        sb.rec.instance_id, sb.rec.guest = instance_id, guest
        link.watcher = asyncio.ensure_future(self._watch(sb, link))

    async def _start_again(self, sb: LiveSandbox, link: AgentLink) -> None:
        """The template's start command, in a sandbox that booted fresh. Its record may come from a
        repository others write: one that is not a command is skipped, as is a command that fails
        to start (the template's own failure; the sandbox runs anyway)."""
        start = start_command(sb.rec.start)
        if start is None:
            if sb.rec.start:
                log.warning("sandbox %s: its template's start command is malformed; not started", sb.id)
            return
        try:
            failure = await link.start_detached(*start)
        except Unsendable as exc:  # larger than the channel carries: as malformed
            failure = exc.message
        if failure:
            log.warning("sandbox %s: the start command did not start again: %s", sb.id, failure[:200])

    def _new_link(self, sb: LiveSandbox) -> AgentLink:
        sb.egress = egress.Guest(sb.id, lambda: self.policy_of(sb.id))
        return AgentLink(sb.id, serve=sb.egress, call_timeout=self.settings.agent_timeout)

    async def _watch(self, sb: LiveSandbox, link: AgentLink) -> None:
        """Notice a sandbox that died on its own (e.g. its memory limit was hit) or broke the channel
        protocol (root in it can write to the agent's pipe) and remove it."""
        while True:
            await link.channel.closed.wait()
            if sb.link is not link:
                return  # closed on purpose: paused or killed
            await asyncio.sleep(0.05)
            if sb.lock.locked():
                # an operation is swapping the pipe (snapshot, fork); look again when it is done
                async with sb.lock:
                    pass
                if sb.link is not link or not link.channel.closed.is_set():
                    continue
            if link.channel.close_reason.startswith(PROTOCOL_VIOLATION):
                reason = link.channel.close_reason
            elif sb.instance and (await self.driver.usage(sb.instance)).oom:
                reason = "out of memory"
            else:
                reason = "exited"
            log.warning("sandbox %s stopped on its own (%s); removing it", sb.id, reason)
            try:
                await self.kill(sb.id)
            except AenvError:
                pass
            return

    def _stop_instance(
        self,
        sb: LiveSandbox,
        reason: str,
        *,
        keep_streams: bool = False,
        then: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Detach from the instance now; tear it down in the background.

        `runsc delete` of a stopped sandbox takes over a second (it polls for the gofer to exit),
        and nothing a client waits for depends on it: after a checkpoint the instance is inert."""
        if sb.instance is not None:
            self._teardown_later(sb.instance, then, lowers=list(sb.rec.layers))
            sb.instance = None
        elif then is not None:
            self._spawn(then())
        if sb.link is not None:
            if keep_streams:
                sb.link.channel.detach()
            else:
                sb.link.close(reason)
                sb.link = None
        sb.rec.instance_id = ""

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(log_failure("background", self._background))

    def _teardown_later(
        self, instance: Instance, then: Callable[[], Awaitable[None]] | None, *, lowers: list[str]
    ) -> None:
        layer = instance.rootfs.upper.name
        self._pending_layers.add(layer)
        self.artifacts.pin(lowers)  # its overlay is mounted until the teardown: not evictable

        async def teardown() -> None:
            try:
                await self.driver.kill(instance)
                if then is not None:
                    await then()
            finally:
                self.artifacts.unpin(lowers)
                self._pending_layers.discard(layer)
                self._teardowns.discard(task)
                if self._teardown_of.get(layer) is task:
                    del self._teardown_of[layer]

        task = asyncio.ensure_future(teardown())
        self._teardowns.add(task)
        self._teardown_of[layer] = task
        self._background.add(task)
        task.add_done_callback(log_failure(instance.id, self._background))

    async def _checkpoint_stopped(self, sb: LiveSandbox) -> str:
        """Freeze the agent, checkpoint and stop the instance; return the image id.

        On failure the sandbox is left running and answering, never frozen."""
        assert sb.instance is not None and sb.link is not None
        if not self.driver.saves_epoll_tcp:
            await self._refuse_unsaveable(sb)
        await sb.link.freeze()
        image = new_id()
        try:
            await self.driver.checkpoint(sb.instance, image_dir=self.files.image(image), leave_running=False)
        except BaseException:
            self.files.remove_image(image)
            try:
                await sb.link.unfreeze()
            except AenvError:
                log.error("sandbox %s died in a failed checkpoint", sb.id)
                self._stop_instance(sb, "the sandbox died during a failed checkpoint")
            raise  # the checkpoint's own error: it says what went wrong
        return image

    async def _refuse_unsaveable(self, sb: LiveSandbox) -> None:
        """Refuse up front what the runtime could not save: a failed save would kill the instance."""
        assert sb.link is not None
        try:
            answer = await sb.link.call("sys.checkpointable")
        except StreamError:
            return  # an agent from before this check (images pin theirs): nothing to ask
        blockers = answer.get("blockers") if isinstance(answer, dict) else None
        if blockers:
            shown = blockers[:3] if isinstance(blockers, list) else [blockers]
            who = ", ".join(_blocker(b) for b in shown)
            message = f"{CHECKPOINT_REFUSAL}: {who}; the sandbox keeps running"
            raise CheckpointRefused(message, sandbox_id=sb.id)

    async def _after_failed_checkpoint(self, sb: LiveSandbox) -> None:
        """Back to running if the instance survived (the usual case); otherwise it is gone."""
        if sb.killer is not None:
            return  # the kill that stopped the checkpoint removes the sandbox
        if sb.instance is not None:
            await self._set_state(sb, S.RUNNING, persist=False)
        else:
            await self._discard(sb)

    # -- create -----------------------------------------------------------------------------------------
    async def create(
        self,
        template: str = "base",
        *,
        timeout: int | None = None,
        metadata: dict[str, str] | None = None,
        env_vars: dict[str, str] | None = None,
        auto_pause: bool = False,
        auto_resume: bool = False,
        auto_pause_memory: bool = True,
        limits: dict[str, Any] | None = None,
        allow_internet_access: bool | None = None,
        network: dict[str, Any] | None = None,
        secure: bool = True,
        public_traffic: bool = True,
        mask_request_host: str = "",
    ) -> SandboxRecord:
        timeout = self._check_timeout(timeout)
        _check_auto_pause(auto_pause, auto_resume, auto_pause_memory)
        if allow_internet_access is None:
            allow_internet_access = self.settings.internet_by_default
        EgressPolicy.of(allow_internet_access, network)  # bad rules are the caller's 400, before any work
        self._admit()
        live = sum(1 for sb in self.sandboxes.values() if sb.state != S.PAUSED)
        if live >= self.settings.max_sandboxes:
            raise LimitExceeded(f"this node runs at most {self.settings.max_sandboxes} sandboxes")
        source = self._source(template)
        if source is None and await self.artifacts.refresh_catalogue():
            source = self._source(template)  # committed to the repository by another node
        if source is None:
            raise TemplateNotFound(f"no template or snapshot named '{template}'")
        if isinstance(source, TemplateRecord):
            template_id, snapshot_id = source.name, ""
        else:
            template_id, snapshot_id = source.template_id, source.id
        layers, image, guest = list(source.layers), source.image, source.guest
        base_env, base_limits = dict(source.env_vars), dict(source.limits)
        user, workdir, start = source.user, source.workdir, dict(source.start)
        base_env.update(env_vars or {})
        base_limits.update(limits or {})
        now = time.time()
        upper = await self.files.new_upper(self._limits_of(base_limits).disk_mb)
        rec = SandboxRecord(
            id=new_sandbox_id(),
            template_id=template_id,
            started_at=now,
            end_at=now + timeout,
            auto_pause=auto_pause,
            auto_resume=auto_resume,
            auto_pause_memory=auto_pause_memory,
            metadata=dict(metadata or {}),
            env_vars=base_env,
            limits=base_limits,
            layers=layers,
            upper=upper,
            snapshot_id=snapshot_id,
            user=user,
            workdir=workdir,
            allow_internet_access=allow_internet_access,
            network=dict(network or {}),
            secure=secure,
            public_traffic=public_traffic,
            mask_request_host=mask_request_host,
            guest=guest,
            start=start,
        )
        sb = LiveSandbox(rec)
        self.sandboxes[rec.id] = sb

        async def run() -> SandboxRecord:
            try:
                async with self.artifacts.using(source):  # fetched from the repository if not here
                    await self._restore_into(sb, image=image, layers=layers, upper=rec.upper, fresh=True)
            except BaseException:
                await self._discard(sb)
                raise
            rec.started_at = time.time()
            rec.end_at = rec.started_at + timeout
            await self._set_state(sb, S.RUNNING)
            return rec

        return await self._operate(sb, "create", run, join=False)

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

    # -- pause and resume --------------------------------------------------------------------------------
    async def pause(self, sandbox_id: str, *, keep_memory: bool = True) -> SandboxRecord:
        """Pause a running sandbox. Without ``keep_memory`` only its file system is kept (E2B's
        filesystem-only pause): its processes end and the resume boots it fresh."""
        sb = self.get(sandbox_id)

        async def run() -> SandboxRecord:
            if sb.state == S.PAUSED:
                raise WrongState(f"sandbox {sb.id} is already paused", sandbox_id=sb.id)
            await self._set_state(sb, S.PAUSING, persist=False)
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
            await self._set_state(sb, S.PAUSED)
            if not keep_memory:
                # Not checkpointed, the instance runs (its agent idle) until torn down; answer once
                # it is gone. A resume waits for it too, should this wait be cut short.
                await self.settled([upper])
            return sb.rec

        # The two kinds do not join: a pause without memory asked during a full one finds it paused.
        return await self._operate(sb, "pause" if keep_memory else "pause_filesystem", run, join=True)

    async def _halt(self, sb: LiveSandbox) -> str:
        """Ready the instance to be stopped keeping only its file system: the agent ends every other
        process, saves what it keeps on disk and syncs, then writes nothing. If the agent does not
        answer, the sandbox keeps running. Returns "" (no checkpoint image)."""
        assert sb.instance is not None and sb.link is not None
        await sb.link.freeze(halt=True)
        return ""

    async def resume(
        self, sandbox_id: str, *, timeout: int | None = None, memory: bool = True
    ) -> tuple[SandboxRecord, bool]:
        """Resume a paused sandbox; returns (record, True if it was resumed, False if it ran).
        Without ``memory`` (E2B's connect ``memory: false``, the SDKs' ``on_resume="reboot"``)
        one paused with its memory boots fresh on its files instead, as one paused without."""
        sb = self.get(sandbox_id)
        timeout_s = self._check_timeout(timeout)

        async def run() -> tuple[SandboxRecord, bool]:
            if sb.state == S.RUNNING:
                sb.rec.end_at = max(sb.rec.end_at, time.time() + timeout_s)
                await self.store.put_sandbox(sb.rec)
                return sb.rec, False
            await self._set_state(sb, S.RESUMING, persist=False)
            try:
                await self.files.mount(sb.rec.upper, writable=True)
                if sb.rec.filesystem_only or not memory:
                    await self.settled([sb.rec.upper])  # the instance it paused
                    await self._boot_into(sb)
                else:
                    await self._restore_into(
                        sb, image=sb.rec.image, layers=sb.rec.layers, upper=sb.rec.upper, fresh=True
                    )
            except BaseException:
                if sb.killer is None:
                    await self._set_state(sb, S.PAUSED, persist=False)
                raise
            self.files.remove_image(sb.rec.image)
            sb.rec.image = ""
            sb.rec.filesystem_only = False
            sb.rec.end_at = time.time() + timeout_s
            await self._set_state(sb, S.RUNNING)
            return sb.rec, True

        return await self._operate(sb, "resume", run, join=True)

    async def ensure_running(self, sandbox_id: str) -> LiveSandbox:
        """For data-plane traffic: a paused sandbox with auto-resume comes back on use."""
        sb = self.get(sandbox_id)
        if sb.state == S.RUNNING and sb.link is not None:
            return sb
        # Traffic never brings back a sandbox paused without memory: its resume is a reboot, which
        # loses whatever ran, so only an explicit resume (connect) does that, as in E2B.
        if sb.state in (S.PAUSED, S.RESUMING) and sb.rec.auto_resume and not sb.rec.filesystem_only:
            await self.resume(sandbox_id)
            return self.get(sandbox_id)
        async with sb.lock:  # wait out a transition in progress
            pass
        if sb.state == S.RUNNING and sb.link is not None:
            return sb
        if sb.state == S.PAUSED and sb.rec.filesystem_only:
            message = f"sandbox {sandbox_id} is paused without its memory; resume it explicitly (connect)"
            raise WrongState(message, sandbox_id=sandbox_id)
        raise WrongState(f"sandbox {sandbox_id} is {sb.state.value}", sandbox_id=sandbox_id)

    # -- snapshot and fork -------------------------------------------------------------------------------
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
        sb.rec.upper = await self.files.new_upper(self._limits(sb.rec).disk_mb)
        return image, layers

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
        if name is not None and any(s.name == name for s in self.snapshots.values()):
            raise InvalidRequest(f"a snapshot named '{name}' already exists")

        async def run() -> SnapshotRecord:
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
            )
            self.snapshots[snap.id] = snap
            await self.store.put_snapshot(snap)
            self.artifacts.commit_later(snap)
            await self._restart_source(sb, image)
            await self._set_state(sb, S.RUNNING)
            return snap

        snap = await self._operate(sb, "snapshot", run, join=False)
        if durable:
            await self.artifacts.wait_committed(snap)
        return snap

    async def delete_snapshot(self, ref: str) -> None:
        snap = self.find_snapshot(ref)
        self.snapshots.pop(snap.id, None)
        await self.store.delete_snapshot(snap.id)
        await self.artifacts.forget(snap)
        self.files.remove_image(snap.image)
        await housekeeping.gc_files(self, min_age=60)

    async def fork(self, sandbox_id: str, *, count: int = 1, timeout: int | None = None) -> list[ForkResult]:
        sb = self.get(sandbox_id)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise InvalidRequest("count must be a positive integer")
        if count > self.settings.max_fork:
            raise InvalidRequest(f"count may be at most {self.settings.max_fork}")
        child_timeout = self._check_timeout(timeout) if timeout is not None else None
        self._admit()

        async def run() -> list[ForkResult]:
            image, layers = await self._branch(sb, S.FORKING)
            now = time.time()
            ttl = child_timeout if child_timeout is not None else max(1, int(sb.rec.end_at - now))
            children: list[LiveSandbox] = []
            try:
                for _ in range(count):
                    children.append(await self._child_of(sb, layers, now, ttl))
                for child in children:
                    self.sandboxes[child.id] = child
                outcomes = await asyncio.gather(
                    self._restart_source(sb, image),
                    *(self._start_child(child, image) for child in children),
                    return_exceptions=True,
                )
            except BaseException:  # cancelled (killed, or past the deadline): no child is handed out
                for child in children:
                    await self._discard(child)
                raise
            finally:
                self.files.remove_image(image)  # a restored instance no longer needs its image
            if isinstance(outcomes[0], BaseException):
                for child in children:
                    await self._discard(child)
                raise outcomes[0]
            await self._set_state(sb, S.RUNNING)
            results = []
            for child, outcome in zip(children, outcomes[1:], strict=True):
                if isinstance(outcome, BaseException):
                    await self._discard(child)
                    err = outcome if isinstance(outcome, AenvError) else self._killed(child, "fork")
                    results.append(ForkResult(error=err))
                else:
                    results.append(ForkResult(sandbox=child.rec))
            return results

        return await self._operate(sb, "fork", run, join=False)

    async def _child_of(self, sb: LiveSandbox, layers: list[str], now: float, ttl: int) -> LiveSandbox:
        src = sb.rec
        upper = await self.files.new_upper(self._limits(src).disk_mb)
        rec = SandboxRecord(
            id=new_sandbox_id(),
            template_id=src.template_id,
            started_at=now,
            end_at=now + ttl,
            auto_pause=src.auto_pause,
            auto_resume=src.auto_resume,
            auto_pause_memory=src.auto_pause_memory,
            metadata=dict(src.metadata),
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
        )
        return LiveSandbox(rec)

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

    # -- network policy --------------------------------------------------------------------------------
    def policy_of(self, sandbox_id: str) -> EgressPolicy:
        rec = self.get(sandbox_id).rec
        return EgressPolicy.of(rec.allow_internet_access, rec.network)

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

    # -- timeouts and kill -------------------------------------------------------------------------------
    async def set_timeout(self, sandbox_id: str, timeout: int) -> SandboxRecord:
        """The sandbox expires ``timeout`` seconds from now; 0 expires it now (E2B's minimum), so
        the reaper pauses or kills it at its next round."""
        sb = self.get(sandbox_id)
        timeout = 0 if type(timeout) is int and timeout == 0 else self._check_timeout(timeout)
        sb.rec.end_at = time.time() + timeout
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
        await self._set_state(sb, S.KILLED, persist=False)
        self.sandboxes.pop(sb.id, None)
        await self.store.delete_sandbox(sb.id)


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


def start_command(record: dict[str, Any]) -> tuple[list[str], dict[str, str], str, str] | None:
    """(argv, env, cwd, user) of a recorded start command (StartCommand.record), if it is one."""
    argv, env, cwd, user = (record.get(k) for k in ("argv", "env", "cwd", "user"))
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        return None
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        return None
    if not (isinstance(cwd, str) and isinstance(user, str)):
        return None
    return argv, env, cwd, user


def _public(state: SandboxState) -> str:
    return PUBLIC_STATE[state]
