"""Node housekeeping: reconciling records with reality at start, garbage collection of files
nobody references, and the TTL reaper."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from aenv.errors import CheckpointRefused
from aenv.node import metrics
from aenv.node.sandbox import LiveSandbox, log_failure
from aenv.node.state import SandboxState as S

if TYPE_CHECKING:
    from aenv.node.orchestrator import Node

log = logging.getLogger("aenv.node")
BUILD_CACHE = "build-cache"  # node meta written by aenv.templates.build: step key -> layer id


async def recover(node: Node) -> None:
    """Reconcile records with reality after a restart: nothing that was running survives a
    node restart (its channel pipes died with the old process), paused sandboxes do."""
    for rec in await node.store.sandboxes():
        if rec.state in (S.PAUSED, S.RESUMING) and rec.image and node.files.image(rec.image).exists():
            rec.state = S.PAUSED
            rec.instance_id = ""
            await node.store.put_sandbox(rec)
            node.sandboxes[rec.id] = LiveSandbox(rec)
        else:
            log.warning("sandbox %s was %s when the node stopped; removing it", rec.id, rec.state.value)
            node.files.remove_image(rec.image)
            await node.store.delete_sandbox(rec.id)
    removed = await node.driver.cleanup_orphans(keep=set())
    if removed:
        log.info("removed %d orphaned instances", len(removed))
    await gc_files(node)
    uppers = {sb.rec.upper for sb in node.sandboxes.values()}
    for layer_id in referenced_layers(node):
        await node.files.mount(layer_id, writable=layer_id in uppers)


def referenced_layers(node: Node) -> set[str]:
    """Layers any record needs, uppers included."""
    refs: set[str] = set()
    for sb in node.sandboxes.values():
        refs.update(sb.rec.layers)
        refs.add(sb.rec.upper)
    for t in node.templates.values():
        refs.update(t.layers)
    for s in node.snapshots.values():
        refs.update(s.layers)
    return refs


async def gc_files(node: Node, min_age: float = 0.0) -> None:
    """Remove layers, uppers and images that no record names (and older than ``min_age``,
    so that an operation still building them is never raced)."""
    now = time.time()

    def old(path: Path) -> bool:
        try:
            return now - path.stat().st_mtime >= min_age
        except OSError:
            return False

    in_use = referenced_layers(node) | node._pending_layers
    build_cache = json.loads(await node.store.get_meta(BUILD_CACHE) or "{}")
    present = node.files.layer_ids()
    cacheable = {x for x in present if x.startswith("oci-")} | {v for v in build_cache.values() if v}
    for layer_id in present - in_use - cacheable:
        if old(node.files.layers / layer_id):
            await node.files.remove(layer_id)
    await evict_cache(node, cacheable, in_use, build_cache)
    images = {sb.rec.image for sb in node.sandboxes.values()} | {t.image for t in node.templates.values()}
    images |= {s.image for s in node.snapshots.values()}
    for image_id in node.files.image_ids() - images:
        if old(node.files.image(image_id)):
            node.files.remove_image(image_id)


async def evict_cache(node: Node, cacheable: set[str], in_use: set[str], build_cache: dict[str, str]) -> None:
    """Keep pulled image layers and Dockerfile step layers within the cache budget.

    Over the high watermark, unused cached layers go, least recently used first, until the
    cache is under the low one. Layers a template, snapshot or sandbox names are never evicted
    (they still count toward the budget)."""
    high = node.settings.layer_cache_mb * 2**20
    low = high * node.settings.layer_cache_low_ratio
    sizes = {x: await asyncio.to_thread(node.files.sealed_size, x) for x in cacheable}
    total = sum(sizes.values())
    metrics.LAYER_CACHE.set(total)
    if total <= high:
        return
    for layer_id in sorted(cacheable - in_use, key=node.files.last_used):
        if total <= low:
            break
        await node.files.remove(layer_id)
        total -= sizes[layer_id]
        log.info("layer cache over budget: evicted %s (%d MiB)", layer_id, sizes[layer_id] >> 20)
        for key in [k for k, v in build_cache.items() if v == layer_id]:
            del build_cache[key]
    metrics.LAYER_CACHE.set(total)
    await node.store.set_meta(BUILD_CACHE, json.dumps(build_cache))


async def reap_forever(node: Node) -> None:
    last_gc = time.monotonic()
    while True:
        await asyncio.sleep(node.settings.reaper_interval)
        try:
            await reap_once(node)
            if time.monotonic() - last_gc > 60:
                last_gc = time.monotonic()
                await gc_files(node, min_age=120)
        except Exception:
            log.exception("reaper pass failed")


async def _expire(node: Node, sandbox_id: str, *, pause: bool) -> None:
    if pause:
        try:
            await node.pause(sandbox_id)
            return
        except CheckpointRefused as exc:
            # It cannot be paused as it is; a timeout must still end it, as without autoPause.
            log.warning("sandbox %s timed out and cannot be paused (%s): killing it", sandbox_id, exc)
    await node.kill(sandbox_id)


async def reap_once(node: Node) -> None:
    now = time.time()
    for sb in list(node.sandboxes.values()):
        if sb.state != S.RUNNING or sb.rec.end_at > now or sb.lock.locked():
            continue
        log.info("sandbox %s timed out: %s", sb.id, "pausing" if sb.rec.auto_pause else "killing")
        task = asyncio.ensure_future(_expire(node, sb.id, pause=sb.rec.auto_pause))
        node._background.add(task)
        task.add_done_callback(log_failure(sb.id, node._background))
