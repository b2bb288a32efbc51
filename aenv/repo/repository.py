"""The snapshot repository: templates and snapshots committed as content-addressed chunks.

Key space (the same on a POSIX directory and in an S3 bucket)::

    chunks/ab/<sha256>                 zstd of one content-defined chunk, named by its raw digest
    packs/ab/<sha256>                  small chunks of checkpoint images, zstd each, one after the
                                       other (see packs.py), named by the digest of the pack
    artifacts/<kind>/<id>.json         one layer, checkpoint image or guest bundle: its encoding
                                       and the ordered chunk list (kind: layer | image | guest);
                                       an image's (format 2) also where its chunks lie in packs,
                                       stored as zstd of the JSON
    entries/<kind>s/<id>.json          one template or snapshot: its record and the digests of the
                                       artifact manifests it needs (kind: template | snapshot)
    locks/<commit|gc>-<uuid>.json      who is committing or collecting right now

A commit uploads chunks, then artifact manifests, then the entry manifest, each step naming only
what is already there: until the entry is written nothing of the commit is visible, and an
interrupted commit leaves only garbage that the collector removes. Artifacts are immutable under
their id (a sealed layer never changes), so a later commit that needs one that is already there
reuses it without reading a byte: a second snapshot of a sandbox uploads its new upper layer and
its new checkpoint image, nothing else. Reads check every link of the chain: the entry names each
manifest's digest, each manifest names its chunks' digests.

Garbage collection marks from the entries and deletes the rest (a pack while no live manifest
names it: packs.py says why that wastes at most so much). It must never run while a commit
is between uploading chunks and writing its entry, so both take a lock object and then list the
locks: a collector that sees a live commit lock backs off; a commit that sees a collector's lock
waits for it to go. Whichever wrote second is guaranteed to see the first (S3 and POSIX listings
are read-after-write consistent), so the two can never overlap.

Everything here is synchronous (boto3, file I/O, tar); the node calls it from worker threads.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import zstandard

from aenv.errors import ArtifactDamaged, InvalidRequest, RepositoryUnavailable, StorageError
from aenv.repo import encodings
from aenv.repo.backends import Backend, MissingObject, PosixBackend
from aenv.repo.chunks import ZSTD_LEVEL, ChunkWriter, WriteStats, chunk_key, read_chunk, read_chunks
from aenv.repo.manifests import (
    ARTIFACT_FORMAT,
    PACKED_FORMAT,
    check_manifest,
    is_packed,
    load_manifest,
    object_keys,
)
from aenv.repo.packs import (
    PackIndex,
    PackWriter,
    chunk_sizes,
    pack_key,
    read_packed,
    wants_of,
)
from aenv.storage.space import ensure_space

log = logging.getLogger("aenv.repo")

ENTRY_FORMAT = "aenv-entry/1"
ArtifactKind = Literal["layer", "image", "guest"]
# A "sandbox" entry is a durably paused sandbox (its record, checkpoint image and sealed upper).
EntryKind = Literal["template", "snapshot", "sandbox"]
ENTRY_KINDS: tuple[EntryKind, ...] = ("template", "snapshot", "sandbox")
ENTRY_DIRS: dict[str, str] = {
    "template": "entries/templates/",
    "snapshot": "entries/snapshots/",
    "sandbox": "entries/sandboxes/",
}
Encoding = Literal["tar", "sparse"]
LOCK_REFRESH_S = 30.0
LOCK_STALE_S = 600.0  # a lock not refreshed for this long belongs to a process that died
CHANGE_TRIES = 5  # rereads of an entry that other nodes keep changing under a rewrite
ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,199}")


@dataclass(frozen=True, slots=True)
class ArtifactRef:
    kind: str
    id: str
    manifest: str  # sha256 of the manifest's bytes


@dataclass(frozen=True, slots=True)
class LocalArtifact:
    """A node-local artifact to commit: where it is and how to encode it."""

    kind: ArtifactKind
    id: str
    path: Path
    encoding: Encoding
    # Small chunks in packs (images always): a sealed upper, which the next one of its sandbox
    # repeats but for a few blocks. Other layers keep loose 1 MiB chunks.
    packed: bool = False


@dataclass
class CommitReport:
    logical_bytes: int = 0  # what the entry restores to: every artifact's stream, reused or not
    new_bytes: int = 0  # bytes this commit uploaded: compressed chunks, manifests, its entry
    chunks: int = 0
    new_chunks: int = 0
    new_objects: int = 0  # objects it wrote: loose chunks, packs, manifests, its entry
    new_artifacts: list[str] = field(default_factory=list)
    reused_artifacts: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class GcReport:
    skipped: str = ""  # why nothing was collected (another commit or collection was running)
    entries: int = 0
    live_chunks: int = 0
    live_packs: int = 0
    deleted_artifacts: int = 0
    deleted_chunks: int = 0
    deleted_packs: int = 0
    freed_bytes: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def artifact_key(kind: str, artifact_id: str) -> str:
    return f"artifacts/{kind}/{artifact_id}.json"


def entry_key(kind: str, entry_id: str) -> str:
    return f"{ENTRY_DIRS[kind]}{entry_id}.json"


def is_valid_id(value: object) -> bool:
    """An artifact or entry id: a name (node ids are hex, ``oci-<hex>``, ``snap_<hex>``), never a path."""
    return isinstance(value, str) and ID.fullmatch(value) is not None


def _check_id(value: str) -> str:
    if not is_valid_id(value):
        raise InvalidRequest(f"bad repository id {value!r}")
    return value


class Repository:
    def __init__(self, backend: Backend, *, workers: int = 8, pack_images: bool = True) -> None:
        self.backend = backend
        self.pack_images = pack_images  # False: images as loose 1 MiB chunks, as before packs (benchmarks)
        self.url = backend.url
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="aenv-repo")
        self.holder = f"{socket.gethostname()}:{os.getpid()}"
        self.index = PackIndex()  # where image chunks this process wrote or read lie in packs

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- artifacts --------------------------------------------------------------------------------
    def find_artifact(self, kind: str, artifact_id: str) -> tuple[ArtifactRef, dict[str, Any]] | None:
        try:
            data = self.backend.get(artifact_key(kind, _check_id(artifact_id)))
        except MissingObject:
            return None
        return ArtifactRef(kind, artifact_id, hashlib.sha256(data).hexdigest()), load_manifest(data, artifact_id)

    def put_artifact(self, item: LocalArtifact, writer: ChunkWriter) -> tuple[ArtifactRef, int]:
        """Upload one artifact's chunks, then its manifest; returns (ref, logical bytes)."""
        manifest: dict[str, Any] = {
            "format": ARTIFACT_FORMAT,
            "kind": item.kind,
            "id": _check_id(item.id),
            "encoding": item.encoding,
            "created_at": time.time(),
        }
        packer: PackWriter | None = None
        if item.encoding not in ("tar", "sparse"):
            raise InvalidRequest(f"unknown encoding {item.encoding!r}")
        if self.pack_images and (item.kind == "image" or item.packed):
            # Small chunks, packed: the pages (or blocks) two images of a sandbox share are stored once.
            packer = PackWriter(writer.backend, writer.pool, self.index, writer.stats, f"{item.kind} {item.id}")
            try:
                if item.encoding == "tar":
                    packer.write(encodings.tar_blocks(item.path), chunk_sizes(item.kind, _bytes_under(item.path)))
                else:
                    size, extents = encodings.data_extents(item.path)
                    manifest.update(file_size=size, extents=extents)
                    stream = sum(n for _, n in extents)
                    packer.write(encodings.sparse_blocks(item.path, extents), chunk_sizes(item.kind, stream))
                manifest.update(format=PACKED_FORMAT, **packer.finish())
            except BaseException:
                packer.abandon()
                raise
            refs = [(d, n) for d, n in manifest["chunks"]]
        elif item.encoding == "tar":
            refs = writer.write_stream(encodings.tar_blocks(item.path))
        elif item.encoding == "sparse":
            size, extents = encodings.data_extents(item.path)
            manifest.update(file_size=size, extents=extents)
            refs = writer.write_stream(encodings.sparse_blocks(item.path, extents))
        writer.flush()  # every chunk is in before the manifest names it
        manifest["size"] = sum(length for _, length in refs)
        manifest["chunks"] = [list(r) for r in refs]
        data = json.dumps(manifest, sort_keys=True).encode()
        if packer is not None:
            data = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data)  # ~45 bytes a chunk, not ~95
        writer.stats.new_bytes += len(data)
        writer.stats.new_objects += 1
        if not self.backend.put_new(artifact_key(item.kind, item.id), data):
            # Another commit (another node) wrote this artifact meanwhile: its manifest is complete
            # and entries may already name its digest, so it stays; ours is garbage for the GC.
            found = self.find_artifact(item.kind, item.id)
            assert found is not None
            return found[0], int(found[1].get("size", 0))
        if packer is not None:
            self.index.add(manifest)
        return ArtifactRef(item.kind, item.id, hashlib.sha256(data).hexdigest()), manifest["size"]

    def read_manifest(self, ref: ArtifactRef, what: str) -> dict[str, Any]:
        try:
            data = self.backend.get(artifact_key(ref.kind, _check_id(ref.id)))
        except MissingObject:
            raise ArtifactDamaged(f"{what}: the manifest of {ref.kind} {ref.id} is missing") from None
        if hashlib.sha256(data).hexdigest() != ref.manifest:
            raise ArtifactDamaged(f"{what}: the manifest of {ref.kind} {ref.id} does not match its digest")
        return load_manifest(data, what)

    def fetch_artifact(
        self, ref: ArtifactRef, dest: Path, what: str, headroom: int = 0, on_bytes: Callable[[int], None] | None = None
    ) -> int:
        """Rebuild an artifact at ``dest`` (a directory for tar, a file for sparse), every chunk
        verified; returns its logical size. On any error the caller discards ``dest``. Refused
        (507) if it would leave less than ``headroom`` bytes free on its filesystem.
        ``on_bytes(n)`` follows the chunks as they arrive (called on this thread)."""
        manifest = self.read_manifest(ref, what)
        check_manifest(manifest, what)
        ensure_space(dest.parent, headroom, manifest["size"], what)
        chunks = self._chunks(manifest, what)
        if on_bytes is not None:
            chunks = _counted(chunks, on_bytes)
        if manifest["encoding"] == "tar":
            dest.mkdir(parents=True)
            encodings.untar(chunks, dest, headroom)
        else:
            extents = [(a, b) for a, b in manifest["extents"]]
            encodings.write_sparse(chunks, dest, manifest["file_size"], extents, headroom)
        if is_packed(manifest):
            self.index.add(manifest)  # every chunk was read and verified: a later commit may name them
        return int(manifest["size"])

    def _chunks(self, manifest: dict[str, Any], what: str) -> Iterator[bytes]:
        """A checked manifest's chunks in order, verified."""
        if is_packed(manifest):
            return _joined(raw for _, raw in read_packed(self.backend, wants_of(manifest), self.pool, what))
        return read_chunks(self.backend, [(d, n) for d, n in manifest["chunks"]], self.pool, what)

    def artifact_chunks(self, ref: ArtifactRef, what: str) -> Iterator[bytes]:
        """An artifact's chunks in order, each verified (wherever they are stored)."""
        manifest = self.read_manifest(ref, what)
        check_manifest(manifest, what)
        return self._chunks(manifest, what)

    # -- entries ----------------------------------------------------------------------------------
    def commit(
        self, kind: EntryKind, entry_id: str, record: dict[str, Any], items: list[LocalArtifact]
    ) -> CommitReport:
        """Commit a template, snapshot or paused sandbox: its artifacts not yet in the repository, then its entry."""
        started = time.monotonic()
        report = CommitReport()
        with self.lock("commit") as lock_key:
            writer = ChunkWriter(self.backend, self.pool)
            refs: list[ArtifactRef] = []
            for item in items:
                found = self.find_artifact(item.kind, item.id)
                if found is not None:
                    ref, manifest = found
                    report.reused_artifacts += 1
                    report.logical_bytes += int(manifest.get("size", 0))
                    report.chunks += len(manifest.get("chunks", []))
                else:
                    ref, _size = self.put_artifact(item, writer)
                    report.new_artifacts.append(f"{item.kind}/{item.id}")
                refs.append(ref)
            stats: WriteStats = writer.stats
            report.logical_bytes += stats.logical_bytes
            report.chunks += stats.chunks
            report.new_chunks, report.new_bytes = stats.new_chunks, stats.new_bytes
            report.new_objects = stats.new_objects + 1  # and the entry
            report.seconds = round(time.monotonic() - started, 3)
            body = {
                "format": ENTRY_FORMAT,
                "kind": kind,
                "id": entry_id,
                "record": record,
                "artifacts": [asdict(r) for r in refs],
                "committed_at": time.time(),
                "commit": report.as_dict(),
            }
            self._still_holding(lock_key)
            data = json.dumps(body, sort_keys=True).encode()
            self.backend.put(entry_key(kind, _check_id(entry_id)), data)
            report.new_bytes += len(data)
        return report

    def update_record(self, kind: EntryKind, entry_id: str, record: dict[str, Any]) -> bool:
        """Rewrite a committed entry's record (aliases, names); False if it is not committed.

        Conditional on the version read, so a rewrite racing another node's delete never brings
        the entry back (its artifacts may be collected already); a racing rewrite is read again."""
        key = entry_key(kind, _check_id(entry_id))
        for _ in range(CHANGE_TRIES):
            try:
                data, tag = self.backend.get_tagged(key)
            except MissingObject:
                return False
            entry = self._parse_entry(kind, entry_id, data)
            entry["record"] = record
            if self.backend.replace(key, json.dumps(entry, sort_keys=True).encode(), tag):
                return True
        raise RepositoryUnavailable(f"{kind} {entry_id}: its entry kept changing while being rewritten")

    def get_entry(self, kind: EntryKind, entry_id: str) -> dict[str, Any] | None:
        try:
            data = self.backend.get(entry_key(kind, _check_id(entry_id)))
        except MissingObject:
            return None
        return self._parse_entry(kind, entry_id, data)

    @staticmethod
    def _parse_entry(kind: EntryKind, entry_id: str, data: bytes) -> dict[str, Any]:
        try:
            entry = json.loads(data)
        except ValueError:
            raise ArtifactDamaged(f"{kind} {entry_id}: its entry in the repository is not valid JSON") from None
        if not isinstance(entry, dict):
            raise ArtifactDamaged(f"{kind} {entry_id}: its entry in the repository is not a JSON object")
        if entry.get("format") != ENTRY_FORMAT:
            raise ArtifactDamaged(f"{kind} {entry_id}: unknown entry format {str(entry.get('format'))[:100]!r}")
        return dict(entry)

    def entries(self, kind: EntryKind, damaged: set[str] | None = None) -> list[dict[str, Any]]:
        """Every readable entry of ``kind``; the ids of unreadable ones go into ``damaged``."""
        out = []
        for info in self.backend.list(ENTRY_DIRS[kind]):
            entry_id = info.key.rsplit("/", 1)[-1].removesuffix(".json")
            if not is_valid_id(entry_id):  # whoever else writes the repository: not one of ours
                log.error("skipping %s: not an entry's name", info.key[:200])
                continue
            try:
                entry = self.get_entry(kind, entry_id)
            except ArtifactDamaged as exc:
                log.error("skipping a damaged entry: %s", exc)
                if damaged is not None:
                    damaged.add(entry_id)
                continue
            if entry is not None:
                out.append(entry)
        return out

    def delete_entry(self, kind: EntryKind, entry_id: str) -> None:
        """What only this entry used becomes garbage for the next collection."""
        self.backend.remove(entry_key(kind, _check_id(entry_id)))

    @staticmethod
    def artifact_refs(entry: dict[str, Any]) -> list[ArtifactRef]:
        return [ArtifactRef(a["kind"], a["id"], a["manifest"]) for a in entry.get("artifacts", [])]

    # -- locks -------------------------------------------------------------------------------------
    def _locks(self, own: str) -> tuple[list[str], list[str]]:
        """(live lock keys other than ``own``, stale lock keys). Age is measured against our own
        lock's time in the same listing: the store's clock, so node clocks do not matter."""
        infos = list(self.backend.list("locks/"))
        now = next((i.modified for i in infos if i.key == own), time.time())
        live: list[str] = []
        stale: list[str] = []
        for info in infos:
            if info.key != own:
                (stale if now - info.modified > LOCK_STALE_S else live).append(info.key)
        return live, stale

    def _write_lock(self, key: str, kind: str) -> None:
        body = {"kind": kind, "holder": self.holder, "time": time.time()}
        self.backend.put(key, json.dumps(body).encode())

    @contextlib.contextmanager
    def _held(self, kind: Literal["commit", "gc"]) -> Iterator[str]:
        """A lock object, refreshed while held and removed after."""
        key = f"locks/{kind}-{uuid.uuid4().hex}.json"
        self._write_lock(key, kind)
        stop = threading.Event()

        def refresh() -> None:
            while not stop.wait(LOCK_REFRESH_S):
                try:
                    self._write_lock(key, kind)
                except Exception:  # noqa: BLE001 - retried at the next tick
                    log.warning("could not refresh repository lock %s", key, exc_info=True)

        refresher = threading.Thread(target=refresh, name="aenv-repo-lock", daemon=True)
        refresher.start()
        try:
            yield key
        finally:
            stop.set()
            refresher.join()  # a refresh in flight must not bring the lock back after the delete
            self.backend.delete([key])

    @contextlib.contextmanager
    def lock(self, kind: Literal["commit"], wait_s: float = 3600) -> Iterator[str]:
        """Held while a commit uploads: no collection starts until it is released."""
        with self._held(kind) as key:
            deadline = time.monotonic() + wait_s
            while any(k.startswith("locks/gc-") for k in self._locks(key)[0]):
                if time.monotonic() > deadline:
                    raise StorageError("the repository's garbage collection has held its lock for too long")
                time.sleep(0.2)
            yield key

    def _still_holding(self, key: str) -> None:
        """Before a commit names what it uploaded: a collector that took our lock for stale (we
        stalled for minutes) may have removed some of it."""
        if not self.backend.exists(key):
            raise StorageError("the commit's repository lock expired while it ran; nothing was committed")

    # -- garbage collection ------------------------------------------------------------------------
    def gc(self) -> GcReport:
        """Delete artifacts and chunks no entry needs. Backs off (``skipped``) while anyone else
        holds a lock: it never deletes a chunk a commit in progress is about to name."""
        started = time.monotonic()
        report = GcReport()
        with self._held("gc") as key:
            live, stale = self._locks(key)
            if stale:
                log.warning("removing %d stale repository locks", len(stale))
                self.backend.delete(stale)
            if live:
                report.skipped = f"{len(live)} commit(s) or collection(s) in progress"
                report.seconds = round(time.monotonic() - started, 3)
                return report
            live_artifacts: set[str] = set()
            for kind in ENTRY_KINDS:
                for info in self.backend.list(ENTRY_DIRS[kind]):
                    entry_id = info.key.rsplit("/", 1)[-1].removesuffix(".json")
                    entry = self.get_entry(kind, entry_id)  # damaged: raise, collect nothing
                    if entry is None:
                        continue
                    report.entries += 1
                    live_artifacts.update(artifact_key(r.kind, r.id) for r in self.artifact_refs(entry))
            needed: set[str] = set()  # chunk and pack keys
            for akey in live_artifacts:
                try:
                    manifest = load_manifest(self.backend.get(akey), akey)
                except MissingObject:
                    log.error("an entry names %s, which is missing", akey)
                    continue
                check_manifest(manifest, akey)  # damaged: raise, collect nothing
                needed.update(object_keys(manifest))
            report.live_chunks = sum(1 for k in needed if k.startswith("chunks/"))
            report.live_packs = len(needed) - report.live_chunks
            dead_artifacts = [i.key for i in self.backend.list("artifacts/") if i.key not in live_artifacts]
            dead_chunks = [i for i in self.backend.list("chunks/") if i.key not in needed]
            dead_packs = [i for i in self.backend.list("packs/") if i.key not in needed]
            # Manifests first: a manifest left behind by a failed delete must never name a chunk
            # or a pack that is already gone (a later commit would reuse it).
            self.backend.delete(dead_artifacts)
            self.backend.delete([i.key for i in dead_chunks + dead_packs])
            report.deleted_artifacts, report.deleted_chunks = len(dead_artifacts), len(dead_chunks)
            report.deleted_packs = len(dead_packs)
            report.freed_bytes = sum(i.size for i in dead_chunks + dead_packs)
            if isinstance(self.backend, PosixBackend):
                self.backend.sweep_partial_puts(older_than=LOCK_STALE_S)
        report.seconds = round(time.monotonic() - started, 3)
        return report

    # -- checking -----------------------------------------------------------------------------------
    def check(self, *, deep: bool = False) -> list[str]:
        """Problems found: entries naming missing or altered manifests, missing chunks, and with
        ``deep`` every chunk downloaded and verified."""
        problems: list[str] = []
        seen: set[str] = set()
        for kind in ENTRY_KINDS:
            for entry in self.entries(kind):
                for ref in self.artifact_refs(entry):
                    what = f"{kind} {entry['id']}"
                    try:
                        manifest = self.read_manifest(ref, what)
                        check_manifest(manifest, what)
                    except ArtifactDamaged as exc:
                        problems.append(exc.message)
                        continue
                    if is_packed(manifest):
                        problems += self._check_packs(manifest, what, seen, deep)
                        continue
                    for digest, length in manifest["chunks"]:
                        if digest in seen:
                            continue
                        seen.add(digest)
                        try:
                            if deep:
                                read_chunk(self.backend, (digest, length), what)
                            elif not self.backend.exists(chunk_key(digest)):
                                problems.append(f"{what}: chunk {digest[:16]} is missing from the repository")
                        except ArtifactDamaged as exc:
                            problems.append(exc.message)
        return problems

    def _check_packs(self, manifest: dict[str, Any], what: str, seen: set[str], deep: bool) -> list[str]:
        problems = []
        for digest, size in manifest["packs"]:
            if digest in seen:
                continue
            seen.add(digest)
            try:
                found = self.backend.size(pack_key(digest))
            except MissingObject:
                problems.append(f"{what}: pack {digest[:16]} is missing from the repository")
                continue
            if found != size:
                problems.append(f"{what}: pack {digest[:16]} is {found} bytes where its manifest says {size}")
        if deep and not problems:
            try:
                for _ in self._chunks(manifest, what):
                    pass
            except ArtifactDamaged as exc:
                problems.append(exc.message)
        return problems


def _bytes_under(path: Path) -> int:
    """Bytes of the regular files in a directory (a checkpoint image: a few files)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _joined(chunks: Iterator[bytes | memoryview], size: int = 1 << 20) -> Iterator[bytes]:
    """Small chunks as blocks of about ``size``: a ~4 KiB write each into tar's pipe cost more than
    the rest of a fetch."""
    block: list[bytes | memoryview] = []
    held = 0
    for chunk in chunks:
        block.append(chunk)
        held += len(chunk)
        if held >= size:
            yield b"".join(block)
            block, held = [], 0
    if block:
        yield b"".join(block)


def _counted(chunks: Iterator[bytes], on_bytes: Callable[[int], None]) -> Iterator[bytes]:
    for chunk in chunks:
        on_bytes(len(chunk))
        yield chunk
