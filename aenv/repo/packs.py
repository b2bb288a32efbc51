"""Packs: the small chunks of a checkpoint image, many to an object, each read back by its range.

A checkpoint's page file keeps its pages at stable offsets, and between two snapshots (or durable
pauses) of an idle sandbox only a few scattered pages change. Cut in ~1 MiB chunks, every chunk of
it is new again; cut small, most chunks are shared, but as loose objects an image would be hundreds
of them (a request each to upload, to ask about and to fetch). So an image is cut small
(`image_sizes`) and the chunks its commit did not find elsewhere go, zstd-compressed one by one,
into one object: a pack (``packs/ab/<sha256 of the pack>``; a bounded few for a large image). The
artifact's manifest (format ``aenv-artifact/2``) keeps the ordered chunk list as before and, beside
it, a pack table (digest, size) and each chunk's place: (pack, offset, stored length).

Deduplication: a commit references a chunk the repository holds in a pack instead of uploading it
again, when this process knows where it is (`PackIndex`: what it wrote, and what it read back and
verified; bounded) and the pack is there with the size known. A commit references an older pack
only if it uses at least `REUSE_MIN` of that pack's bytes (and at most `MAX_REUSED` older packs);
the chunks it would take from a pack it uses less of are copied into its own pack instead. So
every pack a live manifest names is at least a quarter used by one of them, and the collector,
which deletes a pack only when no live manifest names it, leaves at most 4x what packed images
use: no repacking, no rewrite of a manifest (entries name manifests by digest).

Reads plan a window of the chunk list at a time, sort its chunks by (pack, offset), read each pack's
byte ranges with small gaps between needed chunks merged (a ranged GET on S3, pread on a
directory), a few ranges in flight, and give the chunks back in order. Whatever the manifest says
is checked before a byte is asked for: places inside the pack's size, stored lengths no larger
than the chunk can compress to; the store's size of the pack must be the manifest's, a short read
is a truncated pack, and every chunk is decompressed into at most its length and hashed.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import zstandard

from aenv.errors import ArtifactDamaged
from aenv.repo.backends import Backend, MissingObject
from aenv.repo.chunks import CHUNK_MAX, FILE_SIZES, ZSTD_LEVEL, ChunkRef, Sizes, WriteStats, cut, inflate

# Chunks of a checkpoint image: ~4 KiB (a page) while the image is small, twice as large for each
# doubling past IMAGE_CHUNKS of them (a manifest lists every chunk: ~45 bytes each, compressed).
# Measured on images of an idle sandbox (docs/architecture.md, "Incremental memory").
IMAGE_AVG = 4 * 1024
IMAGE_CHUNKS = 8192
PACK_TARGET = 32 << 20  # a pack is sealed and uploaded once it holds this much
RANGE_MAX = 2 << 20  # stored bytes one ranged read asks for (more when one chunk is larger)
GAP_MAX = 128 << 10  # unneeded bytes between two needed chunks read through rather than asked again
WINDOW = 8 << 20  # chunk bytes a read plans (and holds) at a time; the next window is read meanwhile
COMPRESS_AHEAD = 8  # compression tasks in flight while a commit cuts
REUSE_MIN = 0.25  # share of an older pack's bytes a commit must use to reference it
MAX_REUSED = 16  # older packs one artifact references
INDEX_CHUNKS = 65536  # chunk places a repository remembers (~2 GiB of images at 32 KiB a chunk)

DIGEST = re.compile(r"[0-9a-f]{64}")
COMPRESS_BATCH = 64 << 10  # chunk bytes one compression task takes (a task per 4 KiB chunk costs more)
Place = tuple[str, int, int, int]  # (pack digest, pack size, offset, stored length)


def image_sizes(stream_bytes: int) -> Sizes:
    """The chunk sizes of an image of about ``stream_bytes``: two images of one sandbox a small
    change apart get the same ones (unless their sizes straddle a doubling)."""
    avg = IMAGE_AVG
    while stream_bytes > IMAGE_CHUNKS * avg and avg < FILE_SIZES.avg:
        avg *= 2
    return Sizes(avg // 2, avg, avg * 4)


def pack_key(digest: str) -> str:
    return f"packs/{digest[:2]}/{digest}"


def frame_bound(length: int) -> int:
    """The most a chunk of ``length`` bytes takes as a zstd frame (zstd's bound, generously)."""
    return length + (length >> 7) + 1024


def _is_digest(value: object) -> bool:
    return isinstance(value, str) and DIGEST.fullmatch(value) is not None


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_packed(manifest: dict[str, Any], what: str) -> None:
    """A packed manifest's pack table and places, as another node (or anyone who can write the
    repository) may have written them: well formed, every place inside its pack, every pack used."""
    chunks, packs, where = manifest.get("chunks"), manifest.get("packs"), manifest.get("where")
    if not isinstance(packs, list) or not isinstance(where, list) or not isinstance(chunks, list):
        raise ArtifactDamaged(f"{what}: malformed manifest (packs or places)")
    if len(where) != len(chunks) or len(packs) > len(chunks):
        raise ArtifactDamaged(f"{what}: malformed manifest (a place for each chunk, no more packs than chunks)")
    for pack in packs:
        if not (isinstance(pack, list) and len(pack) == 2 and _is_digest(pack[0]) and _is_count(pack[1]) and pack[1]):
            raise ArtifactDamaged(f"{what}: malformed manifest (packs are sha256 digests and sizes)")
    used = set()
    for (_, length), place in zip(chunks, where, strict=True):
        if not 0 < length <= CHUNK_MAX:  # what is decompressed is held in memory
            raise ArtifactDamaged(f"{what}: a chunk claims {length!r} bytes (at most {CHUNK_MAX})")
        if not (isinstance(place, list) and len(place) == 3 and all(_is_count(n) for n in place)):
            raise ArtifactDamaged(f"{what}: malformed manifest (places are pack, offset, length)")
        p, offset, stored = place
        if not 0 < stored <= frame_bound(length):
            raise ArtifactDamaged(
                f"{what}: a chunk stored in {stored} bytes where {length} bytes take at most {frame_bound(length)}"
            )
        if p >= len(packs) or offset + stored > packs[p][1]:
            raise ArtifactDamaged(f"{what}: a chunk's place ({p}, {offset}, {stored}) is outside its pack")
        used.add(p)
    if len(used) != len(packs):
        raise ArtifactDamaged(f"{what}: malformed manifest (a pack no chunk is in)")


def packs_of(manifest: dict[str, Any]) -> list[str]:
    """The pack digests a (checked) packed manifest names."""
    return [digest for digest, _ in manifest.get("packs") or []]


@dataclass(frozen=True, slots=True)
class Want:
    """One chunk to read: its digest and length, and where it lies."""

    digest: str
    length: int
    pack: str
    pack_size: int
    offset: int
    stored: int


def wants_of(manifest: dict[str, Any]) -> list[Want]:
    packs = manifest["packs"]
    return [
        Want(d, n, packs[p][0], packs[p][1], off, stored)
        for (d, n), (p, off, stored) in zip(manifest["chunks"], manifest["where"], strict=True)
    ]


# -- reading ------------------------------------------------------------------------------------------
def _ranges(wants: Iterable[Want]) -> list[list[Want]]:
    """Distinct chunks by (pack, offset), those of one pack close together read as one range."""
    places = sorted({(w.pack, w.offset, w.stored): w for w in wants}.values(), key=lambda w: (w.pack, w.offset))
    out: list[list[Want]] = []
    for w in places:
        last = out[-1] if out else None
        if (
            last is not None
            and last[-1].pack == w.pack
            and 0 <= w.offset - (last[-1].offset + last[-1].stored) <= GAP_MAX
            and w.offset + w.stored - last[0].offset <= RANGE_MAX
        ):
            last.append(w)
        else:
            out.append([w])
    return out


def _read_range(backend: Backend, group: list[Want], what: str) -> tuple[int, bytes]:
    """(offset, bytes) of one range of a pack, checked against the size its manifest says."""
    first = group[0]
    start, end = first.offset, max(w.offset + w.stored for w in group)
    short = first.pack[:16]
    try:
        data, total = backend.get_range(pack_key(first.pack), start, end - start)
    except MissingObject:
        raise ArtifactDamaged(f"{what}: pack {short} is missing from the repository") from None
    if total != first.pack_size:
        raise ArtifactDamaged(f"{what}: pack {short} is {total} bytes where its manifest says {first.pack_size}")
    if len(data) != end - start:
        raise ArtifactDamaged(f"{what}: pack {short} is truncated")
    return start, data


def _open(unzstd: zstandard.ZstdDecompressor, w: Want, frame: memoryview, what: str) -> bytes:
    """A chunk's bytes from its stored frame, verified."""
    try:
        raw = inflate(unzstd, frame, w.length)
    except zstandard.ZstdError as exc:
        raise ArtifactDamaged(f"{what}: chunk {w.digest[:16]} in pack {w.pack[:16]} is corrupt ({exc})") from None
    if len(raw) != w.length or hashlib.sha256(raw).hexdigest() != w.digest:
        message = f"chunk {w.digest[:16]} in pack {w.pack[:16]} is corrupt (content does not match its digest)"
        raise ArtifactDamaged(f"{what}: {message}")
    return raw


def _windows(wants: list[Want]) -> Iterator[list[Want]]:
    window: list[Want] = []
    size = 0
    for w in wants:
        if window and size + w.length > WINDOW:
            yield window
            window, size = [], 0
        window.append(w)
        size += w.length
    if window:
        yield window


Fetching = dict[tuple[str, int], Future[tuple[int, bytes]]]  # (pack, offset) -> its range's read


def read_packed(
    backend: Backend, wants: list[Want], pool: ThreadPoolExecutor, what: str, *, frames: bool = False
) -> Iterator[tuple[Want, bytes]]:
    """``wants`` in order with their verified bytes (with ``frames``, their stored frames, verified
    all the same). Ranges are read on the pool, a window ahead; chunks are opened here, as they
    are given back (the pool's threads would only contend for the interpreter)."""
    todo = _windows(wants)
    ahead: deque[tuple[list[Want], Fetching]] = deque()

    def submit() -> None:
        window = next(todo, None)
        if window is None:
            return
        fetching: Fetching = {}
        for group in _ranges(window):
            future = pool.submit(_read_range, backend, group, what)
            fetching.update(((w.pack, w.offset), future) for w in group)
        ahead.append((window, fetching))

    unzstd = zstandard.ZstdDecompressor()
    try:
        submit()
        while ahead:
            submit()  # the next window is read while this one is given back
            window, fetching = ahead.popleft()
            for w in window:
                start, data = fetching[(w.pack, w.offset)].result()
                frame = memoryview(data)[w.offset - start : w.offset - start + w.stored]
                raw = _open(unzstd, w, frame, what)
                yield w, bytes(frame) if frames else raw
    finally:
        for _, fetching in ahead:
            for future in fetching.values():
                future.cancel()


# -- what a repository knows of packs -------------------------------------------------------------------
class PackIndex:
    """Where chunks lie in packs this process wrote or read back whole and verified: what a commit
    need not upload again. Bounded: the packs used longest ago are forgotten first."""

    def __init__(self, limit: int = INDEX_CHUNKS) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._packs: OrderedDict[str, tuple[int, dict[str, tuple[int, int]]]] = OrderedDict()
        self._where: dict[str, str] = {}  # chunk digest -> pack digest
        self._count = 0

    def add(self, manifest: dict[str, Any]) -> None:
        """Learn a checked packed manifest's places."""
        with self._lock:
            for w in wants_of(manifest):
                size, places = self._packs.setdefault(w.pack, (w.pack_size, {}))
                if size != w.pack_size:
                    continue  # another manifest gave this pack another size: the first one seen stands
                if w.digest not in places:
                    places[w.digest] = (w.offset, w.stored)
                    self._count += 1
                self._where[w.digest] = w.pack
                self._packs.move_to_end(w.pack)
            while self._count > self.limit and self._packs:
                self._drop(next(iter(self._packs)))

    def find(self, digest: str) -> Place | None:
        with self._lock:
            pack = self._where.get(digest)
            if pack is None:
                return None
            size, places = self._packs[pack]
            offset, stored = places[digest]
            return pack, size, offset, stored

    def forget(self, pack: str) -> None:
        with self._lock:
            if pack in self._packs:
                self._drop(pack)

    def __len__(self) -> int:
        return self._count

    def _drop(self, pack: str) -> None:
        _, places = self._packs.pop(pack)
        self._count -= len(places)
        for digest in places:
            if self._where.get(digest) == pack:
                del self._where[digest]


# -- writing -----------------------------------------------------------------------------------------
def _compress(batch: list[bytes]) -> list[bytes]:
    zstd = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return [zstd.compress(raw) for raw in batch]


@dataclass
class PackWriter:
    """One artifact's stream, cut small: chunks known elsewhere referenced, the rest packed."""

    backend: Backend
    pool: ThreadPoolExecutor
    index: PackIndex
    stats: WriteStats
    what: str = "commit"
    _refs: list[ChunkRef] = field(default_factory=list)
    # digest -> (older pack digest, or the number of a pack of this stream; offset; stored length)
    _places: dict[str, tuple[str | int, int, int]] = field(default_factory=dict)
    _older: dict[str, int] = field(default_factory=dict)  # older packs found usable: digest -> size
    _missing: set[str] = field(default_factory=set)  # older packs that are gone or not their size
    _use: Counter[str] = field(default_factory=Counter)  # stored bytes taken from each older pack
    _lengths: dict[str, int] = field(default_factory=dict)
    _batch: list[tuple[str, bytes]] = field(default_factory=list)
    _batched: int = 0
    _compressing: deque[tuple[list[str], Future[list[bytes]]]] = field(default_factory=deque)
    _buf: bytearray = field(default_factory=bytearray)
    _sealed: list[tuple[str, int]] = field(default_factory=list)
    _upload: Future[None] | None = None

    def write(self, blocks: Iterable[bytes], sizes: Sizes) -> None:
        for raw in cut(blocks, sizes):
            digest = hashlib.sha256(raw).hexdigest()
            self._refs.append((digest, len(raw)))
            self.stats.logical_bytes += len(raw)
            self.stats.chunks += 1
            if digest in self._places:
                continue
            self._lengths[digest] = len(raw)
            known = self.index.find(digest)
            if known is not None and self._usable(known[0], known[1]):
                pack, _, offset, stored = known
                self._places[digest] = (pack, offset, stored)
                self._use[pack] += stored
                continue
            self._places[digest] = ("", 0, 0)  # placed once compressed
            self._batch.append((digest, raw))
            self._batched += len(raw)
            if self._batched >= COMPRESS_BATCH:
                self._submit()

    def _submit(self) -> None:
        if self._batch:
            digests, raws = [d for d, _ in self._batch], [r for _, r in self._batch]
            self._compressing.append((digests, self.pool.submit(_compress, raws)))
            self._batch, self._batched = [], 0
        while len(self._compressing) > COMPRESS_AHEAD:
            self._take()

    def _usable(self, pack: str, size: int) -> bool:
        """The older pack is in the repository with the size its manifest said (asked once)."""
        if pack in self._older:
            return True
        if pack in self._missing:
            return False
        try:
            ok = self.backend.size(pack_key(pack)) == size
        except (MissingObject, ArtifactDamaged):
            ok = False
        if ok:
            self._older[pack] = size
        else:
            self._missing.add(pack)
            self.index.forget(pack)
        return ok

    def _take(self) -> None:
        digests, future = self._compressing.popleft()
        for digest, frame in zip(digests, future.result(), strict=True):
            self._append(digest, frame)

    def _append(self, digest: str, frame: bytes) -> None:
        self._places[digest] = (len(self._sealed), len(self._buf), len(frame))
        self._buf += frame
        self.stats.new_chunks += 1
        if len(self._buf) >= PACK_TARGET:
            self._seal()

    def _seal(self) -> None:
        if not self._buf:
            return
        data = bytes(self._buf)
        self._buf = bytearray()
        digest = hashlib.sha256(data).hexdigest()
        self._sealed.append((digest, len(data)))
        if self._upload is not None:
            self._upload.result()  # one upload at a time: at most two packs in memory
        self._upload = self.pool.submit(self.backend.put, pack_key(digest), data)
        self.stats.new_bytes += len(data)
        self.stats.new_objects += 1

    def finish(self) -> dict[str, Any]:
        """Every pack uploaded; the manifest's ``chunks``, ``packs`` and ``where``."""
        self._submit()
        while self._compressing:
            self._take()
        ranked = sorted(self._use.items(), key=lambda kv: (-kv[1], kv[0]))
        kept = sorted(p for n, (p, used) in enumerate(ranked) if n < MAX_REUSED and used >= REUSE_MIN * self._older[p])
        moved = [
            Want(d, self._lengths[d], str(pack), self._older[str(pack)], offset, stored)
            for d, (pack, offset, stored) in self._places.items()
            if isinstance(pack, str) and pack not in kept
        ]
        moved.sort(key=lambda w: (w.pack, w.offset))
        for w, frame in read_packed(self.backend, moved, self.pool, self.what, frames=True):
            self._append(w.digest, frame)  # copied as stored: verified on the way
        self._seal()
        if self._upload is not None:
            self._upload.result()
        table = [[p, self._older[p]] for p in kept] + [[d, n] for d, n in self._sealed]
        number = {p: i for i, p in enumerate(kept)}
        where = []
        for digest, _ in self._refs:
            pack, offset, stored = self._places[digest]
            where.append([number[pack] if isinstance(pack, str) else len(kept) + pack, offset, stored])
        return {"chunks": [list(r) for r in self._refs], "packs": table, "where": where}

    def abandon(self) -> None:
        for _, future in self._compressing:
            future.cancel()
        if self._upload is not None:
            self._upload.cancel()
