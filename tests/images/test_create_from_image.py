"""Sandboxes straight from an image reference (aenv/templates/image_sources.py), end to end: a real
registry (Debian's docker-registry) behind a counting proxy that can also misbehave, real runsc
sandboxes, the real E2B SDK. Images are shaped like SWE-bench's: a shared base (busybox and a few
MiB), a layer per repository, a layer per task.

Seen failing before the change, every test of this module: a create naming an image was a 404
"no template or snapshot named ...".
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import os
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import Sandbox

from aenv.storage.mounts import mounts_under
from tests.conftest import API_KEY, Server, e2b_client, start_busybox_node
from tests.images.oci import LayerTar, Registry, busybox_layer, sha, start_registry

pytestmark = pytest.mark.sandbox
MiB = 1 << 20
Fault = Callable[[BaseHTTPRequestHandler, bytes, dict[str, str]], None]


class CountingProxy:
    """A registry's front: every request counted by (method, path), passed on to the registry, or
    answered by a fault (its handler gets the registry's body and headers to spoil)."""

    def __init__(self, upstream: Registry) -> None:
        self.upstream = upstream
        self.hits: Counter[tuple[str, str]] = Counter()
        self.faults: dict[str, Fault] = {}  # path prefix -> fault
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                with proxy.lock:
                    proxy.hits[(self.command, self.path.split("?")[0])] += 1
                    fault = next((f for p, f in proxy.faults.items() if self.path.startswith(p)), None)
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("accept", "authorization")}
                with httpx.Client(timeout=60) as client:
                    r = client.request(self.command, proxy.upstream.url + self.path, headers=headers)
                keep = ("content-type", "docker-content-digest", "www-authenticate", "docker-distribution-api-version")
                out = {k: v for k, v in r.headers.items() if k.lower() in keep}
                try:
                    if fault is not None and r.status_code == 200:
                        fault(self, r.content, out)
                        return
                    self.send_response(r.status_code)
                    for k, v in out.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(r.content)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(r.content)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            do_HEAD = do_GET  # noqa: N815

            def log_message(self, *args: Any) -> None:
                pass

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                # A client (the node) that gives up on a connection is no error of the proxy's; and
                # a traceback on stderr lands in the output of a CLI run at the same moment.
                if not isinstance(sys.exc_info()[1], ConnectionError):
                    super().handle_error(request, client_address)

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.host = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def count(self, path: str) -> int:
        """GETs of paths that end with ``path`` (``blobs/<digest>``, ``<repo>/manifests/<tag>``)."""
        with self.lock:
            return sum(n for (method, at), n in self.hits.items() if method == "GET" and at.endswith(f"/{path}"))

    def total(self) -> int:
        with self.lock:
            return sum(self.hits.values())

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def body(handler: BaseHTTPRequestHandler, data: bytes, headers: dict[str, str], length: int | None) -> None:
    handler.send_response(200)
    for k, v in headers.items():
        handler.send_header(k, v)
    if length is not None:
        handler.send_header("Content-Length", str(length))
    else:
        handler.send_header("Connection", "close")
    handler.end_headers()
    handler.wfile.write(data)
    handler.wfile.flush()


