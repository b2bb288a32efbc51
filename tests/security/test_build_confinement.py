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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import Sandbox

from aenv.errors import InvalidRequest
from aenv.images.local import LocalSource
from aenv.images.unpack import LayerError, apply_layer
from aenv.sdk import BuildError, Client
from aenv.storage.confined import PathRefused, View
from aenv.templates.uploads import ContextLimits, unpack_context
from tests.conftest import API_KEY, Server
from tests.images.oci import LayerTar, Registry, busybox_layer, sha, start_registry, write_docker_archive, write_layout


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


def test_hardlinks_stay_in_their_layer(tmp_path: Path, canary: Path) -> None:
    """A hardlink to a link the layer made is a link (the old code then chmod'ed through it,
    changing the host file it points at); one to anything but a file of the same layer is refused."""
    layer = LayerTar().symlink("s", str(canary / "secret"))
    hardlink(layer, "h", "s", mode=0o777)
    hardlink(layer, "abs", "/s")  # hardlink names are relative to the layer, absolute or not
    dest = tmp_path / "layer"
    apply_layer(blob(tmp_path, layer), dest)
    assert os.readlink(dest / "h") == str(canary / "secret") and os.readlink(dest / "abs") == str(canary / "secret")
    assert untouched(canary)

    (tmp_path / "outside").write_text("outside")
    for target in ("../../outside", "/../outside", "missing", "dir/../../x", "lnk/secret"):
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
LIMITS = ContextLimits(upload=1 << 30, unpacked=1 << 30, entries=1000, headroom=0)


def context_tar(tmp: Path, build: Callable[[tarfile.TarFile], None]) -> Path:
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
    unpack_context(context_tar(tmp_path, build), dest, LIMITS)
    assert os.readlink(dest / "abs") == str(canary / "secret")
    assert os.readlink(dest / "rel") == "../../../../../../../etc/hostname"
    assert (dest / "same").read_bytes() == b"data" and os.lstat(dest / "same").st_nlink == 2
    assert untouched(canary)


def test_contexts_refuse_what_would_leave_them(tmp_path: Path, canary: Path) -> None:
    """Each case is refused with a 400 naming the entry; nothing is written outside."""
    (tmp_path / "escape-target").write_text("outside")
    cases: list[list[tuple[str, bytes, str]]] = [
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
    ]
    for entries in cases:

        def build(tar: tarfile.TarFile, entries: list[tuple[str, bytes, str]] = entries) -> None:
            for name, kind, link in entries:
                add(tar, name, kind, link.replace("CANARY", str(canary)), b"x" if kind == tarfile.REGTYPE else b"")

        with pytest.raises(InvalidRequest) as refused:
            unpack_context(context_tar(tmp_path, build), tmp_path / "deep" / uuid.uuid4().hex, LIMITS)
        assert refused.value.status == 400 and entries[-1][0] in refused.value.message, (entries, refused.value)
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
        source = LocalSource(f"docker-archive:{archive}", [imports], tmp_path / "work", LIMITS)
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
    source = LocalSource(f"oci:{layout}:v1", [imports], tmp_path / "work", LIMITS)
    with pytest.raises(InvalidRequest, match="inside the image"):
        source.resolve()

    for bad in ("sha256:../../../../../../etc/hostname", "../../../../etc/hostname", "sha256:" + "0" * 64, 7):
        index["manifests"][0]["digest"] = bad
        (layout / "index.json").write_text(json.dumps(index))
        with pytest.raises(InvalidRequest):
            LocalSource(f"oci:{layout}:v1", [imports], tmp_path / "work", LIMITS).resolve()


