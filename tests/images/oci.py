"""Test images made here, and a real registry (Debian's docker-registry) to push them to."""

from __future__ import annotations

import bz2
import functools
import gzip
import hashlib
import io
import json
import lzma
import shutil
import subprocess
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import zstandard

from tests.conftest import free_port

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class LayerTar:
    """An uncompressed layer tar built in memory."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.tar = tarfile.open(fileobj=self.buf, mode="w", format=tarfile.PAX_FORMAT)

    def dir(self, name: str, mode: int = 0o755) -> LayerTar:
        info = tarfile.TarInfo(name)
        info.type, info.mode = tarfile.DIRTYPE, mode
        self.tar.addfile(info)
        return self

    def file(self, name: str, data: bytes, mode: int = 0o644, uid: int = 0) -> LayerTar:
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.uid, info.gid = len(data), mode, uid, uid
        self.tar.addfile(info, io.BytesIO(data))
        return self

    def symlink(self, name: str, target: str) -> LayerTar:
        info = tarfile.TarInfo(name)
        info.type, info.linkname = tarfile.SYMTYPE, target
        self.tar.addfile(info)
        return self

    def bytes(self) -> bytes:
        self.tar.close()
        return self.buf.getvalue()


def busybox_layer() -> LayerTar:
    layer = LayerTar().dir("bin").dir("etc").dir("tmp", 0o1777)
    layer.file("bin/busybox", Path("/bin/busybox").read_bytes(), 0o755)
    for applet in ("sh", "ls", "cat", "echo", "id", "whoami", "stat", "sleep", "mkdir", "rm", "env", "ash"):
        layer.symlink(f"bin/{applet}", "busybox")
    # E2B's SDKs run commands with /bin/bash -l -c; busybox has no bash, ash stands in for it here
    layer.file("bin/bash", b'#!/bin/sh\nexec /bin/busybox ash "$@"\n', 0o755)
    layer.file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n")
    layer.file("etc/group", b"root:x:0:\n")
    return layer


ZERO_RUN = 16 << 20  # zeros compressed once, and repeated in a bomb
MEMBER = {"gzip": lambda b: gzip.compress(b, mtime=0), "bzip2": bz2.compress, "xz": lzma.compress, "none": bytes}
MEDIA = {"gzip": "+gzip", "zstd": "+zstd", "bzip2": "", "xz": "", "none": ""}  # bzip2 and xz: no OCI type; sniffed


@functools.cache
def _zero_member(compression: str, count: int) -> bytes:
    return MEMBER[compression](bytes(count))


def compress(data: bytes, compression: str) -> bytes:
    """``data`` as one gzip, bzip2 or xz member, one zstd frame, or as it is ("none")."""
    return zstandard.compress(data) if compression == "zstd" else MEMBER[compression](data)


def tar_header(name: str, size: int, kind: bytes = tarfile.REGTYPE) -> bytes:
    """A file's header, whatever its size (GNU format: sizes past 8 GiB in base-256)."""
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.type = size, 0o644, kind
    return info.tobuf(format=tarfile.GNU_FORMAT)


def zero_layer(
    files: list[tuple[str, int | bytes]], compression: str = "gzip", trailing: int = 0, hashed: bool = True
) -> tuple[bytes, str]:
    """A layer of files (name, and its bytes or that many zeros) then ``trailing`` zeros past the
    end of the archive, compressed without ever holding its tar: gzip, bzip2 and xz as members one
    after another (a run of zeros compressed once and repeated), zstd as one frame, or none.
    Returns (blob, diff_id); the diff_id is left empty unless ``hashed`` (hashing GiBs takes seconds)."""
    sha = hashlib.sha256()
    frame = zstandard.ZstdCompressor().compressobj() if compression == "zstd" else None
    out: list[bytes] = []

    def put(data: bytes) -> None:
        if hashed:
            sha.update(data)
        if data:
            out.append(frame.compress(data) if frame is not None else MEMBER[compression](data))

    def zeros(count: int) -> None:
        runs, rest = divmod(count, ZERO_RUN)
        for size in [ZERO_RUN] * runs + [rest] * bool(rest):
            if hashed:
                sha.update(bytes(size))
            if frame is not None:
                out.append(frame.compress(bytes(size)))
            else:
                out.append(_zero_member(compression, size))

    for name, content in files:
        size = content if isinstance(content, int) else len(content)
        put(tar_header(name, size))
        if isinstance(content, int):
            zeros(content)
        else:
            put(content)
        put(bytes(-size % tarfile.BLOCKSIZE))
    put(bytes(2 * tarfile.BLOCKSIZE))
    zeros(trailing)
    if frame is not None:
        out.append(frame.flush())
    return b"".join(out), ("sha256:" + sha.hexdigest()) if hashed else ""


