"""Signed ``/files`` URLs at a gateway (aenv/api/signed.py): a URL whose sandbox only its signature
names (the SDKs' ``download_url()`` through one E2B_SANDBOX_URL) is looked up with work that does
not grow with what a stranger sends. A gateway hashed the whole URL once per sandbox it knew,
before any authentication: a 60 KiB path with 10,000 sandboxes in its directory took 587 ms a
request, and 4 such clients held /health for seconds.

The gateway runs in-process on a directory of 10,000 sandboxes filled by hand (no etcd: the
entries name a node that is gone, so a found sandbox is answered "not found ... left the
cluster", which names it). The work is counted, not timed: every byte given to SHA-256 (the
signatures, and HMAC's for the tokens) goes through a counting wrapper. Each test failed on the
code before this lookup (the bytes grew with the path times the sandboxes, the search never let
/health in).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from e2b.sandbox.signature import get_signature

from aenv.cluster.entries import ClusterConfig, SandboxEntry, api_key_digest
from aenv.cluster.gateway import Gateway, GatewaySettings
from aenv.cluster.mirror import Mirror
from aenv.cluster.store import ClusterStore
from aenv.node import tokens
from tests.conftest import API_KEY

SECRET = "5e" * 32
NOWHERE = "etcd://127.0.0.1:9"  # never dialled: the directory is filled by hand
SANDBOXES = 10_000
_sha256 = hashlib.sha256


class Hashed:
    """Bytes given to SHA-256 in this process since the last ``reset``."""

    count = 0

    @classmethod
    def reset(cls) -> int:
        count, cls.count = cls.count, 0
        return count


class CountingSha256:
    block_size, digest_size, name = 64, 32, "sha256"

    def __init__(self, data: bytes = b"", **_: Any) -> None:
        self._h = _sha256(data)
        Hashed.count += len(data)

    def update(self, data: bytes) -> None:
        Hashed.count += len(data)
        self._h.update(data)

    def copy(self) -> CountingSha256:
        twin = object.__new__(CountingSha256)
        twin._h = self._h.copy()
        return twin

    def digest(self) -> bytes:
        return self._h.digest()

    def hexdigest(self) -> str:
        return self._h.hexdigest()


@pytest.fixture()
def counted(monkeypatch: pytest.MonkeyPatch) -> type[Hashed]:
    monkeypatch.setattr(hashlib, "sha256", CountingSha256)
    Hashed.reset()
    return Hashed


def sandbox_id(i: int) -> str:
    return f"sbx{i:017d}"


def token(i: int) -> str:
    return tokens.access_token(SECRET.encode(), sandbox_id(i))


@pytest.fixture()
async def gateway() -> AsyncIterator[httpx.AsyncClient]:
    mirror = Mirror(ClusterStore.from_url(NOWHERE))
    for i in range(SANDBOXES):
        mirror.sandboxes[sandbox_id(i)] = SandboxEntry(sandbox_id=sandbox_id(i), node_id="gone", state="running")
    mirror.loaded.set()
    gw = Gateway(GatewaySettings(cluster=NOWHERE, api_key=API_KEY), mirror)
    gw.config = ClusterConfig(secret=SECRET, api_key_digest=api_key_digest(SECRET, API_KEY))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gw), base_url="http://gateway") as client:
        yield client
    await gw.aclose()


def signed(path: str, i: int, *, operation: str = "read", user: str | None = "user") -> dict[str, str]:
    """The query of the URL the E2B SDK makes for sandbox ``i`` (its own signing function)."""
    sig = get_signature(path, operation, user, token(i), 300)  # type: ignore[arg-type]
    query = {"path": path, "signature": sig["signature"], "signature_expiration": str(sig["expiration"])}
    return {**query, "username": user} if user else query


def found(r: httpx.Response, i: int) -> bool:
    """The gateway took the URL for sandbox ``i``'s (and sent it to its node, which is gone)."""
    return r.status_code == 502 and sandbox_id(i) in r.text and "left the cluster" in r.text


