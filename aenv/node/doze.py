"""Dozing: an idle running sandbox is frozen whole on the host, and thawed by whatever comes to it.

An idle gVisor sentry still wakes a few times a second (its Go runtime's timers, the guest
clock's updater): ~0.4 ms of CPU a second per sandbox, 0.16 cores for 400 idle sandboxes. A
sandbox that is only waiting for its next command needs none of that, so once it has been quiet
for ``AENV_DOZE_AFTER`` seconds the node freezes its host tasks (the driver's :meth:`doze`: the
cgroup freezer) and it costs no CPU at all. Its memory stays, so unlike a pause nothing is saved
or restored: the next write to its channel thaws it first (the driver's :meth:`wake`, one write to
the freezer), and so does every runtime operation on it (pause, snapshot, fork, kill).

Nobody in the sandbox may notice, so a sandbox dozes only when

- its agent says it is the only process left (``sys.alone``): a background command, a server, a
  ``sleep`` in a loop all keep it awake, as their timers must fire on time;
- no stream is open on its channel either way (a command's output, a file transfer, a watch, a
  proxied connection) and no control exchange awaits an answer;
- nothing was written or read on its channel for ``AENV_DOZE_AFTER`` seconds and no operation
  holds it.

The agent's answer comes from the sandbox, which root in it controls: lying "alone" freezes only
that sandbox's own processes until the next request; lying "not alone" only costs its own CPU.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aenv.channel import StreamError
from aenv.errors import AenvError
from aenv.node.sandbox import LiveSandbox
from aenv.node.state import SandboxState

if TYPE_CHECKING:
    from aenv.config import Settings
    from aenv.runtime.base import Driver

log = logging.getLogger("aenv.node")
TICK = 1.0  # seconds between two looks at the node's sandboxes
ASK_TIMEOUT = 5.0  # for the agent's answer to sys.alone
ASKING_AT_ONCE = 8
# A sandbox whose agent is not alone is asked again after this many quiet periods, doubling up to
# BACKOFF_MAX: a long-running server is asked about once every few minutes, not every 10 s.
BACKOFF_MAX = 32
ASK_FRAMES = 2  # what asking takes on the channel: our OPEN and the agent's END


@dataclass(slots=True)
class Watch:
    """What the doze loop knows of one sandbox's channel."""

    instance_id: str
    frames: int  # the channel's frame count when last looked at
    quiet_since: float  # monotonic time since which that count has not moved
    periods: int = 1  # quiet periods to wait before asking again (backoff when not alone)


class Dozer:
    """The doze loop, on what it needs of the node: its settings, its driver (which freezes and
    thaws instances), its sandboxes and its warm pools' idle members."""

    def __init__(
        self,
        settings: Settings,
        driver: Driver,
        sandboxes: Callable[[], Iterable[LiveSandbox]],
        members: Callable[[], Iterable[LiveSandbox]],
    ) -> None:
        self.settings, self.driver = settings, driver
        self._sandboxes, self._pool_members = sandboxes, members
        self._watch: dict[str, Watch] = {}  # sandbox (or warm pool member) id -> its watch

    def candidates(self) -> list[LiveSandbox]:
        """Running sandboxes, the warm pools' idle members included."""
        return [*self._sandboxes(), *self._members()]

    def _members(self) -> list[LiveSandbox]:
        return list(self._pool_members())

    async def forever(self) -> None:
        while True:
            # At most a tenth of the quiet period late: a short AENV_DOZE_AFTER is looked at sooner.
            await asyncio.sleep(min(TICK, max(self.settings.doze_after / 10, 0.1)))
            if self.settings.doze_after <= 0:
                continue
            try:
                await self.look()
            except Exception:
                log.exception("doze pass failed")

    async def look(self) -> None:
        """Doze every sandbox that has been quiet long enough and whose agent says it is alone."""
        now = time.monotonic()
        after = self.settings.doze_after
        seen: set[str] = set()
        due: list[LiveSandbox] = []
        for sb in self.candidates():
            seen.add(sb.id)
            instance, link = sb.instance, sb.link
            if instance is None or link is None or self.driver.dozing(instance):
                continue
            frames = link.channel.frames
            watch = self._watch.get(sb.id)
            if watch is None or watch.instance_id != instance.id or watch.frames != frames:
                periods = watch.periods if watch is not None and watch.instance_id == instance.id else 1
                self._watch[sb.id] = Watch(instance.id, frames, now, periods)
                continue
            if now - watch.quiet_since >= after * watch.periods and self._may_doze(sb):
                due.append(sb)
        for gone in self._watch.keys() - seen:
            del self._watch[gone]
        gate = asyncio.Semaphore(ASKING_AT_ONCE)

        async def one(sb: LiveSandbox) -> None:
            async with gate:
                await self._try(sb)

        await asyncio.gather(*(one(sb) for sb in due))

    def _may_doze(self, sb: LiveSandbox) -> bool:
        link = sb.link
        return (
            (sb.state == SandboxState.RUNNING or any(m is sb for m in self._members()))  # members: CREATING
            and sb.killer is None
            and not sb.lock.locked()
            and link is not None
            and link.idle
        )

    async def _try(self, sb: LiveSandbox) -> None:
        instance, link = sb.instance, sb.link
        watch = self._watch.get(sb.id)
        if instance is None or link is None or watch is None:
            return
        before = link.channel.frames
        try:
            answer: Any = await asyncio.wait_for(link.call("sys.alone"), ASK_TIMEOUT)
        except (AenvError, StreamError, TimeoutError) as exc:
            answer = None  # an agent from before sys.alone, or a busy one: it stays awake
            log.debug("sandbox %s: no doze (%s)", sb.id, exc)
        alone = isinstance(answer, dict) and answer.get("alone") is True
        # Whatever came meanwhile (a command that started a process since the agent answered, and
        # may be over already) keeps it awake. From here to the freeze nothing awaits: nothing
        # can slip in between.
        if sb.instance is not instance or sb.link is not link or not self._may_doze(sb):
            return
        frames = link.channel.frames
        watch.frames, watch.quiet_since = frames, time.monotonic()
        if frames - before > ASK_FRAMES:
            return
        if not alone:
            watch.periods = min(watch.periods * 2, BACKOFF_MAX)
            return
        watch.periods = 1
        if self.driver.doze(instance):
            log.debug("sandbox %s dozes", sb.id)
