"""Templates from OCI images, end to end: a real registry, a real pull, real sandboxes."""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from tests.conftest import Server
from tests.images.oci import (
    LayerTar,
    Registry,
    busybox_layer,
    sha,
    start_registry,
    write_docker_archive,
    write_layout,
)

pytestmark = pytest.mark.sandbox


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    yield from start_registry(tmp_path_factory.mktemp("registry"))


def oci_layers(server: Server) -> set[str]:
    return {p.name for p in (server.data_dir / "fs" / "layers").iterdir() if p.name.startswith("oci-")}


def test_image_to_template_to_sandbox(registry: Registry, api: httpx.Client, e2b_env: Server) -> None:
    base = busybox_layer().dir("data").file("data/a.txt", b"a").file("data/b.txt", b"b").file("gone.txt", b"x")
    base.dir("opq").file("opq/old.txt", b"old")
    top = LayerTar().dir("data").file("data/.wh.a.txt", b"").file(".wh.gone.txt", b"").dir("opq")
    top.file("opq/.wh..wh..opq", b"").file("opq/new.txt", b"new").file("layer2.txt", b"from layer 2\n")
    amd64 = registry.push_image(
        "tests/bb", "amd64", [(base.bytes(), "gzip"), (top.bytes(), "zstd")], env=["PATH=/bin", "GREETING=hello"]
    )
    decoy = registry.push_image("tests/bb", "arm64", [(LayerTar().file("decoy", b"arm").bytes(), "gzip")])
    registry.push_index("tests/bb", "1", [(decoy, "linux", "arm64"), (amd64, "linux", "amd64")])

    before = oci_layers(e2b_env)
    r = api.post("/templates/from-image", json={"name": "bb", "image": f"{registry.host}/tests/bb:1"}, timeout=600)
    assert r.status_code == 201, r.text
    assert r.json()["name"] == "bb" and amd64 in r.json()["description"]  # the amd64 entry of the index
    added = oci_layers(e2b_env) - before
    assert len(added) <= 2

    sbx = Sandbox.create(template="bb", timeout=120)
    try:
        run = sbx.commands.run
        assert run("ls /data").stdout.split() == ["b.txt"]  # a whiteout from the upper layer
        assert run("ls /opq").stdout.split() == ["new.txt"]  # an opaque directory
        assert run("cat /layer2.txt").stdout == "from layer 2\n"
        assert run("ls /gone.txt || echo absent").stdout.strip().endswith("absent")
        # the image names no User nor WorkingDir: Docker's root in /
        assert run("echo $GREETING; whoami; echo $HOME; pwd").stdout.split() == ["hello", "root", "/root", "/"]
        assert not sbx.files.exists("/decoy")  # the arm64 manifest was not used
        sbx.files.write("/home/user/note.txt", "written")
        assert run("cat /home/user/note.txt").stdout == "written"
        assert run("whoami", user="user").stdout.strip() == "user"
    finally:
        sbx.kill()

    # The same layers under another tag: nothing new is unpacked.
    registry.push_image("tests/bb2", "1", [(base.bytes(), "gzip"), (top.bytes(), "none")])
    again = oci_layers(e2b_env)
    r = api.post("/templates/from-image", json={"name": "bb2", "image": f"{registry.host}/tests/bb2:1"}, timeout=600)
    assert r.status_code == 201, r.text
    assert oci_layers(e2b_env) == again


def test_image_errors_are_clear(registry: Registry, api: httpx.Client) -> None:
    r = api.post("/templates/from-image", json={"name": "nope", "image": f"{registry.host}/tests/absent:1"})
    assert r.status_code == 404 and "not found" in r.json()["message"]
    arm = registry.push_image("tests/armonly", "one", [(LayerTar().file("x", b"x").bytes(), "gzip")])
    registry.push_index("tests/armonly", "1", [(arm, "linux", "arm64")])
    r = api.post("/templates/from-image", json={"name": "arm", "image": f"{registry.host}/tests/armonly:1"})
    assert r.status_code == 400 and "linux/arm64" in r.json()["message"]
    lying = registry.push_image("tests/lying", "1", [(busybox_layer().bytes(), "gzip")], diff_ids=[sha(b"other")])
    assert lying
    r = api.post("/templates/from-image", json={"name": "lying", "image": f"{registry.host}/tests/lying:1"})
    assert r.status_code == 400 and "diff_id" in r.json()["message"]  # the image lies: not the node's fault
    r = api.post("/templates/from-image", json={"name": "Bad Name", "image": "x"})
    assert r.status_code == 400
    assert "lying" not in [t["name"] for t in api.get("/templates").json()]


