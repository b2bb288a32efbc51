"""Warm pools: sandboxes of a template restored ahead of time and left idle, so that a create of that
template takes one instead of restoring (a few ms instead of a few hundred).

A pool member is an instance restored from the template's image onto a fresh upper, its agent thawed
with the template's own settings and nothing else: no sandbox id a client will see, no env, no
network rules (its egress is refused: no record names it). It is not a sandbox of the node: never in
``node.sandboxes``, so never listed, counted against ``AENV_MAX_SANDBOXES``, sampled, billed or
written to the cluster's directory. A create that matches it (same template build, same CPU, memory
and disk limits: those are the host's cgroups and the upper's size, fixed at restore) takes it
(``WarmPools.take``) and the create's path applies everything else of the create at that moment:
a fresh sandbox id (hence fresh access and traffic tokens), env, user, workdir, process limit
(``sys.configure``), metadata, timeout, lifecycle and network rules (the record's). What it cannot
apply it does not claim: a create with other limits restores as before.

How many members a template keeps (``target``): the size set for it (``PUT /templates/{id}/warm-pool``:
what its operator asked for), else the node's ``AENV_WARM_POOL`` but no more than the template's
recent demand (its creates within ``AENV_WARM_POOL_WINDOW`` seconds: a template nobody creates from
keeps none), all within ``AENV_WARM_POOL_MEMORY_MB`` for every pool together (at the members'
measured memory). The pool is
refilled one member at a time, only when the node is quiet (no operation running, no create within
the last half second): a burst of creates is never slowed down by its own refill. Members above the
target, beyond the budget, or while the host has less than ``AENV_WARM_POOL_MIN_FREE_MB`` available
are dropped; so are the members of a template that was rebuilt (another record or image under its
name) or deleted.

A new image's first sandbox (``boot_first``, ``snapshot_first``, ``offer_first``) is kept the same
way for a moment. The first create of an image waits for its template's build; instead of booting a
build sandbox, snapshotting it, stopping it and restoring the snapshot for that create, the build
boots the sandbox the create would get (the template's limits, a sandbox's egress, refused until
claimed), checkpoints it leaving it running (its upper copied into the template's top layer), and
offers it here: the next create of the template takes it as it would a pool member, saving the
restore. Its record keeps the layers it runs on (without the copy: its own upper holds the same
files, and stacked under it the copy could bring back a file deleted from it). One nobody claims
within ``AENV_FIRST_SANDBOX_SECONDS`` (the creates that waited for the build come at once; a
client that gave up meanwhile never does) is dropped.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import Counter, Gauge

from aenv.errors import AenvError, InvalidRequest, TemplateNotFound
from aenv.node.sandbox import LiveSandbox
from aenv.node.store import SandboxRecord, TemplateRecord
from aenv.runtime.base import Limits
from aenv.storage.layers import new_id

if TYPE_CHECKING:
    from aenv.config import Settings
    from aenv.node.artifacts import ArtifactCache
    from aenv.node.instances import Instances
    from aenv.node.records import Records
    from aenv.node.store import Store
    from aenv.runtime.base import Driver
    from aenv.storage.layers import LayerStore


class PoolHost(Protocol):
    """What the warm pools use of their node: its records and templates, the artifacts they
    restore from, the instances they keep, and a little of its store."""

    @property
    def settings(self) -> Settings: ...
    @property
    def artifacts(self) -> ArtifactCache: ...
    @property
    def driver(self) -> Driver: ...
    @property
    def files(self) -> LayerStore: ...
    @property
    def instances(self) -> Instances: ...
    @property
    def records(self) -> Records: ...
    @property
    def store(self) -> Store: ...
    @property
    def sandboxes(self) -> Mapping[str, LiveSandbox]: ...
    @property
    def templates(self) -> Mapping[str, TemplateRecord]: ...
    def find_template(self, ref: str) -> TemplateRecord: ...


log = logging.getLogger("aenv.node")

SIZES_KEY = "warm_pools"  # the store's meta key: {template name: size}
MAX_SIZE = 1000
REFILL_QUIET_SECONDS = 0.5  # no create for this long before a refill starts
PASS_SECONDS = 1.0  # the pool looks at demand, memory and its templates at least this often
DEFAULT_MEMBER_MB = 64  # what one member is taken to cost until one was measured
MAX_DEMAND_KEPT = 10_000  # create times remembered per template
# A template whose members fail to restore is tried again after 2 s, then 4, 8, ... at most 5 min
# (a broken build would otherwise restore and fail every pass, forever); a rebuild starts afresh.
RETRY_FIRST_SECONDS = 2.0
RETRY_MAX_SECONDS = 300.0

WARM_MEMBERS = Gauge("aenv_warm_pool_members", "Idle sandboxes kept restored in warm pools", ["template"])
WARM_CLAIMS = Counter(
    "aenv_warm_pool_creates_total",
    "Creates of a template that has a warm pool: taken from it (hit) or restored (miss)",
    ["outcome"],
)
FIRST_SANDBOXES = Counter(
    "aenv_image_first_sandboxes_total",
    "A new image's build sandbox kept running for a create: claimed, or dropped unclaimed",
    ["outcome"],
)


@dataclass(frozen=True)
class Build:
    """What a member was restored from: a create may take it only while its template is still this."""

    template_id: str
    image: str
    layers: tuple[str, ...]
    guest: str

    @classmethod
    def of(cls, rec: TemplateRecord) -> Build:
        return cls(rec.id, rec.image, tuple(rec.layers), rec.guest)


@dataclass
class Member:
    sb: LiveSandbox  # its record names the pool's own id, never shown
    build: Build
    limits: Limits
    held: list[str]  # its layers, image and upper, pinned while it waits
    watcher: asyncio.Task[None] | None = None
    kept_until: float = 0.0  # a new image's first sandbox: dropped unclaimed after this (monotonic)

    @property
    def first(self) -> bool:
        return self.kept_until > 0


def same_host_limits(a: Limits, b: Limits) -> bool:
    """Whether a member restored with limits ``a`` serves a create asking for ``b``: the process
    limit is the agent's, set at claim; the rest is fixed at restore."""
    return (a.cpu_count, a.memory_mb, a.disk_mb) == (b.cpu_count, b.memory_mb, b.disk_mb)


