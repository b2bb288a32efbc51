"""Images from files on the node, for hosts without a registry: an OCI image layout directory
(``oci:DIR[:TAG]``), the same as a tar (``oci-archive:FILE[:TAG]``) and ``docker save`` output
(``docker-archive:FILE[:REPO:TAG]``). Every blob read is checked against its digest, as from a
registry, and must be a regular file inside the layout or archive named: what a manifest or an
index names (digests, docker-save paths) is refused when it is absolute, has ``..`` or reaches
outside through a link. An archive is unpacked as a build context is (never `tarfile`'s
extraction: its ``data`` filter checks names with ``os.path.realpath``, which a path longer than
PATH_MAX fools), in the node's work directory, bounded like one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import stat
from pathlib import Path
from typing import IO, Any

from aenv.errors import InvalidRequest, NotFound, parse_json
from aenv.images.reference import ImageRef
from aenv.images.registry import INDEXES, Image, RegistryError, host_platform
from aenv.storage.confined import remove_tree
from aenv.storage.layers import new_id
from aenv.templates.uploads import ContextLimits, unpack_context

TRANSPORTS = ("oci:", "oci-archive:", "docker-archive:")
REF_NAME = "org.opencontainers.image.ref.name"
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
MAX_JSON = 16 << 20  # an index, a manifest or a config
log = logging.getLogger("aenv.images")


def is_local(reference: str) -> bool:
    return reference.startswith(TRANSPORTS)


def _split(reference: str, roots: list[Path]) -> tuple[str, Path, str | None]:
    transport, _, rest = reference.partition(":")
    path, tag = rest, None
    if not Path(rest).exists() and ":" in rest:
        path, _, tag = rest.partition(":")
    resolved = _resolved(Path(path), f"{transport}: {path}")
    if not any(resolved.is_relative_to(root.resolve()) for root in roots):
        # which directories those are is the operator's to know, not an API client's
        log.info("refused %s: not under %s", reference, ", ".join(str(r) for r in roots))
        raise InvalidRequest(f"{transport} images must be under the node's import directories (AENV_IMAGE_IMPORT_DIRS)")
    if not resolved.exists():
        raise NotFound(f"{transport}: {path} does not exist on this node")
    if not (resolved.is_dir() if transport == "oci" else resolved.is_file()):
        raise InvalidRequest(f"{transport}: {path} is not a {'directory' if transport == 'oci' else 'file'}")
    return transport, resolved, tag


def _inside(root: Path, name: Any, what: str) -> Path:
    """``name`` (from a manifest or an index) as a regular file inside ``root``."""
    if not isinstance(name, str) or not name or name.startswith("/") or ".." in name.split("/"):
        raise InvalidRequest(f"{what} {name!r} is not a path inside the image")
    path = _resolved(root / name, f"{what} {name!r}")
    if not path.is_relative_to(root.resolve()) or not path.is_file():
        raise InvalidRequest(f"{what} {name!r} is not a file inside the image")
    return path


def _resolved(path: Path, what: str) -> Path:
    """``path`` without links; a loop of them is the client's mistake (400), not a 500."""
    try:
        return path.resolve()
    except (RuntimeError, OSError) as exc:  # Python < 3.13 raises RuntimeError for a loop
        raise InvalidRequest(f"{what} cannot be resolved (a loop of links)") from exc


def _open(path: Path) -> IO[bytes]:
    """``path`` for reading: a regular file, never a link, a FIFO or a device."""
    file = os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC), "rb")
    if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
        file.close()
        raise InvalidRequest(f"{path.name} is not a regular file")
    return file


def _hash(path: Path, out: IO[bytes] | None = None) -> str:
    """The sha256 digest of ``path``, copied to ``out`` as it is read: what is hashed is what is copied."""
    h = hashlib.sha256()
    with _open(path) as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            if out is not None:
                out.write(chunk)
    return "sha256:" + h.hexdigest()


def _small(path: Path) -> tuple[str, bytes]:
    """The digest and content of a JSON document (an index, a manifest, a config)."""
    with _open(path) as f:
        data = f.read(MAX_JSON + 1)
    if len(data) > MAX_JSON:
        raise InvalidRequest(f"{path.name} is larger than {MAX_JSON} bytes")
    return "sha256:" + hashlib.sha256(data).hexdigest(), data


def _json(data: bytes, what: str) -> Any:
    try:
        return parse_json(data)
    except ValueError as exc:
        raise InvalidRequest(f"{what} is not JSON: {exc}") from exc


