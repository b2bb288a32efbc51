"""Node-local filesystem artifacts: read-only layers, writable uppers and checkpoint images.

An upper directory becomes a layer by being *sealed*: renamed into the layer store, never
written again. Forks and snapshots share every sealed layer; each instance writes only to its own
fresh upper. Ids are short so that overlayfs option strings stay short.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path


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

    def layer(self, layer_id: str) -> Path:
        return self.layers / layer_id

    def upper(self, upper_id: str) -> Path:
        return self.uppers / upper_id

    def image(self, image_id: str) -> Path:
        return self.images / image_id

    def new_upper(self) -> str:
        upper_id = new_id()
        (self.uppers / upper_id / "upper").mkdir(parents=True)
        (self.uppers / upper_id / "work").mkdir()
        return upper_id

    def new_layer_dir(self) -> tuple[str, Path]:
        layer_id = new_id()
        path = self.layers / layer_id
        path.mkdir(parents=True)
        return layer_id, path

    def seal(self, upper_id: str) -> str | None:
        """Turn an upper into a read-only layer; None if it holds no changes."""
        upper = self.uppers / upper_id / "upper"
        if not any(os.scandir(upper)):
            self.remove_upper(upper_id)
            return None
        layer_id = new_id()
        os.rename(upper, self.layers / layer_id)
        self.remove_upper(upper_id)
        return layer_id

    def remove_upper(self, upper_id: str) -> None:
        if upper_id:
            shutil.rmtree(self.uppers / upper_id, ignore_errors=True)

    def remove_image(self, image_id: str) -> None:
        if image_id:
            shutil.rmtree(self.images / image_id, ignore_errors=True)

    def remove_layer(self, layer_id: str) -> None:
        if layer_id:
            shutil.rmtree(self.layers / layer_id, ignore_errors=True)

    def bytes_used(self, path: Path) -> int:
        total = 0
        for base, _, names in os.walk(path):
            for name in names:
                try:
                    total += os.lstat(os.path.join(base, name)).st_size
                except OSError:
                    pass
        return total