def test_aliases_tags_and_delete(registry: Registry, api: httpx.Client, e2b_env: Server) -> None:
    registry.push_image("tests/cat", "1", [(busybox_layer().bytes(), "gzip")])
    r = api.post("/templates/from-image", json={"name": "cat", "image": f"{registry.host}/tests/cat:1"}, timeout=600)
    assert r.status_code == 201, r.text
    r = api.patch("/templates/cat", json={"aliases": ["kitten", "cat:v1"]})
    assert r.status_code == 200 and set(r.json()["aliases"]) == {"cat", "kitten", "cat:v1"}
    assert api.patch("/templates/cat", json={"aliases": ["base"]}).status_code == 409  # names another template
    assert api.patch("/templates/cat", json={"aliases": ["Not Valid"]}).status_code == 400

    sbx = Sandbox.create(template="cat:v1", timeout=60)  # a tag resolves like a name
    try:
        refused = api.delete("/templates/kitten")
        assert refused.status_code == 409 and sbx.sandbox_id in refused.json()["message"]
        assert api.delete("/templates/kitten", params={"force": "true"}).status_code == 204
        assert sbx.commands.run("echo still here").stdout == "still here\n"  # its layers stay
    finally:
        sbx.kill()
    assert api.get("/templates/cat").status_code == 404
    assert api.delete("/templates/cat").status_code == 404


def test_images_from_files_for_air_gapped_hosts(api: httpx.Client, e2b_env: Server, tmp_path: Path) -> None:
    imports = e2b_env.data_dir / "imports"
    imports.mkdir(exist_ok=True)
    layers = [busybox_layer().bytes(), LayerTar().file("marker", b"from a file").bytes()]
    write_layout(imports / "layout", layers, "v1")
    with tarfile.open(imports / "layout.tar", "w") as tar:  # the same as an OCI archive
        tar.add(imports / "layout", arcname=".")
    write_docker_archive(imports / "saved.tar", layers, "saved/img:1")
    for name, ref in (
        ("from-layout", f"oci:{imports / 'layout'}:v1"),
        ("from-oci-archive", f"oci-archive:{imports / 'layout.tar'}:v1"),
        ("from-docker-save", f"docker-archive:{imports / 'saved.tar'}:saved/img:1"),
    ):
        r = api.post("/templates/from-image", json={"name": name, "image": ref}, timeout=600)
        assert r.status_code == 201, (ref, r.text)
        sbx = Sandbox.create(template=name, timeout=60)
        try:
            assert sbx.commands.run("cat /marker").stdout == "from a file"
        finally:
            sbx.kill()
    outside = tmp_path / "layout"
    write_layout(outside, layers, "v1")
    r = api.post("/templates/from-image", json={"name": "outside", "image": f"oci:{outside}:v1"})
    assert r.status_code == 400 and "AENV_IMAGE_IMPORT_DIRS" in r.json()["message"]
    assert str(imports) not in r.text and str(imports.parent) not in r.text  # the host's directories are not told
    r = api.post("/templates/from-image", json={"name": "notag", "image": f"oci:{imports / 'layout'}:v9"})
    assert r.status_code == 404


@pytest.fixture(scope="module")
def private_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    yield from start_registry(tmp_path_factory.mktemp("private-registry"), login=("alice", "s3cret-pw"))