@dataclass
class Failing:
    """A template whose last refills failed: not refilled again before ``until``."""

    build: Build | None
    failures: int
    until: float
    error: str

    @classmethod
    def after(cls, before: Failing | None, build: Build | None, error: str) -> Failing:
        failures = before.failures + 1 if before is not None and before.build == build else 1
        wait = min(RETRY_MAX_SECONDS, RETRY_FIRST_SECONDS * 2 ** (failures - 1))
        return cls(build, failures, time.monotonic() + wait, error)


@dataclass
class Plan:
    """One pass's decisions: how many members each template should have, and which to drop."""

    targets: dict[str, int] = field(default_factory=dict)
    drop: list[Member] = field(default_factory=list)
    refill: str | None = None  # the template to restore one member of now


def plan(
    pools: dict[str, list[Member]],
    sizes: dict[str, int],
    demand: dict[str, int],
    current: dict[str, Build | None],
    *,
    explicit: set[str],
    member_mb: int,
    budget_mb: int,
    pressure: bool,
    quiet: bool,
    resting: frozenset[str] = frozenset(),
) -> Plan:
    """Pure: what a pass does, from the pools, each template's size, recent demand and current build
    (a template ``resting`` after failed refills is not refilled now)."""
    out = Plan()
    for name, size in sizes.items():
        wanted = size if name in explicit else min(size, demand.get(name, 0))
        out.targets[name] = wanted if current.get(name) else 0
    kept: dict[str, list[Member]] = {}
    for name, members in pools.items():
        build = current.get(name)
        stale = [m for m in members if m.build != build]
        fresh = [m for m in members if m.build == build]
        target = out.targets.get(name, 0)
        out.drop += stale + fresh[target:]
        kept[name] = fresh[:target]
    total = sum(len(m) for m in kept.values())
    most = budget_mb // max(1, member_mb)
    while total > most or (pressure and total > 0):  # the largest pools give first
        name = max(kept, key=lambda n: len(kept[n]))
        out.drop.append(kept[name].pop())
        total -= 1
        if pressure:
            break  # one at a time under pressure: the next pass looks at the host again
    if not pressure and quiet and total < most:
        short = [
            (len(kept.get(n, [])) - t, n)
            for n, t in out.targets.items()
            if len(kept.get(n, [])) < t and n not in resting
        ]
        if short:
            out.refill = min(short)[1]
    return out


