"""Teams' quotas on a node: running and paused sandboxes, creates per second, fork size, disk.

Every refusal is a 429 with ``Retry-After`` (``QuotaExceeded``), in E2B's words where E2B has
them; never a dropped connection. Running sandboxes and disk are counted by the node itself at
the moment a sandbox enters (``team_room``, called with nothing awaited between the count and
the entry, as the node's own room): a burst never runs more than the quota. A create may wait for
room (``?wait=SECONDS``, at most ``AENV_MAX_CREATE_WAIT``): it is tried again whenever a sandbox
of the node stops running, or its rate window opens, until the wait is over (then the 429).
In a cluster the gateways count across nodes first (aenv/teams/cluster.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

from fastapi import Request

from aenv.errors import InvalidRequest, LimitExceeded, QuotaExceeded
from aenv.node.service import LiveSandbox, NodeService, SandboxRecord, SandboxState
from aenv.teams.model import DEFAULT_TEAM, Quotas, current
from aenv.teams.registry import Teams

T = TypeVar("T")
DEFAULT_MAX_WAIT = 60.0
FORK_RETRY_AFTER = 60  # a fork larger than the team's quota: not before it is raised
INACTIVE = (SandboxState.PAUSED, SandboxState.KILLED)
NODE_QUEUE = "\0node"  # creates waiting for the node's room (not a team id)


def running_message(limit: int) -> str:
    return (
        f"you have reached the maximum number of concurrent E2B sandboxes ({limit}). If you need more, "
        "ask the deployment's admin to raise your team's quota (maxRunning)"
    )


def paused_message(limit: int) -> str:
    return (
        f"you have reached the maximum number of paused E2B sandboxes ({limit}). Kill paused sandboxes you "
        "no longer need, or ask the deployment's admin to raise your team's quota (maxPaused)"
    )


def disk_message(limit: int) -> str:
    return (
        f"you have reached your team's disk quota ({limit} MiB for its sandboxes, running and paused). Kill "
        "sandboxes you no longer need, or ask the deployment's admin to raise it (maxDiskMB)"
    )


RATE_MESSAGE = "Rate limit exceeded"  # E2B's


def rate_window(q: Quotas) -> tuple[float, int]:
    """(seconds, creates) of the team's rate: creates_per_second over max(1, 1/rate) seconds."""
    window = max(1.0, 1.0 / q.creates_per_second)
    return window, max(1, math.floor(q.creates_per_second * window + 1e-9))


def team_of(rec: SandboxRecord) -> str:
    return rec.team or DEFAULT_TEAM


