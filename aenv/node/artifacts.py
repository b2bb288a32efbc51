"""The node's side of the snapshot repository: commit what it makes, fetch what it restores.

Templates and snapshots are committed in the background once made (a snapshot's sealed upper
once its old instance is gone); ``committed_at`` on the record says when that finished. Committed
data is the truth: the layers and images of committed records are only a cache here, evicted
(least recently used, never while pinned) when the node's cache is over budget, and fetched back,
every chunk verified, when a restore or build needs them. A node with an empty data dir learns
the repository's templates and snapshots at start and restores them from it.

``ArtifactCache`` is the one object the node holds for all of this. It is composed of parts, each
given what it uses: ``LocalArtifacts`` (aenv/node/artifact_local.py: what a record is made of, what
of it is here, the pins), ``Commits`` (aenv/node/artifact_commits.py: commits and durable pauses)
and ``Fetches`` (aenv/node/artifact_fetches.py: restores' and builds' fetches). It learns the
repository's catalogue itself, since that takes all three, and passes every other call on to the
part that owns it (thin methods at the end).
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

from aenv.errors import AenvError
from aenv.node.artifact_commits import Commits
from aenv.node.artifact_fetches import PROGRESS_EVERY, ByteCounter, Fetches, FetchProgressFn
from aenv.node.artifact_local import FETCHING, ArtifactHost, Entry, LocalArtifacts, kind_of, record_of
from aenv.node.store import SandboxRecord, SnapshotRecord, TemplateRecord
from aenv.repo.repository import LocalArtifact, Repository, is_valid_id

if TYPE_CHECKING:
    from aenv.node.sandbox import LiveSandbox

__all__ = [
    "FETCHING",
    "PROGRESS_EVERY",
    "ArtifactCache",
    "ArtifactHost",
    "ByteCounter",
    "Entry",
    "FetchProgressFn",
    "kind_of",
    "record_of",
]

log = logging.getLogger("aenv.repo")


class ArtifactCache:
    def __init__(self, node: ArtifactHost, repo: Repository | None) -> None:
        self.node = node
        self.repo = repo
        self.local = LocalArtifacts(node, backed=repo is not None)
        self.commits = Commits(node, repo, self.local)
        self.fetches = Fetches(node, repo, self.local)
        self.pins = self.local.pins  # layer and image ids a restore or build is using
        self._refreshed = 0.0

    async def close(self) -> None:
        """Stop: commits under way are abandoned (nothing of them is visible) and redone at start."""
        await self.commits.cancel()
        if self.repo is not None:
            self.repo.close()

    @property
    def repo_url(self) -> str:
        return self.repo.url if self.repo is not None else ""

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
        local = self.local
        for rec in local.entries():
            if rec.id in in_repo:
                continue
            kind, name = kind_of(rec), getattr(rec, "name", "") or "-"
            # Guest bundles are never evicted, and the current one is rebuilt when missing.
            if not all(local.is_present(i.kind, i.id) for i in local.items_of(rec) if i.kind != "guest"):
                # Its files left this node's cache and the repository (another one, or wiped) lost it.
                where = self.repo_url
                log.error("%s %s (%s) is lost: not in %s nor on this node; removing it", kind, rec.id, name, where)
                await self.commits.drop(rec)
            elif rec.committed_at:
                log.warning("%s %s is no longer in the repository: committing it again", kind, rec.id)
                rec.committed_at = 0.0
                await self.commits.save(rec)
        self.commits.commit_pending()

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
        templates = [t for t in (record_of(TemplateRecord, e) for e in entries["template"]) if t is not None]
        # Newest first: if two nodes committed templates of one name, the latest one is imported.
        deleted = self.commits.deleted  # its entry may still be read here a moment after the delete
        for tmpl in sorted(templates, key=lambda t: -t.committed_at):
            if tmpl.id in self.node.templates or tmpl.id in deleted:
                continue
            if any(t.name == tmpl.name for t in self.node.templates.values()):
                log.info("repository template %s is named %r like one here: not imported", tmpl.id, tmpl.name)
                continue
            await self.node.catalogue.put_template(tmpl)
            added += 1
        for snap in (s for s in (record_of(SnapshotRecord, e) for e in entries["snapshot"]) if s is not None):
            if snap.id in self.node.snapshots or snap.id in deleted:
                continue
            await self.node.catalogue.put_snapshot(snap)
            added += 1
        if added:
            log.info("learned %d templates and snapshots from the repository %s", added, self.repo_url)
        return added

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

    # -- the parts' calls --------------------------------------------------------------------------------
    def guest_key(self, rec: Entry | SandboxRecord) -> str:
        return self.local.guest_key(rec)

    def items_of(self, rec: Entry | SandboxRecord) -> list[LocalArtifact]:
        return self.local.items_of(rec)

    def held(self, limit: int, longest: int) -> list[str]:
        return self.local.held(limit, longest)

    def is_cached(self, rec: Entry) -> bool:
        return self.local.is_cached(rec)

    def layer_available(self, layer_id: str) -> bool:
        return self.local.layer_available(layer_id)

    def pin(self, held: list[str]) -> None:
        self.local.pin(held)

    def unpin(self, held: list[str]) -> None:
        self.local.unpin(held)

    def evictable(self) -> tuple[set[str], set[str]]:
        return self.local.evictable()

    def sweep_partial_fetches(self) -> None:
        self.local.sweep_partial_fetches()

    def commit_later(self, rec: Entry) -> None:
        self.commits.commit_later(rec)

    async def wait_committed(self, rec: Entry) -> None:
        await self.commits.wait_committed(rec)

    async def wait_all(self) -> None:
        await self.commits.wait_all()

    async def record_changed(self, rec: Entry) -> None:
        await self.commits.record_changed(rec)

    async def forget(self, rec: Entry) -> None:
        await self.commits.forget(rec)

    def commit_pending(self) -> None:
        self.commits.commit_pending()

    def durable_reason(self, rec: SandboxRecord) -> str:
        return self.commits.durable_reason(rec)

    def commit_pause_later(self, sb: LiveSandbox) -> None:
        self.commits.commit_pause_later(sb)

    async def wait_pause_committed(self, sandbox_id: str) -> None:
        await self.commits.wait_pause_committed(sandbox_id)

    async def release_pause(self, sb: LiveSandbox) -> None:
        await self.commits.release_pause(sb)

    async def holds_pause(self, sandbox_id: str) -> bool:
        return await self.commits.holds_pause(sandbox_id)

    async def forget_pause(self, sandbox_id: str) -> None:
        await self.commits.forget_pause(sandbox_id)

    def using(self, rec: Entry) -> AbstractAsyncContextManager[None]:
        return self.fetches.using(rec)

    def using_layers(self, layers: list[str]) -> AbstractAsyncContextManager[None]:
        return self.fetches.using_layers(layers)

    async def ensure_local(
        self, rec: Entry, only: set[str] | None = None, on_progress: FetchProgressFn | None = None
    ) -> None:
        await self.fetches.ensure_local(rec, only, on_progress)

    async def prefetch(self, rec: Entry, on_progress: FetchProgressFn | None = None) -> int:
        return await self.fetches.prefetch(rec, on_progress)

    async def fetch_pause(self, sandbox_id: str) -> SandboxRecord:
        return await self.fetches.fetch_pause(sandbox_id)
