"""E2B's volumes with the E2B SDK's own calls: made, listed and deleted; their content read and
written through the content API; mounted into sandboxes, shared live between them, there after a
pause and in a fork's child; and a sandbox's links in a volume never followed by the host.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, Volume
from e2b.exceptions import NotFoundException, VolumeException

from aenv.errors import Conflict
from aenv.volumes.files import USER, VolumeFiles
from tests import disk
from tests.conftest import API_KEY, DATA_DIR, Server, start_busybox_node

pytestmark = [pytest.mark.sandbox, pytest.mark.fast]  # the fast tier runs it on the fake runtime


@pytest.fixture()
def vol_env(e2b_env: Server, monkeypatch: pytest.MonkeyPatch) -> Server:
    monkeypatch.setenv("E2B_VOLUME_API_URL", e2b_env.url)  # the SDK's content calls go to the node too
    return e2b_env


@pytest.fixture()
def volume(vol_env: Server) -> Iterator[Volume]:
    vol = Volume.create(f"v-{secrets.token_hex(4)}")
    yield vol
    Volume.destroy(vol.volume_id)


def run(sbx: Sandbox, cmd: str) -> str:
    result = sbx.commands.run(cmd)
    assert result.exit_code == 0, result.stderr
    return result.stdout


def test_volumes_are_made_listed_read_and_deleted_with_the_sdk(vol_env: Server, api: httpx.Client) -> None:
    name = f"data-{secrets.token_hex(3)}"
    vol = Volume.create(name)
    try:
        assert vol.name == name and vol.volume_id
        assert name in [v.name for v in Volume.list()]
        again = Volume.get_info(vol.volume_id)
        assert again.volume_id == vol.volume_id and again.name == name
        dup = api.post("/volumes", json={"name": name})
        assert dup.status_code == 409 and name in dup.json()["message"]
        vol.write_file("/notes/a.txt", b"hello", force=True)
        assert vol.read_file("/notes/a.txt", format="bytes") == b"hello"
        vol.make_dir("/deep/er/dir", force=True)
        entries = {e.path: e for e in vol.list("/", depth=3)}
        assert {"/notes", "/notes/a.txt", "/deep", "/deep/er", "/deep/er/dir"} <= set(entries)
        assert entries["/notes/a.txt"].size == 5 and entries["/notes/a.txt"].type.value == "file"
        assert vol.exists("/notes/a.txt") and not vol.exists("/nope")
        changed = vol.update_metadata("/notes/a.txt", mode=0o600)
        assert changed.mode == 0o600
        vol.remove("/notes")
        assert not vol.exists("/notes/a.txt")
    finally:
        assert Volume.destroy(vol.volume_id) is True
    assert Volume.destroy(vol.volume_id) is False
    with pytest.raises(NotFoundException):
        Volume.get_info(vol.volume_id)


def test_without_force_an_entry_already_there_is_a_409_and_stays_as_it_was(vol_env: Server, volume: Volume) -> None:
    """E2B's ``force`` (its volume service, and its SDK tests' mock): a write or a directory where
    something already is answers 409 (the SDK's VolumeException) without it, and changes nothing;
    with it, a file is replaced and a directory there answered as it is. Neither makes parents
    without it (404)."""
    volume.write_file("/a.txt", b"first")
    with pytest.raises(VolumeException):
        volume.write_file("/a.txt", b"second")
    assert volume.read_file("/a.txt") == "first"
    volume.write_file("/a.txt", b"second", force=True)
    assert volume.read_file("/a.txt") == "second"
    put = httpx.put(
        f"{vol_env.url}/volumecontent/{volume.volume_id}/file",
        params={"path": "/a.txt"},
        content=b"third",
        headers={"Authorization": f"Bearer {volume.token}"},
    )
    assert put.status_code == 409 and "already exists" in put.json()["message"]
    volume.make_dir("/d", mode=0o750)
    with pytest.raises(VolumeException):
        volume.make_dir("/d")
    with pytest.raises(VolumeException):
        volume.make_dir("/a.txt", force=True)  # a file there, force or not
    assert volume.make_dir("/d", force=True, mode=0o700).mode == 0o750  # as it is, unchanged
    with pytest.raises(NotFoundException):
        volume.write_file("/no/such/x.txt", b"x")
    with pytest.raises(NotFoundException):
        volume.make_dir("/no/such")
    assert sorted(e.name for e in volume.list("/")) == ["a.txt", "d"]  # no temporary file left


def test_a_write_without_force_keeps_what_appeared_while_its_body_was_read(tmp_path: Path) -> None:
    """The check before the body is read is done again when the file is put in place: something
    made there meanwhile (by a sandbox that mounts the volume) is kept, the write a 409."""
    files = VolumeFiles(tmp_path)
    parent, fd, temp, name, parts = files.begin_write("/late.txt", owner=USER, mode=None, force=False)
    os.write(fd, b"from the api")
    (tmp_path / "late.txt").write_bytes(b"from a sandbox")
    with pytest.raises(Conflict):
        files.finish_write(parent, fd, temp, name, parts, force=False)
    assert (tmp_path / "late.txt").read_bytes() == b"from a sandbox"
    assert [p.name for p in tmp_path.iterdir()] == ["late.txt"]  # no temporary file left
    parent, fd, temp, name, parts = files.begin_write("/new.txt", owner=USER, mode=None, force=False)
    os.write(fd, b"new")
    assert files.finish_write(parent, fd, temp, name, parts, force=False)["size"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["late.txt", "new.txt"]


def test_bad_names_paths_and_tokens_are_clear_errors(vol_env: Server, api: httpx.Client, volume: Volume) -> None:
    for name in ("", "-x", "a/b", "x" * 200, "a b"):
        assert api.post("/volumes", json={"name": name}).status_code == 400, name
    for path in ("relative", "/", "/proc/x", "/.aenv", "/a/../b"):
        r = api.post("/sandboxes", json={"volumeMounts": [{"name": volume.name, "path": path}]})
        assert r.status_code == 400, (path, r.text)
    missing = api.post("/sandboxes", json={"volumeMounts": [{"name": "no-such-volume", "path": "/mnt/x"}]})
    assert missing.status_code == 404 and "no-such-volume" in missing.json()["message"]
    overlap = [{"name": volume.name, "path": "/mnt/a"}, {"name": volume.name, "path": "/mnt/a/b"}]
    assert api.post("/sandboxes", json={"volumeMounts": overlap}).status_code == 400
    base = f"{vol_env.url}/volumecontent/{volume.volume_id}/path"
    assert httpx.get(base, params={"path": "/"}).status_code == 401  # neither token nor key
    wrong = httpx.get(base, params={"path": "/"}, headers={"Authorization": "Bearer not-the-token"})
    assert wrong.status_code == 404
    other = Volume.create(f"other-{secrets.token_hex(3)}")
    try:
        crossed = httpx.get(base, params={"path": "/"}, headers={"Authorization": f"Bearer {other.token}"})
        assert crossed.status_code == 404
    finally:
        Volume.destroy(other.volume_id)
    ok = httpx.get(base, params={"path": "/"}, headers={"Authorization": f"Bearer {volume.token}"})
    assert ok.status_code == 200 and ok.json()["type"] == "directory"
    token = {"Authorization": f"Bearer {volume.token}"}
    for bad in ("/../../etc/passwd", "/a/../../x"):
        assert httpx.get(base, params={"path": bad}, headers=token).status_code == 400


def test_a_volume_is_shared_live_kept_through_a_pause_and_mounted_by_forks(
    vol_env: Server, api: httpx.Client, volume: Volume
) -> None:
    volume.write_file("/from-api.txt", b"seeded")
    one = Sandbox.create(timeout=120, volume_mounts={"/mnt/data": volume})
    two = Sandbox.create(timeout=120, volume_mounts={"/work/shared": volume.name})
    try:
        info = Sandbox.get_info(one.sandbox_id)
        assert [(m["name"], m["path"]) for m in info.volume_mounts] == [(volume.name, "/mnt/data")]
        assert run(one, "cat /mnt/data/from-api.txt") == "seeded"
        run(one, "echo from-one > /mnt/data/one.txt && id -u > /mnt/data/uid")
        assert run(two, "cat /work/shared/one.txt") == "from-one\n"  # live, no pause between
        assert volume.read_file("/one.txt") == "from-one\n"
        assert volume.read_file("/uid").strip() == run(one, "id -u").strip()  # the sandbox's user writes it
        one.beta_pause()
        run(two, "echo meanwhile > /work/shared/while-paused.txt")
        resumed = Sandbox.connect(one.sandbox_id, timeout=120)
        assert run(resumed, "cat /mnt/data/while-paused.txt") == "meanwhile\n"
        children = api.post(f"/sandboxes/{one.sandbox_id}/fork", json={"count": 1})
        assert children.status_code == 201, children.text
        child_id = children.json()[0]["sandbox"]["sandboxID"]
        child = Sandbox.connect(child_id)
        run(child, "echo from-child > /mnt/data/child.txt")
        assert run(two, "cat /work/shared/child.txt") == "from-child\n"
        in_use = api.delete(f"/volumes/{volume.volume_id}")
        assert in_use.status_code == 409 and "mounted" in in_use.json()["message"]
        child.kill()
    finally:
        one.kill()
        two.kill()


def test_a_fork_may_give_each_child_its_own_copy_of_the_volumes(
    vol_env: Server, api: httpx.Client, volume: Volume
) -> None:
    """``volumes: "clone"``: each child mounts copies (``<name>-<child id>``) of the source's
    volumes as they were at the fork; no child sees another's writes, nor the source's after."""
    volume.write_file("/seed.txt", b"seeded")
    other = Volume.create(f"o-{secrets.token_hex(4)}")
    src = Sandbox.create(timeout=180, volume_mounts={"/mnt/data": volume, "/mnt/other": other})
    children: list[Sandbox] = []
    copies: list[str] = []
    try:
        run(src, "echo before > /mnt/data/state.txt && ln -s /etc/passwd /mnt/data/link && mkfifo /mnt/data/fifo")
        run(src, "echo o > /mnt/other/o.txt")
        assert api.post(f"/sandboxes/{src.sandbox_id}/fork", json={"volumes": "copy"}).status_code == 400
        r = api.post(f"/sandboxes/{src.sandbox_id}/fork", json={"count": 3, "volumes": "clone"})
        assert r.status_code == 201, r.text
        children = [Sandbox.connect(item["sandbox"]["sandboxID"]) for item in r.json()]
        for i, child in enumerate(children):
            mounts = {m["path"]: m["name"] for m in Sandbox.get_info(child.sandbox_id).volume_mounts}
            assert mounts == {
                "/mnt/data": f"{volume.name}-{child.sandbox_id}",
                "/mnt/other": f"{other.name}-{child.sandbox_id}",
            }
            copies += list(mounts.values())
            assert run(child, "cat /mnt/data/state.txt /mnt/data/seed.txt /mnt/other/o.txt") == "before\nseededo\n"
            assert run(child, "readlink /mnt/data/link; test -p /mnt/data/fifo && echo fifo") == "/etc/passwd\nfifo\n"
            run(child, f"echo child-{i} > /mnt/data/state.txt && echo {i} > /mnt/data/mine-{i}")
        run(src, "echo after > /mnt/data/state.txt")
        children[0].beta_pause()  # a child's copy is its volume: a resume mounts it again
        children[0] = Sandbox.connect(children[0].sandbox_id)
        for i, child in enumerate(children):
            assert run(child, "cat /mnt/data/state.txt; ls /mnt/data | grep -c mine-") == f"child-{i}\n1\n"
        assert volume.read_file("/state.txt") == "after\n" and not volume.exists("/mine-0")
        # the copies are volumes like any other: listed, read through the content API with their tokens
        listed = {v.name: v.volume_id for v in Volume.list()}
        assert set(copies) <= set(listed)
        first = api.get(f"/volumes/{listed[copies[0]]}").json()
        body = httpx.get(
            f"{vol_env.url}/volumecontent/{first['volumeID']}/file",
            params={"path": "/state.txt"},
            headers={"Authorization": f"Bearer {first['token']}"},
        )
        assert body.status_code == 200 and body.text == "child-0\n"
        # a child's own fork copies its copies (names cut to 128)
        again = api.post(f"/sandboxes/{children[1].sandbox_id}/fork", json={"count": 1, "volumes": "clone"})
        assert again.status_code == 201, again.text
        grandchild = again.json()[0]["sandbox"]["sandboxID"]
        mine = {m["path"]: m["name"] for m in Sandbox.get_info(grandchild).volume_mounts}
        parent = {m["path"]: m["name"] for m in Sandbox.get_info(children[1].sandbox_id).volume_mounts}
        assert mine == {path: f"{name[: 127 - len(grandchild)]}-{grandchild}" for path, name in parent.items()}
        assert run(Sandbox.connect(grandchild), "cat /mnt/data/state.txt") == "child-1\n"
        api.delete(f"/sandboxes/{grandchild}")
    finally:
        for sbx in (*children, src):
            sbx.kill()
        listed = {v.name: v.volume_id for v in Volume.list()}
        for name in listed:
            if name.startswith((f"{volume.name}-", f"{other.name}-")):
                Volume.destroy(listed[name])
        Volume.destroy(other.volume_id)


def test_links_a_sandbox_leaves_in_a_volume_are_never_followed_by_the_host(vol_env: Server, volume: Volume) -> None:
    sbx = Sandbox.create(timeout=120, volume_mounts={"/mnt/v": volume})
    try:
        run(sbx, "ln -s /etc/hostname /mnt/v/file-link && ln -s / /mnt/v/root-link && mkdir /mnt/v/d")
        run(sbx, "ln -s /etc /mnt/v/d/etc-link")
    finally:
        sbx.kill()
    listed = {e.path: e for e in volume.list("/", depth=2)}
    assert listed["/file-link"].type.value == "symlink" and listed["/file-link"].target == "/etc/hostname"
    headers = {"Authorization": f"Bearer {volume.token}"}
    base = f"{vol_env.url}/volumecontent/{volume.volume_id}"
    for path in ("/file-link", "/root-link/etc/hostname", "/d/etc-link/passwd"):
        r = httpx.get(f"{base}/file", params={"path": path}, headers=headers)
        assert r.status_code == 400, (path, r.status_code, r.text[:200])
        assert "root:" not in r.text
    # a write through a link is refused; one at the link's own name is a 409 (something is there)
    # without force, and replaces the link with it
    through = httpx.put(f"{base}/file", params={"path": "/root-link/tmp/x"}, content=b"x", headers=headers)
    assert through.status_code == 400
    kept = httpx.put(f"{base}/file", params={"path": "/file-link"}, content=b"mine", headers=headers)
    assert kept.status_code == 409
    params = {"path": "/file-link", "force": "true"}
    replaced = httpx.put(f"{base}/file", params=params, content=b"mine", headers=headers)
    assert replaced.status_code == 201 and replaced.json()["type"] == "file"
    assert volume.read_file("/file-link") == "mine"
    with open("/etc/hostname", "rb") as f:
        assert f.read() != b"mine"
    patched = httpx.patch(f"{base}/path", params={"path": "/d/etc-link"}, json={"mode": 0o777}, headers=headers)
    assert patched.status_code == 400


@pytest.fixture(scope="module")
def small_volumes_node() -> Iterator[Server]:
    """A busybox node (template `bb`) whose volumes are 64 MiB each."""
    data = Path(f"{DATA_DIR}-small-volumes")
    disk.release(data)  # its template is made again
    srv = start_busybox_node(data, {"AENV_VOLUME_SIZE_MB": "64"})
    yield srv
    srv.stop()
    disk.release(data)


@pytest.mark.root  # the size limit is an ext4 image's: loop mounts need root
def test_a_full_volume_is_enospc_inside_and_a_507_outside_never_the_hosts_disk(
    small_volumes_node: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = small_volumes_node
    for name, value in (("E2B_API_KEY", API_KEY), ("E2B_API_URL", node.url), ("E2B_SANDBOX_URL", node.url)):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("E2B_VOLUME_API_URL", node.url)
    vol = Volume.create("small")
    sbx = Sandbox.create("bb", timeout=120, volume_mounts={"/mnt/v": vol})
    try:
        out = sbx.commands.run("dd if=/dev/zero of=/mnt/v/big bs=1M count=100 2>&1; echo rc=$?")
        assert "No space left on device" in out.stdout and "rc=1" in out.stdout, out.stdout
        run(sbx, "rm /mnt/v/big && echo ok > /mnt/v/small.txt")  # room again once freed
        big = httpx.put(
            f"{node.url}/volumecontent/{vol.volume_id}/file",
            params={"path": "/api-big"},
            content=b"\0" * (100 << 20),
            headers={"Authorization": f"Bearer {vol.token}"},
            timeout=120,
        )
        assert big.status_code == 507 and "full" in big.json()["message"]
        assert not vol.exists("/api-big")  # nothing half-written left
        assert vol.read_file("/small.txt") == "ok\n"
    finally:
        sbx.kill()
        Volume.destroy(vol.volume_id)
