"""Many sandboxes moved across nodes again and again: 12 sandboxes (20 until CI ran past its
time), each with a process counting in its memory and a file written, go round the cluster (a
drain with move; a drain without move and a connect through a gateway; a pause, its node lost, a
connect), and after every move each counts on from where it was, with its file, env, metadata and
id. On S3 (a moto server: every node's repository); AENV_LOOP_REPOS=posix,s3 runs it on the
session's directory repository too (CI runs S3 only, for time: the directory repository's
durable moves are tested in test_durable_resume and test_drain). One cluster per repository."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
from e2b import Sandbox

from aenv.repo.backends import Backend, PosixBackend
from aenv.repo.repository import ENTRY_DIRS, Repository, artifact_key, object_keys
from tests.cluster.cluster import LEASE_TTL, Cluster, directory_entry, running_cluster, use_gateway, wait_for_nodes
from tests.cluster.test_drain import drained
from tests.conftest import REPO_DIR, Server
from tests.durable import COUNTER, count, wait_for
from tests.repo.conftest import s3  # noqa: F401 - the session's moto server, a fixture here too
from tests.repo.s3 import REGION, S3_KEY, S3Endpoint

pytestmark = pytest.mark.sandbox

SANDBOXES = 12
REPOS = [r.strip() for r in os.environ.get("AENV_LOOP_REPOS", "s3").split(",") if r.strip()]
T = TypeVar("T")


@dataclass
class Tracked:
    """A sandbox of the loop and what it must show after each move."""

    index: int
    sandbox_id: str
    counted: int = 0  # the counter's value seen last: it only grows

    @property
    def content(self) -> str:
        return f"sandbox {self.index} wrote this"


def each(items: list[T], fn: Callable[[T], Any]) -> list[Any]:
    """``fn`` over ``items``, a few at a time (the machine has two cores)."""
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(fn, items))


def seed_templates(source: Repository, target: Backend) -> None:
    """Copy the source repository's templates (`base`: entries, manifests, chunks) into ``target``,
    so the nodes, which hold them already, find them there instead of committing them again."""
    keys: set[str] = set()
    for entry_info in source.backend.list(ENTRY_DIRS["template"]):
        keys.add(entry_info.key)
    for entry in source.entries("template"):
        for ref in source.artifact_refs(entry):
            keys.add(artifact_key(ref.kind, ref.id))
            keys.update(object_keys(source.read_manifest(ref, "seed")))  # loose chunks or packs
    each(sorted(keys), lambda key: target.put(key, source.backend.get(key)))


@pytest.fixture(scope="module", params=REPOS)
def cluster(request: pytest.FixtureRequest, server: Server) -> Iterator[Cluster]:
    node_env: dict[str, str] = {}
    if request.param == "s3":
        endpoint: S3Endpoint = request.getfixturevalue("s3")
        bucket = endpoint.new_bucket()
        started = time.monotonic()
        seed_templates(Repository(PosixBackend(REPO_DIR)), endpoint.backend(bucket, "loop"))
        print(f"seeded S3 with the templates in {time.monotonic() - started:.1f}s")
        node_env = {
            "AENV_REPO": f"s3://{bucket}/loop",
            "AENV_REPO_S3_ENDPOINT": endpoint.url,
            "AENV_REPO_S3_REGION": REGION,
            "AENV_REPO_S3_ACCESS_KEY_ID": S3_KEY["access_key_id"],
            "AENV_REPO_S3_SECRET_ACCESS_KEY": S3_KEY["secret_access_key"],
        }
    with running_cluster(node_env={name: node_env for name in ("node-a", "node-b")} if node_env else None) as c:
        for node in c.nodes.values():  # each on the repository meant, `base` found there (not committed again)
            with node.client() as direct:
                repository = direct.get("/repository").json()
            assert repository["url"].startswith("s3://" if node_env else "file://") and repository["pending"] == [], (
                repository
            )
        yield c


def make(node: Server, index: int) -> Tracked:
    """A sandbox on ``node``, counting, with its file written."""
    with node.client() as direct:
        body = {
            "templateID": "base",
            "timeout": 900,
            "metadata": {"loop": str(index)},
            "envVars": {"MARK": f"m{index}"},
        }
        r = direct.post("/sandboxes", json=body)
        assert r.status_code == 201, r.text
    tracked = Tracked(index, r.json()["sandboxID"])
    sbx = Sandbox.connect(tracked.sandbox_id, api_url=node.url, sandbox_url=node.url)  # before the gateways know it
    sbx.files.write("/home/user/state.txt", tracked.content)
    sbx.commands.run(COUNTER, background=True, timeout=0)  # no deadline: it counts through every round
    sbx.commands.run("until [ -s /home/user/count ]; do sleep 0.1; done", timeout=30)
    tracked.counted = count(sbx)
    return tracked


def check(cluster: Cluster, tracked: Tracked, on: str) -> None:
    """Running on node ``on`` (through gateway 1): its counter goes on from where it was, its file,
    env and metadata are its own."""
    entry = directory_entry(cluster, tracked.sandbox_id)
    assert entry is not None and entry.node_id == on and entry.state == "running", (tracked, entry)
    sbx = Sandbox.connect(tracked.sandbox_id)
    now = count(sbx)
    assert now >= tracked.counted, (tracked, now)  # the same process, its memory kept
    try:
        tracked.counted = wait_for(lambda: (c := count(sbx)) > now and c, 20)
    except AssertionError:
        processes = sbx.commands.run("ps -eo pid,stat,etime,args").stdout
        raise AssertionError(f"{tracked} stopped counting at {now} on {on}:\n{processes}") from None
    assert sbx.files.read("/home/user/state.txt") == tracked.content
    assert sbx.commands.run("echo $MARK").stdout.strip() == f"m{tracked.index}"
    with cluster.api(1) as api:
        r = api.get(f"/sandboxes/{tracked.sandbox_id}")
        assert r.status_code == 200 and r.headers["x-aenv-node-id"] == on, r.text
        assert r.json()["metadata"] == {"loop": str(tracked.index)} and r.json()["state"] == "running"


def connect_through_gateway(cluster: Cluster, tracked: Tracked) -> str:
    with cluster.api(1) as api:
        r = api.post(f"/sandboxes/{tracked.sandbox_id}/connect", json={"timeout": 900})
        assert r.status_code == 201, r.text
        return str(r.headers["x-aenv-node-id"])


def restart(cluster: Cluster, name: str) -> None:
    """Start node ``name`` again (stopped or drained: a restart ends a drain), known to the gateways."""
    cluster.nodes[name].restart()  # on its port: the gateways reach it where they knew it
    for gateway in cluster.gateways:
        wait_for_nodes(gateway, set(cluster.nodes))


def test_sandboxes_go_round_the_cluster(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    started = time.monotonic()
    use_gateway(cluster, 1, monkeypatch)
    a, b = cluster.nodes
    sandboxes = each(list(range(SANDBOXES)), lambda i: make(cluster.nodes[a], i))
    laps = [f"made {SANDBOXES}: {time.monotonic() - started:.1f}s"]
    try:
        # 1. a drain with move: each runs on, on the other node
        last = drained(cluster, a, move=True)[-1]
        assert (last["total"], last["moved"], last["failed"]) == (SANDBOXES, SANDBOXES, 0), last
        each(sandboxes, lambda t: check(cluster, t, b))
        laps.append(f"drain {a} with move: {time.monotonic() - started:.1f}s")
        restart(cluster, a)

        # 2. a drain without move: paused durably on b; a connect through a gateway resumes elsewhere
        last = drained(cluster, b, move=False)[-1]
        assert (last["total"], last["durable"], last["failed"]) == (SANDBOXES, SANDBOXES, 0), last
        assert set(each(sandboxes, lambda t: connect_through_gateway(cluster, t))) == {a}
        each(sandboxes, lambda t: check(cluster, t, a))
        laps.append(f"drain {b}, connect: {time.monotonic() - started:.1f}s")
        restart(cluster, b)

        # 3. paused through a gateway, durable; the node is lost (kill -9); a connect resumes elsewhere
        with cluster.api(0) as api:
            each(sandboxes, lambda t: api.post(f"/sandboxes/{t.sandbox_id}/pause").raise_for_status())
        for tracked in sandboxes:  # the directory's word (a node's GET says durable a tick before it)
            wait_for(lambda: (e := directory_entry(cluster, tracked.sandbox_id)) is not None and e.durable)  # noqa: B023
        cluster.nodes[a].stop(signal.SIGKILL)
        for gateway in cluster.gateways:
            wait_for_nodes(gateway, {b}, timeout=LEASE_TTL + 15)
        assert set(each(sandboxes, lambda t: connect_through_gateway(cluster, t))) == {b}
        each(sandboxes, lambda t: check(cluster, t, b))
        laps.append(f"pause, {a} lost, connect: {time.monotonic() - started:.1f}s")
    finally:
        with cluster.api(1) as api:
            each(sandboxes, lambda t: api.delete(f"/sandboxes/{t.sandbox_id}"))
        if cluster.nodes[a].proc.poll() is not None:
            restart(cluster, a)  # back, so its stale copies go (and the next module finds it whole)
    print("; ".join(laps))
