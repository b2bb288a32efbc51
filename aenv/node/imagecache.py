"""Images as templates, kept as a cache: a disk budget across thousands of images.

A create that names an image makes a template named by the image's manifest digest
(``sha256-<hex>``, aenv/templates/image_sources.py). Such a template is a cache of the image:

- With a snapshot repository it is committed like any template, and its layers and checkpoint
  image leave the node's disk one by one, least recently used first, when the node's cache is over
  ``AENV_LAYER_CACHE_MB`` (housekeeping.evict_cache); the next create fetches them back.
- Without one, the cache evicts such a template **whole**: least recently used first (its last
  restore), never one in use (a sandbox or snapshot made from it, a restore or build pinning it, a
  warm pool size set for it). Its record leaves the catalogue, its checkpoint image and its own
  layers (the conventions layer, the sealed build upper) are removed at once, and its pulled layers
  become plain cached layers, evicted in turn by their own last use unless another image still
  uses them (a shared base stays while any image on it is kept). The node remembers what it
  evicted (:class:`Evicted`: id, name, references, digest, sizes): the next create naming it by any
  of them pulls it again, by digest, and commits it under the same template id.

Templates named by a person (``aenv build --image REF --name N``) are never evicted whole.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import weakref
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from aenv.node import metrics
from aenv.node.catalogue import lookup_keys
from aenv.node.store import TemplateRecord, well_typed

if TYPE_CHECKING:
    from aenv.node.artifacts import ArtifactCache
    from aenv.node.catalogue import Catalogue
    from aenv.node.sandbox import LiveSandbox
    from aenv.node.store import SnapshotRecord, Store
    from aenv.node.warmpool import WarmPools
    from aenv.storage.layers import LayerStore


class StoreHost(Protocol):
    @property
    def store(self) -> Store: ...


class CacheHost(Protocol):
    """What the image cache uses of its node: its records, the files and catalogue entries it
    evicts, the warm pools' sizes (a pool's template is in use), and its store."""

    @property
    def templates(self) -> Mapping[str, TemplateRecord]: ...
    @property
    def snapshots(self) -> Mapping[str, SnapshotRecord]: ...
    @property
    def sandboxes(self) -> Mapping[str, LiveSandbox]: ...
    @property
    def warm(self) -> WarmPools: ...
    @property
    def files(self) -> LayerStore: ...
    @property
    def catalogue(self) -> Catalogue: ...
    @property
    def store(self) -> Store: ...
    @property
    def artifacts(self) -> ArtifactCache: ...
    async def drop_template(self, rec: TemplateRecord) -> None: ...


log = logging.getLogger("aenv.images")
EVICTED_KEY = "evicted-images"  # the store's meta key: {digest: Evicted}
EVICTED_KEPT = 10_000  # evicted images remembered (the oldest evictions forgotten first)


def digest_name(digest: str) -> str:
    """The name of the template made from the manifest ``digest``: ``sha256-<hex>``."""
    return digest.replace(":", "-", 1)


def is_image_template(rec: TemplateRecord) -> bool:
    """Made by a create from an image reference (named by its digest), not by a person."""
    return bool(rec.image_digest) and rec.name == digest_name(rec.image_digest)


def own_items(rec: TemplateRecord) -> list[str]:
    """What only this template holds: its layers that are not pulled ones, and its image."""
    return [x for x in rec.layers if x not in rec.image_layers] + [rec.image]


@dataclass
class Evicted:
    """An image template this node evicted whole, as the next create needs it to make it again."""

    id: str
    name: str
    digest: str
    reference: str  # canonical, as pulled
    aliases: list[str] = field(default_factory=list)
    layers: dict[str, int] = field(default_factory=dict)  # pulled layer id -> compressed bytes
    created_at: float = 0.0
    last_used: float = 0.0
    evicted_at: float = 0.0

    @classmethod
    def of(cls, rec: TemplateRecord, last_used: float) -> Evicted:
        return cls(
            id=rec.id,
            name=rec.name,
            digest=rec.image_digest,
            reference=rec.image_ref,
            aliases=list(rec.aliases),
            layers=dict(rec.image_layers),
            created_at=rec.created_at,
            last_used=last_used,
            evicted_at=time.time(),
        )

    def names(self) -> set[str]:
        return {self.id, self.name, self.digest, self.reference, *self.aliases}


class EvictedImages:
    """The images a node evicted whole, by digest; kept in the store's meta (read once)."""

    def __init__(self, node: StoreHost) -> None:
        self.node = node
        self.by_digest: dict[str, Evicted] | None = None
        self.lock = asyncio.Lock()
        self.dirty = False  # changed since last written

    async def entries(self) -> dict[str, Evicted]:
        if self.by_digest is None:
            async with self.lock:
                if self.by_digest is None:
                    self.by_digest = _parse(await self.node.store.get_meta(EVICTED_KEY))
        return self.by_digest

    async def find(self, ref: str) -> Evicted | None:
        """The evicted image ``ref`` names: its template's id or name, its digest, a reference or alias."""
        for key in lookup_keys(ref):
            for entry in (await self.entries()).values():
                if key in entry.names():
                    return entry
        return None

    async def by(self, digest: str) -> Evicted | None:
        return (await self.entries()).get(digest)

    async def remember(self, entry: Evicted, *, save: bool = True) -> None:
        """Add ``entry``; written to the store now, or with the next :meth:`save` (an eviction
        pass writes once, not once per image)."""
        entries = await self.entries()
        entries[entry.digest] = entry
        if len(entries) > EVICTED_KEPT:
            for old in sorted(entries.values(), key=lambda e: e.evicted_at)[: len(entries) - EVICTED_KEPT]:
                del entries[old.digest]
        self.dirty = True
        if save:
            await self.save()

    async def forget(self, digest: str) -> None:
        """The image is a template again (made anew), or its template was deleted."""
        entries = await self.entries()
        if entries.pop(digest, None) is not None:
            self.dirty = True
            await self.save()

    async def save(self) -> None:
        if self.by_digest is None or not self.dirty:
            return
        self.dirty = False
        body = {d: asdict(e) for d, e in self.by_digest.items()}
        await self.node.store.set_meta(EVICTED_KEY, json.dumps(body))


