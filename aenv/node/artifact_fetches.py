"""Fetches from the snapshot repository: what a restore, build or prefetch needs and is not here.

Committed data is the truth and this node's layers and images only a cache of it, so a create or a
build may find a record's files evicted; they come back here, every chunk verified by the repository.
A fetch builds into a temporary name and renames into place, so a failed or interrupted one leaves
nothing a sandbox could boot from; a damaged artifact fails the one operation that needed it with
``ArtifactDamaged`` and leaves every other sandbox alone. Concurrent fetches of one artifact join,
and whatever a restore or build is using stays pinned (unevictable) for as long as it does.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from aenv.errors import ArtifactDamaged
from aenv.node import metrics
from aenv.node.artifact_local import FETCHING, ArtifactHost, Entry, LocalArtifacts, discard, kind_of, record_of
from aenv.node.store import SandboxRecord
from aenv.repo.repository import ArtifactRef, LocalArtifact, Repository
from aenv.storage.layers import new_id
from aenv.storage.space import headroom

log = logging.getLogger("aenv.repo")
FetchProgressFn = Callable[[int, int], None]  # (bytes fetched, bytes to fetch)
PROGRESS_EVERY = 0.25  # seconds between two reports


class Fetches:
    def __init__(self, node: ArtifactHost, repo: Repository | None, local: LocalArtifacts) -> None:
        self.node = node
        self.repo = repo
        self.local = local
        self._fetches: dict[str, asyncio.Future[None]] = {}

    @asynccontextmanager
    async def using(self, rec: Entry) -> AsyncIterator[None]:
        """Pin ``rec``'s layers and image for the duration, fetching whatever is not here."""
        held = [*rec.layers, rec.image]
        self.local.pin(held)
        try:
            await self.ensure_local(rec)
            for layer_id in rec.layers:
                self.node.files.touch(layer_id)
            self.node.files.touch_image(rec.image)
            yield
        finally:
            self.local.unpin(held)

    @asynccontextmanager
    async def using_layers(self, layers: list[str]) -> AsyncIterator[None]:
        """Pin layers (a build's base) for the duration, fetching those that are not here
        through a committed record that names them."""
        self.local.pin(layers)
        try:
            await self._mount_present(layers)
            missing = [x for x in layers if not self.local.is_local("layer", x)]
            owners = {x: self.local.owner_of(x) for x in missing}
            orphan = next((x for x, owner in owners.items() if owner is None), None)
            if orphan is not None:
                raise ArtifactDamaged(f"layer {orphan} is neither on this node nor in a committed record")
            for owner in {id(r): r for r in owners.values() if r is not None}.values():
                await self.ensure_local(owner, only=set(missing))
            yield
        finally:
            self.local.unpin(layers)

    async def ensure_local(
        self, rec: Entry, only: set[str] | None = None, on_progress: FetchProgressFn | None = None
    ) -> None:
        """Fetch what of ``rec`` is not on this node; ``on_progress(done, total)`` in bytes."""
        missing = await self._missing([i for i in self.local.items_of(rec) if only is None or i.id in only])
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
        self.local.pin(held)
        try:
            await self.ensure_local(rec, on_progress=seen)
        finally:
            self.local.unpin(held)
        return fetched[0]

    async def fetch_pause(self, sandbox_id: str) -> SandboxRecord:
        """The record of a sandbox durably paused by another node, with every artifact it needs
        here (fetched from the repository); the caller gives it an upper of its own."""
        what = f"paused sandbox {sandbox_id}"
        if self.repo is None:
            raise ArtifactDamaged(f"{what}: this node has no snapshot repository (AENV_REPO=none)")
        entry = await asyncio.to_thread(self.repo.get_entry, "sandbox", sandbox_id)
        rec = record_of(SandboxRecord, entry) if entry is not None else None
        if entry is None or rec is None or rec.id != sandbox_id:
            raise ArtifactDamaged(f"{what}: its paused state is not in the repository {self.repo.url} (or unreadable)")
        held = [*rec.layers, rec.image]
        self.local.pin(held)
        try:
            missing = await self._missing(self.local.items_of(rec))
            if missing:
                await self._fetch_all(missing, entry, what)
        finally:
            self.local.unpin(held)
        return rec

    async def _missing(self, items: list[LocalArtifact]) -> list[LocalArtifact]:
        await self._mount_present([i.id for i in items if i.kind == "layer" and i.encoding == "sparse"])
        return [i for i in items if not self.local.is_local(i.kind, i.id)]

    async def _mount_present(self, layer_ids: list[str]) -> None:
        """An image layer that is here but not mounted (yet) only needs mounting, not a fetch."""
        for layer_id in layer_ids:
            if not self.local.is_local("layer", layer_id) and self.local.is_present("layer", layer_id):
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
        if self.local.is_local(ref.kind, ref.id):
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
            await asyncio.to_thread(discard, temp)
            raise
        if ref.kind == "layer" and final.suffix == ".img":
            await files.mount(ref.id, writable=False)
        metrics.REPO_FETCHES.labels(outcome="ok").inc()
        metrics.REPO_FETCH_BYTES.inc(size)
        log.info("fetched %s %s (%.1f MiB) in %.2fs", ref.kind, ref.id, size / 2**20, time.monotonic() - started)


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
