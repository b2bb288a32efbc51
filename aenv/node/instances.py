"""A sandbox's instance: starting it (restore from a checkpoint image, or a fresh boot), wiring its
agent, noticing when it dies on its own, checkpointing it, and tearing it down in the background.

``Node`` (aenv/node/orchestrator.py) makes one ``Instances`` and hands it to the operations that
use it (aenv/node/creation.py, aenv/node/checkpoints.py, aenv/node/runner.py) and to the warm pools.
It is given the node's runtime, layer store, artifact cache (to pin the layers an instance mounts),
records (limits and egress rules) and background tasks, and ``died``: what to do with a sandbox
whose instance stopped on its own (the node kills it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aenv.channel import PROTOCOL_VIOLATION, StreamError, Unsendable
from aenv.config import Settings
from aenv.errors import CHECKPOINT_REFUSAL, AenvError, CheckpointRefused, Conflict
from aenv.node import egress
from aenv.node.agentlink import AgentLink
from aenv.node.artifacts import ArtifactCache
from aenv.node.intercept import EgressCA, Interceptor
from aenv.node.records import Records
from aenv.node.sandbox import LiveSandbox, log_failure
from aenv.node.store import SandboxRecord
from aenv.node.transforms import SecretLookup
from aenv.runtime.base import Driver, Instance, Limits, RootfsSpec
from aenv.storage.layers import LayerStore, new_id
from aenv.storage.space import ensure_space, headroom
from aenv.teams.model import DEFAULT_TEAM

log = logging.getLogger("aenv.node")
DEFAULT_USER = "user"


class Instances:
    def __init__(
        self,
        *,
        settings: Settings,
        driver: Driver,
        files: LayerStore,
        artifacts: ArtifactCache,
        records: Records,
        background: set[asyncio.Task[Any]],
        died: Callable[[str], Awaitable[None]],
    ) -> None:
        self.settings = settings
        self.driver = driver
        self.files = files
        self.artifacts = artifacts
        self.records = records
        self.background = background  # the node's: a stopping node cancels and awaits them
        self.died = died
        self.pending_layers: set[str] = set()  # uppers of instances still being torn down
        # network.rules' secrets: the app's secrets (aenv/secrets) hand their lookup over at start;
        # until then a sandbox's connection to a host with a rule is refused, never made bare
        self.secret_lookup: SecretLookup | None = None
        self.egress_ca = EgressCA(settings.data_dir / "egress-ca", settings.node_id or "")
        egress.static_hosts()  # a bad AENV_EGRESS_HOSTS stops the node at its start, not a sandbox later
        self._teardowns: set[asyncio.Task[None]] = set()
        self._teardown_of: dict[str, asyncio.Task[None]] = {}  # upper id -> its instance's teardown

    async def settle(self, timeout: float = 60) -> None:
        """Wait for background teardowns of old instances to finish."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self._teardowns and (left := deadline - asyncio.get_running_loop().time()) > 0:
            await asyncio.wait(list(self._teardowns), timeout=left)  # a halt's task leaves a kill's

    async def settled(self, layers: list[str]) -> None:
        """Wait until no instance being torn down still writes one of ``layers`` (a snapshot's
        newest layer is its source's old upper, sealed read-only once that instance is gone)."""
        tasks = [t for x in layers if (t := self._teardown_of.get(x)) is not None]
        if tasks:
            await asyncio.wait(tasks)

    def agent_config(self, rec: SandboxRecord) -> dict[str, Any]:
        env = dict(rec.env_vars)
        env.update({"E2B_SANDBOX": "true", "E2B_SANDBOX_ID": rec.id, "E2B_TEMPLATE_ID": rec.template_id})
        env.update({"AENV_SANDBOX_ID": rec.id})
        config: dict[str, Any] = {
            "env": env,
            "user": rec.user or DEFAULT_USER,
            "workdir": rec.workdir or None,
            "nproc": self.records.limits_of(rec).nproc,
        }
        if rec.network.get("rules") and self.secret_lookup is not None:
            try:
                config["egress_ca"] = self.egress_ca.pem()  # a rule's HTTPS host is answered with its certificates
            except (OSError, ValueError) as exc:
                log.warning("sandbox %s: no egress CA for its network.rules: %s", rec.id, exc)
        if not self.driver.restore_leaves_garbage:
            config["hold_heap"] = True  # nothing to give back: the agent's churn would only add
        return config

    def rootfs(self, layers: list[str], upper: str, guest: str = "", rec: SandboxRecord | None = None) -> RootfsSpec:
        files = self.files
        disks = tuple(files.disk(x) for x in layers)
        mounts = self.mounts_of(rec) if rec is not None else ()
        return RootfsSpec(
            tuple(files.layer(x) for x in layers), files.upper(upper), guest, disks, files.disk(upper), mounts
        )

    def mounts_of(self, rec: SandboxRecord) -> tuple[tuple[Path, str], ...]:
        """The sandbox's volumes: each one's directory and where it is bound (aenv/volumes)."""
        mounts = []
        for mount in rec.volume_mounts:
            host = self.settings.volumes_root / mount["id"] / "data"
            if not host.is_dir():
                raise Conflict(f"volume {mount['name']!r} of sandbox {rec.id} was deleted")
            mounts.append((host, mount["path"]))
        return tuple(mounts)

    async def restore_into(
        self, sb: LiveSandbox, *, image: str, layers: list[str], upper: str, fresh: bool, hold_heap: bool = False
    ) -> None:
        """Start an instance of ``sb`` from a checkpoint image and wire up its agent (``hold_heap``:
        a warm pool member's, which keeps its restore's heap until claimed)."""
        instance_id = new_id()
        await self.files.mount_lowers(layers)
        instance = await self.driver.restore(
            instance_id=instance_id,
            rootfs=self.rootfs(layers, upper, sb.rec.guest, sb.rec),
            limits=self.records.limits_of(sb.rec),
            image_dir=self.files.image(image),
        )
        link = sb.link if (sb.link is not None and not fresh) else self.link_for(sb)
        try:
            config = {**self.agent_config(sb.rec), **({"hold_heap": True} if hold_heap else {})}
            await link.restored(instance, fresh=fresh, config=config)
        except BaseException:
            await self.driver.kill(instance)
            raise
        sb.instance, sb.link = instance, link
        sb.rec.instance_id = instance_id
        if link.watcher is None:
            link.watcher = asyncio.ensure_future(self.watch(sb, link))

    async def boot_into(self, sb: LiveSandbox) -> None:
        """Boot a fresh instance of ``sb`` on its layers and upper (a resume after a pause that kept
        no memory): a new agent from the current bundle, the sandbox's settings, and the template's
        start command started again, as in every sandbox made from the template."""

        async def ready(link: AgentLink) -> None:
            await link.call("sys.configure", self.agent_config(sb.rec))
            await self._start_again(sb, link)

        await self.boot(sb, self.records.limits_of(sb.rec), ready)
        assert sb.link is not None
        sb.link.watcher = asyncio.ensure_future(self.watch(sb, sb.link))

    async def boot(
        self, sb: LiveSandbox, limits: Limits, ready: Callable[[AgentLink], Awaitable[None]] | None = None
    ) -> None:
        """Boot an instance of ``sb`` on its record's layers and upper, with ``limits``, and wait
        for its agent's hello (then ``ready``, given the link). On failure nothing is left running."""
        instance_id, guest = new_id(), self.driver.guest_key()
        await self.files.mount_lowers(sb.rec.layers)
        instance = await self.driver.boot(
            instance_id=instance_id, rootfs=self.rootfs(sb.rec.layers, sb.rec.upper, guest, sb.rec), limits=limits
        )
        link = self.link_for(sb)
        try:
            await link.booted(instance)
            if ready is not None:
                await ready(link)
        except BaseException:
            link.close("the sandbox could not boot")
            await self.driver.kill(instance)
            raise
        sb.instance, sb.link = instance, link
        sb.rec.instance_id, sb.rec.guest = instance_id, guest

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

    def link_for(self, sb: LiveSandbox) -> AgentLink:
        """A new agent link for ``sb``, with a sandbox's egress (its record's network rules)."""
        lookup = self.secret_lookup
        interceptor = (
            None if lookup is None else Interceptor(self.egress_ca, lookup, lambda: sb.rec.team or DEFAULT_TEAM)
        )
        sb.egress = egress.Guest(sb.id, lambda: self.records.policy_of(sb.id), interceptor)
        return AgentLink(
            sb.id,
            serve=sb.egress,
            call_timeout=self.settings.agent_timeout,
            wake=self.driver.wake,
            ready_timeout=self.driver.boot_timeout,
        )

    async def watch(self, sb: LiveSandbox, link: AgentLink) -> None:
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
                await self.died(sb.id)
            except AenvError:
                pass
            return

    def stop_instance(
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
            self.spawn(then())
        if sb.link is not None:
            if keep_streams:
                sb.link.channel.detach()
            else:
                sb.link.close(reason)
                sb.link = None
        sb.rec.instance_id = ""

    def spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(log_failure("background", self.background))

    def _teardown_later(
        self, instance: Instance, then: Callable[[], Awaitable[None]] | None, *, lowers: list[str]
    ) -> None:
        layer = instance.rootfs.upper.name
        self.pending_layers.add(layer)
        self.artifacts.pin(lowers)  # its overlay is mounted until the teardown: not evictable

        async def teardown() -> None:
            # Halted, the instance writes nothing and its overlay is gone: its upper may be sealed
            # or removed, and whoever waits for it (settled) goes on. runsc's own teardown follows.
            try:
                await self.driver.halt(instance)
                if then is not None:
                    await then()
            finally:
                self.artifacts.unpin(lowers)
                self.pending_layers.discard(layer)
                if self._teardown_of.get(layer) is task:
                    del self._teardown_of[layer]
                self.kill_later(instance)

        task = asyncio.ensure_future(teardown())
        self._teardown_of[layer] = task
        self._track(task, instance.id)

    def kill_later(self, instance: Instance) -> None:
        """runsc's own teardown of a halted instance, in the background (settle waits for it)."""
        self._track(asyncio.ensure_future(self.driver.kill(instance)), instance.id)

    def _track(self, task: asyncio.Task[None], instance_id: str) -> None:
        """A teardown's task: the node's stop waits for it (settle)."""
        self._teardowns.add(task)
        self.background.add(task)
        task.add_done_callback(self._teardowns.discard)
        task.add_done_callback(log_failure(instance_id, self.background))

    async def checkpoint_stopped(self, sb: LiveSandbox) -> str:
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
            await self._unfreeze_after_failure(sb)
            raise  # the checkpoint's own error: it says what went wrong
        return image

    async def checkpoint_running(
        self, sb: LiveSandbox, *, also: Callable[[], Awaitable[None]] | None = None
    ) -> tuple[str, str | None]:
        """Freeze the agent, checkpoint the instance leaving it running, copy its upper (and run
        ``also``) while it is stopped, thaw the agent on the same pipe; return (image id, the copy's
        layer id, None when the upper is empty). Its open streams never notice. On failure the
        sandbox is left running and answering, never frozen, and nothing is left behind."""
        assert sb.instance is not None and sb.link is not None
        if not self.driver.saves_epoll_tcp:
            await self._refuse_unsaveable(sb)
        upper = sb.rec.upper
        # The copy takes what the upper holds (sealing took nothing): refused (507) up front rather
        # than let a sandbox's full quota fill the node's disk.
        need = self.files.disk_usage(upper)
        ensure_space(self.files.layers, headroom(self.settings), need, f"a copy of sandbox {sb.id}'s disk")
        await sb.link.freeze()
        image, copy = new_id(), None

        async def copy_upper() -> None:
            nonlocal copy
            if not self.files.is_empty(upper):
                work = asyncio.ensure_future(asyncio.to_thread(self.files.copy_upper, upper))
                try:
                    copy = await asyncio.shield(work)
                except asyncio.CancelledError:  # a kill overtook it: a thread cannot be stopped, so its
                    work.add_done_callback(self._drop_late_copy)  # layer goes once the thread is done
                    raise
            if also is not None:
                await also()

        saved = thawed = False
        try:
            image_dir = self.files.image(image)
            await self.driver.checkpoint_running(sb.instance, image_dir=image_dir, while_stopped=copy_upper)
            saved = True
            await sb.link.unfreeze()
            thawed = True  # the copy is mounted at its first use (a fork's children, a create from it)
        except BaseException as exc:
            self.files.remove_image(image)
            if copy is not None:
                await self.files.remove(copy)
            if not saved:
                await self._unfreeze_after_failure(sb)
            elif not thawed and isinstance(exc, AenvError):  # saved, but its agent did not come back
                self.stop_instance(sb, "the sandbox's agent did not come back from a checkpoint")
            raise
        return image, copy

    def _drop_late_copy(self, work: asyncio.Future[str]) -> None:
        if not work.cancelled() and work.exception() is None:
            self.spawn(self.files.remove(work.result()))

    async def _unfreeze_after_failure(self, sb: LiveSandbox) -> None:
        assert sb.link is not None
        try:
            await sb.link.unfreeze()
        except AenvError:
            log.error("sandbox %s died in a failed checkpoint", sb.id)
            self.stop_instance(sb, "the sandbox died during a failed checkpoint")

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

    async def halt(self, sb: LiveSandbox) -> str:
        """Ready the instance to be stopped keeping only its file system: the agent ends every other
        process, saves what it keeps on disk and syncs, then writes nothing. If the agent does not
        answer, the sandbox keeps running. Returns "" (no checkpoint image)."""
        assert sb.instance is not None and sb.link is not None
        await sb.link.freeze(halt=True)
        return ""


def _blocker(entry: Any) -> str:
    """One process the agent says blocks a checkpoint, as the agent described it (bounded)."""
    if isinstance(entry, dict):
        return f"pid {str(entry.get('pid'))[:20]} ({str(entry.get('cmd'))[:200]})"
    return str(entry)[:200]


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