def _parse(raw: str | None) -> dict[str, Evicted]:
    try:
        body = json.loads(raw or "{}")
    except ValueError:
        body = {}
    out: dict[str, Evicted] = {}
    for digest, item in body.items() if isinstance(body, dict) else ():
        try:
            entry = Evicted(**{k: v for k, v in item.items() if k in Evicted.__dataclass_fields__})
        except TypeError:
            continue
        if entry.digest == digest and well_typed(entry):
            out[digest] = entry
    return out


_EVICTED: weakref.WeakKeyDictionary[Any, EvictedImages] = weakref.WeakKeyDictionary()


def evicted_images(node: StoreHost) -> EvictedImages:
    found = _EVICTED.get(node)
    if found is None:
        found = _EVICTED[node] = EvictedImages(node)
    return found


# -- what the cache may evict whole --------------------------------------------------------------------
@dataclass
class Plan:
    """The image templates the cache may evict whole now, and how their pulled layers are held."""

    templates: dict[str, TemplateRecord] = field(default_factory=dict)  # by id
    held: Counter[str] = field(default_factory=Counter)  # pulled layer -> evictable templates naming it
    kept: set[str] = field(default_factory=set)  # layers something else names: never freed by an eviction


def plan(node: CacheHost, busy: set[str]) -> Plan:
    """Image templates evictable whole (none on a node with a repository: there the files go one
    by one and come back from it), given the ids ``busy`` now (sandboxes' layers, pins)."""
    found = Plan()
    if node.artifacts.repo is None:
        made_from = sources(node)
        for t in node.templates.values():
            if is_image_template(t) and not in_use(node, t, busy, made_from):
                found.templates[t.id] = t
    for t in node.templates.values():
        if t.id in found.templates:
            found.held.update(t.image_layers.keys() & set(t.layers))
        else:
            found.kept.update(t.layers)
    for s in node.snapshots.values():
        found.kept.update(s.layers)
    found.kept |= busy
    return found


def in_use(node: CacheHost, rec: TemplateRecord, busy: set[str], made_from: set[str] | None = None) -> bool:
    """A sandbox or snapshot made from it, a restore or build pinning what only it holds, or a
    warm pool an operator set for it. ``made_from``: :func:`sources` (once for many templates)."""
    if any(x in busy for x in own_items(rec)) or node.warm.sizes.get(rec.name, 0) > 0:
        return True
    made_from = sources(node) if made_from is None else made_from
    return rec.id in made_from or rec.name in made_from


def sources(node: CacheHost) -> set[str]:
    """The templates (names or ids) the node's sandboxes and snapshots were made from."""
    return {sb.rec.template_id for sb in node.sandboxes.values()} | {s.template_id for s in node.snapshots.values()}


def unit_size(node: CacheHost, rec: TemplateRecord) -> int:
    """Bytes an eviction of ``rec`` frees at once (its image and own layers; its pulled ones are
    counted as cached layers)."""
    files = node.files
    return files.image_size(rec.image) + sum(files.sealed_size(x) for x in own_items(rec)[:-1])


def last_used(node: CacheHost, rec: TemplateRecord) -> float:
    return node.files.image_last_used(rec.image)


