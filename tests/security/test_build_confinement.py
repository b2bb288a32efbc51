"""Templates and images never make the host read, write, follow or open anything outside the layer
being built or the image being imported (issue 10): COPY/WORKDIR and the sandbox conventions
resolve links as the sandbox would, inside the layers; build contexts, E2B uploads and image
layers unpack without following links; local imports read only inside the archive or layout.

Each case checks canary files on the host and, where a template is built, the result from inside
a sandbox made from it."""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import tarfile
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.errors import InvalidRequest
from aenv.images.local import LocalSource
from aenv.images.unpack import LayerError, apply_layer
from aenv.storage.confined import PathRefused, View
from aenv.templates.build import unpack_context
from tests.images.oci import LayerTar, sha, write_docker_archive, write_layout


@pytest.fixture()
def canary() -> Iterator[Path]:
    """A host directory outside every tree under test (not under /tmp: a sandbox's /tmp is a tmpfs,
    so the same path inside a sandbox stays visible there)."""
    path = Path(tempfile.mkdtemp(prefix="aenv-canary-", dir="/var/tmp"))
    (path / "secret").write_text("HOST SECRET\n")
    os.chmod(path / "secret", 0o600)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def untouched(canary: Path) -> bool:
    """Nothing was created in the canary directory, and its secret kept its content and mode."""
    secret = canary / "secret"
    return (
        sorted(p.name for p in canary.iterdir()) == ["secret"]
        and secret.read_text() == "HOST SECRET\n"
        and stat.S_IMODE(os.lstat(secret).st_mode) == 0o600
    )


def special(layer: LayerTar, name: str, kind: bytes, major: int = 0, minor: int = 0) -> LayerTar:
    info = tarfile.TarInfo(name)
    info.type, info.devmajor, info.devminor, info.mode = kind, major, minor, 0o666
    layer.tar.addfile(info)
    return layer


def hardlink(layer: LayerTar, name: str, target: str, mode: int = 0o644) -> LayerTar:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = tarfile.LNKTYPE, target, mode
    layer.tar.addfile(info)
    return layer


def blob(tmp: Path, layer: LayerTar) -> Path:
    path = tmp / f"blob-{uuid.uuid4().hex[:8]}"
    path.write_bytes(layer.bytes())
    return path


# -- image layers (aenv/images/unpack.py) ---------------------------------------------------------
@pytest.mark.parametrize(
    "name", [".wh.", ".wh..", ".wh...", "a/.wh.", "a/.wh..", "a/b/.wh...", ".wh.../x", "a/.wh.../x"]
)
def test_whiteouts_of_no_file_are_refused(tmp_path: Path, name: str) -> None:
    deep = tmp_path / "deep"
    (deep / "sibling").mkdir(parents=True)
    dest = deep / "layer"
    with pytest.raises(LayerError) as refused:
        apply_layer(blob(tmp_path, LayerTar().dir("a").dir("a/b").file("a/b/f", b"f").file(name, b"")), dest)
    assert refused.value.status == 400 and "whiteout" in refused.value.message
    assert (deep / "sibling").is_dir()  # `.wh...` used to delete the layer's parent directory


def test_a_whiteout_of_an_odd_but_real_name_stays_in_its_directory(tmp_path: Path) -> None:
    (tmp_path / "deep").mkdir()
    dest = tmp_path / "deep" / "layer"
    apply_layer(blob(tmp_path, LayerTar().dir("a").file("a/.wh...x", b"")), dest)
    hidden = os.lstat(dest / "a" / "..x")
    assert stat.S_ISCHR(hidden.st_mode) and hidden.st_rdev == 0
    assert sorted(os.listdir(tmp_path / "deep")) == ["layer"]


