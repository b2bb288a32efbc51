"""Spare uppers: blank, mounted disks kept ready so that creates and forks need not format theirs."""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from aenv.errors import RuntimeFailure
from aenv.runtime import hostexec
from aenv.storage import layers as layers_module
from aenv.storage.layers import LayerStore

pytestmark = pytest.mark.sandbox  # loop-mounts ext4 images (root)


@pytest.fixture()
async def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[LayerStore]:
    monkeypatch.setattr(layers_module, "SPARE_REFILL_QUIET_SECONDS", 0.1)
    files = LayerStore(tmp_path / "fs")
    yield files
    await files.drop_spares()
    for upper_id in files.layer_ids():
        await files.remove(upper_id)


async def spares_of(files: LayerStore, size_mb: int, count: int) -> set[str]:
    for _ in range(200):
        if len(files._spares.get(size_mb, [])) == count and not files._making:
            return set(files._spares[size_mb])
        await asyncio.sleep(0.05)
    raise AssertionError(f"spares of {size_mb} MiB: {files._spares}, wanted {count}")


def blank_and_mounted(files: LayerStore, upper_id: str) -> bool:
    mnt = files.upper(upper_id)
    return os.path.ismount(mnt) and sorted(os.listdir(mnt / "upper")) == [] and (mnt / "work").is_dir()


async def test_creates_take_spares_and_the_pool_refills_when_idle(store: LayerStore) -> None:
    busy = True
    store.keep_spares(2, 64, idle=lambda: not busy)
    await asyncio.sleep(0.5)
    assert store.spare_ids() == set()  # nothing is made while the node is busy
    busy = False
    first = await spares_of(store, 64, 2)
    assert store.layer_ids() == set()  # spares are nobody's: collections and caches don't see them

    taken = await store.new_upper(64)
    assert taken in first and blank_and_mounted(store, taken)
    assert taken in store.layer_ids() and taken not in store.spare_ids()
    (store.upper(taken) / "upper" / "mine").write_text("x")
    refilled = await spares_of(store, 64, 2)
    assert taken not in refilled and all(blank_and_mounted(store, x) for x in refilled)

    # Another size: made on the spot the first time, then kept ready as well.
    other = await store.new_upper(32)
    assert other not in refilled and blank_and_mounted(store, other)
    small = await spares_of(store, 32, 2)
    statvfs = os.statvfs(store.upper(small.pop()))
    assert 20 * 2**20 < statvfs.f_blocks * statvfs.f_frsize <= 32 * 2**20

    spare_paths = [store.upper(x) for x in store.spare_ids()]
    await store.drop_spares()
    assert store.spare_ids() == set() and not any(p.exists() for p in spare_paths)
    assert store.layer_ids() == {taken, other}  # the taken ones are their owners' to remove
    assert (store.upper(taken) / "upper" / "mine").read_text() == "x"


async def test_a_spare_found_unmounted_is_never_handed_out(store: LayerStore) -> None:
    """A spare unmounted meanwhile (by hand, a lazy unmount above it) is made anew: a sandbox on
    it wrote beneath its mount point, outside its disk, and its layer then sealed empty (seen in
    a build: a step's files missing from the template)."""
    store.keep_spares(2, 64)
    for upper_id in await spares_of(store, 64, 2):
        await hostexec.run(["umount", str(store.upper(upper_id))], timeout=60)
    for _ in range(2):
        taken = await store.new_upper(64)
        assert blank_and_mounted(store, taken), taken
        assert taken in store.live and taken in store.layer_ids()


async def test_stopping_while_spares_are_made_leaves_nothing_behind(store: LayerStore) -> None:
    store.keep_spares(4, 64)
    for _ in range(200):  # stop right in the middle of making one
        if store._making:
            break
        await asyncio.sleep(0.01)
    assert store._making
    await store.drop_spares()
    assert store.spare_ids() == set() and store.layer_ids() == set()
    leftovers = [p for p in store.layers.iterdir() if not p.name.startswith(".")]
    assert leftovers == [] and not any(os.path.ismount(p) for p in leftovers)
    with open("/proc/mounts") as f:
        assert str(store.layers) not in f.read()


async def test_concurrent_mounts_of_one_layer_image_mount_it_once(store: LayerStore) -> None:
    """Creates that need the same just-fetched layer each find it unmounted and mount it; the
    second mount of one image failed ("already mounted", seen in a fork spread over two nodes)."""
    upper_id = await store.new_upper(16)
    (store.upper(upper_id) / "upper" / "f").write_text("data")
    await store.unmount_all()
    assert not os.path.ismount(store.upper(upper_id))
    await asyncio.gather(*(store.mount(upper_id, writable=False) for _ in range(6)))
    mnt = store.upper(upper_id)
    assert os.path.ismount(mnt) and (mnt / "upper" / "f").read_text() == "data"
    stacked = [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if f" {mnt} " in line]
    assert len(stacked) == 1, stacked