async def evict(node: CacheHost, rec: TemplateRecord, busy: set[str]) -> bool:
    """Evict one image template whole, unless it is in use now (looked at again here: the awaits
    before let a restore start). Out of the catalogue and its files renamed away before anything
    is awaited, so a create either pinned it first or does not find it and pulls it again."""
    evicted = evicted_images(node)
    await evicted.entries()  # read before anything goes: nothing below awaits until it is remembered
    if node.templates.get(rec.id) is not rec or in_use(node, rec, busy):
        return False
    files = node.files
    used = last_used(node, rec)
    node.catalogue.templates.pop(rec.id, None)
    # Out of the catalogue and remembered as evicted in one step: GET /images meanwhile lists it
    # one way or the other (CI saw an image in neither, between these two).
    await evicted.remember(Evicted.of(rec, used), save=False)  # written once the pass is over
    image_token = files.evict_image(rec.image)
    own = own_items(rec)[:-1]
    tokens = [(x, files.evicting(x)) for x in own]
    await node.drop_template(rec)
    await files.finish_image_eviction(image_token)
    for layer_id, token in tokens:
        await files.finish_eviction(layer_id, token)
        await files.remove(layer_id)  # its mount point and marker too
    metrics.IMAGE_EVICTIONS.inc()
    log.info("cache over budget: evicted image %s (template %s, %s)", rec.image_ref, rec.id, rec.name)
    return True


# -- what the node reports: GET /images and the metrics -------------------------------------------------
async def report(node: CacheHost, busy: set[str]) -> list[dict[str, Any]]:
    """Every image this node holds as a template or evicted, with its size against what it
    stores here; newest use first. Times are epoch seconds."""
    evicted = list((await evicted_images(node).entries()).values())
    records = [t for t in node.templates.values() if t.image_digest]
    pinned = {t.id: not is_image_template(t) or node.warm.sizes.get(t.name, 0) > 0 for t in records}
    made_from = sources(node)
    using = {t.id: in_use(node, t, busy, made_from) for t in records}
    rows = await asyncio.to_thread(_rows, node, records, evicted)
    for row in rows:
        row["pinned"] = pinned.get(row["templateID"], False)
        row["inUse"] = using.get(row["templateID"], False)
    await asyncio.to_thread(_observe, node, records, len(evicted))
    return sorted(rows, key=lambda r: r["lastUsed"], reverse=True)


def _rows(node: CacheHost, records: list[TemplateRecord], evicted: list[Evicted]) -> list[dict[str, Any]]:
    files = node.files
    present = files.layer_ids()
    images = files.image_ids()

    def layer_rows(layers: dict[str, int]) -> list[dict[str, Any]]:
        return [
            {"id": x, "sizeBytes": size, "storedBytes": files.sealed_size(x) if x in present else 0}
            for x, size in layers.items()
        ]

    rows = []
    for t in records:
        pulled = layer_rows(t.image_layers)
        own = [x for x in t.layers if x not in t.image_layers]
        local = all(x in present for x in t.layers) and t.image in images
        stored = sum(r["storedBytes"] for r in pulled) + sum(files.sealed_size(x) for x in own if x in present)
        stored += files.image_size(t.image) if t.image in images else 0
        rows.append(
            {
                **_names(t.image_ref, t.aliases, t.image_digest, t.id, t.name),
                "sizeBytes": sum(t.image_layers.values()),
                "storedBytes": stored,
                "lastUsed": files.image_last_used(t.image) or t.created_at,
                "createdAt": t.created_at,
                "state": "local" if local else "evicted",
                "committed": bool(t.committed_at),
                "layers": pulled,
            }
        )
    for e in evicted:
        pulled = layer_rows(e.layers)
        rows.append(
            {
                **_names(e.reference, e.aliases, e.digest, e.id, e.name),
                "sizeBytes": sum(e.layers.values()),
                "storedBytes": sum(r["storedBytes"] for r in pulled),
                "lastUsed": e.last_used,
                "createdAt": e.created_at,
                "state": "evicted",
                "committed": False,
                "evictedAt": e.evicted_at,
                "layers": pulled,
            }
        )
    return rows


def _names(reference: str, aliases: list[str], digest: str, template_id: str, name: str) -> dict[str, Any]:
    return {"reference": reference, "aliases": aliases, "digest": digest, "templateID": template_id, "name": name}


async def observe(node: CacheHost) -> None:
    """The image gauges of /metrics, measured off the event loop (after each cache pass)."""
    records = [t for t in node.templates.values() if t.image_digest]
    evicted = len(await evicted_images(node).entries())
    await asyncio.to_thread(_observe, node, records, evicted)


def _observe(node: CacheHost, records: list[TemplateRecord], evicted: int) -> None:
    files = node.files
    present = files.layer_ids()
    images = files.image_ids()
    local = [t for t in records if t.image in images and all(x in present for x in t.layers)]
    pulled = {x for t in local for x in t.image_layers}
    metrics.IMAGE_STORED.set(sum(files.sealed_size(x) for x in pulled))
    metrics.IMAGE_SIZES.set(sum(sum(t.image_layers.values()) for t in local))
    metrics.IMAGES.labels(state="local").set(len(local))
    metrics.IMAGES.labels(state="evicted").set(evicted + len(records) - len(local))
