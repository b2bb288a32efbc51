"""Memory images are bound to the runsc that wrote them: an upgraded node (or one sharing a
repository with nodes of another runsc) refuses to restore another's image with a clear 422 and
loses nothing, instead of handing runsc an image it crashes on (a Go panic, 500)."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from aenv.runtime.gvisor import IMAGE_MARK, LEGACY_RUNSC, RunscVersion, image_mark
from tests.conftest import Server

pytestmark = pytest.mark.sandbox

OTHER_RUNSC = "runsc 0.0~20000101.0"


def images(server: Server) -> set[str]:
    return set(os.listdir(server.data_dir / "fs" / "images"))


def test_a_pause_another_runsc_wrote_is_refused_and_boots_without_its_memory(
    sandbox: Sandbox, server: Server, api: httpx.Client
) -> None:
    sandbox.files.write("/home/user/kept", "on disk")
    before = images(server)
    assert sandbox.pause() is True
    (image,) = images(server) - before
    mark = server.data_dir / "fs" / "images" / image / IMAGE_MARK
    assert mark.read_text() == f"runsc {api.get('/health').json()['runtime']['runsc']}"
    mark.write_text(OTHER_RUNSC)  # as if this node's runsc had been upgraded since

    r = api.post(f"/sandboxes/{sandbox.sandbox_id}/resume", json={})
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["error_code"] == "image_incompatible" and OTHER_RUNSC in body["message"]
    assert "memory=false" in body["message"]
    assert api.get(f"/sandboxes/{sandbox.sandbox_id}").json()["state"] == "paused"  # nothing lost

    r = api.post(f"/sandboxes/{sandbox.sandbox_id}/connect", json={"timeout": 60, "memory": False})
    assert r.status_code == 201, r.text
    again = Sandbox.connect(sandbox.sandbox_id)
    assert again.files.read("/home/user/kept") == "on disk"


def test_a_snapshot_another_runsc_wrote_is_refused(sandbox: Sandbox, server: Server, api: httpx.Client) -> None:
    before = images(server)
    r = api.post(f"/sandboxes/{sandbox.sandbox_id}/snapshots", json={})
    assert r.status_code == 201, r.text
    snap = r.json()["snapshotID"]
    (image,) = images(server) - before
    (server.data_dir / "fs" / "images" / image / IMAGE_MARK).write_text(OTHER_RUNSC)
    r = api.post("/sandboxes", json={"templateID": snap})
    assert r.status_code == 422, r.text
    assert r.json()["error_code"] == "image_incompatible" and snap in r.json()["message"]
    assert sandbox.commands.run("echo alive").stdout == "alive\n"  # the source is not touched


def test_the_mark_is_read_as_a_small_regular_file_only(tmp_path: Path) -> None:
    assert image_mark(tmp_path) == LEGACY_RUNSC  # images from before marks
    (tmp_path / IMAGE_MARK).symlink_to("/etc/hostname")
    assert image_mark(tmp_path) == "an unreadable mark"  # never followed
    (tmp_path / IMAGE_MARK).unlink()
    os.mkfifo(tmp_path / IMAGE_MARK)
    assert image_mark(tmp_path) == "an unreadable mark"  # never blocks on a FIFO
    (tmp_path / IMAGE_MARK).unlink()
    (tmp_path / IMAGE_MARK).write_text("runsc " + "x" * 100_000)
    assert len(image_mark(tmp_path)) < 200


def test_versions_runsc_prints() -> None:
    assert RunscVersion("0.0~20240729.0").date == 20240729 and RunscVersion("0.0~20240729.0").modern
    assert RunscVersion("release-20250106.0").modern
    assert not RunscVersion("0.0~20221219.0").modern
    assert RunscVersion("VERSION_MISSING").modern  # a development build: taken to be recent
    assert RunscVersion("0.0~20221219.0").mark == LEGACY_RUNSC