async def test_a_path_longer_than_a_path_is_refused_before_anything_is_hashed(
    gateway: httpx.AsyncClient, counted: type[Hashed]
) -> None:
    asked = [
        ("GET", signed("/" + "a" * 60_000, 7)),  # 60 KiB (an encoded URL takes no more)
        ("GET", signed("/home/user/" + "a/" * 8_000, 7)),
        ("POST", signed("/home/user/" + "b" * 4_097, 7, operation="write")),
        ("GET", signed("/x", 7, user="u" * 300)),
    ]
    counted.reset()
    for method, params in asked:
        r = await gateway.request(method, "/files", params=params)
        assert r.status_code == 414, r.text
        assert r.json()["code"] == 414
    assert counted.reset() == 0


async def test_a_signature_of_another_shape_is_tried_against_nothing(
    gateway: httpx.AsyncClient, counted: type[Hashed]
) -> None:
    params = signed("/home/user/f.txt", 3)
    good = params["signature"]
    shapes = ["v1_bogus", good + "=", good[:-1], "v2_" + good[3:], good[:-2] + "!!", "v1_" + "é" * 43, good + "A"]
    counted.reset()
    for shape in shapes:
        r = await gateway.get("/files", params={**params, "signature": shape})
        assert r.status_code == 401, (shape, r.text)  # no sandbox named: the API's own 401
    assert counted.reset() == 0


async def test_an_sdk_url_costs_one_short_hash_a_sandbox_and_then_one_hash(
    gateway: httpx.AsyncClient, counted: type[Hashed]
) -> None:
    path = "/home/user/" + "d" * 200 + "/" + "e" * 3800  # near PATH_MAX
    last = SANDBOXES - 1
    params = signed(path, last)
    wrong = {**params, "signature": signed(path + "x", last)["signature"]}
    upload = signed("/home/user/up.bin", 42, operation="write")
    counted.reset()
    r = await gateway.get("/files", params=params)
    assert found(r, last), r.text
    first = counted.reset()
    # the path once, then a token's worth per sandbox (and each token's HMAC, kept afterwards):
    # the whole URL once per sandbox was 10,000 times the path
    assert first < 2 * len(path) + 400 * SANDBOXES, first
    r = await gateway.get("/files", params=params)
    assert found(r, last), r.text
    assert counted.reset() < 2 * len(path) + 1024  # found before: one hash
    r = await gateway.get("/files", params=wrong)
    assert r.status_code == 401, r.text
    assert counted.reset() < 2 * len(path) + 100 * SANDBOXES  # tokens kept: one short hash each
    r = await gateway.post("/files", params=upload, content=b"x")
    assert found(r, 42), r.text
    r = await gateway.get("/files", params=upload)  # a write's signature does not read
    assert r.status_code == 401, r.text


async def test_a_url_that_names_its_sandbox_is_not_searched_for(
    gateway: httpx.AsyncClient, counted: type[Hashed]
) -> None:
    routed = {"E2b-Sandbox-Id": sandbox_id(5), "E2b-Sandbox-Port": "49983"}
    params = signed("/home/user/f.txt", 5)
    counted.reset()
    r = await gateway.get("/files", params=params, headers=routed)
    assert found(r, 5), r.text
    assert counted.reset() == 0  # the node checks its one signature


async def test_health_is_answered_while_strangers_urls_are_looked_up(gateway: httpx.AsyncClient) -> None:
    """Four anonymous searches over 10,000 sandboxes at once: /health is answered before they
    end (the order is what is checked, not the time)."""
    done: list[str] = []

    wrong = [{**signed(f"/tmp/{n}", 1), "signature": signed("/x", 1)["signature"]} for n in range(4)]

    async def search(n: int) -> None:
        r = await gateway.get("/files", params=wrong[n])
        assert r.status_code == 401
        done.append("search")

    async def health() -> None:
        await asyncio.sleep(0)  # the searches have started
        r = await gateway.get("/health")
        assert r.status_code == 200, r.text
        done.append("health")

    await asyncio.wait_for(asyncio.gather(*(search(n) for n in range(4)), health()), 60)
    assert done.index("health") < 3, done
