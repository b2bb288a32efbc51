"""Resource usage history of sandboxes: E2B's sandbox metrics.

Every running sandbox is sampled on the host every ``AENV_METRICS_INTERVAL`` seconds (E2B: 5):
CPU from its cgroup's CPU time since the previous sample, memory from its memory cgroup, disk from
its upper's file system. Nothing is asked of the agent, so what sandbox root says cannot enter the
numbers, and a wedged agent cannot hold an answer up. Each sandbox keeps its last
``AENV_METRICS_HISTORY`` samples packed in one buffer (36 bytes a sample: 13 KiB for half an hour),
so thousands of sandboxes cost megabytes. A paused sandbox is not sampled (it uses nothing) and
keeps its history; a killed one loses it, as the node forgets it.

A range is answered as E2B's API answers it from its metrics store: the samples inside
``[start, end]`` (either open), grouped into buckets of a step that grows with the range (5 s
below an hour), each the maximum of its samples, stamped with the bucket's start.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aenv.node.state import SandboxState

if TYPE_CHECKING:
    from aenv.node.orchestrator import Node
    from aenv.node.sandbox import LiveSandbox

log = logging.getLogger("aenv.node")
PACKED = struct.Struct("<dfQQQ")  # time, CPU %, memory used, memory cache, disk used
# E2B's buckets: (range shorter than this many seconds, step in seconds).
STEPS = ((3600, 5), (6 * 3600, 30), (12 * 3600, 60), (24 * 3600, 120), (7 * 24 * 3600, 300))
LONGEST_STEP = 900


@dataclass(frozen=True, slots=True)
class Sample:
    ts: float
    cpu_used_pct: float
    mem_used: int
    mem_cache: int
    disk_used: int


class History:
    """The last ``capacity`` samples of one sandbox, oldest first, packed in one buffer."""

    __slots__ = ("_buf", "_capacity", "baseline")

    def __init__(self, capacity: int) -> None:
        self._buf = bytearray()
        self._capacity = capacity
        # (instance id, monotonic time, CPU seconds) of the last reading: CPU use is a difference
        self.baseline: tuple[str, float, float] | None = None

    def add(self, sample: Sample) -> None:
        self._buf += PACKED.pack(sample.ts, sample.cpu_used_pct, sample.mem_used, sample.mem_cache, sample.disk_used)
        excess = len(self._buf) - self._capacity * PACKED.size
        if excess > 0:
            del self._buf[:excess]

    def __iter__(self) -> Iterator[Sample]:
        for values in PACKED.iter_unpack(self._buf):
            yield Sample(*values)

    def latest(self) -> Sample | None:
        if not self._buf:
            return None
        return Sample(*PACKED.unpack_from(self._buf, len(self._buf) - PACKED.size))


class UsageHistory:
    """Every sandbox's history, and the sampler that fills them."""

    def __init__(self, interval: float, capacity: int) -> None:
        self.interval = interval
        self.capacity = capacity
        self._histories: dict[str, History] = {}
        self._due: dict[str, float] = {}  # sandbox id -> monotonic time of its next sample

    def of(self, sandbox_id: str) -> History | None:
        return self._histories.get(sandbox_id)

    async def sample_forever(self, node: Node) -> None:
        tick = min(self.interval, 1.0)  # a new sandbox's first sample comes a tick after its baseline
        while True:
            try:
                await self.sample_due(node)
            except Exception:
                log.exception("usage sampling failed")
            await asyncio.sleep(tick)

    async def sample_due(self, node: Node) -> None:
        for gone in self._histories.keys() - node.sandboxes.keys():
            del self._histories[gone]
            self._due.pop(gone, None)
        now = time.monotonic()
        for sb in list(node.sandboxes.values()):
            if sb.state != SandboxState.RUNNING or sb.instance is None or self._due.get(sb.id, 0.0) > now:
                continue
            history = self._histories.get(sb.id)
            if history is None:
                history = self._histories[sb.id] = History(self.capacity)
            if await self._sample(node, sb, history):
                self._due[sb.id] = now + self.interval

    async def _sample(self, node: Node, sb: LiveSandbox, history: History) -> bool:
        """Read the sandbox's usage; records a sample once there is a baseline for its CPU use."""
        instance = sb.instance
        if instance is None:
            return False
        latest = history.latest()
        baseline = history.baseline
        if latest is not None and baseline is not None and baseline[0] == instance.id and node.driver.dozing(instance):
            # Frozen: nothing it holds or uses can change, and reading its cgroup costs the node
            # (at 400 idle sandboxes, 80 reads a second).
            history.baseline = (instance.id, time.monotonic(), baseline[2])
            history.add(Sample(time.time(), 0.0, latest.mem_used, 0, latest.disk_used))
            return True
        usage = await node.driver.usage(instance)
        now = time.monotonic()
        previous, history.baseline = history.baseline, (instance.id, now, usage.cpu_seconds)
        if previous is None or previous[0] != instance.id or now <= previous[1]:
            return False  # a new instance (created, resumed, restored): its CPU time starts anew
        cpus = max(node.limits_of(sb.rec).cpu_count, 0.01)
        busy = (usage.cpu_seconds - previous[2]) / (now - previous[1]) / cpus * 100
        history.add(
            Sample(
                ts=time.time(),
                cpu_used_pct=round(min(max(busy, 0.0), 100.0), 2),
                mem_used=usage.memory_bytes,
                mem_cache=0,  # the guest's page cache is not told apart on the host
                disk_used=_disk_used(node, sb),
            )
        )
        return True


def _disk_used(node: Node, sb: LiveSandbox) -> int:
    """Bytes used on the sandbox's disk: its upper's file system, as the host mounts it."""
    try:
        st = os.statvfs(node.files.upper(sb.rec.upper))
    except OSError:
        return 0
    return (st.f_blocks - st.f_bfree) * st.f_frsize


@dataclass(frozen=True, slots=True)
class Bucket:
    start: int  # Unix seconds
    cpu_used_pct: float
    mem_used: int
    mem_cache: int
    disk_used: int


def step_for(span: float) -> int:
    """E2B's bucket size for a range of ``span`` seconds (under 1000 buckets)."""
    for shorter_than, step in STEPS:
        if span < shorter_than:
            return step
    return LONGEST_STEP


def in_range(samples: History | None, start: int | None, end: int | None) -> list[Bucket]:
    """The samples in ``[start, end]`` (Unix seconds; None = open), bucketed as E2B buckets them."""
    chosen = [s for s in samples or () if (start is None or s.ts >= start) and (end is None or math.floor(s.ts) <= end)]
    if not chosen:
        return []
    lo = start if start is not None else chosen[0].ts
    hi = end if end is not None else chosen[-1].ts
    step = step_for(hi - lo)
    buckets: dict[int, list[Sample]] = {}
    for s in chosen:
        buckets.setdefault(int(s.ts // step) * step, []).append(s)
    return [
        Bucket(
            start=at,
            cpu_used_pct=max(s.cpu_used_pct for s in group),
            mem_used=max(s.mem_used for s in group),
            mem_cache=max(s.mem_cache for s in group),
            disk_used=max(s.disk_used for s in group),
        )
        for at, group in buckets.items()
    ]
