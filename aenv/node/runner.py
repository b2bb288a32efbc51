"""The runner every lifecycle operation on a sandbox goes through, and the kill.

Each operation on a sandbox runs as its own task under the sandbox's lock, so it completes even
if the client that asked for it goes away, and concurrent requests for the same idempotent
transition (pause, resume) join the task already running instead of starting a second one. Every
operation has a deadline. A kill does not queue behind them: it cancels whatever is in flight on
the sandbox (those callers get 404, the sandbox was killed) and removes it within seconds.

``Node`` (aenv/node/orchestrator.py) makes one ``Runner`` and hands it to the operations
(aenv/node/creation.py, aenv/node/checkpoints.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aenv.config import Settings
from aenv.errors import OperationTimeout, SandboxNotFound
from aenv.node import metrics
from aenv.node.artifacts import ArtifactCache
from aenv.node.instances import Instances
from aenv.node.records import Records
from aenv.node.rollout import RolloutLogs
from aenv.node.sandbox import LiveSandbox, log_failure
from aenv.node.state import SETTLED, SandboxState
from aenv.storage.layers import LayerStore

log = logging.getLogger("aenv.node")
S = SandboxState
T = TypeVar("T")
KILL_GRACE = 10.0  # how long a kill waits for the operations it cancelled to unwind


class Runner:
    def __init__(
        self,
        *,
        settings: Settings,
        records: Records,
        instances: Instances,
        files: LayerStore,
        artifacts: ArtifactCache,
        rollouts: RolloutLogs,
        background: set[asyncio.Task[Any]],
    ) -> None:
        self.settings = settings
        self.records = records
        self.instances = instances
        self.files = files
        self.artifacts = artifacts
        self.rollouts = rollouts
        self.background = background

    async def operate(self, sb: LiveSandbox, name: str, fn: Callable[[], Awaitable[T]], *, join: bool) -> T:
        if join:
            running = sb.ops.get(name)
            if running is not None and not running.done():
                return await self._outcome(sb, name, running)
        if sb.killer is not None:
            raise self.killed(sb, name)

        async def locked() -> T:
            async with sb.lock:
                if sb.killer is not None:  # killed while this one waited for the lock
                    raise self.killed(sb, name)
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
        self.background.add(task)
        sb.tasks.add(task)
        if join:
            sb.ops[name] = task

        def done(t: asyncio.Task[T]) -> None:
            self.background.discard(t)
            sb.tasks.discard(t)
            if sb.ops.get(name) is t:
                sb.ops.pop(name, None)
            if not t.cancelled():
                t.exception()  # retrieved: a client that left must not cause a warning

        task.add_done_callback(done)
        return await self._outcome(sb, name, task)

    async def _outcome(self, sb: LiveSandbox, name: str, task: asyncio.Future[T]) -> T:
        """The operation's result; if a kill stopped it, a clear error for its caller."""
        try:
            return await asyncio.shield(task)
        except BaseException as exc:
            caller = asyncio.current_task()
            if sb.killer is None or (caller is not None and caller.cancelling()):
                raise
            raise self.killed(sb, name) from exc

    def killed(self, sb: LiveSandbox, name: str) -> SandboxNotFound:
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
        if self.records.sandboxes.get(sb.id) is sb and sb.killer is None and sb.state not in SETTLED:
            log.error("sandbox %s was left %s by %s; killing it", sb.id, sb.state.value, name)
            self.instances.spawn(self.kill(sb.id))

    async def after_failed_checkpoint(self, sb: LiveSandbox) -> None:
        """Back to running if the instance survived (the usual case); otherwise it is gone."""
        if sb.killer is not None:
            return  # the kill that stopped the checkpoint removes the sandbox
        if sb.instance is not None:
            await self.records.set_state(sb, S.RUNNING, persist=False)
        else:
            await self.discard(sb)

    async def kill(self, sandbox_id: str) -> None:
        """Stop and remove a sandbox within seconds, whatever it or its agent is doing: operations
        in flight on it are cancelled (their callers get 404) and concurrent kills join this one."""
        sb = self.records.get(sandbox_id)
        if sb.killer is None:
            sb.killer = asyncio.ensure_future(self._kill(sb))
            self.background.add(sb.killer)
            sb.killer.add_done_callback(log_failure(sb.id, self.background))
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
            await self.records.set_state(sb, S.KILLING, persist=False)
            await self._forget(sb)
        metrics.OPERATIONS.labels(op="kill", outcome="ok").inc()
        metrics.OPERATION_SECONDS.labels(op="kill").observe(time.monotonic() - started)

    async def discard(self, sb: LiveSandbox) -> None:
        """Remove a sandbox an operation cannot keep (it died, or is a failed fork's child)."""
        if sb.killer is None and sb.state != S.KILLED:
            await self.records.set_state(sb, S.KILLING, persist=False)
            await self._forget(sb)

    async def _forget(self, sb: LiveSandbox) -> None:
        upper, image = sb.rec.upper, sb.rec.image

        async def release() -> None:
            await self.files.remove(upper)
            self.files.remove_image(image)

        self.instances.stop_instance(sb, f"sandbox {sb.id} was killed", then=release)
        self.rollouts.remove(sb.id)
        if sb.rec.durable_at:
            self.instances.spawn(self.artifacts.forget_pause(sb.id))
        await self.records.set_state(sb, S.KILLED, persist=False)
        self.records.sandboxes.pop(sb.id, None)
        await self.records.store.delete_sandbox(sb.id)
