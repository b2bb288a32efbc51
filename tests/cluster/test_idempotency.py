"""E2B's `Idempotency-Key` is the create id: a create sent again with the same key gets the first
one's sandbox, on one node and through any gateway of a cluster (the real E2B SDK sends it)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.cluster.cluster import Cluster, running_cluster
from tests.conftest import API_KEY, Server

pytestmark = pytest.mark.sandbox


@pytest.fixture(scope="module")
def cluster(server: Server) -> Iterator[Cluster]:
    with running_cluster() as c:
        yield c


def sdk_create(url: str, key: str | None) -> str:
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=120, idempotency_key=key, api_url=url, sandbox_url=url, api_key=API_KEY)
    return sbx.sandbox_id


def kill_all(url: str, ids: set[str]) -> None:
    with httpx.Client(base_url=url, headers={"X-API-Key": API_KEY}, timeout=60) as api:
        for sid in ids:
            api.delete(f"/sandboxes/{sid}")


def test_a_node_alone_honours_the_sdk_s_idempotency_key(server: Server) -> None:
    key = secrets.token_hex(16)
    made: set[str] = set()
    try:
        first = sdk_create(server.url, key)
        made.add(first)
        assert sdk_create(server.url, key) == first
        other = sdk_create(server.url, secrets.token_hex(16))
        made.add(other)
        assert other != first
    finally:
        kill_all(server.url, made)


def test_the_same_key_through_either_gateway_makes_one_sandbox(cluster: Cluster) -> None:
    urls = [g.url for g in cluster.gateways]
    key = secrets.token_hex(16)
    long_key = "-".join(secrets.token_hex(8) for _ in range(14))  # 237 characters: longer than a create id
    made: set[str] = set()
    try:
        with ThreadPoolExecutor(4) as pool:  # at once, through both gateways
            ids = set(pool.map(lambda i: sdk_create(urls[i % 2], key), range(4)))
        made |= ids
        assert len(ids) == 1, ids
        assert sdk_create(urls[1], key) in ids  # later, through the other gateway
        long_ids = {sdk_create(urls[i], long_key) for i in (0, 1)}
        made |= long_ids
        assert len(long_ids) == 1 and not long_ids & ids
        unkeyed = {sdk_create(urls[0], None) for _ in range(2)}  # without a key, two creates are two
        made |= unkeyed
        assert len(unkeyed) == 2
    finally:
        kill_all(urls[0], made)


@pytest.mark.parametrize("key", ["", "x" * 256, "caf\u00e9", "tab\there"])
def test_a_bad_idempotency_key_is_a_400(cluster: Cluster, server: Server, key: str) -> None:
    for url in (cluster.gateway.url, server.url):
        r = httpx.post(
            f"{url}/sandboxes",
            json={"templateID": "base", "timeout": 30},
            headers=[(b"X-API-Key", API_KEY.encode()), (b"Idempotency-Key", key.encode())],
            timeout=60,
        )
        assert r.status_code == 400 and "Idempotency-Key" in r.json()["message"], (url, r.status_code, r.text)
