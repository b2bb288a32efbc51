"""Durable pause on one node: a pause with memory is committed to the node's repository in the
background (the record, the checkpoint image, the upper sealed as a layer under a new id), the
sandbox says when it is durable, and a resume on the same node works as before and takes the
paused state out of the repository. A node without a repository says why its pauses are not."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import Sandbox

from aenv.repo.backends import PosixBackend
from aenv.repo.repository import ArtifactRef, Repository
from tests.conftest import Server, start_busybox_node
from tests.durable import count, wait_for

pytestmark = pytest.mark.sandbox

COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /home/user/count; sleep 0.2; done"


def durable_detail(api: httpx.Client, sandbox_id: str) -> dict[str, Any] | None:
    detail = api.get(f"/sandboxes/{sandbox_id}").json()
    return detail if detail.get("durable") else None


def upper_file(repo: Repository, ref: ArtifactRef, path: str, tmp: Path) -> str:
    """A file of a committed upper (an ext4 image), read back from the repository's chunks."""
    img = tmp / f"{ref.id}.img"
    repo.fetch_artifact(ref, img, "test")
    out = subprocess.run(["debugfs", "-R", f"cat /upper{path}", str(img)], capture_output=True, text=True, check=True)
    return out.stdout


def test_a_pause_becomes_durable_and_resumes_on_its_node(e2b_env: Server, api: httpx.Client, tmp_path: Path) -> None:
    repo = Repository(PosixBackend(e2b_env.repo_dir))
    sbx = Sandbox.create(timeout=300)
    try:
        sbx.commands.run(COUNTER, background=True)
        sbx.files.write("/home/user/state.txt", "before the pause")
        time.sleep(1)
        before = count(sbx)
        r = api.post(f"/sandboxes/{sbx.sandbox_id}/pause")
        assert r.status_code == 204, r.text
        pending = api.get("/repository").json()["pendingPauses"]  # the commit backlog counts it until durable
        detail = api.get(f"/sandboxes/{sbx.sandbox_id}").json()
        assert detail["state"] == "paused" and detail["durable"] in (False, True)
        assert detail["durable"] or sbx.sandbox_id in pending
        assert "durableReason" not in detail
        wait_for(lambda: durable_detail(api, sbx.sandbox_id))
        assert sbx.sandbox_id not in api.get("/repository").json()["pendingPauses"]

        entry = repo.get_entry("sandbox", sbx.sandbox_id)
        assert entry is not None
        record = entry["record"]
        assert record["id"] == sbx.sandbox_id and record["state"] == "paused" and record["upper"] == ""
        refs = {(r.kind, r.id): r for r in repo.artifact_refs(entry)}
        assert ("image", record["image"]) in refs  # the checkpoint image
        sealed = record["layers"][-1]  # the upper, sealed as a layer under an id of its own
        assert ("layer", sealed) in refs and all(("layer", x) in refs for x in record["layers"])
        assert upper_file(repo, refs[("layer", sealed)], "/home/user/state.txt", tmp_path) == "before the pause"
        r = api.post("/repository/gc")  # a collection keeps what a paused sandbox's entry names
        assert r.status_code == 200, r.text
        assert repo.check() == []

        # A resume on the same node: the process goes on, the files are there and writable,
        # and the paused state leaves the repository.
        sbx.connect()
        resumed = count(sbx)
        assert resumed >= before
        assert sbx.files.read("/home/user/state.txt") == "before the pause"
        sbx.files.write("/home/user/after.txt", "written after the resume")
        assert "durable" not in api.get(f"/sandboxes/{sbx.sandbox_id}").json()
        wait_for(lambda: repo.get_entry("sandbox", sbx.sandbox_id) is None, 20)

        # A second pause is committed again, with its upper under a new id; a kill removes it.
        assert api.post(f"/sandboxes/{sbx.sandbox_id}/pause").status_code == 204
        wait_for(lambda: durable_detail(api, sbx.sandbox_id))
        second = repo.get_entry("sandbox", sbx.sandbox_id)
        assert second is not None and second["record"]["layers"][-1] != sealed
        ref = next(r for r in repo.artifact_refs(second) if r.id == second["record"]["layers"][-1])
        assert upper_file(repo, ref, "/home/user/after.txt", tmp_path) == "written after the resume"
    finally:
        sbx.kill()
    wait_for(lambda: repo.get_entry("sandbox", sbx.sandbox_id) is None, 20)


def test_a_second_pause_of_an_idle_sandbox_uploads_its_changed_pages_in_one_pack(
    e2b_env: Server, api: httpx.Client
) -> None:
    """Incremental memory: the second durable pause of an idle sandbox shares the pages its first
    image has and uploads the rest as one pack (seen failing before: 2.7 MiB, its image in 1 MiB
    chunks that all changed). A fresh node (the entry's manifests, the packs' ranges) reads it."""
    backend = PosixBackend(e2b_env.repo_dir)
    repo = Repository(backend)
    sbx = Sandbox.create(timeout=300)
    try:
        uploads, images, packs_before = [], [], []
        for _ in range(2):
            time.sleep(1)
            packs_before.append({o.key.rsplit("/", 1)[-1] for o in backend.list("packs/")})
            assert api.post(f"/sandboxes/{sbx.sandbox_id}/pause").status_code == 204
            wait_for(lambda: durable_detail(api, sbx.sandbox_id))
            entry = repo.get_entry("sandbox", sbx.sandbox_id)
            assert entry is not None
            uploads.append(entry["commit"]["new_bytes"])
            image = next(r for r in repo.artifact_refs(entry) if r.kind == "image")
            images.append(repo.read_manifest(image, "test"))
            sbx.connect()
            wait_for(lambda: repo.get_entry("sandbox", sbx.sandbox_id) is None, 20)
        first, second = images
        own = [digest for digest, _ in second["packs"] if digest not in packs_before[1]]
        # One pack uploaded; the others were in the repository before. Most are ones the first image
        # references; any older pack counts once a quarter of its bytes is reused (the server's other
        # sandboxes' pauses share pages too), and how many varies: seen 3 and 4.
        assert len(own) == 1 and len(second["packs"]) <= len(first["packs"]) + 2, (first["packs"], second["packs"])
        assert len(second["chunks"]) > 1000  # ~4 KiB chunks of a ~10 MiB image
        assert uploads[1] < 1.2 * 2**20, uploads  # the changed pages, the upper, the manifests
        sealed = next(r for r in repo.artifact_refs(entry) if r.id == entry["record"]["layers"][-1])
        assert "packs" in repo.read_manifest(sealed, "test")  # its upper's blocks shared too
        assert sbx.commands.run("echo ok").stdout.strip() == "ok"
    finally:
        sbx.kill()