def test_device_nodes_are_not_kept_but_whiteouts_are(tmp_path: Path) -> None:
    layer = LayerTar().dir("dev")
    special(layer, "dev/mem", tarfile.CHRTYPE, 1, 1)
    special(layer, "dev/sda", tarfile.BLKTYPE, 8, 0)
    special(layer, "gone", tarfile.CHRTYPE, 0, 0)
    special(layer, "dev/fifo", tarfile.FIFOTYPE)
    dest = tmp_path / "layer"
    apply_layer(blob(tmp_path, layer), dest)
    assert sorted(os.listdir(dest / "dev")) == ["fifo"]
    assert stat.S_ISFIFO(os.lstat(dest / "dev" / "fifo").st_mode)
    gone = os.lstat(dest / "gone")
    assert stat.S_ISCHR(gone.st_mode) and gone.st_rdev == 0


def test_a_hardlink_to_a_link_never_changes_what_the_link_points_at(tmp_path: Path, canary: Path) -> None:
    layer = LayerTar().symlink("s", str(canary / "secret"))
    hardlink(layer, "h", "s", mode=0o777)
    hardlink(layer, "abs", "/s")  # hardlink names are relative to the layer, absolute or not
    dest = tmp_path / "layer"
    apply_layer(blob(tmp_path, layer), dest)
    assert os.readlink(dest / "h") == str(canary / "secret") and os.readlink(dest / "abs") == str(canary / "secret")
    assert untouched(canary)


@pytest.mark.parametrize("target", ["../../outside", "/../outside", "missing", "dir/../../x", "lnk/secret"])
def test_hardlinks_must_name_a_file_of_the_same_layer(tmp_path: Path, canary: Path, target: str) -> None:
    (tmp_path / "outside").write_text("outside")
    layer = LayerTar().dir("dir").symlink("lnk", str(canary))
    hardlink(layer, "h", target)
    with pytest.raises(LayerError):
        apply_layer(blob(tmp_path, layer), tmp_path / "deep" / "layer")
    assert untouched(canary) and (tmp_path / "outside").read_text() == "outside"


def test_layers_set_no_host_kernel_attributes(tmp_path: Path) -> None:
    layer = LayerTar()
    info = tarfile.TarInfo("d")
    info.type = tarfile.DIRTYPE
    info.pax_headers = {
        "SCHILY.xattr.trusted.overlay.redirect": "/elsewhere",
        "SCHILY.xattr.trusted.overlay.opaque": "y",
        "SCHILY.xattr.user.note": "kept",
    }
    layer.tar.addfile(info)
    dest = tmp_path / "layer"
    apply_layer(blob(tmp_path, layer), dest)
    assert sorted(os.listxattr(dest / "d")) == ["trusted.overlay.opaque", "user.note"]


def test_setuid_files_keep_their_mode_and_are_never_run(tmp_path: Path) -> None:
    """Set-id bits are normal in images (sudo): kept in the layer, which the host never executes."""
    dest = tmp_path / "layer"
    apply_layer(blob(tmp_path, LayerTar().file("sudo", b"#!/bin/sh\ntouch /pwned\n", 0o4755)), dest)
    assert stat.S_IMODE(os.lstat(dest / "sudo").st_mode) == 0o4755


