"""What each team used on this node: sandbox-seconds, CPU-seconds, and GiB-seconds of memory and
of storage, counted every ``AENV_METRICS_INTERVAL`` seconds.

- sandbox-seconds: time its sandboxes were not paused (creating, running, resuming, ...);
- CPU-seconds: the CPU time of its sandboxes' cgroups (the node's own usage samples, never what
  the sandbox says);
- memory GiB-seconds: the memory limit of each of its sandboxes while not paused (what the node
  holds for it, as E2B bills RAM);
- storage GiB-seconds: the disk quota of each of its sandboxes, paused ones included, while it
  exists.

Totals go on ``/metrics`` (``aenv_team_*_total{team}``), on ``GET /teams/{id}/metrics`` (E2B's
TeamMetric over time, with the totals at each point) and ``GET /teams/{id}/usage``; they are kept
in the team store every ``SAVE_EVERY`` seconds and at stop, so a restart loses at most that.
In a cluster each node keeps its own under its id and a team's usage is the sum (aenv/teams/cluster.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Gauge

from aenv.node.service import NodeService, SandboxState
from aenv.teams.model import rfc3339
from aenv.teams.quotas import INACTIVE, team_of
from aenv.teams.registry import Teams

log = logging.getLogger("aenv.teams")
SAVE_EVERY = 30.0
SHARED_SAVE_EVERY = 5.0  # in a cluster (others sum it): the teams whose usage changed, this often
SERIES_POINTS = 720  # an hour at 5 s
FIELDS = ("sandbox_seconds", "cpu_seconds", "memory_gib_seconds", "storage_gib_seconds")
WIRE = {
    "sandbox_seconds": "sandboxSeconds",
    "cpu_seconds": "cpuSeconds",
    "memory_gib_seconds": "memoryGiBSeconds",
    "storage_gib_seconds": "storageGiBSeconds",
}
COUNTERS = {
    name: Counter(
        f"aenv_team_{name}", f"Team usage: {name.replace('_', ' ')}, on this node since it was made", ["team"]
    )
    for name in FIELDS
}
SANDBOXES = Gauge("aenv_team_sandboxes", "A team's sandboxes on this node, by public state", ["team", "state"])


@dataclass(frozen=True, slots=True)
class Point:
    at: float
    running: int
    started: int  # sandboxes started since the previous point
    seconds: float  # since the previous point
    totals: tuple[float, ...]


class NodeUsage:
    def __init__(self, node: NodeService, teams: Teams) -> None:
        self.node = node
        self.teams = teams
        self.totals: dict[str, dict[str, float]] = {}
        self.series: dict[str, deque[Point]] = {}
        self.cpu_seen: dict[str, tuple[str, float]] = {}  # sandbox id -> (instance id, CPU seconds)
        self.running_seen: set[str] = set()
        self.last = time.monotonic()
        self.saved_at = time.monotonic()
        self.saved: dict[str, dict[str, float]] = {}  # what the store has
        self.labels: set[tuple[str, str]] = set()
        self._task: asyncio.Task[None] | None = None
        self.interval = float(node.settings.metrics_interval)

    async def start(self) -> None:
        try:
            saved = await self.teams.store.load_usage()
        except Exception:  # noqa: BLE001 - counting starts from zero rather than not at all
            log.exception("could not read the teams' usage: counting from zero")
            saved = {}
        for team, totals in saved.items():
            mine = self.totals.setdefault(team, dict.fromkeys(FIELDS, 0.0))
            for name in FIELDS:
                extra = float(totals.get(name, 0.0)) - mine[name]
                if extra > 0:
                    mine[name] += extra
                    COUNTERS[name].labels(team).inc(extra)
        self.last = time.monotonic()
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.sample()
        await self.save()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                self.sample()
                every = SHARED_SAVE_EVERY if self.teams.store.shared else SAVE_EVERY
                if time.monotonic() - self.saved_at >= every:
                    await self.save()
            except Exception:
                log.exception("team usage accounting failed")

    async def save(self) -> None:
        self.saved_at = time.monotonic()
        changed = {team: dict(totals) for team, totals in self.totals.items() if totals != self.saved.get(team)}
        if not changed:
            return
        try:
            await self.teams.store.put_usage(changed)
        except Exception:  # noqa: BLE001 - kept in memory, saved next time
            log.warning("could not save the teams' usage", exc_info=True)
            return
        self.saved.update(changed)

    def sample(self) -> None:
        """Add what every sandbox used since the last sample to its team."""
        now = time.monotonic()
        dt = max(0.0, now - self.last)
        self.last = now
        added: dict[str, list[float]] = {}
        running: dict[str, int] = {}
        started: dict[str, int] = {}
        states: dict[tuple[str, str], int] = {}
        live = set()
        for sb in list(self.node.sandboxes.values()):
            if sb.state == SandboxState.KILLED:
                continue
            live.add(sb.id)
            team = team_of(sb.rec)
            adds = added.setdefault(team, [0.0] * len(FIELDS))
            limits = self.node.limits_of(sb.rec)
            public = "paused" if sb.state == SandboxState.PAUSED else "running"
            states[(team, public)] = states.get((team, public), 0) + 1
            adds[3] += limits.disk_mb / 1024 * dt
            if sb.state in INACTIVE:
                continue
            running[team] = running.get(team, 0) + 1
            if sb.id not in self.running_seen:
                self.running_seen.add(sb.id)
                started[team] = started.get(team, 0) + 1
            adds[0] += dt
            adds[2] += limits.memory_mb / 1024 * dt
            adds[1] += self._cpu(sb.id)
        self.running_seen &= live
        for gone in self.cpu_seen.keys() - live:
            del self.cpu_seen[gone]
        for team, adds in added.items():
            totals = self.totals.setdefault(team, dict.fromkeys(FIELDS, 0.0))
            for name, amount in zip(FIELDS, adds, strict=True):
                if amount > 0:
                    totals[name] += amount
                    COUNTERS[name].labels(team).inc(amount)
        for key in self.labels - states.keys():
            SANDBOXES.labels(*key).set(0)
        for key, count in states.items():
            SANDBOXES.labels(*key).set(count)
        self.labels |= states.keys()
        at = time.time()
        for team in set(self.totals) | set(running):
            totals = self.totals.get(team, dict.fromkeys(FIELDS, 0.0))
            point = Point(at, running.get(team, 0), started.get(team, 0), dt, tuple(totals[n] for n in FIELDS))
            self.series.setdefault(team, deque(maxlen=SERIES_POINTS)).append(point)

    def _cpu(self, sandbox_id: str) -> float:
        history = self.node.usage_of(sandbox_id)
        baseline = history.baseline if history is not None else None
        if baseline is None:
            return 0.0
        instance, _, cpu = baseline
        before = self.cpu_seen.get(sandbox_id)
        self.cpu_seen[sandbox_id] = (instance, cpu)
        if before is None or before[0] != instance:
            return max(0.0, cpu)  # a new instance: its CPU time since it started
        return max(0.0, cpu - before[1])

    def usage_json(self, team: str, totals: dict[str, float] | None = None) -> dict[str, Any]:
        mine = totals if totals is not None else self.totals.get(team, {})
        counts = {"running": 0, "paused": 0}
        for sb in list(self.node.sandboxes.values()):
            if team_of(sb.rec) == team and sb.state != SandboxState.KILLED:
                counts["paused" if sb.state == SandboxState.PAUSED else "running"] += 1
        return {
            "teamID": team,
            **{WIRE[name]: round(mine.get(name, 0.0), 3) for name in FIELDS},
            "runningSandboxes": counts["running"],
            "pausedSandboxes": counts["paused"],
        }

    async def team_metrics(self, team: str, start: int | None, end: int | None) -> list[dict[str, Any]]:
        """E2B's TeamMetric (concurrent sandboxes, start rate) at each point, with the totals then."""
        out = []
        for p in self.series.get(team, ()):
            if (start is not None and p.at < start) or (end is not None and int(p.at) > end):
                continue
            out.append(
                {
                    "timestamp": rfc3339(p.at),
                    "timestampUnix": int(p.at),
                    "concurrentSandboxes": p.running,
                    "sandboxStartRate": round(p.started / p.seconds, 3) if p.seconds > 0 else 0.0,
                    **{WIRE[name]: round(v, 3) for name, v in zip(FIELDS, p.totals, strict=True)},
                }
            )
        return out
