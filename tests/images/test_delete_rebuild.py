"""A template deleted, then the same recipe built again: every cached step's layer is whole (mounted
if it was not, fetched if it can be) or its step runs again; a delete, or a node killed during one,
never leaves a half-removed layer that the step cache or another template then uses.

Seen failing before the fix: Harbor 0.25 built a task FROM a local-registry image, the template was
deleted, and the next build of the same task failed with "No such file or directory:
<data>/fs/layers/<id>/upper": the step cache held a RUN step's layer whose image was not mounted,
and the WORKDIR step after it read it on the host without mounting it (here: layers unmounted by
hand, the state that build found)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, Template

from tests.conftest import API_KEY, Server, start_busybox_node
from tests.images.oci import Registry, busybox_layer, start_registry

pytestmark = pytest.mark.sandbox


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    yield from start_registry(tmp_path_factory.mktemp("registry"))


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("rebuild")
    srv = start_busybox_node(root / "data", {"AENV_REPO": str(root / "repo")})
    srv.wait_for = "bb"  # what a restart waits for
    yield srv
    srv.stop()


@pytest.fixture()
def e2b(node: Server, monkeypatch: pytest.MonkeyPatch) -> Server:
    for key, value in {"E2B_API_KEY": API_KEY, "E2B_API_URL": node.url, "E2B_SANDBOX_URL": node.url}.items():
        monkeypatch.setenv(key, value)
    return node


def recipe(registry: Registry, marker: str) -> Template:
    """FROM a registry image, a RUN, a WORKDIR that reads the layers on the host, another RUN."""
    repo = f"tests/rebuild-{marker}"
    registry.push_image(repo, "1", [(busybox_layer().dir("tmp", 0o1777).bytes(), "gzip")])
    return (
        Template()
        .from_image(f"{registry.host}/{repo}:1")
        .run_cmd(f"echo {marker} > /etc/first", user="root")
        .set_workdir("/srv/app")
        .run_cmd("echo second > /etc/second", user="root")
    )


def check(name: str, marker: str) -> None:
    sbx = Sandbox.create(template=name, timeout=60)
    try:
        assert sbx.commands.run("cat /etc/first /etc/second; pwd").stdout == f"{marker}\nsecond\n/srv/app\n"
    finally:
        sbx.kill()


def committed(node: Server, name: str) -> str:
    with node.client() as api:
        deadline = time.monotonic() + 60
        while not (got := api.get(f"/templates/{name}").json()).get("committed"):
            assert time.monotonic() < deadline, got
            time.sleep(0.3)
        return str(got["templateID"])


def layers_dir(node: Server) -> Path:
    return node.data_dir / "fs" / "layers"


def unmount_layers(node: Server) -> int:
    """Sealed layers (read-only mounts) unmounted, as that build found them; uppers stay."""
    mounted = [p for p in layers_dir(node).iterdir() if os.path.ismount(p) and os.statvfs(p).f_flag & os.ST_RDONLY]
    for path in mounted:
        subprocess.run(["umount", str(path)], check=True)
    return len(mounted)


def age_layers(node: Server) -> None:
    """Layers as old as a minute and more: the collection a delete runs spares younger ones."""
    then = time.time() - 600
    for path in layers_dir(node).iterdir():
        try:
            os.utime(path, (then, then), follow_symlinks=False)
        except OSError:  # a mounted layer's root is read-only
            pass


def delete(node: Server, template_id: str) -> None:
    age_layers(node)
    with node.client() as api:
        assert api.delete(f"/templates/{template_id}").status_code == 204


def test_a_rebuild_mounts_the_cached_layers_it_reads(registry: Registry, e2b: Server) -> None:
    name, marker = f"task-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex[:8]
    steps = recipe(registry, marker)
    Template.build(steps, name)
    assert unmount_layers(e2b) > 0
    logs: list[str] = []
    Template.build(steps, name, on_build_logs=lambda entry: logs.append(entry.message))
    assert [line for line in logs if "RUN" in line and not line.endswith("(cached)")] == [], logs
    check(name, marker)


@pytest.mark.parametrize("unmounted", [False, True], ids=["mounted", "unmounted"])
def test_a_template_deleted_then_built_again(registry: Registry, e2b: Server, unmounted: bool) -> None:
    name, marker = f"task-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex[:8]
    steps = recipe(registry, marker)
    for _ in range(3):
        Template.build(steps, name)
        check(name, marker)
        delete(e2b, committed(e2b, name))
        with e2b.client() as api:
            assert api.get(f"/templates/{name}").status_code == 404
        if unmounted:
            unmount_layers(e2b)
    Template.build(steps, name)
    check(name, marker)


def test_a_delete_while_the_same_recipe_builds(registry: Registry, e2b: Server) -> None:
    """A delete of the template, and its collection, while a build of the same recipe (every step
    cached) runs: both end well, and the new build's sandboxes have every layer."""
    name, marker = f"task-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex[:8]
    steps = recipe(registry, marker)
    Template.build(steps, name)
    template_id = committed(e2b, name)
    errors: list[BaseException] = []

    def rebuild() -> None:
        try:
            Template.build(steps, f"{name}-again")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    builder = threading.Thread(target=rebuild)
    builder.start()
    delete(e2b, template_id)
    builder.join(300)
    assert not errors, errors
    check(f"{name}-again", marker)


def test_a_node_killed_during_deletes_leaves_no_half_removed_layer(registry: Registry, e2b: Server) -> None:
    """kill -9 of the node at moments through a delete and its collection, then the states a
    removal or an eviction may be cut at: after each, a restart and a rebuild of the same recipe
    give sandboxes with every layer."""
    name, marker = f"task-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex[:8]
    steps = recipe(registry, marker)
    for delay in (0.0, 0.05, 0.2, 0.5):
        Template.build(steps, name)
        template_id = committed(e2b, name)
        age_layers(e2b)
        done = threading.Event()

        def delete_now(tid: str = template_id, finished: threading.Event = done) -> None:
            try:
                httpx.delete(f"{e2b.url}/templates/{tid}", headers={"X-API-Key": API_KEY}, timeout=30)
            except httpx.HTTPError:
                pass
            finished.set()

        threading.Thread(target=delete_now).start()
        time.sleep(delay)
        e2b.restart(signal.SIGKILL)
        done.wait(30)
        Template.build(steps, name)
        check(name, marker)

    # The states a removal or an eviction is cut at, made by hand on the stopped node: a cached
    # RUN layer whose mountpoint was renamed away (its image whole), and one whose image an
    # eviction renamed to its token, leaving the empty mountpoint.
    Template.build(steps, name)
    e2b.stop(signal.SIGKILL)
    images = sorted(p for p in layers_dir(e2b).glob("*.img") if not p.name.startswith("."))
    assert len(images) >= 2
    for image in images:
        mnt = image.with_suffix("")
        if os.path.ismount(mnt):
            subprocess.run(["umount", str(mnt)], check=True)
    first, second = images[0].with_suffix(""), images[1].with_suffix("")
    first.rename(layers_dir(e2b) / f".remove-{first.name}-abc123")
    images[1].rename(layers_dir(e2b) / f".evict-{second.name}-abc123.img")
    e2b.restart(signal.SIGKILL)
    assert not second.exists() and not list(layers_dir(e2b).glob(".remove-*"))
    Template.build(steps, name)
    check(name, marker)
