"""What a template, snapshot or paused sandbox is made of, and what of it is on this node's disk.

The artifact cache's commits, fetches and catalogue sync (aenv/node/artifacts.py) all ask the same
questions: which layers, image and guest bundle a record names, which of them are here (mounted, or
only on disk), which are pinned by a restore or build in progress, and which the repository could
give back if the node's cache evicted them. They are answered here, once, with no repository access;
so are the shared names: the node as the cache sees it (``ArtifactHost``), a repository entry read
back into a record (``record_of``, which refuses artifact names that are paths) and the prefix of
artifacts still being fetched.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from aenv.node.store import SandboxRecord, SnapshotRecord, TemplateRecord, well_typed
from aenv.repo.repository import EntryKind, LocalArtifact, is_valid_id
from aenv.storage.confined import remove_tree

if TYPE_CHECKING:
    from aenv.config import Settings
    from aenv.node.catalogue import Catalogue
    from aenv.node.sandbox import LiveSandbox
    from aenv.node.store import Store
    from aenv.runtime.base import Driver
    from aenv.storage.layers import LayerStore

log = logging.getLogger("aenv.repo")
Entry = TemplateRecord | SnapshotRecord
R = TypeVar("R", TemplateRecord, SnapshotRecord, SandboxRecord)
FETCHING = ".fetch-"  # prefix of artifacts still being fetched (never booted from; removed at start)


def kind_of(rec: Entry | SandboxRecord) -> EntryKind:
    if isinstance(rec, SandboxRecord):
        return "sandbox"
    return "template" if isinstance(rec, TemplateRecord) else "snapshot"


class ArtifactHost(Protocol):
    """The node as its artifact cache sees it (``Node`` is one)."""

    @property
    def settings(self) -> Settings: ...

    @property
    def driver(self) -> Driver: ...

    @property
    def files(self) -> LayerStore: ...

    @property
    def store(self) -> Store: ...

    @property
    def catalogue(self) -> Catalogue: ...

    @property
    def templates(self) -> Mapping[str, TemplateRecord]: ...

    @property
    def snapshots(self) -> Mapping[str, SnapshotRecord]: ...

    @property
    def sandboxes(self) -> Mapping[str, LiveSandbox]: ...

    @property
    def state_listeners(self) -> list[Callable[[LiveSandbox], None]]: ...

    async def settled(self, layers: list[str]) -> None:
        """Until no instance being torn down still writes one of ``layers``."""


class LocalArtifacts:
    """A record's artifacts, their presence on this node, and the pins that keep them here."""

    def __init__(self, node: ArtifactHost, backed: bool) -> None:
        self.node = node
        self.backed = backed  # the node has a repository: committed artifacts can be fetched back
        self.pins: Counter[str] = Counter()  # layer and image ids a restore or build is using

    def entries(self) -> list[Entry]:
        """The node's templates and snapshots."""
        return [*self.node.templates.values(), *self.node.snapshots.values()]

    def guest_key(self, rec: Entry | SandboxRecord) -> str:
        return rec.guest or self.node.driver.guest_key()

    def items_of(self, rec: Entry | SandboxRecord) -> list[LocalArtifact]:
        files = self.node.files
        items = []
        # A snapshot's or paused sandbox's layers above its template's are sealed uppers: small
        # chunks in packs, the blocks one shares with the upper before it stored once.
        below: set[str] = set()
        if not isinstance(rec, TemplateRecord):  # its template_id is the template's name (or id)
            named = [t for t in self.node.templates.values() if rec.template_id in (t.id, t.name)]
            below = {x for t in named for x in t.layers}
        for layer_id in rec.layers:
            img = files.layers / f"{layer_id}.img"
            if img.exists():
                upper = not isinstance(rec, TemplateRecord) and layer_id not in below
                items.append(LocalArtifact("layer", layer_id, img, "sparse", packed=upper))
            else:
                items.append(LocalArtifact("layer", layer_id, files.layers / layer_id, "tar"))
        items.append(LocalArtifact("image", rec.image, files.image(rec.image), "tar"))
        key = self.guest_key(rec)
        items.append(LocalArtifact("guest", key, self.node.driver.guest_path(key), "tar"))
        return items

    def held(self, limit: int, longest: int) -> list[str]:
        """The names (id, name, aliases) by which a create may name the newest templates and
        snapshots whose every layer, image and guest is on this node's disk: at most ``limit``
        names of at most ``longest`` characters, after looking at no more than 4 x ``limit``
        records (each costs a few stats)."""
        records: list[Entry] = self.entries()
        records.sort(key=lambda r: r.created_at, reverse=True)
        names: list[str] = []
        for rec in records[: 4 * limit]:
            if isinstance(rec, SnapshotRecord) and rec.ephemeral:
                continue  # a fork's, gone once its children are up
            if not all(self.is_present(item.kind, item.id) for item in self.items_of(rec)):
                continue
            aliases = rec.aliases if isinstance(rec, TemplateRecord) else []
            for name in dict.fromkeys([rec.id, rec.name, *aliases]):
                if name and len(name) <= longest and len(names) < limit:
                    names.append(name)
        return names

    def is_present(self, kind: str, artifact_id: str) -> bool:
        """On this node's disk (an image layer maybe not mounted yet, as at start)."""
        if kind == "layer":
            files = self.node.files
            return (files.layers / f"{artifact_id}.img").exists() or files.is_local(artifact_id)
        return self.is_local(kind, artifact_id)

    def is_local(self, kind: str, artifact_id: str) -> bool:
        """Usable by a restore right now."""
        files = self.node.files
        if kind == "layer":
            return files.is_local(artifact_id)
        if kind == "image":
            return files.image(artifact_id).is_dir()
        return (self.node.driver.guest_path(artifact_id) / ".complete").exists()

    def is_cached(self, rec: Entry) -> bool:
        """Every artifact of ``rec`` is here: a restore from it fetches nothing."""
        return all(self.is_local(item.kind, item.id) for item in self.items_of(rec))

    def owner_of(self, layer_id: str) -> Entry | None:
        """A committed record naming ``layer_id``: what a fetch of the layer goes through."""
        for rec in self.entries():
            if rec.committed_at and layer_id in rec.layers:
                return rec
        return None

    def layer_available(self, layer_id: str) -> bool:
        """On this node's disk, or fetchable through a committed record that names it: what a build
        cache hit needs (a layer the cache evicted that no record names is built again)."""
        return bool(layer_id) and (self.is_present("layer", layer_id) or self.owner_of(layer_id) is not None)

    def pin(self, held: list[str]) -> None:
        self.pins.update(held)

    def unpin(self, held: list[str]) -> None:
        self.pins.subtract(held)
        for key in [k for k in held if self.pins[k] <= 0]:
            self.pins.pop(key, None)

    def evictable(self) -> tuple[set[str], set[str]]:
        """(layers, images) that only committed records name: the repository can give them back."""
        if not self.backed:
            return set(), set()
        layers: set[str] = set()
        images: set[str] = set()
        needed_layers: set[str] = set()
        needed_images: set[str] = set()
        for rec in self.entries():
            if rec.committed_at:
                layers.update(rec.layers)
                images.add(rec.image)
            else:
                needed_layers.update(rec.layers)
                needed_images.add(rec.image)
        return layers - needed_layers, images - needed_images

    def sweep_partial_fetches(self) -> None:
        """Remove what fetches interrupted by a stop left behind."""
        self.node.files.sweep_removals()  # first: an evicted layer's mountpoint is found by its token
        dirs = [self.node.files.layers, self.node.files.images, self.node.driver.guest_path("x").parent]
        for d in dirs:
            for p in [*d.glob(f"{FETCHING}*"), *d.glob(".evict-*")]:
                discard(p)


