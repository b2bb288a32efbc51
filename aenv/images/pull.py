"""Pull an image into the node's layer store: one overlay lower per OCI layer, shared by content.

A layer's id derives from its diff_id (the digest of its uncompressed tar), so every template
built on the same base layers uses the same directories, and a layer already here is never
fetched again. A layer appears under its id only once it is complete and verified.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import json
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

from aenv.errors import AenvError, InsufficientStorage, InvalidRequest, PayloadTooLarge, RuntimeFailure
from aenv.images.local import DIGEST, LocalSource, is_local
from aenv.images.mirrors import MirroredClient, parse_mirrors
from aenv.images.reference import ImageRef
from aenv.images.registry import Image
from aenv.images.unpack import Bounds, GrowthFn, LayerError, Meter, apply_layer, apply_layer_stream
from aenv.node import metrics
from aenv.storage.confined import remove_tree
from aenv.storage.layers import new_id
from aenv.storage.space import ensure_space, headroom

if TYPE_CHECKING:
    from aenv.node.service import BuildHost

LogFn = Callable[[str], None]
T = TypeVar("T")
PARALLEL_LAYERS = 4  # layers of one image downloading and unpacking at once
PIPE_SIZE = 1 << 20  # between a download and its unpack
WRITE_BATCH = 256 << 10  # bytes of a download handed to its unpack at a time
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
UNPACK_APART = 4 << 20  # a layer this large (compressed) unpacks in a process of its own, a smaller one on a thread
# What the unpacking process may answer, as it raised it (anything else: an AenvError of its status).
UNPACK_ERRORS: dict[str, type[AenvError]] = {
    cls.__name__: cls for cls in (LayerError, PayloadTooLarge, InsufficientStorage, InvalidRequest)
}


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
    sizes: dict[str, int] = field(default_factory=dict)  # layer id -> its blob's size (compressed)


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


class ImagePull:
    """One pull of ``reference`` into the layer store: :meth:`resolve` its manifest (the digest
    is known before any layer moves), then :meth:`fetch_layers`; :meth:`close` at the end.

    From a registry (``login`` = (user, password) for it, else the node's, ``AENV_REGISTRY_AUTH``
    or the Docker config), or from a layout or archive on this node (``oci:``, ``oci-archive:``,
    ``docker-archive:``). ``on_progress`` follows each layer's download."""

    def __init__(
        self,
        node: BuildHost,
        reference: str,
        *,
        login: tuple[str, str] | None = None,
        on_log: LogFn | None = None,
        on_progress: PullProgressFn | None = None,
    ) -> None:
        settings = node.settings
        self.node, self.reference, self.on_progress = node, reference, on_progress
        self.log = on_log or (lambda line: None)
        roots = [settings.data_dir / "imports", *map(Path, settings.image_import_dirs)]
        self.tmp = node.files.root / "tmp"
        self.tmp.mkdir(exist_ok=True)
        self.local = LocalSource(reference, roots, self.tmp, node.uploads.limits) if is_local(reference) else None
        self.client: MirroredClient | None = None
        if self.local is None:
            registry = ImageRef.parse(reference).registry
            self.client = MirroredClient(
                registry,
                parse_mirrors(settings.registry_mirrors),  # checked at the node's start
                insecure=set(settings.insecure_registries),
                credentials={registry: login} if login else {},
                auth=settings.registry_auth,
                read_timeout=settings.registry_read_timeout,
            )
        self.ref: ImageRef | None = None
        self.image: Image | None = None
        self.bounds = Bounds.layer(settings)  # what each layer may unpack to
        self.unpacked: Meter | None = None  # what the image's layers unpack to together (those here: as they did)

    async def __aenter__(self) -> ImagePull:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
        if self.local is not None:
            self.local.close()

    async def resolve(self) -> Image:
        """The image's manifest and config (for this host's platform), checked."""
        ensure_space(self.tmp, headroom(self.node.settings), 0, f"pulling {self.reference}")
        if self.local is not None:
            image = await asyncio.to_thread(self.local.resolve)
            ref = image.ref
        else:
            assert self.client is not None
            ref = ImageRef.parse(self.reference)
            image = await self.client.resolve(ref)
        _check_layers(image)
        client = self.client
        source = f" from {client.source}" if client is not None and client.source != ref.registry else ""
        self.log(f"{ref}{source}: {len(image.layers)} layers, manifest {image.digest[:19]}")
        self.ref, self.image = ref, image
        return image

    async def fetch_layers(self) -> Pulled:
        """Every layer of the image in the layer store, PARALLEL_LAYERS at a time, each unpacked
        as it downloads; a layer another pull is fetching is waited for, not fetched twice."""
        image = self.image or await self.resolve()
        assert self.ref is not None
        ids = [layer_id_of(diff_id) for diff_id in image.diff_ids]
        self.node.artifacts.pin(ids)  # not garbage while the template is being made
        try:
            compressed = sum([self._compressed(desc) for desc in image.layers])
        except BaseException:
            self.node.artifacts.unpin(ids)
            raise
        self.unpacked = Meter(f"image {self.ref}", Bounds.image(self.node.settings), compressed)
        slots = asyncio.Semaphore(PARALLEL_LAYERS)
        count = len(image.layers)

        async def one(i: int, desc: dict[str, Any], diff_id: str) -> tuple[int, bool]:
            async with slots:
                return await self._layer(i, count, desc, diff_id)

        try:
            pairs = zip(image.layers, image.diff_ids, strict=True)
            got = await _all([asyncio.ensure_future(one(i, desc, d)) for i, (desc, d) in enumerate(pairs, 1)])
        except BaseException:
            self.node.artifacts.unpin(ids)
            raise
        fetched = sum(size for size, _ in got)
        sizes = {x: _declared(desc, size) for x, desc, (size, _) in zip(ids, image.layers, got, strict=True)}
        cached = sum(1 for _, hit in got if hit)
        return Pulled(self.ref, image.digest, ids, image.config, fetched, cached, sizes)

    def _compressed(self, desc: dict[str, Any]) -> int:
        """A layer's blob's size: as its descriptor says from a registry (a blob of another size is
        refused as it arrives), as stored in a layout or an archive."""
        if self.local is not None:
            return self.local.size(desc["digest"])
        return int(desc["size"])

    def _meter(self, label: str, compressed: int) -> Meter:
        """The bounds of layer ``label``, whose growth the image's meter counts too."""
        assert self.unpacked is not None
        return Meter(f"layer {label}", self.bounds, compressed, self.unpacked.add)

    async def _layer(self, i: int, count: int, desc: dict[str, Any], diff_id: str) -> tuple[int, bool]:
        """(bytes fetched, whether it was here already) of layer ``i``."""
        layer_id = layer_id_of(diff_id)
        final = self.node.files.layers / layer_id
        flights = _layer_flights(self.node)
        joined = False
        while True:
            if final.exists():
                self.node.files.touch(layer_id)
                self.log(f"layer {i}/{count} {diff_id[:19]}: cached")
                assert self.unpacked is not None  # the image's bounds count it as it unpacked
                self.unpacked.add(*await asyncio.to_thread(self.node.files.extent, layer_id))
                return 0, True
            flight = flights.get(layer_id)
            if flight is None or joined:
                task = asyncio.ensure_future(self._fetch(i, count, desc, diff_id, final))
                if flight is None:
                    flights[layer_id] = task
                    task.add_done_callback(functools.partial(_landed, flights, layer_id))
                return await task, False  # cancelling this pull cancels its fetch
            joined = True  # once: should the other pull fail, this one fetches it from its own source
            self.log(f"layer {i}/{count} {diff_id[:19]}: being fetched by another pull")
            try:
                await asyncio.shield(flight)
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise
            except Exception:  # noqa: BLE001 - the other pull's failure, from its source
                pass

    async def _fetch(self, i: int, count: int, desc: dict[str, Any], diff_id: str, final: Path) -> int:
        """Download and unpack one layer under a temporary name; it appears as ``final`` only once
        whole and verified (the blob's digest and the tar's diff_id). Returns the blob's size."""
        room = headroom(self.node.settings)
        declared = desc.get("size")  # the manifest's word for it: refuses a pull that cannot fit
        need = declared if isinstance(declared, int) else 0
        ensure_space(self.tmp, room, need, f"layer {i} of {self.ref}")
        started = time.monotonic()
        progress = LayerProgress(self.on_progress, i, count, need)
        work = self.tmp / f"{final.name}.{new_id()}"
        try:
            if self.local is not None:
                blob = self.tmp / f"{new_id()}.blob"
                try:
                    await asyncio.to_thread(self.local.fetch, desc["digest"], blob)
                    size = blob.stat().st_size
                    progress.finish(size)
                    label = f"{i} of {self.ref}"
                    got = await asyncio.to_thread(apply_layer, blob, work, room, label, self._meter(label, size))
                finally:
                    blob.unlink(missing_ok=True)
            else:
                got = await self._stream(desc, work, progress, f"{i} of {self.ref}")
                size = desc["size"]
                progress.finish(size)
            if got != diff_id:
                raise LayerError(f"layer {i} of {self.ref} unpacks to {got}, not its diff_id {diff_id}")
            if not final.exists():
                work.rename(final)
        finally:
            if work.exists():
                # awaited whatever happens: another layer's failure cancels this fetch, and the
                # pull's answer must not come while half a layer is still being removed
                await _settle(asyncio.ensure_future(asyncio.to_thread(remove_tree, work, ignore_errors=True)))
        took = time.monotonic() - started
        self.log(f"layer {i}/{count} {diff_id[:19]}: {size / 2**20:.1f} MiB in {took:.1f}s")
        return size

    async def _stream(self, desc: dict[str, Any], work: Path, progress: LayerProgress, label: str) -> str:
        """Unpack the blob into ``work`` while it downloads: the download writes into a pipe that
        a process of its own (a thread for a small layer) unpacks from. Returns the tar's digest;
        whether the blob was whole and its own is known only at its end, so ``work`` is the
        caller's to keep or throw away once the unpacking has stopped."""
        assert self.client is not None and self.ref is not None
        loop = asyncio.get_running_loop()
        read_end, write_end = os.pipe()
        with contextlib.suppress(OSError):
            fcntl.fcntl(write_end, F_SETPIPE_SZ, PIPE_SIZE)
        os.set_blocking(write_end, False)
        room = headroom(self.node.settings)
        assert self.unpacked is not None
        try:
            if desc["size"] >= UNPACK_APART:
                unpack: asyncio.Future[str] = await _in_process(
                    read_end, work, room, label, self.bounds, desc["size"], self.unpacked.add
                )
            else:
                reader = os.fdopen(read_end, "rb", buffering=0)
                unpack = _in_thread(_unpack_pipe, reader, work, room, label, self._meter(label, desc["size"]))
                read_end = -1  # the thread's file has it
        except BaseException:
            os.close(write_end)
            raise
        finally:
            if read_end >= 0:
                os.close(read_end)  # the unpacking process has its own
        pending = bytearray()

        async def sink(chunk: bytes) -> None:
            pending.extend(chunk)
            if len(pending) >= WRITE_BATCH:
                await _write_all(loop, write_end, bytes(pending))
                pending.clear()

        try:
            await self.client.stream_blob(self.ref, desc, sink, on_bytes=functools.partial(_arrived, progress))
            await _write_all(loop, write_end, bytes(pending))
        except BrokenPipeError:
            pass  # the unpack stopped reading: its own error says why
        finally:
            os.close(write_end)  # the unpack reads to the end now, or has stopped
            await _settle(unpack)  # its thread is done with ``work`` before anyone removes it
        return unpack.result()