async def test_uppers_are_copies_of_one_blank_per_size_each_its_own_disk(
    store: LayerStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upper is a copy of the blank of its size, formatted once (mkfs ends with an fsync, which
    a host writing hard made wait over a minute); each copy is its own empty disk of its quota."""
    formats: list[list[str]] = []
    run = layers_module.hostexec.run

    async def counting(argv: list[str], **kw: Any) -> str:
        if argv[0] == "mkfs.ext4":
            formats.append(argv)
        return await run(argv, **kw)

    monkeypatch.setattr(layers_module.hostexec, "run", counting)
    uppers = await asyncio.gather(*(store.new_upper(16) for _ in range(3)))
    assert len(formats) == 1 and len(set(uppers)) == 3
    assert all(blank_and_mounted(store, u) for u in uppers)
    (store.upper(uppers[0]) / "upper" / "mine").write_text("one")
    assert all(blank_and_mounted(store, u) for u in uppers[1:])  # not one disk seen three times
    # The quota is the copy's own: filling one leaves the others their room.
    with pytest.raises(OSError) as full:
        with open(store.upper(uppers[1]) / "upper" / "big", "wb") as f:
            for _ in range(32):
                f.write(os.urandom(1 << 20))
                f.flush()
                os.fsync(f.fileno())
    assert full.value.errno == errno.ENOSPC
    (store.upper(uppers[2]) / "upper" / "room").write_bytes(os.urandom(8 << 20))
    assert os.statvfs(store.upper(uppers[2])).f_blocks * os.statvfs(store.upper(uppers[2])).f_frsize <= 16 << 20
    # The blank holds only metadata; another size formats its own.
    [blank] = store.blanks.glob("ext4-16-*.img")
    assert blank.stat().st_size == 16 << 20 and blank.stat().st_blocks * 512 < 4 << 20
    await store.new_upper(24)
    assert len(formats) == 2 and len(list(store.blanks.glob("ext4-24-*.img"))) == 1
    assert not {p.name for p in store.blanks.iterdir()} & store.layer_ids()  # blanks are no layers


async def test_a_damaged_blank_is_formatted_again(store: LayerStore) -> None:
    first = await store.new_upper(16)
    [blank] = store.blanks.glob("ext4-16-*.img")
    with open(blank, "r+b") as f:  # the superblock (at 1 KiB) zeroed: no filesystem
        f.seek(1024)
        f.write(bytes(1024))
    with pytest.raises(RuntimeFailure, match="mount"):
        await store.new_upper(16)
    assert not blank.exists()  # dropped, and nothing of the failed upper is left
    again = await store.new_upper(16)
    assert blank_and_mounted(store, again) and blank.exists()
    assert store.layer_ids() == {first, again}


async def test_a_mount_that_fails_keeps_a_sound_blank(store: LayerStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of loop devices, say: the blank is not to blame and is not formatted again."""
    first = await store.new_upper(16)
    [blank] = store.blanks.glob("ext4-16-*.img")

    async def refused(layer_id: str, *, writable: bool) -> None:
        raise RuntimeFailure("mount: could not find any free loop device")

    with monkeypatch.context() as m:
        m.setattr(store, "mount", refused)
        with pytest.raises(RuntimeFailure, match="loop device"):
            await store.new_upper(16)
    assert blank.exists() and store.layer_ids() == {first}  # and no half-made upper
    assert not [p for p in store.layers.iterdir() if p.name.endswith(".img") and p.stem not in {first}]


async def test_creates_waiting_for_one_format_share_its_failure(
    store: LayerStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mkfs that fails fails every create waiting for it at once (one mkfs, not one after
    another, each with its own timeout); the next create formats again."""
    calls = 0
    run = layers_module.hostexec.run

    async def failing(argv: list[str], **kw: Any) -> str:
        nonlocal calls
        if argv[0] == "mkfs.ext4":
            calls += 1
            await asyncio.sleep(0.2)
            raise RuntimeFailure("mkfs.ext4 timed out")
        return await run(argv, **kw)

    with monkeypatch.context() as m:
        m.setattr(layers_module.hostexec, "run", failing)
        done = await asyncio.gather(*(store.new_upper(20) for _ in range(4)), return_exceptions=True)
    assert calls == 1 and all(isinstance(x, RuntimeFailure) for x in done), done
    assert store.layer_ids() == set() and not list(store.blanks.iterdir())
    upper = await store.new_upper(20)
    assert blank_and_mounted(store, upper)
