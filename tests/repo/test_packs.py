"""Checkpoint images in packs: small chunks, the new ones of a commit in one object, read back by
byte ranges; what a second image of a sandbox uploads, what the collector keeps, and what a
hostile repository writer's packs and manifests get (a clear refusal). On a directory and on S3
(a moto server)."""

from __future__ import annotations

import hashlib
import json
import random
import threading
from pathlib import Path
from typing import Any

import pytest
import zstandard

from aenv.errors import ArtifactDamaged
from aenv.repo import packs
from aenv.repo.backends import Backend, PosixBackend
from aenv.repo.chunks import CHUNK_MAX, ChunkWriter
from aenv.repo.repository import (
    ARTIFACT_FORMAT,
    ArtifactRef,
    LocalArtifact,
    Repository,
    artifact_key,
    object_keys,
)

PAGE = 4096
MiB = 2**20


def page_file(rng: random.Random, pages: int) -> bytearray:
    """Memory pages as a checkpoint writes them: half random, half compressible (text-like)."""
    out = bytearray()
    salt = rng.randbytes(4).hex().encode()
    for n in range(pages):
        out += rng.randbytes(PAGE) if n % 2 else (b"page %08d %s " % (n, salt) * PAGE)[:PAGE]
    return out


def image_dir(root: Path, name: str, pages: bytes, meta: bytes = b"meta") -> Path:
    d = root / name
    d.mkdir()
    (d / "checkpoint.img").write_bytes(meta * 100)
    (d / "pages.img").write_bytes(pages)
    return d