async def pull(
    node: BuildHost,
    reference: str,
    *,
    login: tuple[str, str] | None = None,
    on_log: LogFn | None = None,
    on_progress: PullProgressFn | None = None,
) -> Pulled:
    """Resolve ``reference`` and bring its layers into the layer store (:class:`ImagePull`)."""
    async with ImagePull(node, reference, login=login, on_log=on_log, on_progress=on_progress) as job:
        await job.resolve()
        return await job.fetch_layers()


def _arrived(progress: LayerProgress, count: int) -> None:
    progress.add(count)
    metrics.IMAGE_PULLED.inc(count)


def _declared(desc: dict[str, Any], fetched: int) -> int:
    """A layer's compressed size: its descriptor's (a `docker save` archive gives none: what was read)."""
    size = desc.get("size")
    return size if isinstance(size, int) and not isinstance(size, bool) and size >= 0 else fetched


# Layers being fetched, per node: a layer two pulls need (a shared base) is downloaded once.
_FLIGHTS: weakref.WeakKeyDictionary[Any, dict[str, asyncio.Task[int]]] = weakref.WeakKeyDictionary()


def _layer_flights(node: BuildHost) -> dict[str, asyncio.Task[int]]:
    return _FLIGHTS.setdefault(node, {})


async def _all(tasks: list[asyncio.Future[T]]) -> list[T]:
    """Every task's result; the first failure cancels the others (and is awaited with them)."""
    try:
        pending: set[asyncio.Future[T]] = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if not task.cancelled() and (exc := task.exception()) is not None:
                    raise exc
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _in_process(
    read_end: int, work: Path, room: int, label: str, bounds: Bounds, compressed: int, grew: GrowthFn
) -> asyncio.Future[str]:
    """Unpack the layer ``read_end`` carries in a process of its own (``python -m
    aenv.images.unpack``): it holds no lock the node's event loop needs, and layers unpack on as
    many cores as there are. It holds the layer to ``bounds`` for its ``compressed`` size itself
    and tells its growth, handed to ``grew`` (the image's meter: past the image's bounds the
    process is killed). The future: the tar's digest, or the process's error."""
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "aenv.images.unpack",
            str(work),
            str(room),
            label,
            bounds.to_json(),
            str(compressed),
            stdin=read_end,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        raise RuntimeFailure(f"cannot start the unpacking of layer {label}: {exc}") from exc
    return asyncio.ensure_future(_unpacked(proc, label, grew))


