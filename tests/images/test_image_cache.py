"""Image templates as a cache (aenv/node/imagecache.py), on a real node with made-up files: on a
node without a repository the budget evicts image templates whole, least recently used first,
never one in use, a shared base layer only once no image on it is kept; what is evicted is
remembered so the next create makes it again under the same id. End to end with a registry and
sandboxes: test_image_budget.py.

Seen failing before the change (the first two tests): a template's layers were never evicted
whatever the budget, so every image stayed."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.node import housekeeping, imagecache
from aenv.node.orchestrator import Node
from aenv.node.sandbox import LiveSandbox
from aenv.node.store import SandboxRecord, SnapshotRecord, TemplateRecord

pytestmark = pytest.mark.sandbox  # a real node (its driver needs runsc), no sandbox started

MiB = 2**20


@pytest.fixture()
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    settings = Settings(
        data_dir=tmp_path / "data", build_base=False, layer_cache_mb=10, layer_cache_low_ratio=0.7, repo="none"
    )
    node = Node(settings)
    await node.start()
    yield node
    await node.stop(pause_running=False)


def write_layer(node: Node, layer_id: str, mib: float) -> None:
    path = node.files.layers / layer_id
    if not path.exists():
        path.mkdir()
        (path / "blob").write_bytes(os.urandom(int(mib * MiB)))


async def image_template(node: Node, name: str, age_s: float, task_mib: float = 1.0) -> TemplateRecord:
    """An image template as a create makes it: a shared base layer (2 MiB), a task layer, its
    conventions layer and a checkpoint image (1 MiB), last used ``age_s`` ago."""
    digest = "sha256:" + name.encode().hex().ljust(64, "0")[:64]
    write_layer(node, "oci-base", 2)
    write_layer(node, f"oci-task-{name}", task_mib)
    write_layer(node, f"conv-{name}", 0.01)
    image = node.files.image(f"img-{name}")
    image.mkdir()
    (image / "pages.img").write_bytes(os.urandom(MiB))
    then = time.time() - age_s
    for path in (image, node.files.layers / f"oci-task-{name}", node.files.layers / f"conv-{name}"):
        os.utime(path, (then, then))  # restores touch every layer of the template they use
    rec = TemplateRecord(
        id=f"id-{name}",
        name=imagecache.digest_name(digest),
        layers=["oci-base", f"oci-task-{name}", f"conv-{name}"],
        image=image.name,
        created_at=then,
        image_ref=f"registry.test/swe/{name}:latest",
        image_digest=digest,
        image_layers={"oci-base": 2 * MiB, f"oci-task-{name}": int(task_mib * MiB)},
        aliases=[f"registry.test/swe/{name}:latest"],
    )
    await node.add_template(rec)
    return rec


def local(node: Node) -> set[str]:
    return {t.id for t in node.templates.values() if t.image_digest}


async def test_image_templates_go_whole_lru_and_one_in_use_stays(node: Node) -> None:
    recs = {n: await image_template(node, n, age_s=500 - 100 * i) for i, n in enumerate("abcde")}
    # a: the oldest, but a sandbox runs on it; b: a restore has it pinned; c: a snapshot was made from it
    sb = SandboxRecord(id="sbx-a", template_id=recs["a"].name, started_at=0, end_at=0, layers=recs["a"].layers)
    node.sandboxes[sb.id] = LiveSandbox(sb)
    node.artifacts.pin([*recs["b"].layers, recs["b"].image])
    c = recs["c"]
    snap = SnapshotRecord(
        id="snap-c", name="", sandbox_id="", template_id=c.name, layers=c.layers, image="", created_at=1
    )
    node.catalogue.snapshots[snap.id] = snap
    try:
        await housekeeping.gc_files(node, min_age=60)
    finally:
        del node.sandboxes[sb.id]
        node.artifacts.unpin([*recs["b"].layers, recs["b"].image])
        del node.catalogue.snapshots[snap.id]

    # 2 base + 5 x (1 task + 1 image) = 12 MiB > 10: d (the oldest unused) goes, then 10 > 7: e
    assert local(node) == {"id-a", "id-b", "id-c"}
    layers = node.files.layer_ids()
    assert {"oci-task-d", "oci-task-e", "conv-d", "conv-e"}.isdisjoint(layers)
    assert {"oci-base", "oci-task-a", "conv-a"} <= layers
    assert not node.files.image(recs["d"].image).exists()
    evicted = await imagecache.evicted_images(node).entries()
    assert {e.id for e in evicted.values()} == {"id-d", "id-e"}
    found = await imagecache.evicted_images(node).find("registry.test/swe/d:latest")
    assert found is not None and found.id == "id-d" and found.name == recs["d"].name
    assert await imagecache.evicted_images(node).find(recs["e"].name) is evicted[recs["e"].image_digest]

    # Under budget (8 MiB) the next pass keeps them; with a budget of 1 MiB and nothing in use
    # they go too, and with the last image on it the base.
    await housekeeping.gc_files(node, min_age=60)
    assert local(node) == {"id-a", "id-b", "id-c"}
    node.settings.layer_cache_mb = 1
    await housekeeping.gc_files(node, min_age=60)
    assert local(node) == set()
    assert not {x for x in node.files.layer_ids() if x.startswith(("oci-", "conv-"))}
    assert len(await imagecache.evicted_images(node).entries()) == 5


async def test_a_base_layer_stays_while_an_image_on_it_is_kept(node: Node) -> None:
    old = await image_template(node, "old", age_s=900, task_mib=3)
    await image_template(node, "new", age_s=10, task_mib=3)
    write_layer(node, "oci-stray", 3)  # a pulled layer no image names, used long ago
    os.utime(node.files.layers / "oci-stray", (time.time() - 2000,) * 2)
    # 2 base + 2 x 4 + 3 stray = 13 > 10: the stray goes first (oldest), then the old image (its
    # task layer with it) down to 7; the base stays: the new image is on it.
    await housekeeping.gc_files(node, min_age=0)
    assert local(node) == {"id-new"}
    assert {"oci-base", "oci-task-new"} <= node.files.layer_ids()
    assert {"oci-stray", "oci-task-old", f"conv-{old.name}"}.isdisjoint(node.files.layer_ids())


async def test_templates_named_by_a_person_or_with_a_pool_are_kept(node: Node) -> None:
    named = await image_template(node, "named", age_s=900, task_mib=4)
    named.name = "my-env"  # aenv build --image REF --name my-env
    pooled = await image_template(node, "pooled", age_s=800, task_mib=4)
    node.warm.sizes[pooled.name] = 1
    try:
        await housekeeping.gc_files(node, min_age=60)
    finally:
        node.warm.sizes.pop(pooled.name, None)
    assert local(node) == {"id-named", "id-pooled"}
    assert await imagecache.evicted_images(node).entries() == {}


async def test_with_a_repository_files_go_and_records_stay(tmp_path: Path) -> None:
    """With a repository an image template is committed and its files are a cache of it, evicted
    one by one and fetched back (aenv/node/artifacts.py): the record is never dropped."""
    settings = Settings(
        data_dir=tmp_path / "data", build_base=False, layer_cache_mb=1, repo=str(tmp_path / "repo"), repo_gc_interval=0
    )
    node = Node(settings)
    await node.start()
    try:
        rec = await image_template(node, "committed", age_s=100)
        await node.artifacts.wait_committed(rec)
        await housekeeping.gc_files(node)
        assert local(node) == {"id-committed"} and not node.files.image(rec.image).exists()
        assert await imagecache.evicted_images(node).entries() == {}
        async with node.artifacts.using(rec):
            assert node.files.image(rec.image).exists()
    finally:
        await node.stop(pause_running=False)