def sparse_layer(work: Path, apparent: int, pax: bool = False) -> bytes:
    """A tar (GNU tar's own: Python's writes none) of one sparse file of ``apparent`` bytes that
    holds 4 KiB of data: an old GNU sparse entry, or a PAX 1.0 one."""
    work.mkdir(parents=True, exist_ok=True)
    with open(work / "sparse", "wb") as f:
        f.truncate(apparent)
        f.seek(apparent // 2)
        f.write(b"x" * 4096)
    form = ["--format=pax", "--sparse-version=1.0"] if pax else ["--format=gnu"]
    done = subprocess.run(["tar", "--sparse", *form, "-C", str(work), "-cf", "-", "sparse"], capture_output=True)
    assert done.returncode == 0, done.stderr
    (work / "sparse").unlink()
    return done.stdout


class GzipLayer:
    """A layer compressed once (gzip at Go's default level, no time), for images pushed by the
    dozen: a base they share is compressed once, uploaded once and mounted into the other
    repositories, as a registry holds it. Only the blob is kept, not the tar."""

    def __init__(self, tar: bytes) -> None:
        self.blob = gzip.compress(tar, compresslevel=6, mtime=0)
        self.digest = sha(self.blob)
        self.diff_id = sha(tar)
        self.size = len(tar)  # uncompressed
        self.pushed_to = ""  # the repository it was uploaded to first


@dataclass
class Registry:
    host: str  # "127.0.0.1:PORT"
    proc: subprocess.Popen[bytes]
    auth: tuple[str, str] | None = None  # when the registry asks for a login

    @property
    def http(self) -> httpx.Client:
        return httpx.Client(auth=self.auth, timeout=60)

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    def push_blob(self, repo: str, data: bytes) -> str:
        digest = sha(data)
        start = self.http.post(f"{self.url}/v2/{repo}/blobs/uploads/")
        assert start.status_code == 202, start.text
        location = start.headers["location"]
        if location.startswith("/"):
            location = self.url + location
        put = self.http.put(httpx.URL(location).copy_add_param("digest", digest), content=data)  # keeps _state
        assert put.status_code == 201, put.text
        return digest

    def push_image(
        self,
        repo: str,
        tag: str,
        layers: list[tuple[bytes, str]],  # (uncompressed tar, "gzip" | "zstd" | "none")
        env: list[str] | None = None,
        diff_ids: list[str] | None = None,
        platform: tuple[str, str] = ("linux", "amd64"),
        config: dict[str, object] | None = None,
    ) -> str:
        """Push an image (linux/amd64 unless ``platform`` says otherwise; ``config``: more of its
        config, e.g. WorkingDir and User); returns its manifest digest."""
        descs: list[dict[str, object]] = []
        for tar, compression in layers:
            # gzip without a time: one layer pushed twice is one blob, as a registry holds a shared base
            gz = lambda b: gzip.compress(b, mtime=0)  # noqa: E731
            blob = {"gzip": gz, "zstd": zstandard.compress, "none": lambda b: b}[compression](tar)
            media = (
                "application/vnd.oci.image.layer.v1.tar" + {"gzip": "+gzip", "zstd": "+zstd", "none": ""}[compression]
            )
            descs.append({"mediaType": media, "digest": self.push_blob(repo, blob), "size": len(blob)})
        return self._push_manifest(repo, tag, descs, diff_ids or [sha(t) for t, _ in layers], env, platform, config)

    def push_blobs(self, repo: str, tag: str, layers: list[tuple[bytes, str, str]]) -> str:
        """Push an image of layers compressed ahead: (blob, compression, diff_id) each (a bomb's
        tar is never held); returns its manifest digest."""
        media = "application/vnd.oci.image.layer.v1.tar"
        descs = [
            {"mediaType": media + MEDIA[compression], "digest": self.push_blob(repo, blob), "size": len(blob)}
            for blob, compression, _ in layers
        ]
        return self._push_manifest(repo, tag, descs, [diff_id for _, _, diff_id in layers], None)

    def push_gzip_image(self, repo: str, tag: str, layers: list[GzipLayer], env: list[str] | None = None) -> str:
        """Push a linux/amd64 image of layers compressed ahead; returns its manifest digest."""
        http = self.http
        for layer in layers:
            if layer.pushed_to:
                mount = {"mount": layer.digest, "from": layer.pushed_to}
                r = http.post(f"{self.url}/v2/{repo}/blobs/uploads/", params=mount)
                if r.status_code == 201:
                    continue
            self.push_blob(repo, layer.blob)
            layer.pushed_to = layer.pushed_to or repo
        media = "application/vnd.oci.image.layer.v1.tar+gzip"
        descs = [{"mediaType": media, "digest": x.digest, "size": len(x.blob)} for x in layers]
        return self._push_manifest(repo, tag, descs, [x.diff_id for x in layers], env)

    def _push_manifest(
        self,
        repo: str,
        tag: str,
        layers: list[dict[str, object]],
        diff_ids: list[str],
        env: list[str] | None,
        platform: tuple[str, str] = ("linux", "amd64"),
        more: dict[str, object] | None = None,
    ) -> str:
        """Push the config of an image of ``layers`` (descriptors of blobs pushed) and its manifest."""
        config = {
            "architecture": platform[1],
            "os": platform[0],
            "config": {"Env": env or ["PATH=/bin"], **(more or {})},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }
        raw_config = json.dumps(config).encode()
        manifest = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"mediaType": OCI_CONFIG, "digest": self.push_blob(repo, raw_config), "size": len(raw_config)},
            "layers": layers,
        }
        return self.put_manifest(repo, tag, manifest, OCI_MANIFEST)

    def put_manifest(self, repo: str, tag: str, body: dict[str, object], media: str) -> str:
        raw = json.dumps(body).encode()
        r = self.http.put(f"{self.url}/v2/{repo}/manifests/{tag}", content=raw, headers={"Content-Type": media})
        assert r.status_code == 201, r.text
        return sha(raw)

    def push_index(self, repo: str, tag: str, entries: list[tuple[str, str, str]]) -> str:
        """An image index of (manifest digest, os, architecture)."""
        manifests = []
        for digest, os_, arch in entries:
            url = f"{self.url}/v2/{repo}/manifests/{digest}"
            size = len(self.http.get(url, headers={"Accept": OCI_MANIFEST}).content)
            manifests.append(
                {
                    "mediaType": OCI_MANIFEST,
                    "digest": digest,
                    "size": size,
                    "platform": {"os": os_, "architecture": arch},
                }
            )
        return self.put_manifest(
            repo, tag, {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests}, OCI_INDEX
        )


