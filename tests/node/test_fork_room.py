"""A fork takes the node's room into account (aenv/node/creation.py ``fork``): it makes as many
children as the node has room for (AENV_MAX_SANDBOXES) and answers the rest with a per-child 429
in the same 201 list; with no room at all the whole fork is a 429. Concurrent forks never overfill
the node: the room check and the children's entries happen with nothing awaited between.

One node for the module, at most 3 sandboxes, on a busybox template (nothing to debootstrap).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox

from tests.conftest import Server, e2b_client, start_busybox_node

pytestmark = [pytest.mark.sandbox, pytest.mark.fast]  # the fast tier runs it on the fake runtime

MAX = 3


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    env = {
        "AENV_MAX_SANDBOXES": str(MAX),
        "AENV_MIN_FREE_MEMORY_MB": "0",  # the machine is shared: only the sandbox limit decides here
        "AENV_SPARE_UPPERS": "0",
    }
    srv = start_busybox_node(tmp_path_factory.mktemp("forkroom") / "data", env)
    yield srv
    srv.stop()


@pytest.fixture()
def api(node: Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[httpx.Client]:
    yield from e2b_client(node, monkeypatch, empty_after=True)


def running(api: httpx.Client) -> int:
    return len(api.get("/sandboxes").json())


def test_a_fork_makes_the_children_that_fit_and_refuses_the_rest_in_its_list(api: httpx.Client) -> None:
    source = Sandbox.create(template="bb", timeout=300)
    source.files.write("/home/user/mark.txt", "from the source")
    r = api.post(f"/sandboxes/{source.sandbox_id}/fork", json={"count": 4, "timeout": 120})
    assert r.status_code == 201, r.text
    results = r.json()
    assert len(results) == 4
    made = [item["sandbox"]["sandboxID"] for item in results if "sandbox" in item]
    refused = [item["error"] for item in results if "error" in item]
    assert len(made) == MAX - 1 and len(refused) == 2
    assert all("sandbox" in item for item in results[: MAX - 1])  # children first, then the refusals
    for error in refused:
        assert error["code"] == 429 and error["error_code"] == "limit_exceeded"
        assert f"at most {MAX} sandboxes" in error["message"]
    assert running(api) == MAX  # never more than the node runs
    for child in made:
        assert Sandbox.connect(child).files.read("/home/user/mark.txt") == "from the source"
    assert source.files.read("/home/user/mark.txt") == "from the source"  # the source runs on


def test_a_fork_with_no_room_at_all_is_refused_whole(api: httpx.Client) -> None:
    source = Sandbox.create(template="bb", timeout=300)
    first = api.post(f"/sandboxes/{source.sandbox_id}/fork", json={"count": MAX - 1})
    assert first.status_code == 201 and all("sandbox" in item for item in first.json()), first.text
    r = api.post(f"/sandboxes/{source.sandbox_id}/fork", json={"count": 1})
    assert r.status_code == 429, r.text
    assert r.json()["code"] == 429 and r.headers["retry-after"] == "1"
    assert running(api) == MAX
    assert api.get(f"/sandboxes/{source.sandbox_id}").json()["state"] == "running"


def test_concurrent_forks_share_the_room_and_never_overfill(api: httpx.Client) -> None:
    sources = [Sandbox.create(template="bb", timeout=300) for _ in range(2)]  # one place left
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda s: api.post(f"/sandboxes/{s.sandbox_id}/fork", json={"count": 2}), sources))
    children = 0
    for r in answers:
        assert r.status_code in (201, 429), r.text
        if r.status_code == 201:
            children += sum(1 for item in r.json() if "sandbox" in item)
            assert len(r.json()) == 2
    assert children == 1
    assert running(api) == MAX
