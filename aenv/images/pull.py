"""Pull an image into the node's layer store: one overlay lower per OCI layer, shared by content.

A layer's id derives from its diff_id (the digest of its uncompressed tar), so every template
built on the same base layers uses the same directories, and a layer already here is never
fetched again. A layer appears under its id only once it is complete and verified.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aenv.images.local import DIGEST, LocalSource, is_local
from aenv.images.mirrors import MirroredClient
from aenv.images.reference import ImageRef
from aenv.images.registry import Image
from aenv.images.unpack import LayerError, apply_layer
from aenv.storage.confined import remove_tree
from aenv.storage.layers import new_id
from aenv.storage.space import ensure_space, headroom

if TYPE_CHECKING:
    from aenv.node.service import BuildHost

LogFn = Callable[[str], None]


def layer_id_of(diff_id: str) -> str:
    return "oci-" + diff_id.split(":", 1)[1][:32]


def _check_layers(image: Image) -> None:
    """Layer directories are named after diff_ids, which come from the image: only digests."""
    try:
        diff_ids = image.diff_ids
    except AttributeError as exc:
        raise LayerError(f"{image.ref}: malformed image config: {exc}") from exc
    if len(diff_ids) != len(image.layers):
        raise LayerError(f"{image.ref}: the manifest has {len(image.layers)} layers, the config {len(diff_ids)}")
    for diff_id in diff_ids:
        if not isinstance(diff_id, str) or not DIGEST.fullmatch(diff_id):
            raise LayerError(f"{image.ref}: diff_id {diff_id!r} is not a sha256 digest")


PullProgressFn = Callable[[int, int, int, int], None]  # (layer, layers, bytes done, bytes in the layer)
PROGRESS_EVERY = 0.25  # seconds between two reports of one layer's download


@dataclass
class Pulled:
    ref: ImageRef
    digest: str
    layers: list[str]  # layer ids, lowest first
    config: dict[str, Any]
    fetched_bytes: int
    cached_layers: int


class LayerProgress:
    """``on_progress(layer, layers, done, total)`` as a layer's bytes arrive: at most every
    quarter second, and always once the layer is whole (what a client's progress bar needs)."""

    def __init__(self, on_progress: PullProgressFn | None, layer: int, layers: int, total: int) -> None:
        self.on_progress, self.layer, self.layers, self.total = on_progress, layer, layers, total
        self.done, self.shown_at = 0, 0.0

    def add(self, count: int) -> None:
        self.done += count
        now = time.monotonic()
        if self.on_progress is not None and now - self.shown_at >= PROGRESS_EVERY:
            self.shown_at = now
            self.on_progress(self.layer, self.layers, self.done, max(self.total, self.done))

    def finish(self, size: int) -> None:
        if self.on_progress is not None:
            self.on_progress(self.layer, self.layers, size, size)


async def pull(
    node: BuildHost,
    reference: str,
    *,
    login: tuple[str, str] | None = None,
    on_log: LogFn | None = None,
    on_progress: PullProgressFn | None = None,
) -> Pulled:
    """Bring an image's layers into the layer store: from a registry (``login`` = (user, password)
    for it, else the Docker config's), or from a layout or archive on this node (``oci:``,
    ``oci-archive:``, ``docker-archive:``). ``on_progress`` follows each layer's download."""
    log = on_log or (lambda line: None)
    roots = [node.settings.data_dir / "imports", *map(Path, node.settings.image_import_dirs)]
    tmp = node.files.root / "tmp"
    tmp.mkdir(exist_ok=True)
    local = LocalSource(reference, roots, tmp, node.uploads.limits) if is_local(reference) else None
    client = None
    if local is None:
        registry = ImageRef.parse(reference).registry
        logins = {registry: login} if login else {}
        insecure = set(node.settings.insecure_registries)
        client = MirroredClient(registry, node.settings.registry_mirrors, insecure=insecure, credentials=logins)
    ensure_space(tmp, headroom(node.settings), 0, f"pulling {reference}")
    fetched, cached, ids = 0, 0, []
    try:
        if local is not None:
            image = await asyncio.to_thread(local.resolve)
            ref = image.ref
        else:
            assert client is not None
            ref = ImageRef.parse(reference)
            image = await client.resolve(ref)
        _check_layers(image)
        source = f" from {client.source}" if client is not None and client.source != ref.registry else ""
        log(f"{ref}{source}: {len(image.layers)} layers, manifest {image.digest[:19]}")
        for i, (desc, diff_id) in enumerate(zip(image.layers, image.diff_ids, strict=True), 1):
            layer_id = layer_id_of(diff_id)
            ids.append(layer_id)
            node.artifacts.pin([layer_id])  # not garbage while the template is being made
            final = node.files.layers / layer_id
            if final.exists():
                node.files.touch(layer_id)
                cached += 1
                log(f"layer {i}/{len(image.layers)} {diff_id[:19]}: cached")
                continue
            declared = desc.get("size")  # the manifest's word for it: refuses a pull that cannot fit
            need = declared if isinstance(declared, int) else 0
            ensure_space(tmp, headroom(node.settings), need, f"layer {i} of {ref}")
            started = time.monotonic()
            progress = LayerProgress(on_progress, i, len(image.layers), need)
            blob = tmp / f"{new_id()}.blob"
            work = tmp / f"{layer_id}.{new_id()}"
            try:
                if local is not None:
                    await asyncio.to_thread(local.fetch, desc["digest"], blob)
                else:
                    assert client is not None
                    await client.fetch_blob(ref, desc, blob, on_bytes=progress.add)
                size = blob.stat().st_size
                progress.finish(size)
                got = await asyncio.to_thread(apply_layer, blob, work, headroom(node.settings))
                if got != diff_id:
                    raise LayerError(f"layer {i} of {ref} unpacks to {got}, not its diff_id {diff_id}")
                if not final.exists():
                    work.rename(final)
            finally:
                blob.unlink(missing_ok=True)
                if work.exists():
                    await asyncio.to_thread(remove_tree, work, ignore_errors=True)
            fetched += size
            took = time.monotonic() - started
            log(f"layer {i}/{len(image.layers)} {diff_id[:19]}: {size / 2**20:.1f} MiB in {took:.1f}s")
        return Pulled(ref, image.digest, ids, image.config, fetched, cached)
    except BaseException:
        node.artifacts.unpin(ids)
        raise
    finally:
        if client is not None:
            await client.close()
        if local is not None:
            local.close()


def release(node: BuildHost, pulled: Pulled) -> None:
    """The template (or the failure) is recorded: the layers are ordinary layers again."""
    node.artifacts.unpin(pulled.layers)