class LocalSource:
    """Resolves a local image and hands out its blobs (verified) like a registry would. An
    archive is unpacked in a directory of its own under ``work``, within ``limits``."""

    def __init__(self, reference: str, roots: list[Path], work: Path, limits: ContextLimits) -> None:
        self.reference = reference
        self.transport, self.path, self.tag = _split(reference, roots)
        self.work = work
        self.limits = limits
        self._tmp: Path | None = None
        self._blobs: dict[str, Path] = {}

    def close(self) -> None:
        if self._tmp is not None:
            remove_tree(self._tmp, ignore_errors=True)

    def ref(self) -> ImageRef:
        name = self.path.name.lower().replace("_", "-").split(".")[0] or "local"
        return ImageRef("local", "".join(c for c in name if c.isalnum() or c == "-") or "local", self.tag or "latest")

    def resolve(self) -> Image:
        root = self.path
        if self.transport in ("oci-archive", "docker-archive"):
            self._tmp = self.work / f"image-{new_id()}"
            unpack_context(self.path, self._tmp, self.limits, f"the image archive {self.path.name}")
            root = self._tmp
        if self.transport == "docker-archive" and (root / "manifest.json").exists():
            return self._docker(root)
        return self._layout(root)

    def size(self, digest: str) -> int:
        """The blob's size as stored (what a layout's manifest says of it is not relied on)."""
        path = self._blobs.get(digest)
        if path is None:
            raise RegistryError(f"{self.reference}: blob {digest} is missing", status=400)
        return os.stat(path).st_size

    def fetch(self, digest: str, dest: Path) -> None:
        path = self._blobs.get(digest)
        if path is None:
            raise RegistryError(f"{self.reference}: blob {digest} is missing", status=400)
        with open(dest, "wb") as out:
            got = _hash(path, out)
        if got != digest:
            dest.unlink()
            raise RegistryError(f"{self.reference}: blob {digest} does not match its digest", status=400)

    # -- OCI image layout ------------------------------------------------------------------------
    def _blob(self, root: Path, digest: Any) -> Path:
        if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
            raise InvalidRequest(f"{self.reference}: {digest!r} is not a sha256 digest")
        path = _inside(root, f"blobs/sha256/{digest.split(':', 1)[1]}", f"{self.reference}: blob")
        self._blobs[digest] = path
        return path

    def _json_blob(self, root: Path, digest: Any) -> dict[str, Any]:
        got, data = _small(self._blob(root, digest))
        if got != digest:
            raise RegistryError(f"{self.reference}: blob {digest} is corrupt", status=400)
        value = _json(data, f"{self.reference}: blob {digest}")
        if not isinstance(value, dict):
            raise InvalidRequest(f"{self.reference}: blob {digest} is not a JSON object")
        return value

    def _layout(self, root: Path) -> Image:
        try:
            _, raw = _small(_inside(root, "index.json", "index"))
        except (OSError, InvalidRequest) as exc:
            raise InvalidRequest(f"{self.reference}: no OCI image layout (index.json): {exc}") from exc
        index = _json(raw, f"{self.reference}: index.json")
        try:
            return self._layout_image(root, index)
        except (KeyError, TypeError, AttributeError) as exc:
            raise InvalidRequest(f"{self.reference}: malformed OCI layout: {exc!r}") from exc

    def _layout_image(self, root: Path, index: dict[str, Any]) -> Image:
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
        _, raw = _small(_inside(root, "manifest.json", "manifest"))
        entries = _json(raw, f"{self.reference}: manifest.json")
        try:
            return self._docker_image(root, entries)
        except (KeyError, TypeError, AttributeError) as exc:
            raise InvalidRequest(f"{self.reference}: malformed manifest.json: {exc!r}") from exc

    def _docker_image(self, root: Path, entries: list[dict[str, Any]]) -> Image:
        if self.tag:
            entries = [e for e in entries if self.tag in (e.get("RepoTags") or [])]
        if not entries:
            raise NotFound(f"{self.reference}: no image {self.tag!r} in the archive")
        entry = entries[0]
        config_path = _inside(root, entry["Config"], f"{self.reference}: config")
        digest, raw = _small(config_path)
        config = _json(raw, f"{self.reference}: config")
        layers = []
        for name in entry["Layers"]:
            path = _inside(root, name, f"{self.reference}: layer")
            layer_digest = _hash(path)  # docker save layers are plain tars: digest = diff_id
            self._blobs[layer_digest] = path
            layers.append({"digest": layer_digest, "mediaType": "application/vnd.docker.image.rootfs.diff.tar"})
        return Image(self.ref(), digest, {"layers": layers}, config, layers)
