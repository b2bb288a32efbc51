"""Node-local filesystem artifacts: read-only layers, writable uppers and checkpoint images.

Every sandbox writes into its own *upper*: a sparse ext4 image of the sandbox's disk quota,
loop-mounted, holding ``upper/`` and ``work/`` for overlayfs. Writing past the quota fails with
ENOSPC inside the sandbox and touches nothing else.

An upper becomes a layer by being *sealed*: its image is moved into the layer store and mounted
read-only, never written again. Forks and snapshots share every sealed layer. A layer is either a
plain directory (a root filesystem made by debootstrap or unpacked from an image) or such an ext4
image. Ids are short so that overlayfs option strings stay short.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

from aenv.errors import StorageError
from aenv.runtime import hostexec


def new_id(n: int = 12) -> str:
    return secrets.token_hex(n // 2)


class LayerStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.layers = root / "layers"
        self.uppers = root / "uppers"
        self.images = root / "images"
        for d in (self.layers, self.uppers, self.images):
            d.mkdir(parents=True, exist_ok=True)

    # -- paths --------------------------------------------------------------------------------------
    def layer(self, layer_id: str) -> Path:
        """The directory overlayfs uses as this layer."""
        if (self.layers / f"{layer_id}.img").exists():
            return self.layers / layer_id / "upper"
        return self.layers / layer_id

    def upper(self, upper_id: str) -> Path:
        """The directory holding ``upper/`` and ``work/`` (the mounted disk image)."""
        return self.uppers / upper_id / "mnt"

    def image(self, image_id: str) -> Path:
        return self.images / image_id

    def new_layer_dir(self) -> tuple[str, Path]:
        layer_id = new_id()
        path = self.layers / layer_id
        path.mkdir(parents=True)
        return layer_id, path

    # -- uppers -------------------------------------------------------------------------------------
    async def new_upper(self, size_mb: int) -> str:
        upper_id = new_id()
        base = self.uppers / upper_id
        (base / "mnt").mkdir(parents=True)
        disk = base / "disk.img"
        try:
            with open(disk, "wb") as f:
                f.truncate(size_mb * 2**20)
            await hostexec.run(
                [
                    "mkfs.ext4",
                    "-q",
                    "-F",
                    "-O",
                    "^has_journal",
                    "-E",
                    "lazy_itable_init=1,nodiscard",
                    "-m",
                    "0",
                    str(disk),
                ],
                timeout=60,
            )
            await self.mount_upper(upper_id)
            (base / "mnt" / "upper").mkdir(exist_ok=True)
            (base / "mnt" / "work").mkdir(exist_ok=True)
        except BaseException:
            await self.remove_upper(upper_id)
            raise
        return upper_id

    async def mount_upper(self, upper_id: str) -> None:
        mnt = self.uppers / upper_id / "mnt"
        if not os.path.ismount(mnt):
            await hostexec.run(
                ["mount", "-o", "loop,noatime", str(self.uppers / upper_id / "disk.img"), str(mnt)], timeout=60
            )

    async def unmount_upper(self, upper_id: str) -> None:
        await _unmount(self.uppers / upper_id / "mnt")

    async def remove_upper(self, upper_id: str) -> None:
        if not upper_id:
            return
        await _unmount(self.uppers / upper_id / "mnt")
        shutil.rmtree(self.uppers / upper_id, ignore_errors=True)

    async def seal(self, upper_id: str) -> str | None:
        """Turn an upper into a read-only layer; None if it holds no changes."""
        upper = self.upper(upper_id) / "upper"
        if not upper.is_dir():
            raise StorageError(f"upper {upper_id} is not mounted")
        if not any(os.scandir(upper)):
            await self.remove_upper(upper_id)
            return None
        await self.unmount_upper(upper_id)
        layer_id = new_id()
        os.rename(self.uppers / upper_id / "disk.img", self.layers / f"{layer_id}.img")
        shutil.rmtree(self.uppers / upper_id, ignore_errors=True)
        await self.mount_layer(layer_id)
        return layer_id

    # -- layers -------------------------------------------------------------------------------------
    async def mount_layer(self, layer_id: str) -> None:
        img = self.layers / f"{layer_id}.img"
        mnt = self.layers / layer_id
        if img.exists() and not os.path.ismount(mnt):
            mnt.mkdir(exist_ok=True)
            await hostexec.run(["mount", "-o", "loop,ro,noatime", str(img), str(mnt)], timeout=60)

    async def remove_layer(self, layer_id: str) -> None:
        if not layer_id:
            return
        await _unmount(self.layers / layer_id)
        (self.layers / f"{layer_id}.img").unlink(missing_ok=True)
        shutil.rmtree(self.layers / layer_id, ignore_errors=True)

    def layer_ids(self) -> set[str]:
        return {p.name.removesuffix(".img") for p in self.layers.iterdir() if not p.name.startswith(".")}

    def upper_ids(self) -> set[str]:
        return {p.name for p in self.uppers.iterdir() if not p.name.startswith(".")}

    # -- images -------------------------------------------------------------------------------------
    def remove_image(self, image_id: str) -> None:
        if image_id:
            shutil.rmtree(self.images / image_id, ignore_errors=True)

    def image_ids(self) -> set[str]:
        return {p.name for p in self.images.iterdir() if not p.name.startswith(".")}


async def _unmount(path: Path) -> None:
    if os.path.ismount(path):
        try:
            await hostexec.run(["umount", str(path)], timeout=60)
        except StorageError:
            raise
        except Exception:
            await hostexec.run(["umount", "-l", str(path)], timeout=60, check=False)