def stall(handler: BaseHTTPRequestHandler, data: bytes, headers: dict[str, str]) -> None:
    """Half the blob, then nothing (the connection held open)."""
    handler.send_response(200)
    for k, v in headers.items():
        handler.send_header(k, v)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data[: len(data) // 2])
    handler.wfile.flush()
    time.sleep(30)


FAULTS: dict[str, tuple[Fault, int, str]] = {  # fault, status, what the message says
    "stalls": (stall, 504, "did not answer in time"),
    "sends more than declared": (lambda h, d, hd: body(h, d + os.urandom(4096), hd, None), 502, "larger than"),
    "sends fewer than declared": (lambda h, d, hd: body(h, d[:-100], hd, len(d) - 100), 502, "ended after"),
    "sends other bytes": (lambda h, d, hd: body(h, d[:-8] + b"spoiled!", hd, len(d)), 502, "does not match"),
}


@dataclass
class Setup:
    node: Server
    registry: Registry
    proxy: CountingProxy
    locked: Registry
    auth_file: Path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    registry_gen = start_registry(tmp_path_factory.mktemp("registry"))
    locked_gen = start_registry(tmp_path_factory.mktemp("locked"), login=("alice", "s3cret-pw"))
    registry, locked = next(registry_gen), next(locked_gen)
    proxy = CountingProxy(registry)
    auth_file = tmp_path_factory.mktemp("auth") / "config.json"  # written by a test: read at each pull
    env = {
        "AENV_REGISTRY_MIRRORS": f"docker.io=http://{proxy.host}",  # Docker Hub shorthand, offline
        "AENV_REGISTRY_READ_TIMEOUT": "3",
        "AENV_REGISTRY_AUTH": str(auth_file),
        "AENV_SPARE_UPPERS": "0",  # no blank uppers mounted behind the tests' backs: mounts are compared
    }
    node = None
    try:  # the registries stop with the module, and when the node does not start
        node = start_busybox_node(tmp_path_factory.mktemp("node") / "data", env)
        yield Setup(node, registry, proxy, locked, auth_file)
    finally:
        if node is not None:
            node.stop()
        proxy.close()
        for gen in (registry_gen, locked_gen):
            next(gen, None)


@pytest.fixture()
def api(setup: Setup, monkeypatch: pytest.MonkeyPatch) -> Iterator[httpx.Client]:
    yield from e2b_client(setup.node, monkeypatch, empty_after=True)


BASE = busybox_layer().file("opt/conda/base.bin", os.urandom(3 * MiB)).bytes()  # shared by every image


def task_image(registry: Registry, repo: str, task: str, repo_layer: bytes) -> tuple[str, str, list[str]]:
    """A SWE-bench shaped image ``swebench/sweb.eval.x86_64.<task>:latest``: (repository, manifest
    digest, the digests of its blobs: layers and config)."""
    task_layer = LayerTar().dir("testbed").file("testbed/task.txt", f"{task}\n".encode()).bytes()
    name = f"swebench/sweb.eval.x86_64.{task}"
    layers = [(BASE, "gzip"), (repo_layer, "gzip"), (task_layer, "zstd")]
    digest = registry.push_image(name, "latest", layers, env=["PATH=/bin", f"TASK={task}"])
    return name, digest, blobs_of(registry, name, digest)


def blobs_of(registry: Registry, name: str, digest: str) -> list[str]:
    """The digests of an image's layers, then of its config."""
    url = f"{registry.url}/v2/{name}/manifests/{digest}"
    manifest = registry.http.get(url, headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}).json()
    return [d["digest"] for d in manifest["layers"]] + [manifest["config"]["digest"]]


def layer_dir(tar: bytes) -> str:
    return f"oci-{sha(tar).split(':')[1][:32]}"


def repo_layer(repo: str) -> bytes:
    return LayerTar().dir("repo").file(f"repo/{repo}.bin", os.urandom(MiB)).file("repo/name", repo.encode()).bytes()


def fs_state(node: Server) -> tuple[set[str], set[str], list[Path]]:
    """(layer dirs, scratch entries, mounts) under the node's data dir."""
    fs = node.data_dir / "fs"
    layers, scratch = ({p.name for p in (fs / sub).iterdir()} for sub in ("layers", "tmp"))
    return layers, scratch, mounts_under(node.data_dir)


async def create_all(url: str, refs: list[str]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, headers={"X-API-Key": API_KEY}, timeout=300) as client:
        return await asyncio.gather(*(client.post("/sandboxes", json={"templateID": r, "timeout": 120}) for r in refs))


