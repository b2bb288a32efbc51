"""Layers as overlay lowers (aenv/images/unpack.py) and image references. No sandbox needed."""

from __future__ import annotations

import gzip
import os
import stat
from pathlib import Path

import pytest
import zstandard

from aenv.config import Settings
from aenv.errors import InvalidRequest, PayloadTooLarge
from aenv.images.reference import ImageRef
from aenv.images.unpack import IMAGE_SETTINGS, LAYER_SETTINGS, Bounds, LayerError, Meter, apply_layer
from tests.images.oci import LayerTar, busybox_layer, compress, sha, sparse_layer, tar_header, zero_layer

pytestmark = pytest.mark.fast  # the fast tier (./scripts/test --fast)
MiB = 1 << 20
# A layer's bounds here: 64 MiB, 20x its compressed size past 8 MiB, 1000 entries.
BOUNDS = Bounds(64 * MiB, 20, 8 * MiB, 1000, LAYER_SETTINGS)


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


def disk_use(path: Path) -> int:
    """Bytes of disk the files under ``path`` take (holes take none)."""
    return sum(os.lstat(os.path.join(d, n)).st_blocks * 512 for d, dirs, names in os.walk(path) for n in dirs + names)


def refused(tmp: Path, blob: bytes, image: Meter | None = None) -> tuple[Path, str]:
    """Unpack ``blob`` as layer 3 within `BOUNDS`, expecting a 413: where it went, and why not."""
    dest = tmp / "layer"
    meter = Meter("layer 3", BOUNDS, len(blob), image.add if image is not None else None)
    with pytest.raises(PayloadTooLarge) as caught:
        apply_layer(write(tmp, blob), dest, meter=meter)
    assert caught.value.status == 413 and str(tmp) not in caught.value.message
    return dest, caught.value.message


@pytest.mark.parametrize("compression", ["gzip", "zstd", "bzip2", "xz"])
def test_a_bomb_stops_as_it_decompresses_not_after(tmp_path: Path, compression: str) -> None:
    """1 GiB of zeros in files of 4 MiB, a few KiB to 1 MiB compressed: refused once it has
    unpacked 20 times that (8 MiB at least), with that much written at most."""
    blob, _ = zero_layer([(f"z{i}", 4 * MiB) for i in range(256)], compression, hashed=False)
    assert len(blob) < 2 * MiB
    limit = max(8 * MiB, 20 * len(blob))
    dest, said = refused(tmp_path, blob)
    assert said.startswith("layer 3 expands more than 20x its compressed size of ")
    assert "AENV_MAX_LAYER_RATIO" in said
    assert 0 < disk_use(dest) <= limit


@pytest.mark.parametrize("compression", ["gzip", "zstd", "bzip2", "xz", "none"])
def test_a_file_declared_past_a_bound_is_refused_before_a_byte_of_it(tmp_path: Path, compression: str) -> None:
    """A file's header says 1 TiB (its bytes never come): refused at the header, not once written."""
    dest, said = refused(tmp_path, compress(tar_header("huge", 1 << 40) + bytes(4 * MiB), compression))
    expected = "unpacks to more than 64 MiB" if compression == "none" else "expands more than 20x"
    assert said.startswith(f"layer 3 {expected}") and disk_use(dest) < 64 << 10


def test_the_total_bounds_a_layer_that_compresses_little(tmp_path: Path) -> None:
    """A plain tar (no ratio to speak of) past the total: refused as the stream passes it."""
    tar = zero_layer([(f"f{i}", os.urandom(MiB)) for i in range(80)], "none", hashed=False)[0]
    dest, said = refused(tmp_path, tar)
    assert said == "layer 3 unpacks to more than 64 MiB (the node's AENV_MAX_LAYER_UNPACKED_MB)"
    assert disk_use(dest) <= 64 * MiB


@pytest.mark.parametrize("pax", [False, True], ids=["gnu", "pax"])
def test_a_sparse_file_counts_at_its_full_size(tmp_path: Path, pax: bool) -> None:
    """tarfile writes a sparse file's holes as zeros: 4 KiB of data in a 2 GiB file is 2 GiB
    written. Its full size counts, before a byte of it is written; a small one still unpacks."""
    dest, said = refused(tmp_path, sparse_layer(tmp_path / "src", 2 << 30, pax))
    assert "expands more than 20x" in said and disk_use(dest) < 64 << 10
    small = sparse_layer(tmp_path / "src", 4 * MiB, pax)
    apply_layer(write(tmp_path, small), tmp_path / "small", meter=Meter("layer 4", BOUNDS, len(small)))
    assert os.stat(tmp_path / "small/sparse").st_size == 4 * MiB


def test_zeros_past_the_end_of_the_archive_count_too(tmp_path: Path) -> None:
    """Nothing is written from them, but each is decompressed and hashed: 1 TiB would take hours."""
    blob, _ = zero_layer([("a", b"a")], "zstd", trailing=1 << 30, hashed=False)
    _, said = refused(tmp_path, blob)
    assert "expands more than 20x" in said


def test_entries_are_bounded(tmp_path: Path) -> None:
    """Empty files take no bytes, and an inode each: a layer holds at most so many entries."""
    layer = LayerTar()
    for i in range(1500):
        layer.file(f"e{i}", b"")
    dest, said = refused(tmp_path, gzip.compress(layer.bytes()))
    assert said == "layer 3 has more than 1000 entries (the node's AENV_MAX_LAYER_ENTRIES)"
    assert len(os.listdir(dest)) <= 1000


def test_an_images_layers_are_bounded_together(tmp_path: Path) -> None:
    """Layers each within their bounds, together past the image's: refused as the last one grows.
    Each under the ratio's floor (8 MiB), together past it: the image's ratio holds."""
    layers = [zero_layer([(f"l{n}", 3 * MiB + MiB // 2)], "gzip", hashed=False)[0] for n in range(3)]
    image = Meter("image r/x:1", Bounds(256 * MiB, 20, 8 * MiB, 1000, IMAGE_SETTINGS), sum(map(len, layers)))
    for n in range(2):
        apply_layer(
            write(tmp_path, layers[n]), tmp_path / f"l{n}", meter=Meter("layer", BOUNDS, len(layers[n]), image.add)
        )
    _, said = refused(tmp_path, layers[2], image=image)
    assert said.startswith("image r/x:1 expands more than 20x its compressed size of ")
    assert "AENV_LAYER_RATIO_FLOOR_MB: 8 MiB" in said


def test_real_layers_are_far_from_the_default_bounds(tmp_path: Path) -> None:
    """What images hold (binaries, text, many small files) unpacks within the defaults."""
    layer = busybox_layer()
    for i in range(2000):
        layer.file(f"src/m{i}.py", b"def f():\n    return %d\n" % i * 20)
    tar = layer.bytes()
    blob = gzip.compress(tar)
    assert apply_layer(
        write(tmp_path, blob), tmp_path / "layer", meter=Meter("l", Bounds.layer(Settings()), len(blob))
    ) == sha(tar)