def test_docker_archives_still_import(tmp_path: Path) -> None:
    imports = tmp_path / "imports"
    imports.mkdir()
    layer = LayerTar().file("marker", b"fine").bytes()
    write_docker_archive(imports / "saved.tar", [layer], "saved/img:1")
    source = LocalSource(f"docker-archive:{imports / 'saved.tar'}:saved/img:1", [imports], tmp_path / "work", LIMITS)
    try:
        image = source.resolve()
        source.fetch(image.layers[0]["digest"], tmp_path / "blob")
        assert (tmp_path / "blob").read_bytes() == layer
    finally:
        source.close()


# -- end to end: a real server, a real registry, real sandboxes ------------------------------------
@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    yield from start_registry(tmp_path_factory.mktemp("registry"))


def image(registry: Registry, *layers: LayerTar) -> str:
    """A busybox image with ``layers`` on top, pushed under a fresh name."""
    repo = f"tests/conf-{uuid.uuid4().hex[:8]}"
    registry.push_image(
        repo,
        "1",
        [(busybox_layer().dir("tmp", 0o1777).bytes(), "gzip")] + [(layer.bytes(), "gzip") for layer in layers],
    )
    return f"{registry.host}/{repo}:1"


def fresh(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"  # the local test data dir outlives runs


def in_sandbox(template: str, *commands: str) -> list[tuple[int, str]]:
    """(exit code, stdout + stderr) of each command, run as root in a sandbox of ``template``."""
    from e2b import CommandExitException

    sbx = Sandbox.create(template=template, timeout=120)
    try:
        out = []
        for command in commands:
            try:
                result = sbx.commands.run(command, user="root")
                out.append((result.exit_code, result.stdout + result.stderr))
            except CommandExitException as exc:
                out.append((exc.exit_code, exc.stdout + exc.stderr))
        return out
    finally:
        sbx.kill()


def readlinks(*paths: str) -> str:
    return f"for f in {' '.join(paths)}; do readlink $f; done"


def post_context(
    api: httpx.Client, name: str, members: list[tarfile.TarInfo | tuple[tarfile.TarInfo, bytes]]
) -> tuple[int, dict[str, Any]]:
    """POST /templates/build with a tar made of ``members``: (status, the final JSON object)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for member in members:
            info, data = member if isinstance(member, tuple) else (member, b"")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data else None)
    r = api.post("/templates/build", params={"name": name}, content=raw.getvalue(), timeout=600)
    if r.status_code != 200:
        return r.status_code, r.json()
    last = json.loads(r.text.strip().splitlines()[-1])
    return (200, last["template"]) if "template" in last else (int(last["error"]["code"]), last["error"])


def entry(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", mode: int = 0o644) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, mode
    return info


def dockerfile(text: str) -> tuple[tarfile.TarInfo, bytes]:
    return entry("Dockerfile"), text.encode()


@pytest.mark.sandbox
def test_issue_copy_through_a_link_the_same_copy_made(
    registry: Registry, server: Server, e2b_env: Server, tmp_path: Path, canary: Path
) -> None:
    """The issue's case: `x -> ../../../../../../<canary>` from the first source, `x/pwned` from the
    second. The link is as deep in the context as the layer directory is on the host, so the old
    code wrote the file into the canary directory, as root."""
    depth = len((server.data_dir / "fs" / "layers" / "id").parts) - 1
    dirs = "/".join(f"d{i}" for i in range(depth))
    ctx = tmp_path / "ctx"
    (ctx / dirs).mkdir(parents=True)
    link = "../" * depth + str(canary.relative_to("/"))
    os.symlink(link, ctx / dirs / "x")
    (ctx / "y" / "x").mkdir(parents=True)
    (ctx / "y" / "x" / "pwned").write_text("pwned")
    (ctx / "Dockerfile").write_text(f"FROM {image(registry)}\nCOPY {dirs} y /\n")
    name = fresh("issue-copy")
    with Client(server.url, API_KEY) as client:
        client.build(name, ctx)
    assert untouched(canary)
    (_, target), (_, pwned) = in_sandbox(name, "readlink /x", f"cat {canary}/pwned")
    assert (target.strip(), pwned) == (link, "pwned")  # kept as a link, followed inside the sandbox


@pytest.mark.sandbox
def test_links_to_absolute_paths_and_in_the_middle_of_destinations(
    registry: Registry, server: Server, e2b_env: Server, tmp_path: Path, canary: Path
) -> None:
    """Absolute links from the context, from a lower layer and from an earlier RUN, in the middle of
    a COPY or WORKDIR destination, and a link as a COPY source: all resolved as the sandbox sees
    them, inside the layers."""
    base = image(registry, LayerTar().dir("etc").symlink("etc/link", str(canary)))
    ctx = tmp_path / "ctx"
    (ctx / "a").mkdir(parents=True)
    (ctx / "sub").mkdir()
    (ctx / "sub" / "inner").write_text("inner")
    os.symlink("sub", ctx / "to-sub")
    os.symlink(str(canary), ctx / "a" / "x")
    (ctx / "b" / "x").mkdir(parents=True)
    (ctx / "b" / "x" / "pwned").write_text("pwned")
    (ctx / "note").write_text("note")
    os.symlink(str(canary / "secret"), ctx / "srclink")
    (ctx / "Dockerfile").write_text(
        f"FROM {base}\n"
        "COPY a b /opt/\n"
        "COPY note /etc/link/note\n"
        f"RUN ln -s {canary}/sub /mid\n"
        "COPY note /mid/deeper/note\n"
        "WORKDIR /mid/wd\n"
        "RUN pwd -P > /pwd.txt\n"
        "COPY srclink /copied\n"
        "COPY to-sub/ /through/\n"
        "RUN ln -s /tmp /etc/tmplink\n"
        "COPY note /etc/tmplink/x\n"
    )
    name = fresh("abs-links")
    with Client(server.url, API_KEY) as client:
        client.build(name, ctx)
    assert untouched(canary)
    results = in_sandbox(
        name,
        readlinks("/opt/x", "/etc/link", "/mid", "/copied", "/etc/tmplink"),
        f"cat {canary}/pwned {canary}/note {canary}/sub/deeper/note /pwd.txt",
        f"test -d {canary}/sub/wd && cat /through/inner /tmp/x",
        "cat /copied",
    )
    assert results[0] == (0, f"{canary}\n{canary}\n{canary}/sub\n{canary}/secret\n/tmp\n")
    assert results[1] == (0, f"pwnednotenote{canary}/sub/wd\n")
    assert results[2] == (0, "innernote")
    assert results[3][0] != 0 and "HOST SECRET" not in results[3][1]  # the host's file is not the sandbox's


@pytest.mark.sandbox
def test_sources_through_links_stay_in_the_context(
    registry: Registry, server: Server, canary: Path, tmp_path: Path
) -> None:
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    os.symlink(str(canary), ctx / "abs")
    os.symlink("../" * 12, ctx / "up")
    base = image(registry)
    with Client(server.url, API_KEY) as client:
        for source in (
            "abs/secret",
            f"up{canary}/secret",
            f"up/var/tmp/*{canary.name[-6:]}*/secret",
            f"abs/../{canary.name}/secret",
        ):
            (ctx / "Dockerfile").write_text(f"FROM {base}\nCOPY {source} /x\n")
            with pytest.raises(BuildError) as failed:
                client.build(fresh("src-link"), ctx)
            assert failed.value.status == 400 and "not found in the build context" in failed.value.message, source
    assert untouched(canary)


@pytest.mark.sandbox
def test_context_tars_unpack_inside_and_keep_links(
    registry: Registry, api: httpx.Client, e2b_env: Server, canary: Path
) -> None:
    base = image(registry)
    good = fresh("ctx-good")
    status, body = post_context(
        api,
        good,
        [
            dockerfile(f"FROM {base}\nCOPY . /ctx/\n"),
            (entry("./file"), b"data"),
            entry("./hard", tarfile.LNKTYPE, "file"),
            entry("./abs", tarfile.SYMTYPE, str(canary / "secret")),
            entry("./rel", tarfile.SYMTYPE, "../" * 12 + "etc/hostname"),
        ],
    )
    assert status == 200, body
    ((_, out),) = in_sandbox(good, "cat /ctx/file /ctx/hard; " + readlinks("/ctx/abs", "/ctx/rel"))
    assert out == f"datadata{canary}/secret\n{'../' * 12}etc/hostname\n"

    for members, named in (
        ([entry("../escape")], "../escape"),
        ([entry("/abs-name")], "/abs-name"),
        ([entry("ok/../../escape")], "ok/../../escape"),
        ([entry("h", tarfile.LNKTYPE, "../../../../../../etc/hostname")], "h"),
        ([entry("h", tarfile.LNKTYPE, str(canary / "secret"))], "h"),
        ([entry("lnk", tarfile.SYMTYPE, str(canary)), entry("lnk/escape")], "lnk/escape"),
        ([entry("lnk", tarfile.SYMTYPE, str(canary)), entry("h", tarfile.LNKTYPE, "lnk/secret")], "lnk/secret"),
        ([entry("dev", tarfile.CHRTYPE)], "dev"),
        ([entry("Dockerfile", tarfile.SYMTYPE, "/etc/hostname")], "Dockerfile"),  # resolves inside: none there
    ):
        status, body = post_context(api, fresh("ctx-bad"), [dockerfile(f"FROM {base}\n"), *members])
        assert status == 400 and body["code"] == 400 and named in body["message"], (named, body)
    assert untouched(canary)


@pytest.mark.sandbox
def test_e2b_copy_steps_keep_links_as_links(registry: Registry, e2b_env: Server, tmp_path: Path, canary: Path) -> None:
    """The e2b SDK's Template builder, unchanged: `copy` of files that include relative and
    absolute links (the old extraction answered 500 for an absolute one)."""
    from e2b import Template

    (tmp_path / "a").mkdir()
    os.symlink(str(canary), tmp_path / "a" / "x")
    os.symlink("../" * 12 + "etc/hostname", tmp_path / "a" / "rel")
    (tmp_path / "b" / "x").mkdir(parents=True)
    (tmp_path / "b" / "x" / "pwned").write_text("pwned")
    template = (
        Template(file_context_path=str(tmp_path))
        .from_image(image(registry))
        .copy("a", "/opt/")
        .copy("b", "/opt/")
        .copy("a/x", "/home/user/linked")
    )
    name = fresh("e2b-links")
    Template.build(template, name)
    assert untouched(canary)
    (_, links), (_, pwned) = in_sandbox(
        name, readlinks("/opt/x", "/opt/rel", "/home/user/linked"), f"cat {canary}/pwned"
    )
    assert links == f"{canary}\n{'../' * 12}etc/hostname\n{canary}\n"
    assert pwned == "pwned"


@pytest.mark.sandbox
def test_image_conventions_follow_the_images_links_inside_it(
    registry: Registry, api: httpx.Client, e2b_env: Server, canary: Path
) -> None:
    """An image whose /etc is a link to a host path and whose /home is `/`: the host files there
    are neither read (the old code put the host's passwd in the template) nor written."""
    (canary / "etc").mkdir()
    (canary / "etc" / "passwd").write_text("root:x:0:0:HOST SECRET:/root:/bin/sh\n")
    linked = image(registry, LayerTar().symlink("etc", str(canary / "etc")).symlink("home", "/"))
    shadowed = image(registry, LayerTar().dir("etc").symlink("etc/passwd", "/etc/shadow"))
    for ref in (linked, shadowed):
        name = fresh("conv")
        r = api.post("/templates/from-image", json={"name": name, "image": ref}, timeout=600)
        assert r.status_code == 201, r.text
        results = in_sandbox(name, "cat /etc/passwd", "id -un user; ls -d /home/user")
        assert results[0][0] == 0 and "HOST SECRET" not in results[0][1] and "$" not in results[0][1]
        assert "user:x:1000:1000" in results[0][1] and results[1][0] == 0, results
    assert sorted(os.listdir(canary / "etc")) == ["passwd"] and "HOST SECRET" in (canary / "etc" / "passwd").read_text()
    assert not Path("/user").exists()


@pytest.mark.sandbox
def test_image_layers_with_hostile_entries_are_400(registry: Registry, api: httpx.Client, server: Server) -> None:
    for layer in (
        LayerTar().file(".wh.", b""),
        LayerTar().file(".wh..", b""),
        LayerTar().dir("sub").file("sub/.wh...", b""),
        LayerTar().dir(".wh...").file(".wh.../x", b""),
    ):
        r = api.post("/templates/from-image", json={"name": fresh("wh"), "image": image(registry, layer)}, timeout=600)
        assert r.status_code == 400 and "whiteout" in r.json()["message"], r.text
    repo = f"tests/conf-{uuid.uuid4().hex[:8]}"
    escaping = "sha256:" + "/.." * 10 + "/"  # used to name a layer directory outside the layer store
    registry.push_image(repo, "1", [(busybox_layer().bytes(), "gzip")], diff_ids=[escaping])
    r = api.post("/templates/from-image", json={"name": fresh("diffid"), "image": f"{registry.host}/{repo}:1"})
    assert r.status_code == 400 and "diff_id" in r.json()["message"], r.text
    assert (server.data_dir / "fs" / "tmp").is_dir() and not (server.data_dir / "fs" / "tmp" / "oci-").exists()


@pytest.mark.sandbox
def test_device_nodes_from_images_never_reach_the_host(
    registry: Registry, api: httpx.Client, e2b_env: Server, server: Server
) -> None:
    layer = LayerTar().dir("bin").file("unique", uuid.uuid4().bytes)  # a layer of its own: never cached
    special(layer, "mem", tarfile.CHRTYPE, 1, 1)
    special(layer, "sda", tarfile.BLKTYPE, 8, 0)
    special(layer, "bin/ls", tarfile.CHRTYPE, 0, 0)  # an overlay whiteout: hides busybox's ls
    ref = image(registry, layer)
    name = fresh("devices")
    r = api.post("/templates/from-image", json={"name": name, "image": ref}, timeout=600)
    assert r.status_code == 201, r.text
    layer_dir = server.data_dir / "fs" / "layers" / ("oci-" + sha(layer.buf.getvalue())[7:39])
    found = {p.name: os.lstat(p) for p in layer_dir.rglob("*")}
    assert "mem" not in found and "sda" not in found
    assert all(st.st_rdev == 0 for st in found.values() if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode))
    assert [code for code, _ in in_sandbox(name, "test -e /mem || test -e /sda", "test -e /bin/ls")] == [1, 1]


@pytest.mark.sandbox
def test_local_imports_read_only_inside_their_archive_or_layout(
    api: httpx.Client, server: Server, tmp_path: Path
) -> None:
    imports = server.data_dir / "imports"
    imports.mkdir(exist_ok=True)
    secret = LayerTar().file("marker", b"HOST SECRET").bytes()
    (tmp_path / "secret.tar").write_bytes(secret)  # on the host, outside every import directory
    name = uuid.uuid4().hex[:8]
    cases = {
        "absolute": str(tmp_path / "secret.tar"),
        "dotdot": "../" * 12 + str(tmp_path / "secret.tar").lstrip("/"),
    }
    for case, layer_name in cases.items():
        archive = imports / f"{name}-{case}.tar"
        write_docker_archive(archive, [secret], "saved/img:1")
        rewrite_manifest(archive, {"Layers": [layer_name]})
        r = api.post("/templates/from-image", json={"name": fresh(case), "image": f"docker-archive:{archive}"})
        assert r.status_code == 400 and "inside the image" in r.json()["message"], (case, r.text)
    archive = imports / f"{name}-config.tar"
    write_docker_archive(archive, [secret], "saved/img:1")
    rewrite_manifest(archive, {"Config": "../../../../../../../../etc/hostname"})
    r = api.post("/templates/from-image", json={"name": fresh("config"), "image": f"docker-archive:{archive}"})
    assert r.status_code == 400 and "inside the image" in r.json()["message"], r.text

    layout = imports / f"{name}-layout"
    write_layout(layout, [secret], "v1")
    blob_path = layer_blob(layout)
    os.rename(blob_path, tmp_path / "blob")  # the blob outside the layout, a link to it inside
    os.symlink(tmp_path / "blob", blob_path)
    r = api.post("/templates/from-image", json={"name": fresh("layout"), "image": f"oci:{layout}:v1"})
    assert r.status_code == 400 and "inside the image" in r.json()["message"], r.text


def rewrite_manifest(archive: Path, changes: dict[str, Any]) -> None:
    with tarfile.open(archive) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]
    with tarfile.open(archive, "w") as tar:
        for member, data in members:
            if member.name == "manifest.json":
                data = json.dumps([{**json.loads(data)[0], **changes}]).encode()
                member.size = len(data)
            tar.addfile(member, io.BytesIO(data))


