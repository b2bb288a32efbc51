"""Node housekeeping: reconciling records with reality at start, garbage collection of files
nobody references, and the TTL reaper."""

from __future__ import annotations

import asyncio
import heapq
import json
import logging
import os
import time
import weakref
from collections.abc import Awaitable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from aenv.channel import StreamError
from aenv.errors import AenvError, SandboxNotFound, WrongState
from aenv.node import grace, imagecache, metrics, rollout
from aenv.node.sandbox import LiveSandbox, log_failure
from aenv.node.state import SandboxState as S
from aenv.storage.confined import remove_tree

if TYPE_CHECKING:
    from aenv.config import Settings
    from aenv.node.agentlink import AgentLink
    from aenv.node.instances import Instances
    from aenv.node.records import Records
    from aenv.node.rollout import RolloutLogs
    from aenv.node.store import SandboxRecord, SnapshotRecord, TemplateRecord
    from aenv.runtime.base import Driver
    from aenv.templates.uploads import UploadCache


class Keeper(imagecache.CacheHost, Protocol):
    """What housekeeping uses of its node: the image cache's part, and its settings, driver,
    instances and records, the uploads it collects, the rollout logs it trims, the background
    tasks it starts, and the lifecycle calls of its reaper (pause, kill)."""

    @property
    def settings(self) -> Settings: ...
    @property
    def driver(self) -> Driver: ...
    @property
    def instances(self) -> Instances: ...
    @property
    def records(self) -> Records: ...
    @property
    def uploads(self) -> UploadCache: ...
    @property
    def rollouts(self) -> RolloutLogs: ...
    @property
    def background(self) -> set[asyncio.Task[Any]]: ...
    @property
    def contained(self) -> dict[str, int]: ...
    @property
    def sandboxes(self) -> dict[str, LiveSandbox]: ...  # recover() puts back what a stop left paused
    def spawn(self, coro: Awaitable[Any]) -> None: ...
    async def pause(
        self, sandbox_id: str, *, keep_memory: bool = True, settle_streams: bool = False
    ) -> SandboxRecord: ...
    async def kill(self, sandbox_id: str) -> None: ...


log = logging.getLogger("aenv.node")
BUILD_CACHE = "build-cache"  # node meta written by aenv.templates.build: step key -> layer id
# Of a sandbox's host task limit: a fork bomb of 256 processes adds ~200 host tasks a second (512:
# ~600) and starves the agent of CPU for seconds. Above what 256 sleeping processes cost (~13 host
# tasks each); asking costs little anyway: the agent kills only users at their process limit.
CONTAIN_AT = 1 / 4
RECONTAIN_STEP = 1 / 16
CONTAIN_TIMEOUT = 30.0


async def recover(node: Keeper) -> None:
    """Reconcile records with reality after a restart: nothing that was running survives a
    node restart (its channel pipes died with the old process), paused sandboxes do: with their
    checkpoint image, or without one when paused without memory (they boot fresh)."""
    for rec in await node.store.sandboxes():
        kept = rec.filesystem_only or (rec.image and node.files.image(rec.image).exists())
        if rec.state in (S.PAUSED, S.RESUMING) and kept:
            sb = LiveSandbox(rec)
            if rec.state != S.PAUSED:  # a resume the stop interrupted: its image is still there
                await node.records.set_state(sb, S.PAUSED, persist=False)
            rec.instance_id = ""
            await node.store.put_sandbox(rec)
            node.sandboxes[rec.id] = sb
        else:
            log.warning("sandbox %s was %s when the node stopped; removing it", rec.id, rec.state.value)
            node.files.remove_image(rec.image)
            await node.store.delete_sandbox(rec.id)
    node.rollouts.sweep([*node.sandboxes, *(rollout.snapshot_key(s) for s in node.snapshots)])
    removed = await node.driver.cleanup_orphans(keep=set())
    if removed:
        log.info("removed %d orphaned instances", len(removed))
    await asyncio.to_thread(sweep_scratch, node)
    await gc_files(node)
    await node.files.secure_mounts()  # what stayed mounted: mount() leaves a mounted layer alone
    uppers = {sb.rec.upper for sb in node.sandboxes.values()}
    for layer_id in referenced_layers(node):
        await node.files.mount(layer_id, writable=layer_id in uppers)


