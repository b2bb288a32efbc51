"""A burst of creates (an RL fleet starting its rollouts at once): every one is answered, 201 with a
sandbox or 429 with ``Retry-After`` and a JSON ``{code, message}`` once the node is full; never a
dropped connection, a timeout or a 5xx, and never more sandboxes than ``AENV_MAX_SANDBOXES``.

One node for the module, on a busybox template (nothing to debootstrap), with a small limit.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import API_KEY, Server, start_busybox_node
from tests.node.test_restart import runsc_containers

pytestmark = pytest.mark.sandbox

MAX_SANDBOXES = 6
BURST = 40


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_busybox_node(tmp_path_factory.mktemp("burst") / "data", {"AENV_MAX_SANDBOXES": str(MAX_SANDBOXES)})
    yield srv
    srv.stop()


async def burst(url: str, count: int, body: dict[str, object]) -> list[httpx.Response | BaseException]:
    """``count`` creates at the same moment, each from a client (connection) of its own."""
    start = asyncio.Event()

    async def one() -> httpx.Response:
        async with httpx.AsyncClient(base_url=url, headers={"X-API-Key": API_KEY}, timeout=120) as client:
            await start.wait()
            return await client.post("/sandboxes", json=body)

    tasks = [asyncio.ensure_future(one()) for _ in range(count)]
    await asyncio.sleep(0.2)
    start.set()
    return list(await asyncio.gather(*tasks, return_exceptions=True))


def check(answers: list[httpx.Response | BaseException]) -> list[str]:
    """The ids of the sandboxes made; every other answer must be a well-formed 429."""
    made = []
    for answer in answers:
        assert isinstance(answer, httpx.Response), repr(answer)  # no dropped connection, no timeout
        if answer.status_code == 201:
            made.append(answer.json()["sandboxID"])
            continue
        assert answer.status_code == 429, answer.text
        body = answer.json()
        assert isinstance(body.get("code"), int) and isinstance(body.get("message"), str), body
        assert int(answer.headers["Retry-After"]) >= 1
    return made


def hits_of(api: httpx.Client) -> float:
    found = re.search(r'^aenv_warm_pool_creates_total\{outcome="hit"\} ([0-9.e+]+)$', api.get("/metrics").text, re.M)
    return float(found.group(1)) if found else 0.0


def kill_all(node: Server, ids: list[str]) -> None:
    with node.client() as api:
        for sid in ids:
            assert api.delete(f"/sandboxes/{sid}").status_code == 204


def quiet(node: Server) -> None:
    """Until runsc lists no container: the previous test's teardowns, or the template build's
    (its sandbox is dead at once; runsc's own delete of it goes on in the background)."""
    deadline = time.monotonic() + 30
    while runsc_containers(node) and time.monotonic() < deadline:
        time.sleep(0.3)


def test_a_burst_past_the_limit_is_answered_201_or_429_and_never_overfills(node: Server) -> None:
    quiet(node)
    answers = asyncio.run(burst(node.url, BURST, {"templateID": "bb", "timeout": 120}))
    made = check(answers)
    try:
        assert 1 <= len(made) <= MAX_SANDBOXES
        with node.client() as api:
            listed = [sb["sandboxID"] for sb in api.get("/sandboxes").json()]
        assert sorted(listed) == sorted(made)
        assert len(runsc_containers(node)) <= MAX_SANDBOXES
    finally:
        kill_all(node, made)


def test_a_burst_within_the_limit_all_succeed_and_run(node: Server) -> None:
    quiet(node)
    answers = asyncio.run(burst(node.url, MAX_SANDBOXES, {"templateID": "bb", "timeout": 120}))
    made = check(answers)
    try:
        assert len(made) == MAX_SANDBOXES
        with node.client() as api:
            for sid in made:
                r = api.get(f"/sandboxes/{sid}")
                assert r.status_code == 200 and r.json()["state"] == "running", r.text
    finally:
        kill_all(node, made)


def test_a_burst_with_a_warm_pool_takes_members_and_restores_and_never_overfills(node: Server) -> None:
    with node.client() as api:
        assert api.put("/templates/bb/warm-pool", json={"size": 3}).status_code == 200
        deadline = time.monotonic() + 60
        while api.get("/templates/bb/warm-pool").json()["ready"] < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        hits = hits_of(api)
    answers = asyncio.run(burst(node.url, BURST, {"templateID": "bb", "timeout": 120}))
    made = check(answers)
    try:
        assert 1 <= len(made) <= MAX_SANDBOXES
        with node.client() as api:
            assert hits_of(api) == hits + 3  # every member taken, no more
            assert sorted(sb["sandboxID"] for sb in api.get("/sandboxes").json()) == sorted(made)
            for sid in made:
                assert api.get(f"/sandboxes/{sid}").json()["state"] == "running"
    finally:
        kill_all(node, made)
        with node.client() as api:
            api.put("/templates/bb/warm-pool", json={"size": None})


def test_resumes_count_against_the_limit_as_creates_do(node: Server) -> None:
    """A paused sandbox holds no room, so the node fills up with others; resuming it then would
    run one sandbox past AENV_MAX_SANDBOXES: 429 with Retry-After, and it stays paused, whole.
    A burst of resumes of many paused sandboxes at once never overfills either."""
    with node.client() as api:
        paused = []
        for _ in range(MAX_SANDBOXES):
            r = api.post("/sandboxes", json={"templateID": "bb", "timeout": 120})
            assert r.status_code == 201, r.text
            sid = r.json()["sandboxID"]
            assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
            paused.append(sid)
        fillers = check(asyncio.run(burst(node.url, MAX_SANDBOXES - 2, {"templateID": "bb", "timeout": 120})))
        try:
            assert len(fillers) == MAX_SANDBOXES - 2
            answers = asyncio.run(resume_burst(node.url, paused))
            resumed = check(answers)
            assert len(resumed) == 2, [a.status_code for a in answers if isinstance(a, httpx.Response)]
            listed = api.get("/sandboxes", params={"state": "running"}).json()
            assert len(listed) == MAX_SANDBOXES
            deadline = time.monotonic() + 30  # the paused ones' old instances go in the background
            while len(runsc_containers(node)) > MAX_SANDBOXES:
                assert time.monotonic() < deadline, runsc_containers(node)
                time.sleep(0.3)
            refused = [sid for sid in paused if sid not in resumed]
            for sid in refused:  # untouched: paused, and resumes once there is room
                assert api.get(f"/sandboxes/{sid}").json()["state"] == "paused"
            r = api.post(f"/sandboxes/{refused[0]}/connect", json={"timeout": 60})
            assert r.status_code == 429 and "at most" in r.json()["message"], r.text
            assert api.delete(f"/sandboxes/{fillers[0]}").status_code == 204
            fillers = fillers[1:]
            r = api.post(f"/sandboxes/{refused[0]}/connect", json={"timeout": 60})
            assert r.status_code == 201, r.text
            assert api.get(f"/sandboxes/{refused[0]}").json()["state"] == "running"
        finally:
            kill_all(node, [*paused, *fillers])


async def resume_burst(url: str, ids: list[str]) -> list[httpx.Response | BaseException]:
    """Each paused sandbox resumed at the same moment; a 201 answer is shaped as a create's."""

    async def one(sid: str) -> httpx.Response:
        async with httpx.AsyncClient(base_url=url, headers={"X-API-Key": API_KEY}, timeout=120) as client:
            return await client.post(f"/sandboxes/{sid}/connect", json={"timeout": 60})

    return list(await asyncio.gather(*(one(sid) for sid in ids), return_exceptions=True))


def test_a_create_is_refused_while_the_host_is_short_of_memory(tmp_path: Path) -> None:
    from aenv.config import Settings
    from aenv.errors import LimitExceeded
    from aenv.node.orchestrator import Node

    node = Node(Settings(data_dir=tmp_path / "data", min_free_memory_mb=10**9))
    with pytest.raises(LimitExceeded, match="memory available"):
        asyncio.run(node.create("base"))
    assert node.sandboxes == {}
