"""Per-team quotas on one node: running and paused sandboxes, creates per second, fork size, disk.
Every refusal is a 429 with Retry-After and E2B's words, never a 5xx or a dropped connection;
``?wait=`` makes a burst queue. Seen failing with the node's count off (``NodeQuotas.team_room``
always giving room): the bounded-wait, fork and disk tests got 201s where the 429s belong."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.conftest import Server
from tests.teams.conftest import TeamKey, new_team

pytestmark = pytest.mark.sandbox
RUNNING_WORDS = "maximum number of concurrent E2B sandboxes"


async def _burst(team: TeamKey, count: int, *, wait: float | None = None, kill: bool = False) -> list[httpx.Response]:
    """``count`` creates at once, each on a connection of its own; with ``kill``, each sandbox is
    killed as soon as its create answers (so the next queued create finds room)."""
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    params = {"wait": str(wait)} if wait is not None else None
    async with httpx.AsyncClient(
        base_url=team.url, headers={"X-API-Key": team.key}, timeout=(wait or 0) + 180, limits=limits
    ) as client:

        async def one() -> httpx.Response:
            r = await client.post("/sandboxes", json={"templateID": "bb", "timeout": 120}, params=params)
            if kill and r.status_code == 201:
                await client.delete(f"/sandboxes/{r.json()['sandboxID']}")
            return r

        return list(await asyncio.gather(*(one() for _ in range(count))))


def _kill_all(team: TeamKey) -> None:
    with team.client() as client:
        for item in client.get("/v2/sandboxes").json():
            client.delete(f"/sandboxes/{item['sandboxID']}")


def test_a_burst_of_200_creates_gets_429s_with_retry_after_and_no_more_than_the_quota(admin: httpx.Client) -> None:
    from e2b import Sandbox
    from e2b.exceptions import RateLimitException

    team = new_team(admin, "burst", maxRunning=4)
    try:
        answers = asyncio.run(_burst(team, 200))  # a dropped connection raises here
        statuses = [r.status_code for r in answers]
        assert statuses.count(201) == 4, sorted(set(statuses))
        assert statuses.count(429) == 196
        for r in answers:
            if r.status_code == 429:
                assert int(r.headers["retry-after"]) >= 1
                body = r.json()
                assert body["code"] == 429 and RUNNING_WORDS in body["message"] and "(4)" in body["message"]
        with team.client() as client:
            assert len(client.get("/v2/sandboxes").json()) == 4
        with pytest.raises(RateLimitException, match=RUNNING_WORDS):
            Sandbox.create("bb", api_key=team.key, api_url=team.url, sandbox_url=team.url)
    finally:
        _kill_all(team)


def test_a_burst_that_waits_queues_and_completes(admin: httpx.Client) -> None:
    team = new_team(admin, "queue", maxRunning=8)
    try:
        answers = asyncio.run(_burst(team, 200, wait=300, kill=True))
        assert [r.status_code for r in answers] == [201] * 200, {r.status_code: r.text[:200] for r in answers}
        assert len({r.json()["sandboxID"] for r in answers}) == 200
    finally:
        _kill_all(team)


def test_wait_is_bounded_and_checked(admin: httpx.Client) -> None:
    team = new_team(admin, "bounded", maxRunning=1)
    try:
        with team.client() as client:
            assert client.post("/sandboxes", json={"templateID": "bb"}).status_code == 201
            started = time.monotonic()
            r = client.post("/sandboxes", json={"templateID": "bb"}, params={"wait": "1.5"})
            assert r.status_code == 429 and 1.4 <= time.monotonic() - started < 30
            for bad in ("-1", "nan", "soon"):
                assert client.post("/sandboxes", json={"templateID": "bb"}, params={"wait": bad}).status_code == 400
    finally:
        _kill_all(team)


def test_creates_per_second(admin: httpx.Client) -> None:
    team = new_team(admin, "rate", createsPerSecond=2)
    try:
        answers = asyncio.run(_burst(team, 10))
        statuses = [r.status_code for r in answers]
        assert statuses.count(201) == 2 and statuses.count(429) == 8
        refused = next(r for r in answers if r.status_code == 429)
        assert refused.json()["message"] == "Rate limit exceeded" and refused.headers["retry-after"] == "1"
        time.sleep(1.1)
        assert [r.status_code for r in asyncio.run(_burst(team, 2))] == [201, 201]
    finally:
        _kill_all(team)


def test_paused_quota(admin: httpx.Client) -> None:
    team = new_team(admin, "paused", maxPaused=1)
    try:
        with team.client() as client:
            first, second = (client.post("/sandboxes", json={"templateID": "bb"}).json()["sandboxID"] for _ in range(2))
            assert client.post(f"/sandboxes/{first}/pause").status_code == 204
            r = client.post(f"/sandboxes/{second}/pause")
            assert r.status_code == 429 and "paused E2B sandboxes (1)" in r.json()["message"]
            assert int(r.headers["retry-after"]) >= 1
            assert client.get(f"/sandboxes/{second}").json()["state"] == "running"
            assert client.post(f"/sandboxes/{first}/connect", json={}).status_code == 201
            assert client.post(f"/sandboxes/{second}/pause").status_code == 204  # room again
    finally:
        _kill_all(team)


def test_fork_size_and_room(admin: httpx.Client) -> None:
    team = new_team(admin, "forks", maxFork=2, maxRunning=3)
    try:
        with team.client() as client:
            source = client.post("/sandboxes", json={"templateID": "bb"}).json()["sandboxID"]
            too_many = client.post(f"/sandboxes/{source}/fork", json={"count": 3})
            assert too_many.status_code == 429 and "Count cannot be greater than 2" in too_many.json()["message"]
            made = client.post(f"/sandboxes/{source}/fork", json={"count": 2})
            assert made.status_code == 201 and all("sandbox" in item for item in made.json())
            full = client.post(f"/sandboxes/{source}/fork", json={"count": 1})  # 3 running: the quota
            assert full.status_code == 429 and RUNNING_WORDS in full.json()["message"]
            assert len(client.get("/v2/sandboxes").json()) == 3
    finally:
        _kill_all(team)


def test_disk_quota_counts_paused_sandboxes(admin: httpx.Client, teams_node: Server) -> None:
    team = new_team(admin, "disk", maxDiskMB=2 * 2048)  # the node's default disk is 2048 MiB a sandbox
    try:
        with team.client() as client:
            ids = [client.post("/sandboxes", json={"templateID": "bb"}).json()["sandboxID"] for _ in range(2)]
            assert client.post(f"/sandboxes/{ids[0]}/pause").status_code == 204
            r = client.post("/sandboxes", json={"templateID": "bb"})
            assert r.status_code == 429 and "disk quota (4096 MiB" in r.json()["message"]
            assert client.delete(f"/sandboxes/{ids[0]}").status_code == 204
            assert client.post("/sandboxes", json={"templateID": "bb"}).status_code == 201
    finally:
        _kill_all(team)