def sweep_scratch(node: Keeper) -> None:
    """Remove what pulls, builds and uploads that a stop interrupted left behind."""
    for entry in os.scandir(node.files.tmp):
        if entry.is_dir(follow_symlinks=False):
            remove_tree(Path(entry.path), ignore_errors=True)
        else:
            os.unlink(entry.path)
    node.uploads.sweep()


def referenced_layers(node: Keeper) -> set[str]:
    """Layers any record needs, uppers included."""
    refs = sandbox_layers(node)
    for t in node.templates.values():
        refs.update(t.layers)
    for s in node.snapshots.values():
        refs.update(s.layers)
    return refs


def sandbox_layers(node: Keeper) -> set[str]:
    refs: set[str] = set()
    for sb in node.sandboxes.values():
        refs.update(sb.rec.layers)
        refs.add(sb.rec.upper)
    return refs


async def gc_files(node: Keeper, min_age: float = 0.0) -> None:
    """Remove layers, uppers and images that no record names (and older than ``min_age``,
    so that an operation still building them is never raced), then keep the cache in budget and
    remove E2B uploads unused for their TTL. One pass at a time (the reaper's, a delete's, an
    image build's): two would evict against the same total."""
    lock = _GC_LOCKS.get(node)
    if lock is None:
        lock = _GC_LOCKS[node] = asyncio.Lock()
    async with lock:
        await _gc_files(node, min_age)


_GC_LOCKS: weakref.WeakKeyDictionary[Any, asyncio.Lock] = weakref.WeakKeyDictionary()


async def _gc_files(node: Keeper, min_age: float) -> None:
    now = time.time()

    def old(path: Path) -> bool:
        try:
            return now - path.stat().st_mtime >= min_age
        except OSError:
            return False

    busy = busy_now(node)
    build_cache = json.loads(await node.store.get_meta(BUILD_CACHE) or "{}")
    present = node.files.layer_ids()
    for layer_id in present - referenced_layers(node) - busy - cached_layers(present, build_cache):
        if old(node.files.layers / layer_id):
            await node.files.remove(layer_id)
    records: list[SandboxRecord | TemplateRecord | SnapshotRecord] = [sb.rec for sb in node.sandboxes.values()]
    records += [*node.templates.values(), *node.snapshots.values()]
    for image_id in node.files.image_ids() - {r.image for r in records} - busy:
        if old(node.files.image(image_id)):
            node.files.remove_image(image_id)
    # Fresh boots use the current bundle; anything else only while a record names it.
    for key in node.driver.guest_keys() - {node.driver.guest_key()} - {r.guest for r in records}:
        if old(node.driver.guest_path(key)):
            await asyncio.to_thread(node.driver.remove_guest, key)
    cache, in_use = cache_items(node, build_cache)
    await evict_cache(node, cache, in_use, build_cache)
    await imagecache.observe(node)
    node.uploads.collect()


def cache_items(node: Keeper, build_cache: dict[str, str]) -> tuple[list[tuple[str, str]], set[str]]:
    """What the local cache holds, as (kind, id), and the ids it must not evict now.

    The cache is pulled image layers, Dockerfile step layers, the layers and images that only
    committed records name (the repository gives those back on demand), and on a node without a
    repository the image templates creates made, each whole ("template": aenv/node/imagecache.py)."""
    present = node.files.layer_ids()
    backed_layers, backed_images = node.artifacts.evictable()
    busy = busy_now(node)
    in_use = (referenced_layers(node) - backed_layers) | busy
    cache = [("layer", x) for x in (cached_layers(present, build_cache) | backed_layers) & present]
    cache += [("image", x) for x in backed_images & node.files.image_ids()]
    made_from = imagecache.sources(node)
    for t in node.templates.values():
        if node.artifacts.repo is None and imagecache.is_image_template(t):
            cache.append(("template", t.id))
            if imagecache.in_use(node, t, busy, made_from):
                in_use.add(t.id)
    return cache, in_use


