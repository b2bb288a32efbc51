"""The node's side of the snapshot repository: commit what it makes, fetch what it restores.

Templates and snapshots are committed in the background once made (a snapshot's sealed upper
once its old instance is gone); ``committed_at`` on the record says when that finished. Committed
data is the truth: the layers and images of committed records are only a cache here, evicted
(least recently used, never while pinned) when the node's cache is over budget, and fetched back,
every chunk verified, when a restore or build needs them. A node with an empty data dir learns
the repository's templates and snapshots at start and restores them from it.

Fetches build into a temporary name and rename into place, so a failed or interrupted fetch
leaves nothing a sandbox could boot from; a damaged artifact fails the one operation that needed
it with ``ArtifactDamaged`` and leaves every other sandbox alone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from aenv.errors import AenvError, ArtifactDamaged
from aenv.node import metrics
from aenv.node.state import SandboxState
from aenv.node.store import SandboxRecord, SnapshotRecord, TemplateRecord, well_typed
from aenv.repo.repository import ArtifactRef, EntryKind, LocalArtifact, Repository, is_valid_id
from aenv.storage.confined import remove_tree
from aenv.storage.layers import new_id
from aenv.storage.space import headroom

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


class ArtifactCache:
    def __init__(self, node: ArtifactHost, repo: Repository | None) -> None:
        self.node = node
        self.repo = repo
        self.pins: Counter[str] = Counter()  # layer and image ids a restore or build is using
        self._commits: dict[str, asyncio.Task[None]] = {}
        self._fetches: dict[str, asyncio.Future[None]] = {}
        self._slots = asyncio.Semaphore(1)  # commits compete with sandboxes for CPU: one at a time
        self._refreshed = 0.0
        self._dirty: set[str] = set()  # records changed while their commit was under way
        self._pauses: dict[str, asyncio.Task[None]] = {}  # durable pauses under way, by sandbox id
        self._uploading: set[str] = set()  # those of them past the point where a resume cancels them

    async def close(self) -> None:
        """Stop: commits under way are abandoned (nothing of them is visible) and redone at start."""
        tasks = [*self._commits.values(), *self._pauses.values()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10)
        if self.repo is not None:
            self.repo.close()

    def _entries(self) -> list[Entry]:
        """The node's templates and snapshots."""
        return [*self.node.templates.values(), *self.node.snapshots.values()]

    # -- what a record is made of -------------------------------------------------------------------
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
        records: list[Entry] = self._entries()
        records.sort(key=lambda r: r.created_at, reverse=True)
        names: list[str] = []
        for rec in records[: 4 * limit]:
            if isinstance(rec, SnapshotRecord) and rec.ephemeral:
                continue  # a fork's, gone once its children are up
            if not all(self._is_present(item.kind, item.id) for item in self.items_of(rec)):
                continue
            aliases = rec.aliases if isinstance(rec, TemplateRecord) else []
            for name in dict.fromkeys([rec.id, rec.name, *aliases]):
                if name and len(name) <= longest and len(names) < limit:
                    names.append(name)
        return names

    def _is_present(self, kind: str, artifact_id: str) -> bool:
        """On this node's disk (an image layer maybe not mounted yet, as at start)."""
        if kind == "layer":
            files = self.node.files
            return (files.layers / f"{artifact_id}.img").exists() or files.is_local(artifact_id)
        return self._is_local(kind, artifact_id)

    def _is_local(self, kind: str, artifact_id: str) -> bool:
        """Usable by a restore right now."""
        files = self.node.files
        if kind == "layer":
            return files.is_local(artifact_id)
        if kind == "image":
            return files.image(artifact_id).is_dir()
        return (self.node.driver.guest_path(artifact_id) / ".complete").exists()

    def is_cached(self, rec: Entry) -> bool:
        """Every artifact of ``rec`` is here: a restore from it fetches nothing."""
        return all(self._is_local(item.kind, item.id) for item in self.items_of(rec))

    # -- commits -------------------------------------------------------------------------------------
    def commit_later(self, rec: Entry) -> None:
        """Commit ``rec`` in the background (joined if already under way)."""
        if self.repo is None or rec.id in self._commits:
            return
        task = asyncio.ensure_future(self._commit(rec))
        self._commits[rec.id] = task
        task.add_done_callback(lambda t: self._commits.pop(rec.id, None))

    async def wait_committed(self, rec: Entry) -> None:
        """Commit now (or join the commit under way); raises what the commit raised."""
        if self.repo is None or rec.committed_at:
            return
        self.commit_later(rec)
        task = self._commits.get(rec.id)
        if task is not None:
            await asyncio.shield(task)
        if not rec.committed_at:
            raise AenvError(f"{kind_of(rec)} {rec.id} could not be committed to the repository; see the node log")

    async def wait_all(self) -> None:
        """Until no commit is under way (benchmarks keep measurements apart with it)."""
        while self._commits:
            await asyncio.wait(list(self._commits.values()))

    async def _commit(self, rec: Entry) -> None:
        assert self.repo is not None
        kind = kind_of(rec)
        await self.node.settled(rec.layers)
        try:
            async with self._slots:
                if not self._known(rec):
                    return  # deleted while waiting for its turn
                body = json.loads(rec.to_json())  # as it is now: aliases may have changed meanwhile
                items = self.items_of(rec)
                self.pin(rec.layers + [rec.image])
                try:
                    report = await asyncio.to_thread(self.repo.commit, kind, rec.id, body, items)
                finally:
                    self.unpin(rec.layers + [rec.image])
        except Exception as exc:
            if not self._known(rec):
                log.info("%s %s was deleted while being committed", kind, rec.id)
                return
            metrics.REPO_COMMITS.labels(outcome="error").inc()
            log.error("committing %s %s to %s failed: %s", kind, rec.id, self.repo.url, exc)
            return
        metrics.REPO_COMMITS.labels(outcome="ok").inc()
        metrics.REPO_BYTES.labels(what="logical").inc(report.logical_bytes)
        metrics.REPO_BYTES.labels(what="uploaded").inc(report.new_bytes)
        if not self._known(rec):  # deleted while it was being committed
            await asyncio.to_thread(self.repo.delete_entry, kind, rec.id)
            return
        rec.committed_at = time.time()
        rec.commit = report.as_dict()
        await self._save(rec)
        if rec.id in self._dirty:
            self._dirty.discard(rec.id)
            await self._push_record(rec)
        log.info(
            "committed %s %s: %.1f MiB logical, %.2f MiB uploaded in %d new chunks, %d objects (%.2fs)",
            kind,
            rec.id,
            report.logical_bytes / 2**20,
            report.new_bytes / 2**20,
            report.new_chunks,
            report.new_objects,
            report.seconds,
        )

    def _known(self, rec: Entry) -> bool:
        catalogue = self.node.catalogue
        table: dict[str, Any] = catalogue.templates if isinstance(rec, TemplateRecord) else catalogue.snapshots
        return table.get(rec.id) is rec

    async def _save(self, rec: Entry) -> None:
        if isinstance(rec, TemplateRecord):
            await self.node.store.put_template(rec)
        else:
            await self.node.store.put_snapshot(rec)

    async def _drop(self, rec: Entry) -> None:
        if isinstance(rec, TemplateRecord):
            await self.node.catalogue.remove_template(rec)
        else:
            await self.node.catalogue.remove_snapshot(rec)

    async def record_changed(self, rec: Entry) -> None:
        """A committed record changed (aliases): rewrite its entry; an uncommitted one is committed."""
        if self.repo is None:
            return
        if rec.id in self._commits:
            self._dirty.add(rec.id)  # the commit wrote the record as it was; rewritten after it
            return
        if not rec.committed_at:
            self.commit_later(rec)
            return
        await self._push_record(rec)

    async def _push_record(self, rec: Entry) -> None:
        """Rewrite a committed entry's record as it is now."""
        assert self.repo is not None
        try:
            await asyncio.to_thread(self.repo.update_record, kind_of(rec), rec.id, json.loads(rec.to_json()))
        except Exception as exc:  # noqa: BLE001 - the local record is right; the entry catches up later
            log.error("updating %s %s in the repository failed: %s", kind_of(rec), rec.id, exc)

    async def forget(self, rec: Entry) -> None:
        """The record is deleted: its entry goes; what only it used is collected later."""
        if self.repo is None:
            return
        task = self._commits.get(rec.id)
        if task is not None:
            return  # the commit sees the record gone and deletes the entry itself
        try:
            await asyncio.to_thread(self.repo.delete_entry, kind_of(rec), rec.id)
        except Exception as exc:  # noqa: BLE001
            log.error("deleting %s %s from the repository failed: %s", kind_of(rec), rec.id, exc)

    def commit_pending(self) -> None:
        """Commit every record not committed yet (after a start, or after a failed commit)."""
        if self.repo is None:
            return
        for rec in self._entries():
            if rec.committed_at or getattr(rec, "ephemeral", False):
                continue
            if all(self._is_present(i.kind, i.id) for i in self.items_of(rec)):
                self.commit_later(rec)
        for sb in list(self.node.sandboxes.values()):
            if sb.state == SandboxState.PAUSED and not sb.rec.durable_at:
                self.commit_pause_later(sb)

    # -- durable pauses --------------------------------------------------------------------------------
    def durable_reason(self, rec: SandboxRecord) -> str:
        """Why a paused sandbox is not durable ("" when it is, or will be once its commit is done)."""
        if self.repo is None:
            return "this node has no snapshot repository (AENV_REPO=none): the pause stays on this node"
        if rec.filesystem_only:
            return "a pause without memory stays on this node"
        return ""

    def commit_pause_later(self, sb: LiveSandbox) -> None:
        """Commit a sandbox just paused with its memory in the background: its layers (most are
        in the repository already), its checkpoint image and its upper, sealed as a layer of its
        own under a new id (the upper stays this sandbox's and changes again after a resume)."""
        if self.durable_reason(sb.rec) or sb.id in self._pauses:
            return
        task = asyncio.ensure_future(self._commit_pause(sb, sb.rec.image))
        self._pauses[sb.id] = task

        def done(t: asyncio.Task[None]) -> None:
            if self._pauses.get(sb.id) is t:
                del self._pauses[sb.id]
            self._uploading.discard(sb.id)

        task.add_done_callback(done)

    async def wait_pause_committed(self, sandbox_id: str) -> None:
        """Until the durable pause under way (if any) is done (tests and benchmarks)."""
        task = self._pauses.get(sandbox_id)
        if task is not None:
            await asyncio.wait([task])

    async def release_pause(self, sb: LiveSandbox) -> None:
        """A resume takes the sandbox back: a commit still waiting is abandoned, one uploading is
        waited for (it reads the upper and image the resume is about to change)."""
        task = self._pauses.get(sb.id)
        if task is None:
            return
        if sb.id not in self._uploading:
            task.cancel()
        await asyncio.wait([task])

    def _same_pause(self, sb: LiveSandbox, image: str) -> bool:
        return (
            self.node.sandboxes.get(sb.id) is sb
            and sb.killer is None
            and sb.state == SandboxState.PAUSED
            and sb.rec.image == image
        )

    async def _commit_pause(self, sb: LiveSandbox, image: str) -> None:
        assert self.repo is not None
        files = self.node.files
        upper = sb.rec.upper
        await self.node.settled([upper])  # the instance it paused
        async with self._slots:
            if not self._same_pause(sb, image):
                return  # resumed or killed while waiting for its turn
            layer = new_id()
            body = json.loads(sb.rec.to_json())
            body.update(layers=[*sb.rec.layers, layer], upper="", instance_id="")
            sealed = LocalArtifact("layer", layer, files.layers / f"{upper}.img", "sparse", packed=True)
            if not sealed.path.exists():  # a plain upper (the fake runtime's): a directory layer
                sealed = LocalArtifact("layer", layer, files.layers / upper, "tar")
            items = [*self.items_of(sb.rec), sealed]
            self.pin(sb.rec.layers)
            try:
                await files.remount(upper, writable=False)
                self._uploading.add(sb.id)
                report = await asyncio.to_thread(self.repo.commit, "sandbox", sb.id, body, items)
            except Exception as exc:
                metrics.REPO_COMMITS.labels(outcome="error").inc()
                log.error("committing the pause of sandbox %s to %s failed: %s", sb.id, self.repo.url, exc)
                return
            finally:
                self.unpin(sb.rec.layers)
        metrics.REPO_COMMITS.labels(outcome="ok").inc()
        metrics.REPO_BYTES.labels(what="logical").inc(report.logical_bytes)
        metrics.REPO_BYTES.labels(what="uploaded").inc(report.new_bytes)
        if self.node.sandboxes.get(sb.id) is not sb or sb.killer is not None:
            await self.forget_pause(sb.id)  # killed meanwhile
            return
        sb.rec.durable_at = time.time()
        sb.events.note(f"durable: its pause is in the repository ({report.new_bytes / 2**20:.2f} MiB uploaded)")
        await self.node.store.put_sandbox(sb.rec)
        for listener in self.node.state_listeners:  # the cluster agent writes the entry now, not at its next beat
            listener(sb)
        log.info(
            "paused sandbox %s is durable: %.2f MiB uploaded in %d new chunks, %d objects (%.2fs)",
            sb.id,
            report.new_bytes / 2**20,
            report.new_chunks,
            report.new_objects,
            report.seconds,
        )

    async def holds_pause(self, sandbox_id: str) -> bool:
        """Whether the repository holds a durable pause of ``sandbox_id``."""
        if self.repo is None:
            return False
        return await asyncio.to_thread(self.repo.get_entry, "sandbox", sandbox_id) is not None

    async def forget_pause(self, sandbox_id: str) -> None:
        """The sandbox runs again or is gone: its paused state leaves the repository."""
        if self.repo is None:
            return
        try:
            await asyncio.to_thread(self.repo.delete_entry, "sandbox", sandbox_id)
        except Exception as exc:  # noqa: BLE001 - a stale entry only holds garbage until the next collection
            log.error("deleting the paused state of sandbox %s from the repository failed: %s", sandbox_id, exc)

    # -- start: learn the repository's catalogue ------------------------------------------------------
    async def sync_catalogue(self) -> None:
        """At start: add the repository's templates and snapshots this node does not have, and
        re-commit committed records the repository lost (when their files are still here)."""
        if self.repo is None:
            return
        try:
            entries = await self._read_entries()
        except AenvError as exc:
            log.error("cannot read the repository %s at start: %s (running on local records)", self.repo.url, exc)
            return
        await self._import(entries)
        in_repo = {e["id"] for kind in entries for e in entries[kind]}
        for rec in self._entries():
            if rec.id in in_repo:
                continue
            kind, name = kind_of(rec), getattr(rec, "name", "") or "-"
            # Guest bundles are never evicted, and the current one is rebuilt when missing.
            if not all(self._is_present(i.kind, i.id) for i in self.items_of(rec) if i.kind != "guest"):
                # Its files left this node's cache and the repository (another one, or wiped) lost it.
                where = self.repo_url
                log.error("%s %s (%s) is lost: not in %s nor on this node; removing it", kind, rec.id, name, where)
                await self._drop(rec)
            elif rec.committed_at:
                log.warning("%s %s is no longer in the repository: committing it again", kind, rec.id)
                rec.committed_at = 0.0
                await self._save(rec)
        self.commit_pending()

    async def refresh_catalogue(self, ref: str = "") -> int:
        """Learn what other nodes committed since this one started (a create naming something
        unknown asks): the entry ``ref`` names, read at once (a fork's snapshot, made elsewhere a
        moment ago, is found by the create that names it); else every entry, at most once every
        few seconds. Returns how many records were added."""
        if self.repo is None:
            return 0
        if is_valid_id(ref):
            try:
                found = {
                    kind: await asyncio.to_thread(self.repo.get_entry, kind, ref) for kind in ("template", "snapshot")
                }
            except AenvError as exc:
                log.warning("cannot read %s from the repository %s: %s", ref, self.repo_url, exc)
            else:
                if any(found.values()):
                    named = {kind: [entry] if entry else [] for kind, entry in found.items()}
                    return await self._import({**named, "damaged": []})
        if time.monotonic() - self._refreshed < 3:
            return 0
        self._refreshed = time.monotonic()
        try:
            return await self._import(await self._read_entries())
        except AenvError as exc:
            log.warning("cannot read the repository %s: %s", self.repo_url, exc)
            return 0

    async def _read_entries(self) -> dict[str, list[dict[str, Any]]]:
        """Readable entries by kind; under "damaged", stubs for the ids the repository has but
        this node cannot read (a newer format, a broken write): never mistaken for lost."""
        assert self.repo is not None
        damaged: set[str] = set()
        out: dict[str, list[dict[str, Any]]] = {
            kind: await asyncio.to_thread(self.repo.entries, kind, damaged) for kind in ("template", "snapshot")
        }
        out["damaged"] = [{"id": x} for x in sorted(damaged)]
        return out

    async def _import(self, entries: dict[str, list[dict[str, Any]]]) -> int:
        added = 0
        templates = [t for t in (_record_of(TemplateRecord, e) for e in entries["template"]) if t is not None]
        # Newest first: if two nodes committed templates of one name, the latest one is imported.
        for tmpl in sorted(templates, key=lambda t: -t.committed_at):
            if tmpl.id in self.node.templates:
                continue
            if any(t.name == tmpl.name for t in self.node.templates.values()):
                log.info("repository template %s is named %r like one here: not imported", tmpl.id, tmpl.name)
                continue
            await self.node.catalogue.put_template(tmpl)
            added += 1
        for snap in (s for s in (_record_of(SnapshotRecord, e) for e in entries["snapshot"]) if s is not None):
            if snap.id in self.node.snapshots:
                continue
            await self.node.catalogue.put_snapshot(snap)
            added += 1
        if added:
            log.info("learned %d templates and snapshots from the repository %s", added, self.repo_url)
        return added

    @property
    def repo_url(self) -> str:
        return self.repo.url if self.repo is not None else ""

    # -- fetching ---------------------------------------------------------------------------------------
    @asynccontextmanager
    async def using(self, rec: Entry) -> AsyncIterator[None]:
        """Pin ``rec``'s layers and image for the duration, fetching whatever is not here."""
        held = [*rec.layers, rec.image]
        self.pin(held)
        try:
            await self.ensure_local(rec)
            for layer_id in rec.layers:
                self.node.files.touch(layer_id)
            self.node.files.touch_image(rec.image)
            yield
        finally:
            self.unpin(held)

    @asynccontextmanager
    async def using_layers(self, layers: list[str]) -> AsyncIterator[None]:
        """Pin layers (a build's base) for the duration, fetching those that are not here
        through a committed record that names them."""
        self.pin(layers)
        try:
            await self._mount_present(layers)
            missing = [x for x in layers if not self._is_local("layer", x)]
            owners = {x: self._owner_of(x) for x in missing}
            orphan = next((x for x, owner in owners.items() if owner is None), None)
            if orphan is not None:
                raise ArtifactDamaged(f"layer {orphan} is neither on this node nor in a committed record")
            for owner in {id(r): r for r in owners.values() if r is not None}.values():
                await self.ensure_local(owner, only=set(missing))
            yield
        finally:
            self.unpin(layers)

    def layer_available(self, layer_id: str) -> bool:
        """On this node's disk, or fetchable through a committed record that names it: what a build
        cache hit needs (a layer the cache evicted that no record names is built again)."""
        return bool(layer_id) and (self._is_present("layer", layer_id) or self._owner_of(layer_id) is not None)

    def pin(self, held: list[str]) -> None:
        self.pins.update(held)

    def unpin(self, held: list[str]) -> None:
        self.pins.subtract(held)
        for key in [k for k in held if self.pins[k] <= 0]:
            self.pins.pop(key, None)

    def _owner_of(self, layer_id: str) -> Entry | None:
        for rec in self._entries():
            if rec.committed_at and layer_id in rec.layers:
                return rec
        return None

    async def ensure_local(
        self, rec: Entry, only: set[str] | None = None, on_progress: FetchProgressFn | None = None
    ) -> None:
        """Fetch what of ``rec`` is not on this node; ``on_progress(done, total)`` in bytes."""
        missing = await self._missing([i for i in self.items_of(rec) if only is None or i.id in only])
        if not missing:
            return
        kind = kind_of(rec)
        what = f"{kind} {rec.id}"
        if self.repo is None or not rec.committed_at:
            raise ArtifactDamaged(f"{what}: {missing[0].kind} {missing[0].id} is neither on this node nor committed")
        entry = await asyncio.to_thread(self.repo.get_entry, kind, rec.id)
        if entry is None:
            raise ArtifactDamaged(f"{what} is not in the repository {self.repo.url} and its files are not here")
        await self._fetch_all(missing, entry, what, on_progress)

    async def prefetch(self, rec: Entry, on_progress: FetchProgressFn | None = None) -> int:
        """Bring a committed template's or snapshot's files into this node's cache ahead of its
        first create (an operator warming a node); its layers and image stay pinned only while
        they arrive. Returns the bytes fetched (0: all were here)."""
        fetched = [0]

        def seen(done: int, total: int) -> None:
            fetched[0] = done
            if on_progress is not None:
                on_progress(done, total)

        held = [*rec.layers, rec.image]
        self.pin(held)
        try:
            await self.ensure_local(rec, on_progress=seen)
        finally:
            self.unpin(held)
        return fetched[0]

    async def fetch_pause(self, sandbox_id: str) -> SandboxRecord:
        """The record of a sandbox durably paused by another node, with every artifact it needs
        here (fetched from the repository); the caller gives it an upper of its own."""
        what = f"paused sandbox {sandbox_id}"
        if self.repo is None:
            raise ArtifactDamaged(f"{what}: this node has no snapshot repository (AENV_REPO=none)")
        entry = await asyncio.to_thread(self.repo.get_entry, "sandbox", sandbox_id)
        rec = _record_of(SandboxRecord, entry) if entry is not None else None
        if entry is None or rec is None or rec.id != sandbox_id:
            raise ArtifactDamaged(f"{what}: its paused state is not in the repository {self.repo.url} (or unreadable)")
        held = [*rec.layers, rec.image]
        self.pin(held)
        try:
            missing = await self._missing(self.items_of(rec))
            if missing:
                await self._fetch_all(missing, entry, what)
        finally:
            self.unpin(held)
        return rec

    async def _missing(self, items: list[LocalArtifact]) -> list[LocalArtifact]:
        await self._mount_present([i.id for i in items if i.kind == "layer" and i.encoding == "sparse"])
        return [i for i in items if not self._is_local(i.kind, i.id)]

    async def _mount_present(self, layer_ids: list[str]) -> None:
        """An image layer that is here but not mounted (yet) only needs mounting, not a fetch."""
        for layer_id in layer_ids:
            if not self._is_local("layer", layer_id) and self._is_present("layer", layer_id):
                await self.node.files.mount(layer_id, writable=False)

    async def _fetch_all(
        self,
        missing: list[LocalArtifact],
        entry: dict[str, Any],
        what: str,
        on_progress: FetchProgressFn | None = None,
    ) -> None:
        assert self.repo is not None
        refs = {(r.kind, r.id): r for r in self.repo.artifact_refs(entry)}
        wanted = []
        for item in missing:
            ref = refs.get((item.kind, item.id))
            if ref is None:
                raise ArtifactDamaged(f"{what}: the repository entry does not name {item.kind} {item.id}")
            wanted.append(ref)
        counter = await self._progress_of(wanted, what, on_progress) if on_progress is not None else None
        fetches = [self._fetch(ref, what, counter) for ref in wanted]
        outcomes = await asyncio.gather(*fetches, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    async def _progress_of(self, refs: list[ArtifactRef], what: str, on_progress: FetchProgressFn) -> ByteCounter:
        """A thread-safe counter of the bytes of ``refs`` fetched, told to ``on_progress`` on this loop."""
        assert self.repo is not None
        repo = self.repo
        manifests = await asyncio.gather(*(asyncio.to_thread(repo.read_manifest, ref, what) for ref in refs))
        return ByteCounter(asyncio.get_running_loop(), sum(int(m.get("size", 0)) for m in manifests), on_progress)

    async def _fetch(self, ref: ArtifactRef, what: str, counter: ByteCounter | None = None) -> None:
        """Fetch one artifact; concurrent requests for the same one join (only the first's bytes
        are counted)."""
        key = f"{ref.kind}/{ref.id}"
        running = self._fetches.get(key)
        if running is None:
            running = asyncio.ensure_future(self._fetch_now(ref, what, counter))
            self._fetches[key] = running
            running.add_done_callback(lambda f: self._fetches.pop(key, None))
        await asyncio.shield(running)

    async def _fetch_now(self, ref: ArtifactRef, what: str, counter: ByteCounter | None = None) -> None:
        assert self.repo is not None
        files = self.node.files
        if self._is_local(ref.kind, ref.id):
            return  # a fetch that finished while this one was being set up
        started = time.monotonic()
        temp: Path
        if ref.kind == "layer":
            manifest = await asyncio.to_thread(self.repo.read_manifest, ref, what)
            sparse = manifest["encoding"] == "sparse"
            temp = files.layers / f"{FETCHING}{ref.id}-{new_id(6)}{'.img' if sparse else ''}"
            final = files.layers / (f"{ref.id}.img" if sparse else ref.id)
        elif ref.kind == "image":
            temp, final = files.images / f"{FETCHING}{ref.id}-{new_id(6)}", files.image(ref.id)
        else:
            final = self.node.driver.guest_path(ref.id)
            temp = final.parent / f"{FETCHING}{ref.id}-{new_id(6)}"
        try:
            room = headroom(self.node.settings)
            on_bytes = counter.add if counter is not None else None
            size = await asyncio.to_thread(self.repo.fetch_artifact, ref, temp, what, room, on_bytes)
            os.rename(temp, final)
        except BaseException:
            metrics.REPO_FETCHES.labels(outcome="error").inc()
            await asyncio.to_thread(_discard, temp)
            raise
        if ref.kind == "layer" and final.suffix == ".img":
            await files.mount(ref.id, writable=False)
        metrics.REPO_FETCHES.labels(outcome="ok").inc()
        metrics.REPO_FETCH_BYTES.inc(size)
        log.info("fetched %s %s (%.1f MiB) in %.2fs", ref.kind, ref.id, size / 2**20, time.monotonic() - started)

    # -- the local cache ----------------------------------------------------------------------------------
    def evictable(self) -> tuple[set[str], set[str]]:
        """(layers, images) that only committed records name: the repository can give them back."""
        if self.repo is None:
            return set(), set()
        layers: set[str] = set()
        images: set[str] = set()
        needed_layers: set[str] = set()
        needed_images: set[str] = set()
        for rec in self._entries():
            if rec.committed_at:
                layers.update(rec.layers)
                images.add(rec.image)
            else:
                needed_layers.update(rec.layers)
                needed_images.add(rec.image)
        return layers - needed_layers, images - needed_images

    def sweep_partial_fetches(self) -> None:
        """Remove what fetches interrupted by a stop left behind."""
        dirs = [self.node.files.layers, self.node.files.images, self.node.driver.guest_path("x").parent]
        for d in dirs:
            for p in [*d.glob(f"{FETCHING}*"), *d.glob(".evict-*")]:
                _discard(p)

    async def gc_repository(self) -> dict[str, Any]:
        if self.repo is None:
            return {"skipped": "no repository"}
        report = await asyncio.to_thread(self.repo.gc)
        if report.skipped:
            log.info("repository gc skipped: %s", report.skipped)
        else:
            log.info(
                "repository gc: %d chunks, %d packs and %d artifacts deleted, %.1f MiB freed",
                report.deleted_chunks,
                report.deleted_packs,
                report.deleted_artifacts,
                report.freed_bytes / 2**20,
            )
        return report.as_dict()


def _record_of(cls: type[R], entry: dict[str, Any]) -> R | None:
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


def _discard(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        remove_tree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


FetchProgressFn = Callable[[int, int], None]  # (bytes fetched, bytes to fetch)
PROGRESS_EVERY = 0.25  # seconds between two reports


class ByteCounter:
    """Bytes fetched by repository threads, reported on the node's loop at most every quarter
    second, and once more when all have arrived."""

    def __init__(self, loop: asyncio.AbstractEventLoop, total: int, on_progress: FetchProgressFn) -> None:
        self.loop, self.total, self.on_progress = loop, total, on_progress
        self.done, self.shown_at = 0, 0.0
        self.lock = threading.Lock()

    def add(self, count: int) -> None:
        with self.lock:
            self.done += count
            now = time.monotonic()
            if now - self.shown_at < PROGRESS_EVERY and self.done < self.total:
                return
            self.shown_at = now
            done = self.done
        self.loop.call_soon_threadsafe(self.on_progress, done, max(self.total, done))
