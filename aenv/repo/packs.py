"""Packs: the small chunks of a checkpoint image, many to an object, read back by byte ranges.

A checkpoint's page file keeps its pages at stable offsets, and between two snapshots (or durable
pauses) of an idle sandbox only a few scattered pages change. Cut in ~1 MiB chunks, every chunk of
it is new again; cut small, most chunks are shared, but as loose objects an image would be hundreds
of them (a request each to upload, to ask about and to fetch). So an image is cut small
(`chunk_sizes`) and the chunks its commit did not find elsewhere go into one object, a pack
(``packs/ab/<sha256 of the pack>``; a bounded few for a large image): zstd frames one after the
other, each of a run of new chunks up to `FRAME_TARGET` (a frame a chunk cost more to compress and
to inflate than all else of a fetch). The artifact's manifest (format ``aenv-artifact/2``) keeps
the ordered chunk list as before and, beside it, a pack table (digest, size) and each chunk's
place: (pack, frame offset, frame's stored length, frame's length, chunk's offset in the frame).

Deduplication: a commit references a chunk the repository holds in a pack instead of uploading it
again, when this process knows where it is (`PackIndex`: what it wrote, and what it read back and
verified; bounded) and the pack is there with the size known. A commit references an older pack
only if the frames it uses are at least `REUSE_MIN` of that pack's bytes (and at most `MAX_REUSED`
older packs); the chunks it would take from a pack it uses less of are copied into its own pack
instead. So every pack a live manifest names is at least a quarter used by one of them, and the
collector, which deletes a pack only when no live manifest names it, leaves at most 4x what packed
images use: no repacking, no rewrite of a manifest (entries name manifests by digest).

Reads plan a window of the chunk list at a time, sort its frames by (pack, offset), read each
pack's byte ranges with small gaps between needed frames merged (a ranged GET on S3, pread on a
directory) on the pool a window ahead, and give the chunks back in order, inflating each frame
once (a few recent ones are kept). Whatever the manifest says is checked before a byte is asked
for: places inside the pack's size, frames no longer than `FRAME_MAX` (or their one chunk) and
stored in no more than they can compress to, chunks inside their frame; the store's size of the
pack must be the manifest's, a short read is a truncated pack, a frame whose header says another
length is refused before it is inflated, every chunk is hashed, and a fetch that inflates more
than 3x its size (frames named again and again) stops.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import zstandard

from aenv.errors import ArtifactDamaged
from aenv.repo.backends import Backend, MissingObject
from aenv.repo.chunks import CHUNK_MAX, FILE_SIZES, ZSTD_LEVEL, ChunkRef, Sizes, WriteStats, cut, inflate

# Chunks of a checkpoint image: ~4 KiB (a page) while the image is small, twice as large for each
# doubling past PACKED_CHUNKS of them (a manifest lists every chunk: ~45 bytes each, compressed).
# A sealed upper's: ~32 KiB (ext4 changes a few blocks between two pauses; 4 KiB chunks of a
# 21 MiB upper shared as much but listed 5285 chunks). Measured on an idle sandbox's images and
# uppers (docs/architecture.md, "Incremental memory").
IMAGE_AVG = 4 * 1024
UPPER_AVG = 32 * 1024
PACKED_CHUNKS = 8192
FRAME_TARGET = 64 << 10  # new chunks compressed together until a frame holds this much
FRAME_MAX = 128 << 10  # the most a frame of several chunks holds (a larger chunk is a frame alone)
PACK_TARGET = 32 << 20  # a pack is sealed and uploaded once it holds this much
RANGE_MAX = 4 << 20  # stored bytes one ranged read asks for (more when one frame is larger)
GAP_MAX = 128 << 10  # unneeded bytes between two needed frames read through rather than asked again
WINDOW = 16 << 20  # frame bytes a read plans (and holds) at a time; the next window is read meanwhile
KEPT_FRAMES = 16  # inflated frames a read keeps (the chunks of one are seldom all in a row)
INFLATE_MAX = 3  # a read inflates at most this many times the artifact's size (+ a window)
COMPRESS_AHEAD = 8  # frames compressed in parallel while a commit cuts
REUSE_MIN = 0.25  # share of an older pack's bytes a commit must use to reference it
MAX_REUSED = 16  # older packs one artifact references (more for one of more than 32 MiB)
INDEX_CHUNKS = 65536  # chunk places a repository remembers (~256 MiB of images at 4 KiB a chunk)

DIGEST = re.compile(r"[0-9a-f]{64}")
# (pack digest, pack size, frame offset, frame's stored length, frame's length, offset in the frame)
Place = tuple[str, int, int, int, int, int]


def chunk_sizes(kind: str, stream_bytes: int) -> Sizes:
    """The chunk sizes of a packed image (or upper) of about ``stream_bytes``: two of one sandbox
    a small change apart get the same ones (unless their sizes straddle a doubling)."""
    avg = IMAGE_AVG if kind == "image" else UPPER_AVG
    while stream_bytes > PACKED_CHUNKS * avg and avg < FILE_SIZES.avg:
        avg *= 2
    return Sizes(avg // 2, avg, avg * 4)


def pack_key(digest: str) -> str:
    return f"packs/{digest[:2]}/{digest}"


def frame_bound(length: int) -> int:
    """The most ``length`` bytes take as a zstd frame (zstd's bound, generously)."""
    return length + (length >> 7) + 1024


def _is_digest(value: object) -> bool:
    return isinstance(value, str) and DIGEST.fullmatch(value) is not None


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0  # not a bool


def check_packed(manifest: dict[str, Any], what: str) -> None:
    """A packed manifest's pack table and places, as another node (or anyone who can write the
    repository) may have written them: well formed, every frame inside its pack, every chunk
    inside its frame, every pack used."""
    chunks, packs, where = manifest.get("chunks"), manifest.get("packs"), manifest.get("where")
    if not isinstance(packs, list) or not isinstance(where, list) or not isinstance(chunks, list):
        raise ArtifactDamaged(f"{what}: malformed manifest (packs or places)")
    if len(where) != len(chunks) or len(packs) > len(chunks):
        raise ArtifactDamaged(f"{what}: malformed manifest (a place for each chunk, no more packs than chunks)")
    for pack in packs:
        if not (isinstance(pack, list) and len(pack) == 2 and _is_digest(pack[0]) and _is_count(pack[1]) and pack[1]):
            raise ArtifactDamaged(f"{what}: malformed manifest (packs are sha256 digests and sizes)")
    used = set()
    sizes = [size for _, size in packs]
    for (_, length), place in zip(chunks, where, strict=True):
        if not 0 < length <= CHUNK_MAX:  # what is decompressed is held in memory
            raise ArtifactDamaged(f"{what}: a chunk claims {length!r} bytes (at most {CHUNK_MAX})")
        if type(place) is not list or len(place) != 5 or not all(type(n) is int and n >= 0 for n in place):
            raise ArtifactDamaged(f"{what}: malformed manifest (places are five counts)")
        p, offset, stored, raw, inner = place
        if not 0 < raw <= max(FRAME_MAX, length) or inner + length > raw:
            raise ArtifactDamaged(f"{what}: a chunk of {length} bytes at {inner} of a frame of {raw}")
        if not 0 < stored <= frame_bound(raw):
            raise ArtifactDamaged(
                f"{what}: a frame stored in {stored} bytes where {raw} bytes take at most {frame_bound(raw)}"
            )
        if p >= len(sizes) or offset + stored > sizes[p]:
            raise ArtifactDamaged(f"{what}: a frame's place ({p}, {offset}, {stored}) is outside its pack")
        used.add(p)
    if len(used) != len(packs):
        raise ArtifactDamaged(f"{what}: malformed manifest (a pack no chunk is in)")


def packs_of(manifest: dict[str, Any]) -> list[str]:
    """The pack digests a (checked) packed manifest names."""
    return [digest for digest, _ in manifest.get("packs") or []]


class Want(NamedTuple):
    """One chunk to read: its digest and length, and where it lies (a tuple: thousands an image)."""

    digest: str
    length: int
    pack: str
    pack_size: int
    offset: int  # of its frame in the pack
    stored: int  # the frame's bytes in the pack
    raw: int  # the frame's length inflated
    inner: int  # the chunk's offset in the inflated frame

    @property
    def frame(self) -> tuple[str, int]:
        return self.pack, self.offset


def wants_of(manifest: dict[str, Any]) -> list[Want]:
    packs = manifest["packs"]
    return [
        Want(d, n, packs[p][0], packs[p][1], off, stored, raw, inner)
        for (d, n), (p, off, stored, raw, inner) in zip(manifest["chunks"], manifest["where"], strict=True)
    ]


# -- reading ------------------------------------------------------------------------------------------
def _ranges(frames: Iterable[Want]) -> list[list[Want]]:
    """Frames by (pack, offset), those of one pack close together read as one range."""
    out: list[list[Want]] = []
    for w in sorted(frames, key=lambda w: w.frame):
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


def _windows(wants: list[Want]) -> Iterator[tuple[list[Want], dict[tuple[str, int], Want]]]:
    """Runs of ``wants`` whose distinct frames inflate to at most WINDOW (one frame at least)."""
    window: list[Want] = []
    frames: dict[tuple[str, int], Want] = {}
    size = 0
    for w in wants:
        if w.frame not in frames:
            if window and size + w.raw > WINDOW:
                yield window, frames
                window, frames, size = [], {}, 0
            frames[w.frame] = w
            size += w.raw
        window.append(w)
    if window:
        yield window, frames


Fetching = dict[tuple[str, int], Future[tuple[int, bytes]]]  # frame -> its range's read


def read_packed(
    backend: Backend, wants: list[Want], pool: ThreadPoolExecutor, what: str
) -> Iterator[tuple[Want, memoryview]]:
    """``wants`` in order with their verified bytes. Ranges are read on the pool, a window ahead;
    frames are inflated here, as their chunks are given back (the pool's threads would only
    contend for the interpreter)."""
    todo = _windows(wants)
    ahead: deque[tuple[list[Want], Fetching]] = deque()
    budget = INFLATE_MAX * sum(w.length for w in wants) + WINDOW

    def submit() -> None:
        planned = next(todo, None)
        if planned is None:
            return
        window, frames = planned
        fetching: Fetching = {}
        for group in _ranges(frames.values()):
            future = pool.submit(_read_range, backend, group, what)
            fetching.update((w.frame, future) for w in group)
        ahead.append((window, fetching))

    unzstd = zstandard.ZstdDecompressor()
    kept: OrderedDict[tuple[str, int], memoryview] = OrderedDict()
    sha256 = hashlib.sha256

    def frame_of(w: Want, fetching: Fetching) -> memoryview:
        nonlocal budget
        key = (w.pack, w.offset)
        found = kept.get(key)
        if found is not None:
            kept.move_to_end(key)
            return found
        budget -= w.raw
        if budget < 0:
            raise ArtifactDamaged(f"{what}: its frames inflate to more than {INFLATE_MAX}x its size")
        start, data = fetching[key].result()
        try:
            frame = inflate(unzstd, memoryview(data)[w.offset - start : w.offset - start + w.stored], w.raw)
        except zstandard.ZstdError as exc:
            message = f"a frame in pack {w.pack[:16]} is corrupt ({exc})"
            raise ArtifactDamaged(f"{what}: chunk {w.digest[:16]}: {message}") from None
        if len(frame) != w.raw:
            raise ArtifactDamaged(f"{what}: a frame in pack {w.pack[:16]} is corrupt (its length)")
        kept[key] = found = memoryview(frame)
        if len(kept) > KEPT_FRAMES:
            kept.popitem(last=False)
        return found

    try:
        submit()
        while ahead:
            submit()  # the next window is read while this one is given back
            window, fetching = ahead.popleft()
            current: tuple[str, int] | None = None
            frame = memoryview(b"")
            for w in window:
                if (w.pack, w.offset) != current:  # chunks of one frame mostly come in a row
                    frame, current = frame_of(w, fetching), (w.pack, w.offset)
                raw = frame[w.inner : w.inner + w.length]  # not copied: the caller joins them
                if sha256(raw).hexdigest() != w.digest:
                    where = f"chunk {w.digest[:16]} in pack {w.pack[:16]}"
                    raise ArtifactDamaged(f"{what}: {where} is corrupt (content does not match its digest)")
                yield w, raw
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
        # pack -> (its size, {chunk digest: (frame offset, stored, length, offset in the frame)})
        self._packs: OrderedDict[str, tuple[int, dict[str, tuple[int, int, int, int]]]] = OrderedDict()
        self._where: dict[str, str] = {}  # chunk digest -> pack digest
        self._count = 0

    def add(self, manifest: dict[str, Any]) -> None:
        """Learn a checked packed manifest's places."""
        table = manifest["packs"]
        with self._lock:
            known = []
            for digest, size in table:
                entry = self._packs.setdefault(digest, (size, {}))
                known.append(entry[1] if entry[0] == size else None)  # another size: the first seen stands
                self._packs.move_to_end(digest)
            for (digest, _), (p, *place) in zip(manifest["chunks"], manifest["where"], strict=True):
                places = known[p]
                if places is None:
                    continue
                if digest not in places:
                    places[digest] = (place[0], place[1], place[2], place[3])
                    self._count += 1
                self._where[digest] = table[p][0]
            while self._count > self.limit and self._packs:
                self._drop(next(iter(self._packs)))

    def find(self, digest: str) -> Place | None:
        with self._lock:
            pack = self._where.get(digest)
            if pack is None:
                return None
            size, places = self._packs[pack]
            return (pack, size, *places[digest])

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
def _compress(raws: list[bytes]) -> bytes:
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(b"".join(raws))


@dataclass
class PackWriter:
    """One artifact's stream, cut small: chunks known elsewhere referenced, the rest packed."""

    backend: Backend
    pool: ThreadPoolExecutor
    index: PackIndex
    stats: WriteStats
    what: str = "commit"
    _refs: list[ChunkRef] = field(default_factory=list)
    # digest -> (older pack digest, or the number of a pack of this stream; the rest of its place)
    _places: dict[str, tuple[str | int, int, int, int, int]] = field(default_factory=dict)
    _older: dict[str, int] = field(default_factory=dict)  # older packs found usable: digest -> size
    _missing: set[str] = field(default_factory=set)  # older packs that are gone or not their size
    _frames_used: dict[tuple[str, int], int] = field(default_factory=dict)  # older frames: stored bytes
    _lengths: dict[str, int] = field(default_factory=dict)
    _batch: list[tuple[str, bytes]] = field(default_factory=list)
    _batched: int = 0
    _compressing: deque[tuple[list[tuple[str, int, int]], int, Future[bytes]]] = field(default_factory=deque)
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
                pack, _, offset, stored, length, inner = known
                self._places[digest] = (pack, offset, stored, length, inner)
                self._frames_used[(pack, offset)] = stored
                continue
            self._add(digest, raw)

    def _add(self, digest: str, raw: bytes) -> None:
        """A chunk for this stream's packs: into the frame being gathered."""
        if self._batch and self._batched + len(raw) > FRAME_MAX:
            self._submit()
        self._places[digest] = ("", 0, 0, 0, 0)  # placed once compressed
        self._batch.append((digest, raw))
        self._batched += len(raw)
        if self._batched >= FRAME_TARGET:
            self._submit()

    def _submit(self) -> None:
        if self._batch:
            inner, spans = 0, []
            for digest, raw in self._batch:
                spans.append((digest, inner, len(raw)))
                inner += len(raw)
            future = self.pool.submit(_compress, [raw for _, raw in self._batch])
            self._compressing.append((spans, inner, future))
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
        spans, length, future = self._compressing.popleft()
        frame = future.result()
        offset = len(self._buf)
        for digest, inner, _ in spans:
            self._places[digest] = (len(self._sealed), offset, len(frame), length, inner)
        self._buf += frame
        self.stats.new_chunks += len(spans)
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

    def _drain(self) -> None:
        self._submit()
        while self._compressing:
            self._take()

    def finish(self) -> dict[str, Any]:
        """Every pack uploaded; the manifest's ``chunks``, ``packs`` and ``where``."""
        self._drain()
        use: Counter[str] = Counter()
        for (older, _), stored in self._frames_used.items():
            use[older] += stored
        ranked = sorted(use.items(), key=lambda kv: (-kv[1], kv[0]))
        # A large image or upper spans many packs of its own: as many older ones may be its base.
        most = MAX_REUSED + 2 * (sum(n for _, n in self._refs) // PACK_TARGET)
        kept = sorted(p for n, (p, used) in enumerate(ranked) if n < most and used >= REUSE_MIN * self._older[p])
        moved = [
            Want(d, self._lengths[d], older, self._older[older], *place)
            for d, (older, *place) in self._places.items()
            if isinstance(older, str) and older not in kept
        ]
        moved.sort(key=lambda w: (w.frame, w.inner))
        for w, raw in read_packed(self.backend, moved, self.pool, self.what):
            self._add(w.digest, bytes(raw))  # verified on the way
        self._drain()
        self._seal()
        if self._upload is not None:
            self._upload.result()
        table = [[p, self._older[p]] for p in kept] + [[d, n] for d, n in self._sealed]
        number = {p: i for i, p in enumerate(kept)}
        where = []
        for digest, _ in self._refs:
            which, *place = self._places[digest]
            where.append([number[which] if isinstance(which, str) else len(kept) + which, *place])
        return {"chunks": [list(r) for r in self._refs], "packs": table, "where": where}

    def abandon(self) -> None:
        for _, _, future in self._compressing:
            future.cancel()
        if self._upload is not None:
            self._upload.cancel()