def cached_layers(present: set[str], build_cache: dict[str, str]) -> set[str]:
    """Layers kept for reuse though no record names them: pulled ones and Dockerfile steps'."""
    return {x for x in present if x.startswith("oci-")} | {v for v in build_cache.values() if v}


def busy_now(node: Keeper) -> set[str]:
    """Ids in use this moment: sandboxes' layers, uppers being torn down, pins, and uppers live
    (a build step's, however long it runs)."""
    return sandbox_layers(node) | node.instances.pending_layers | set(node.artifacts.pins) | node.files.live


def _size(node: Keeper, item: tuple[str, str]) -> int:
    kind, item_id = item
    if kind == "template":
        rec = node.templates.get(item_id)
        return imagecache.unit_size(node, rec) if rec is not None else 0
    return node.files.sealed_size(item_id) if kind == "layer" else node.files.image_size(item_id)


async def cache_bytes(node: Keeper) -> int:
    build_cache = json.loads(await node.store.get_meta(BUILD_CACHE) or "{}")
    cache, _ = cache_items(node, build_cache)
    return sum([await asyncio.to_thread(_size, node, item) for item in cache])


async def evict_cache(
    node: Keeper, cache: list[tuple[str, str]], in_use: set[str], build_cache: dict[str, str]
) -> None:
    """Keep the node-local cache within its budget.

    The cache is pulled image layers, Dockerfile step layers, the layers and images of
    committed templates and snapshots, and (no repository) image templates whole. Over the high
    watermark, unused entries go, least recently used first, until the cache is under the low
    one. Nothing a sandbox, a restore or a build in progress, or an uncommitted record needs is
    ever evicted (it still counts); a pulled layer an evicted image template held joins the
    candidates once no other record names it."""
    files = node.files
    high = node.settings.layer_cache_mb * 2**20
    low = high * node.settings.layer_cache_low_ratio

    def last_used(item: tuple[str, str]) -> float:
        kind, item_id = item
        if kind == "template":
            rec = node.templates.get(item_id)
            return imagecache.last_used(node, rec) if rec is not None else 0.0
        return files.last_used(item_id) if kind == "layer" else files.image_last_used(item_id)

    sizes = {item: await asyncio.to_thread(_size, node, item) for item in cache}
    total = sum(sizes.values())
    metrics.LAYER_CACHE.set(total)
    if total <= high:
        return
    whole = imagecache.plan(node, busy_now(node))
    candidates = [
        (last_used(i), i) for i in cache if i[1] not in in_use and (i[0] != "template" or i[1] in whole.templates)
    ]
    heapq.heapify(candidates)
    while candidates and total > low:
        _, item = heapq.heappop(candidates)
        kind, item_id = item
        # Looked at again right before it goes (the awaits above let restores start), and taken
        # out of use with one rename before the next await: a restore either pinned it first or
        # finds it missing and fetches it again.
        busy = busy_now(node)
        if item_id in busy:
            continue
        if kind == "template":
            rec = whole.templates[item_id]
            if not await imagecache.evict(node, rec, busy):
                continue
            for layer_id in rec.image_layers.keys() & set(rec.layers):
                whole.held[layer_id] -= 1
                freed = ("layer", layer_id)
                if whole.held[layer_id] <= 0 and layer_id not in whole.kept and freed in sizes:
                    heapq.heappush(candidates, (last_used(freed), freed))
        elif kind == "layer":
            token = files.evicting(item_id)
            await files.finish_eviction(item_id, token)
        else:
            await files.finish_image_eviction(files.evict_image(item_id))
        total -= sizes[item]
        log.info("cache over budget: evicted %s %s (%d MiB)", kind, item_id, sizes[item] >> 20)
        for key in [k for k, v in build_cache.items() if v == item_id]:
            del build_cache[key]
    metrics.LAYER_CACHE.set(total)
    await node.store.set_meta(BUILD_CACHE, json.dumps(build_cache))
    await imagecache.evicted_images(node).save()


