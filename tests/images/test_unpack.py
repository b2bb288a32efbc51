"""Layers as overlay lowers (aenv/images/unpack.py) and image references. No sandbox needed."""

from __future__ import annotations

import gzip
import os
import stat
from pathlib import Path

import pytest
import zstandard

from aenv.errors import InvalidRequest
from aenv.images.reference import ImageRef
from aenv.images.unpack import LayerError, apply_layer
from tests.images.oci import LayerTar, sha

pytestmark = pytest.mark.fast  # the fast tier (./scripts/test --fast)


def write(tmp: Path, data: bytes) -> Path:
    blob = tmp / "blob"
    blob.write_bytes(data)
    return blob


@pytest.mark.root  # owners as the layer says
@pytest.mark.parametrize("compress", [lambda b: b, gzip.compress, zstandard.compress])
def test_files_links_and_the_diff_id(tmp_path: Path, compress) -> None:  # type: ignore[no-untyped-def]
    tar = LayerTar().dir("etc").file("etc/motd", b"hi\n", 0o640, uid=7).symlink("etc/link", "motd").bytes()
    dest = tmp_path / "layer"
    assert apply_layer(write(tmp_path, compress(tar)), dest) == sha(tar)
    assert (dest / "etc/motd").read_bytes() == b"hi\n"
    st = os.lstat(dest / "etc/motd")
    assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o640, 7)
    assert os.readlink(dest / "etc/link") == "motd"


@pytest.mark.root  # owners as the layer says
def test_whiteouts_become_overlay_whiteouts(tmp_path: Path) -> None:
    tar = LayerTar().dir("data").file("data/.wh.gone", b"").dir("opq").file("opq/.wh..wh..opq", b"").bytes()
    dest = tmp_path / "layer"
    apply_layer(write(tmp_path, tar), dest)
    gone = os.lstat(dest / "data/gone")
    assert stat.S_ISCHR(gone.st_mode) and gone.st_rdev == 0
    assert os.getxattr(dest / "opq", "trusted.overlay.opaque") == b"y"
    assert not (dest / "opq/.wh..wh..opq").exists()


@pytest.mark.parametrize(
    "hostile",
    [
        LayerTar().file("../escape", b"x"),
        LayerTar().file("a/../../escape", b"x"),
        LayerTar().symlink("link", "/").file("link/escape", b"x"),
        LayerTar().symlink("link", "..").file("link/escape", b"x"),
    ],
)
def test_nothing_lands_outside_the_layer(tmp_path: Path, hostile: LayerTar) -> None:
    dest = tmp_path / "deep" / "layer"
    with pytest.raises(LayerError):
        apply_layer(write(tmp_path, hostile.bytes()), dest)
    assert not (tmp_path / "deep" / "escape").exists() and not (tmp_path / "escape").exists()
    assert not Path("/escape").exists()


@pytest.mark.parametrize(
    "replaced",
    [
        lambda layer: layer.symlink("d", "/"),  # the directory becomes a link out
        lambda layer: layer.file("d", b"now a file"),
        lambda layer: layer.file(".wh.d", b""),  # whited out in its own layer
    ],
    ids=["link", "file", "whiteout"],
)
def test_a_directory_an_entry_replaced_is_never_written_through(tmp_path: Path, replaced) -> None:  # type: ignore[no-untyped-def]
    """The unpack keeps the directories it wrote into open; an entry that replaces one must not
    leave a later entry below that path going into the old directory (or through a link)."""
    layer = LayerTar().dir("d").dir("d/sub").file("d/sub/a", b"a")
    layer = replaced(layer).file("d/sub/b", b"b")
    dest = tmp_path / "deep" / "layer"
    with pytest.raises(LayerError, match="non-directory"):
        apply_layer(write(tmp_path, layer.bytes()), dest)
    assert not Path("/sub").exists() and not (tmp_path / "deep" / "sub").exists()


def test_many_files_in_few_directories(tmp_path: Path) -> None:
    layer = LayerTar()
    for d in range(5):
        layer.dir(f"d{d}")
        for f in range(300):
            layer.file(f"d{d}/f{f}", f"{d}/{f}".encode(), 0o600 + d)
    tar = layer.bytes()
    dest = tmp_path / "layer"
    assert apply_layer(write(tmp_path, gzip.compress(tar)), dest) == sha(tar)
    assert sorted(os.listdir(dest)) == [f"d{d}" for d in range(5)]
    assert (dest / "d3/f299").read_bytes() == b"3/299" and stat.S_IMODE(os.stat(dest / "d4/f0").st_mode) == 0o604


def test_corrupt_layer_is_a_clear_error(tmp_path: Path) -> None:
    good = gzip.compress(LayerTar().file("a", b"x" * 10000).bytes())
    with pytest.raises(LayerError):
        apply_layer(write(tmp_path, good[: len(good) // 2]), tmp_path / "layer")


def test_references() -> None:
    assert str(ImageRef.parse("busybox")) == "registry-1.docker.io/library/busybox:latest"
    assert str(ImageRef.parse("localhost:5000/a/b:1.0")) == "localhost:5000/a/b:1.0"
    pinned = ImageRef.parse("ghcr.io/o/r@sha256:" + "a" * 64)
    assert pinned.reference == "sha256:" + "a" * 64 and pinned.tag is None
    assert ImageRef.parse("h.io/r:V1").tag == "V1"  # tags are case-sensitive
    for bad in ("UPPER/case", "r@sha256:short", "a:b:c:d", "bad tag:!", "h.io/r:v1\u00e9", "r:\u0661"):
        with pytest.raises(InvalidRequest):
            ImageRef.parse(bad)