def test_concurrent_creates_of_new_images_pull_each_once(setup: Setup, api: httpx.Client) -> None:
    """20 creates at once over 5 images no node has: 5 pulls (each blob fetched once, the shared
    base too, each manifest once), 5 templates, 20 sandboxes; creates after restore."""
    tasks = {"django": ["django__django-11099", "django__django-11133", "django__django-12286"]}
    tasks["sympy"] = ["sympy__sympy-20590", "sympy__sympy-13480"]
    images = {}
    for repo, names in tasks.items():
        layer = repo_layer(repo)
        for task in names:
            images[task] = task_image(setup.registry, repo, task, layer)
    refs = {task: f"{setup.proxy.host}/{name}:latest" for task, (name, _, _) in images.items()}
    before = setup.proxy.total()

    answers = asyncio.run(create_all(setup.node.url, [ref for ref in refs.values() for _ in range(4)]))
    assert [r.status_code for r in answers] == [201] * 20, [r.text for r in answers if r.status_code != 201]
    made = {r.json()["sandboxID"]: r.json()["templateID"] for r in answers}
    assert len(made) == 20 and len(set(made.values())) == 5
    for task, (name, _, blobs) in images.items():
        assert setup.proxy.count(f"{name}/manifests/latest") == 1, task
        for blob in blobs:  # the base and the django layer are in several images: fetched once all the same
            assert setup.proxy.count(f"blobs/{blob}") == 1, (task, blob)
    distinct = {b for _, _, blobs in images.values() for b in blobs}
    assert setup.proxy.total() - before == 5 + len(distinct)  # 5 manifests and every distinct blob once

    templates = {t["name"]: t for t in api.get("/templates").json()}
    for task, (_, digest, _) in images.items():
        t = templates[digest.replace(":", "-")]  # named by the image's digest, the reference an alias
        assert refs[task] in t["aliases"] and t["sandboxes"] == 4 and t["name"] in made.values(), t
    _, digest, _ = images["sympy__sympy-13480"]
    sbx = Sandbox.connect(next(s for s, t in made.items() if t == digest.replace(":", "-")))
    said = sbx.commands.run("cat /testbed/task.txt; cat /repo/name; echo; echo $TASK; whoami").stdout.split()
    assert said == ["sympy__sympy-13480", "sympy", "sympy__sympy-13480", "root"]  # the image names no User: Docker's
    # Later creates restore the template: nothing more from the registry.
    before = setup.proxy.total()
    answers = asyncio.run(create_all(setup.node.url, list(refs.values())))
    assert [r.status_code for r in answers] == [201] * 5 and setup.proxy.total() == before


def test_the_e2b_sdk_creates_from_references(setup: Setup, api: httpx.Client) -> None:
    """Docker Hub's shorthand (through the operator's mirror), a reference pinned by digest, and a
    tag and a digest naming one image: one template for both."""
    which = LayerTar().file("which", b"python\n").bytes()
    python = setup.registry.push_image("library/python", "3.12-slim", [(BASE, "gzip"), (which, "gzip")])
    sbx = Sandbox.create(template="python:3.12-slim", timeout=60)
    try:
        assert sbx.commands.run("cat /which").stdout == "python\n"
    finally:
        sbx.kill()
    templates = {t["name"]: t for t in api.get("/templates").json()}
    assert "registry-1.docker.io/library/python:3.12-slim" in templates[python.replace(":", "-")]["aliases"]

    name, digest, blobs = task_image(setup.registry, "astropy", "astropy__astropy-12907", repo_layer("astropy"))
    pinned = f"{setup.proxy.host}/{name}@{digest}"
    sbx = Sandbox.create(template=pinned, timeout=60)
    try:
        assert sbx.commands.run("cat /testbed/task.txt").stdout == "astropy__astropy-12907\n"
    finally:
        sbx.kill()
    before = setup.proxy.total()
    sbx = Sandbox.create(template=f"{setup.proxy.host}/{name}:latest", timeout=60)  # the same image by its tag
    try:
        assert sbx.get_info().template_id == digest.replace(":", "-")
    finally:
        sbx.kill()
    assert setup.proxy.total() - before == 2  # its manifest and config, to learn its digest; no layer
    assert [setup.proxy.count(f"blobs/{b}") for b in blobs] == [1, 1, 1, 2]
    template = api.get(f"/templates/{digest.replace(':', '-')}").json()
    assert {pinned, f"{setup.proxy.host}/{name}:latest"} <= set(template["aliases"]), template


