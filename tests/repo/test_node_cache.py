"""The node-local cache over the repository: commits in the background, eviction of what the
repository holds (never what is pinned or uncommitted), fetch on demand, damage reported."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.errors import ArtifactDamaged
from aenv.node import housekeeping, metrics
from aenv.node.orchestrator import Node
from aenv.node.store import TemplateRecord
from aenv.repo.backends import PosixBackend
from aenv.repo.chunks import chunk_key
from aenv.repo.repository import Repository

pytestmark = pytest.mark.sandbox  # a real node (its driver needs runsc); no sandbox is started

MiB = 2**20


@pytest.fixture()
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    settings = Settings(
        data_dir=tmp_path / "data", build_base=False, layer_cache_mb=1, repo=str(tmp_path / "repo"), repo_gc_interval=0
    )
    node = Node(settings)
    await node.start()
    yield node
    await node.stop(pause_running=False)


def digest_of(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(path).as_posix().encode() + p.read_bytes())
    return h.hexdigest()


async def fake_template(node: Node, name: str, mib: int = 2) -> TemplateRecord:
    """A template made of files only (a layer, a checkpoint image, a guest bundle): enough for
    the cache, which never looks inside them."""
    layer = node.files.layers / f"lay-{name}"
    (layer / "usr").mkdir(parents=True)
    (layer / "usr" / "blob").write_bytes(os.urandom(mib * MiB))
    image = node.files.image(f"img-{name}")
    image.mkdir()
    (image / "checkpoint.img").write_bytes(os.urandom(MiB))
    guest = node.driver.guest_path("test-guest")
    guest.mkdir(parents=True, exist_ok=True)
    (guest / ".complete").write_text("")
    rec = TemplateRecord(
        id=f"t-{name}", name=name, layers=[layer.name], image=image.name, created_at=time.time(), guest="test-guest"
    )
    node.catalogue.templates[rec.id] = rec
    await node.store.put_template(rec)
    return rec


async def test_committed_records_are_a_cache_that_comes_back(node: Node) -> None:
    rec = await fake_template(node, "cached")
    layer, image = node.files.layers / rec.layers[0], node.files.image(rec.image)
    before = (digest_of(layer), digest_of(image))

    await housekeeping.gc_files(node)
    assert layer.exists() and image.exists(), "not committed yet: the only copy is never evicted"

    await node.artifacts.wait_committed(rec)
    assert rec.committed_at > 0 and rec.commit["logical_bytes"] >= 3 * MiB
    await housekeeping.gc_files(node)
    assert not layer.exists() and not image.exists(), "over budget and held by the repository: evicted"

    fetched = metrics.REPO_FETCHES.labels(outcome="ok")._value.get()
    async with node.artifacts.using(rec), node.artifacts.using(rec):  # concurrent users share one fetch
        assert (digest_of(layer), digest_of(image)) == before
        await housekeeping.gc_files(node)
        assert layer.exists() and image.exists(), "pinned while in use"
    assert metrics.REPO_FETCHES.labels(outcome="ok")._value.get() - fetched == 2  # the layer and the image
    await housekeeping.gc_files(node)
    assert not layer.exists()


async def test_concurrent_users_join_one_fetch(node: Node) -> None:
    rec = await fake_template(node, "joined")
    await node.artifacts.wait_committed(rec)
    await housekeeping.gc_files(node)
    fetched = metrics.REPO_FETCHES.labels(outcome="ok")._value.get()

    async def use() -> str:
        async with node.artifacts.using(rec):
            return digest_of(node.files.layers / rec.layers[0])

    digests = await asyncio.gather(*(use() for _ in range(4)))
    assert len(set(digests)) == 1
    assert metrics.REPO_FETCHES.labels(outcome="ok")._value.get() - fetched == 2


async def test_a_damaged_chunk_fails_only_that_restore(node: Node, tmp_path: Path) -> None:
    rec = await fake_template(node, "damaged")
    healthy = await fake_template(node, "healthy")
    for r in (rec, healthy):
        await node.artifacts.wait_committed(r)
    await housekeeping.gc_files(node)
    repo = node.artifacts.repo
    assert repo is not None
    found = repo.find_artifact("layer", rec.layers[0])
    assert found is not None
    key = chunk_key(found[1]["chunks"][0][0])
    path = tmp_path / "repo" / key
    data = bytearray(path.read_bytes())
    data[-8] ^= 0xFF  # inside the zstd frame's payload
    path.write_bytes(bytes(data))

    with pytest.raises(ArtifactDamaged) as err:
        async with node.artifacts.using(rec):
            pytest.fail("a damaged artifact must not be used")
    assert f"template {rec.id}" in err.value.message and "corrupt" in err.value.message
    assert not (node.files.layers / rec.layers[0]).exists(), "nothing half-fetched is left to boot from"
    assert not list(node.files.layers.glob(".fetch-*")) and not list(node.files.images.glob(".fetch-*"))
    async with node.artifacts.using(healthy):  # other records are unaffected
        assert (node.files.layers / healthy.layers[0] / "usr" / "blob").stat().st_size == 2 * MiB


async def test_a_new_node_learns_the_catalogue_and_recommits_what_the_repository_lost(tmp_path: Path) -> None:
    settings = dict(build_base=False, repo=str(tmp_path / "repo"), repo_gc_interval=0)
    first = Node(Settings(data_dir=tmp_path / "a", **settings))
    await first.start()
    rec = await fake_template(first, "shared")
    await first.artifacts.wait_committed(rec)
    await first.stop(pause_running=False)

    second = Node(Settings(data_dir=tmp_path / "b", **settings))
    await second.start()
    try:
        learned = second.find_template("shared")
        assert learned.id == rec.id and learned.committed_at == pytest.approx(rec.committed_at, abs=5)
        async with second.artifacts.using(learned):
            assert (second.files.layers / rec.layers[0] / "usr" / "blob").stat().st_size == 2 * MiB
    finally:
        await second.stop(pause_running=False)

    # The repository loses the entry: the first node, which still has the files, commits it again.
    repo = second.artifacts.repo
    assert repo is not None
    repo.delete_entry("template", rec.id)
    again = Node(Settings(data_dir=tmp_path / "a", **settings))
    await again.start()
    try:
        recommitted = again.find_template("shared")
        await again.artifacts.wait_committed(recommitted)
        assert again.artifacts.repo is not None
        assert again.artifacts.repo.get_entry("template", rec.id) is not None
    finally:
        await again.stop(pause_running=False)


async def test_a_running_node_learns_what_another_committed(tmp_path: Path) -> None:
    settings = dict(build_base=False, repo=str(tmp_path / "repo"), repo_gc_interval=0)
    a, b = Node(Settings(data_dir=tmp_path / "a", **settings)), Node(Settings(data_dir=tmp_path / "b", **settings))
    await a.start()
    await b.start()
    try:
        rec = await fake_template(a, "later")
        await a.artifacts.wait_committed(rec)
        assert b.catalogue.source("later") is None
        assert await b.artifacts.refresh_catalogue() == 1
        assert b.find_template("later").id == rec.id
        assert await b.artifacts.refresh_catalogue() == 0  # rate-limited: no listing storm on typos
    finally:
        await a.stop(pause_running=False)
        await b.stop(pause_running=False)


async def test_the_api_of_any_node_finds_what_another_committed(tmp_path: Path) -> None:
    """A gateway sends a request naming a template or snapshot (and their lists) to any node: one
    that has not learned it yet looks in the repository first, by id or by name, and answers as
    the node that made it would. Seen failing: a public template made on one node was a 404 from
    the other until a create there named it."""
    import httpx

    from aenv.api.app import build
    from aenv.node.store import SnapshotRecord

    settings = dict(build_base=False, repo=str(tmp_path / "repo"), repo_gc_interval=0)
    a, b = Node(Settings(data_dir=tmp_path / "a", **settings)), Node(Settings(data_dir=tmp_path / "b", **settings))
    await a.start()
    await b.start()
    key = "e2b_" + "1" * 40
    try:
        rec = await fake_template(a, "made-on-a")
        snap = SnapshotRecord(
            id="snap_" + "ab" * 8,
            name="snap-on-a",
            layers=rec.layers,
            image=rec.image,
            created_at=time.time(),
            guest=rec.guest,
            sandbox_id="gone" + "0" * 16,
            template_id=rec.id,
        )
        a.catalogue.snapshots[snap.id] = snap
        await a.store.put_snapshot(snap)
        await a.artifacts.wait_committed(rec)
        await a.artifacts.wait_committed(snap)
        app = build(b, key, start_node=False)
        headers = {"X-API-Key": key}
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://b", headers=headers
        ) as api:
            # By id even just after a full listing (the entry is read), by name at the next listing.
            for ref, listed_at in ((rec.id, time.monotonic()), ("made-on-a", 0.0)):
                b.artifacts._refreshed = listed_at
                got = await api.get(f"/templates/{ref}")
                assert got.status_code == 200 and got.json()["templateID"] == rec.id, got.text
                b.catalogue.templates.pop(rec.id)  # forgotten again, for the next way of naming it
            b.artifacts._refreshed = 0.0
            listed = await api.get("/templates")
            assert rec.id in [t["templateID"] for t in listed.json()], listed.text
            got = await api.get(f"/snapshots/{snap.id}")
            assert got.status_code == 200 and got.json()["snapshotID"] == snap.id, got.text
            missing = await api.get("/templates/never-made")
            assert missing.status_code == 404 and missing.json()["code"] == 404, missing.text
    finally:
        await a.stop(pause_running=False)
        await b.stop(pause_running=False)


async def test_a_record_lost_everywhere_is_removed_not_kept_broken(tmp_path: Path) -> None:
    settings = dict(build_base=False, layer_cache_mb=0, repo_gc_interval=0)
    node = Node(Settings(data_dir=tmp_path / "a", repo=str(tmp_path / "repo-1"), **settings))
    await node.start()
    kept, lost = await fake_template(node, "kept", mib=1), await fake_template(node, "lost", mib=1)
    for rec in (kept, lost):
        await node.artifacts.wait_committed(rec)
    await housekeeping.gc_files(node)  # budget 0: both evicted, the repository holds them
    await node.stop(pause_running=False)
    # The node comes back on another repository that has only one of them.
    shutil.copytree(tmp_path / "repo-1", tmp_path / "repo-2")
    Repository(PosixBackend(tmp_path / "repo-2")).delete_entry("template", lost.id)
    again = Node(Settings(data_dir=tmp_path / "a", repo=str(tmp_path / "repo-2"), **settings))
    await again.start()
    try:
        assert {t.name for t in again.templates.values()} == {"kept"}
        async with again.artifacts.using(again.find_template("kept")):
            pass
    finally:
        await again.stop(pause_running=False)


async def test_guest_bundles_no_record_names_are_removed(node: Node) -> None:
    rec = await fake_template(node, "named")  # names the bundle "test-guest"
    current = node.driver.guest_key()
    node.driver.guest_bundle()  # the current one exists
    then = time.time() - 3600
    for key in ("old-unused", "young-unused"):
        path = node.driver.guest_path(key)
        path.mkdir()
        (path / ".complete").write_text(key)
        if key == "old-unused":
            os.utime(path, (then, then))
    os.utime(node.driver.guest_path(rec.guest), (then, then))
    os.utime(node.driver.guest_path(current), (then, then))

    await housekeeping.gc_files(node, min_age=60)
    assert node.driver.guest_keys() == {current, rec.guest, "young-unused"}  # an upgrade's old agent goes
    assert not any(p.name.startswith(".evict-") for p in node.driver.guest_path("x").parent.iterdir())

    del node.catalogue.templates[rec.id]
    await node.store.delete_template(rec.id)
    await housekeeping.gc_files(node)
    assert node.driver.guest_keys() == {current}  # never the bundle fresh boots use


async def test_a_record_deleted_here_is_not_learnt_back_while_its_entry_lingers(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A template deleted while its commit is under way keeps its entry until the commit ends, and
    a repository read begun before a delete still lists it: a create or lookup that refreshes the
    catalogue meanwhile must not bring the record back (CI saw `GET /templates/cat` answer 200
    right after its delete). Here the entry's delete is held back; the node deleted the record."""
    rec = await fake_template(node, "lingers")
    await node.artifacts.wait_committed(rec)
    repo = node.artifacts.repo
    assert repo is not None
    monkeypatch.setattr(repo, "delete_entry", lambda kind, entry_id: None)  # the entry lingers
    await node.drop_template(rec)
    assert repo.get_entry("template", rec.id) is not None
    assert await node.artifacts.refresh_catalogue(rec.id) == 0  # by id: read at once
    assert await node.artifacts.refresh_catalogue() == 0  # the whole listing
    assert node.catalogue.source("lingers") is None and rec.id not in node.templates
