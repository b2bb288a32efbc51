"""Commits to the snapshot repository: templates, snapshots and durable pauses, in the background.

A record is committed once made (a snapshot's sealed upper once its old instance is gone), one commit
at a time since commits compete with sandboxes for CPU; ``committed_at`` on the record says when that
finished and failed commits are retried by ``commit_pending``. A record deleted while its commit runs
has its entry deleted by the commit itself, and one whose aliases change meanwhile is rewritten once
the commit is done. A sandbox paused with its memory is made durable the same way, its upper sealed
as a layer of its own; a resume abandons a commit still waiting and waits for one already uploading.
Fetching back what was committed is aenv/node/artifact_fetches.py's business.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from aenv.errors import AenvError
from aenv.node import metrics
from aenv.node.artifact_local import ArtifactHost, Entry, LocalArtifacts, kind_of
from aenv.node.state import SandboxState
from aenv.node.store import SandboxRecord, TemplateRecord
from aenv.repo.repository import LocalArtifact, Repository
from aenv.storage.layers import new_id

if TYPE_CHECKING:
    from aenv.node.sandbox import LiveSandbox

log = logging.getLogger("aenv.repo")
DELETED_KEPT_SECONDS = 600.0  # how long a record deleted here is not learnt back from the repository


class Commits:
    def __init__(self, node: ArtifactHost, repo: Repository | None, local: LocalArtifacts) -> None:
        self.node = node
        self.repo = repo
        self.local = local
        self._commits: dict[str, asyncio.Task[None]] = {}
        self._slots = asyncio.Semaphore(1)  # commits compete with sandboxes for CPU: one at a time
        self._dirty: set[str] = set()  # records changed while their commit was under way
        self._pauses: dict[str, asyncio.Task[None]] = {}  # durable pauses under way, by sandbox id
        self._uploading: set[str] = set()  # those of them past the point where a resume cancels them
        # Records deleted here lately, by id: a repository read that began before an entry's
        # delete (or while a commit under way still writes it) must not bring the record back.
        self.deleted: dict[str, float] = {}

    async def cancel(self) -> None:
        """Stop: commits under way are abandoned (nothing of them is visible) and redone at start."""
        tasks = [*self._commits.values(), *self._pauses.values()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10)

    # -- templates and snapshots ----------------------------------------------------------------------
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
                items = self.local.items_of(rec)
                self.local.pin(rec.layers + [rec.image])
                try:
                    report = await asyncio.to_thread(self.repo.commit, kind, rec.id, body, items)
                finally:
                    self.local.unpin(rec.layers + [rec.image])
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
        await self.save(rec)
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

    async def save(self, rec: Entry) -> None:
        if isinstance(rec, TemplateRecord):
            await self.node.store.put_template(rec)
        else:
            await self.node.store.put_snapshot(rec)

    async def drop(self, rec: Entry) -> None:
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
        now = time.monotonic()
        self.deleted = {x: at for x, at in self.deleted.items() if now - at < DELETED_KEPT_SECONDS}
        self.deleted[rec.id] = now
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
        for rec in self.local.entries():
            if rec.committed_at or getattr(rec, "ephemeral", False):
                continue
            if all(self.local.is_present(i.kind, i.id) for i in self.local.items_of(rec)):
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
            items = [*self.local.items_of(sb.rec), sealed]
            self.local.pin(sb.rec.layers)
            try:
                await files.remount(upper, writable=False)
                self._uploading.add(sb.id)
                report = await asyncio.to_thread(self.repo.commit, "sandbox", sb.id, body, items)
            except Exception as exc:
                metrics.REPO_COMMITS.labels(outcome="error").inc()
                log.error("committing the pause of sandbox %s to %s failed: %s", sb.id, self.repo.url, exc)
                return
            finally:
                self.local.unpin(sb.rec.layers)
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