def changed(rng: random.Random, pages: bytearray, count: int) -> bytearray:
    out = bytearray(pages)
    for page in rng.sample(range(len(pages) // PAGE), count):
        out[page * PAGE + 100 : page * PAGE + 164] = rng.randbytes(64)
    return out


def objects(backend: Backend) -> set[str]:
    return {i.key for prefix in ("chunks/", "packs/", "artifacts/", "entries/") for i in backend.list(prefix)}


def manifest_of(repo: Repository, kind: str, entry_id: str) -> tuple[ArtifactRef, dict[str, Any]]:
    entry = repo.get_entry(kind, entry_id)  # type: ignore[arg-type]
    assert entry is not None
    ref = repo.artifact_refs(entry)[0]
    return ref, repo.read_manifest(ref, "test")


def fetched(repo: Repository, kind: str, entry_id: str, dest: Path) -> dict[str, bytes]:
    ref, _ = manifest_of(repo, kind, entry_id)
    repo.fetch_artifact(ref, dest, f"{kind} {entry_id}")
    return {p.name: p.read_bytes() for p in dest.iterdir()}


def test_a_second_image_a_few_pages_apart_uploads_about_those_pages_in_one_object(
    backend: Backend, tmp_path: Path
) -> None:
    """Two images of a sandbox, 16 scattered pages of 2048 changed: the second commit uploads
    about those pages (not the 1 MiB chunk around each, as before), as one pack, its manifest and
    its entry: three objects, as the first. Seen failing before (images in loose 1 MiB chunks,
    as Repository(pack_images=False) still writes them): 7 objects and 3.71 MiB; packed 3 and 0.15."""
    repo = Repository(backend)
    rng = random.Random(5)
    first_pages = page_file(rng, 2048)
    one = image_dir(tmp_path, "one", first_pages)
    two = image_dir(tmp_path, "two", changed(rng, first_pages, 16))
    before = objects(backend)
    first = repo.commit("snapshot", "s1", {}, [LocalArtifact("image", "img1", one, "tar")])
    after_first = objects(backend)
    second = repo.commit("snapshot", "s2", {}, [LocalArtifact("image", "img2", two, "tar")])
    new = objects(backend) - after_first
    assert len(after_first - before) == 3 and len(new) == 3, sorted(new)  # a pack, a manifest, an entry
    assert {k.split("/")[0] for k in new} == {"packs", "artifacts", "entries"}
    assert first.chunks > 1000  # small chunks: ~4 KiB
    # 16 pages changed: each makes at most two chunks of at most 16 KiB new, and the manifest
    # lists ~2000 chunks (~45 bytes each, compressed).
    assert second.new_bytes < 16 * 2 * 16 * 1024 + 200 * 1024, second
    assert second.new_bytes < first.new_bytes / 5, (first, second)
    _, manifest = manifest_of(repo, "snapshot", "s2")
    assert len(manifest["packs"]) == 2  # the first image's pack and its own
    for name, folder in (("s1", one), ("s2", two)):
        back = fetched(repo, "snapshot", name, tmp_path / f"back-{name}")
        assert back == {p.name: p.read_bytes() for p in folder.iterdir()}
    assert repo.check(deep=True) == []


def sparse_upper(path: Path, blocks: dict[int, bytes]) -> Path:
    """A sealed upper: a 1 GiB ext4-like image holding ~20 MiB."""
    with open(path, "wb") as f:
        f.truncate(1 << 30)
        for offset, data in blocks.items():
            f.seek(offset)
            f.write(data)
    return path


def test_a_sealed_upper_a_few_blocks_apart_uploads_about_those_blocks(backend: Backend, tmp_path: Path) -> None:
    """The upper of a second pause: the same file data, a few metadata blocks rewritten. Packed
    (~32 KiB chunks) it uploads about those blocks; in loose 1 MiB chunks each block took the
    MiB around it (seen: 0.29 MiB for an idle sandbox's upper, 0.004 packed)."""
    repo = Repository(backend)
    rng = random.Random(12)
    data = {0: rng.randbytes(64 * 1024), 1 << 20: rng.randbytes(20 * MiB), 512 << 20: b"journal" * 1000}
    first = sparse_upper(tmp_path / "u1.img", data)
    changed_blocks = dict(data)
    for offset in (4096, 40960, 512 << 20):
        changed_blocks[offset] = rng.randbytes(4096)  # metadata and journal blocks
    second = sparse_upper(tmp_path / "u2.img", changed_blocks)
    one = repo.commit("sandbox", "sb", {}, [LocalArtifact("layer", "up1", first, "sparse", packed=True)])
    two = repo.commit("sandbox", "sb", {}, [LocalArtifact("layer", "up2", second, "sparse", packed=True)])
    assert one.new_bytes > 20 * MiB and two.new_objects == 3, (one, two)
    assert two.new_bytes < 3 * 4 * 128 * 1024 + 64 * 1024, two  # a 128 KiB chunk at most a block
    _, manifest = manifest_of(repo, "sandbox", "sb")
    assert manifest["encoding"] == "sparse" and len(manifest["packs"]) == 2
    ref, _ = manifest_of(repo, "sandbox", "sb")
    repo.fetch_artifact(ref, tmp_path / "back.img", "test")
    with open(tmp_path / "back.img", "rb") as a, open(second, "rb") as b:
        for offset in changed_blocks:
            a.seek(offset)
            b.seek(offset)
            assert a.read(len(changed_blocks[offset])) == b.read(len(changed_blocks[offset]))
    assert (tmp_path / "back.img").stat().st_size == 1 << 30
    loose = repo.commit("template", "t", {}, [LocalArtifact("layer", "lay", second, "sparse")])
    assert loose.new_objects > 10  # other layers keep loose 1 MiB chunks


def test_layers_keep_loose_1_mib_chunks(backend: Backend, tmp_path: Path) -> None:
    repo = Repository(backend)
    folder = image_dir(tmp_path, "layer", page_file(random.Random(1), 1024))
    report = repo.commit("template", "t", {}, [LocalArtifact("layer", "lay", folder, "tar")])
    keys = objects(backend)
    assert not any(k.startswith("packs/") for k in keys)
    assert 0 < report.chunks < 20 and sum(k.startswith("chunks/") for k in keys) == report.new_chunks


def test_reads_are_coalesced_ranges_of_the_pack(backend: Backend, tmp_path: Path) -> None:
    """A fetch asks for a few ranges of each pack (never a pack whole, never a chunk at a time),
    with a bounded number in flight."""
    repo = Repository(backend)
    rng = random.Random(2)
    first_pages = page_file(rng, 2048)
    repo.commit("snapshot", "s1", {}, [LocalArtifact("image", "i1", image_dir(tmp_path, "a", first_pages), "tar")])
    two = image_dir(tmp_path, "b", changed(rng, first_pages, 40))
    repo.commit("snapshot", "s2", {}, [LocalArtifact("image", "i2", two, "tar")])
    calls: list[tuple[str, int, int]] = []
    whole: list[str] = []
    busy, most = [0], [0]
    lock = threading.Lock()
    real_range, real_get = backend.get_range, backend.get

    def get_range(key: str, start: int, length: int) -> tuple[bytes, int]:
        with lock:
            calls.append((key, start, length))
            busy[0] += 1
            most[0] = max(most[0], busy[0])
        try:
            return real_range(key, start, length)
        finally:
            with lock:
                busy[0] -= 1

    def get(key: str) -> bytes:
        whole.append(key)
        return real_get(key)

    reader = Repository(backend)
    setattr(backend, "get_range", get_range)  # noqa: B010
    setattr(backend, "get", get)  # noqa: B010
    back = fetched(reader, "snapshot", "s2", tmp_path / "back")
    assert back["pages.img"] == (two / "pages.img").read_bytes()
    _, manifest = manifest_of(reader, "snapshot", "s2")
    assert not any(k.startswith("packs/") for k in whole)
    assert {k for k, _, _ in calls} == {packs.pack_key(d) for d, _ in manifest["packs"]}
    # ~8.4 MiB of stream in 2 windows; each pack's needed chunks a few ranges of <= RANGE_MAX.
    stored = sum(size for _, size in manifest["packs"])
    assert len(calls) <= 2 * (len(manifest["packs"]) + stored // packs.RANGE_MAX + 1), calls
    assert all(length <= packs.RANGE_MAX or length <= packs.frame_bound(CHUNK_MAX) for _, _, length in calls)
    assert most[0] <= reader.pool._max_workers


def test_gc_keeps_a_pack_while_any_manifest_names_it(backend: Backend, tmp_path: Path) -> None:
    repo = Repository(backend)
    rng = random.Random(3)
    first_pages = page_file(rng, 1024)
    repo.commit("snapshot", "s1", {}, [LocalArtifact("image", "i1", image_dir(tmp_path, "a", first_pages), "tar")])
    two = image_dir(tmp_path, "b", changed(rng, first_pages, 8))
    repo.commit("snapshot", "s2", {}, [LocalArtifact("image", "i2", two, "tar")])
    _, first_manifest = manifest_of(repo, "snapshot", "s1")
    first_pack = packs.pack_key(first_manifest["packs"][0][0])
    # An interrupted commit: a pack uploaded, never a manifest.
    backend.put(packs.pack_key("ab" * 32), b"an orphan pack")

    repo.delete_entry("snapshot", "s1")
    report = repo.gc()
    assert report.deleted_artifacts == 1 and report.deleted_packs == 1, report  # the orphan only
    assert backend.exists(first_pack)  # the second image still reads most of its chunks there
    assert fetched(repo, "snapshot", "s2", tmp_path / "back")["pages.img"] == (two / "pages.img").read_bytes()
    assert repo.check(deep=True) == []

    repo.delete_entry("snapshot", "s2")
    report = repo.gc()
    assert report.deleted_packs == 2 and report.live_packs == 0, report
    assert not list(backend.list("packs/")) and not list(backend.list("artifacts/"))


def test_a_pack_used_too_little_is_not_referenced_so_garbage_stays_bounded(backend: Backend, tmp_path: Path) -> None:
    """An image that would take only a small part of an older pack gets those chunks copied into
    its own: once the older image is deleted, its whole pack goes. One that uses most of it
    references it."""
    repo = Repository(backend)
    rng = random.Random(4)
    old_pages = page_file(rng, 2048)
    repo.commit("snapshot", "old", {}, [LocalArtifact("image", "old", image_dir(tmp_path, "old", old_pages), "tar")])
    _, old = manifest_of(repo, "snapshot", "old")
    little = old_pages[: len(old_pages) // 10] + page_file(random.Random(9), 1843)  # 10% of the old pages
    most = changed(rng, old_pages, 4)
    repo.commit("snapshot", "little", {}, [LocalArtifact("image", "little", image_dir(tmp_path, "l", little), "tar")])
    repo.commit("snapshot", "most", {}, [LocalArtifact("image", "most", image_dir(tmp_path, "m", most), "tar")])
    _, of_little = manifest_of(repo, "snapshot", "little")
    _, of_most = manifest_of(repo, "snapshot", "most")
    assert old["packs"][0] not in of_little["packs"] and len(of_little["packs"]) == 1
    assert old["packs"][0] in of_most["packs"]
    repo.delete_entry("snapshot", "most")
    repo.delete_entry("snapshot", "old")
    assert repo.gc().deleted_packs == 2
    assert fetched(repo, "snapshot", "little", tmp_path / "back")["pages.img"] == little


def test_a_commit_never_names_a_pack_collected_since_it_learned_of_it(backend: Backend, tmp_path: Path) -> None:
    repo = Repository(backend)
    rng = random.Random(6)
    pages = page_file(rng, 1024)
    repo.commit("snapshot", "s1", {}, [LocalArtifact("image", "i1", image_dir(tmp_path, "a", pages), "tar")])
    repo.delete_entry("snapshot", "s1")
    assert repo.gc().deleted_packs == 1  # the repository forgot it; this process's index did not
    two = image_dir(tmp_path, "b", changed(rng, pages, 4))
    report = repo.commit("snapshot", "s2", {}, [LocalArtifact("image", "i2", two, "tar")])
    assert report.new_bytes > len(pages) / 4  # uploaded again
    assert fetched(repo, "snapshot", "s2", tmp_path / "back")["pages.img"] == (two / "pages.img").read_bytes()


def test_another_node_that_fetched_an_image_uploads_only_what_changed(backend: Backend, tmp_path: Path) -> None:
    """A durable pause resumed elsewhere and paused again: the node that fetched the first image
    (every chunk verified) shares its pages."""
    here, there = Repository(backend), Repository(backend)
    rng = random.Random(7)
    pages = page_file(rng, 1024)
    first = here.commit("sandbox", "sb", {}, [LocalArtifact("image", "i1", image_dir(tmp_path, "a", pages), "tar")])
    fetched(there, "sandbox", "sb", tmp_path / "fetched")
    two = image_dir(tmp_path, "b", changed(rng, pages, 4))
    second = there.commit("sandbox", "sb", {}, [LocalArtifact("image", "i2", two, "tar")])
    assert second.new_bytes < first.new_bytes / 5, (first, second)


def test_an_image_of_the_earlier_format_still_reads_and_is_collected(backend: Backend, tmp_path: Path) -> None:
    """Format 1: an image's chunks as loose objects, its manifest plain JSON (what nodes wrote
    before packs)."""
    repo = Repository(backend)
    raw = b"".join([b"old image " * 1000, random.Random(8).randbytes(3 * MiB)])
    writer = ChunkWriter(backend, repo.pool)
    refs = writer.write_stream([raw])
    writer.flush()
    body = {
        "format": ARTIFACT_FORMAT,
        "kind": "image",
        "id": "old",
        "encoding": "tar",
        "size": len(raw),
        "chunks": refs,
        "created_at": 0,
    }
    data = json.dumps(body).encode()
    backend.put(artifact_key("image", "old"), data)
    ref = ArtifactRef("image", "old", hashlib.sha256(data).hexdigest())
    assert b"".join(repo.artifact_chunks(ref, "test")) == raw
    assert object_keys(repo.read_manifest(ref, "test"))[0].startswith("chunks/")
    put_entry(backend, "old", ref)
    assert repo.gc().deleted_chunks == 0 and repo.check(deep=True) == []
    backend.remove("entries/snapshots/old.json")
    assert repo.gc().deleted_chunks == len(refs)


def put_entry(backend: Backend, entry_id: str, ref: ArtifactRef) -> None:
    body = {
        "format": "aenv-entry/1",
        "kind": "snapshot",
        "id": entry_id,
        "record": {},
        "artifacts": [{"kind": ref.kind, "id": ref.id, "manifest": ref.manifest}],
        "committed_at": 0,
    }
    backend.put(f"entries/snapshots/{entry_id}.json", json.dumps(body).encode())


def test_the_index_of_known_chunks_is_bounded() -> None:
    index = packs.PackIndex(limit=100)
    for n in range(10):
        digest = f"{n:02d}" * 32
        chunks = [[hashlib.sha256(f"{n}-{i}".encode()).hexdigest(), 10] for i in range(30)]
        where = [[0, 20 * i, 20, 10, 0] for i in range(30)]
        index.add({"chunks": chunks, "packs": [[digest, 30 * 20]], "where": where})
        assert len(index) <= 100
    assert index.find(hashlib.sha256(b"9-0").hexdigest()) is not None  # the newest stay
    assert index.find(hashlib.sha256(b"0-0").hexdigest()) is None  # the oldest went


def test_range_reads_on_the_store(backend: Backend) -> None:
    backend.put("packs/ab/x", b"0123456789")
    assert backend.get_range("packs/ab/x", 2, 3) == (b"234", 10)
    assert backend.get_range("packs/ab/x", 8, 5) == (b"89", 10)
    assert backend.get_range("packs/ab/x", 10, 5) == (b"", 10)
    assert backend.get_range("packs/ab/x", 50, 5) == (b"", 10)
    assert backend.size("packs/ab/x") == 10


# -- a hostile repository writer -------------------------------------------------------------------------
def rewrite(repo: Repository, tmp_path: Path, change: Any) -> str:
    """Commit an image, then write a changed copy of its manifest (and an entry naming it, so the
    chain of digests holds) the way someone who can write the repository could."""
    rng = random.Random(11)
    folder = image_dir(tmp_path, "img", page_file(rng, 512))
    repo.commit("snapshot", "good", {}, [LocalArtifact("image", "good", folder, "tar")])
    _, manifest = manifest_of(repo, "snapshot", "good")
    manifest = json.loads(json.dumps(manifest))
    manifest["id"] = "bad"
    data = change(repo, manifest)
    if data is None:
        data = zstandard.ZstdCompressor().compress(json.dumps(manifest).encode())
    repo.backend.put(artifact_key("image", "bad"), data)
    put_entry(repo.backend, "bad", ArtifactRef("image", "bad", hashlib.sha256(data).hexdigest()))
    return "bad"


def pack_bytes(repo: Repository, manifest: dict[str, Any]) -> tuple[str, bytearray]:
    key = packs.pack_key(manifest["packs"][0][0])
    return key, bytearray(repo.backend.get(key))


def _wrong_offset(repo: Repository, m: dict[str, Any]) -> None:
    m["where"][5][1] += 1


def _swapped(repo: Repository, m: dict[str, Any]) -> None:
    m["where"][3], m["where"][4] = m["where"][4], m["where"][3]


def _past_the_end(repo: Repository, m: dict[str, Any]) -> None:
    m["where"][2][1] = m["packs"][0][1] + 10


def _huge_stored(repo: Repository, m: dict[str, Any]) -> None:
    m["where"][2][2] = 1 << 40
    m["packs"][0][1] = 1 << 41


def _huge_length(repo: Repository, m: dict[str, Any]) -> None:
    m["chunks"][0][1] = 1 << 40
    m["size"] = sum(n for _, n in m["chunks"])


def _negative(repo: Repository, m: dict[str, Any]) -> None:
    m["where"][0][1] = -1


def _not_numbers(repo: Repository, m: dict[str, Any]) -> None:
    m["where"][0] = ["0", True, None]


def _pack_size_lie(repo: Repository, m: dict[str, Any]) -> None:
    m["packs"][0][1] += 4096  # bigger than the pack: reads would come back short


def _truncated(repo: Repository, m: dict[str, Any]) -> None:
    key, data = pack_bytes(repo, m)
    repo.backend.put(key, bytes(data[: len(data) // 2]))


def _flipped(repo: Repository, m: dict[str, Any]) -> None:
    key, data = pack_bytes(repo, m)
    _, offset, stored, _, _ = m["where"][7]
    data[offset + stored - 6] ^= 0xFF
    repo.backend.put(key, bytes(data))


def _other_content(repo: Repository, m: dict[str, Any]) -> None:
    """A frame replaced by a valid frame of other bytes of the same length: only digests tell."""
    key, data = pack_bytes(repo, m)
    _, offset, stored, raw, _ = m["where"][9]
    frame = zstandard.ZstdCompressor(level=1).compress(b"x" * raw)
    data[offset : offset + stored] = frame
    m["packs"][0][1] = len(data)
    for place in m["where"]:
        if place[1] == offset:
            place[2] = len(frame)
        elif place[1] > offset:
            place[1] += len(frame) - stored
    repo.backend.put(key, bytes(data))


def _bomb(repo: Repository, m: dict[str, Any]) -> None:
    """A frame that inflates far past what its place says."""
    key, data = pack_bytes(repo, m)
    frame = zstandard.ZstdCompressor().compress(bytes(64 * MiB))
    m["where"][0] = [0, len(data), len(frame), m["chunks"][0][1], 0]
    m["packs"][0][1] = len(data) + len(frame)
    repo.backend.put(key, bytes(data) + frame)


def _huge_frame(repo: Repository, m: dict[str, Any]) -> None:
    m["where"][0][3] = 1 << 30


def _chunk_past_its_frame(repo: Repository, m: dict[str, Any]) -> None:
    m["where"][0][4] = m["where"][0][3]


def _missing(repo: Repository, m: dict[str, Any]) -> None:
    key, _ = pack_bytes(repo, m)
    repo.backend.delete([key])


def _unused_pack(repo: Repository, m: dict[str, Any]) -> None:
    m["packs"].append(["cd" * 32, 100])


def _manifest_bomb(repo: Repository, m: dict[str, Any]) -> bytes:
    return zstandard.ZstdCompressor().compress(b" " * (65 * MiB))


def _unknown_format(repo: Repository, m: dict[str, Any]) -> None:
    m["format"] = "aenv-artifact/9"


HOSTILE = {
    "wrong offset": (_wrong_offset, "corrupt"),
    "swapped places": (_swapped, ("corrupt", "take at most", "of a frame of")),
    "frame larger than a frame may be": (_huge_frame, "of a frame of"),
    "chunk past its frame's end": (_chunk_past_its_frame, "of a frame of"),
    "place past the pack's end": (_past_the_end, "outside its pack"),
    "huge stored length": (_huge_stored, "take at most"),
    "huge chunk length": (_huge_length, "at most"),
    "negative offset": (_negative, "malformed"),
    "places not numbers": (_not_numbers, "malformed"),
    "pack smaller than said": (_pack_size_lie, "where its manifest says"),
    "truncated pack": (_truncated, "where its manifest says"),
    "flipped byte": (_flipped, "corrupt"),
    "other content, valid frame": (_other_content, "does not match its digest"),
    "decompression bomb": (_bomb, "corrupt"),
    "missing pack": (_missing, "missing"),
    "a pack no chunk is in": (_unused_pack, "malformed"),
    "manifest bomb": (_manifest_bomb, "corrupt"),
    "unknown format": (_unknown_format, "unknown artifact format"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_pack_or_manifest_is_refused_cleanly(backend: Backend, tmp_path: Path, case: str) -> None:
    """Every case fails the fetch with ArtifactDamaged naming the artifact and what is wrong, with
    nothing read beyond the pack's size or inflated beyond a chunk's length; check() reports it;
    the good image it was copied from still reads, and a commit never names the bad one's chunks."""
    change, expected = HOSTILE[case]
    repo = Repository(backend)
    bad = rewrite(repo, tmp_path, change)
    reader = Repository(backend)
    entry = reader.get_entry("snapshot", bad)
    assert entry is not None
    ref = reader.artifact_refs(entry)[0]
    with pytest.raises(ArtifactDamaged) as err:
        reader.fetch_artifact(ref, tmp_path / "out", "snapshot bad")
    wanted = (expected,) if isinstance(expected, str) else expected
    assert "snapshot bad" in err.value.message and any(w in err.value.message for w in wanted), err.value.message
    assert reader.check(deep=True), "check must report it"
    assert len(reader.index) == 0  # nothing of a manifest that failed is remembered for dedup
    if case not in (
        "truncated pack",
        "flipped byte",
        "other content, valid frame",
        "decompression bomb",
        "missing pack",
    ):
        assert fetched(reader, "snapshot", "good", tmp_path / "good")["pages.img"]  # the pack itself is intact


def test_an_s3_range_past_the_end_and_a_lying_store_are_refused(s3: Any) -> None:
    """S3 answers a range starting past the object with 416: an empty read, not an error."""
    backend = s3.backend(s3.new_bucket(), "p")
    backend.put("packs/ab/y", b"abc")
    assert backend.get_range("packs/ab/y", 3, 10) == (b"", 3)


def test_posix_range_reads_refuse_links_and_fifos(tmp_path: Path) -> None:
    import os

    backend = PosixBackend(tmp_path / "repo")
    (tmp_path / "repo" / "packs" / "ab").mkdir(parents=True)
    os.symlink("/dev/zero", tmp_path / "repo" / "packs" / "ab" / "link")
    os.mkfifo(tmp_path / "repo" / "packs" / "ab" / "fifo")
    for name in ("link", "fifo"):
        with pytest.raises(ArtifactDamaged):
            backend.get_range(f"packs/ab/{name}", 0, 10)


@pytest.mark.parametrize("where", ["pack", "loose chunk"])
def test_a_frame_claiming_more_than_its_chunk_is_refused_before_memory_is_taken(
    backend: Backend, tmp_path: Path, where: str
) -> None:
    """A 2 KB zstd frame whose header says 64 MiB: zstd allocates what the header says whatever
    the limit it is given. Refused from the header. Seen failing before (loose chunks too): the
    fetch took 64 MiB before finding the content wrong."""
    import tracemalloc

    repo = Repository(backend)
    bomb = zstandard.ZstdCompressor().compress(bytes(64 * MiB))
    if where == "pack":
        bad = rewrite(repo, tmp_path, _bomb)
    else:
        digest = hashlib.sha256(b"small").hexdigest()
        backend.put(f"chunks/{digest[:2]}/{digest}", bomb)
        body = {"format": ARTIFACT_FORMAT, "kind": "image", "id": "bad", "encoding": "tar", "size": 5}
        data = json.dumps({**body, "chunks": [[digest, 5]], "created_at": 0}).encode()
        backend.put(artifact_key("image", "bad"), data)
        put_entry(backend, "bad", ArtifactRef("image", "bad", hashlib.sha256(data).hexdigest()))
        bad = "bad"
    entry = repo.get_entry("snapshot", bad)
    assert entry is not None
    tracemalloc.start()
    try:
        with pytest.raises(ArtifactDamaged) as err:
            for _ in repo.artifact_chunks(repo.artifact_refs(entry)[0], "snapshot bad"):
                pass
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "corrupt" in err.value.message
    assert peak < 16 * MiB, peak


def test_frames_named_again_and_again_stop_the_read(backend: Backend) -> None:
    """A manifest whose 2000 identical chunks each name one of 20 large frames in turn (each frame
    inflated again: the read keeps 16): the read stops at 3x the artifact's size instead of
    inflating 2000 frames of 128 KiB (250 MiB for 8 MiB)."""
    repo = Repository(backend)
    zero = bytes(4096)
    frame = zstandard.ZstdCompressor().compress(bytes(packs.FRAME_MAX))
    pack = frame * 20
    digest = hashlib.sha256(pack).hexdigest()
    backend.put(packs.pack_key(digest), pack)
    count = 2000
    body = {
        "format": "aenv-artifact/2",
        "kind": "image",
        "id": "spin",
        "encoding": "tar",
        "size": count * len(zero),
        "chunks": [[hashlib.sha256(zero).hexdigest(), len(zero)]] * count,
        "packs": [[digest, len(pack)]],
        "where": [[0, (i % 20) * len(frame), len(frame), packs.FRAME_MAX, 0] for i in range(count)],
        "created_at": 0,
    }
    data = zstandard.ZstdCompressor().compress(json.dumps(body).encode())
    backend.put(artifact_key("image", "spin"), data)
    ref = ArtifactRef("image", "spin", hashlib.sha256(data).hexdigest())
    given = 0
    with pytest.raises(ArtifactDamaged) as err:
        for chunk in repo.artifact_chunks(ref, "snapshot spin"):
            given += len(chunk)
    assert "inflate to more than" in err.value.message
    assert given < count * len(zero)