# -- the sandbox's view of layers (aenv/storage/confined.py) --------------------------------------
def test_view_resolves_links_inside_the_layers(tmp_path: Path, canary: Path) -> None:
    lower, top = tmp_path / "lower", tmp_path / "top"
    (lower / "etc").mkdir(parents=True)
    top.mkdir()
    (lower / "etc" / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    os.symlink(str(canary), lower / "etc" / "abs")  # what the sandbox sees as /var/tmp/aenv-canary-...
    os.symlink("../../../../../../../../..", lower / "up")
    os.symlink("loop", lower / "loop")
    os.symlink(str(canary / "secret"), lower / "shadow")
    view = View([lower], top)

    assert view.read("/shadow") is None and view.read("/etc/abs/secret") is None
    assert view.canonical("/up/etc/passwd") == "/etc/passwd" and view.read("/up/etc/passwd") is not None
    with pytest.raises(PathRefused):
        view.stat("/loop")
    with pytest.raises(PathRefused):
        view.stat("/etc/passwd/x")

    view.write_file("/etc/abs/new", b"in the layer", 0o644)  # through an absolute link: re-rooted
    assert (top / canary.relative_to("/") / "new").read_bytes() == b"in the layer"
    view.make_dir("/up/made", owner=(5, 5))
    assert (top / "made").is_dir() and os.lstat(top / "made").st_uid == 5
    view.write_file("/shadow", b"replaced", 0o600)  # the last component is replaced, never followed
    assert (top / "shadow").read_bytes() == b"replaced" and os.path.islink(lower / "shadow")
    assert untouched(canary)


def test_view_honours_whiteouts_and_opaque_directories(tmp_path: Path) -> None:
    low, mid = tmp_path / "low", tmp_path / "mid"
    for layer, text in ((low, b"low"), (mid, b"mid")):
        apply_layer(blob(tmp_path, LayerTar().dir("a").file("a/f", text).file("a/only-" + layer.name, b"")), layer)
    apply_layer(blob(tmp_path, LayerTar().dir("a").file("a/.wh.f", b"").dir("o").file("o/.wh..wh..opq", b"")), mid)
    (low / "o").mkdir()
    (low / "o" / "hidden").write_text("x")
    view = View([low, mid])
    assert view.read("/a/f") is None
    assert view.listdir("/a") == ["only-low", "only-mid"]
    assert view.listdir("/o") == [] and view.read("/o/hidden") is None


# -- build contexts and E2B uploads (unpack_context) ----------------------------------------------
def context_tar(tmp: Path, build: callable) -> Path:  # type: ignore[valid-type]
    path = tmp / f"context-{uuid.uuid4().hex[:8]}.tar"
    with tarfile.open(path, "w") as tar:
        build(tar)
    return path


def add(tar: tarfile.TarFile, name: str, kind: bytes = tarfile.REGTYPE, link: str = "", data: bytes = b"") -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size, info.mode = kind, link, len(data), 0o644
    tar.addfile(info, io.BytesIO(data) if data else None)


def test_contexts_keep_links_as_links(tmp_path: Path, canary: Path) -> None:
    def build(tar: tarfile.TarFile) -> None:
        add(tar, "./abs", tarfile.SYMTYPE, str(canary / "secret"))
        add(tar, "./rel", tarfile.SYMTYPE, "../../../../../../../etc/hostname")
        add(tar, "./file", data=b"data")
        add(tar, "./same", tarfile.LNKTYPE, "file")

    dest = tmp_path / "ctx"
    unpack_context(context_tar(tmp_path, build), dest)
    assert os.readlink(dest / "abs") == str(canary / "secret")
    assert os.readlink(dest / "rel") == "../../../../../../../etc/hostname"
    assert (dest / "same").read_bytes() == b"data" and os.lstat(dest / "same").st_nlink == 2
    assert untouched(canary)


@pytest.mark.parametrize(
    "entries",
    [
        [("../escape", tarfile.REGTYPE, "")],
        [("a/../../escape", tarfile.REGTYPE, "")],
        [("/escape", tarfile.REGTYPE, "")],
        [("lnk", tarfile.SYMTYPE, "CANARY"), ("lnk/escape", tarfile.REGTYPE, "")],
        [("lnk", tarfile.SYMTYPE, ".."), ("lnk/escape", tarfile.REGTYPE, "")],
        [("h", tarfile.LNKTYPE, "../escape-target")],
        [("h", tarfile.LNKTYPE, "CANARY/secret")],
        [("lnk", tarfile.SYMTYPE, "CANARY"), ("h", tarfile.LNKTYPE, "lnk/secret")],
        [("dev", tarfile.CHRTYPE, "")],
        [("fifo", tarfile.FIFOTYPE, "")],
    ],
)
def test_contexts_refuse_what_would_leave_them(
    tmp_path: Path, canary: Path, entries: list[tuple[str, bytes, str]]
) -> None:
    (tmp_path / "escape-target").write_text("outside")

    def build(tar: tarfile.TarFile) -> None:
        for name, kind, link in entries:
            add(tar, name, kind, link.replace("CANARY", str(canary)), b"x" if kind == tarfile.REGTYPE else b"")

    with pytest.raises(InvalidRequest) as refused:
        unpack_context(context_tar(tmp_path, build), tmp_path / "deep" / "ctx")
    assert refused.value.status == 400 and entries[-1][0] in refused.value.message
    assert untouched(canary) and not (tmp_path / "escape").exists() and not (tmp_path / "deep" / "escape").exists()


# -- local imports (aenv/images/local.py) ---------------------------------------------------------
def test_docker_archives_are_read_only_inside(tmp_path: Path) -> None:
    imports = tmp_path / "imports"
    imports.mkdir()
    secret_layer = LayerTar().file("marker", b"HOST SECRET").bytes()
    (tmp_path / "secret.tar").write_bytes(secret_layer)  # a tar on the host, outside the archive
    config = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {"diff_ids": [sha(secret_layer)]}})
    (tmp_path / "config.json").write_text(config)
    for case, entry in {
        "absolute": {"Config": "config.json", "Layers": [str(tmp_path / "secret.tar")]},
        "dotdot": {"Config": "config.json", "Layers": ["../../../../../../../../" + str(tmp_path / "secret.tar")]},
        "config": {"Config": "../../../../../../../../etc/hostname", "Layers": []},
        "config-abs": {"Config": str(tmp_path / "config.json"), "Layers": []},
        "not-a-list": {"Config": "config.json", "Layers": 7},
    }.items():
        archive = imports / f"{case}.tar"
        with tarfile.open(archive, "w") as tar:
            data = json.dumps([{**entry, "RepoTags": ["x:1"]}]).encode()
            info = tarfile.TarInfo("manifest.json")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            info = tarfile.TarInfo("config.json")
            info.size = len(config)
            tar.addfile(info, io.BytesIO(config.encode()))
        source = LocalSource(f"docker-archive:{archive}", [imports])
        try:
            with pytest.raises(InvalidRequest):
                source.resolve()
        finally:
            source.close()


