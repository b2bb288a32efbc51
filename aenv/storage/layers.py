"""Node-local filesystem artifacts: layers (read-only, or one sandbox's writable upper) and images.

Every sandbox writes into its own *upper*: a sparse ext4 image of the sandbox's disk quota,
``fs/layers/<id>.img``, loop-mounted at ``fs/layers/<id>/`` and holding ``upper/`` and ``work/``
for overlayfs. Writing past the quota fails with ENOSPC inside the sandbox and touches nothing else.

An upper becomes a layer by being *sealed*, which moves nothing: its id simply joins a layer list
(its ``upper/`` directory is then a lower of new overlays) and, once the instance that wrote it is
gone, it is remounted read-only. An upper whose sandbox goes on running (a snapshot or fork that
leaves its source running) is *copied* instead: its image, frozen for the copy, becomes a new
layer's. Forks and snapshots share every sealed layer. A layer is either
such an image or a plain directory (a root filesystem made by debootstrap). Ids are short so that
overlayfs option strings stay short.

Under a VM driver (aenv/runtime/qemu.py) a sandbox's disk is written by its guest's kernel: the
driver turns the upper's image into a qcow2 file (an overlay of the layer below it, or standalone)
that only QEMU opens. Such a *guest-written* image (known by its qcow2 magic) is opaque here: never
mounted on the host (the host's kernel never parses a file system a guest wrote), never empty,
copied as a file while its VM is stopped.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import hashlib
import logging
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from aenv.errors import RuntimeFailure
from aenv.runtime import hostexec
from aenv.storage import datadir
from aenv.storage.confined import remove_tree, tree_extent, tree_usage
from aenv.storage.mounts import mounts_under, unmount_under
from aenv.storage.space import data_runs

log = logging.getLogger(__name__)

SPARE_REFILL_QUIET_SECONDS = 1.0
SPARE_SIZE_KEEP_SECONDS = 3600.0
MAX_SPARE_SIZES = 4
OTHER_SIZE_SPARES = 2
UNTRUSTED_BITS = os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC  # hostexec.UNTRUSTED_FLAGS, as statvfs says them
FIFREEZE, FITHAW = 0xC0045877, 0xC0045878  # linux/fs.h: _IOWR('X', 119 / 120, int)
ENTRY_COST = 4096  # what the cache counts for an entry of a layer, at the least (one block)
MKFS = ["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-E", "lazy_itable_init=1,nodiscard", "-m", "0"]
MKFS_SECONDS = 120.0
REMOVING = ".remove-"  # a layer on its way out: <prefix><id>-<token> (and .img)
EVICTING = ".evict-"  # a layer or image the cache evicts: <prefix><id>-<token> (and .img)
MAX_BLANKS = 8  # blank disk images kept, one per upper size (a few MiB each), the least used go
MKFS_KEY = hashlib.sha256(" ".join(MKFS).encode()).hexdigest()[:8]  # other options: other blanks
EXT4_MAGIC_AT, EXT4_MAGIC = 1024 + 0x38, b"\x53\xef"  # the superblock's s_magic, little-endian
QCOW2_MAGIC = b"QFI\xfb"


def new_id(n: int = 12) -> str:
    return secrets.token_hex(n // 2)


class LayerStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.layers = root / "layers"
        self.images = root / "images"
        self.used = self.layers / ".used"  # last-use markers of cached layers
        self.tmp = root / "tmp"  # work in progress (pulls, build contexts): what is left at start is garbage
        for d in (self.layers, self.images, self.used, self.tmp):
            d.mkdir(parents=True, exist_ok=True)
        self._sealed_sizes: dict[str, int] = {}
        self._extents: dict[str, tuple[int, int]] = {}
        self._mounting: dict[str, asyncio.Lock] = {}  # one mount of a layer at a time
        self.blanks = self.layers / ".blanks"  # formatted, empty disk images to copy, one per size
        self.blanks.mkdir(exist_ok=True)
        for left in self.blanks.glob(".tmp-*"):  # a format the last run did not finish
            left.unlink(missing_ok=True)
        self._blanking: dict[int, asyncio.Future[Path]] = {}  # size in MiB -> its blank being made
        self._spares: dict[int, list[str]] = {}  # size in MiB -> blank, mounted uppers
        self._making: set[str] = set()
        self._wanted: dict[int, float] = {}  # size in MiB -> last time one was taken
        self._spare_target = 0
        self._default_size: int | None = None
        self._last_take = 0.0
        self._refill: asyncio.Task[None] | None = None
        self._idle: Callable[[], bool] = lambda: True
        # Uppers as plain directories, no disk image (the fake runtime, which runs without root:
        # no mkfs, no loop mount, and so no disk quota). Such an upper is its own root directory
        # (``upper/`` and ``work/`` are the runtime's business) and, sealed, a directory layer.
        self.plain_uppers = False
        self.live: set[str] = set()  # uppers handed out and not yet released or removed (new_upper)

    # -- paths --------------------------------------------------------------------------------------
    def _img(self, layer_id: str) -> Path:
        return self.layers / f"{layer_id}.img"

    def layer(self, layer_id: str) -> Path:
        """The directory overlayfs uses as this layer."""
        if self._img(layer_id).exists():
            return self.layers / layer_id / "upper"
        return self.layers / layer_id

    def disk(self, layer_id: str) -> Path | None:
        """The ext4 image a layer or upper lives in (the layer is its ``upper/``), None for a
        directory layer: what a VM driver attaches as a block device."""
        img = self._img(layer_id)
        return img if img.exists() else None

    def upper(self, upper_id: str) -> Path:
        """The directory holding ``upper/`` and ``work/`` (the mounted disk image)."""
        return self.layers / upper_id

    def image(self, image_id: str) -> Path:
        return self.images / image_id

    def new_layer_dir(self) -> tuple[str, Path]:
        layer_id = new_id()
        path = self.layers / layer_id
        path.mkdir(parents=True)
        return layer_id, path

    # -- uppers -------------------------------------------------------------------------------------
    async def new_upper(self, size_mb: int) -> str:
        """A fresh, empty, mounted upper of ``size_mb``: a spare if one is ready. It is live (never
        garbage, however old) until removed or :meth:`release`d by its owner once a record or a
        pin holds it: a build step running for minutes writes into an upper nothing names yet."""
        upper_id = await self._take_upper(size_mb)
        self.live.add(upper_id)
        return upper_id

    def release(self, layer_ids: Iterable[str]) -> None:
        """Uppers (sealed into layers) that a record or a pin holds now: no longer live."""
        self.live.difference_update(layer_ids)

    async def _take_upper(self, size_mb: int) -> str:
        self._last_take = time.monotonic()
        self._wanted[size_mb] = self._last_take
        spares = self._spares.get(size_mb)
        if spares:
            upper_id = spares.pop()
            os.utime(self.layers / upper_id)  # as new as a made one: collections spare young uppers
            if not self.plain_uppers and not os.path.ismount(self.layers / upper_id):
                # Unmounted meanwhile (by hand, or a lazy unmount above it): a sandbox on it would
                # write beneath the mount point, outside its disk, and the upper would seal empty.
                log.warning("spare upper %s was not mounted: made anew", upper_id)
                await self.remove(upper_id)
                upper_id = await self._make_upper(size_mb, new_id())
        else:
            upper_id = await self._make_upper(size_mb, new_id())
        self._refill_soon()
        return upper_id

    async def _make_upper(self, size_mb: int, upper_id: str) -> str:
        mnt = self.layers / upper_id
        mnt.mkdir(parents=True)
        if self.plain_uppers:
            datadir.sandbox_dir(mnt)
            return upper_id
        disk = self._img(upper_id)
        try:
            blank = await self._blank(size_mb)
            # Awaited to its end even when the create is cancelled: the thread would otherwise
            # make the image after the removal below, an image of no upper that nothing removes.
            copy = asyncio.ensure_future(asyncio.to_thread(copy_sparse, blank, disk))
            try:
                await asyncio.shield(copy)
            except asyncio.CancelledError:
                await asyncio.wait([copy])
                raise
            try:
                await self.mount(upper_id, writable=True)
            except RuntimeFailure:
                if not _is_ext4(blank):  # damaged: the next upper of this size formats a new one
                    blank.unlink(missing_ok=True)
                raise
            datadir.sandbox_dir(mnt / "upper")  # the sandbox's "/" takes this directory's mode
            (mnt / "work").mkdir(exist_ok=True)
        except BaseException:
            await self.remove(upper_id)
            raise
        return upper_id

    # An upper is a copy of a blank image of its size, formatted once: mkfs ends with an fsync,
    # which on a host writing hard (image pulls unpacking) waited over a minute behind everything
    # else dirty; a copy of the blank's few MiB of metadata goes to the page cache. The copies
    # share the blank's filesystem UUID and hash seed, as a fork's copied upper shares its
    # source's: a sandbox sees neither (it sees files, not the disk). A blank is named by its
    # size and the mkfs options that made it.
    async def _blank(self, size_mb: int) -> Path:
        path = self.blanks / f"ext4-{size_mb}-{MKFS_KEY}.img"
        if path.exists():
            os.utime(path)  # recently used: kept
            return path
        # One mkfs per size, whoever asks meanwhile shares its outcome: a failure is each
        # waiter's at once, not a mkfs after another.
        making = self._blanking.get(size_mb)
        if making is None:
            making = self._blanking[size_mb] = asyncio.ensure_future(self._format_blank(size_mb, path))
            making.add_done_callback(lambda done: self._made_blank(size_mb, done))
        return await asyncio.shield(making)

    def _made_blank(self, size_mb: int, done: asyncio.Future[Path]) -> None:
        self._blanking.pop(size_mb, None)
        if not done.cancelled():
            done.exception()  # seen by its waiters, if any are left: not logged as never retrieved

    async def _format_blank(self, size_mb: int, path: Path) -> Path:
        tmp = self.blanks / f".tmp-{new_id()}.img"  # swept at start
        try:
            with open(tmp, "wb") as f:
                f.truncate(size_mb * 2**20)
            await hostexec.run([*MKFS, str(tmp)], timeout=MKFS_SECONDS)
            os.rename(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        self._trim_blanks()
        return path

    def _trim_blanks(self) -> None:
        blanks = sorted(self.blanks.glob("ext4-*.img"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in blanks[MAX_BLANKS:]:
            old.unlink(missing_ok=True)

    # A fork of N needs N+1 fresh uppers at once, and formatting and mounting them (~40 ms each on
    # two busy cores) sat on the fork's critical path, as one did on every create's. So a few blank
    # ones are kept ready, refilled once the node is idle: never in competition with the restores
    # that just took them.
    def keep_spares(self, count: int, default_size_mb: int, idle: Callable[[], bool] = lambda: True) -> None:
        """``count`` spares of the default size, a couple of other sizes taken lately (a template
        build's 16 GiB disks must not sit there seventeen at a time)."""
        self._spare_target = count
        self._default_size = default_size_mb
        self._idle = idle
        self._wanted.setdefault(default_size_mb, time.monotonic())
        self._refill_soon()

    def spare_ids(self) -> set[str]:
        """Spares and the ones being made: no record names them, and nothing may remove them."""
        return {x for ids in self._spares.values() for x in ids} | self._making

    def _target(self, size_mb: int) -> int:
        return self._spare_target if size_mb == self._default_size else min(self._spare_target, OTHER_SIZE_SPARES)

    async def spares_ready(self, timeout: float = 30.0) -> bool:
        """Wait until every wanted size has its spares (or ``timeout``); whether they are there."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(len(self._spares.get(x, [])) >= self._target(x) for x in self._sizes_wanted()):
                return True
            self._refill_soon()
            await asyncio.sleep(0.05)
        return False

    def _refill_soon(self) -> None:
        if self._spare_target and (self._refill is None or self._refill.done()):
            self._refill = asyncio.create_task(self._refill_spares())

    def _sizes_wanted(self) -> list[int]:
        """The default size, and others taken within the last hour (at most four sizes)."""
        now = time.monotonic()
        recent = sorted((t, size) for size, t in self._wanted.items() if now - t < SPARE_SIZE_KEEP_SECONDS)
        sizes = [size for _, size in recent[-MAX_SPARE_SIZES:]]
        if self._default_size is not None and self._default_size not in sizes:
            sizes.append(self._default_size)
        return sizes

    async def _refill_spares(self) -> None:
        try:
            while self._spare_target:
                quiet = time.monotonic() - self._last_take
                if quiet < SPARE_REFILL_QUIET_SECONDS:
                    await asyncio.sleep(SPARE_REFILL_QUIET_SECONDS - quiet)
                    continue
                if not self._idle():
                    await asyncio.sleep(SPARE_REFILL_QUIET_SECONDS / 4)
                    continue
                sizes = self._sizes_wanted()
                for size in [x for x in self._spares if x not in sizes]:
                    await self._remove_spares(size)
                short = [x for x in sizes if len(self._spares.get(x, [])) < self._target(x)]
                if not short:
                    return
                upper_id = new_id()
                self._making.add(upper_id)
                try:
                    await self._make_upper(short[0], upper_id)
                    self._spares.setdefault(short[0], []).append(upper_id)
                finally:
                    self._making.discard(upper_id)
        except Exception:  # e.g. a full disk: creates make their own uppers then, and say why
            log.exception("could not make a spare upper")

    async def _remove_spares(self, size_mb: int) -> None:
        # One at a time out of the list, so that no create takes one that is being removed, and
        # into _making meanwhile, so that no collection sees an upper nobody owns.
        spares = self._spares.get(size_mb, [])
        while spares:
            upper_id = spares.pop()
            self._making.add(upper_id)
            try:
                await self.remove(upper_id)
            finally:
                self._making.discard(upper_id)
        self._spares.pop(size_mb, None)

    async def drop_spares(self) -> None:
        """Stop keeping spares and remove them (a stopping node). A spare being made is finished
        first: cancelling it would leave its mkfs or mount running under a removal."""
        self._spare_target = 0
        if self._refill is not None:
            await asyncio.gather(self._refill, return_exceptions=True)
        for size in list(self._spares):
            await self._remove_spares(size)

    def guest_written(self, layer_id: str) -> bool:
        """Whether a layer's or upper's image is a VM's qcow2 (opaque to the host: see the top)."""
        return is_qcow2(self._img(layer_id))

    def is_empty(self, upper_id: str) -> bool:
        if self.guest_written(upper_id):
            return False  # what a guest wrote is not looked into
        upper = self.upper(upper_id) / ("upper" if self._img(upper_id).exists() else "")
        return not upper.is_dir() or not any(os.scandir(upper))

    # -- mounts -------------------------------------------------------------------------------------
    async def mount(self, layer_id: str, *, writable: bool) -> None:
        """Mount an image layer (no-op for directory layers or when mounted already)."""
        img, mnt = self._img(layer_id), self.layers / layer_id
        if not img.exists() or os.path.ismount(mnt) or is_qcow2(img):
            return
        # Two creates needing the same fetched layer both find it unmounted; the second mount of
        # one image would fail ("already mounted"), so they take turns and the second finds it done.
        async with self._mounting.setdefault(layer_id, asyncio.Lock()):
            if os.path.ismount(mnt):
                return
            mnt.mkdir(exist_ok=True)
            opts = ",".join(("loop", "noatime", *hostexec.UNTRUSTED_FLAGS, *(() if writable else ("ro",))))
            await hostexec.run(["mount", "-o", opts, str(img), str(mnt)], timeout=60)

    async def mount_lowers(self, layer_ids: list[str]) -> None:
        """Every layer a root file system is about to stack, mounted (read-only) if it is not: a
        snapshot's copy of an upper is mounted at its first use, not while the snapshot waits."""
        for layer_id in layer_ids:
            await self.mount(layer_id, writable=False)

    async def secure_mounts(self) -> None:
        """Give the untrusted flags to layer mounts that lack them: a restart keeps what is
        mounted, and a version before them (or a crash of one) left setuid files and device nodes
        that sandbox root made live on the host."""
        for layer_id in self.layer_ids():
            mnt = self.layers / layer_id
            if not os.path.ismount(mnt):
                continue
            flags = os.statvfs(mnt).f_flag
            if flags & UNTRUSTED_BITS != UNTRUSTED_BITS:
                kept = ("ro",) if flags & os.ST_RDONLY else ()
                opts = ",".join(("remount", *kept, *hostexec.UNTRUSTED_FLAGS))
                await hostexec.run(["mount", "-o", opts, str(mnt)], timeout=60)

    def copy_upper(self, upper_id: str) -> str:
        """A new layer whose image is a copy of a mounted upper's as it is now (not mounted yet:
        :meth:`mount` it read-only). The upper's file system is frozen for the copy (FIFREEZE:
        written out whole and consistent, writes wait), so call it while nothing in the sandbox
        runs; only its data extents are copied, as the sparse file it is."""
        copy_id = new_id()
        if not self._img(upper_id).exists():  # a plain upper: its tree, as it is (the instance is stopped)
            try:
                copy_tree(self.layers / upper_id, self.layers / copy_id)
            except BaseException:
                remove_tree(self.layers / copy_id, ignore_errors=True)
                raise
            return copy_id
        (self.layers / copy_id).mkdir()
        # A guest-written image is not mounted here (its VM is stopped, its disk flushed): the file
        # as it is, never a freeze (on its unmounted directory that would freeze the host's file system).
        mnt = None if self.guest_written(upper_id) else os.open(self.layers / upper_id, os.O_RDONLY | os.O_DIRECTORY)
        try:
            if mnt is not None:
                fcntl.ioctl(mnt, FIFREEZE, 0)
            try:
                copy_sparse(self._img(upper_id), self._img(copy_id))
            finally:
                if mnt is not None:
                    fcntl.ioctl(mnt, FITHAW, 0)
        except BaseException:
            self._img(copy_id).unlink(missing_ok=True)
            (self.layers / copy_id).rmdir()
            raise
        finally:
            if mnt is not None:
                os.close(mnt)
        return copy_id

    async def make_read_only(self, layer_id: str) -> None:
        """Seal for good: called once the instance that wrote the layer is gone."""
        mnt = self.layers / layer_id
        if self._img(layer_id).exists() and os.path.ismount(mnt):
            # A remount sets the mount's flags anew: the untrusted ones are repeated, not dropped.
            opts = ",".join(("remount", "ro", *hostexec.UNTRUSTED_FLAGS))
            await hostexec.run(["mount", "-o", opts, str(mnt)], timeout=60, check=False)

    async def remount(self, layer_id: str, *, writable: bool) -> None:
        """Remount a paused sandbox's upper read-only while it is committed (flushed, and nothing
        writes it meanwhile), and writable again for its resume."""
        mnt = self.layers / layer_id
        if self._img(layer_id).exists() and os.path.ismount(mnt):
            opts = ",".join(("remount", "rw" if writable else "ro", *hostexec.UNTRUSTED_FLAGS))
            await hostexec.run(["mount", "-o", opts, str(mnt)], timeout=60)

    async def remove(self, layer_id: str) -> None:
        """Remove a layer or an upper. It leaves its name in one step, before the slow part: a
        reader meanwhile, or a node killed meanwhile, finds it whole (its image still there, to
        be mounted again) or gone, never an empty directory under its name (a build then took an
        empty mountpoint for a directory layer)."""
        if not layer_id:
            return
        mnt = self.layers / layer_id
        if os.path.ismount(mnt):
            try:
                await hostexec.run(["umount", str(mnt)], timeout=60)
            except Exception:
                await hostexec.run(["umount", "-l", str(mnt)], timeout=60, check=False)
        if mnt.is_dir() and mounts_under(mnt):  # what a killed node's debootstrap mounted in its target
            await unmount_under(mnt)
        trash = self.layers / f"{REMOVING}{layer_id}-{new_id(6)}"
        try:
            if mnt.is_dir():
                os.rename(mnt, trash)  # first: without its directory the image is still whole
            if self._img(layer_id).exists():
                os.rename(self._img(layer_id), f"{trash}.img")
        except OSError as exc:  # mounted again meanwhile (EBUSY): in use, so not removed now
            log.warning("layer %s not removed: %s", layer_id, exc)
            return
        self._sealed_sizes.pop(layer_id, None)
        self._extents.pop(layer_id, None)
        self._mounting.pop(layer_id, None)
        self.live.discard(layer_id)
        (self.used / layer_id).unlink(missing_ok=True)
        Path(f"{trash}.img").unlink(missing_ok=True)
        await asyncio.to_thread(remove_tree, trash, ignore_errors=True)  # big trees take seconds: off the loop

    def evicting(self, layer_id: str) -> str:
        """Take a layer out of use atomically (one rename, before any await): from here on it is
        not local, so a restore fetches it again instead of booting on a half-deleted tree.
        Returns a token for :meth:`finish_eviction`."""
        token = f"{EVICTING}{layer_id}-{new_id(6)}"
        img = self._img(layer_id)
        if img.exists():
            os.rename(img, self.layers / f"{token}.img")  # still mounted through its loop device
        elif (self.layers / layer_id).is_dir():
            os.rename(self.layers / layer_id, self.layers / token)
        self._sealed_sizes.pop(layer_id, None)
        self._extents.pop(layer_id, None)
        self._mounting.pop(layer_id, None)
        (self.used / layer_id).unlink(missing_ok=True)
        return token

    async def finish_eviction(self, layer_id: str, token: str) -> None:
        mnt = self.layers / layer_id
        if os.path.ismount(mnt):
            await hostexec.run(["umount", "-l", str(mnt)], timeout=60, check=False)
            remove_tree(mnt, ignore_errors=True)
        # The token's image goes last: a node killed before the mountpoint went finds it by the
        # token at its next start (sweep_removals), not as an empty directory layer.
        (self.layers / f"{token}.img").unlink(missing_ok=True)
        await asyncio.to_thread(remove_tree, self.layers / token, ignore_errors=True)

    def sweep_removals(self) -> None:
        """At start: finish removals and evictions a stopped node left half done. An evicted
        image's empty mountpoint goes with its token (it would pass for an empty directory layer)."""
        for p in [*self.layers.glob(f"{REMOVING}*"), *self.layers.glob(f"{EVICTING}*")]:
            layer_id = p.name.removesuffix(".img").removeprefix(REMOVING).removeprefix(EVICTING).rsplit("-", 1)[0]
            mnt = self.layers / layer_id
            leftover = mnt.is_dir() and not os.path.ismount(mnt) and not self._img(layer_id).exists()
            if p.name.startswith(EVICTING) and leftover and not any(os.scandir(mnt)):
                mnt.rmdir()
            if p.is_dir() and not p.is_symlink():
                remove_tree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)

    def is_local(self, layer_id: str) -> bool:
        """Usable right now: an image layer mounted, or a directory layer (not a stale mountpoint)."""
        mnt = self.layers / layer_id
        if self._img(layer_id).exists():
            return os.path.ismount(mnt) or self.guest_written(layer_id)
        return mnt.is_dir() and not os.path.ismount(mnt)

    async def unmount_all(self) -> None:
        """Release every loop mount (a stopping node); the next start mounts what it needs."""
        for layer_id in self.layer_ids():
            mnt = self.layers / layer_id
            if os.path.ismount(mnt):
                await hostexec.run(["umount", "-l", str(mnt)], timeout=60, check=False)

    def disk_usage(self, layer_id: str) -> int:
        """Bytes a layer holds on disk (allocated blocks of its image file, or of its tree, where
        each entry counts as at least one block: an empty file holds no block but an inode, and a
        layer of millions of them must not be free to the cache)."""
        img = self._img(layer_id)
        if img.exists():
            return img.stat().st_blocks * 512
        try:
            return tree_usage(self.layers / layer_id, least=ENTRY_COST)
        except OSError:
            return 0  # gone meanwhile

    def sealed_size(self, layer_id: str) -> int:
        """:meth:`disk_usage` of a layer that no longer changes, measured once (the layer cache
        asks for every cached layer on each garbage-collection pass)."""
        if layer_id not in self._sealed_sizes:
            self._sealed_sizes[layer_id] = self.disk_usage(layer_id)
        return self._sealed_sizes[layer_id]

    def extent(self, layer_id: str) -> tuple[int, int]:
        """(bytes, entries) of a pulled layer as its tar unpacked (`tree_extent`), measured once:
        what an image's bounds count for a layer it finds here (aenv/images/unpack.py)."""
        if layer_id not in self._extents:
            try:
                self._extents[layer_id] = tree_extent(self.layers / layer_id)
            except OSError:
                return 0, 0  # gone meanwhile
        return self._extents[layer_id]

    # Last use, for the cache's LRU order: a marker beside the layer or image, not its own mtime
    # (a sealed layer never changes, not even there); without a marker, its creation time.
    def _mark(self, name: str) -> None:
        try:
            (self.used / name).touch()
        except OSError:
            pass

    def _last_use(self, name: str, path: Path) -> float:
        for candidate in (self.used / name, path):
            try:
                return candidate.stat().st_mtime
            except OSError:
                continue
        return 0.0

    def last_used(self, layer_id: str) -> float:
        return self._last_use(layer_id, self.layers / layer_id)

    def touch(self, layer_id: str) -> None:
        """Mark a layer as just used (the cache evicts the least recently used first)."""
        self._mark(layer_id)

    def touch_image(self, image_id: str) -> None:
        self._mark(f"image-{image_id}")

    def image_size(self, image_id: str) -> int:
        """Bytes a checkpoint image holds (images never change once written)."""
        key = f"image:{image_id}"
        if key not in self._sealed_sizes:
            total = 0
            for p in (self.images / image_id).glob("*"):
                try:
                    total += p.stat().st_blocks * 512
                except OSError:
                    continue
            self._sealed_sizes[key] = total
        return self._sealed_sizes[key]

    def image_last_used(self, image_id: str) -> float:
        return self._last_use(f"image-{image_id}", self.images / image_id)

    def evict_image(self, image_id: str) -> str:
        """Like :meth:`evicting` for an image: renamed away at once, deleted by :meth:`finish_image_eviction`."""
        token = f".evict-{image_id}-{new_id(6)}"
        if (self.images / image_id).is_dir():
            os.rename(self.images / image_id, self.images / token)
        self._sealed_sizes.pop(f"image:{image_id}", None)
        (self.used / f"image-{image_id}").unlink(missing_ok=True)
        return token

    async def finish_image_eviction(self, token: str) -> None:
        await asyncio.to_thread(shutil.rmtree, self.images / token, True)

    def layer_ids(self) -> set[str]:
        """Layers and uppers in use or cached; not the spare uppers, which are nobody's yet."""
        present = {p.name.removesuffix(".img") for p in self.layers.iterdir() if not p.name.startswith(".")}
        return present - self.spare_ids()

    # -- images -------------------------------------------------------------------------------------
    def remove_image(self, image_id: str) -> None:
        if image_id:
            shutil.rmtree(self.images / image_id, ignore_errors=True)
            self._sealed_sizes.pop(f"image:{image_id}", None)

    def image_ids(self) -> set[str]:
        return {p.name for p in self.images.iterdir() if not p.name.startswith(".")}