def layer_blob(layout: Path) -> Path:
    """The one layer blob of a layout write_layout made."""
    blobs = layout / "blobs" / "sha256"
    index = json.loads((layout / "index.json").read_text())
    manifest = json.loads((blobs / index["manifests"][0]["digest"][7:]).read_bytes())
    return blobs / manifest["layers"][0]["digest"][7:]


@pytest.mark.sandbox
def test_copy_flags_are_checked(registry: Registry, server: Server, tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "a").write_text("a")
    base = image(registry)
    with Client(server.url, API_KEY) as client:
        for flags, says in (("--chmod=999", "octal"), ("--chmod=u+x", "octal"), ("--chown=99999999999", "passwd")):
            (ctx / "Dockerfile").write_text(f"FROM {base}\nCOPY {flags} a /a\n")
            with pytest.raises(BuildError) as failed:
                client.build(fresh("flags"), ctx)
            assert failed.value.status == 400 and failed.value.step == 2 and says in failed.value.message


@pytest.mark.sandbox
def test_e2b_files_hashes_are_names_not_paths(registry: Registry, api: httpx.Client, server: Server) -> None:
    """A build's `filesHash` named a tar and the directory it was unpacked in: `../` in it used to
    unpack an uploaded tar outside the build's context."""
    files = server.data_dir / "fs" / "build-files"
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        info = tarfile.TarInfo("file")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"data"))
    digest = uuid.uuid4().hex
    link = api.get(f"/templates/t/files/{digest}").json()
    assert httpx.put(link["url"], content=raw.getvalue()).status_code == 200
    base = image(registry)
    for files_hash in (f"../build-files/{digest}", f"../../build-files/{digest}", "/etc/hostname", ".."):
        created = api.post("/v3/templates", json={"name": fresh("hash")}).json()
        step = {"type": "COPY", "args": ["file", "/file"], "filesHash": files_hash}
        r = api.post(
            f"/v2/templates/{created['templateID']}/builds/{created['buildID']}",
            json={"fromImage": base, "steps": [step]},
        )
        message = r.json()["message"]
        assert r.status_code == 400 and ("files hash" in message or "filesHash" in message), (files_hash, r.text)
    assert not (files / "build-files").exists() and not (server.data_dir / "fs" / "build-files" / digest).exists()
    for bad in ("..", "a.b", "x" * 200):
        assert api.get(f"/templates/t/files/{bad}").status_code in (400, 404)