def test_tags_that_differ_only_in_case_are_two_images(setup: Setup, api: httpx.Client) -> None:
    """A tag is case-sensitive, as registries see it: ``app:V1`` after ``app:v1`` is its own image,
    not the template a name lookup would find by lowercasing; a repository is lowercase."""
    for tag in ("v1", "V1"):
        layer = LayerTar().file("who", f"{tag}\n".encode()).bytes()
        setup.registry.push_image("tests/cased", tag, [(BASE, "gzip"), (layer, "gzip")])
    made = []
    for tag in ("v1", "V1", "v1"):
        sbx = Sandbox.create(template=f"{setup.registry.host}/tests/cased:{tag}", timeout=60)
        try:
            assert sbx.commands.run("cat /who").stdout == f"{tag}\n"
            made.append(sbx.get_info().template_id)
        finally:
            sbx.kill()
    assert made[0] == made[2] != made[1]
    r = api.post("/sandboxes", json={"templateID": f"{setup.registry.host}/TESTS/CASED:v1"})
    assert r.status_code == 400 and "bad repository name" in r.json()["message"], r.text


def test_a_digest_in_another_repository_is_asked_of_the_registry(setup: Setup, api: httpx.Client) -> None:
    """Knowing an image's digest is no right to read it: a digest named in a repository this node
    did not pull it from is asked of the registry (a repository without it: E2B's not found), and
    one that has it gets the same template with no layer fetched; in its own repository, nothing
    is asked."""
    layer = LayerTar().file("secret.txt", f"{uuid.uuid4()}\n".encode()).bytes()
    digest = setup.registry.push_image("team/private", "1", [(BASE, "gzip"), (layer, "gzip")])
    made = api.post("/sandboxes", json={"templateID": f"{setup.proxy.host}/team/private:1", "timeout": 60})
    assert made.status_code == 201, made.text
    api.delete(f"/sandboxes/{made.json()['sandboxID']}")
    template_id = made.json()["templateID"]

    elsewhere = f"{setup.proxy.host}/someone/else@{digest}"
    r = api.post("/sandboxes", json={"templateID": elsewhere})
    assert r.status_code == 404 and "not found" in r.json()["message"], r.text

    setup.registry.push_image("team/mirror", "1", [(BASE, "gzip"), (layer, "gzip")])  # the same image
    before = setup.proxy.total()
    again = api.post("/sandboxes", json={"templateID": f"{setup.proxy.host}/team/mirror@{digest}", "timeout": 60})
    assert again.status_code == 201 and again.json()["templateID"] == template_id, again.text
    api.delete(f"/sandboxes/{again.json()['sandboxID']}")
    assert 1 <= setup.proxy.total() - before <= 2  # its manifest (and config): no layer
    before = setup.proxy.total()
    own = api.post("/sandboxes", json={"templateID": f"{setup.proxy.host}/team/private@{digest}", "timeout": 60})
    assert own.status_code == 201 and own.json()["templateID"] == template_id, own.text
    api.delete(f"/sandboxes/{own.json()['sandboxID']}")
    assert setup.proxy.total() == before


def test_an_image_of_another_platform_is_refused_before_its_layers(setup: Setup, api: httpx.Client) -> None:
    """A single-platform image says its platform in its config only: one for arm64 (or Windows)
    is a 400 naming it, with no layer fetched and nothing made, as an index without amd64 is."""
    before = fs_state(setup.node)
    for repo, platform in (("tests/arm-only", ("linux", "arm64")), ("tests/windows", ("windows", "amd64"))):
        layer = LayerTar().file("arch", platform[1].encode()).bytes()
        setup.registry.push_image(repo, "1", [(layer, "gzip")], platform=platform)
        blob = sha(gzip.compress(layer, mtime=0))
        r = api.post("/sandboxes", json={"templateID": f"{setup.proxy.host}/{repo}:1"})
        assert r.status_code == 400, r.text
        assert f"is {platform[0]}/{platform[1]}, not linux/amd64" in r.json()["message"], r.text
        assert setup.proxy.count(f"blobs/{blob}") == 0
    assert not [t for t in api.get("/templates").json() if "arm-only" in json.dumps(t) or "windows" in json.dumps(t)]
    layers, scratch, _ = fs_state(setup.node)
    assert layers <= before[0] and not scratch


