"""Red-team variants of issue 10's host-side cases: what the first fixes left open.

Each test is an attack that got through the merged fixes: a local image archive that wrote
outside its extraction directory through Python's own tar filter, ..."""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from aenv.errors import AenvError, InvalidRequest
from aenv.images.local import LocalSource
from aenv.images.unpack import apply_layer
from aenv.repo.backends import PosixBackend
from aenv.repo.repository import Repository
from aenv.templates.uploads import ContextLimits, unpack_context
from tests.conftest import Server, start_server
from tests.images.oci import LayerTar, Registry, write_docker_archive
from tests.security.test_build_confinement import (  # noqa: F401 - fixtures too
    canary,
    dockerfile,
    fresh,
    image,
    in_sandbox,
    post_context,
    registry,
    untouched,
)
from tests.security.test_host_side import as_nobody
from tests.security.test_uploads_and_repo import after_a_while, base_entry, create, gnu_tar, put_artifact, put_entry

LIMITS = ContextLimits(upload=1 << 30, unpacked=1 << 30, entries=1000, headroom=0)


# -- local imports (aenv/images/local.py) ---------------------------------------------------------
def realpath_escape(tar: tarfile.TarFile, target_dir: Path, name: str, data: bytes) -> None:
    """Entries that make ``escape`` lead to ``target_dir`` for the kernel while os.path.realpath,
    which stops resolving once a path passes PATH_MAX, sees it inside (CVE-2025-4517): Python's
    own `filter="data"` lets ``escape/<name>`` through."""
    long_dir = "d" * 247
    steps = "abcdefghijklmnop"
    path = ""

    def add(member: str, kind: bytes, link: str = "", content: bytes = b"") -> None:
        info = tarfile.TarInfo(member)
        info.type, info.linkname, info.size, info.mode = kind, link, len(content), 0o755
        tar.addfile(info, io.BytesIO(content) if content else None)

    for step in steps:
        add(os.path.join(path, long_dir), tarfile.DIRTYPE)
        add(os.path.join(path, step), tarfile.SYMTYPE, long_dir)
        path = os.path.join(path, long_dir)
    too_long = os.path.join(*steps, "l" * 254)  # resolves to the archive's root, past PATH_MAX
    add(too_long, tarfile.SYMTYPE, "../" * len(steps))
    add("escape", tarfile.SYMTYPE, too_long + "/.." * (len(steps) + 1) + str(target_dir))
    add(f"escape/{name}", tarfile.REGTYPE, content=data)


@pytest.mark.parametrize("transport", ["docker-archive", "oci-archive"])
def test_image_archives_do_not_unpack_through_links(tmp_path: Path, canary: Path, transport: str) -> None:  # noqa: F811
    imports = tmp_path / "imports"
    imports.mkdir()
    archive = imports / "image.tar"
    write_docker_archive(archive, [LayerTar().file("marker", b"x").bytes()], "img:1")
    with tarfile.open(archive, "a") as tar:
        realpath_escape(tar, canary, "pwned", b"written by an image archive\n")
    source = LocalSource(f"{transport}:{archive}", [imports], tmp_path / "work", LIMITS)
    try:
        with pytest.raises(InvalidRequest) as refused:
            source.resolve()
        assert refused.value.status == 400
    finally:
        source.close()
    assert untouched(canary), sorted(p.name for p in canary.iterdir())
    assert not (tmp_path / "work").exists() or not any((tmp_path / "work").iterdir())


@pytest.mark.sandbox
def test_image_archives_named_through_the_api_do_not_write_the_host(
    api: httpx.Client,
    server: Server,
    canary: Path,  # noqa: F811
) -> None:
    """The same archive named by `POST /templates/from-image` and by a Dockerfile's FROM."""
    archive = server.data_dir / "imports" / f"escape-{uuid.uuid4().hex[:8]}.tar"
    archive.parent.mkdir(exist_ok=True)
    write_docker_archive(archive, [LayerTar().file("marker", b"x").bytes()], "img:1")
    with tarfile.open(archive, "a") as tar:
        realpath_escape(tar, canary, "pwned", b"written by an image archive\n")
    for transport in ("docker-archive", "oci-archive"):
        r = api.post("/templates/from-image", json={"name": fresh("escape"), "image": f"{transport}:{archive}"})
        assert r.status_code == 400, r.text
        status, error = post_context(api, fresh("escape"), [dockerfile(f"FROM {transport}:{archive}\n")])
        assert status == 400, error
    assert untouched(canary), sorted(p.name for p in canary.iterdir())
    assert not [p for p in (server.data_dir / "fs" / "tmp").iterdir() if p.name.startswith("image-")]