def test_private_registry_logins(private_registry: Registry, api: httpx.Client, e2b_env: Server) -> None:
    from e2b import Template

    private_registry.push_image("team/app", "1", [(busybox_layer().file("secret.txt", b"inside\n").bytes(), "gzip")])
    image = f"{private_registry.host}/team/app:1"
    r = api.post("/templates/from-image", json={"name": "priv", "image": image})
    assert r.status_code == 403 and "login" in r.json()["message"]
    r = api.post("/templates/from-image", json={"name": "priv", "image": image, "username": "alice", "password": "no"})
    assert r.status_code == 403 and "refused" in r.json()["message"]
    login = {"username": "alice", "password": "s3cret-pw"}
    r = api.post("/templates/from-image", json={"name": "priv", "image": image, **login})
    assert r.status_code == 201, r.text
    # The login was for that pull only: nothing of it is kept in the template.
    assert "s3cret" not in json.dumps(api.get("/templates/priv").json())
    # The CLI: the user as an option, the password from the environment (never on a command line).
    from typer.testing import CliRunner

    from aenv.cli.main import app
    from tests.conftest import API_KEY

    argv = ["--url", e2b_env.url, "--api-key", API_KEY, "build", "--name", "priv-cli", "--image", image]
    result = CliRunner().invoke(app, [*argv, "--registry-user", "alice"], env={"AENV_REGISTRY_PASSWORD": "s3cret-pw"})
    assert result.exit_code == 0, result.output
    assert CliRunner().invoke(app, argv).exit_code == 1  # without the login: refused

    # E2B's Template builder with registry credentials (fromImageRegistry).
    template = Template().from_image(image, username="alice", password="s3cret-pw").run_cmd("cat /secret.txt")
    info = Template.build(template, "priv-e2b")
    sbx = Sandbox.create(template=info.template_id, timeout=60)
    try:
        assert sbx.commands.run("cat /secret.txt").stdout == "inside\n"
    finally:
        sbx.kill()
    with pytest.raises(Exception, match="refused"):
        Template.build(Template().from_image(image, username="alice", password="wrong").run_cmd("true"), "priv-bad")


def test_a_pull_streams_its_progress_when_asked(registry: Registry, api: httpx.Client, server: Server) -> None:
    """`Accept: application/x-ndjson`: the log, each layer's download (layer i of n, bytes done of
    its size, ending whole), then the template; a refused pull ends with its error. Without it:
    one JSON answer, as before."""
    import asyncio
    import os

    from aenv.sdk import AsyncClient, BuildError
    from tests.conftest import API_KEY

    big = busybox_layer().file("noise.bin", os.urandom(3 << 20))  # incompressible: several chunks on the wire
    small = LayerTar().file("x", os.urandom(8))  # its own: a layer a node has cached shows no progress
    registry.push_image("tests/progress", "1", [(big.bytes(), "gzip"), (small.bytes(), "gzip")])
    image = f"{registry.host}/tests/progress:1"
    seen: list[tuple[int, int, int, int]] = []
    logs: list[str] = []

    async def pull(name: str, reference: str) -> dict[str, object]:
        async with AsyncClient(server.url, API_KEY) as client:
            return await client.template_from_image(
                name, reference, on_log=logs.append, on_progress=lambda *p: seen.append(p)
            )

    try:
        row = asyncio.run(pull("progress", image))
        assert row["name"] == "progress"
        assert {layer for layer, *_ in seen} == {1, 2} and all(layers == 2 for _, layers, *_ in seen)
        for index in (1, 2):
            mine = [(done, total) for layer, _, done, total in seen if layer == index]
            assert mine[-1][0] == mine[-1][1] > 0 and [d for d, _ in mine] == sorted(d for d, _ in mine)
        assert any("2 layers" in line for line in logs), logs
        with pytest.raises(BuildError) as refused:
            asyncio.run(pull("progress-missing", f"{registry.host}/tests/nothing-here:1"))
        assert refused.value.status in (400, 404, 502) and refused.value.message
        plain = api.post("/templates/from-image", json={"name": "progress-plain", "image": image}, timeout=600)
        assert plain.status_code == 201 and plain.headers["content-type"].startswith("application/json")
    finally:
        for name in ("progress", "progress-plain"):
            api.delete(f"/templates/{name}")