def test_the_native_sdk_and_the_cli_create_from_an_image(setup: Setup, api: httpx.Client) -> None:
    from typer.testing import CliRunner

    from aenv.cli.main import app
    from aenv.sdk import Client

    name, _, _ = task_image(setup.registry, "flask", "pallets__flask-4045", repo_layer("flask"))
    ref = f"{setup.proxy.host}/{name}:latest"
    with Client(setup.node.url, API_KEY) as client:
        sbx = client.create(image=ref, timeout=60)
        try:
            assert sbx.exec("cat /testbed/task.txt").stdout == "pallets__flask-4045\n"
        finally:
            sbx.kill()
    argv = ["--url", setup.node.url, "--api-key", API_KEY, "create", "--image", ref, "-q"]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    api.delete(f"/sandboxes/{result.output.strip()}")
    r = api.post("/sandboxes", json={"templateID": "bb", "image": ref})
    assert r.status_code == 400 and "not both" in r.json()["message"], r.text


def test_a_missing_image_or_tag_is_e2bs_not_found(setup: Setup, api: httpx.Client) -> None:
    before = fs_state(setup.node)
    missing = {
        f"{setup.proxy.host}/swebench/nothing-here:latest": "image '",
        f"{setup.proxy.host}/swebench/sweb.eval.x86_64.django__django-11099@sha256:{'0' * 64}": "image '",
        "bb:v9": "tag 'v9' does not exist for template 'bb'",  # a template's missing tag, never Docker Hub
    }
    for ref, says in missing.items():
        r = api.post("/sandboxes", json={"templateID": ref})
        assert r.status_code == 404 and says in r.json()["message"], r.text
    assert not [t for t in api.get("/templates").json() if "nothing-here" in json.dumps(t)]
    with pytest.raises(Exception, match="not found: the image or tag does not exist") as raised:
        Sandbox.create(template=f"{setup.proxy.host}/swebench/nothing-here:v2")
    assert getattr(raised.value, "status_code", 404) == 404
    assert api.post("/sandboxes", json={"templateID": "Not A/Reference"}).status_code == 400
    layers, scratch, mounts = fs_state(setup.node)
    assert layers <= before[0] and not scratch and set(mounts) <= set(before[2])


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_registry_that_misbehaves_fails_every_waiter_and_leaves_nothing(
    setup: Setup, api: httpx.Client, fault: str
) -> None:
    """A blob that stalls or lies about its size or bytes: each create waiting for the build gets
    the same clear error, the registry was asked once, and nothing is left half-made: no layer,
    no scratch file, no template, no mount. Once the registry behaves, a create makes it."""
    task = f"broken__broken-{abs(hash(fault)) % 10000}"
    # past UNPACK_APART: unpacked by a process of its own while it downloads (BASE, on a thread)
    unique = LayerTar().file("unique.bin", os.urandom(5 * MiB)).bytes()
    name = f"swebench/sweb.eval.x86_64.{task}"
    digest = setup.registry.push_image(name, "latest", [(BASE, "gzip"), (unique, "gzip")])
    spoiled = blobs_of(setup.registry, name, digest)[1]
    ref = f"{setup.proxy.host}/{name}:latest"
    spoil, status, says = FAULTS[fault]
    setup.proxy.faults[f"/v2/{name}/blobs/{spoiled}"] = spoil
    before = fs_state(setup.node)
    started = time.monotonic()
    answers = asyncio.run(create_all(setup.node.url, [ref] * 3))
    assert time.monotonic() - started < 30
    errors = {(r.status_code, r.json()["message"]) for r in answers}
    assert len(errors) == 1, errors  # the same error for every create that waited
    ((code, message),) = errors
    assert code == status and says in message and ref in message, (code, message)
    assert setup.proxy.count(f"blobs/{spoiled}") == 1  # one pull for the three creates
    layers, scratch, mounts = fs_state(setup.node)
    assert layer_dir(unique) not in layers
    assert not scratch and set(mounts) <= set(before[2]) and layers <= before[0] | {layer_dir(BASE)}
    assert not [t for t in api.get("/templates").json() if ref in t["aliases"]]

    del setup.proxy.faults[f"/v2/{name}/blobs/{spoiled}"]
    if fault == "stalls":  # nothing of the failure was remembered: the next create makes it
        Sandbox.create(template=ref, timeout=60).kill()


