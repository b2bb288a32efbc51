"""Images from files on the node, for hosts without a registry: an OCI image layout directory
(``oci:DIR[:TAG]``), the same as a tar (``oci-archive:FILE[:TAG]``) and ``docker save`` output
(``docker-archive:FILE[:REPO:TAG]``). Every blob read is checked against its digest, as from a
registry.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from aenv.errors import InvalidRequest, NotFound
from aenv.images.reference import ImageRef
from aenv.images.registry import INDEXES, Image, RegistryError, host_platform

TRANSPORTS = ("oci:", "oci-archive:", "docker-archive:")
REF_NAME = "org.opencontainers.image.ref.name"


def is_local(reference: str) -> bool:
    return reference.startswith(TRANSPORTS)


def _split(reference: str, roots: list[Path]) -> tuple[str, Path, str | None]:
    transport, _, rest = reference.partition(":")
    path, tag = rest, None
    if not Path(rest).exists() and ":" in rest:
        path, _, tag = rest.partition(":")
    resolved = Path(path).resolve()
    if not any(resolved.is_relative_to(root.resolve()) for root in roots):
        allowed = ", ".join(str(r) for r in roots)
        raise InvalidRequest(f"{transport} images must be under one of: {allowed} (AENV_IMAGE_IMPORT_DIRS)")
    if not resolved.exists():
        raise NotFound(f"{transport}: {path} does not exist on this node")
    return transport, resolved, tag


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


class LocalSource:
    """Resolves a local image and hands out its blobs (verified) like a registry would."""

    def __init__(self, reference: str, roots: list[Path]) -> None:
        self.reference = reference
        self.transport, self.path, self.tag = _split(reference, roots)
        self._tmp: Path | None = None
        self._blobs: dict[str, Path] = {}

    def close(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def ref(self) -> ImageRef:
        name = self.path.name.lower().replace("_", "-").split(".")[0] or "local"
        return ImageRef("local", "".join(c for c in name if c.isalnum() or c == "-") or "local", self.tag or "latest")

    def resolve(self) -> Image:
        root = self.path
        if self.transport in ("oci-archive", "docker-archive"):
            self._tmp = Path(tempfile.mkdtemp(prefix="aenv-image-"))
            try:
                with tarfile.open(self.path) as tar:
                    tar.extractall(self._tmp, filter="data")
            except (tarfile.TarError, OSError) as exc:
                raise InvalidRequest(f"{self.path}: not a readable image archive: {exc}") from exc
            root = self._tmp
        if self.transport == "docker-archive" and (root / "manifest.json").exists():
            return self._docker(root)
        return self._layout(root)

    def fetch(self, digest: str, dest: Path) -> None:
        path = self._blobs.get(digest)
        if path is None or not path.exists():
            raise RegistryError(f"{self.reference}: blob {digest} is missing", status=400)
        if _sha256_file(path) != digest:
            raise RegistryError(f"{self.reference}: blob {digest} does not match its digest", status=400)
        shutil.copyfile(path, dest)

    # -- OCI image layout ------------------------------------------------------------------------
    def _blob(self, root: Path, digest: str) -> Path:
        algo, _, hexdigest = digest.partition(":")
        path = root / "blobs" / algo / hexdigest
        self._blobs[digest] = path
        return path

    def _json_blob(self, root: Path, digest: str) -> dict[str, Any]:
        path = self._blob(root, digest)
        if not path.exists() or _sha256_file(path) != digest:
            raise RegistryError(f"{self.reference}: blob {digest} is missing or corrupt", status=400)
        return dict(json.loads(path.read_bytes()))

    def _layout(self, root: Path) -> Image:
        try:
            index = json.loads((root / "index.json").read_text())
        except (OSError, ValueError) as exc:
            raise InvalidRequest(f"{self.reference}: no OCI image layout (index.json): {exc}") from exc
        entries = index.get("manifests", [])
        if self.tag:
            entries = [m for m in entries if (m.get("annotations") or {}).get(REF_NAME) == self.tag]
        if not entries:
            raise NotFound(f"{self.reference}: no image tagged {self.tag!r} in the layout")
        desc = entries[0]
        manifest = self._json_blob(root, desc["digest"])
        digest = desc["digest"]
        if manifest.get("mediaType") in INDEXES or "manifests" in manifest:
            want = host_platform()
            chosen = [
                m
                for m in manifest.get("manifests", [])
                if (m.get("platform", {}).get("os"), m.get("platform", {}).get("architecture")) == want
            ]
            if not chosen:
                raise InvalidRequest(f"{self.reference} has no {want[0]}/{want[1]} variant")
            digest = chosen[0]["digest"]
            manifest = self._json_blob(root, digest)
        config = self._json_blob(root, manifest["config"]["digest"])
        layers = list(manifest.get("layers", []))
        for layer in layers:
            self._blob(root, layer["digest"])
        return Image(self.ref(), digest, manifest, config, layers)

    # -- docker save -----------------------------------------------------------------------------
    def _docker(self, root: Path) -> Image:
        entries = json.loads((root / "manifest.json").read_text())
        if self.tag:
            entries = [e for e in entries if self.tag in (e.get("RepoTags") or [])]
        if not entries:
            raise NotFound(f"{self.reference}: no image {self.tag!r} in the archive")
        entry = entries[0]
        config_path = root / entry["Config"]
        config = json.loads(config_path.read_bytes())
        layers = []
        for name in entry["Layers"]:
            path = root / name
            digest = _sha256_file(path)  # docker save layers are plain tars: digest = diff_id
            self._blobs[digest] = path
            layers.append({"digest": digest, "mediaType": "application/vnd.docker.image.rootfs.diff.tar"})
        digest = _sha256_file(config_path)
        return Image(self.ref(), digest, {"layers": layers}, config, layers)