def start_registry(root: Path, login: tuple[str, str] | None = None) -> Iterator[Registry]:
    """Debian's docker-registry on loopback; with ``login``, behind htpasswd (basic) auth."""
    binary = shutil.which("docker-registry")
    assert binary, "docker-registry is installed by scripts/install"
    port = free_port()
    config = root / "config.yml"
    auth = ""
    if login is not None:
        (root / "htpasswd").write_text(f"{login[0]}:{bcrypt_hash(login[1])}\n")
        auth = f"auth:\n  htpasswd:\n    realm: aenv-tests\n    path: {root / 'htpasswd'}\n"
    config.write_text(
        "version: 0.1\n"
        f"storage:\n  filesystem:\n    rootdirectory: {root / 'data'}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
        "log:\n  level: error\n" + auth
    )
    proc = subprocess.Popen([binary, "serve", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    registry = Registry(f"127.0.0.1:{port}", proc, login)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if registry.http.get(f"{registry.url}/v2/").status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    else:
        proc.kill()
        raise RuntimeError("docker-registry did not come up")
    yield registry
    proc.terminate()
    proc.wait(10)


def bcrypt_hash(password: str) -> str:
    """The only hash docker-registry's htpasswd accepts (glibc's crypt does bcrypt on Debian)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt

    return crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH))


def _config(diff_ids: list[str], env: list[str] | None = None, more: dict[str, object] | None = None) -> bytes:
    body = {"architecture": "amd64", "os": "linux", "config": {"Env": env or ["PATH=/bin"], **(more or {})}}
    body["rootfs"] = {"type": "layers", "diff_ids": diff_ids}
    return json.dumps(body).encode()


def write_layout(root: Path, layers: list[bytes], tag: str, config: dict[str, object] | None = None) -> None:
    """An OCI image layout (gzip layers) with one manifest tagged ``tag`` (``config``: more of
    the image's config, e.g. User and WorkingDir)."""
    write_layout_blobs(root, [(gzip.compress(tar), "gzip", sha(tar)) for tar in layers], tag, config)


def write_layout_blobs(
    root: Path, layers: list[tuple[bytes, str, str]], tag: str, more: dict[str, object] | None = None
) -> None:
    """An OCI image layout of layers compressed ahead, (blob, compression, diff_id) each, with
    one manifest tagged ``tag``."""
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)

    def put(data: bytes) -> str:
        digest = sha(data)
        (blobs / digest.split(":")[1]).write_bytes(data)
        return digest

    media = "application/vnd.oci.image.layer.v1.tar"
    descs = [
        {"mediaType": media + MEDIA[compression], "digest": put(blob), "size": len(blob)}
        for blob, compression, _ in layers
    ]
    config = _config([diff_id for _, _, diff_id in layers], more=more)
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": put(config),
                "size": len(config),
            },
            "layers": descs,
        }
    ).encode()
    entry = {"mediaType": OCI_MANIFEST, "digest": put(manifest), "size": len(manifest)}
    entry["annotations"] = {"org.opencontainers.image.ref.name": tag}
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [entry]}))


def write_docker_archive(path: Path, layers: list[bytes], repo_tag: str) -> None:
    """What `docker save` writes: manifest.json, a config and plain layer tars."""
    with tarfile.open(path, "w") as out:

        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            out.addfile(info, io.BytesIO(data))

        names = []
        for i, tar in enumerate(layers):
            names.append(f"layer{i}/layer.tar")
            add(names[-1], tar)
        config = _config([sha(t) for t in layers])
        add("config.json", config)
        add("manifest.json", json.dumps([{"Config": "config.json", "RepoTags": [repo_tag], "Layers": names}]).encode())