def test_private_registries_take_the_nodes_logins_or_one_given_once(setup: Setup, api: httpx.Client) -> None:
    """A registry that wants a login: E2B's "access denied" (403, not a 401 that would read as the
    API key's) until AENV_REGISTRY_AUTH (a Docker config, read at each pull) has one for it; or a
    client pulls the image once with its own login, and creates by the reference use that."""
    setup.locked.push_image("team/app", "1", [(BASE, "gzip"), (LayerTar().file("secret", b"inside\n").bytes(), "gzip")])
    ref = f"{setup.locked.host}/team/app:1"
    r = api.post("/sandboxes", json={"templateID": ref})
    assert r.status_code == 403, r.text
    assert r.json()["message"].startswith(f"access denied to '{ref}': authentication required"), r.text
    login = base64.b64encode(b"alice:s3cret-pw").decode()
    setup.auth_file.write_text(json.dumps({"auths": {setup.locked.host: {"auth": login}}}))
    try:
        sbx = Sandbox.create(template=ref, timeout=60)
        try:
            assert sbx.commands.run("cat /secret").stdout == "inside\n"
        finally:
            sbx.kill()
    finally:
        setup.auth_file.unlink()
    assert "s3cret" not in json.dumps(api.get("/templates").json())

    # A client's own login, given once to the from-image API (for that pull only, never kept): the
    # template it makes is what creates by the reference restore, with no login.
    setup.locked.push_image("team/tool", "2", [(BASE, "gzip"), (LayerTar().file("tool", b"tool\n").bytes(), "gzip")])
    tool = f"{setup.locked.host}/team/tool:2"
    made = api.post(
        "/templates/from-image", json={"name": "tool", "image": tool, "username": "alice", "password": "s3cret-pw"}
    )
    assert made.status_code == 201, made.text
    sbx = Sandbox.create(template=tool, timeout=60)
    try:
        assert sbx.commands.run("cat /tool").stdout == "tool\n" and sbx.get_info().template_id == "tool"
    finally:
        sbx.kill()


def test_the_template_is_listed_deleted_and_made_again(setup: Setup, api: httpx.Client) -> None:
    name, digest, blobs = task_image(setup.registry, "requests", "psf__requests-2317", repo_layer("requests"))
    ref = f"{setup.proxy.host}/{name}:latest"
    first = api.post("/sandboxes", json={"templateID": ref, "timeout": 60})
    assert first.status_code == 201, first.text
    template = api.get(f"/templates/{digest.replace(':', '-')}").json()
    assert ref in template["aliases"] and template["sandboxes"] == 1
    assert api.delete(f"/templates/{template['name']}").status_code == 409  # in use
    api.delete(f"/sandboxes/{first.json()['sandboxID']}")
    assert api.delete(f"/templates/{template['name']}").status_code == 204
    assert api.get(f"/templates/{template['name']}").status_code == 404
    again = api.post("/sandboxes", json={"templateID": ref, "timeout": 60})
    assert again.status_code == 201, again.text
    rebuilt = api.get(f"/templates/{digest.replace(':', '-')}").json()
    assert rebuilt["templateID"] != template["templateID"] and ref in rebuilt["aliases"]
    assert all(setup.proxy.count(f"blobs/{b}") == 1 for b in blobs[:-1])  # its layers stayed as a cache


def test_a_malformed_registry_auth_stops_the_server_at_once(tmp_path: Path) -> None:
    """Inline AENV_REGISTRY_AUTH that is no Docker config: exit code 2 naming it, no secret echoed."""
    import subprocess
    import sys

    for value in ('{"auths": {"r:5000": {"auth": "c2VjcmV0"}}', '{"auths": ["r:5000"]}'):
        env = {"AENV_REGISTRY_AUTH": value, "PATH": "/usr/bin:/bin"}
        argv = [sys.executable, "-m", "aenv.cli.main", "server", "--data-dir", str(tmp_path), "--port", "1"]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "AENV_REGISTRY_AUTH" in done.stderr, done.stderr
        assert "c2VjcmV0" not in done.stderr