async def _unpacked(proc: asyncio.subprocess.Process, label: str, grew: GrowthFn) -> str:
    assert proc.stdout is not None and proc.stderr is not None
    errors = asyncio.ensure_future(proc.stderr.read())
    answer: Any = None
    partial, last = b"", b""
    try:
        # its growth as it goes, then its answer: its input ends when the download ends, whatever happened
        while chunk := await proc.stdout.read(1 << 16):
            if b"\n" not in chunk:
                partial += chunk
                continue
            *lines, partial = (partial + chunk).split(b"\n")
            for line in lines:
                grown = _growth(line)
                if grown is not None:
                    grew(*grown)  # past the image's bounds: raises, and the process is killed
                elif line.strip():
                    last = line  # its answer
        with contextlib.suppress(ValueError):
            answer = json.loads(partial if partial.strip() else last)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        raise
    finally:
        await proc.wait()
        err = await errors
    if isinstance(answer, dict) and proc.returncode == 0 and isinstance(answer.get("digest"), str):
        return str(answer["digest"])
    error = answer.get("error") if isinstance(answer, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        kind = UNPACK_ERRORS.get(str(error.get("type")), AenvError)
        status = error.get("status")
        raise kind(error["message"], status=status if isinstance(status, int) else None)
    said = err.decode(errors="replace").strip().splitlines()
    raise RuntimeFailure(f"unpacking layer {label} failed (exit {proc.returncode}): {said[-1] if said else ''}")


def _growth(line: bytes) -> tuple[int, int] | None:
    """(bytes, entries) of an unpacking process's report of its growth (`aenv.images.unpack.Report`)."""
    if not line.startswith(b'{"grew"'):
        return None
    try:
        grown = json.loads(line).get("grew")
    except ValueError:
        return None
    if isinstance(grown, list) and len(grown) == 2 and all(type(n) is int and n >= 0 for n in grown):
        return grown[0], grown[1]
    return None


def _unpack_pipe(reader: BinaryIO, work: Path, room: int, label: str, meter: Meter) -> str:
    try:
        return apply_layer_stream(reader, work, room, label, meter)
    finally:
        reader.close()  # a download still writing gets EPIPE rather than wait


def _in_thread(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """``fn(*args)`` on a thread of its own: an unpack blocks on its pipe, and a few of them
    must never hold the default pool's threads that the downloads feeding them may need."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, exc: BaseException | None) -> None:
        if future.done():
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result, exc = fn(*args), None
        except BaseException as caught:  # noqa: BLE001 - handed to the loop
            result, exc = None, caught
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, exc)

    threading.Thread(target=run, name="aenv-unpack", daemon=True).start()
    return future


async def _settle(future: asyncio.Future[Any]) -> None:
    """Wait for ``future`` whatever happens meanwhile (a cancellation is raised once it is done)."""
    interrupted = False
    while not future.done():
        try:
            await asyncio.wait([future])
        except asyncio.CancelledError:
            interrupted = True
    if not future.cancelled():
        future.exception()  # retrieved: the caller's own error may be the one that counts
    if interrupted:
        raise asyncio.CancelledError


def _wake(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)


def _landed(flights: dict[str, asyncio.Task[int]], layer_id: str, task: asyncio.Task[int]) -> None:
    if flights.get(layer_id) is task:
        del flights[layer_id]


async def _write_all(loop: asyncio.AbstractEventLoop, fd: int, data: bytes) -> None:
    """Write ``data`` to a non-blocking pipe, waiting while it is full (the unpack is behind)."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            ready: asyncio.Future[None] = loop.create_future()
            loop.add_writer(fd, _wake, ready)
            try:
                await ready
            finally:
                loop.remove_writer(fd)


def release(node: BuildHost, pulled: Pulled) -> None:
    """The template (or the failure) is recorded: the layers are ordinary layers again."""
    node.artifacts.unpin(pulled.layers)