def _is_ext4(image: Path) -> bool:
    try:
        with open(image, "rb") as f:
            f.seek(EXT4_MAGIC_AT)
            return f.read(2) == EXT4_MAGIC
    except OSError:
        return False


def is_qcow2(image: Path) -> bool:
    try:
        with open(image, "rb") as f:
            return f.read(4) == QCOW2_MAGIC
    except OSError:
        return False


def copy_sparse(source: Path, target: Path) -> None:
    """Copy a file's data extents into a new file of the same size: its holes stay holes."""
    src = os.open(source, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        copy_sparse_from(src, target)
    finally:
        os.close(src)


def copy_sparse_from(src: int, target: Path) -> None:
    """:func:`copy_sparse` of the file open as ``src`` (which may have no name any more)."""
    dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        size = os.fstat(src).st_size
        os.ftruncate(dst, size)
        for start, end in data_runs(src, size):
            done = start
            while done < end:
                n = os.copy_file_range(src, dst, end - done, done, done)
                if n == 0:
                    raise OSError(errno.EIO, f"{target.name}: its source shrank while being copied")
                done += n
    except BaseException:
        os.close(dst)
        target.unlink(missing_ok=True)
        raise
    os.close(dst)


def copy_tree(source: Path, target: Path) -> None:
    """A copy of a directory layer with owners, modes, links, extended attributes and overlayfs
    whiteouts (0/0 character devices, which any user may make) as they are: cp -a does it all."""
    done = subprocess.run(["cp", "-a", "--", str(source), str(target)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise OSError(errno.EIO, f"copying {source.name}: {done.stderr.strip()[-500:]}")
