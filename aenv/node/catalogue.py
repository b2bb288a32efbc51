"""The node's catalogue: its template and snapshot records, by id, and how a name finds one.

It owns the two tables (the node and its artifact cache change them through it; everyone else sees
read-only views) and keeps the store in step with every change it makes. What a record's files are
and where they come from is the artifact cache's business (aenv/node/artifacts.py).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from types import MappingProxyType

from aenv.errors import SnapshotNotFound, TemplateNotFound
from aenv.node.store import SnapshotRecord, Store, TemplateRecord


def lookup_keys(ref: str) -> tuple[str, ...]:
    """What a template or image named ``ref`` is looked up by. Names are stored lowercased (an
    E2B build's "My-Env" is "my-env") and found so as E2B finds them: by the name as the client
    spelled it too. A tag only as written (``app:V1`` is another image than ``app:v1``), and an
    image reference with a registry, a path or a digest only as written."""
    if "/" in ref or "@" in ref:
        return (ref,)
    name, colon, tag = ref.partition(":")
    return tuple(dict.fromkeys((ref, f"{name.lower()}{colon}{tag}")))


def _is_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return len(text) == 36


class Catalogue:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.templates: dict[str, TemplateRecord] = {}
        self.snapshots: dict[str, SnapshotRecord] = {}
        self.templates_view: Mapping[str, TemplateRecord] = MappingProxyType(self.templates)
        self.snapshots_view: Mapping[str, SnapshotRecord] = MappingProxyType(self.snapshots)

    async def load(self) -> None:
        """The records the store holds (at the node's start)."""
        self.templates.clear()
        self.templates.update((t.id, t) for t in await self.store.templates())
        self.snapshots.clear()
        self.snapshots.update((s.id, s) for s in await self.store.snapshots())

    def find_template(self, ref: str) -> TemplateRecord:
        for key in lookup_keys(ref):
            for t in self.templates.values():
                if key in (t.id, t.name) or key in t.aliases:
                    return t
        found = self._by_build(ref)
        if found is not None:
            return found
        raise TemplateNotFound(f"template '{ref}' not found")

    def _by_build(self, ref: str) -> TemplateRecord | None:
        """``name:<build id>`` (E2B's reference to one build, as Harbor creates by): the build of that
        name, an older one included while it is kept; never another template's, never the newest
        in its place."""
        name, _, build = ref.partition(":")
        if not build or "/" in ref or "@" in ref or not _is_uuid(build):
            return None
        names = set(lookup_keys(name))
        for t in self.templates.values():
            family = {t.id, t.name, *(a.partition(":")[0] for a in t.aliases)}
            if names & family and t.made_by(build.lower()):
                return t
        return None

    def find_snapshot(self, ref: str) -> SnapshotRecord:
        for s in self.snapshots.values():
            if ref in (s.id, s.name) and not s.ephemeral:
                return s
        raise SnapshotNotFound(f"snapshot '{ref}' not found")

    def source(self, ref: str) -> TemplateRecord | SnapshotRecord | None:
        """The template, else the snapshot, that ``ref`` names."""
        try:
            return self.find_template(ref)
        except TemplateNotFound:
            try:
                return self.find_snapshot(ref)
            except SnapshotNotFound:
                return None

    def snapshot_named(self, name: str) -> bool:
        return any(s.name == name for s in self.snapshots.values())

    async def put_template(self, rec: TemplateRecord) -> None:
        self.templates[rec.id] = rec
        await self.store.put_template(rec)

    async def remove_template(self, rec: TemplateRecord) -> None:
        if self.templates.get(rec.id, rec) is not rec:
            return  # its id names another record now: an evicted image's template made again
        self.templates.pop(rec.id, None)
        await self.store.delete_template(rec.id)

    async def put_snapshot(self, rec: SnapshotRecord) -> None:
        self.snapshots[rec.id] = rec
        await self.store.put_snapshot(rec)

    async def remove_snapshot(self, rec: SnapshotRecord) -> None:
        self.snapshots.pop(rec.id, None)
        await self.store.delete_snapshot(rec.id)
