"""What an API-key holder sends to build from, and what the snapshot repository hands back, can
neither fill the host's disk nor write outside where it belongs (issue 10).

Build contexts and E2B uploads are bounded as sent (with and without a Content-Length), once
decompressed, in entries and in header size; the node refuses work with 507 when its disk is
nearly full; E2B uploads are collected once unused. Artifacts fetched from a repository that
others can write are decoded inside their target only (hostile tar entries, sparse extents and
records naming paths), and a sandbox's FIFOs, links and devices never stall or leak through a
commit of its snapshot."""

from __future__ import annotations

import copy
import hashlib
import http.client
import io
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import tarfile
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import zstandard
from e2b import Sandbox

from aenv.config import Settings
from aenv.errors import AenvError, ArtifactDamaged
from aenv.repo.backends import PosixBackend
from aenv.repo.chunks import CHUNK_MAX, ChunkRef, ChunkWriter, chunk_key, read_chunk
from aenv.repo.repository import ARTIFACT_FORMAT, ArtifactRef, Repository, artifact_key, entry_key
from tests.conftest import API_KEY, Server, start_server
from tests.images.oci import LayerTar, Registry, busybox_layer, start_registry

MiB = 1 << 20
LIMITS = {
    "AENV_MAX_UPLOAD_MB": "4",
    "AENV_MAX_UNPACKED_MB": "16",
    "AENV_MAX_UPLOAD_ENTRIES": "500",
    "AENV_DISK_HEADROOM_MB": "0",
}
NODE = {"AENV_BUILD_BASE": "false", "AENV_REPO": "none"}


@contextmanager
def node(tmp: Path, **env: str) -> Iterator[Server]:
    """A node of its own (fresh data dir, no `base`, no repository) with ``env`` set; its driver
    needs runsc, so the tests using one are marked `sandbox`."""
    srv = start_server(tmp / "data", extra_env={**NODE, **env}, wait_for=None)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A node with small upload limits: 4 MiB sent, 16 MiB unpacked, 500 entries."""
    with node(tmp_path_factory.mktemp("small"), **LIMITS) as srv:
        yield srv


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A node whose disk is 'nearly full': it keeps more free than the disk has."""
    with node(tmp_path_factory.mktemp("full"), AENV_DISK_HEADROOM_MB=str(1 << 30)) as srv:
        yield srv


def tar_of(entries: list[tuple[tarfile.TarInfo, bytes]], *, gz: bool = False) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz" if gz else "w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in entries:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return raw.getvalue()


def item(name: str, data: bytes = b"") -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


class Zeros(io.RawIOBase):
    """``n`` zero bytes, never all in memory."""

    def __init__(self, n: int) -> None:
        self.left = n

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self.left)
        buffer[:n] = bytes(n)
        self.left -= n
        return n


def zip_bomb(size: int) -> bytes:
    """A gzip'd context (well under a MiB) holding one file of ``size`` zero bytes."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        info = tarfile.TarInfo("big")
        info.size = size
        tar.addfile(info, Zeros(size))
    return raw.getvalue()


def header_bomb(size: int) -> bytes:
    """A gzip'd context whose one entry has a pax header of ``size`` bytes."""
    info = tarfile.TarInfo("notes")
    info.pax_headers = {"comment": "x" * size}
    return tar_of([(info, b"notes\n")], gz=True)


def sparse_bomb(tmp: Path, size: int) -> bytes:
    """A gzip'd context of one GNU sparse file of ``size`` bytes: a hole, then a line."""
    (tmp / "sparse").mkdir()
    with open(tmp / "sparse" / "hole", "wb") as f:
        f.truncate(size)
        f.seek(size)
        f.write(b"end\n")
    return subprocess.run(
        ["tar", "-C", str(tmp / "sparse"), "--sparse", "-cz", "hole"], capture_output=True, check=True
    ).stdout


