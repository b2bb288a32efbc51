"""A disk budget across many images, end to end: a real registry (Debian's docker-registry) behind a
counting proxy serving images shaped like SWE-bench's (a shared base, a layer per repository, a
layer per task), a busybox node without a repository and a small AENV_LAYER_CACHE_MB, real runsc
sandboxes, the E2B SDK and the CLI. Images are evicted least recently used first, never one in
use, and made again under the same template id by their next create; GET /images, /metrics and
`aenv images` show what sharing saves; a prefetch makes images ahead of their creates.

Seen failing before the change, every test here: no image was ever evicted (the node kept all of
them over its budget), and GET /images, POST /images/prefetch were 404s."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import Sandbox
from typer.testing import CliRunner

from aenv.cli.main import app
from tests.conftest import API_KEY, Server, e2b_client, start_busybox_node
from tests.images.oci import LayerTar, Registry, busybox_layer, start_registry
from tests.images.test_create_from_image import CountingProxy, blobs_of

pytestmark = pytest.mark.sandbox
MiB = 1 << 20
BUDGET_MB = 80  # the fixed part (busybox, the base, a repository layer) and ~3 images of ~22 MB each
BASE = busybox_layer().file("opt/conda/base.bin", os.urandom(3 * MiB)).bytes()
REPO = LayerTar().dir("repo").file("repo/astropy.bin", os.urandom(MiB)).bytes()


@dataclass
class Setup:
    node: Server
    registry: Registry
    proxy: CountingProxy


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    registry_gen = start_registry(tmp_path_factory.mktemp("registry"))
    registry = next(registry_gen)
    proxy = CountingProxy(registry)
    env = {"AENV_LAYER_CACHE_MB": str(BUDGET_MB), "AENV_SPARE_UPPERS": "0"}
    node = None
    try:
        node = start_busybox_node(tmp_path_factory.mktemp("node") / "data", env)
        yield Setup(node, registry, proxy)
    finally:
        if node is not None:
            node.stop()
        proxy.close()
        next(registry_gen, None)


@pytest.fixture()
def api(setup: Setup, monkeypatch: pytest.MonkeyPatch) -> Iterator[httpx.Client]:
    yield from e2b_client(setup.node, monkeypatch, empty_after=True)


def task_image(setup: Setup, task: str, task_mib: int = 6) -> tuple[str, str]:
    """``swebench/sweb.eval.x86_64.<task>:latest`` through the proxy: (reference, digest)."""
    layer = LayerTar().dir("testbed").file("testbed/task.txt", f"{task}\n".encode())
    layer.file("testbed/data.bin", os.urandom(task_mib * MiB))
    name = f"swebench/sweb.eval.x86_64.{task}"
    digest = setup.registry.push_image(name, "latest", [(BASE, "gzip"), (REPO, "gzip"), (layer.bytes(), "gzip")])
    return f"{setup.proxy.host}/{name}:latest", digest


def images_by_digest(api: httpx.Client) -> dict[str, dict[str, Any]]:
    r = api.get("/images")
    assert r.status_code == 200, r.text
    return {row["digest"]: row for row in r.json()}


def gauge(api: httpx.Client, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", api.get("/metrics").text, re.M)
    assert found, name
    return float(found.group(1))


def wait_for(check: Any, what: str, seconds: float = 30) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    pytest.fail(f"not within {seconds:g} s: {what}")


def test_images_are_evicted_lru_never_in_use_and_made_again_with_their_id(setup: Setup, api: httpx.Client) -> None:
    images = [task_image(setup, f"astropy__astropy-{n}") for n in (12907, 13033, 13236, 13398, 13453)]
    first = api.post("/sandboxes", json={"templateID": images[0][0], "timeout": 300})
    assert first.status_code == 201, first.text  # the oldest image, kept running: in use
    for ref, _ in images[1:]:
        r = api.post("/sandboxes", json={"templateID": ref, "timeout": 60})
        assert r.status_code == 201, r.text
        api.delete(f"/sandboxes/{r.json()['sandboxID']}")
    rows = images_by_digest(api)  # local or evicted, each still names its template
    made = {d: rows[d]["templateID"] for _, d in images}
    wait_for(lambda: any(images_by_digest(api)[d]["state"] == "evicted" for _, d in images), "an eviction")
    # An image shows evicted as its eviction begins; the pass then removes its files, and the next.
    budget = BUDGET_MB * MiB
    wait_for(lambda: gauge(api, "aenv_layer_cache_bytes") <= budget, "the cache back within its budget")
    rows = images_by_digest(api)
    states = [rows[d]["state"] for _, d in images]
    assert states[0] == "local" and rows[images[0][1]]["inUse"], states  # the oldest, but in use
    assert states[-1] == "local", states  # the newest
    evicted = [i for i, s in enumerate(states) if s == "evicted"]
    assert evicted == list(range(1, 1 + len(evicted))), states  # the least recently used of the others
    assert gauge(api, "aenv_layer_cache_bytes") <= BUDGET_MB * MiB
    assert api.get(f"/templates/{made[images[1][1]]}").status_code == 404  # its record went with it

    # The next create of an evicted image pulls it again (its own layer; the base another image
    # in use holds stays) and makes it under the same template id.
    ref, digest = images[1]
    task_blob, base_blob = blobs_of(setup.registry, ref.split("/", 1)[1].rsplit(":", 1)[0], digest)[2::-2]
    before = (setup.proxy.count(f"blobs/{task_blob}"), setup.proxy.count(f"blobs/{base_blob}"))
    again = api.post("/sandboxes", json={"templateID": ref, "timeout": 60})
    assert again.status_code == 201, again.text
    assert again.json()["templateID"] == rows[digest]["name"]
    assert (setup.proxy.count(f"blobs/{task_blob}"), setup.proxy.count(f"blobs/{base_blob}")) == (
        before[0] + 1,
        before[1],
    )
    template = api.get(f"/templates/{made[digest]}").json()
    assert template["templateID"] == made[digest] and ref in template["aliases"], template
    api.delete(f"/sandboxes/{again.json()['sandboxID']}")

    # By its template id (E2B's SDK, as a harness that kept it would): made again, same id.
    gone = next((d for _, d in images[2:] if images_by_digest(api)[d]["state"] == "evicted"), None)
    assert gone is not None  # the next one in LRU order: evicted before, or by the create just now
    sbx = Sandbox.create(template=made[gone], timeout=60)
    try:
        assert sbx.commands.run("cat /testbed/task.txt").exit_code == 0
    finally:
        sbx.kill()
    assert api.get(f"/templates/{made[gone]}").json()["templateID"] == made[gone]
    api.delete(f"/sandboxes/{first.json()['sandboxID']}")


def test_images_metrics_and_the_cli_show_what_sharing_saves(setup: Setup, api: httpx.Client) -> None:
    ref, digest = task_image(setup, "astropy__astropy-14182", task_mib=1)
    assert api.post("/sandboxes", json={"templateID": ref, "timeout": 60}).status_code == 201
    row = images_by_digest(api)[digest]
    assert row["reference"] == ref and row["name"] == "sha256-" + digest.split(":")[1], row
    assert row["state"] == "local" and row["inUse"] and not row["pinned"], row
    assert row["sizeBytes"] == sum(layer["sizeBytes"] for layer in row["layers"]) > 4 * MiB
    assert row["storedBytes"] > sum(layer["storedBytes"] for layer in row["layers"])  # and its snapshot
    assert [layer["id"].startswith("oci-") for layer in row["layers"]] == [True] * 3
    bb = next(r for r in images_by_digest(api).values() if r["name"] == "bb")
    assert bb["pinned"]  # named by a person: never evicted whole

    result = CliRunner().invoke(app, ["--url", setup.node.url, "--api-key", API_KEY, "images"])
    assert result.exit_code == 0, result.output
    listed = json.loads(result.stdout)  # piped: JSON, as `aenv nodes`
    assert {r["digest"] for r in listed} == set(images_by_digest(api))
    from aenv.cli.images import totals

    sums = totals(listed)
    assert sums["uniqueLayerBytes"] < sums["sizeBytes"]  # the base and repository layers counted once
    stored, sizes = gauge(api, "aenv_image_layer_stored_bytes"), gauge(api, "aenv_image_size_bytes")
    assert 0 < stored < sizes, (stored, sizes)
    assert gauge(api, "aenv_image_pull_bytes_total") >= row["sizeBytes"] - 2 * MiB  # its base came before


def test_a_prefetch_makes_images_ahead_with_progress_and_e2b_errors(
    setup: Setup, api: httpx.Client, tmp_path: Path
) -> None:
    ready = [task_image(setup, f"django__django-{n}", task_mib=2) for n in (11099, 11133)]
    missing = f"{setup.proxy.host}/swebench/sweb.eval.x86_64.nothing-here:latest"
    listing = tmp_path / "images.txt"
    listing.write_text(f"# SWE-bench tasks\n{ready[0][0]}\n\n{ready[1][0]}  # second\n{missing}\n{ready[0][0]}\n")
    result = CliRunner().invoke(
        app, ["--url", setup.node.url, "--api-key", API_KEY, "images", "prefetch", str(listing)]
    )
    assert result.exit_code == 1, result.output  # one failed
    job = json.loads(result.stdout)
    assert job["state"] == "done" and job["counts"] == {"pending": 0, "pulling": 0, "ready": 2, "failed": 1}, job
    by_ref = {item["reference"]: item for item in job["images"]}
    assert len(by_ref) == 3  # the duplicate once
    failed = by_ref[missing]
    assert failed["state"] == "failed" and failed["error"]["code"] == 404, failed
    assert failed["error"]["message"].startswith(f"image '{missing}' not found"), failed
    for ref, digest in ready:
        item = by_ref[ref]
        assert item["state"] == "ready" and item["digest"] == digest, item
        assert item["templateID"] == images_by_digest(api)[digest]["templateID"], item
        assert item["bytesDone"] >= 2 * MiB and item["bytesDone"] == item["bytesTotal"], item
    assert api.get(f"/images/prefetch/{job['prefetchID']}").json()["counts"] == job["counts"]

    before = setup.proxy.total()
    for ref, _ in ready:  # made ahead: no pull
        r = api.post("/sandboxes", json={"templateID": ref, "timeout": 60})
        assert r.status_code == 201, r.text
    assert setup.proxy.total() == before


def test_a_prefetch_checks_its_request_first(setup: Setup, api: httpx.Client) -> None:
    good = f"{setup.proxy.host}/swebench/a:latest"
    bad: list[Any] = [
        {},
        {"images": []},
        {"images": "python:3.12"},
        {"images": [good, 7]},
        {"images": [good, "Not A/Reference"]},
        {"images": [good, "x" * 2000]},
        {"images": [good, "bad\u0000ref"]},
        {"images": [good] * 1001},
        {"images": [good], "extra": 1},
    ]
    before = setup.proxy.total()
    for body in bad:
        r = api.post("/images/prefetch", json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["message"], r.text
    torn = api.post("/images/prefetch", content=b"[1, 2", headers={"Content-Type": "application/json"})
    assert torn.status_code == 400, torn.text
    assert setup.proxy.total() == before  # nothing started
    assert api.get("/images/prefetch/nope").status_code == 404
    assert api.get("/images/prefetch/" + "a" * 5000).status_code in (404, 414, 431)


def evict(setup: Setup, api: httpx.Client, digests: list[str], prefix: str) -> None:
    """Create (and kill) new images until every one of ``digests`` is evicted."""
    for n in range(12):
        if all(images_by_digest(api)[d]["state"] == "evicted" for d in digests):
            return
        ref, _ = task_image(setup, f"{prefix}-{n}")
        r = api.post("/sandboxes", json={"templateID": ref, "timeout": 60})
        assert r.status_code == 201, r.text
        api.delete(f"/sandboxes/{r.json()['sandboxID']}")
        time.sleep(0.5)  # the eviction pass after a create
    pytest.fail(f"not evicted: {[images_by_digest(api)[d]['state'] for d in digests]}")


def test_an_evicted_image_whose_digest_left_the_registry_follows_its_tag_or_is_deleted(
    setup: Setup, api: httpx.Client
) -> None:
    """Its tag moved and the old manifest is gone: a create by the tag pulls what the tag names
    now (not a 404 for ever); by the old template id it is E2B's not found. Another evicted image
    is deleted by its template id: forgotten, and no longer listed."""
    name = "swebench/sweb.eval.x86_64.moved__task-1"
    ref = f"{setup.proxy.host}/{name}:latest"

    def push(content: str) -> str:
        layer = (
            LayerTar()
            .dir("testbed")
            .file("testbed/task.txt", content.encode())
            .file("testbed/pad", os.urandom(6 * MiB))
        )
        return setup.registry.push_image(name, "latest", [(BASE, "gzip"), (REPO, "gzip"), (layer.bytes(), "gzip")])

    old = push("old\n")
    dropped_ref, dropped = task_image(setup, "dropped__task-1")
    for r in (ref, dropped_ref):
        made = api.post("/sandboxes", json={"templateID": r, "timeout": 60})
        assert made.status_code == 201, made.text
        api.delete(f"/sandboxes/{made.json()['sandboxID']}")
    old_id, dropped_id = (images_by_digest(api)[d]["templateID"] for d in (old, dropped))
    evict(setup, api, [old, dropped], "filler")

    gone = setup.registry.http.delete(f"{setup.registry.url}/v2/{name}/manifests/{old}")
    assert gone.status_code == 202, gone.text
    new = push("new\n")
    assert api.post("/sandboxes", json={"templateID": old_id}).status_code == 404  # that very image
    sbx = Sandbox.create(template=ref, timeout=60)
    try:
        assert sbx.commands.run("cat /testbed/task.txt").stdout == "new\n"
    finally:
        sbx.kill()
    rows = images_by_digest(api)
    assert rows[new]["state"] == "local" and old not in rows, rows.keys()

    assert api.delete(f"/templates/{dropped_id}").status_code == 204
    assert dropped not in images_by_digest(api)
    assert api.delete(f"/templates/{dropped_id}").status_code == 404
