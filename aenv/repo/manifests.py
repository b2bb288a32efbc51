"""Artifact manifests as stored: format 1 (plain JSON, loose chunks) and format 2 (zstd of the
JSON, chunks in packs), and the checks a fetch relies on in one another node (or anyone who can
write the repository) may have written."""

from __future__ import annotations

import json
import re
from typing import Any

import zstandard

from aenv.errors import ArtifactDamaged
from aenv.repo import encodings
from aenv.repo.chunks import chunk_key
from aenv.repo.packs import check_packed, pack_key, packs_of

ARTIFACT_FORMAT = "aenv-artifact/1"  # chunks as loose objects
PACKED_FORMAT = "aenv-artifact/2"  # chunks in packs, the manifest zstd-compressed
MANIFEST_MAX = 64 << 20  # the most a compressed manifest is inflated to
DIGESTS = re.compile(r"(?:[0-9a-f]{64})*")
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def load_manifest(data: bytes, what: str) -> dict[str, Any]:
    """An artifact manifest's JSON, zstd-compressed (format 2) or not (format 1)."""
    if data[:4] == ZSTD_MAGIC:
        try:
            claimed = zstandard.frame_content_size(data)
            if claimed > MANIFEST_MAX:
                raise zstandard.ZstdError(f"its frame says {claimed} bytes")
            data = zstandard.ZstdDecompressor().decompress(data, max_output_size=MANIFEST_MAX)
        except zstandard.ZstdError as exc:
            raise ArtifactDamaged(f"{what}: its manifest is corrupt ({exc})") from None
    try:
        manifest = json.loads(data)
    except ValueError:
        raise ArtifactDamaged(f"{what}: its manifest is not valid JSON") from None
    if not isinstance(manifest, dict):
        raise ArtifactDamaged(f"{what}: its manifest is not a JSON object")
    if manifest.get("format") not in (ARTIFACT_FORMAT, PACKED_FORMAT):
        raise ArtifactDamaged(f"{what}: unknown artifact format {str(manifest.get('format'))[:100]!r}")
    return manifest


def is_packed(manifest: dict[str, Any]) -> bool:
    return manifest.get("format") == PACKED_FORMAT


def object_keys(manifest: dict[str, Any]) -> list[str]:
    """The keys of the objects an artifact's chunks are in: its packs, or its loose chunks."""
    if is_packed(manifest):
        return [pack_key(d) for d in packs_of(manifest)]
    return list(dict.fromkeys(chunk_key(d) for d, _ in manifest["chunks"]))


def check_manifest(manifest: dict[str, Any], what: str) -> None:
    """What a fetch relies on in a manifest another node may have written: a known encoding, chunk
    lengths that add up to its size, a sparse file's extents inside it and holding that size, a
    packed one's places inside its packs."""
    chunks = manifest.get("chunks")
    if manifest.get("encoding") not in ("tar", "sparse") or not isinstance(chunks, list):
        raise ArtifactDamaged(f"{what}: malformed manifest (encoding or chunks)")
    if not all(type(c) is list and len(c) == 2 and type(c[0]) is str and type(c[1]) is int for c in chunks):
        raise ArtifactDamaged(f"{what}: malformed manifest (chunks are sha256 digests and lengths)")
    if not DIGESTS.fullmatch("".join(c[0] for c in chunks)):  # one match, not one a chunk
        raise ArtifactDamaged(f"{what}: malformed manifest (chunks are sha256 digests and lengths)")
    if manifest.get("size") != sum(length for _, length in chunks):
        raise ArtifactDamaged(f"{what}: its manifest's size is not what its chunks hold")
    if is_packed(manifest):
        check_packed(manifest, what)
    if manifest["encoding"] == "sparse":
        extents = manifest.get("extents")
        size = manifest.get("file_size")
        if not isinstance(size, int) or not isinstance(extents, list):
            raise ArtifactDamaged(f"{what}: malformed manifest (file size or extents)")
        if not all(isinstance(e, list) and len(e) == 2 and all(isinstance(n, int) for n in e) for e in extents):
            raise ArtifactDamaged(f"{what}: malformed manifest (extents)")
        encodings.check_extents(size, [(a, b) for a, b in extents])
        if sum(b for _, b in extents) != manifest["size"]:
            raise ArtifactDamaged(f"{what}: its extents do not hold what its chunks hold")
