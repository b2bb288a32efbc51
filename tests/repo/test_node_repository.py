"""Snapshots through the repository, end to end: a node commits them, a second node with an empty
data dir learns them from the repository and restores running processes from it; damage in the
repository fails that one restore with a clear error. Against a directory and against S3 (moto)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from aenv.repo.backends import Backend, PosixBackend
from aenv.repo.repository import Repository, object_keys
from tests.conftest import Server, start_server
from tests.images.oci import Registry, busybox_layer, start_registry
from tests.repo.s3 import S3_KEY, S3Endpoint

pytestmark = pytest.mark.sandbox

COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /home/user/count; sleep 0.2; done"


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    yield from start_registry(tmp_path_factory.mktemp("registry"))


@pytest.fixture(params=["posix", "s3"])
def repository(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[dict[str, str], Backend]:
    """(node environment naming the repository, the same repository for the test to inspect)."""
    if request.param == "posix":
        root = tmp_path / "shared-repo"
        return {"AENV_REPO": str(root)}, PosixBackend(root)
    s3: S3Endpoint = request.getfixturevalue("s3")
    bucket = s3.new_bucket()
    env = {
        "AENV_REPO": f"s3://{bucket}/fleet",
        "AENV_REPO_S3_ENDPOINT": s3.url,
        "AENV_REPO_S3_REGION": "us-east-1",
        "AENV_REPO_S3_ACCESS_KEY_ID": S3_KEY["access_key_id"],
        "AENV_REPO_S3_SECRET_ACCESS_KEY": S3_KEY["secret_access_key"],
    }
    return env, s3.backend(bucket, "fleet")


def use(server: Server, monkeypatch: pytest.MonkeyPatch) -> httpx.Client:
    monkeypatch.setenv("E2B_API_KEY", server.env["AENV_API_KEY"])
    monkeypatch.setenv("E2B_API_URL", server.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", server.url)
    return server.client()


def count(sbx: Sandbox) -> int:
    for _ in range(50):
        out = sbx.commands.run("cat /home/user/count").stdout.strip()
        if out:
            return int(out)
        time.sleep(0.1)
    raise AssertionError("the counter wrote nothing")


def test_a_node_with_an_empty_data_dir_restores_from_the_repository(
    registry: Registry,
    repository: tuple[dict[str, str], Backend],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env, backend = repository
    env = {**env, "AENV_BUILD_BASE": "false", "AENV_REPO_GC_INTERVAL": "0"}
    registry.push_image("tests/repo-bb", "1", [(busybox_layer().file("etc/motd", b"hi\n").bytes(), "gzip")])

    first = start_server(tmp_path / "node-a", extra_env=env, wait_for=None)
    try:
        api = use(first, monkeypatch)
        r = api.post("/templates/from-image", json={"name": "repo-bb", "image": f"{registry.host}/tests/repo-bb:1"})
        assert r.status_code == 201, r.text
        sbx = Sandbox.create(template="repo-bb", timeout=300)
        sbx.commands.run(COUNTER, background=True)
        sbx.files.write("/home/user/state.txt", "before the snapshot")
        time.sleep(2)
        at_snapshot = count(sbx)  # ~10 by now; the checkpoint holds at least this
        r = api.post(f"/sandboxes/{sbx.sandbox_id}/snapshots", json={"name": "prepared", "durable": True})
        assert r.status_code == 201, r.text
        snap1 = r.json()
        assert snap1["committed"] is True
        # A second snapshot of the same sandbox after a small change uploads only what is new.
        sbx.files.write("/home/user/more.txt", "x" * 1000)
        r = api.post(f"/sandboxes/{sbx.sandbox_id}/snapshots", json={"name": "prepared-2", "durable": True})
        assert r.status_code == 201, r.text
        snap2 = r.json()
        c1, c2 = snap1["commit"], snap2["commit"]
        # about as large (its memory image may have shrunk a little: a CI run saw 0.3% less)
        assert c2["logicalBytes"] >= c1["logicalBytes"] * 0.9, (c1, c2)
        assert c2["uploadedBytes"] < c2["logicalBytes"] / 10, (c1, c2)
        assert c2["newChunks"] < c2["chunks"]
        template = api.get("/templates/repo-bb").json()
        for _ in range(100):  # the template is committed in the background
            if template["committed"]:
                break
            time.sleep(0.2)
            template = api.get("/templates/repo-bb").json()
        assert template["committed"] is True
        sbx.kill()
    finally:
        first.stop()

    # A node that has never seen any of it: an empty data dir, the same repository.
    second = start_server(tmp_path / "node-b", extra_env=env, wait_for="repo-bb")
    try:
        api = use(second, monkeypatch)
        names = {s["names"][0]: s for s in api.get("/snapshots").json()}
        assert {"prepared", "prepared-2"} <= set(names) and names["prepared"]["committed"]
        prefetch_with_progress(second, snap1["snapshotID"])

        # Damage one chunk that only the second snapshot's checkpoint image has.
        repo = Repository(backend)
        entry = repo.get_entry("snapshot", snap2["snapshotID"])
        first_entry = repo.get_entry("snapshot", snap1["snapshotID"])
        assert entry is not None and first_entry is not None
        image_ref = next(r for r in repo.artifact_refs(entry) if r.kind == "image")
        shared = {k for r in repo.artifact_refs(first_entry) for k in object_keys(repo.read_manifest(r, "test"))}
        image = repo.read_manifest(image_ref, "test")
        own = [k for k in object_keys(image) if k not in shared]  # its pack: the pages that changed
        assert own and all(k.startswith("packs/") for k in own), own
        pack = bytearray(backend.get(own[0]))
        pack[len(pack) // 2] ^= 0xFF  # a byte inside one of its chunks' frames
        backend.put(own[0], bytes(pack))
        r = api.post("/sandboxes", json={"templateID": snap2["snapshotID"], "timeout": 60})
        assert r.status_code == 500, r.text
        assert r.json()["error_code"] == "artifact_damaged"
        assert snap2["snapshotID"] in r.json()["message"] and "corrupt" in r.json()["message"]
        assert api.get("/sandboxes").json() == []

        # The first snapshot restores: files and the running process, which goes on counting.
        child = Sandbox.create(template=snap1["snapshotID"], timeout=120)
        try:
            assert child.files.read("/home/user/state.txt") == "before the snapshot"
            resumed = count(child)
            assert resumed >= at_snapshot, (resumed, at_snapshot)  # the same process, not a fresh counter
            time.sleep(0.6)
            assert count(child) > resumed
        finally:
            child.kill()
        fresh = Sandbox.create(template="repo-bb", timeout=60)
        try:
            assert fresh.commands.run("cat /etc/motd").stdout == "hi\n"
        finally:
            fresh.kill()
    finally:
        second.stop()


def prefetch_with_progress(node: Server, snapshot_id: str) -> None:
    """An operator warms a node: `aenv repo fetch` brings a snapshot's files from the repository
    with a progress bar (NDJSON progress in bytes); once they are here there is nothing to fetch."""
    import asyncio
    import json

    from typer.testing import CliRunner

    from aenv.cli.main import app
    from aenv.sdk import AsyncClient, NotFound

    seen: list[tuple[int, int]] = []

    async def fetch(name: str) -> dict[str, object]:
        async with AsyncClient(node.url, node.env["AENV_API_KEY"]) as client:
            return await client.fetch_template(name, on_progress=lambda *p: seen.append(p))

    answer = asyncio.run(fetch(snapshot_id))
    fetched = answer["fetchedBytes"]
    assert isinstance(fetched, int) and fetched > 0 and answer["snapshot"]["snapshotID"] == snapshot_id  # type: ignore[index]
    assert seen and seen[-1][0] == seen[-1][1] == fetched and [d for d, _ in seen] == sorted(d for d, _ in seen)
    cli = CliRunner().invoke(
        app, ["--url", node.url, "--api-key", node.env["AENV_API_KEY"], "repo", "fetch", snapshot_id]
    )
    assert cli.exit_code == 0 and json.loads(cli.stdout)["fetchedBytes"] == 0, cli.output  # all here now
    with pytest.raises(NotFound):
        asyncio.run(fetch("no-such-template"))
