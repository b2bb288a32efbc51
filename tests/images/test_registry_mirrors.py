"""Registry mirrors (AENV_REGISTRY_MIRRORS): images resolve from a local registry while their
registry is out of reach, mirror first and then the registry itself, through the same guard.

Real docker-registry processes on loopback play the mirror and an origin; the other origins are
closed ports (nothing listens: out of reach at once, no network needed). Seen failing before the
fix: `python:3.12-slim` and `docker.io/library/...` went to Docker Hub (502, out of reach here), and
images of an unreachable origin could not be had at all. The login test was seen failing with the
client's login handed to the mirror too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from aenv.images.reference import ImageRef
from tests.conftest import Server, e2b_client, free_port, start_busybox_node
from tests.images.oci import LayerTar, Registry, busybox_layer, start_registry
from tests.security.test_upstreams_hostile import Upstream, reply

pytestmark = pytest.mark.sandbox
METADATA = "http://169.254.169.254/latest/meta-data/"


@dataclass
class Setup:
    node: Server
    mirror: Registry
    origin: Registry
    locked: Registry  # a mirror that wants a login (none is configured for it)
    hostile: Upstream  # a mirror that sends the node to cloud metadata
    gone: str  # registries nothing answers for (closed ports)
    gone_too: str
    locked_for: str
    hostile_for: str


def image(registry: Registry, repo: str, tag: str, marker: bytes) -> str:
    """A busybox image with /marker holding ``marker``; its manifest digest."""
    layers = [(busybox_layer().bytes(), "gzip"), (LayerTar().file("marker", marker).bytes(), "gzip")]
    return registry.push_image(repo, tag, layers)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    mirror_gen = start_registry(tmp_path_factory.mktemp("mirror"))
    origin_gen = start_registry(tmp_path_factory.mktemp("origin"))
    locked_gen = start_registry(tmp_path_factory.mktemp("locked"), login=("user", "secret"))
    mirror, origin, locked = next(mirror_gen), next(origin_gen), next(locked_gen)
    hostile = Upstream()
    redirect = {"Location": METADATA + "x", "Docker-Distribution-API-Version": "registry/2.0"}
    hostile.routes["/v2/tests/redirected/"] = lambda h: reply(h, 307, headers=redirect)
    challenge = {"WWW-Authenticate": f'Bearer realm="{METADATA}token",service="x"'}
    hostile.routes["/v2/tests/token/"] = lambda h: reply(h, 401, b"{}", challenge)
    gone, gone_too, locked_for, hostile_for = (f"127.0.0.1:{free_port()}" for _ in range(4))
    mirrors = {
        "docker.io": f"http://{mirror.host}",
        origin.host: f"http://{mirror.host}/cache",  # the mirror keeps the origin's images under cache/
        gone: [f"http://127.0.0.1:{free_port()}", f"http://{mirror.host}"],  # a dead mirror, then a live one
        gone_too: f"http://{gone}",
        locked_for: f"http://{locked.host}",
        hostile_for: hostile.origin,
    }
    node = start_busybox_node(
        tmp_path_factory.mktemp("node") / "data", extra_env={"AENV_REGISTRY_MIRRORS": json.dumps(mirrors)}
    )
    try:
        yield Setup(node, mirror, origin, locked, hostile, gone, gone_too, locked_for, hostile_for)
    finally:
        node.stop()
        hostile.close()
        for gen in (mirror_gen, origin_gen, locked_gen):
            next(gen, None)


@pytest.fixture()
def api(setup: Setup, monkeypatch: pytest.MonkeyPatch) -> Iterator[httpx.Client]:
    yield from e2b_client(setup.node, monkeypatch)


def from_image(api: httpx.Client, name: str, ref: str, **login: str) -> httpx.Response:
    return api.post("/templates/from-image", json={"name": name, "image": ref, **login}, timeout=300)


def test_docker_hub_images_come_from_the_mirror(setup: Setup, api: httpx.Client) -> None:
    digest = image(setup.mirror, "library/python", "3.12-slim", b"from the mirror\n")
    for spelled in ("docker.io/library/python:3.12-slim", "index.docker.io/library/python:3.12-slim"):
        assert ImageRef.parse(spelled) == ImageRef.parse("python:3.12-slim")  # Docker Hub by each of its names
    r = from_image(api, "py", "python:3.12-slim")
    assert r.status_code == 201, r.text
    assert r.json()["description"] == f"from registry-1.docker.io/library/python:3.12-slim@{digest}"
    sbx = Sandbox.create(template="py", timeout=60)
    try:
        assert sbx.commands.run("cat /marker").stdout == "from the mirror\n"
    finally:
        sbx.kill()


def test_the_mirror_first_then_the_registry(setup: Setup, api: httpx.Client) -> None:
    image(setup.origin, "tests/app", "1", b"origin 1\n")
    mirrored = image(setup.mirror, "cache/tests/app", "1", b"mirror 1\n")
    only_origin = image(setup.origin, "tests/app", "2", b"origin 2\n")
    r = from_image(api, "app1", f"{setup.origin.host}/tests/app:1")
    assert r.status_code == 201 and r.json()["description"].endswith(mirrored), r.text
    r = from_image(api, "app2", f"{setup.origin.host}/tests/app:2")  # not mirrored: from the registry
    assert r.status_code == 201 and r.json()["description"].endswith(only_origin), r.text
    r = from_image(api, "app3", f"{setup.origin.host}/tests/app@{only_origin}")  # pinned: its digest said once
    assert r.status_code == 201 and r.json()["description"] == f"from {setup.origin.host}/tests/app@{only_origin}"


def test_an_unreachable_registry_is_not_needed(setup: Setup, api: httpx.Client) -> None:
    digest = image(setup.mirror, "tests/offline", "1", b"offline\n")
    r = from_image(api, "offline", f"{setup.gone}/tests/offline:1")  # its first mirror is dead too
    assert r.status_code == 201 and r.json()["description"].endswith(digest), r.text

    r = from_image(api, "missing", f"{setup.gone}/tests/missing:1")
    assert r.status_code == 502, r.text
    message = r.json()["message"]
    for said in (f"mirror http://{setup.mirror.host}", "not found", f"then {setup.gone} itself", "cannot be reached"):
        assert said in message, message

    r = from_image(api, "nowhere", f"{setup.gone_too}/tests/x:1")  # the mirror and the registry both out of reach
    assert r.status_code == 502, r.text
    message = r.json()["message"]
    assert f"mirror http://{setup.gone}" in message and f"then {setup.gone_too} itself" in message, message
    assert message.count("cannot be reached") == 2, message


def test_a_clients_login_is_not_given_to_a_mirror(setup: Setup, api: httpx.Client) -> None:
    """The login a client gives is for the registry it named, never for the operator's mirror."""
    setup.locked.push_image("tests/private", "1", [(LayerTar().file("private", b"x").bytes(), "gzip")])  # never pulled
    r = from_image(api, "private", f"{setup.locked_for}/tests/private:1", username="user", password="secret")
    assert r.status_code == 502, r.text  # the mirror wants a login it was not given; the registry is gone
    assert "wants a login" in r.json()["message"], r.text
    assert "private" not in [t["name"] for t in api.get("/templates").json()]


@pytest.mark.parametrize("repo", ["tests/redirected", "tests/token"])
def test_a_mirror_is_guarded_as_a_registry(setup: Setup, api: httpx.Client, repo: str) -> None:
    """A loopback mirror may not send the node to cloud metadata by a redirect or a token realm."""
    before = len(setup.hostile.hits)
    r = from_image(api, repo.split("/")[1], f"{setup.hostile_for}/{repo}:1")
    assert r.status_code == 502, r.text
    message = r.json()["message"]
    assert "link-local, multicast or reserved" in message and f"mirror {setup.hostile.origin}" in message, message
    assert len(setup.hostile.hits) > before  # the mirror was asked


def test_bad_mirror_settings_stop_the_server_at_once(tmp_path: Path) -> None:
    env = {"AENV_REGISTRY_MIRRORS": "docker.io=ftp://mirror.lan", "PATH": "/usr/bin:/bin"}
    argv = [sys.executable, "-m", "aenv.cli.main", "server", "--data-dir", str(tmp_path), "--port", "1"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "AENV_REGISTRY_MIRRORS" in done.stderr and "http://" in done.stderr, done.stderr