def record_of(cls: type[R], entry: dict[str, Any]) -> R | None:
    """The record a repository entry holds, or None (logged) if it cannot be used: malformed, or
    naming itself or its artifacts otherwise than by names. Those become paths under the data dir:
    a layer ``../../..`` would make a host directory a sandbox's layer."""
    rec: R
    try:
        rec = cls.from_json(json.dumps(entry["record"]))
        if isinstance(rec, SandboxRecord):
            rec.durable_at = float(entry["committed_at"])
        else:
            rec.committed_at, rec.commit = float(entry["committed_at"]), dict(entry.get("commit") or {})
    except (KeyError, TypeError, ValueError) as exc:
        log.error("repository entry %r is malformed (%s): not imported", entry.get("id"), exc)
        return None
    if not well_typed(rec):
        log.error("repository %s %r has fields of the wrong type: not imported", kind_of(rec), rec.id)
        return None
    ids: list[object] = [rec.id, rec.image, *([rec.guest] if rec.guest else [])]
    ids += rec.layers if isinstance(rec.layers, list) else [rec.layers]  # JSON gave it: maybe no list
    if not all(is_valid_id(x) for x in ids):
        log.error("repository %s %r names its artifacts by paths or odd names: not imported", kind_of(rec), rec.id)
        return None
    return rec


def discard(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        remove_tree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