async def reap_forever(node: Keeper) -> None:
    """Containment of runaways, file collection and commit retries (expiry has its own loop)."""
    last_gc = last_repo_gc = time.monotonic()
    while True:
        await asyncio.sleep(node.settings.reaper_interval)
        try:
            await contain_runaways(node)
            if time.monotonic() - last_gc > 60:
                last_gc = time.monotonic()
                await gc_files(node, min_age=120)
                node.artifacts.commit_pending()  # retries commits that failed (e.g. S3 was down)
            interval = node.settings.repo_gc_interval
            if interval and time.monotonic() - last_repo_gc > interval:
                last_repo_gc = time.monotonic()
                node.spawn(node.artifacts.gc_repository())
        except Exception:
            log.exception("reaper pass failed")


async def contain_runaways(node: Keeper) -> None:
    """Ask the agent of each sandbox near its host task limit to stop the users that hold their
    process limit (a fork bomb; see aenv/guest/runaway.py): hitting the limit would stop the
    sandbox as a whole."""
    live = {sb.instance.id for sb in node.sandboxes.values() if sb.instance is not None}
    for instance_id in set(node.contained) - live:
        del node.contained[instance_id]
    for sb in list(node.sandboxes.values()):
        instance, link = sb.instance, sb.link
        if sb.state != S.RUNNING or instance is None or link is None or sb.lock.locked():
            continue
        if node.driver.dozing(instance):
            continue  # frozen: it cannot fork
        pids, pids_limit = await node.driver.host_tasks(instance)
        # Host tasks do not go down when the bomb is gone (runsc keeps the stubs until a restore):
        # asked again only once they grew on.
        since = node.contained.get(instance.id, 0) + pids_limit * RECONTAIN_STEP
        if pids_limit and pids > max(pids_limit * CONTAIN_AT, since):
            node.contained[instance.id] = pids
            task = asyncio.ensure_future(_contain(sb.id, link, pids, pids_limit))
            node.background.add(task)
            task.add_done_callback(log_failure(sb.id, node.background))


async def _contain(sandbox_id: str, link: AgentLink, pids: int, limit: int) -> None:
    try:
        answer = await asyncio.wait_for(link.call("sys.contain"), CONTAIN_TIMEOUT)
    except (AenvError, StreamError, TimeoutError) as exc:
        log.warning("sandbox %s is at %d of %d host tasks and could not be contained: %s", sandbox_id, pids, limit, exc)
        return
    who = _killed(answer)
    if who:
        log.warning(
            "sandbox %s had %d of %d host tasks: killed %s (at its process limit)", sandbox_id, pids, limit, who
        )


def _killed(answer: Any) -> str:
    """Whom the agent says it killed, where it says so in numbers (uid -> count), a few at most:
    the answer of an agent that sandbox root controls goes into the node's log."""
    killed = answer.get("killed") if isinstance(answer, dict) else None
    if not isinstance(killed, dict):
        return ""
    shown = [
        f"{n} processes of uid {uid}"
        for uid, n in killed.items()
        if uid.isascii() and uid.isdecimal() and len(uid) <= 10 and type(n) is int and 0 < n < 2**31
    ]
    return ", ".join(shown[:8])