def test_a_link_loop_in_an_image_archive_is_400(tmp_path: Path) -> None:
    imports = tmp_path / "imports"
    imports.mkdir()
    archive = imports / "loop.tar"
    write_docker_archive(archive, [LayerTar().file("marker", b"x").bytes()], "img:1")
    with tarfile.open(archive) as tar:
        manifest = json.load(tar.extractfile("manifest.json"))  # type: ignore[arg-type]
    manifest[0]["Config"] = "x"
    with tarfile.open(archive, "a") as tar:
        for name, link in (("x", "y"), ("y", "x")):
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, link
            tar.addfile(info)
        data = json.dumps(manifest).encode()
        info = tarfile.TarInfo("manifest.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    source = LocalSource(f"docker-archive:{archive}", [imports], tmp_path / "work", LIMITS)
    try:
        with pytest.raises(InvalidRequest):
            source.resolve()
    finally:
        source.close()


def test_image_archives_still_import_with_links_inside(tmp_path: Path) -> None:
    """`docker save` writes a layer shared by two images once, and a link to it for the other."""
    imports = tmp_path / "imports"
    imports.mkdir()
    layer = LayerTar().file("marker", b"fine").bytes()
    archive = imports / "saved.tar"
    write_docker_archive(archive, [layer], "saved/img:1")
    with tarfile.open(archive) as tar:
        manifest = json.load(tar.extractfile("manifest.json"))  # type: ignore[arg-type]
    manifest[0]["Layers"] = ["linked/layer.tar"]
    with tarfile.open(archive, "a") as tar:
        for name, link in (("linked", ""), ("linked/layer.tar", "../layer0/layer.tar")):
            info = tarfile.TarInfo(name)
            info.type, info.linkname = (tarfile.SYMTYPE, link) if link else (tarfile.DIRTYPE, "")
            tar.addfile(info)
        data = json.dumps(manifest).encode()
        info = tarfile.TarInfo("manifest.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    source = LocalSource(f"docker-archive:{archive}:saved/img:1", [imports], tmp_path / "work", LIMITS)
    try:
        image = source.resolve()
        source.fetch(image.layers[0]["digest"], tmp_path / "blob")
        assert (tmp_path / "blob").read_bytes() == layer
    finally:
        source.close()
    assert not any((tmp_path / "work").iterdir())


# -- malformed tar headers: a 400, never a 500 -----------------------------------------------------
def pax_member(kind: bytes, pax: dict[str, str]) -> tuple[tarfile.TarInfo, bytes]:
    """An entry whose pax header says what no file system name can hold, and its content."""
    info = tarfile.TarInfo("placeholder")
    info.type, info.linkname, info.pax_headers = kind, "placeholder-target", pax
    data = b"x" if kind == tarfile.REGTYPE else b""
    info.size = len(data)
    return info, data


def pax_entry(kind: bytes, pax: dict[str, str]) -> LayerTar:
    layer = LayerTar()
    info, data = pax_member(kind, pax)
    layer.tar.addfile(info, io.BytesIO(data))
    return layer


SPARSE_OF_WORDS = {"GNU.sparse.major": "0", "GNU.sparse.minor": "1", "GNU.sparse.map": "a,b", "path": "s"}
MALFORMED = {
    "nul-name": (tarfile.REGTYPE, {"path": "a\0b"}),
    "nul-symlink": (tarfile.SYMTYPE, {"path": "l", "linkpath": "x\0y"}),
    "nul-hardlink": (tarfile.LNKTYPE, {"path": "h", "linkpath": "x\0y"}),
    "sparse-map-of-words": (tarfile.REGTYPE, {**SPARSE_OF_WORDS, "GNU.sparse.realsize": "10"}),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_tar_headers_are_refused(tmp_path: Path, case: str) -> None:
    kind, pax = MALFORMED[case]
    tar = tmp_path / "layer.tar"
    tar.write_bytes(pax_entry(kind, pax).bytes())
    with pytest.raises(InvalidRequest) as layer:
        apply_layer(tar, tmp_path / "layer")
    with pytest.raises(InvalidRequest) as context:
        unpack_context(tar, tmp_path / "context", LIMITS)
    assert layer.value.status == context.value.status == 400


def test_an_attribute_name_with_a_nul_byte_is_only_skipped(tmp_path: Path) -> None:
    tar = tmp_path / "layer.tar"
    tar.write_bytes(pax_entry(tarfile.REGTYPE, {"path": "f", "SCHILY.xattr.user.a\0b": "v"}).bytes())
    apply_layer(tar, tmp_path / "layer")
    assert (tmp_path / "layer" / "f").read_bytes() == b"x"


@pytest.mark.sandbox
def test_malformed_headers_through_the_api_are_400(registry: Registry, api: httpx.Client) -> None:  # noqa: F811
    for case, (kind, pax) in MALFORMED.items():
        r = api.post(
            "/templates/from-image", json={"name": fresh(case), "image": image(registry, pax_entry(kind, pax))}
        )
        assert r.status_code == 400, (case, r.text)
        info = tarfile.TarInfo("placeholder")
        info.type, info.linkname, info.pax_headers = kind, "placeholder-target", pax
        status, error = post_context(
            api, fresh(case), [dockerfile("FROM base\n"), (info, b"x" if kind == tarfile.REGTYPE else b"")]
        )
        assert status == 400, (case, error)


# -- inodes are disk space too ---------------------------------------------------------------------
MiB = 1 << 20
HEADROOM = 16 * MiB


@pytest.fixture()
def few_inodes(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB ext4 file system with 8192 inodes: room for bytes, not for many files."""
    disk, mountpoint = tmp_path / "disk.img", tmp_path / "mnt"
    with open(disk, "wb") as f:
        f.truncate(64 * MiB)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-N", "8192", "-m", "0", str(disk)], check=True)
    mountpoint.mkdir()
    subprocess.run(["mount", "-o", "loop", str(disk), str(mountpoint)], check=True)
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", str(mountpoint)], check=True)


def empty_files(count: int) -> bytes:
    """A tar of ``count`` empty files: no bytes to speak of, one inode each."""
    return gnu_tar([(tarfile.TarInfo(f"f{n}"), b"") for n in range(count)])


def assert_kept_inodes(refused: pytest.ExceptionInfo[AenvError], where: Path) -> None:
    """Refused with 507, and far from the last inode (the headroom's share is a quarter: 2048)."""
    assert refused.value.status == 507 and "nearly full" in refused.value.message, refused.value
    assert os.statvfs(where).f_favail >= 1024


def test_a_layer_of_empty_files_stops_at_the_inode_headroom(few_inodes: Path) -> None:
    blob = few_inodes / "layer.tar"
    blob.write_bytes(empty_files(10_000))
    with pytest.raises(AenvError) as refused:
        apply_layer(blob, few_inodes / "layer", HEADROOM)
    assert_kept_inodes(refused, few_inodes)


def test_a_context_of_empty_files_stops_at_the_inode_headroom(few_inodes: Path) -> None:
    context = few_inodes / "context.tar"
    context.write_bytes(empty_files(10_000))
    limits = ContextLimits(upload=1 << 30, unpacked=1 << 30, entries=10_000, headroom=HEADROOM)
    with pytest.raises(AenvError) as refused:
        unpack_context(context, few_inodes / "context", limits)
    assert_kept_inodes(refused, few_inodes)


def test_a_repository_artifact_of_empty_files_stops_at_the_inode_headroom(tmp_path: Path, few_inodes: Path) -> None:
    repo = Repository(PosixBackend(tmp_path / "repo"))
    ref = put_artifact(repo, "layer", "many", empty_files(10_000))
    with pytest.raises(AenvError) as refused:
        repo.fetch_artifact(ref, few_inodes / "many", "test", HEADROOM)
    assert_kept_inodes(refused, few_inodes)


def test_the_layer_cache_counts_what_empty_files_hold(tmp_path: Path) -> None:
    from aenv.storage.layers import LayerStore

    store = LayerStore(tmp_path)
    layer_id, root = store.new_layer_dir()
    for n in range(1000):
        (root / f"f{n}").touch()
    assert store.disk_usage(layer_id) >= 1000 * 4096


# -- a data dir another host user made -------------------------------------------------------------
@pytest.fixture()
def shared_tmp() -> Iterator[Path]:
    """A directory like /var/tmp: every host user may create entries in it (sticky)."""
    path = Path(tempfile.mkdtemp(prefix="aenv-shared-", dir="/var/tmp"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


NO_BASE = {"AENV_BUILD_BASE": "false", "AENV_API_KEY": ""}


@pytest.mark.sandbox
@pytest.mark.parametrize("made_by_nobody", ["data", "data/..", "repo"])
def test_a_node_refuses_directories_another_user_can_change(shared_tmp: Path, made_by_nobody: str) -> None:
    """A host user who made the data dir (or a directory on its path, or the repository's) before
    the node's first start could swap what root reads and writes there: plant an `api-key` of
    their own, or links where layers go. The node refuses to start instead."""
    owned = shared_tmp / "nobody"
    assert as_nobody("mkdir", "-m", "0777", str(owned)).returncode == 0
    data = {"data": owned, "data/..": owned / "data", "repo": shared_tmp / "data"}[made_by_nobody]
    env = {**NO_BASE, "AENV_REPO": str(owned if made_by_nobody == "repo" else shared_tmp / "repo")}
    with pytest.raises(RuntimeError, match="another user"):
        srv = start_server(data, extra_env=env, wait_for=None, timeout=60)
        srv.stop()


@pytest.mark.sandbox
def test_a_node_starts_in_its_own_directory_under_a_shared_one(shared_tmp: Path) -> None:
    env = {**NO_BASE, "AENV_REPO": str(shared_tmp / "repo")}
    srv = start_server(shared_tmp / "data", extra_env=env, wait_for=None, timeout=60)
    srv.stop()


# -- host tasks: what all sandboxes together may take ----------------------------------------------
def test_one_sandbox_gets_at_most_a_quarter_of_the_host_s_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A typical 24 GiB host: pid_max 4194304 (systemd's), threads-max 192730. A quarter of the
    pid space was a million: one root bomb could take every thread the host may have."""
    from aenv.runtime import gvisor

    host = {"pid_max": 4194304, "threads-max": 192730}
    monkeypatch.setattr(gvisor, "_kernel_limit", lambda name: host[name])
    assert gvisor.host_tasks_limit(65536) <= 192730 // 4
    assert gvisor.all_sandboxes_tasks_limit() <= 192730 // 2


@pytest.mark.sandbox
def test_all_sandboxes_together_keep_half_of_the_host_s_tasks(e2b_env: Server, api: httpx.Client) -> None:
    """A contained user fork bomb leaves its sandbox ~4300 host tasks (runsc keeps the stubs of
    exited processes) until it is restored, and a root bomb may take a quarter of the host's:
    four such sandboxes (a rollout's forks all running one program) took every pid of a host
    with pid_max 32768. The node caps the cgroup that holds every sandbox at half of them."""
    r = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120, "limits": {"nproc": 65536}})
    assert r.status_code == 201, r.text
    try:
        space = min(int(Path(f"/proc/sys/kernel/{name}").read_text()) for name in ("pid_max", "threads-max"))
        parent = Path("/sys/fs/cgroup/pids/aenv")
        assert (parent / "pids.max").read_text().strip() != "max"
        assert int((parent / "pids.max").read_text()) <= space // 2
        limits = [int((d / "pids.max").read_text()) for d in parent.iterdir() if (d / "pids.max").exists()]
        assert limits and max(limits) <= space // 4
    finally:
        api.delete(f"/sandboxes/{r.json()['sandboxID']}")


HIGHEST_NPROC = 65536


@pytest.mark.sandbox
def test_the_highest_nproc_the_api_allows_is_the_one_processes_get(e2b_env: Server, api: httpx.Client) -> None:
    """65536, the API's highest. A template's agent keeps the limits it was committed with, and
    could not give a process a limit above its own: with `limits.nproc` past the commit's (8192)
    every command failed with 'set limits: EPERM'. A template committed now takes any nproc."""
    name = fresh("nproc")
    status, error = post_context(api, name, [dockerfile(f"FROM base\nRUN echo {uuid.uuid4().hex} > /opt/id\n")])
    assert status == 200, error
    r = api.post("/v2/sandboxes", json={"templateID": name, "timeout": 120, "limits": {"nproc": HIGHEST_NPROC}})
    assert r.status_code == 201, r.text
    try:
        sbx = Sandbox.connect(r.json()["sandboxID"])
        assert sbx.commands.run("ulimit -u; ulimit -Hu").stdout.split() == [str(HIGHEST_NPROC)] * 2
        assert sbx.commands.run("ulimit -u", user="root").stdout.strip() == str(HIGHEST_NPROC)
    finally:
        api.delete(f"/sandboxes/{r.json()['sandboxID']}")
        api.delete(f"/templates/{name}")


# -- deep trees: Python's own walks recurse --------------------------------------------------------
DEEP = 1200  # directories: a few KiB of tar, past Python's recursion limit (1000)


def deep_tree(tar: LayerTar, top: str = "deep") -> LayerTar:
    info = tarfile.TarInfo("/".join([top] + ["d"] * DEEP + ["f"]))
    info.size = 1
    tar.tar.addfile(info, io.BytesIO(b"x"))
    return tar


@pytest.fixture()
def deep_tmp(tmp_path: Path) -> Iterator[Path]:
    """tmp_path, emptied here: pytest's own cleanup (shutil.rmtree) cannot remove a deep tree."""
    yield tmp_path
    from aenv.storage.confined import remove_tree

    remove_tree(tmp_path, ignore_errors=True)


def test_a_layer_thousands_of_directories_deep_is_measured_and_removed(deep_tmp: Path) -> None:
    """shutil.rmtree and os.walk recursed: a deep layer could never be measured (every cache
    pass failed on it) nor removed, and a whiteout of a deep directory answered 500."""
    from aenv.storage.layers import LayerStore

    store = LayerStore(deep_tmp / "fs")
    blob = deep_tmp / "layer.tar"
    blob.write_bytes(deep_tree(LayerTar()).bytes())
    apply_layer(blob, store.layers / "oci-deep")
    assert store.disk_usage("oci-deep") >= DEEP * 4096
    asyncio.run(store.remove("oci-deep"))
    assert not (store.layers / "oci-deep").exists()

    blob.write_bytes(deep_tree(LayerTar()).file(".wh.deep", b"").bytes())  # whited out in its own layer
    apply_layer(blob, deep_tmp / "whiteout")
    assert (deep_tmp / "whiteout" / "deep").is_char_device()


def test_removing_a_tree_never_follows_links_nor_enters_other_file_systems(tmp_path: Path, canary: Path) -> None:  # noqa: F811
    from aenv.storage.confined import remove_tree

    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    os.symlink(canary, tree / "a" / "link")
    os.symlink(canary / "secret", tree / "a" / "b" / "file-link")
    (tree / "mnt").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(tree / "mnt")], check=True)
    try:
        (tree / "mnt" / "kept").write_text("kept")
        with pytest.raises(OSError):
            remove_tree(tree)  # the mount point cannot go
        assert (tree / "mnt" / "kept").read_text() == "kept"
    finally:
        subprocess.run(["umount", str(tree / "mnt")], check=True)
    assert untouched(canary)
    remove_tree(tree)
    assert not tree.exists() and untouched(canary)


@pytest.mark.sandbox
def test_deep_contexts_and_layers_through_the_api(registry: Registry, api: httpx.Client, server: Server) -> None:  # noqa: F811
    """A build context and an image layer thousands of directories deep build, and leave nothing."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        data = b"FROM base\nCOPY ctx/d/d /opt/d\n"
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        for member in tarfile.open(fileobj=io.BytesIO(deep_tree(LayerTar(), "ctx").bytes())):
            tar.addfile(member, io.BytesIO(b"x") if member.isreg() else None)
    r = api.post("/templates/build", params={"name": fresh("deep")}, content=raw.getvalue(), timeout=600)
    assert r.status_code == 200 and "template" in json.loads(r.text.strip().splitlines()[-1]), r.text[-2000:]
    r = api.post("/templates/from-image", json={"name": fresh("deep"), "image": image(registry, deep_tree(LayerTar()))})
    assert r.status_code == 201, r.text
    assert not list((server.data_dir / "fs" / "tmp").iterdir())


@pytest.mark.sandbox
def test_a_copy_never_holds_the_node_s_event_loop(api: httpx.Client, server: Server) -> None:
    """COPY, WORKDIR and the conventions ran their host file work on the event loop: a 4 KiB
    context 1500 directories deep held every API call and sandbox stream for 13 s (and hashing
    and copying a 20 GiB context would for minutes). 900 deep here: seconds too, by either a linear
    or a quadratic cost in the depth."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        data = f"FROM base\nCOPY ctx /opt/ctx-{uuid.uuid4().hex}\nWORKDIR /opt/w\n".encode()
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo("ctx/" + "/".join(["d"] * 900) + "/f")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    answers: list[httpx.Response] = []
    building = threading.Thread(
        target=lambda: answers.append(
            api.post("/templates/build", params={"name": fresh("loop")}, content=raw.getvalue())
        )
    )
    building.start()
    slowest = 0.0
    with httpx.Client(base_url=server.url, timeout=120) as probe:
        while building.is_alive():
            started = time.monotonic()
            assert probe.get("/health").status_code == 200
            slowest = max(slowest, time.monotonic() - started)
            time.sleep(0.1)
    building.join()
    assert "template" in json.loads(answers[0].text.strip().splitlines()[-1]), answers[0].text[-1000:]
    assert slowest < 2.0, f"/health took {slowest:.1f} s during the build"


def test_aufs_bookkeeping_at_a_layer_s_top_is_skipped_as_docker_skips_it(tmp_path: Path) -> None:
    """Images exported from AUFS keep hardlinks' originals in /.wh..wh.plnk/: a 400 before."""
    blob = tmp_path / "layer.tar"
    layer = LayerTar().dir(".wh..wh.plnk", 0o700).file(".wh..wh.plnk/1234.5678", b"x").file("kept", b"y")
    blob.write_bytes(layer.bytes())
    apply_layer(blob, tmp_path / "layer")
    assert sorted(os.listdir(tmp_path / "layer")) == ["kept"]
    blob.write_bytes(LayerTar().file("d/.wh..wh.plnk/1234", b"x").bytes())  # anywhere else: refused
    with pytest.raises(InvalidRequest):
        apply_layer(blob, tmp_path / "other")


# -- decompressors hold what their header asks -----------------------------------------------------
def xz_with_a_large_dictionary(tmp_path: Path, dictionary: int = 512 << 20, zeros: int = 64 << 20) -> Path:
    """A tar of one file of zeros, xz'd with a dictionary of ``dictionary`` bytes: a few KiB that
    the decoder unpacks into as much memory as it writes, up to the dictionary's size."""
    import lzma

    info = tarfile.TarInfo("zeros")
    info.size = zeros
    compressor = lzma.LZMACompressor(filters=[{"id": lzma.FILTER_LZMA2, "preset": 0, "dict_size": dictionary}])
    parts = [compressor.compress(info.tobuf())]
    parts += [compressor.compress(bytes(1 << 20)) for _ in range(zeros >> 20)]
    parts += [compressor.compress(bytes(1024)), compressor.flush()]
    path = tmp_path / "bomb.tar.xz"
    path.write_bytes(b"".join(parts))
    return path


def test_an_xz_stream_gets_the_memory_zstd_gets(tmp_path: Path) -> None:
    bomb = xz_with_a_large_dictionary(tmp_path)
    with pytest.raises(InvalidRequest) as layer:
        apply_layer(bomb, tmp_path / "layer")
    with pytest.raises(InvalidRequest) as context:
        unpack_context(bomb, tmp_path / "context", LIMITS)
    assert layer.value.status == context.value.status == 400
    assert "memory" in context.value.message.lower()
    fine = xz_with_a_large_dictionary(tmp_path, dictionary=64 << 20, zeros=1 << 20)  # xz -9's
    unpack_context(fine, tmp_path / "fine", LIMITS)
    assert (tmp_path / "fine" / "zeros").stat().st_size == 1 << 20


# -- mounts a restart keeps ------------------------------------------------------------------------
@pytest.mark.sandbox
def test_mounts_a_crash_or_an_older_version_left_get_the_untrusted_flags(e2b_env: Server) -> None:
    """A crash keeps the paused sandboxes' uppers and the sealed layers mounted, and the restart
    left a mounted layer alone: mounts an older version made without nosuid,nodev,noexec (played
    here by remounting them so) stayed that way."""
    from tests.security.test_host_side import assert_untrusted_mounts, mounts_under

    sbx = Sandbox.create(timeout=300)
    try:
        sbx.files.write("/home/user/kept.txt", "kept")
        assert sbx.pause()
        layers = e2b_env.data_dir / "fs" / "layers"
        loosened = {point: opts for point, opts in mounts_under(layers).items() if point != str(layers)}
        assert loosened
        for point, opts in loosened.items():
            kept = ",ro" if "ro" in opts else ""
            subprocess.run(["mount", "-o", f"remount,suid,dev,exec{kept}", point], check=True)
        e2b_env.restart(signal.SIGKILL)
        seen = assert_untrusted_mounts(e2b_env.data_dir)
        assert set(loosened) & set(seen)  # the same mounts, kept, now with the flags
        assert Sandbox.connect(sbx.sandbox_id).files.read("/home/user/kept.txt") == "kept"
    finally:
        sbx.kill()


def test_a_deep_tree_in_the_repository_does_not_stop_its_listings(deep_tmp: Path) -> None:
    """Whoever else writes a repository directory put a tree 1200 deep under entries/: listing
    it overflowed the stack, and every node sharing the repository failed to start."""
    repo = Repository(PosixBackend(deep_tmp / "repo"))
    ref = put_artifact(repo, "layer", "kept", empty_files(1))
    for where in ("entries/templates", "chunks/ab"):
        (deep_tmp / "repo" / where).mkdir(parents=True, exist_ok=True)
        fd = os.open(deep_tmp / "repo" / where, os.O_RDONLY | os.O_DIRECTORY)
        for _ in range(1200):  # by fds: the path would be longer than PATH_MAX
            os.mkdir("d", dir_fd=fd)
            deeper = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = deeper
        os.close(fd)
    assert repo.entries("template") == []
    assert repo.find_artifact("layer", "kept") is not None and ref.id == "kept"
    assert any(info.key.startswith("chunks/") for info in repo.backend.list("chunks/"))


def test_odd_entries_in_the_repository_are_skipped_one_by_one(tmp_path: Path) -> None:
    """An entry that is JSON but no object stopped every node sharing the repository from
    starting (AttributeError), and one file under entries/ with an odd name kept the whole
    catalogue from being read."""
    from aenv.repo.repository import ENTRY_FORMAT

    repo = Repository(PosixBackend(tmp_path / "repo"))
    good = {"format": ENTRY_FORMAT, "id": "good", "record": {}}
    repo.backend.put("entries/templates/good.json", json.dumps(good).encode())
    for n, body in enumerate((b"[]", b"7", b'"x"', b"null")):
        repo.backend.put(f"entries/templates/odd{n}.json", body)
    repo.backend.put("entries/templates/not an id!.json", json.dumps(good).encode())
    damaged: set[str] = set()
    assert [e["id"] for e in repo.entries("template", damaged)] == ["good"]
    assert damaged == {"odd0", "odd1", "odd2", "odd3"}


ILL_TYPED = [
    {"aliases": 5},
    {"aliases": [7]},
    {"name": 12},
    {"env_vars": ["A=1"]},
    {"env_vars": {"A": 1}},
    {"limits": "big"},
    {"created_at": "yesterday"},
    {"description": {"x": 1}},
    {"user": None},
]


@pytest.mark.sandbox
def test_ill_typed_repository_records_are_not_imported(api: httpx.Client, server: Server) -> None:
    """Records are imported by field names, not types: one whose aliases were a number made every
    template lookup (every create, every build FROM a template) a 500 on every node sharing the
    repository, and one with odd types broke the template listing."""
    repo = Repository(PosixBackend(server.repo_dir))
    base = base_entry(api, repo)
    names = [put_entry(repo, base, **fields) for fields in ILL_TYPED]
    after_a_while()
    try:
        for name in names:  # each create of an unknown name has the node read the repository
            r = create(api, name)
            if r.status_code == 201:
                api.delete(f"/sandboxes/{r.json()['sandboxID']}")
            assert r.status_code == 404, (name, r.text)
            assert create(api, fresh("unknown")).status_code == 404  # a lookup past every record
        r = create(api, "base")
        assert r.status_code == 201, r.text
        api.delete(f"/sandboxes/{r.json()['sandboxID']}")
        assert api.get("/templates").status_code == 200
    finally:
        ours = {name.removeprefix("repo-") for name in names}
        for info in list(repo.backend.list("entries/templates/")):
            if info.key.rsplit("/", 1)[-1][:8] in ours:
                repo.backend.remove(info.key)


# -- host writes a build makes: within the headroom --------------------------------------------------
@pytest.fixture()
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 GiB ext4 file system of its own: a node's data dir there fills the same way whatever
    else the machine's disk does."""
    disk, mountpoint = tmp_path / "disk.img", tmp_path / "mnt"
    with open(disk, "wb") as f:
        f.truncate(1 << 30)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(disk)], check=True)
    mountpoint.mkdir()
    subprocess.run(["mount", "-o", "loop", str(disk), str(mountpoint)], check=True)
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)


@pytest.mark.sandbox
def test_copies_stop_at_the_disk_headroom(registry: Registry, small_disk: Path) -> None:  # noqa: F811
    """Each COPY writes its sources again, with no look at the free space: a context of 250 MiB
    of zeros (a few hundred KiB sent) copied by N steps wrote N x 250 MiB on the host's disk."""
    env = {"AENV_BUILD_BASE": "false", "AENV_REPO": "none", "AENV_SPARE_UPPERS": "0", "AENV_DISK_HEADROOM_MB": "300"}
    srv = start_server(small_disk / "data", extra_env=env, wait_for=None)
    try:
        raw = io.BytesIO()
        with tarfile.open(fileobj=raw, mode="w|gz") as tar:
            data = f"FROM {image(registry)}\nCOPY big /a\nCOPY big /b\nCOPY big /c\n".encode()
            info = tarfile.TarInfo("Dockerfile")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            info = tarfile.TarInfo("big")
            info.size = 250 * MiB
            tar.addfile(info, io.BytesIO(bytes(info.size)))
        with srv.client() as api:
            r = api.post("/templates/build", params={"name": "copies"}, content=raw.getvalue(), timeout=600)
        last = json.loads(r.text.strip().splitlines()[-1])
        assert "error" in last and last["error"]["code"] == 507, last
        assert "COPY" in last["error"]["message"] and "nearly full" in last["error"]["message"], last
        assert os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize >= 250 * MiB
    finally:
        srv.stop()


# -- the guest bundle's mount point ----------------------------------------------------------------
@pytest.mark.sandbox
def test_an_image_s_own_aenv_is_hidden_not_followed(
    registry: Registry,  # noqa: F811
    e2b_env: Server,
    api: httpx.Client,
    canary: Path,  # noqa: F811
) -> None:
    """/.aenv is where the agent's bundle is mounted. The host looked at it in the merged root
    file system, following an image's link there (to a host path); one that led nowhere made
    every boot of the template fail (500)."""
    for target in (str(canary / "nowhere"), str(canary / "secret"), str(canary)):
        name = fresh("aenv-link")
        hostile = image(registry, LayerTar().symlink(".aenv", target))
        r = api.post("/templates/from-image", json={"name": name, "image": hostile})
        assert r.status_code == 201, (target, r.text)
        ((code, out),) = in_sandbox(name, "ls /.aenv/bin && test -d /.aenv && echo ok")
        assert code == 0 and out.endswith("ok\n"), out
        api.delete(f"/templates/{name}")
    assert untouched(canary)