class NodeQuotas:
    def __init__(self, node: NodeService, teams: Teams, max_wait: float = DEFAULT_MAX_WAIT) -> None:
        self.node = node
        self.teams = teams
        self.max_wait = max_wait
        self.rates: dict[str, deque[float]] = {}
        self.pausing: dict[str, set[str]] = {}
        # Creates waiting for room, in the order they came: a team's (its quota) and the node's (its room).
        self.waiting: dict[str, deque[asyncio.Future[None]]] = {}

    # -- the node's count (node.team_room) ------------------------------------------------------------
    def team_room(self, rec: SandboxRecord, wanted: int) -> tuple[int, str]:
        team = team_of(rec)
        q = self.teams.quotas(team)
        room, reason = wanted, ""
        if q.running:
            active = sum(1 for sb in self._of(team) if sb.state not in INACTIVE)
            if active + wanted > q.running:
                room, reason = max(0, q.running - active), running_message(q.running)
        if q.disk_mb:
            each = max(1, self.node.limits_of(rec).disk_mb)
            used = sum(
                self.node.limits_of(sb.rec).disk_mb
                for sb in self._of(team)
                if sb.state != SandboxState.KILLED and not (sb.id == rec.id and sb.state == SandboxState.PAUSED)
            )
            fit = max(0, (q.disk_mb - used) // each)
            if fit < room:
                room, reason = fit, disk_message(q.disk_mb)
        return room, reason

    def _of(self, team: str) -> list[LiveSandbox]:
        return [sb for sb in list(self.node.sandboxes.values()) if team_of(sb.rec) == team]

    # -- rate -----------------------------------------------------------------------------------------
    def take_rate(self, team: str) -> float | None:
        """A create's place in its team's rate window (None: no rate quota), or QuotaExceeded."""
        q = self.teams.quotas(team)
        if not q.creates_per_second:
            return None
        window, most = rate_window(q)
        now = time.monotonic()
        seen = self.rates.setdefault(team, deque())
        while seen and seen[0] <= now - window:
            seen.popleft()
        if len(seen) >= most:
            raise QuotaExceeded(RATE_MESSAGE, retry_after=math.ceil(seen[0] + window - now))
        seen.append(now)
        return now

    def refund(self, team: str, taken: float | None) -> None:
        seen = self.rates.get(team)
        if taken is not None and seen is not None:
            try:
                seen.remove(taken)
            except ValueError:
                pass

    # -- creates that wait ----------------------------------------------------------------------------
    def wait_of(self, request: Request) -> float:
        raw = request.query_params.get("wait")
        if raw is None:
            return 0.0
        try:
            wait = float(raw)
        except ValueError:
            raise InvalidRequest("wait must be a number of seconds") from None
        if not math.isfinite(wait) or wait < 0:
            raise InvalidRequest("wait must be a number of seconds, 0 or more")
        return min(wait, self.max_wait)

    async def admitted(self, request: Request, attempt: Callable[[], Awaitable[T]]) -> T:
        """A create under its team's rate, tried again for up to ``?wait`` seconds while the team or
        the node has no room (a burst queues); then the last 429."""
        who = current()
        team = who.team if who is not None else DEFAULT_TEAM
        deadline = time.monotonic() + self.wait_of(request)
        tried = False
        while True:
            taken: float | None = None
            try:
                taken = self.take_rate(team)
                return await attempt()
            except LimitExceeded as exc:
                self.refund(team, taken)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                queue = team if isinstance(exc, QuotaExceeded) else NODE_QUEUE
                await self._wait_for_room(queue, min(left, float(getattr(exc, "retry_after", 1))), again=tried)
                tried = True

    async def _wait_for_room(self, queue: str, most: float, *, again: bool) -> None:
        """Until a sandbox stops running (one waiter woken for each, first come first woken; one
        woken that found no room is first again), or ``most`` seconds."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting = self.waiting.setdefault(queue, deque())
        if again:
            waiting.appendleft(waiter)
        else:
            waiting.append(waiter)
        try:
            await asyncio.wait([waiter], timeout=most)
        finally:
            if not waiter.done():
                waiter.cancel()
            with contextlib.suppress(ValueError):
                waiting.remove(waiter)
            if not waiting:
                self.waiting.pop(queue, None)

    def changed(self, sb: LiveSandbox) -> None:
        """A state listener of the node: a sandbox paused or gone makes room for one waiter of its
        team and one waiting for the node's room."""
        if sb.state not in INACTIVE:
            return
        for queue in (team_of(sb.rec), NODE_QUEUE):
            waiting = self.waiting.get(queue)
            while waiting:
                waiter = waiting.popleft()
                if not waiter.done():
                    waiter.set_result(None)
                    break

    # -- forks and pauses -----------------------------------------------------------------------------
    def check_fork(self, rec: SandboxRecord, count: int) -> None:
        """A fork of ``count`` from ``rec``: within the team's fork size, and the whole fork within
        its running and disk quotas now (children that lose a race for room get the 429 each)."""
        team = team_of(rec)
        q = self.teams.quotas(team)
        if q.fork and count > q.fork:
            raise QuotaExceeded(
                f"Count cannot be greater than {q.fork} (your team's fork quota, maxFork)", retry_after=FORK_RETRY_AFTER
            )
        room, reason = self.team_room(rec, count)
        if room < count:
            raise QuotaExceeded(reason)

    @asynccontextmanager
    async def pausing_one(self, sandbox_id: str) -> AsyncIterator[None]:
        """A pause of a running sandbox, counted against its team's paused quota while it runs."""
        sb = self.node.sandboxes.get(sandbox_id)
        if sb is None or sb.state in INACTIVE:
            yield  # the node's answer: not found, or already paused
            return
        team = team_of(sb.rec)
        q = self.teams.quotas(team)
        under_way = self.pausing.setdefault(team, set())
        if q.paused:
            paused = {s.id for s in self._of(team) if s.state in (SandboxState.PAUSED, SandboxState.PAUSING)}
            if len((paused | under_way) - {sandbox_id}) >= q.paused:
                raise QuotaExceeded(paused_message(q.paused))
        under_way.add(sandbox_id)
        try:
            yield
        finally:
            under_way.discard(sandbox_id)