async def _expire(node: Keeper, sandbox_id: str, *, pause: bool, keep_memory: bool) -> None:
    if pause:
        try:
            await node.pause(sandbox_id, keep_memory=keep_memory)
            return
        except (SandboxNotFound, WrongState):
            return  # killed or paused meanwhile: nothing left to expire
        except AenvError as exc:
            # It cannot be paused (a socket the runtime cannot save, a wedged agent); a timeout
            # must still end it, as without autoPause.
            log.warning("sandbox %s timed out and cannot be paused (%s): killing it", sandbox_id, exc)
    expired = node.sandboxes.get(sandbox_id)
    if expired is not None:
        expired.kill_reason = "timeout"
    await node.kill(sandbox_id)


# States a timeout kill overtakes: the operation in flight would only bring the sandbox back running.
KILLED_AT_TIMEOUT = frozenset({S.RUNNING, S.SNAPSHOTTING, S.FORKING})
# The shortest timeout a sandbox can have (seconds): waking at least this often, the expiry loop
# sees every new endAt before it comes and sleeps until it exactly.
MIN_TIMEOUT = 1.0
# How soon a sandbox past its endAt is looked at again while an operation in flight holds it.
EXPIRY_RECHECK = 0.1


async def expire_forever(node: Keeper) -> None:
    """Pause or kill each sandbox at its endAt, within milliseconds: E2B's clients expect an
    auto-paused sandbox to read paused a second or two after its timeout. This loop sleeps until
    the next deadline and does nothing else, so no slow housekeeping pass delays an expiry."""
    expiring: set[str] = set()
    while True:
        try:
            wait = expire_due(node, expiring)
        except Exception:
            log.exception("expiry pass failed")
            wait = MIN_TIMEOUT
        await asyncio.sleep(wait)


def expire_due(node: Keeper, expiring: set[str]) -> float:
    """Start the expiry of every sandbox past its endAt that can be expired now; returns how long
    to sleep before the next look."""
    now = time.time()
    wait = min(node.settings.reaper_interval, MIN_TIMEOUT)
    for sb in list(node.sandboxes.values()):
        if sb.killer is not None or sb.state in (S.PAUSED, S.KILLING, S.KILLED) or sb.id in expiring:
            continue  # paused sandboxes never expire
        left = sb.rec.end_at - now
        if left > 0:
            wait = min(wait, left)
            continue
        if grace.in_grace(sb.rec, now):  # held for scoring until its grace period ends
            wait = min(wait, grace.end_of(sb.rec) - now)
            if sb.grace_of != sb.rec.end_at:
                if sb.state != S.RUNNING or sb.lock.locked():
                    wait = min(wait, EXPIRY_RECHECK)  # its commands stop once the operation is over
                    continue
                sb.grace_of = sb.rec.end_at
                task = asyncio.ensure_future(grace.begin(sb))
                node.background.add(task)
                task.add_done_callback(log_failure(sb.id, node.background))
            continue
        if sb.rec.auto_pause and (sb.state != S.RUNNING or sb.lock.locked()):
            wait = min(wait, EXPIRY_RECHECK)  # paused once the operation in flight is over
            continue
        if not sb.rec.auto_pause and sb.state not in KILLED_AT_TIMEOUT:
            wait = min(wait, EXPIRY_RECHECK)
            continue
        log.info("sandbox %s timed out: %s", sb.id, "pausing" if sb.rec.auto_pause else "killing")
        sb.events.note(f"timed out: {'pausing' if sb.rec.auto_pause else 'killing'} it")
        expiring.add(sb.id)
        task = asyncio.ensure_future(
            _expire(node, sb.id, pause=sb.rec.auto_pause, keep_memory=sb.rec.auto_pause_memory)
        )
        node.background.add(task)
        task.add_done_callback(log_failure(sb.id, node.background))

        def expired(_: asyncio.Task[None], sandbox_id: str = sb.id) -> None:
            expiring.discard(sandbox_id)

        task.add_done_callback(expired)
    return max(wait, 0.0)
