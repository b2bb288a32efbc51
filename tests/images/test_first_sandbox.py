"""A new image's first sandbox (aenv/node/warmpool.py, "first sandbox"): the first create of an
image takes the sandbox its template was snapshotted from (checkpointed leaving it running)
instead of a restore of that snapshot. It must be exactly what a restored sandbox would be (the
create's id, env, user and network rules), and what it does after the snapshot must never reach
the template: a later create of the image restores the image as it was. Among creates waiting for
one build, one takes it; one nobody takes is stopped.

Real runsc sandboxes, a real registry (Debian's docker-registry), the real E2B SDK.
Seen failing before the change: every create was a restore (no first sandbox was ever claimed).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from e2b import Sandbox

from tests.conftest import API_KEY, Server, e2b_client, start_busybox_node
from tests.images.oci import LayerTar, Registry, busybox_layer, start_registry
from tests.node.test_restart import runsc_containers
from tests.node.test_warm_pool import instances

pytestmark = pytest.mark.sandbox
KEPT_SECONDS = 6  # the node's AENV_FIRST_SANDBOX_SECONDS: long enough for a loaded machine's create
SETTLE = 60.0  # how long a stopped instance may take to go, on a busy two-core machine
SNAPSHOTTED_FROM = "was snapshotted from"  # the first sandbox's event line
BASE = busybox_layer().bytes()


@dataclass
class Setup:
    node: Server
    registry: Registry


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    registry_gen = start_registry(tmp_path_factory.mktemp("registry"))
    registry = next(registry_gen)
    env = {"AENV_FIRST_SANDBOX_SECONDS": str(KEPT_SECONDS), "AENV_SPARE_UPPERS": "0"}
    node = None
    try:
        node = start_busybox_node(tmp_path_factory.mktemp("node") / "data", env)
        yield Setup(node, registry)
    finally:
        if node is not None:
            node.stop()
            assert runsc_containers(node) == set()  # a kept first sandbox goes with the node
        next(registry_gen, None)


@pytest.fixture()
def api(setup: Setup, monkeypatch: pytest.MonkeyPatch) -> Iterator[httpx.Client]:
    yield from e2b_client(setup.node, monkeypatch, empty_after=True)


def push(setup: Setup, task: str) -> str:
    """An image ``tasks/<task>:latest`` with a task layer of two files and ``TASK=<task>``; its reference."""
    layer = LayerTar().dir("testbed").file("testbed/keep.txt", b"kept\n").file("testbed/gone.txt", b"gone\n")
    layers = [(BASE, "gzip"), (layer.bytes(), "gzip")]
    setup.registry.push_image(f"tasks/{task}", "latest", layers, env=[f"TASK={task}"])
    return f"{setup.registry.host}/tasks/{task}:latest"


def firsts(api: httpx.Client) -> dict[str, float]:
    text = api.get("/metrics").text
    found = re.findall(r'^aenv_image_first_sandboxes_total\{outcome="(\w+)"\} ([0-9.e+]+)$', text, re.M)
    return {outcome: float(n) for outcome, n in found}


def was_first(api: httpx.Client, sandbox_id: str) -> bool:
    logs = api.get(f"/sandboxes/{sandbox_id}/logs").json()["logs"]
    return any(SNAPSHOTTED_FROM in entry["line"] for entry in logs)


def test_the_first_create_is_the_snapshotted_sandbox_and_its_later_writes_stay_its_own(
    setup: Setup, api: httpx.Client
) -> None:
    ref = push(setup, "first")
    before = firsts(api)
    sbx = Sandbox.create(
        template=ref, timeout=120, envs={"FOO": "bar"}, metadata={"run": "1"}, allow_internet_access=False
    )
    sid = sbx.sandbox_id
    assert firsts(api).get("claimed", 0) == before.get("claimed", 0) + 1
    assert was_first(api, sid)
    assert len(instances(setup.node, 1)) == 1  # the sandbox: nothing was restored for it
    # The image's two layers and the conventions: the runtime's mount points are made there, so the
    # sandbox's boot wrote nothing to its upper and the template has no copy of it as a layer.
    template = api.get(f"/templates/{sbx.get_info().template_id}").json()
    assert template["layers"] == 3, template
    # Everything of the create, as a restored sandbox gets it at its restore.
    said = sbx.commands.run("echo $FOO $E2B_SANDBOX_ID $TASK; id -un; cat /testbed/keep.txt").stdout.split()
    assert said == ["bar", sid, "first", "root", "kept"]  # the image names no User: Docker's root
    info = api.get(f"/sandboxes/{sid}").json()
    assert info["metadata"] == {"run": "1"} and info["allowInternetAccess"] is False
    ask = "printf 'CONNECT 1.1.1.1:80 HTTP/1.1\\r\\nHost: 1.1.1.1:80\\r\\n\\r\\n' | nc -w 5 127.0.0.1 3128"
    refused = sbx.commands.run(ask + " 2>&1 || true").stdout
    assert refused.startswith("HTTP/1.1 403"), refused

    # Its writes after the snapshot: a file made, one of the image's removed.
    sbx.files.write("/home/user/mine.txt", "mine")
    sbx.commands.run("rm /testbed/gone.txt", user="root")

    # They outlive a pause, and nothing of the template comes back from under its upper.
    assert sbx.beta_pause()
    sbx = Sandbox.connect(sid)
    assert sbx.commands.run("ls /testbed").stdout.split() == ["keep.txt"]
    assert sbx.files.read("/home/user/mine.txt") == "mine"
    assert sbx.commands.run("echo $FOO $E2B_SANDBOX_ID").stdout.split() == ["bar", sid]

    # A later create of the image restores the template: the image as it was, none of the above.
    other = Sandbox.create(template=ref, timeout=120)
    assert not was_first(api, other.sandbox_id)
    assert other.commands.run("ls /testbed").stdout.split() == ["gone.txt", "keep.txt"]
    assert other.commands.run("test -e /home/user/mine.txt || echo absent").stdout.strip() == "absent"
    assert other.commands.run("echo ${FOO:-unset} $E2B_SANDBOX_ID").stdout.split() == ["unset", other.sandbox_id]
    # The first sandbox forks like any other, its children with its own files.
    r = api.post(f"/sandboxes/{sid}/fork", json={"count": 1})
    assert r.status_code == 201, r.text
    child = Sandbox.connect(r.json()[0]["sandbox"]["sandboxID"])
    assert child.files.read("/home/user/mine.txt") == "mine"
    assert child.commands.run("ls /testbed").stdout.split() == ["keep.txt"]


async def create_all(url: str, body: dict[str, object], count: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, headers={"X-API-Key": API_KEY}, timeout=300) as client:
        return await asyncio.gather(*(client.post("/sandboxes", json=body) for _ in range(count)))


def test_of_creates_waiting_for_one_build_one_takes_the_first_sandbox(setup: Setup, api: httpx.Client) -> None:
    ref = push(setup, "burst")
    before = firsts(api)
    answers = asyncio.run(create_all(setup.node.url, {"templateID": ref, "timeout": 120}, 4))
    assert [r.status_code for r in answers] == [201] * 4, [r.text for r in answers]
    ids = [r.json()["sandboxID"] for r in answers]
    assert len(set(ids)) == 4
    assert sum(was_first(api, sid) for sid in ids) == 1
    assert firsts(api).get("claimed", 0) == before.get("claimed", 0) + 1
    for sid in ids:
        sbx = Sandbox.connect(sid)
        assert sbx.commands.run("echo $E2B_SANDBOX_ID $TASK; ls /testbed").stdout.split() == [
            sid,
            "burst",
            "gone.txt",
            "keep.txt",
        ]
    assert len(instances(setup.node, 4)) == 4  # no instance besides the four sandboxes


def test_a_first_sandbox_no_create_can_take_is_stopped(setup: Setup, api: httpx.Client) -> None:
    """A create asking other limits than the template's cannot take it (its cgroups and upper are
    fixed): it restores, and the first sandbox is stopped once its time is up."""
    ref = push(setup, "unclaimed")
    before = firsts(api)
    r = api.post("/sandboxes", json={"templateID": ref, "timeout": 120, "limits": {"memoryMB": 384}})
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    assert not was_first(api, sid)
    assert Sandbox.connect(sid).commands.run("cat /testbed/keep.txt").stdout == "kept\n"
    deadline = time.monotonic() + KEPT_SECONDS + SETTLE
    while firsts(api).get("unclaimed", 0) < before.get("unclaimed", 0) + 1 and time.monotonic() < deadline:
        time.sleep(0.3)
    assert firsts(api).get("unclaimed", 0) == before.get("unclaimed", 0) + 1
    assert firsts(api).get("claimed", 0) == before.get("claimed", 0)
    assert len(instances(setup.node, 1)) == 1  # the restored sandbox only
    # A create after that restores, as for any template.
    later = api.post("/sandboxes", json={"templateID": ref, "timeout": 60})
    assert later.status_code == 201 and not was_first(api, later.json()["sandboxID"])


def test_a_prefetched_image_keeps_no_first_sandbox(setup: Setup, api: httpx.Client) -> None:
    ref = push(setup, "prefetched")
    before = firsts(api)
    r = api.post("/images/prefetch", json={"images": [ref]})
    assert r.status_code == 202, r.text
    deadline = time.monotonic() + SETTLE
    while not any(ref in t.get("aliases", []) for t in api.get("/templates").json()) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert instances(setup.node, 0) == set()  # built in a build sandbox, stopped
    sbx = Sandbox.create(template=ref, timeout=60)
    assert not was_first(api, sbx.sandbox_id)
    assert firsts(api) == before
