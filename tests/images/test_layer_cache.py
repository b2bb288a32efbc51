"""The layer cache budget: least recently used first, never a layer in use, step cache kept in sync."""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.node import housekeeping
from aenv.node.orchestrator import Node
from aenv.node.store import TemplateRecord

pytestmark = pytest.mark.sandbox  # a real node (its driver needs runsc), no sandbox started

MiB = 2**20


@pytest.fixture()
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    settings = Settings(data_dir=tmp_path / "data", build_base=False, layer_cache_mb=10, layer_cache_low_ratio=0.7)
    node = Node(settings)
    await node.start()
    yield node
    await node.stop(pause_running=False)


def fake_layer(node: Node, layer_id: str, mib: int, age_s: float) -> None:
    path = node.files.layers / layer_id
    path.mkdir()
    (path / "blob").write_bytes(os.urandom(mib * MiB))
    then = time.time() - age_s
    os.utime(path, (then, then))


async def test_eviction_is_lru_and_spares_layers_in_use(node: Node) -> None:
    fake_layer(node, "oci-oldest", 3, age_s=500)
    fake_layer(node, "oci-inuse", 3, age_s=400)  # the oldest of all after this one, but a template names it
    fake_layer(node, "oci-middle", 3, age_s=300)
    fake_layer(node, "step-layer", 3, age_s=200)
    fake_layer(node, "oci-newest", 3, age_s=100)
    fake_layer(node, "orphan-upper", 1, age_s=1000)  # neither cached nor named: plain garbage
    await node.store.set_meta("build-cache", json.dumps({"k1": "step-layer", "k2": "oci-middle"}))
    template = TemplateRecord(id="t1", name="t", layers=["oci-inuse"], image="", created_at=time.time())
    node.catalogue.templates[template.id] = template

    await housekeeping.gc_files(node, min_age=60)

    left = node.files.layer_ids()
    # 15 MiB cached > 10 high; the oldest unused go first until <= 7: oldest, middle, step-layer.
    assert left == {"oci-inuse", "oci-newest"}
    assert json.loads(await node.store.get_meta("build-cache") or "{}") == {}


async def test_under_budget_nothing_cached_goes(node: Node) -> None:
    fake_layer(node, "oci-a", 2, age_s=500)
    fake_layer(node, "oci-b", 2, age_s=400)
    await housekeeping.gc_files(node, min_age=60)
    assert node.files.layer_ids() == {"oci-a", "oci-b"}