def chunks(total: int, size: int = MiB) -> Iterator[bytes]:
    """A body sent chunked (no Content-Length): ``total`` bytes."""
    block = b"\0" * size
    for _ in range(total // size):
        yield block


def error_of(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert body["code"] == r.status_code and isinstance(body["message"], str), body
    return dict(body)


def leftovers(srv: Server) -> list[str]:
    """What uploads and contexts left in the data dir (nothing once they are done or refused)."""
    fs = srv.data_dir / "fs"
    found = [str(p.relative_to(fs)) for p in (fs / "tmp").iterdir()] if (fs / "tmp").is_dir() else []
    if (fs / "build-files").is_dir():
        found += [str(p.relative_to(fs)) for p in (fs / "build-files").glob("*.part")]
    return found


def build(srv: Server, body: bytes | Iterator[bytes], name: str = "ctx") -> httpx.Response:
    with srv.client() as api:
        return api.post("/templates/build", params={"name": name}, content=body, timeout=300)


def upload_url(srv: Server, files_hash: str) -> tuple[bool, str]:
    with srv.client() as api:
        link = api.get(f"/templates/t/files/{files_hash}").json()
    return link["present"], link["url"]


def declare_only(srv: Server, path: str, length: int, api_key: bool = True) -> tuple[int, dict[str, Any]]:
    """Send only the headers of a request declaring a ``length``-byte body: the answer must come
    before any of it (a server that reads first never answers: a timeout)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=20)
    try:
        conn.putrequest("PUT" if "/upload" in path else "POST", path)
        conn.putheader("Content-Length", str(length))
        if api_key:
            conn.putheader("X-API-Key", API_KEY)
        conn.endheaders()
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


# -- sizes as sent -----------------------------------------------------------------------------------
@pytest.mark.sandbox
def test_an_oversize_context_is_413_with_or_without_its_length(small: Server) -> None:
    declared = build(small, os.urandom(5 * MiB))
    assert declared.status_code == 413
    body = error_of(declared)
    assert body["error_code"] == "payload_too_large"
    assert "4 MiB" in body["message"] and "AENV_MAX_UPLOAD_MB" in body["message"]

    streamed = build(small, chunks(64 * MiB))  # chunked: no length to judge by
    assert streamed.status_code == 413 and "AENV_MAX_UPLOAD_MB" in error_of(streamed)["message"]

    status, body = declare_only(small, "/templates/build?name=ctx", 100 << 30)
    assert status == 413 and "4 MiB" in body["message"]
    assert leftovers(small) == []

    fits = build(small, tar_of([item("data", os.urandom(3 * MiB))]))
    assert fits.status_code == 400 and "no Dockerfile" in error_of(fits)["message"]  # taken and unpacked


@pytest.mark.sandbox
def test_an_oversize_e2b_upload_is_413_and_leaves_nothing(small: Server) -> None:
    files_hash = uuid.uuid4().hex
    present, url = upload_url(small, files_hash)
    assert not present
    declared = httpx.put(url, content=os.urandom(5 * MiB), timeout=120)
    assert declared.status_code == 413 and "AENV_MAX_UPLOAD_MB" in error_of(declared)["message"]
    streamed = httpx.put(url, content=chunks(64 * MiB), timeout=300)
    assert streamed.status_code == 413 and "4 MiB" in error_of(streamed)["message"]
    status, _ = declare_only(small, url.split(str(small.port), 1)[1], 100 << 30, api_key=False)
    assert status == 413
    assert upload_url(small, files_hash)[0] is False and leftovers(small) == []

    ok = httpx.put(url, content=tar_of([item("file", b"data")]), timeout=60)
    assert ok.status_code == 200 and upload_url(small, files_hash)[0] is True


@pytest.mark.sandbox
def test_an_upload_the_client_abandons_leaves_nothing(small: Server) -> None:
    """Half a declared body, then the connection closes: what was written is removed."""
    _, url = upload_url(small, uuid.uuid4().hex)
    for path in ("/templates/build?name=ctx", url.split(str(small.port), 1)[1]):
        with socket.create_connection(("127.0.0.1", small.port)) as conn:
            method = "PUT" if "/upload" in path else "POST"
            head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nX-API-Key: {API_KEY}\r\nContent-Length: {3 * MiB}\r\n\r\n"
            conn.sendall(head.encode() + os.urandom(MiB))
            time.sleep(0.5)  # the server has the first MiB
        deadline = time.monotonic() + 10
        while leftovers(small) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert leftovers(small) == [], path


# -- what a context unpacks to -------------------------------------------------------------------------
@pytest.mark.sandbox
@pytest.mark.parametrize("bomb", ["zeros", "sparse", "headers"])
def test_context_bombs_are_413(small: Server, tmp_path: Path, bomb: str) -> None:
    """Each body is well under the 4 MiB sent; unpacked it would be 64 MiB of zeros, a 512 MiB
    sparse file written out, or an 8 MiB header held in memory."""
    if bomb == "zeros":
        body = zip_bomb(64 * MiB)
    elif bomb == "sparse":
        body = sparse_bomb(tmp_path, 512 * MiB)
    else:
        body = header_bomb(8 * MiB)
    assert len(body) < MiB
    r = build(small, body)
    assert r.status_code == 413, r.text
    says = error_of(r)["message"]
    if bomb == "headers":
        assert "headers are larger than 1 MiB" in says, says
    else:
        assert "unpacks to more than 16 MiB" in says and "AENV_MAX_UNPACKED_MB" in says, says
    assert leftovers(small) == []


@pytest.mark.sandbox
def test_an_e2b_upload_that_unpacks_too_much_fails_its_build_start(small: Server) -> None:
    files_hash = uuid.uuid4().hex
    _, url = upload_url(small, files_hash)
    assert httpx.put(url, content=zip_bomb(64 * MiB), timeout=60).status_code == 200
    with small.client() as api:
        created = api.post("/v3/templates", json={"name": f"bomb-{files_hash[:8]}"}).json()
        step = {"type": "COPY", "args": ["big", "/big"], "filesHash": files_hash}
        r = api.post(
            f"/v2/templates/{created['templateID']}/builds/{created['buildID']}",
            json={"fromImage": "busybox:never-pulled", "steps": [step]},
        )
    assert r.status_code == 413 and "AENV_MAX_UNPACKED_MB" in error_of(r)["message"]
    assert leftovers(small) == []


@pytest.mark.sandbox
def test_a_context_of_too_many_entries_is_413(small: Server) -> None:
    many = [item(f"d/f{i}") for i in range(600)]
    r = build(small, tar_of(many, gz=True))
    assert r.status_code == 413
    assert "500 entries" in error_of(r)["message"] and "AENV_MAX_UPLOAD_ENTRIES" in error_of(r)["message"]
    assert leftovers(small) == []


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    yield from start_registry(tmp_path_factory.mktemp("registry"))


@pytest.mark.sandbox
def test_an_image_layer_with_a_huge_header_is_413(registry: Registry, api: httpx.Client) -> None:
    """Image layers are read as contexts are: an 8 MiB pax header (a few KiB gzip'd) is refused,
    not held in memory (tarfile holds a header of any size whole)."""
    repo = f"tests/bomb-{uuid.uuid4().hex[:8]}"
    bomb = LayerTar()
    info = tarfile.TarInfo(repo)  # a layer of its own: a pulled one is cached by its digest
    info.pax_headers = {"comment": "x" * (8 * MiB)}
    bomb.tar.addfile(info)
    registry.push_image(repo, "1", [(busybox_layer().bytes(), "gzip"), (bomb.bytes(), "gzip")])
    r = api.post("/templates/from-image", json={"name": repo.replace("/", "-"), "image": f"{registry.host}/{repo}:1"})
    assert r.status_code == 413 and "headers are larger than 1 MiB" in error_of(r)["message"], r.text


# -- a nearly full disk -------------------------------------------------------------------------------
@pytest.mark.sandbox
def test_a_nearly_full_disk_refuses_uploads_and_builds_with_507(full: Server) -> None:
    context = tar_of([item("f", b"x")])
    refusals = [build(full, context), build(full, chunks(8 * MiB))]
    files_hash = uuid.uuid4().hex
    _, url = upload_url(full, files_hash)
    refusals.append(httpx.put(url, content=context, timeout=60))
    with full.client() as api:
        created = api.post("/v3/templates", json={"name": "full"}).json()
        refusals.append(
            api.post(f"/v2/templates/full/builds/{created['buildID']}", json={"fromImage": "busybox:never-pulled"})
        )
        refusals.append(api.post("/templates/from-image", json={"name": "full", "image": "127.0.0.1:1/x:1"}))
    for r in refusals:
        assert r.status_code == 507, (r.request.url, r.text)
        body = error_of(r)
        assert body["error_code"] == "insufficient_storage" and "nearly full" in body["message"], body
        assert not re.search(r"\d+ (MiB|inodes)|free,|kept free", body["message"]), (
            body
        )  # the host's disk stays its own
    status, _ = declare_only(full, "/templates/build?name=ctx", MiB)
    assert status == 507
    assert leftovers(full) == []


@pytest.mark.sandbox
def test_a_disk_that_fills_during_an_upload_stops_it(tmp_path: Path) -> None:
    """The headroom leaves 48 MiB to write when the node starts: a 1 GiB context sent chunked
    stops once that is used, and what it wrote is removed."""
    disk = os.statvfs(tmp_path)
    headroom = disk.f_bavail * disk.f_frsize // MiB - 48
    with node(tmp_path, AENV_DISK_HEADROOM_MB=str(headroom)) as srv:
        r = build(srv, chunks(1 << 30))
        assert r.status_code == 507 and error_of(r)["error_code"] == "insufficient_storage"
        _, url = upload_url(srv, uuid.uuid4().hex)
        r = httpx.put(url, content=chunks(1 << 30), timeout=300)
        assert r.status_code == 507
        assert leftovers(srv) == []


# -- E2B uploads are a cache, not forever --------------------------------------------------------------
@pytest.mark.sandbox
def test_e2b_uploads_unused_for_their_ttl_are_collected(small: Server) -> None:
    """Aged by hand (their mtime is their last use), then collected by the node's start."""
    hashes = [uuid.uuid4().hex for _ in range(3)]
    for files_hash in hashes:
        _, url = upload_url(small, files_hash)
        assert httpx.put(url, content=tar_of([item("f", b"x")]), timeout=60).status_code == 200
    stale, renewed, fresh = (small.data_dir / "fs" / "build-files" / f"{h}.tar" for h in hashes)
    two_days_ago = time.time() - 2 * 86400
    for path in (stale, renewed):
        os.utime(path, (two_days_ago, two_days_ago))
    assert upload_url(small, hashes[1])[0] is True  # asked about: the SDK will use it next
    small.restart()
    assert [upload_url(small, h)[0] for h in hashes] == [False, True, True]
    assert not stale.exists() and renewed.exists() and fresh.exists()


def test_an_upload_in_use_is_never_collected(tmp_path: Path) -> None:
    from aenv.templates.uploads import UploadCache

    cache = UploadCache(tmp_path, Settings(data_dir=tmp_path, upload_ttl=0))
    for files_hash in ("used", "idle"):
        cache.tar(files_hash).write_bytes(b"")
    with cache.using("used"):
        assert cache.collect() == ["idle"]
    assert cache.tar("used").exists()
    assert cache.collect() == ["used"]


# -- the snapshot repository: artifacts others wrote --------------------------------------------------
@pytest.fixture()
def canary() -> Iterator[Path]:
    """A host directory no artifact may reach (not under /tmp: a sandbox has its own /tmp)."""
    path = Path(tempfile.mkdtemp(prefix="aenv-canary-", dir="/var/tmp"))
    (path / "secret").write_text(f"HOST SECRET {uuid.uuid4().hex}\n")
    os.chmod(path / "secret", 0o600)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def untouched(canary: Path, secret: str) -> bool:
    st = os.lstat(canary / "secret")
    return (
        [p.name for p in canary.iterdir()] == ["secret"]
        and (canary / "secret").read_text() == secret
        and (stat.S_IMODE(st.st_mode) == 0o600)
    )


def entry(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", data: bytes = b"", **attrs: Any) -> Any:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, 0o644
    for key, value in attrs.items():
        setattr(info, key, value)
    return info, data


def renamed(info: tarfile.TarInfo, name: str) -> tarfile.TarInfo:
    """``info`` under another name (TarInfo.replace is newer than Debian 12's Python 3.11.2)."""
    out = copy.copy(info)
    out.name = name
    return out


def gnu_tar(entries: list[tuple[tarfile.TarInfo, bytes]]) -> bytes:
    """A tar stream as a commit makes them (GNU tar's format, pax attributes where needed)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in entries:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data else None)
    return raw.getvalue()


def put_artifact(repo: Repository, kind: str, artifact_id: str, stream: bytes, **manifest: Any) -> ArtifactRef:
    """An artifact written into ``repo`` by hand: ``stream``'s chunks and a manifest saying
    whatever ``manifest`` adds (a tar by default)."""
    writer = ChunkWriter(repo.backend, repo.pool)
    chunks = writer.write_stream([stream])
    writer.flush()
    return put_manifest(repo, kind, artifact_id, chunks, **manifest)


def put_manifest(repo: Repository, kind: str, artifact_id: str, chunks: list[ChunkRef], **manifest: Any) -> ArtifactRef:
    body = {
        "format": ARTIFACT_FORMAT,
        "kind": kind,
        "id": artifact_id,
        "encoding": "tar",
        "created_at": time.time(),
        "size": sum(n for _, n in chunks),
        "chunks": chunks,
        **manifest,
    }
    data = json.dumps(body, sort_keys=True).encode()
    repo.backend.put(artifact_key(kind, artifact_id), data)
    return ArtifactRef(kind, artifact_id, hashlib.sha256(data).hexdigest())


def escapes(canary: Path) -> list[list[Any]]:
    """Tar streams that try to write outside their target, one way each."""
    c = str(canary)
    return [
        [entry("../escape", data=b"x")],
        [entry("a/../../escape", data=b"x")],
        [entry("/escape-abs", data=b"x")],
        [entry(f"{c}/pwned", data=b"x")],
        [entry("lnk", tarfile.SYMTYPE, c), entry("lnk/pwned", data=b"x")],
        [entry("up", tarfile.SYMTYPE, "../../../../../../../../.."), entry(f"up{c}/pwned", data=b"x")],
        [entry("a", tarfile.SYMTYPE, "."), entry("b", tarfile.SYMTYPE, "a/a/../../.."), entry("b/escape", data=b"x")],
        [entry("d", tarfile.DIRTYPE), entry("d/up", tarfile.SYMTYPE, ".."), entry("d/up/escape", data=b"x")],
        [entry("s", tarfile.SYMTYPE, f"{c}/secret"), entry("s", data=b"OVERWRITTEN")],
        [entry("h", tarfile.LNKTYPE, f"{c}/secret"), entry("h", data=b"OVERWRITTEN")],
        [entry("h", tarfile.LNKTYPE, "../../../../../../../.." + c + "/secret")],
        [entry("lnk", tarfile.SYMTYPE, c), entry("h", tarfile.LNKTYPE, "lnk/secret"), entry("h", data=b"OVERWRITTEN")],
    ]


def specials() -> list[Any]:
    """Devices, a whiteout, a FIFO, host-kernel attributes, a set-uid file: what a layer tar can hold."""
    attrs = {
        "SCHILY.xattr.trusted.overlay.redirect": "/etc",
        "SCHILY.xattr.trusted.overlay.opaque": "y",
        "SCHILY.xattr.user.note": "kept",
    }
    return [
        entry("dev", tarfile.DIRTYPE),
        entry("dev/sda", tarfile.BLKTYPE, devmajor=8, devminor=0),
        entry("dev/mem", tarfile.CHRTYPE, devmajor=1, devminor=1),
        entry("dev/zero", tarfile.CHRTYPE, devmajor=1, devminor=5),
        entry("gone", tarfile.CHRTYPE, devmajor=0, devminor=0),  # an overlay whiteout
        entry("fifo", tarfile.FIFOTYPE),
        entry("opt", tarfile.DIRTYPE, pax_headers=attrs),
        entry("opt/sudo", data=b"#!/bin/sh\n", mode=0o4755),
    ]


def check_specials(layer: Path) -> None:
    assert sorted(os.listdir(layer / "dev")) == []  # no device node on the host
    gone = os.lstat(layer / "gone")
    assert stat.S_ISCHR(gone.st_mode) and gone.st_rdev == 0
    assert stat.S_ISFIFO(os.lstat(layer / "fifo").st_mode)
    assert sorted(os.listxattr(layer / "opt")) == ["trusted.overlay.opaque", "user.note"]
    assert stat.S_IMODE(os.lstat(layer / "opt" / "sudo").st_mode) == 0o4755


def test_hostile_tar_artifacts_decode_inside_their_target(tmp_path: Path, canary: Path) -> None:
    """Each stream is fetched into its own directory two levels down; whether it is refused or
    decoded, nothing appears beside it or in the canary, and no device or host-kernel attribute
    is left in what is decoded."""
    secret = (canary / "secret").read_text()
    repo = Repository(PosixBackend(tmp_path / "repo"))
    for n, entries in enumerate(escapes(canary)):
        target = tmp_path / "deep" / f"case{n}" / "layer"
        target.parent.mkdir(parents=True)
        try:
            repo.fetch_artifact(put_artifact(repo, "layer", f"escape{n}", gnu_tar(entries)), target, "test")
        except AenvError:
            pass  # refused (GNU tar skips what it will not write, then fails): fine if nothing escaped
        assert os.listdir(target.parent) == ["layer"], (n, entries)
        assert sorted(os.listdir(tmp_path / "deep")) == sorted(f"case{i}" for i in range(n + 1)), (n, entries)
        assert untouched(canary, secret), (n, entries)
        assert not Path("/escape-abs").exists()
    target = tmp_path / "specials"
    repo.fetch_artifact(put_artifact(repo, "layer", "specials", gnu_tar(specials())), target, "test")
    check_specials(target)


@pytest.mark.parametrize(
    "file_size, extents",
    [
        (8192, [(0, 4096), (1 << 20, 4096)]),  # past the end of the file
        (16384, [(0, 8192), (4096, 4096)]),  # overlapping
        (16384, [(8192, 4096), (0, 4096)]),  # out of order
        (16384, [(-4096, 4096), (4096, 4096)]),  # before the start
        (16384, [(0, 0), (0, 8192)]),  # empty
        (16384, [(0, 4096)]),  # holding less than the chunks
    ],
)
def test_sparse_artifacts_write_only_inside_their_size(tmp_path: Path, file_size: int, extents: list[Any]) -> None:
    repo = Repository(PosixBackend(tmp_path / "repo"))
    ref = put_artifact(repo, "layer", "img", os.urandom(8192), encoding="sparse", file_size=file_size, extents=extents)
    dest = tmp_path / "out" / "layer.img"
    dest.parent.mkdir()
    with pytest.raises(ArtifactDamaged):
        repo.fetch_artifact(ref, dest, "test")
    assert not dest.exists() or dest.stat().st_size <= file_size
    assert sorted(os.listdir(dest.parent)) in ([], ["layer.img"])


def test_manifests_that_lie_about_sizes_are_refused(tmp_path: Path) -> None:
    """One chunk larger than the chunker ever cuts (decoded whole in memory: a 1 GiB one, eight
    fetched ahead, would take the node's memory), and a size that is not what the chunks hold."""
    repo = Repository(PosixBackend(tmp_path / "repo"))
    stream = gnu_tar([entry("big", data=bytes(2 * CHUNK_MAX))])
    digest = hashlib.sha256(stream).hexdigest()
    repo.backend.put(chunk_key(digest), zstandard.ZstdCompressor().compress(stream))
    whole = put_manifest(repo, "layer", "whole", [(digest, len(stream))])
    with pytest.raises(AenvError, match="claims"):
        repo.fetch_artifact(whole, tmp_path / "whole", "test")
    with pytest.raises(AenvError, match="claims"):
        read_chunk(repo.backend, (digest, len(stream)), "test")

    small = put_artifact(repo, "layer", "small", gnu_tar([entry("f", data=b"x")]))
    manifest = json.loads(repo.backend.get(artifact_key("layer", "small")))
    lying = put_manifest(repo, "layer", "lying", [tuple(c) for c in manifest["chunks"]], size=1 << 40)
    with pytest.raises(AenvError, match="size"):
        repo.fetch_artifact(lying, tmp_path / "lying", "test")
    repo.fetch_artifact(small, tmp_path / "small", "test")
    assert (tmp_path / "small" / "f").read_bytes() == b"x"


def test_repository_objects_that_are_not_files_are_refused(tmp_path: Path) -> None:
    """In a shared repository directory, a chunk (or a manifest, an entry) replaced by a link to
    /dev/zero, a FIFO or a huge file is refused at once: reading it would fill the node's memory
    or stall the fetch forever."""
    backend = PosixBackend(tmp_path / "repo")
    repo = Repository(backend)
    for n, make in enumerate(
        [
            lambda path: os.symlink("/dev/zero", path),
            lambda path: os.mkfifo(path),
            lambda path: path.write_bytes(bytes(100 * MiB)),
        ]
    ):
        ref = put_artifact(repo, "layer", f"odd{n}", gnu_tar([entry(f"f{n}", data=b"x")]))
        digest = json.loads(backend.get(artifact_key("layer", f"odd{n}")))["chunks"][0][0]
        chunk = tmp_path / "repo" / chunk_key(digest)
        chunk.unlink()
        make(chunk)
        with pytest.raises(ArtifactDamaged, match="cannot be read|not a file of at most 64 MiB"):
            repo.fetch_artifact(ref, tmp_path / f"odd{n}", "test")
    os.rename(tmp_path / "repo" / artifact_key("layer", "odd0"), tmp_path / "manifest")
    os.symlink("/dev/zero", tmp_path / "repo" / artifact_key("layer", "odd0"))
    with pytest.raises(ArtifactDamaged):
        repo.find_artifact("layer", "odd0")


def test_a_fetch_that_would_fill_the_disk_is_507(tmp_path: Path) -> None:
    repo = Repository(PosixBackend(tmp_path / "repo"))
    ref = put_artifact(repo, "layer", "some", gnu_tar([entry("f", data=os.urandom(MiB))]))
    disk = os.statvfs(tmp_path)
    with pytest.raises(AenvError) as refused:
        repo.fetch_artifact(ref, tmp_path / "some", "test", disk.f_bavail * disk.f_frsize)
    assert refused.value.status == 507 and "nearly full" in refused.value.message
    assert not (tmp_path / "some").exists()


# -- through a node: what it learns from the repository and fetches ---------------------------------
def base_entry(api: httpx.Client, repo: Repository) -> dict[str, Any]:
    found = repo.get_entry("template", api.get("/templates/base").json()["templateID"])
    assert found is not None, "the test node commits `base` to its repository"
    return found


def put_entry(repo: Repository, base: dict[str, Any], refs: tuple[ArtifactRef, ...] = (), **record: Any) -> str:
    """A template entry as another node could write it: ``base``'s, with ``record`` changed and
    ``refs`` added to its artifacts. Returns its name."""
    entry_id = uuid.uuid4().hex[:16]
    name = f"repo-{entry_id[:8]}"
    body = {
        **base,
        "id": entry_id,
        "record": {**base["record"], "id": entry_id, "name": name, "aliases": [], **record},
        "artifacts": [*base["artifacts"], *({"kind": r.kind, "id": r.id, "manifest": r.manifest} for r in refs)],
        "committed_at": time.time(),
    }
    repo.backend.put(entry_key("template", entry_id), json.dumps(body).encode())
    return name


def create(api: httpx.Client, name: str) -> httpx.Response:
    return api.post("/sandboxes", json={"templateID": name, "timeout": 120})


def after_a_while() -> None:
    """The node looks at the repository again (on a create naming something unknown) at most
    every 3 s: from now on, the next create sees what was written before this call."""
    time.sleep(3.5)


@pytest.mark.sandbox
def test_repository_records_naming_paths_are_never_imported(api: httpx.Client, server: Server, canary: Path) -> None:
    """Layer, image and bundle ids become paths under the data dir: a record from the repository
    whose layer is `../../../<canary>` made that host directory the top layer of the sandbox
    (its files readable inside). Such records, and malformed ones, are not imported, and the node
    goes on learning good ones."""
    secret = (canary / "secret").read_text()
    repo = Repository(PosixBackend(server.repo_dir))
    base = base_entry(api, repo)
    layers = base["record"]["layers"]
    fs = server.data_dir / "fs"
    hostile = [
        put_entry(repo, base, layers=[*layers, os.path.relpath(canary, fs / "layers")]),
        put_entry(repo, base, layers=[*layers, str(canary)]),
        put_entry(repo, base, layers="../../../etc"),
        put_entry(repo, base, image=os.path.relpath(canary, fs / "images")),
        put_entry(repo, base, guest="../../../../etc"),
        put_entry(repo, base, layers=None, image=7),
    ]
    broken = uuid.uuid4().hex[:16]
    repo.backend.put(
        entry_key("template", broken), json.dumps({**base, "id": broken, "record": {"id": broken}}).encode()
    )
    good = ""
    after_a_while()
    try:
        for name in hostile:
            r = create(api, name)
            assert r.status_code == 404, (name, r.text)
        assert untouched(canary, secret)
        good = put_entry(repo, base)
        after_a_while()
        r = create(api, good)
        assert r.status_code == 201, r.text
        api.delete(f"/sandboxes/{r.json()['sandboxID']}")
    finally:
        for key in [info.key for info in repo.backend.list("entries/templates/")]:
            name = json.loads(repo.backend.get(key)).get("record", {}).get("name", "")
            if name in (*hostile, good) or key.endswith(f"/{broken}.json"):
                repo.backend.remove(key)
        for name in (*hostile, good):
            api.delete(f"/templates/{name}")


@pytest.mark.sandbox
def test_a_hostile_layer_from_the_repository_stays_in_its_directory(
    api: httpx.Client, server: Server, canary: Path
) -> None:
    """A template another node committed with a top layer of its own making: one layer whose tar
    tries to write outside (the fetch fails, nothing is left), one with device nodes, a host
    kernel attribute and a set-uid file (fetched and booted: no device on the host, the attribute
    dropped, the rest as a sandbox expects)."""
    secret = (canary / "secret").read_text()
    repo = Repository(PosixBackend(server.repo_dir))
    base = base_entry(api, repo)
    layers_dir = server.data_dir / "fs" / "layers"
    escaping = [part for case in escapes(canary) for part in case]
    bad_id, odd_id = f"hostile-{uuid.uuid4().hex[:8]}", f"odd-{uuid.uuid4().hex[:8]}"
    bad = put_artifact(repo, "layer", bad_id, gnu_tar(escaping))
    odd = put_artifact(
        repo,
        "layer",
        odd_id,
        gnu_tar(
            [entry("probe", tarfile.DIRTYPE)]
            + [(renamed(info, f"probe/{info.name}"), data) for info, data in specials()]
        ),
    )
    names = [
        put_entry(repo, base, (bad,), layers=[*base["record"]["layers"], bad_id]),
        put_entry(repo, base, (odd,), layers=[*base["record"]["layers"], odd_id]),
    ]
    after_a_while()
    try:
        r = create(api, names[0])
        assert r.status_code == 500 and r.json()["error_code"] == "artifact_damaged", r.text
        assert not (layers_dir / bad_id).exists() and not list(layers_dir.glob(".fetch-*"))
        assert untouched(canary, secret)

        r = create(api, names[1])  # boots: the layer is fetched and usable
        assert r.status_code == 201, r.text
        api.delete(f"/sandboxes/{r.json()['sandboxID']}")
        check_specials(layers_dir / odd_id / "probe")
    finally:
        for name in names:
            api.delete(f"/templates/{name}")


# -- sandbox-made files in a committed snapshot --------------------------------------------------------
@pytest.mark.sandbox
def test_a_snapshot_with_fifos_links_and_devices_commits_without_reading_the_host(
    api: httpx.Client, server: Server, sandbox: Any, canary: Path
) -> None:
    """The sandbox leaves a FIFO (a commit that opened it would wait for a writer forever),
    links to the host's /etc/shadow and to a canary, and tries device nodes. A durable snapshot
    commits; no committed byte is the canary's."""
    secret = (canary / "secret").read_text()
    setup = (
        "mkfifo /home/user/fifo /fifo && ln -s /etc/shadow /home/user/shadow && "
        f"ln -s {canary}/secret /home/user/canary && ln -s {canary} /canary && "
        "(mknod /home/user/sda b 8 0; mknod /home/user/mem c 1 1; true)"
    )
    sandbox.commands.run(setup, user="root")
    started = time.monotonic()
    r = api.post(
        f"/sandboxes/{sandbox.sandbox_id}/snapshots", json={"name": f"odd-{uuid.uuid4().hex[:8]}", "durable": True}
    )
    assert r.status_code == 201 and r.json()["committed"] is True, r.text
    assert time.monotonic() - started < 120
    snap = r.json()["snapshotID"]
    try:
        repo = Repository(PosixBackend(server.repo_dir))
        found = repo.get_entry("snapshot", snap)
        assert found is not None
        base = base_entry(api, repo)
        known = {(a["kind"], a["id"]) for a in base["artifacts"]}
        for ref in repo.artifact_refs(found):
            if (ref.kind, ref.id) in known:
                continue
            for chunk in repo.artifact_chunks(ref, "test"):  # loose or packed (an image's)
                assert secret.encode() not in chunk, ref
        assert untouched(canary, secret)
        child = Sandbox.create(template=snap, timeout=60)
        try:
            out = child.commands.run("ls -l /home/user/fifo; readlink /home/user/shadow /canary", user="root").stdout
            assert out.startswith("p") and f"/etc/shadow\n{canary}\n" in out
        finally:
            child.kill()
    finally:
        api.delete(f"/templates/{snap}")
