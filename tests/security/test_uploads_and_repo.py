"""What an API-key holder sends to build from, and what the snapshot repository hands back, can
neither fill the host's disk nor write outside where it belongs (issue 10).

Build contexts and E2B uploads are bounded as sent (with and without a Content-Length), once
decompressed, in entries and in header size; the node refuses work with 507 when its disk is
nearly full; E2B uploads are collected once unused. Artifacts fetched from a repository that
others can write are decoded inside their target only (hostile tar entries, sparse extents and
records naming paths), and a sandbox's FIFOs, links and devices never stall or leak through a
commit of its snapshot."""

from __future__ import annotations

import http.client
import io
import json
import os
import subprocess
import tarfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from aenv.config import Settings
from tests.conftest import API_KEY, Server, start_server

MiB = 1 << 20
LIMITS = {
    "AENV_BUILD_UPLOAD_MAX_MB": "4",
    "AENV_BUILD_UNPACKED_MAX_MB": "16",
    "AENV_BUILD_MAX_ENTRIES": "500",
    "AENV_DISK_HEADROOM_MB": "0",
}
NODE = {"AENV_BUILD_BASE": "false", "AENV_REPO": "none"}


@contextmanager
def node(tmp: Path, **env: str) -> Iterator[Server]:
    """A node of its own (fresh data dir, no `base`, no repository) with ``env`` set."""
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
def test_an_oversize_context_is_413_with_or_without_its_length(small: Server) -> None:
    declared = build(small, os.urandom(5 * MiB))
    assert declared.status_code == 413
    body = error_of(declared)
    assert body["error_code"] == "payload_too_large"
    assert "4 MiB" in body["message"] and "AENV_BUILD_UPLOAD_MAX_MB" in body["message"]

    streamed = build(small, chunks(64 * MiB))  # chunked: no length to judge by
    assert streamed.status_code == 413 and "AENV_BUILD_UPLOAD_MAX_MB" in error_of(streamed)["message"]

    status, body = declare_only(small, "/templates/build?name=ctx", 100 << 30)
    assert status == 413 and "4 MiB" in body["message"]
    assert leftovers(small) == []

    fits = build(small, tar_of([item("data", os.urandom(3 * MiB))]))
    assert fits.status_code == 400 and "no Dockerfile" in error_of(fits)["message"]  # taken and unpacked


def test_an_oversize_e2b_upload_is_413_and_leaves_nothing(small: Server) -> None:
    files_hash = uuid.uuid4().hex
    present, url = upload_url(small, files_hash)
    assert not present
    declared = httpx.put(url, content=os.urandom(5 * MiB), timeout=120)
    assert declared.status_code == 413 and "AENV_BUILD_UPLOAD_MAX_MB" in error_of(declared)["message"]
    streamed = httpx.put(url, content=chunks(64 * MiB), timeout=300)
    assert streamed.status_code == 413 and "4 MiB" in error_of(streamed)["message"]
    status, _ = declare_only(small, url.split(str(small.port), 1)[1], 100 << 30, api_key=False)
    assert status == 413
    assert upload_url(small, files_hash)[0] is False and leftovers(small) == []

    ok = httpx.put(url, content=tar_of([item("file", b"data")]), timeout=60)
    assert ok.status_code == 200 and upload_url(small, files_hash)[0] is True


# -- what a context unpacks to -------------------------------------------------------------------------
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
        assert "unpacks to more than 16 MiB" in says and "AENV_BUILD_UNPACKED_MAX_MB" in says, says
    assert leftovers(small) == []


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
    assert r.status_code == 413 and "AENV_BUILD_UNPACKED_MAX_MB" in error_of(r)["message"]
    assert leftovers(small) == []


def test_a_context_of_too_many_entries_is_413(small: Server) -> None:
    many = [item(f"d/f{i}") for i in range(600)]
    r = build(small, tar_of(many, gz=True))
    assert r.status_code == 413
    assert "500 entries" in error_of(r)["message"] and "AENV_BUILD_MAX_ENTRIES" in error_of(r)["message"]
    assert leftovers(small) == []


# -- a nearly full disk -------------------------------------------------------------------------------
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
    status, _ = declare_only(full, "/templates/build?name=ctx", MiB)
    assert status == 507
    assert leftovers(full) == []


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

    cache = UploadCache(tmp_path, Settings(data_dir=tmp_path, build_files_ttl=0))
    for files_hash in ("used", "idle"):
        cache.tar(files_hash).write_bytes(b"")
    with cache.using("used"):
        assert cache.collect() == ["idle"]
    assert cache.tar("used").exists()
    assert cache.collect() == ["used"]