def memory_available_mb() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class WarmPools:
    def __init__(self, node: PoolHost) -> None:
        self.node = node
        self.settings = node.settings
        self.pools: dict[str, list[Member]] = {}  # template name -> idle members, oldest first
        self.firsts: dict[str, Member] = {}  # template name -> its image's first sandbox, unclaimed
        self.sizes: dict[str, int] = {}  # template name -> its size set through the API
        self._demand: dict[str, collections.deque[float]] = {}
        self._last_create = 0.0
        self._member_mb = 0  # the most one member measured (0: none measured yet)
        self._failing: dict[str, Failing] = {}  # template name -> its refills' failures, while they last
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # -- settings ---------------------------------------------------------------------------------
    async def load(self) -> None:
        raw = await self.node.store.get_meta(SIZES_KEY)
        try:
            sizes = json.loads(raw) if raw else {}
        except ValueError:
            sizes = {}
        self.sizes = {str(k): v for k, v in sizes.items() if type(v) is int and 0 <= v <= MAX_SIZE}

    def size_of(self, name: str) -> int:
        return self.sizes.get(name, self.settings.warm_pool)

    async def set_size(self, ref: str, size: int | None) -> dict[str, Any]:
        """Set a template's size (None: back to the node's default); its status."""
        rec = self.node.find_template(ref)
        if size is not None and (type(size) is not int or not 0 <= size <= MAX_SIZE):
            raise InvalidRequest(f"size must be an integer from 0 to {MAX_SIZE}")
        if size is None:
            self.sizes.pop(rec.name, None)
        else:
            self.sizes[rec.name] = size
        await self.node.store.set_meta(SIZES_KEY, json.dumps(self.sizes))
        self.wake()
        return self.status(rec.name)

    def status(self, ref: str) -> dict[str, Any]:
        rec = self.node.find_template(ref)
        demand = self._recent(rec.name)
        return {
            "templateID": rec.id,
            "name": rec.name,
            "size": self.size_of(rec.name),
            "explicit": rec.name in self.sizes,
            "target": self._targets().get(rec.name, 0),
            "ready": sum(1 for m in self.pools.get(rec.name, []) if m.build == Build.of(rec)),
            "recentCreates": demand,
            "memberMB": self._member_mb or None,
            **self._failure_of(rec.name),
        }

    def _failure_of(self, name: str) -> dict[str, Any]:
        failing = self._failing.get(name)
        if failing is None or failing.build != self._current(name):
            return {}
        retry_in = max(0.0, failing.until - time.monotonic())
        return {"failures": failing.failures, "lastError": failing.error, "retryIn": round(retry_in, 1)}

    def forget(self, rec: TemplateRecord) -> None:
        """A template record was deleted: its members go at once. Its size stays with its name (a
        rebuild deletes the old record before it adds the new one)."""
        members, build = self.pools.get(rec.name, []), Build.of(rec)  # (an evicted image made again keeps its id)
        for member in [m for m in members if m.build == build]:
            members.remove(member)
            self._drop(member, "its template was deleted")
        first = self.firsts.get(rec.name)
        if first is not None and first.build == build:
            self._drop_first(rec.name, "its template was deleted")
        self._observe()

    # -- claims -----------------------------------------------------------------------------------
    def take(self, rec: TemplateRecord, limits: Limits) -> Member | None:
        """An idle member for a create of ``rec`` with ``limits``, out of the pool; None on a miss.
        Synchronous: two creates never get one member."""
        now = time.monotonic()
        self._last_create = now
        demand = self._demand.setdefault(rec.name, collections.deque(maxlen=MAX_DEMAND_KEPT))
        demand.append(now)
        self.wake()
        build = Build.of(rec)
        first = self.firsts.get(rec.name)
        if first is not None and first.build == build and same_host_limits(first.limits, limits) and _alive(first):
            del self.firsts[rec.name]
            if first.watcher is not None:
                first.watcher.cancel()
            FIRST_SANDBOXES.labels(outcome="claimed").inc()
            return first
        if not self.size_of(rec.name):
            return None
        for member in self.pools.get(rec.name, []):
            if member.build == build and same_host_limits(member.limits, limits) and member.sb.link is not None:
                if not _alive(member):
                    continue  # died; its watcher drops it
                self.pools[rec.name].remove(member)
                if member.watcher is not None:
                    member.watcher.cancel()
                WARM_CLAIMS.labels(outcome="hit").inc()
                self._observe()
                return member
        WARM_CLAIMS.labels(outcome="miss").inc()
        return None

    def release(self, member: Member) -> None:
        """A claimed member is the claimer's sandbox now (in ``node.sandboxes``): no longer pinned here."""
        self.node.artifacts.unpin(member.held)

    # -- the refill loop --------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def wake(self) -> None:
        self._wake.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for members in self.pools.values():
            for member in members:
                self._drop(member, "the node is stopping")
        self.pools.clear()
        for name in list(self.firsts):
            self._drop_first(name, "the node is stopping")
        self._observe()

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self._pass()
            except asyncio.CancelledError:
                raise
            except Exception:  # the pool is an optimisation: a failed pass is logged and retried
                log.exception("warm pool pass failed")
                await asyncio.sleep(PASS_SECONDS)
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._sleep()):
                    await self._wake.wait()

    def _sleep(self) -> float:
        quiet_in = REFILL_QUIET_SECONDS - (time.monotonic() - self._last_create)
        return max(0.05, min(PASS_SECONDS, quiet_in)) if quiet_in > 0 else PASS_SECONDS

    async def _pass(self) -> None:
        now = time.monotonic()
        for name, first in list(self.firsts.items()):
            if first.kept_until <= now or first.build != self._current(name):
                self._drop_first(name, "no create claimed it")
        decided = plan(
            self.pools,
            self._all_sizes(),
            {name: self._recent(name) for name in self._all_sizes()},
            {name: self._current(name) for name in {*self._all_sizes(), *self.pools}},
            explicit=set(self.sizes),
            member_mb=self._member_mb or DEFAULT_MEMBER_MB,
            budget_mb=self.settings.warm_pool_memory_mb,
            pressure=self._under_pressure(),
            quiet=self._quiet(),
            resting=self._resting(),
        )
        for member in decided.drop:
            self.pools[member.sb.rec.template_id].remove(member)
            self._drop(member, "not wanted in the pool any more")
        for name in [n for n, members in self.pools.items() if not members]:
            del self.pools[name]
        self._observe()
        if decided.refill is not None:
            await self._refill(decided.refill)
            self.wake()  # look again at once: more may be short

    def _resting(self) -> frozenset[str]:
        now = time.monotonic()
        return frozenset(n for n, f in self._failing.items() if f.until > now and f.build == self._current(n))

    def _all_sizes(self) -> dict[str, int]:
        """The size of every template (explicit ones, and the node's default for the rest)."""
        names = {t.name for t in self.node.templates.values()} | set(self.sizes)
        return {n: s for n in names if (s := self.size_of(n)) > 0}

    def _targets(self) -> dict[str, int]:
        sizes = self._all_sizes()
        current = {n: self._current(n) for n in sizes}
        demand = {n: self._recent(n) for n in sizes}
        return plan(
            {}, sizes, demand, current, explicit=set(self.sizes), member_mb=1, budget_mb=0, pressure=False, quiet=False
        ).targets

    def _current(self, name: str) -> Build | None:
        try:
            rec = self.node.find_template(name)
        except TemplateNotFound:
            return None
        return Build.of(rec) if rec.name == name and rec.image else None

    def _recent(self, name: str) -> int:
        demand = self._demand.get(name)
        if not demand:
            return 0
        since = time.monotonic() - self.settings.warm_pool_window
        while demand and demand[0] < since:
            demand.popleft()
        return len(demand)

    def _quiet(self) -> bool:
        if time.monotonic() - self._last_create < REFILL_QUIET_SECONDS:
            return False
        return not any(sb.lock.locked() for sb in self.node.sandboxes.values())

    def _under_pressure(self) -> bool:
        available = memory_available_mb()
        return available is not None and available < self.settings.warm_pool_min_free_mb

    async def _refill(self, name: str) -> None:
        try:
            member = await self._make(self.node.find_template(name))
        except AenvError as exc:
            failing = self._failing[name] = Failing.after(self._failing.get(name), self._current(name), exc.message)
            log.warning(
                "warm pool of %s: could not restore a member (%d in a row; next try in %.0f s): %s",
                name,
                failing.failures,
                failing.until - time.monotonic(),
                exc.message,
            )
            return
        self._failing.pop(name, None)
        if member.build != self._current(name):  # rebuilt or deleted meanwhile
            self._drop(member, "its template changed")
            return
        self.pools.setdefault(name, []).append(member)
        self._observe()

    async def _make(self, rec: TemplateRecord) -> Member:
        node = self.node
        limits = node.records.limits_from(rec.limits)
        upper = await node.files.new_upper(limits.disk_mb)
        now = time.time()
        pool_rec = SandboxRecord(
            id=f"warm-{new_id(12)}",  # the pool's own name, for logs; a claim gives the sandbox its id
            template_id=rec.name,
            started_at=now,
            end_at=now,
            env_vars=dict(rec.env_vars),
            limits=dict(rec.limits),
            layers=list(rec.layers),
            upper=upper,
            user=rec.user,
            workdir=rec.workdir,
            guest=rec.guest,
            start=dict(rec.start),
        )
        sb = LiveSandbox(pool_rec)
        held = [*rec.layers, rec.image, upper]
        node.artifacts.pin(held)
        try:
            async with node.artifacts.using(rec):
                await node.instances.restore_into(
                    sb, image=rec.image, layers=list(rec.layers), upper=upper, fresh=True, hold_heap=True
                )
        except BaseException:
            node.artifacts.unpin(held)
            self._discard(sb, "its restore failed")
            raise
        assert sb.link is not None
        if sb.link.watcher is not None:  # the node's watcher would kill it by a sandbox id no one has
            sb.link.watcher.cancel()
            sb.link.watcher = None
        member = Member(sb=sb, build=Build.of(rec), limits=limits, held=held)
        member.watcher = asyncio.ensure_future(self._watch(member))
        try:
            await self._measure(member)
        except BaseException:  # cancelled (the node stops): a member no pool holds would run on
            self._drop(member, "the pool stopped while it was made")
            raise
        return member

    async def _measure(self, member: Member) -> None:
        if member.sb.instance is None:
            return
        with contextlib.suppress(OSError, AenvError):
            usage = await self.node.driver.usage(member.sb.instance)
            self._member_mb = max(self._member_mb, -(-usage.memory_bytes // 2**20))

    async def _watch(self, member: Member) -> None:
        """A member that dies while it waits (OOM, its channel broken) leaves the pool."""
        assert member.sb.link is not None
        await member.sb.link.channel.closed.wait()
        name = member.sb.rec.template_id
        if self.firsts.get(name) is member:
            log.warning("the first sandbox of image template %s stopped on its own", name)
            self._drop_first(name, "it stopped")
            return
        members = self.pools.get(name, [])
        if member in members:
            members.remove(member)
            log.warning("warm pool member %s of %s stopped on its own", member.sb.id, member.sb.rec.template_id)
            self._drop(member, "it stopped")
            self._observe()

    # -- a new image's first sandbox ---------------------------------------------------------------
    async def boot_first(self, layers: list[str]) -> LiveSandbox:
        """Boot a sandbox on a new image template's ``layers`` (and a fresh upper), as a create from
        the template would get it: the node's default limits (an image template sets none) and a
        sandbox's egress, refused while no record names it. Its agent is left as a build leaves it
        (not configured: the template's snapshot must hold that agent); the claim configures it.
        Its layers and upper are pinned until it is claimed or dropped."""
        node = self.node
        limits = node.records.limits_from({})
        upper = await node.files.new_upper(limits.disk_mb)
        now = time.time()
        rec = SandboxRecord(
            id=f"first-{new_id(12)}",  # for logs only: the claim gives the sandbox its id
            template_id="",
            started_at=now,
            end_at=now,
            layers=list(layers),
            upper=upper,
        )
        sb = LiveSandbox(rec)
        held = [*layers, upper]
        node.artifacts.pin(held)
        try:
            await node.instances.boot(sb, limits)
        except BaseException:
            node.artifacts.unpin(held)
            await node.files.remove(upper)
            raise
        return sb

    async def snapshot_first(self, sb: LiveSandbox) -> tuple[str, str | None]:
        """Checkpoint a first sandbox leaving it running: (its image, the copy of its upper as a
        layer, None when the upper is empty). On failure it is still running: drop it."""
        return await self.node.instances.checkpoint_running(sb)

    def offer_first(self, sb: LiveSandbox, rec: TemplateRecord) -> None:
        """Keep the first sandbox of ``rec`` (snapshotted into it) for the next create of it."""
        sb.rec.template_id = rec.name
        member = Member(
            sb=sb,
            build=Build.of(rec),
            limits=self.node.records.limits_of(sb.rec),
            held=[*sb.rec.layers, sb.rec.upper],
            kept_until=time.monotonic() + self.settings.first_sandbox_seconds,
        )
        if rec.name in self.firsts:
            self._drop_first(rec.name, "its template was made again")
        self.firsts[rec.name] = member
        member.watcher = asyncio.ensure_future(self._watch(member))

    def drop_first(self, sb: LiveSandbox, reason: str) -> None:
        """A first sandbox whose template was not made: stopped, its upper removed."""
        self.node.artifacts.unpin([*sb.rec.layers, sb.rec.upper])
        self._discard(sb, reason)

    def _drop_first(self, name: str, reason: str) -> None:
        member = self.firsts.pop(name)
        log.info("the first sandbox of image template %s dropped: %s", name, reason)
        FIRST_SANDBOXES.labels(outcome="unclaimed").inc()
        self._drop(member, reason)

    def _drop(self, member: Member, reason: str) -> None:
        if member.watcher is not None:
            member.watcher.cancel()
        self.node.artifacts.unpin(member.held)
        self._discard(member.sb, f"warm pool member dropped: {reason}")

    def _discard(self, sb: LiveSandbox, reason: str) -> None:
        """Tear a member's instance down in the background (as a killed sandbox's), its upper after."""
        upper = sb.rec.upper

        async def release() -> None:
            await self.node.files.remove(upper)

        self.node.instances.stop_instance(sb, reason, then=release)

    def _observe(self) -> None:
        WARM_MEMBERS.clear()
        for name, members in self.pools.items():
            WARM_MEMBERS.labels(template=name).set(len(members))


def _alive(member: Member) -> bool:
    return member.sb.link is not None and not member.sb.link.channel.closed.is_set()
