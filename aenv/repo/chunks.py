"""Content-defined chunks: cut, named by their SHA-256, stored zstd-compressed, verified on read.

Cut points come from FastCDC over the content itself, so an insertion early in a stream moves only
the chunks around it and everything after still matches what the repository already holds. A
chunk's name is the digest of its *uncompressed* bytes: reading one back decompresses, hashes and
compares, so a flipped bit anywhere is caught before a byte of it reaches a sandbox.
"""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import fastcdc
import zstandard

from aenv.errors import ArtifactDamaged
from aenv.repo.backends import Backend, MissingObject


@dataclass(frozen=True)
class Sizes:
    """FastCDC's smallest, average and largest chunk."""

    min: int
    avg: int
    max: int


# Layers, uppers and guests: loose objects of ~1 MiB (files change whole; one request a chunk).
FILE_SIZES = Sizes(256 * 1024, 1024 * 1024, 4 * 1024 * 1024)
CHUNK_MIN, CHUNK_AVG, CHUNK_MAX = FILE_SIZES.min, FILE_SIZES.avg, FILE_SIZES.max
WINDOW = 16 * 1024 * 1024  # bytes cut at a time; the tail carries over to the next window
ZSTD_LEVEL = 3

ChunkRef = tuple[str, int]  # (sha256 hex of the raw bytes, raw length)


def chunk_key(digest: str) -> str:
    return f"chunks/{digest[:2]}/{digest}"


def cut(blocks: Iterable[bytes], sizes: Sizes = FILE_SIZES) -> Iterator[bytes]:
    """Split a stream, given as blocks of any size, into content-defined chunks."""
    buf = bytearray()
    for block in blocks:
        buf += block
        if len(buf) < WINDOW:
            continue
        pending = bytes(buf)
        pieces = list(fastcdc.fastcdc(pending, sizes.min, sizes.avg, sizes.max))
        for c in pieces[:-1]:
            yield pending[c.offset : c.offset + c.length]
        last = pieces[-1]  # cut by the window's end, not by content: decide it with more data
        buf = bytearray(pending[last.offset :])
    if buf:
        pending = bytes(buf)
        for c in fastcdc.fastcdc(pending, sizes.min, sizes.avg, sizes.max):
            yield pending[c.offset : c.offset + c.length]


@dataclass
class WriteStats:
    logical_bytes: int = 0  # bytes of the streams committed
    chunks: int = 0
    new_chunks: int = 0
    new_bytes: int = 0  # compressed bytes actually uploaded
    new_objects: int = 0  # objects uploaded: loose chunks and packs

    def add(self, other: WriteStats) -> None:
        self.logical_bytes += other.logical_bytes
        self.chunks += other.chunks
        self.new_chunks += other.new_chunks
        self.new_bytes += other.new_bytes
        self.new_objects += other.new_objects


@dataclass
class ChunkWriter:
    """Uploads the chunks of one commit in parallel, each once, skipping what the store has."""

    backend: Backend
    pool: ThreadPoolExecutor
    max_in_flight: int = 16
    stats: WriteStats = field(default_factory=WriteStats)
    _seen: set[str] = field(default_factory=set)
    _in_flight: deque[Future[None]] = field(default_factory=deque)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def write_stream(self, blocks: Iterable[bytes]) -> list[ChunkRef]:
        refs: list[ChunkRef] = []
        for raw in cut(blocks):
            digest = hashlib.sha256(raw).hexdigest()
            refs.append((digest, len(raw)))
            self.stats.logical_bytes += len(raw)
            self.stats.chunks += 1
            if digest in self._seen:
                continue
            self._seen.add(digest)
            while len(self._in_flight) >= self.max_in_flight:  # bounds the memory held in chunks
                self._in_flight.popleft().result()
            self._in_flight.append(self.pool.submit(self._upload, digest, raw))
        return refs

    def _upload(self, digest: str, raw: bytes) -> None:
        key = chunk_key(digest)
        if self.backend.exists(key):
            return
        data = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)
        self.backend.put(key, data)
        with self._lock:
            self.stats.new_chunks += 1
            self.stats.new_bytes += len(data)
            self.stats.new_objects += 1

    def flush(self) -> None:
        """Wait for every upload; the first failure is raised."""
        while self._in_flight:
            self._in_flight.popleft().result()


def inflate(unzstd: zstandard.ZstdDecompressor, frame: bytes | memoryview, length: int) -> bytes:
    """A zstd frame's content, never more than ``length`` bytes of memory: a frame whose header
    says another size is refused before anything is allocated (zstd allocates what a header
    says and ignores ``max_output_size``: a 2 KB frame claimed, and took, 64 MiB)."""
    claimed = zstandard.frame_content_size(frame)
    if claimed not in (-1, length):
        raise zstandard.ZstdError(f"its frame says {claimed} bytes, not {length}")
    return unzstd.decompress(frame, max_output_size=length)


def read_chunk(backend: Backend, ref: ChunkRef, what: str) -> bytes:
    digest, length = ref
    if not isinstance(length, int) or not 0 < length <= CHUNK_MAX:  # what is decompressed is held in memory
        raise ArtifactDamaged(f"{what}: chunk {str(digest)[:16]} claims {length!r} bytes (at most {CHUNK_MAX})")
    try:
        data = backend.get(chunk_key(digest))
    except MissingObject:
        raise ArtifactDamaged(f"{what}: chunk {digest[:16]} is missing from the repository") from None
    try:
        raw = inflate(zstandard.ZstdDecompressor(), data, length)
    except zstandard.ZstdError as exc:
        raise ArtifactDamaged(f"{what}: chunk {digest[:16]} is corrupt ({exc})") from None
    if len(raw) != length or hashlib.sha256(raw).hexdigest() != digest:
        raise ArtifactDamaged(f"{what}: chunk {digest[:16]} is corrupt (content does not match its digest)")
    return raw


def read_chunks(backend: Backend, refs: list[ChunkRef], pool: ThreadPoolExecutor, what: str) -> Iterator[bytes]:
    """Verified chunk contents in order, fetched a few ahead in parallel."""
    ahead: deque[Future[bytes]] = deque()
    todo = iter(refs)
    try:
        for ref in todo:
            ahead.append(pool.submit(read_chunk, backend, ref, what))
            if len(ahead) >= 8:
                break
        while ahead:
            raw = ahead.popleft().result()
            nxt = next(todo, None)
            if nxt is not None:
                ahead.append(pool.submit(read_chunk, backend, nxt, what))
            yield raw
    finally:
        for f in ahead:
            f.cancel()