def test_a_resume_right_after_the_pause_does_not_wait_for_durability(e2b_env: Server, api: httpx.Client) -> None:
    """Pause and resume in a loop, faster than the commits: every resume works, files persist and
    the repository never keeps the state of a sandbox that runs."""
    repo = Repository(PosixBackend(e2b_env.repo_dir))
    sbx = Sandbox.create(timeout=300)
    try:
        for i in range(4):
            sbx.files.write(f"/home/user/round-{i}", str(i))
            assert api.post(f"/sandboxes/{sbx.sandbox_id}/pause").status_code == 204
            if i % 2:
                time.sleep(0.5)  # sometimes while its commit is under way
            sbx.connect()
            assert [sbx.files.read(f"/home/user/round-{j}") for j in range(i + 1)] == [str(j) for j in range(i + 1)]
        wait_for(lambda: repo.get_entry("sandbox", sbx.sandbox_id) is None, 30)
        time.sleep(3)  # a late commit must not bring it back
        assert repo.get_entry("sandbox", sbx.sandbox_id) is None
        assert sbx.commands.run("echo ok > /home/user/w && cat /home/user/w").stdout.strip() == "ok"
    finally:
        sbx.kill()


@pytest.fixture(scope="module")
def no_repo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A node without a repository, on a busybox template from a local OCI layout."""
    srv = start_busybox_node(tmp_path_factory.mktemp("no-repo") / "data")
    yield srv
    srv.stop()


def test_a_node_without_a_repository_says_its_pause_is_not_durable(no_repo: Server) -> None:
    with no_repo.client() as api:
        r = api.post("/sandboxes", json={"templateID": "bb", "timeout": 120})
        assert r.status_code == 201, r.text
        sandbox_id = r.json()["sandboxID"]
        try:
            assert api.post(f"/sandboxes/{sandbox_id}/pause").status_code == 204
            detail = api.get(f"/sandboxes/{sandbox_id}").json()
            assert detail["durable"] is False and "AENV_REPO=none" in detail["durableReason"]
            r = api.post(f"/sandboxes/{sandbox_id}/resume", json={})
            assert r.status_code == 201, r.text
            assert api.get(f"/sandboxes/{sandbox_id}").json()["state"] == "running"
        finally:
            api.delete(f"/sandboxes/{sandbox_id}")


def test_a_pause_without_memory_says_it_stays_on_the_node(e2b_env: Server, api: httpx.Client) -> None:
    repo = Repository(PosixBackend(e2b_env.repo_dir))
    sbx = Sandbox.create(timeout=120)
    try:
        r = api.post(f"/sandboxes/{sbx.sandbox_id}/pause", json={"memory": False})
        assert r.status_code == 204, r.text
        detail = api.get(f"/sandboxes/{sbx.sandbox_id}").json()
        assert detail["pausedWithMemory"] is False
        assert detail["durable"] is False and "without memory" in detail["durableReason"]
        time.sleep(2)
        assert repo.get_entry("sandbox", sbx.sandbox_id) is None
        assert sbx.sandbox_id not in api.get("/repository").json()["pendingPauses"]  # nothing to commit
    finally:
        sbx.kill()


def test_a_resume_at_any_point_of_the_commit_keeps_everything(e2b_env: Server, api: httpx.Client) -> None:
    """A pause whose upper takes a moment to upload, resumed at once and at later moments (the
    commit waiting for the instance's teardown, uploading, done): a waiting commit is abandoned,
    an upload is waited for, and the sandbox's files and processes are as they were each time;
    the repository does not keep the state of a running sandbox."""
    repo = Repository(PosixBackend(e2b_env.repo_dir))
    sbx = Sandbox.create(timeout=300)
    try:
        sbx.commands.run(COUNTER, background=True)
        digest = sbx.commands.run(
            "head -c 96M /dev/urandom > /home/user/big && sha256sum /home/user/big", timeout=120
        ).stdout.split()[0]
        for i, delay in enumerate((0.0, 1.0, 2.0, 2.5, 3.0)):
            before = count(sbx)
            assert api.post(f"/sandboxes/{sbx.sandbox_id}/pause").status_code == 204
            time.sleep(delay)
            sbx.connect()
            assert count(sbx) >= before
            assert sbx.commands.run("sha256sum /home/user/big", timeout=120).stdout.split()[0] == digest
            sbx.files.write(f"/home/user/after-{i}", str(delay))
        wait_for(lambda: repo.get_entry("sandbox", sbx.sandbox_id) is None, 60)
        time.sleep(2)
        assert repo.get_entry("sandbox", sbx.sandbox_id) is None
        assert sbx.files.read("/home/user/after-0") == "0.0"
    finally:
        sbx.kill()