def test_oci_layouts_are_read_only_inside(tmp_path: Path) -> None:
    imports = tmp_path / "imports"
    layout = imports / "layout"
    layer = LayerTar().file("marker", b"x").bytes()
    write_layout(layout, [layer], "v1")
    blobs = layout / "blobs" / "sha256"
    index = json.loads((layout / "index.json").read_text())
    manifest = json.loads((blobs / index["manifests"][0]["digest"].split(":")[1]).read_bytes())
    layer_blob = blobs / manifest["layers"][0]["digest"].split(":")[1]
    os.rename(layer_blob, tmp_path / "moved")  # the blob outside, a link to it inside
    os.symlink(tmp_path / "moved", layer_blob)
    source = LocalSource(f"oci:{layout}:v1", [imports])
    with pytest.raises(InvalidRequest, match="inside the image"):
        source.resolve()

    for bad in ("sha256:../../../../../../etc/hostname", "../../../../etc/hostname", "sha256:" + "0" * 64, 7):
        index["manifests"][0]["digest"] = bad
        (layout / "index.json").write_text(json.dumps(index))
        with pytest.raises(InvalidRequest):
            LocalSource(f"oci:{layout}:v1", [imports]).resolve()


def test_docker_archives_still_import(tmp_path: Path) -> None:
    imports = tmp_path / "imports"
    imports.mkdir()
    layer = LayerTar().file("marker", b"fine").bytes()
    write_docker_archive(imports / "saved.tar", [layer], "saved/img:1")
    source = LocalSource(f"docker-archive:{imports / 'saved.tar'}:saved/img:1", [imports])
    try:
        image = source.resolve()
        source.fetch(image.layers[0]["digest"], tmp_path / "blob")
        assert (tmp_path / "blob").read_bytes() == layer
    finally:
        source.close()
